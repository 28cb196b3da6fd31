"""Ctrl-C while a call waits for the group's turn (another thread of the process holds it): the call
was not made, so an error note goes in its place and the calls pair up again (a reviewer found the
next call paired with the others' interrupted one: every later result silently wrong). Real
processes and a real SIGINT."""

import os
import signal
import threading

import zcollective as zc
from zcollective.testing import run_replicas


def interrupted_waiting_for_the_turn():
    me = zc.get_rank()
    zc.barrier()
    if me == 0:
        turns, held, release = zc._calls.turns, threading.Event(), threading.Event()

        def hold():  # another thread of this process keeps the turn (as a busy step would)
            with turns:
                held.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(10)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            zc.allreduce(1000)
            first = "made"
        except KeyboardInterrupt:
            first = "interrupted"
        release.set()
        holder.join(10)
    else:
        try:
            first = zc.allreduce(1000, timeout=20)
        except zc.CollectiveError as exc:
            first = type(exc).__name__
    try:
        second = zc.allreduce(me + 1, timeout=20)
    except zc.CollectiveError as exc:
        second = f"{type(exc).__name__}: {exc}"
    return first, second


def test_a_call_interrupted_waiting_for_the_turn_fails_everywhere_and_the_next_pairs_up():
    outs = run_replicas(interrupted_waiting_for_the_turn, 2, timeout=90)
    assert outs[0] == ("interrupted", 3), outs
    assert outs[1] == ("PeerError", 3), outs  # (before: 1001, paired with rank 0's next call)
