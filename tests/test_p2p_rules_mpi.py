"""Point-to-point rules without sockets for issue 46's mpi4py features (zcollective._protocol._p2p):
a synchronous send done only once its receiver's program took the message (acknowledged by the
CREDIT's root), a matched probe that takes a message out of matching, a posted receive cancelled
before it matched, and PROC_NULL in the rank checks."""

from collections import deque

import pytest

from zcollective._format._wire import Kind, Message
from zcollective._protocol._p2p import (
    ANY_SOURCE,
    ANY_TAG,
    PROC_NULL,
    SYNC,
    Mail,
    Mailbox,
    Receive,
    check_rank,
)
from zcollective._protocol._p2p_matching import ack_of

WINDOW = 1000
ENDED = "rank 1 called teardown (pid 7 on h)"


def _mail(rank, size=2, window=WINDOW):
    return Mail(rank, size, window, session=7, outcomes=deque())


def _send_msg(source, tag, seq, sync=False):
    return Message(Kind.SEND, SYNC if sync else 0, source, tag, seq, 7, segments=[[b"\x80\x05K\x01."]])


def _done(mail):
    return [(o.future, o.error is None) for o in mail.outcomes]


def test_a_synchronous_send_is_done_once_acknowledged_not_once_sent():
    sender = _mail(0)
    sender.send(1, 4, [b"x"], "ssend", "its message")
    [(to, msg, handle)] = sender.out
    assert (to, msg.kind, msg.op, handle) == (1, Kind.SEND, SYNC, "its message")  # the driver's handle
    assert not sender.outcomes  # sent is not done
    sender.take(Message(Kind.CREDIT, 0, 1, 0, 0, 7))  # a window credit without acknowledgement
    assert not sender.outcomes
    sender.take(Message(Kind.CREDIT, 0, 1, ack_of(0), 0, 7))
    assert _done(sender) == [("ssend", True)] and not sender.syncing


def test_a_receiver_acknowledges_a_synchronous_message_at_once_when_its_program_takes_it():
    receiver = _mail(1)
    receiver.take(_send_msg(0, 4, 0, sync=True))
    receiver.take(_send_msg(0, 4, 1))
    assert receiver.out == []  # arrived, not yet received: nothing said
    receiver.receive(0, 4, "r")
    assert [(m.kind, m.root, m.seq) for _, m, _ in receiver.out] == [(Kind.CREDIT, ack_of(0), 0)]
    receiver.out.clear()
    receiver.receive(0, 4, "r2")  # a plain one: credited later, as before (a quarter of the window)
    assert receiver.out == []


def test_a_plain_message_never_acknowledges():
    box = Mailbox(1, 2, WINDOW)
    box.arrive(0, 0, 0, 10, "m", False)
    came, credits = box.post(Receive(0, 0, None))
    assert credits == [] and not came.sync


def test_a_synchronous_send_to_oneself_is_done_when_received_in_any_order():
    mail = _mail(0, size=1)
    for tag in (1, 2, 3):
        mail.send(0, tag, [b"x"], f"ssend {tag}", f"its message {tag}")
    assert not mail.outcomes and mail.out == []  # nothing travels, nothing done
    mail.receive(0, 3, "r3")
    mail.receive(0, 1, "r1")
    assert _done(mail) == [("r3", True), ("ssend 3", True), ("r1", True), ("ssend 1", True)]


def test_a_synchronous_send_to_a_rank_that_ended_is_done_if_received_else_peer_ended():
    sender = _mail(0, size=3)
    sender.send(1, 0, [b"x"], "received", "m0")
    sender.send(1, 0, [b"x"], "never", "m1")
    sender.send(2, 0, [b"x"], "to 2", "m2")
    sender.ended(1, 0, ENDED, received=1)
    assert [(o.future, type(o.error).__name__) for o in sender.outcomes] == [
        ("received", "NoneType"), ("never", "PeerEndedError")]
    assert "ssend(dest=1, tag=0) cannot complete" in str(sender.outcomes[1].error)
    assert list(sender.syncing) == [(2, ack_of(0))]  # rank 2's still waits


def test_a_synchronous_send_credited_by_a_later_message_is_still_decided_when_its_receiver_ends():
    """A window credit through a later message (received first, another tag) leaves no record of
    it among the sends on their way: it is decided from what is awaited."""
    sender = _mail(0)
    sender.send(1, 0, [b"x"], "ssend", "m0")
    sender.send(1, 1, [b"x"], "send")
    sender.take(Message(Kind.CREDIT, 0, 1, 0, 1, 7))  # message 1 received, not acknowledging 0
    assert not sender.box.peers[1].unreceived
    sender.ended(1, 0, ENDED, received=2)
    assert [(o.future, o.error is None) for o in sender.outcomes if o.future == "ssend"] == [("ssend", True)]
    sender = _mail(0)
    sender.send(1, 0, [b"x"], "ssend", "m0")
    sender.take(Message(Kind.CREDIT, 0, 1, 0, 0, 7))
    sender.ended(1, 0, ENDED, received=0)
    assert [type(o.error).__name__ for o in sender.outcomes] == ["PeerEndedError"]
    assert "ssend(dest=1, tag=0) cannot complete" in str(sender.outcomes[0].error)


def test_a_synchronous_send_taken_back_or_failed_is_no_longer_awaited():
    sender = _mail(0)
    sender.send(1, 0, [b"x"], "timed out", "m0")
    sender.send(1, 0, [b"x"], "failed", "m1")
    assert sender.withdraw("timed out") and len(sender.syncing) == 1
    sender.take(Message(Kind.CREDIT, 0, 1, ack_of(0), 0, 7))  # its acknowledgement, late: ignored
    assert not sender.outcomes
    sender.fail(RuntimeError("lost"))
    assert [(o.future, type(o.error)) for o in sender.outcomes] == [("failed", RuntimeError)]
    assert not sender.syncing


def test_a_matched_probe_takes_the_message_out_of_matching():
    mail = _mail(1)
    mail.take(_send_msg(0, 5, 0, sync=True))
    mail.take(_send_msg(0, 5, 1))
    mail.receive(0, 5, "matched", True)
    [outcome] = mail.outcomes
    came = outcome.make()
    assert (came.source, came.tag, came.seq) == (0, 5, 0)  # the message itself, not its value
    assert [(m.kind, m.root) for _, m, _ in mail.out] == [(Kind.CREDIT, ack_of(0))]  # counts as received
    assert mail.box.probe(0, 5).source == 0  # the second one: the first is no longer here
    second = mail.improbe(ANY_SOURCE, ANY_TAG)
    assert second.seq == 1 and mail.improbe(ANY_SOURCE, ANY_TAG) is None


def test_a_posted_matched_probe_takes_the_next_arrival_before_a_later_receive():
    mail = _mail(1)
    mail.receive(0, ANY_TAG, "matched", True)
    mail.receive(0, ANY_TAG, "recv")
    mail.take(_send_msg(0, 1, 0))
    assert [o.future for o in mail.outcomes] == ["matched"] and mail.outcomes[0].make().seq == 0
    mail.take(_send_msg(0, 2, 1))
    assert [o.future for o in mail.outcomes] == ["matched", "recv"] and mail.outcomes[1].make().seq == 1


def test_a_cancelled_receive_loses_no_message():
    box = Mailbox(1, 2, WINDOW)
    first, second = Receive(0, 3, "first"), Receive(0, 3, "second")
    box.post(first)
    box.post(second)
    assert box.cancel("first") and not box.cancel("first")  # once
    done, _ = box.arrive(0, 3, 0, 10, "m")
    assert done[0] is second and not box.cancel("second")  # matched: not cancellable
    assert not box.cancel("never posted")


def test_proc_null_is_a_rank_only_where_allowed():
    assert check_rank(PROC_NULL, 4, "dest", proc_null=True) == PROC_NULL
    with pytest.raises(ValueError, match="or PROC_NULL"):
        check_rank(-3, 4, "dest", proc_null=True)
    with pytest.raises(ValueError):
        check_rank(PROC_NULL, 4, "dest")


def test_a_matched_probe_no_message_can_answer_fails_naming_itself():
    mail = _mail(1)
    mail.receive(0, 5, "matched", True)
    mail.ended(0, 0, "rank 0 ended its program (without teardown)", received=0)
    [outcome] = mail.outcomes
    assert type(outcome.error).__name__ == "PeerEndedError"
    assert str(outcome.error).startswith("rank 1: mprobe(source=0, tag=5) cannot complete: rank 0 ended")


def test_a_synchronous_message_a_teardown_drops_unreceived_fails_its_send():
    """Teardown drops what no receive takes (a plain send is done once sent); an ssend is told
    its message was never received: PeerEndedError, not done."""
    receiver = _mail(1)
    receiver.take(_send_msg(0, 4, 0, sync=True))
    receiver.closing()
    [(_, credit, _)] = receiver.out
    assert (credit.kind, credit.root) == (Kind.CREDIT, -ack_of(0))
    sender = _mail(0)
    sender.send(1, 4, [b"x"], "ssend", "m0")
    sender.take(credit.__class__(Kind.CREDIT, 0, 1, credit.root, credit.seq, 7))
    [outcome] = sender.outcomes
    assert type(outcome.error).__name__ == "PeerEndedError" and outcome.error.ended_ranks == (1,)
    assert str(outcome.error).startswith("rank 0: ssend(dest=1, tag=4) cannot complete: rank 1 called "
                                         "teardown")
    mail = _mail(0, size=1)  # to itself, unreceived at its own teardown
    mail.send(0, 2, [b"x"], "to itself", "m")
    mail.closing()
    assert [type(o.error).__name__ for o in mail.outcomes] == ["PeerEndedError"]
