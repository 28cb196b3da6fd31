"""cancel() of a receive future never matched, while another thread holds the group (a done-callback
of another receive runs, holding it): it waits for the group and returns True (False means matched
or done, never "busy"); past op_timeout it raises, saying why (review of issue 46)."""

import threading
import time

import pytest

import zcollective as zc

CALLBACK_S = 1.5  # the other thread holds the group this long (longer than the old 1 s give-up)


def _busy_while(group, callback_s):
    """Start a thread whose send to this rank runs a done-callback of ``callback_s`` s holding the
    group; returns it once the callback runs."""
    other = group.recv_async(0, 2)
    running = threading.Event()

    def callback(_):
        running.set()
        time.sleep(callback_s)

    other.add_done_callback(callback)
    thread = threading.Thread(target=group.send, args=("go", 0, 2), daemon=True)
    thread.start()
    assert running.wait(10)
    return thread, other


def test_cancel_waits_for_a_thread_holding_the_group():
    with zc.Group(rank=0, size=1) as group:
        never = group.recv_async(0, 3)
        thread, other = _busy_while(group, CALLBACK_S)
        started = time.monotonic()
        cancelled = never.cancel()
        took = time.monotonic() - started
        thread.join(10)
        assert cancelled is True, took
        assert never.cancelled() and never.cancel() is True
        assert other.result(5) == "go"
        group.send("later", 0, 3)  # the cancelled receive took nothing: a later one gets it
        assert group.recv(0, 3, timeout=5) == "later"


def test_cancel_says_why_once_op_timeout_passes():
    with zc.Group(rank=0, size=1, op_timeout=0.5) as group:
        never = group.recv_async(0, 3)
        thread, _ = _busy_while(group, CALLBACK_S)
        said = r"cancel\(\) of recv\(source=0, tag=3\) timed out after 0.5 s .*another thread held the group"
        with pytest.raises(zc.CollectiveTimeoutError, match=said):
            never.cancel()
        thread.join(10)
        assert not never.done()
        assert never.cancel() is True
