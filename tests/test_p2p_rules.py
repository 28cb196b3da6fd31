"""Point-to-point rules without sockets (zcollective._protocol._p2p): MPI's matching, the
order of each pair's messages, the window a sender may fill at a receiver and the credit that
frees it."""

from collections import deque

import pytest

from zcollective._format._wire import Kind, Message
from zcollective._protocol._p2p import (
    ANY_SOURCE,
    ANY_TAG,
    MAX_TAG,
    Credit,
    Mail,
    Mailbox,
    OutOfOrder,
    Receive,
    Status,
    check_rank,
    check_tag,
)

WINDOW = 1000


def test_an_arriving_message_completes_the_earliest_posted_receive_it_matches():
    box = Mailbox(0, 3, WINDOW)
    tag5, anyone, from2 = Receive(ANY_SOURCE, 5, "a"), Receive(ANY_SOURCE, ANY_TAG, "b"), Receive(2, 7, "c")
    for r in (tag5, anyone, from2):
        assert box.post(r) == (None, [])
    done, _ = box.arrive(2, 7, 0, 10, "m0")
    assert done[0] is anyone and done[1].message == "m0"  # posted before from2, and it matches
    done, _ = box.arrive(1, 5, 0, 10, "m1")
    assert done[0] is tag5
    done, _ = box.arrive(2, 7, 1, 10, "m2")
    assert done[0] is from2 and box.posted == []


def test_a_receive_takes_the_earliest_arrived_match_and_each_pair_keeps_its_order():
    box = Mailbox(0, 3, WINDOW)
    box.arrive(1, 3, 0, 1, "1:3:a")
    box.arrive(2, 3, 0, 1, "2:3:a")
    box.arrive(1, 4, 1, 1, "1:4")
    box.arrive(1, 3, 2, 1, "1:3:b")
    assert box.probe(ANY_SOURCE, 4) == Status(1, 4, 1)
    assert box.probe(2, 4) is None
    taken = [box.post(Receive(s, t, None))[0].message for s, t in
             [(1, ANY_TAG), (ANY_SOURCE, 3), (1, 3), (ANY_SOURCE, ANY_TAG)]]
    assert taken == ["1:3:a", "2:3:a", "1:3:b", "1:4"]  # non-overtaking within (source, tag)
    assert box.probe(ANY_SOURCE, ANY_TAG) is None


def test_a_message_out_of_its_pairs_order_is_refused():
    box = Mailbox(0, 2, WINDOW)
    box.arrive(1, 0, 0, 1, "first")
    with pytest.raises(OutOfOrder, match="message 0 from rank 1, where 1 was next"):
        box.arrive(1, 0, 0, 1, "replayed")
    with pytest.raises(OutOfOrder):
        box.arrive(1, 0, 5, 1, "skipped ahead")
    assert len(box.arrived) == 1


def test_a_sender_fills_its_window_then_waits_for_credit():
    sender, receiver = Mailbox(0, 2, WINDOW), Mailbox(1, 2, WINDOW)
    assert sender.may_send(1, 5 * WINDOW)  # one message of any size when nothing is held
    seqs = [sender.send(1, 400), sender.send(1, 400)]
    assert seqs == [0, 1] and not sender.may_send(1, 400) and sender.may_send(1, 200)
    assert sender.ask(1) and not sender.ask(1)  # asks once
    for seq in seqs:
        receiver.arrive(0, 0, seq, 400, seq)
    assert receiver.asked(0) == []  # nothing received by the program yet: owed at the next take
    came, credit = receiver.post(Receive(0, ANY_TAG, None))
    assert came.seq == 0 and credit == [Credit(0, 0)]  # owed: at once
    sender.credited(1, 0)
    assert sender.may_send(1, 600) and not sender.may_send(1, 601) and sender.ask(1)
    came, credit = receiver.post(Receive(0, ANY_TAG, None))
    assert came.seq == 1 and credit == [Credit(0, 1)]  # 400 bytes: over a quarter of the window


def test_credit_is_sent_once_a_quarter_of_the_window_was_received():
    receiver = Mailbox(1, 2, WINDOW)
    for seq in range(5):
        receiver.arrive(0, 0, seq, 100, seq)
    credits = [receiver.post(Receive(0, 0, None))[1] for _ in range(5)]
    assert credits == [[], [], [Credit(0, 2)], [], []]  # 300 bytes >= 250


def test_messages_to_oneself_are_credited_without_travelling():
    box = Mailbox(0, 1, WINDOW)
    seq = box.send(0, 900)
    assert not box.may_send(0, 200)
    assert box.arrive(0, 1, seq, 900, "me") == (None, [])
    came, credit = box.post(Receive(0, 1, None))
    assert came.message == "me" and credit == [] and box.may_send(0, WINDOW)


def test_a_withdrawn_receive_takes_nothing():
    box = Mailbox(0, 2, WINDOW)
    r = Receive(1, 0, None)
    box.post(r)
    assert box.withdraw(r) and not box.withdraw(r)
    assert box.arrive(1, 0, 0, 1, "m") == (None, [])
    assert box.held_from(1) == 1


def test_tags_and_ranks_are_checked():
    assert check_tag(0, False) == 0 and check_tag(MAX_TAG, False) == MAX_TAG
    assert check_tag(ANY_TAG, True) == ANY_TAG
    for bad in (-1, MAX_TAG + 1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="is not an int from 0 to"):
            check_tag(bad, False)
    assert check_rank(ANY_SOURCE, 4, "source", any_source=True) == ANY_SOURCE
    with pytest.raises(ValueError, match="dest=4 is not a rank of this group of 4 replicas"):
        check_rank(4, 4, "dest")
    with pytest.raises(ValueError):
        check_rank(ANY_SOURCE, 4, "dest")


# -- Mail: the messages the rules send, and what calls came to ----------------------------------


def _mail(rank, size=2, window=WINDOW):
    return Mail(rank, size, window, session=7, outcomes=deque())


def _send_msg(source, tag, seq, payload=b"\x80\x05K\x01.", session=7):
    return Message(Kind.SEND, 0, source, tag, seq, session, segments=[[payload]])


def test_a_send_short_of_credit_waits_asks_once_and_goes_when_credited():
    mail = _mail(0)
    big = [bytes(600)]
    mail.send(1, 0, big, "first")
    mail.send(1, 0, big, "second")  # 1,200 bytes > the window: waits, unsent
    kinds = [(to, m.kind, h) for to, m, h in mail.out]
    assert kinds == [(1, Kind.SEND, "first"), (1, Kind.ASK, None)]
    mail.out.clear()
    mail.send(1, 0, [b"x"], "third")  # behind the waiting one, in order, and no second ASK
    assert mail.out == []
    mail.take(Message(Kind.CREDIT, 0, 1, 0, 0, 7))  # rank 1 received message 0
    assert [(m.kind, m.seq, h) for _, m, h in mail.out] == [(Kind.SEND, 1, "second"), (Kind.SEND, 2, "third")]


def test_a_receiver_asked_for_credit_sends_it_once_its_program_receives():
    mail = _mail(1)
    mail.take(_send_msg(0, 0, 0))
    mail.take(Message(Kind.ASK, 0, 0, 0, 0, 7))
    assert mail.out == []  # nothing received yet
    mail.receive(0, 0, "r")
    assert [(to, m.kind, m.seq) for to, m, _ in mail.out] == [(0, Kind.CREDIT, 0)]
    assert mail.outcomes[0].future == "r" and mail.outcomes[0].make().seq == 0  # (its frames, undecoded)


def test_messages_of_another_group_or_out_of_order_are_dropped():
    mail = _mail(1)
    mail.take(_send_msg(0, 0, 0, session=8))  # an earlier group's, on a reused port
    mail.take(_send_msg(0, 0, 1))  # skips message 0
    assert not mail.box.arrived and mail.dropped == 1


def test_after_a_failure_what_came_is_still_received_and_the_rest_fails():
    mail = _mail(1)
    mail.take(_send_msg(0, 3, 0))
    mail.receive(0, 9, "waiting")
    mail.fail(RuntimeError("rank 0 was lost"))
    assert [(o.future, type(o.error)) for o in mail.outcomes] == [("waiting", RuntimeError)]
    mail.outcomes.clear()
    mail.take(_send_msg(0, 4, 1))  # came after the failure was heard: still received
    mail.receive(0, 3, "came before")
    mail.receive(0, 4, "came after")
    mail.receive(0, 5, "never came")
    assert [(o.future, o.error is None) for o in mail.outcomes] == [
        ("came before", True), ("came after", True), ("never came", False)]


def test_a_receive_given_up_before_its_outcome_applies_puts_its_message_back():
    mail = _mail(1)
    mail.take(_send_msg(0, 0, 0))
    mail.receive(0, 0, "given up")
    assert mail.withdraw("given up") and not mail.outcomes
    mail.receive(0, 0, "next")
    assert mail.outcomes[0].future == "next" and mail.outcomes[0].status.source == 0


def test_a_send_to_oneself_that_waited_for_the_window_goes_once_the_first_is_received():
    """Found by an attack: receiving the message that filled the window credited it, but nothing
    sent the one waiting, so the second receive timed out."""
    mail = _mail(0, size=1)
    mail.send(0, 1, [bytes(1500)], "first")  # over the window, allowed: nothing held
    mail.send(0, 1, [bytes(10)], "second")  # waits
    assert [o.future for o in mail.outcomes] == ["first"]
    mail.receive(0, 1, "r1")
    mail.receive(0, 1, "r2")
    assert [o.future for o in mail.outcomes] == ["first", "r1", "second", "r2"]


# -- ends: a rank that sends no more (FINAL, through the coordinator) ---------------------------

ENDED = "rank 0 called teardown (pid 7 on h)"


def _failed(mail):
    """(future, error text) of each outcome that is an error; the outcomes cleared."""
    out = [(o.future, str(o.error)) for o in mail.outcomes if o.error is not None]
    mail.outcomes.clear()
    return out


def test_a_receive_from_a_rank_that_ended_fails_only_once_all_it_sent_was_taken_in():
    mail = _mail(1, size=3)
    mail.take(_send_msg(0, 3, 0))
    mail.receive(0, 5, "pending")  # tag 5 never comes
    mail.ended(0, 2, ENDED)  # it sent two: the second is still on its way
    assert _failed(mail) == [] and mail.box.posted
    mail.take(_send_msg(0, 4, 1))  # the last one: no match for the pending receive
    assert _failed(mail) == [("pending", "rank 1: recv(source=0, tag=5) cannot complete: rank 0 called "
                              "teardown (pid 7 on h), after sending this rank 2 message(s), all taken "
                              "in; none here matches")]
    mail.receive(0, 3, "sent before")
    mail.receive(0, 4, "sent last")
    mail.receive(0, ANY_TAG, "after")
    mail.probe(0, ANY_TAG, "probe after")
    assert [(o.future, o.error is None) for o in mail.outcomes] == [
        ("sent before", True), ("sent last", True), ("after", False), ("probe after", False)]


def test_a_pending_receive_whose_message_came_before_the_end_is_not_failed():
    mail = _mail(1)
    mail.receive(0, 1, "r")
    mail.take(_send_msg(0, 1, 0))
    mail.ended(0, 1, ENDED)
    assert [(o.future, o.error) for o in mail.outcomes] == [("r", None)]


def test_any_source_fails_only_when_no_other_rank_can_send():
    mail = _mail(1, size=3)
    mail.receive(ANY_SOURCE, ANY_TAG, "anyone")
    mail.receive(ANY_SOURCE, 9, "tag 9")
    mail.ended(0, 0, ENDED)
    assert _failed(mail) == []  # rank 2 still runs
    mail.take(_send_msg(2, 4, 0))
    assert [o.future for o in mail.outcomes] == ["anyone"]
    mail.outcomes.clear()
    mail.ended(2, 1, "rank 2 ended its program (without teardown) (pid 8 on h)")
    (future, text), = _failed(mail)
    assert future == "tag 9" and text.startswith(
        "rank 1: recv(source=ANY_SOURCE, tag=9) cannot complete: no other rank can send any more "
        "(rank 0 called teardown (pid 7 on h); rank 2 ended its program")


def test_a_send_to_a_rank_that_ended_fails_and_so_does_one_waiting_for_its_credit():
    mail = _mail(0)
    mail.send(1, 0, [bytes(WINDOW)], "fills the window")  # handed to the driver: done once sent
    mail.send(1, 0, [b"x"], "waits for credit")
    mail.ended(1, 0, "rank 1 called teardown (pid 8 on h)")
    mail.send(1, 2, [b"y"], "after")
    assert _failed(mail) == [
        ("waits for credit", "rank 0: send(dest=1, tag=0) cannot go: rank 1 called teardown (pid 8 on h): "
                             "its program receives nothing more (nothing was sent)"),
        ("after", "rank 0: send(dest=1, tag=2) cannot go: rank 1 called teardown (pid 8 on h): its "
                  "program receives nothing more (nothing was sent)")]
    assert [h for _, m, h in mail.out if m.kind is Kind.SEND] == ["fills the window"]


def test_a_rank_that_stops_sending_counts_what_it_sent_and_fails_what_waits_for_credit():
    mail = _mail(0, size=3)
    mail.send(1, 0, [bytes(WINDOW)], "a")
    mail.send(1, 0, [b"x"], "waiting")
    mail.send(2, 0, [b"y"], "b")
    assert mail.final()[0] == [0, 1, 1]
    (future, text), = _failed(mail)
    assert future == "waiting" and "waited for rank 1's window when this rank stopped sending" in text


def test_a_rank_told_of_its_own_end_ignores_it_and_its_sends_to_itself_go_on():
    mail = _mail(0)
    mail.ended(0, 0, ENDED)
    mail.send(0, 1, [b"\x80\x05K\x01."], "to itself")
    mail.receive(0, 1, "from itself")
    assert [(o.future, o.error) for o in mail.outcomes] == [("to itself", None), ("from itself", None)]
