"""Point-to-point rules without sockets (zcollective._protocol._p2p), issue 44: the order of
messages put back or received after a failure (promises 1 and 2), a send on its way to a rank
that ended (defect 6), an ending that cut messages off (7), sends held for their link at a
failure (8), the receiver's window (9), and PeerEndedError (14); the FINAL and WELCOME bodies
that carry them, and the coordinator's forwarding."""

import pickle
from collections import deque

import pytest

from zcollective import CollectiveError, PeerEndedError, ReplicaLostError
from zcollective._format import _bodies
from zcollective._format._wire import Kind, Message, decode, encode
from zcollective._protocol._p2p import ANY_SOURCE, ANY_TAG, Mail, Mailbox

WINDOW = 1000
ENDED = "rank 1 ended its program (without teardown) after seq 4 (pid 8 on h)"


def _mail(rank, size=2, window=WINDOW, windows=None):
    return Mail(rank, size, window, session=7, outcomes=deque(), windows=windows)


def _send_msg(source, tag, seq, value):
    return Message(Kind.SEND, 0, source, tag, seq, 7, segments=[[pickle.dumps(value, protocol=5)]])


def _values(mail):
    """What each outcome came to (its value, or its error's type), in order; cleared."""
    out = [(o.future, type(o.error).__name__ if o.error is not None else  # (a receive's frames, unpickled)
            (pickle.loads(o.make().message.segments[0][0]) if o.make else None)) for o in mail.outcomes]
    mail.outcomes.clear()
    return out


# -- promise 1: a receive given up puts its message back first ---------------------------------


def test_a_withdrawn_receive_puts_its_message_back_first_of_its_pair():
    """Two messages from one (source, tag): the first is matched by a receive given up before
    its outcome applied (timed out, interrupted); it goes back first, so the next two receives
    take [first, second] (put back last, they would take [second, first])."""
    mail = _mail(0)
    mail.take(_send_msg(1, 4, 0, "first"))
    mail.take(_send_msg(1, 4, 1, "second"))
    mail.receive(1, 4, "given up")
    assert mail.withdraw("given up") and not mail.outcomes
    mail.receive(1, 4, "next")
    mail.receive(1, 4, "after")
    assert _values(mail) == [("next", "first"), ("after", "second")]


def test_a_withdrawn_receive_of_any_source_puts_its_message_back_before_a_later_one():
    mail = _mail(0, size=3)
    mail.take(_send_msg(2, 1, 0, "from 2"))
    mail.take(_send_msg(1, 1, 0, "from 1"))
    mail.receive(ANY_SOURCE, ANY_TAG, "given up")
    assert mail.withdraw("given up")
    mail.receive(ANY_SOURCE, 1, "next")
    assert _values(mail) == [("next", "from 2")]


# -- promise 2: after a failure, what came before is received earliest first ---------------------


def test_after_a_failure_a_receive_takes_the_earliest_of_two_messages_of_one_tag():
    """Two messages of one tag came before the group failed: receives after it take them in the
    order sent (taking the latest would give [second, first])."""
    mail = _mail(0)
    mail.take(_send_msg(1, 7, 0, "first"))
    mail.take(_send_msg(1, 7, 1, "second"))
    mail.fail(ReplicaLostError("rank 2 was lost"))
    mail.receive(1, 7, "a")
    mail.receive(1, 7, "b")
    mail.receive(1, 7, "c")
    assert _values(mail) == [("a", "first"), ("b", "second"), ("c", "ReplicaLostError")]


def test_after_a_failure_any_source_takes_the_earliest_arrived():
    mail = _mail(0, size=3)
    mail.take(_send_msg(2, 7, 0, "first"))
    mail.take(_send_msg(1, 7, 0, "second"))
    mail.fail(ReplicaLostError("rank 2 was lost"))
    mail.receive(ANY_SOURCE, 7, "a")
    mail.receive(ANY_SOURCE, ANY_TAG, "b")
    assert _values(mail) == [("a", "first"), ("b", "second")]


# -- defect 9: the receiver's window ------------------------------------------------------------


def test_a_sender_keeps_to_each_receivers_window_not_its_own():
    box = Mailbox(0, 3, window=64 * WINDOW, windows=[64 * WINDOW, WINDOW, 0])
    assert box.may_send(1, 5 * WINDOW)  # one message of any size when nothing is held
    box.send(1, 600)
    assert not box.may_send(1, 600) and box.may_send(1, 400)  # rank 1's 1,000, not 64,000
    box.send(2, 600)
    assert box.may_send(2, 600)  # rank 2 said none (an older release): this rank's own


def test_a_mail_asks_for_credit_at_the_receivers_window_and_says_it_in_a_timeout():
    mail = _mail(0, size=2, window=64 * WINDOW, windows=[64 * WINDOW, WINDOW])
    mail.send(1, 0, [bytes(800)], "a")
    mail.send(1, 0, [bytes(800)], "b")
    assert [(m.kind, h) for _, m, h in mail.out] == [(Kind.SEND, "a"), (Kind.ASK, None)]
    assert mail.waiting_for("b") == 1 and mail.box.peers[1].window == WINDOW


def test_a_join_and_a_welcome_carry_the_mailbox_windows():
    join = _bodies.join(1, 2, "3.11", "00" * 16, None, None, 0, "auto", mail="tcp://h:1", mail_window=1 << 20)
    assert _bodies.parse_join(decode(encode(join)))["mail_window"] == 1 << 20
    welcome = _bodies.welcome(2, "n", None, None, None, 0, "ab" * 32, mail=["tcp://h:1", "tcp://h:2"],
                              mail_windows=[0, 1 << 20])
    assert _bodies.parse_welcome(decode(encode(welcome)), 2)["mail_windows"] == [0, 1 << 20]
    bad = _bodies.welcome(2, "n", None, None, None, 0, "ab" * 32, mail=["tcp://h:1", "tcp://h:2"],
                          mail_windows=[1, -1])
    assert _bodies.parse_welcome(decode(encode(bad)), 2)["mail_windows"] is None


# -- defect 14: an ending is no loss ------------------------------------------------------------


def test_a_rank_that_ended_fails_calls_with_peer_ended_error_not_replica_lost_error():
    assert issubclass(PeerEndedError, CollectiveError) and not issubclass(PeerEndedError, ReplicaLostError)
    mail = _mail(0, size=3)
    mail.receive(1, 3, "recv")
    mail.probe(1, ANY_TAG, "probe")
    mail.ended(1, 0, ENDED, received=0)
    mail.send(1, 2, [b"x"], "send")
    mail.receive(ANY_SOURCE, 5, "anyone")
    mail.ended(2, 0, "rank 2 called teardown after seq 4 (pid 9 on h)", received=0)
    errors = {o.future: o.error for o in mail.outcomes}
    assert all(type(e) is PeerEndedError for e in errors.values()) and len(errors) == 4
    assert errors["recv"].ended_ranks == (1,) and errors["anyone"].ended_ranks == (1, 2)
    assert str(errors["send"]) == (f"rank 0: send(dest=1, tag=2) cannot go: {ENDED}: its program receives "
                                   f"nothing more (nothing was sent)")


# -- defect 6: sends on their way to a rank that ended ------------------------------------------


def test_sends_on_their_way_to_a_rank_that_ended_fail_unless_its_program_received_them():
    """Its FINAL says how many of this rank's messages its program received: a send still on
    its way (its tracker not done) is done if it was received, else fails at once naming it;
    the driver is told to drop what still waits for that link, and to stop watching them."""
    mail = _mail(0)
    for name in ("received", "on its way", "held for its link"):
        mail.send(1, 6, [bytes(10)], name)
    assert [h for _, m, h in mail.out] == ["received", "on its way", "held for its link"]
    mail.out.clear()
    mail.ended(1, 0, ENDED, received=1)
    outcomes = {o.future: o.error for o in mail.outcomes}
    assert outcomes["received"] is None
    for name, seq in (("on its way", 1), ("held for its link", 2)):
        assert type(outcomes[name]) is PeerEndedError and str(outcomes[name]) == (
            f"rank 0: send(dest=1, tag=6) cannot complete: {ENDED}, having received 1 of this rank's "
            f"messages, not this one (number {seq} to it): its program receives nothing more")
    (dest, decided), = mail.cut
    assert dest == 1 and decided == ["received", "on its way", "held for its link"]
    assert mail.box.peers[1].held == 0 and not mail.box.peers[1].unreceived


def test_a_send_held_for_its_link_is_taken_back_only_as_the_last_numbered_for_its_rank():
    mail = _mail(0)
    mail.send(1, 0, [bytes(10)], "a")
    mail.send(1, 0, [bytes(20)], "b")
    assert not mail.unsend(1, "a")  # "b" was numbered after it: a's number must stay
    assert mail.unsend(1, "b") and mail.box.peers[1].next_out == 1 and mail.box.peers[1].held == 10
    mail.send(1, 0, [bytes(5)], "c")
    assert mail.out[-1][1].seq == 1  # the pair's numbers stay whole


# -- defect 8: a failure drops the sends held for their link -----------------------------------


def test_a_failure_has_the_driver_drop_every_rank_s_sends_held_for_their_link():
    mail = _mail(0, size=3)
    mail.fail(ReplicaLostError("rank 2 was lost"))
    assert mail.cut == [(0, []), (1, []), (2, [])]
    mail.send(1, 0, [b"x"], "after")  # never numbered, never sent
    assert _values(mail) == [("after", "ReplicaLostError")] and mail.out == []


# -- defect 7: an ending that cut messages off --------------------------------------------------


def test_an_ending_counts_what_was_still_leaving_as_lost_and_fails_those_sends():
    mail = _mail(0, size=3)
    for name in ("gone", "leaving", "behind it", "held"):
        mail.send(1, 0, [bytes(10)], name)
    mail.send(2, 0, [bytes(10)], "to 2")
    mail.take(_send_msg(2, 0, 0, "taken"))
    mail.receive(2, 0, "r")
    mail.outcomes.clear()
    sent, lost, received = mail.final(unsent={1: ["held"]}, leaving={1: 1})
    assert (sent, lost, received) == ([0, 1, 1], [0, 3, 0], [0, 0, 1])
    failed = {o.future: str(o.error) for o in mail.outcomes}
    assert set(failed) == {"held", "leaving", "behind it"}
    assert failed["leaving"].startswith("rank 0: send(dest=1, tag=0) was still leaving, rank 1 not taking "
                                        "it in (stopped?), when this rank's program ended")


def test_a_receiver_told_messages_were_lost_fails_at_once_naming_them_and_drops_them_if_they_come():
    mail = _mail(0)
    mail.take(_send_msg(1, 0, 0, "came"))
    mail.receive(1, 3, "waits")
    mail.ended(1, 1, ENDED, received=0, lost=2)
    (future, error), = [(o.future, o.error) for o in mail.outcomes]
    assert future == "waits" and type(error) is PeerEndedError and str(error) == (
        f"rank 0: recv(source=1, tag=3) cannot complete: {ENDED}, after sending this rank 1 message(s), "
        f"all taken in; 2 more it meant for this rank never left it (from number 1 on: it ended with them "
        f"waiting for credit, its link, or this rank to take them in): lost; none here matches")
    mail.outcomes.clear()
    mail.take(_send_msg(1, 3, 1, "cut off, yet came"))  # counted lost: never received
    assert mail.dropped == 1 and mail.gap is None
    mail.receive(1, ANY_TAG, "first")
    mail.receive(1, ANY_TAG, "then")
    assert _values(mail) == [("first", "came"), ("then", "PeerEndedError")]


# -- the FINAL's counts, through the coordinator ------------------------------------------------


def test_a_final_carries_what_was_received_and_lost_and_its_calls():
    msg = decode(encode(_bodies.final([1, 0, 3], False, [0, 2, 5], [0, 0, 2], 5, rank=1, session=3)))
    assert _bodies.parse_final(msg, 3) == {"sent": [1, 0, 3], "teardown": False, "received": [0, 2, 5],
                                          "lost": [0, 0, 2], "calls": 5, "posted": [None] * 3}
    old = decode(encode(_bodies.final([1, 0, 3], True, rank=1, session=3)))  # an older release's
    assert _bodies.parse_final(old, 3) == {"sent": [1, 0, 3], "teardown": True, "received": None,
                                          "lost": [0, 0, 0], "calls": None, "posted": [None] * 3}
    told = decode(encode(_bodies.ended("rank 1 ...", 5, 2, rank=2, root=1, seq=3, session=3)))
    assert _bodies.ended_counts(told) == (5, 2)
    older = decode(encode(_bodies.ended("rank 1 ...", rank=2, root=1, seq=3)))
    assert _bodies.ended_counts(older) == (None, 0)


def test_the_coordinator_forwards_to_each_rank_its_counts_and_the_last_seq():
    from test_coordinator import SESSION, feed, joined, peer

    coord = joined(3)
    out = feed(coord, peer(1), _bodies.final([4, 0, 2], False, [1, 0, 6], [0, 0, 3], 5, rank=1,
                                              session=SESSION))
    told = {p: (m.seq, _bodies.parse_ended(m), _bodies.ended_counts(m)) for p, m in out}
    who = "rank 1 ended its program (without teardown) after seq 4 (pid 101 on h)"
    assert told == {peer(0): (4, who, (1, 0)), peer(2): (2, who, (6, 3))}
    out = feed(coord, peer(2), _bodies.final([0, 0, 0], True, [0, 0, 0], [0, 0, 0], 0,
                                              [[3, -1], None, []], rank=2, session=SESSION))
    assert _bodies.parse_ended(out[0][1]).startswith(
        "rank 2 called teardown with no collective call before")
    assert [_bodies.ended_posted(m) for _, m in out] == [[3, -1], None]


@pytest.mark.parametrize("received", [None, 0])
def test_a_rank_told_of_its_own_end_or_of_one_twice_changes_nothing(received):
    mail = _mail(0)
    mail.ended(0, 0, ENDED, received=received)
    mail.ended(1, 0, ENDED, received=received)
    mail.ended(1, 5, ENDED, received=received)
    assert mail.box.peers[1].last == 0 and mail.cut == [(1, [])]
