"""Signals where they meet the other features (issue 44): a handler the
program installs after the group started, storms of signals during
shared-memory calls and stack requests, the launcher's stack requests to
programs that handle SIGUSR1 themselves, and Ctrl-C during a slow
reduction. Real processes, real signals (``os.kill``); every wait bounded."""

import operator
import os
import signal
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import launched_until_seen, wait_for

import zcollective as zc
from zcollective._io._stacks import STACKS_GAP_S
from zcollective.testing import Replicas, free_port, report

ELEMENTS = 1 << 20  # float32: 4 MiB, through shared memory (3 ranks on one host)
STORM_S = 3.0  # how long a storm of signals lasts
STORM_EVERY_S = 0.003  # one signal this often
SIGTERM_EVERY_S = 0.01  # ... of SIGTERM: a 4 MiB call completes between two, or fails of one
SIGTERM_CALLS = 200  # the calls that must complete (most during the storm)
P2P_EVERY_S = 0.005  # ... during sends of 256 KiB


class Stop(Exception):
    """What the program's SIGTERM handler raises."""


def storm(sig, seconds, every):
    """Send this process ``sig`` every ``every`` s for ``seconds`` (a thread of
    its own), or until the event returned is set."""
    end, stop = time.monotonic() + seconds, threading.Event()

    def run():
        while time.monotonic() < end and not stop.is_set():
            os.kill(os.getpid(), sig)
            time.sleep(every)
    threading.Thread(target=run, daemon=True).start()
    return stop


def test_a_handler_installed_after_the_hold_is_wrapped_at_the_next_entry_but_the_librarys_own():
    """Without processes: the check every entry makes, and what it wraps."""
    from zcollective._io import _interrupts, _stacks

    def mine(signum, frame):
        raise Stop
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        _interrupts.hold_signals()
        signal.signal(signal.SIGUSR2, mine)
        signal.signal(signal.SIGUSR1, _stacks._on_signal)
        assert tuple(map(_interrupts.getsignal, _interrupts.DEFERRED_SIGNALS)) != _interrupts.held
        _interrupts.hold_new_handlers()
        wrapped = signal.getsignal(signal.SIGUSR2)
        assert type(wrapped).__name__ == "_Wrapped" and wrapped.handler is mine
        assert signal.getsignal(signal.SIGUSR1) is _stacks._on_signal  # (it never raises)
        assert tuple(map(_interrupts.getsignal, _interrupts.DEFERRED_SIGNALS)) == _interrupts.held
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_call_moves_its_data_from_its_plan_to_its_end():
    from zcollective._protocol._member import Member

    member = Member(1, 3, "tcp://127.0.0.1:1", None, 1 << 20)
    assert not member.moving(4)
    member.transfers.append((4, object()))
    assert member.moving(4) and not member.moving(5)


def allreduces_through_a_sigterm_storm():
    """The program installs a raising SIGTERM handler after initialize, then
    allreduces 4 MiB while SIGTERMs come every few ms: an interrupted call
    fails on every rank alike, so each rank retries the same value, and every
    result is the sum of the same call on every rank."""
    loop, armed = [], []

    def handler(signum, frame):
        if not armed or frame is None or frame.f_code in loop:  # between the loop's own lines: a
            return  # call made or returned, not yet counted (the program's window, not the library's)
        raise Stop

    def run():
        i, wrong, interrupted, failed = 0, [], 0, 0
        values = np.empty(ELEMENTS, dtype=np.float32)
        stop = storm(signal.SIGTERM, STORM_S, SIGTERM_EVERY_S)
        armed.append(True)
        while i < SIGTERM_CALLS:
            try:
                values.fill(i)
                got = zc.allreduce(values)
                if not (got[0] == got[-1] == 3 * i):
                    wrong.append((i, float(got[0]), float(got[-1])))
                i += 1
            except Stop:
                interrupted += 1
            except zc.PeerError:
                failed += 1
        stop.set()
        armed.clear()
        return i, wrong[:5], len(wrong), interrupted, failed
    loop.append(run.__code__)
    signal.signal(signal.SIGTERM, handler)  # after initialize: not wrapped when the group started
    return run()


def test_a_raising_handler_installed_after_initialize_never_mispairs_calls():
    with Replicas(allreduces_through_a_sigterm_storm, 3) as reps:
        outs = reps.wait(90)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    said = report(outs, f"outcomes {[o.value for o in outs]}")
    assert all(o.value[2] == 0 for o in outs), said
    assert sum(o.value[3] for o in outs) > 0, said  # (the storm did interrupt calls)


def sends_through_a_sigterm_storm(count, floats=1 << 16):
    """Rank 0 sends ``count`` messages to rank 1, each retried when the
    program's SIGTERM handler (installed after initialize) interrupts it, while
    SIGTERMs come every few ms on both ranks: an interrupted send or receive is
    taken back, or, if its message went, stands (its signal comes again after)."""
    loop, armed = [], []

    def handler(signum, frame):
        if not armed or frame is None or frame.f_code in loop:
            return
        raise Stop

    def run():
        me, got, k, interrupted = zc.get_rank(), [], 0, 0
        stop = storm(signal.SIGTERM, STORM_S, P2P_EVERY_S)
        armed.append(True)
        while k < count:
            try:
                if me == 0:
                    zc.send(np.full(floats, k, dtype=np.float32), 1, tag=1)
                else:
                    got.append(int(zc.recv(0, tag=1)[0]))
                k += 1
            except Stop:
                interrupted += 1
        stop.set()
        armed.clear()
        zc.barrier()
        return got, interrupted
    loop.append(run.__code__)
    signal.signal(signal.SIGTERM, handler)
    return run()


@pytest.mark.parametrize("local", ["0", "1"], ids=["zeromq", "one-host links"])
def test_a_send_interrupted_after_its_message_went_is_not_sent_twice(local):
    """Over one-host links a 256 KiB send mostly goes to the kernel at once, never waiting (so never
    interrupted): there the sends are 4 MiB, which wait for the socket."""
    count, floats = (400, 1 << 16) if local == "0" else (60, 1 << 20)
    env = {"ZCOLLECTIVE_LOCAL_MAIL": local}
    with Replicas(sends_through_a_sigterm_storm, 2, count, floats, env=env) as reps:
        outs = reps.wait(60)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    got = outs[1].value[0]
    said = report(outs, f"received {got[:20]}..., interrupted {[o.value[1] for o in outs]}")
    assert got == list(range(count)), said
    assert outs[0].value[1] > 0 and outs[1].value[1] > 0, said  # (the storm did interrupt calls)


# -- defect 3: stacks on SIGUSR1, while threads come and go ------------------------------------


def allreduces_through_a_sigusr1_storm():
    """SIGUSR1 every few ms (a user's ``kill -USR1``, asking for the stacks) while
    a worker thread starts short threads and another polls ``status()``."""
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            helper = threading.Thread(target=sum, args=(range(100),))
            helper.start()
            helper.join()

    def poller():
        while not stop.is_set():
            zc.status()
    threads = [threading.Thread(target=worker), threading.Thread(target=poller)]
    for thread in threads:
        thread.start()
    storm(signal.SIGUSR1, STORM_S, STORM_EVERY_S)
    end, sums, storming = time.monotonic() + STORM_S, [], True
    while storming:
        sums.append(float(zc.allreduce(np.ones(1000))[0]))
        storming = zc.allreduce(time.monotonic() < end, operator.or_)  # (every rank stops at one call)
    stop.set()
    for thread in threads:
        thread.join(10)
    return len(sums), set(sums)


def test_a_storm_of_stack_requests_never_kills_the_rank_it_diagnoses():
    with Replicas(allreduces_through_a_sigusr1_storm, 2) as reps:
        outs = reps.wait(60)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    assert all(o.value[1] == {2.0} for o in outs), report(outs, "wrong sums")
    for o in outs:
        dumps = o.output.count("zcollective: the threads of process")  # (one a second at most)
        assert 0 < dumps <= STORM_S / STACKS_GAP_S + 2, report(outs, f"rank {o.rank}: {dumps} dumps")
        assert "allreduces_through_a_sigusr1_storm" in o.output, report(outs, "the main thread's stack")


# -- defect 12: the launcher's stack requests, and the program's own SIGUSR1 handler ------------

WARN_S = 1.0  # the stall warning's bound in the launcher's tests


def test_a_stall_under_the_launcher_never_runs_the_programs_own_sigusr1_handler(tmp_path):
    """The program installs a "checkpoint and exit" SIGUSR1 handler after
    initialize; rank 1 is late, so the launcher shows its stacks: the
    handler never runs, and the stacks still come."""
    job, shown = tmp_path / "late.py", tmp_path / "shown"
    job.write_text(textwrap.dedent(f"""\
        import os, signal, sys, time
        import zcollective as zc
        zc.initialize()
        def checkpoint_and_exit(signum, frame):
            print("the program's SIGUSR1 handler ran", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGUSR1, checkpoint_and_exit)
        zc.allreduce(1)
        end = time.monotonic() + 30  # (its stack shown, after the signal: the test says so with {shown})
        while zc.get_rank() == 1 and not os.path.exists({str(shown)!r}) and time.monotonic() < end:
            time.sleep(0.01)  # line 11: where rank 1 is
        zc.allreduce(1)
        zc.teardown()
    """))
    env = {**os.environ, "ZCOLLECTIVE_WARN_AFTER": str(WARN_S)}
    returncode, out = launched_until_seen(
        [sys.executable, "-m", "zcollective.run", "-n", "2", "--master-port", str(free_port()), str(job)],
        lambda line: line.startswith("[1]") and "late.py" in line and "line 11" in line, str(shown), 60,
        env=env)
    assert "SIGUSR1 handler ran" not in out and returncode == 0, out
    assert "rank 1 is late in a call the others wait for" in out, out
    stack = [line for line in out.splitlines() if line.startswith("[1]") and "late.py" in line]
    assert any("line 11" in line for line in stack), out


# -- item 16a: Ctrl-C during a slow reduction ------------------------------------------------------

REDUCE_S = 1.5  # each of rank 0's two reductions (3 ranks) takes this long


def interrupted_mid_reduction(markers):
    """Rank 0's reduce function is slow; rank 1 gets a real SIGINT while it
    runs. What each rank's call came to, and whether rank 1's Ctrl-C came out."""
    me = zc.get_rank()

    def slow_add(a, b):
        with open(os.path.join(markers, "reducing"), "w"):
            pass
        time.sleep(REDUCE_S)
        return a + b
    if me == 1:
        def interrupt():
            wait_for(os.path.join(markers, "reducing"))
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
    outcome, interrupted = None, False
    try:
        outcome = ("value", zc.allreduce(me + 1, slow_add))
        time.sleep(1.0)  # (an interrupt that came meanwhile comes out here)
    except KeyboardInterrupt:
        interrupted = True
    except zc.CollectiveError as exc:
        outcome = ("error", type(exc).__name__)
    if outcome is None:
        outcome = ("error", "KeyboardInterrupt")
    after = zc.allreduce(me + 1)  # the next call pairs
    return outcome, interrupted, after


@pytest.mark.parametrize("tree", ["off", "on"])
def test_ctrl_c_during_a_slow_reduction_ends_the_call_alike_on_every_rank(tmp_path, tree):
    with Replicas(interrupted_mid_reduction, 3, str(tmp_path), env={"ZCOLLECTIVE_TREE": tree}) as reps:
        outs = reps.wait(60)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    said = report(outs, f"outcomes {[o.value for o in outs]}")
    outcomes = [o.value[0] for o in outs]
    assert outcomes == [("value", 6)] * 3 or all(kind == "error" for kind, _ in outcomes), said
    assert outs[1].value[1] or outcomes[1] == ("error", "KeyboardInterrupt"), said  # never swallowed
    assert [o.value[2] for o in outs] == [6] * 3, said
