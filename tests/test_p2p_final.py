"""An ending rank's FINAL says exactly which of each sender's messages its program received, and the
sender decides per message (zcollective._protocol._p2p_endings): a pair's messages received out of order
(rank 1 sends tag A then tag B; rank 0 receives B, then ends without receiving A) leave A unreceived,
so an ssend of A raises PeerEndedError and a send of A still on its way fails. Rules without sockets,
through the FINAL's wire form and the coordinator's forwarding."""

import pickle
from collections import deque

import pytest

from zcollective import PeerEndedError
from zcollective._format import _bodies
from zcollective._format._wire import Kind, Message, decode, encode
from zcollective._protocol._p2p import SYNC, Mail
from zcollective._protocol._p2p_matching import ack_of, count_received, was_received

WINDOW = 1 << 20
HOW = "rank 0 ended its program (without teardown) (pid 7 on h)"


def _mail(rank, size=2):
    return Mail(rank, size, WINDOW, session=7, outcomes=deque())


def _send_msg(source, tag, seq, sync=False):
    return Message(Kind.SEND, SYNC if sync else 0, source, tag, seq, 7,
                   segments=[[pickle.dumps(seq, protocol=5)]])


def _through_the_wire(final, to_rank, size=2):
    """What ``to_rank`` is told of a FINAL (Mail.final's three lists): as the coordinator forwards it."""
    sent, lost, received = final
    parsed = _bodies.parse_final(decode(encode(_bodies.final(sent, False, received, lost, 0, rank=0,
                                                             session=3))), size)
    told = decode(encode(_bodies.ended(HOW, parsed["received"][to_rank], parsed["lost"][to_rank],
                                       rank=to_rank, root=0, seq=parsed["sent"][to_rank], session=3)))
    return told.seq, *_bodies.ended_counts(told)


def _outcomes(mail):
    out = {o.future: o.error for o in mail.outcomes}
    mail.outcomes.clear()
    return out


def test_a_final_says_which_messages_were_received_out_of_order():
    receiver = _mail(0)
    for seq, tag in enumerate((1, 2, 2, 1, 2)):  # A, B, B, A, B
        receiver.take(_send_msg(1, tag, seq))
    receiver.receive(1, 2, "B0")
    receiver.receive(1, 2, "B1")
    assert receiver.final()[2] == [0, [0, 1, 3]]  # numbers 1 and 2: not 0
    receiver.receive(1, 1, "A0")
    assert receiver.final()[2] == [0, 3]  # every one below 3
    receiver.receive(1, 2, "B2")
    assert receiver.final()[2] == [0, [3, 4, 5]]


def test_an_ssend_not_received_fails_when_a_later_one_of_another_tag_was():
    sender, receiver = _mail(1), _mail(0)
    sender.send(0, 1, [b"A"], "ssend A", "sent A")
    sender.send(0, 2, [b"B"], "ssend B", "sent B")
    for _, msg, _ in sender.out:
        receiver.take(msg)
    sender.out.clear()
    receiver.receive(1, 2, "recv B")  # B taken, A never: its program ends
    for to, msg, _ in receiver.out:  # B's acknowledgement
        assert to == 1
        sender.take(msg)
    assert _outcomes(sender) == {"ssend B": None}
    seq, received, lost = _through_the_wire(receiver.final(), 1)
    sender.ended(0, seq, HOW, False, received, lost)
    (future, error), = _outcomes(sender).items()
    assert future == "ssend A" and type(error) is PeerEndedError
    assert "having received 1 of this rank's messages, not this one (number 0 to it)" in str(error)


def test_a_send_on_its_way_is_decided_per_message():
    sender = _mail(1)
    for name, tag in (("A", 1), ("B", 2), ("C", 1)):
        sender.send(0, tag, [bytes(8)], name)  # sent, libzmq still reading their buffers: not done
    sender.out.clear()
    sender.ended(0, 0, HOW, False, [0, 1, 2])  # it received B only
    done = _outcomes(sender)
    assert done["B"] is None and type(done["A"]) is PeerEndedError and type(done["C"]) is PeerEndedError


def test_an_ssend_received_in_order_is_done_at_the_receivers_end():
    sender = _mail(1)
    sender.send(0, 1, [b"A"], "ssend A", "sent A")
    sender.send(0, 1, [b"B"], "ssend B", "sent B")
    sender.ended(0, 2, HOW, False, 1)  # an int: every number below it (an older release's form too)
    done = _outcomes(sender)
    assert done["ssend A"] is None and type(done["ssend B"]) is PeerEndedError


def test_a_message_dropped_by_teardown_or_given_back_is_not_counted_received():
    receiver = _mail(0)
    receiver.take(_send_msg(1, 1, 0))
    receiver.take(_send_msg(1, 2, 1))
    receiver.receive(1, 2, "B")
    (outcome,) = receiver.outcomes
    outcome.undo()  # its call was given up before the value was made: B goes back
    assert receiver.final()[2] == [0, 0]
    receiver.closing()  # teardown drops both, unreceived
    assert receiver.final()[2] == [0, 0]


def test_the_coordinator_forwards_the_ranges_to_the_sender():
    from test_coordinator import SESSION, feed, joined, peer

    coord = joined(3)
    out = feed(coord, peer(1), _bodies.final([0, 0, 0], False, [[0, 2, 4], 0, [5, 7, 8, 9, 12]],
                                              [0, 0, 0], 1, rank=1, session=SESSION))
    told = {p: _bodies.ended_counts(m) for p, m in out}
    assert told == {peer(0): ([0, 2, 4], 0), peer(2): ([5, 7, 8, 9, 12], 0)}


@pytest.mark.parametrize("bad", [[3, 2, 5], [0, 4, 4], [0, 2, 5, 5, 6], [0, 2], [-1], [0, 2, 3.0], "3"])
def test_a_malformed_received_is_unsaid(bad):
    msg = decode(encode(_bodies.control(Kind.FINAL, {"sent": [0, 0], "how": "exit", "received": [0, bad]},
                                        rank=1, session=3)))
    assert _bodies.parse_final(msg, 2)["received"] is None
    told = decode(encode(_bodies.ended(HOW, bad, rank=0, root=1, seq=0, session=3)))
    assert _bodies.ended_counts(told) == (None, 0)


def test_too_many_ranges_are_cut_to_fewer_received_never_more():
    holes = [0] + [n for k in range(2, 4 * _bodies.MAX_RECEIVED_RANGES, 4) for n in (k, k + 1)]
    said = _bodies.parse_final(decode(encode(_bodies.final([0, 0], False, [0, holes], rank=1, session=3))),
                               2)["received"][1]
    assert len(said) == 1 + 2 * _bodies.MAX_RECEIVED_RANGES and said == holes[:len(said)]
    assert all(was_received(holes, seq) for seq in range(4 * _bodies.MAX_RECEIVED_RANGES)
               if was_received(said, seq))
    assert count_received(said) == _bodies.MAX_RECEIVED_RANGES


def test_an_acknowledgement_and_the_final_agree():
    receiver = _mail(0)
    receiver.take(_send_msg(1, 1, 0, sync=True))
    receiver.take(_send_msg(1, 2, 1, sync=True))
    receiver.receive(1, 2, "B")
    assert [m.root for _, m, _ in receiver.out] == [ack_of(1)]
    received = receiver.final()[2][1]
    assert not was_received(received, 0) and was_received(received, 1)


def test_what_a_mailbox_says_it_received_is_exactly_what_its_program_received():
    """Many messages of a few tags, received in random tag order, some given back: the ranges match a
    set of what was received, and hold as many numbers as there are holes."""
    import random

    from zcollective._protocol._p2p_matching import Mailbox, Receive

    rng = random.Random(46)
    for _ in range(200):
        box, n = Mailbox(0, 2, WINDOW), rng.randrange(1, 40)
        for seq in range(n):
            box.arrive(1, rng.randrange(3), seq, 1, None)
        model = set()
        for _ in range(rng.randrange(1, 2 * n)):
            came, _ = box.post(Receive(1, rng.randrange(3), "r"))
            if came is None:
                box.posted.clear()
                continue
            model.add(came.seq)
            if rng.random() < 0.2:
                box.untake(came)
                model.discard(came.seq)
        said = box.received(1)
        assert [seq for seq in range(n) if was_received(said, seq)] == sorted(model), said
        assert count_received(said) == len(model)
        assert all(a < b for a, b in zip(said, said[1:], strict=False)) or len(said) == 1, said
        assert len(said) - 1 <= 2 * (n - len(model)), said  # a range per hole at most
