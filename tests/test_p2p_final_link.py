"""An ssend still waiting for its link when it times out (its receiver stopped before the link's
handshake) says so and is taken back, as a send's is: the message never comes. Real processes, real
TCP, real signals; and the rules' part without sockets."""

import os
import signal
from collections import deque

from conftest import touch, wait_for

import zcollective as zc
from zcollective._protocol._p2p import Mail
from zcollective.testing import Replicas, report


def _outcome(call):
    try:
        return call()
    except zc.CollectiveError as exc:
        return type(exc).__name__, str(exc)


def stopped_before_the_link(markers, sync_async):
    """Rank 1 ssends to rank 2, which the test stopped: on a new link, whose handshake waits."""
    r = zc.get_rank()
    if r == 1:
        wait_for(os.path.join(markers, "stopped"))
        if sync_async:
            future = zc.ssend_async("taken back", 2, tag=1)
            out = _outcome(lambda: future.result(timeout=1.5))
        else:
            out = _outcome(lambda: zc.ssend("taken back", 2, tag=1, timeout=1.5))
        touch(os.path.join(markers, "timed out"))
        zc.ssend("made", 2, tag=2, timeout=30)
        zc.barrier(timeout=60)
        return out
    if r == 2:
        touch(os.path.join(markers, "ready"))  # stopped, then continued, by the test
        made = zc.recv(1, tag=2, timeout=30)
        zc.barrier(timeout=60)
        return made, zc.iprobe(1)  # (the one taken back never comes)
    zc.barrier(timeout=60)
    return None


def test_an_ssend_waiting_for_its_link_is_taken_back_at_its_timeout(tmp_path):
    for sync_async in (False, True):
        markers = str(tmp_path / str(sync_async))
        os.makedirs(markers)
        with Replicas(stopped_before_the_link, 3, markers, sync_async) as reps:
            wait_for(os.path.join(markers, "ready"), watch=reps)
            reps.kill(2, signal.SIGSTOP)
            touch(os.path.join(markers, "stopped"))
            wait_for(os.path.join(markers, "timed out"), watch=reps)
            reps.kill(2, signal.SIGCONT)
            outs = reps.wait(60)
        assert all(o.ok for o in outs), report(outs, "a rank failed")
        kind, message = outs[1].value
        made, left = outs[2].value
        assert made == "made", report(outs, str(outs[2].value))
        if message.endswith("not taken back, it may still be received"):  # (a loaded machine: the
            # link was made before rank 2 stopped, and the message left: it says so, and it came)
            assert left is not None and left.tag == 1, report(outs, f"{message}: {left}")
            continue
        assert kind == "CollectiveTimeoutError" and message.startswith(
            "rank 1: ssend(dest=2, tag=1) timed out after 1.5 s: its message waits for its link to rank 2's "
            "mailbox"), report(outs, message)
        assert message.endswith("taken back: nothing was sent"), message
        assert left is None, report(outs, f"the message taken back came: {left}")


def test_unsend_takes_an_ssend_back_whole():
    mail = Mail(0, 2, 1000, session=7, outcomes=deque())
    mail.send(1, 0, [b"x"], "ssend", "its message")
    assert mail.sent_as("ssend") == "its message" and mail.sent_as("send") == "send"
    assert mail.unsend(1, "ssend")
    assert not mail.syncing and mail.box.peers[1].next_out == 0 and mail.box.peers[1].held == 0
    assert mail.sent_as("ssend") == "ssend"


def ends_having_received_the_later_tag(markers):
    """Rank 1 ssends rank 2 tag 1, then tag 2; rank 2 receives tag 2 only, and its program ends
    (without teardown: its FINAL says what it received)."""
    zc.initialize()
    r = zc.get_rank()
    if r == 2:
        return zc.recv(1, tag=2, timeout=30)
    if r == 1:
        first = zc.ssend_async("A, never received", 2, tag=1)
        zc.ssend("B", 2, tag=2, timeout=30)
        out = _outcome(lambda: first.result(timeout=30))
        touch(os.path.join(markers, "done"))
        return out
    wait_for(os.path.join(markers, "done"), timeout=60)  # (rank 0 ending would end the group)
    return None


def test_an_ssend_whose_receiver_took_a_later_tag_and_ended_raises_peer_ended(tmp_path):
    with Replicas(ends_having_received_the_later_tag, 3, str(tmp_path), initialize=False) as reps:
        outs = reps.wait(60)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    assert outs[2].value == "B", report(outs, str(outs[2].value))
    assert outs[1].value is not None, report(outs, "the ssend of tag 1 returned, as if received")
    kind, message = outs[1].value
    assert kind == "PeerEndedError" and message.startswith(
        "rank 1: ssend(dest=2, tag=1) cannot complete: rank 2 ended its program"), report(outs, message)
    assert "having received 1 of this rank's messages, not this one (number 0 to it)" in message, message
