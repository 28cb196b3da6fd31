"""A Ctrl-C raised in another call's done-callback, which a blocking ``send``/``recv`` runs as it settles
what came, ends that blocking call as an interrupt of its own wait would (reviewer r-hot's critical
finding): it is taken back, or, finished, returns and the signal comes again. Before, the settle after
the point-to-point fast wait ran outside the take-back: a receive was left posted and took the next
message (lost to the program), a send waiting for credit went though it raised, a received value was
dropped. Two ranks, a real SIGINT while the callback blocks in a receive of its own."""

import os
import signal
import threading
import time

from zcollective.testing import run_replicas

SIGINT_AT_S = 0.8  # into the blocking call: the callback has started (its message came at 0.1 s)


def _callback_waiting(log):
    import zcollective as zc

    def callback(future):
        log.append(("callback", future.result()))
        log.append(("callback got", zc.recv(0, tag=2, timeout=20)))  # rank 0 sends it late
    return callback


def _ctrl_c_soon():
    threading.Timer(SIGINT_AT_S, os.kill, (os.getpid(), signal.SIGINT)).start()


def _sends_to_rank_1(*steps):
    """Rank 0: each (seconds to wait first, value, tag) in turn, then a wait for rank 1's goodbye."""
    import zcollective as zc

    for wait_s, value, tag in steps:
        time.sleep(wait_s)
        zc.send(value, 1, tag=tag)
    zc.recv(1, tag=9, timeout=30)


def _a_recv_the_callback_interrupts(log):
    """Rank 1: a blocking recv(0, tag=4) settling a receive whose done-callback waits, Ctrl-C there."""
    import zcollective as zc

    zc.recv_async(0, tag=1).add_done_callback(_callback_waiting(log))
    _ctrl_c_soon()
    try:
        log.append(("recv", zc.recv(0, tag=4, timeout=20)))
    except KeyboardInterrupt:
        log.append(("recv interrupted",))


def a_receive_interrupted_in_a_callback():
    import zcollective as zc

    zc.barrier()
    if zc.get_rank() == 0:  # ("A" after rank 1's interrupted recv(tag=4): for its next one)
        return _sends_to_rank_1((0.1, "one", 1), (1.9, "A", 4), (0.3, "two", 2))
    log = []
    _a_recv_the_callback_interrupts(log)
    log.append(("next recv", zc.recv(0, tag=4, timeout=10)))
    zc.send("bye", 0, tag=9)
    return log


def test_a_receive_interrupted_in_a_callback_is_taken_back_and_the_next_gets_the_message():
    log = run_replicas(a_receive_interrupted_in_a_callback, 2, timeout=60)[1]
    assert ("recv interrupted",) in log and ("next recv", "A") in log, log


def a_send_interrupted_in_a_callback():
    import zcollective as zc

    pad = b"x" * 600
    zc.barrier()
    if zc.get_rank() == 0:
        time.sleep(0.1)
        zc.send("one", 1, tag=1)
        time.sleep(1.4)  # rank 1's send of "B" waits for this rank's credit meanwhile
        got = []
        while not got or got[-1] != "end":
            value = zc.recv(1, tag=5, timeout=10)
            got.append(value[0] if isinstance(value, tuple) else value)
        zc.send("two", 1, tag=2)
        return got
    log = []
    zc.send(("A", pad), 0, tag=5)  # fills rank 0's window (1000 bytes)
    zc.recv_async(0, tag=1).add_done_callback(_callback_waiting(log))
    _ctrl_c_soon()
    try:
        zc.send(("B", pad), 0, tag=5, timeout=20)
        log.append(("sent B",))
    except KeyboardInterrupt:
        log.append(("send interrupted",))
    time.sleep(0.3)
    zc.send("end", 0, tag=5, timeout=20)
    zc.recv(0, tag=2, timeout=10)
    return log


def test_a_send_interrupted_in_a_callback_is_taken_back_and_never_delivered():
    got, log = run_replicas(a_send_interrupted_in_a_callback, 2, timeout=60,
                            env={"ZCOLLECTIVE_MAIL_WINDOW_BYTES": "1000"})
    assert ("send interrupted",) in log and got == ["A", "end"], (got, log)


def a_received_value_then_interrupted_in_a_callback():
    import zcollective as zc

    zc.barrier()
    if zc.get_rank() == 0:  # ("four" taken in by the callback's own wait, for the blocking recv)
        return _sends_to_rank_1((0.1, "one", 1), (0, "four", 4), (1.5, "two", 2))
    log = []
    _a_recv_the_callback_interrupts(log)
    try:
        time.sleep(2)
    except KeyboardInterrupt:
        log.append(("Ctrl-C again",))
    zc.send("bye", 0, tag=9)
    return log


def test_a_value_received_before_the_interrupt_is_returned_and_the_interrupt_comes_again():
    log = run_replicas(a_received_value_then_interrupted_in_a_callback, 2, timeout=60)[1]
    assert ("recv", "four") in log and ("Ctrl-C again",) in log, log
