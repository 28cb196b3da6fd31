"""Any thread may call: the turn's rules without sockets (fast), then
threads of real processes calling one group at once, with real signals."""

import os
import select
import signal
import threading
import time

import pytest
from conftest import touch, wait_for

import zcollective as zc
from zcollective._io._turns import Turns
from zcollective.testing import Replicas, report, run_replicas

WAIT_S = 10  # every wait of these tests is bounded by this


# -- the rules, without sockets --------------------------------------------------


class FakeLink:
    """A link whose 'messages' are results put in by the test: the leader's
    drive takes them in (resolving calls) and sleeps on a pipe, like a poll
    of the sockets with the turn's nudge; it records who drove, and whether
    two threads ever drove at once."""

    def __init__(self, turns):
        self.turns = turns
        self.inbox = []
        self.done = set()
        self.drivers = []
        self.inside = 0
        self.overlap = False
        self.read, self.write = os.pipe()
        self.lock = threading.Lock()
        self.wakers = {}  # call -> wake-ups of threads following it

    def deliver(self, call):
        with self.lock:
            self.inbox.append(call)
        os.write(self.write, b"x")

    def drive(self, until, deadline, nudged):
        self.inside += 1
        self.overlap |= self.inside > 1
        self.drivers.append((threading.get_ident(), nudged))
        try:
            while not until():
                watch = [self.read] + ([self.turns.nudge.fd] if nudged else [])
                timeout = None if deadline is None else max(0, deadline - time.monotonic())
                ready, _, _ = select.select(watch, [], [], timeout)
                if not ready:
                    return until()
                if self.read in ready:
                    os.read(self.read, 4096)
                    with self.lock:
                        taken, self.inbox = self.inbox, []
                    for call in taken:
                        self.done.add(call)
                        for wake in self.wakers.pop(call, []):
                            wake()
            return True
        finally:
            self.inside -= 1

    def wait(self, call, timeout=WAIT_S):
        def follow(wake):
            self.wakers.setdefault(call, []).append(wake)
            if call in self.done:
                wake()
        return self.turns.wait(lambda: call in self.done, time.monotonic() + timeout, self.drive, follow)


def _fake():
    turns = Turns()
    return turns, FakeLink(turns)


def _until(condition, timeout=WAIT_S):
    """Wait (bounded) until ``condition()``; what it last said."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def _thread(target, *args):
    out = {}

    def run():
        try:
            out["value"] = target(*args)
        except BaseException as exc:  # noqa: B036 (reported to the test)
            out["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_one_thread_leads_the_others_follow_and_each_wakes_when_its_call_is_done():
    turns, link = _fake()
    waiting = [_thread(link.wait, call) for call in range(4)]
    time.sleep(0.1)  # all four wait: one leads, three follow
    assert len({ident for ident, _ in link.drivers}) == 1
    for call in (2, 0, 3, 1):  # out of order: a follower's call first
        link.deliver(call)
    for t, out in waiting:
        t.join(WAIT_S)
        assert out == {"value": True}
    assert not link.overlap


def test_a_thread_wanting_the_turn_nudges_the_leader_which_takes_it_back_after():
    turns, link = _fake()
    leader, out = _thread(link.wait, "slow")
    time.sleep(0.1)
    assert turns._leader is not None
    started = time.monotonic()
    assert turns.take(time.monotonic() + WAIT_S)  # the leader waits in its poll: nudged, lets go
    took = time.monotonic() - started
    assert turns.held() and link.inside == 0
    turns.give()
    link.deliver("slow")
    leader.join(WAIT_S)
    assert out == {"value": True}
    assert took < WAIT_S / 2, took
    assert len(link.drivers) >= 2  # it drove again after letting go
    assert not turns._wanting and not select.select([turns.nudge.fd], [], [], 0)[0]  # cleared


def test_a_wait_holding_the_turn_leads_and_never_lets_go():
    turns, link = _fake()
    turns.take()  # as teardown does, or a done-callback halfway through a message

    def want():
        got = turns.take(time.monotonic() + WAIT_S)
        at = time.monotonic()
        if got:
            turns.give()
        return got, at
    try:
        t, out = _thread(want)
        assert _until(lambda: turns.wanted() and select.select([turns.nudge.fd], [], [], 0)[0]), \
            "the other thread's wish for the turn never showed (nudge)"
        link.deliver("own")
        assert link.wait("own")
        assert link.drivers == [(threading.get_ident(), False)]  # not nudged: it held the turn
        assert "value" not in out and t.is_alive()  # the other still waits for it
    finally:
        gave = time.monotonic()
        turns.give()
    t.join(WAIT_S)
    got, at = out["value"]
    assert got and at >= gave, (got, at - gave)  # it had the turn once given, not before


def test_a_follower_times_out_on_its_own_deadline_while_the_leader_waits_on():
    turns, link = _fake()
    leader, out = _thread(link.wait, "long")
    time.sleep(0.05)
    assert link.wait("short", timeout=0.2) is False
    link.deliver("long")
    leader.join(WAIT_S)
    assert out == {"value": True}


def test_when_the_leader_is_done_a_follower_leads():
    turns, link = _fake()
    first, out1 = _thread(link.wait, 1)
    time.sleep(0.05)
    second, out2 = _thread(link.wait, 2)
    time.sleep(0.05)
    link.deliver(1)
    first.join(WAIT_S)
    time.sleep(0.05)
    link.deliver(2)  # only a thread that leads takes this in
    second.join(WAIT_S)
    assert out1 == out2 == {"value": True}
    assert len({ident for ident, _ in link.drivers}) == 2


def test_a_follower_whose_call_completes_as_it_starts_following_returns():
    """The call completes between the follower's check and its follow(): its
    done-callback runs at once (as CollectiveFuture.add_done_callback does),
    which must not deadlock on the turn's own mutex."""
    turns = Turns()
    release = threading.Event()

    def drive(until, deadline, nudged):
        release.wait(WAIT_S)
        return until()
    leader, _ = _thread(turns.wait, release.is_set, None, drive, lambda wake: None)
    time.sleep(0.05)  # it leads
    checks = []

    def done():
        checks.append(1)
        return len(checks) > 1  # done from the second look on

    def follow(wake):
        if done():
            wake()
    try:
        follower, out = _thread(turns.wait, done, time.monotonic() + 1, drive, follow)
        follower.join(WAIT_S / 2)
        assert out == {"value": True}
    finally:
        release.set()
    leader.join(WAIT_S)


def test_a_closed_turn_is_not_nudged(monkeypatch):
    """A thread still waiting for the turn of a closed group sets the nudge:
    nothing is written or read, as the nudge's file numbers may be another
    file's by then (here they are kept open, as that file's, to see it)."""
    turns = Turns()
    kept = []
    monkeypatch.setattr(os, "close", kept.append)
    turns.close()
    monkeypatch.undo()
    try:
        assert sorted(kept) == sorted([turns.nudge.fd, turns.nudge._write])
        turns.nudge.set()
        assert not select.select([turns.nudge.fd], [], [], 0)[0], "a closed nudge wrote"
        os.write(turns.nudge._write, b"x")  # that other file's own byte
        turns.nudge.clear()
        assert os.read(turns.nudge.fd, 4096) == b"x", "a closed nudge read another file's byte"
    finally:
        for fd in kept:
            os.close(fd)


# -- threads of real processes ----------------------------------------------------

THREADS = 4
CALLS = 30  # per thread


def many_threads(arrays):
    """THREADS threads of each rank call at once. A ticket (the program's
    own business, as in MPI_THREAD_MULTIPLE) makes every rank send its calls
    in the same order; waits overlap freely: one thread leads, others
    follow, others send meanwhile. The main thread, which made the group,
    only waits for them."""
    import numpy as np

    rank, size = zc.get_rank(), zc.get_world_size()
    ticket = [0]
    turn = threading.Condition()
    results, errors = {}, []

    def call(k):
        kind = k % 4
        if kind == 0:
            return zc.allgather_async((k, rank)), [(k, r) for r in range(size)]
        if kind == 1:
            return zc.allreduce_async(rank + k), sum(range(size)) + size * k
        if kind == 2:
            root = k % size
            return zc.broadcast_async(k * 10 + rank, root), k * 10 + root
        if arrays:  # the data plane's ring, from any thread
            array = np.full(100_000, rank + k, dtype=np.float64)
            return zc.allreduce_async(array), float(sum(range(size)) + size * k)
        return zc.barrier_async(), None

    def worker(t):
        try:
            pending = []
            for i in range(CALLS):
                k = i * THREADS + t
                with turn:
                    assert turn.wait_for(lambda k=k: ticket[0] == k, WAIT_S * 3), f"ticket {k} never came"
                    future, expected = call(k)
                    ticket[0] += 1
                    turn.notify_all()
                pending.append((k, future, expected))
                if i % 3 == 2:  # let some pile up, then wait for them in another order
                    for k2, f, e in reversed(pending):
                        got = f.result(timeout=WAIT_S * 3)
                        results[k2] = (float(got[0]) if hasattr(got, "shape") else got, e)
                    pending.clear()
            for k2, f, e in pending:
                got = f.result(timeout=WAIT_S * 3)
                results[k2] = (float(got[0]) if hasattr(got, "shape") else got, e)
        except BaseException as exc:  # noqa: B036 (reported below)
            errors.append(f"thread {t}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 6)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting"
    assert not errors, errors
    wrong = {k: v for k, v in results.items() if v[0] != v[1]}
    assert not wrong, wrong
    assert len(results) == THREADS * CALLS
    assert zc._current()._life.here.data == arrays
    return zc.allgather(len(results))  # and the group goes on, from the main thread


@pytest.mark.parametrize("arrays", [False, True], ids=["star", "data-plane"])
def test_threads_of_every_rank_call_one_group_at_once(arrays):
    env = {"ZCOLLECTIVE_DATA_PLANE": "on", "ZCOLLECTIVE_DATA_PLANE_MIN_BYTES": "65536",
           "ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": "off"} if arrays else None
    # bounded below pytest's 120 s, so that a hang shows every rank's stacks
    outs = run_replicas(many_threads, 3, arrays, env=env, timeout=90)
    assert outs == [[THREADS * CALLS] * 3] * 3


def sends_while_another_waits(markers):
    """The main thread blocks in a call a slow rank holds up; meanwhile a
    second thread of the same rank sends the next call and takes its
    result: sending never waits for another thread's call to finish."""
    rank = zc.get_rank()
    zc.barrier()
    if rank == 2:
        time.sleep(1.5)  # the others' main threads wait for this rank meanwhile
        first = zc.allreduce(1)
        return first, zc.broadcast(None, root=1), zc.allgather(rank)
    started = threading.Event()
    seen = {}

    def second():
        started.wait(WAIT_S)
        time.sleep(0.2)  # the main thread is in its wait by now (it leads)
        later = zc.broadcast_async("from rank 1" if rank == 1 else None, root=1)
        seen["sent while the first was pending"] = not first.done()  # (rank 2 still sleeps)
        seen["result"] = later.result(timeout=WAIT_S)

    thread = threading.Thread(target=second)
    thread.start()
    first = zc.allreduce_async(1)
    started.set()
    value = first.result(timeout=WAIT_S)
    thread.join(WAIT_S)
    return value, seen, zc.allgather(rank)


def test_a_thread_sends_while_another_waits_for_an_earlier_call():
    outs = run_replicas(sends_while_another_waits, 3, None)
    assert outs[2] == (3, "from rank 1", [0, 1, 2])
    for first, seen, gathered in outs[:2]:
        assert first == 3 and gathered == [0, 1, 2]
        assert seen == {"sent while the first was pending": True, "result": "from rank 1"}, seen


def interrupted_among_threads(main_leads):
    """Rank 1's main thread is interrupted (a real SIGINT) in a blocking
    call while its other thread waits for an earlier call: the main thread
    raises KeyboardInterrupt; its call fails on every rank alike (it was
    given up); the other thread's call completes on every rank; the group
    goes on."""
    rank = zc.get_rank()
    zc.barrier()
    sent, main_in = threading.Event(), threading.Event()
    seen = {}

    def other():
        future = zc.allreduce_async(10)  # seq 1, on every rank before the main thread's
        sent.set()
        if main_leads:
            main_in.wait(WAIT_S)
            time.sleep(0.3)  # the main thread waits (it leads); this one follows it
        try:
            seen["other"] = future.result(timeout=WAIT_S * 2)
        except BaseException as exc:  # noqa: B036 (reported)
            seen["other"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=other)
    thread.start()
    sent.wait(WAIT_S)
    if rank == 2:
        time.sleep(1.5)  # rank 1's main thread is interrupted while waiting for this rank
    if rank == 1:
        if not main_leads:
            time.sleep(0.3)  # the other thread waits first (it leads); this one follows
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    main_in.set()
    try:
        seen["main"] = zc.allreduce(1)  # seq 2
    except KeyboardInterrupt:
        seen["main"] = "KeyboardInterrupt"
    except zc.CollectiveError as exc:
        seen["main"] = type(exc).__name__ + ("(given up)" if "interrupted" in str(exc) else str(exc))
    thread.join(WAIT_S * 2)
    return seen, zc.allgather(rank)


@pytest.mark.parametrize("main_leads", [True, False], ids=["interrupted-leader", "interrupted-follower"])
def test_an_interrupt_of_one_thread_fails_its_call_alike_and_spares_the_others(main_leads):
    outs = run_replicas(interrupted_among_threads, 3, main_leads)
    for rank, (seen, gathered) in enumerate(outs):
        assert gathered == [0, 1, 2]
        assert seen["other"] == 30, (rank, seen)
        expected = "KeyboardInterrupt" if rank == 1 else "PeerError(given up)"
        assert seen["main"] == expected, (rank, seen)


def teardown_from_another_thread():
    """A thread that is not the group's creator tears it down while another
    waits for a call nobody else makes: the waiter is told at once (rank 0's
    teardown meets its call: a mismatch), not at its own timeout, and the
    teardown returns."""
    rank = zc.get_rank()
    zc.barrier()
    seen = {}
    if rank == 1:
        started = time.monotonic()
        waiting = zc.barrier_async()  # rank 0 never makes this call
        done = threading.Event()

        def wait():
            try:
                waiting.result(timeout=WAIT_S)
            except BaseException as exc:  # noqa: B036 (reported)
                seen["waiter"] = type(exc).__name__
                seen["told after"] = time.monotonic() - started
            done.set()
        threading.Thread(target=wait).start()
        time.sleep(0.3)
    closer = threading.Thread(target=lambda: seen.setdefault("teardown", zc.teardown(timeout=WAIT_S)))
    closer.start()
    closer.join(WAIT_S)
    if rank == 1:
        seen["waiter ended"] = done.wait(WAIT_S)
    return seen


def test_teardown_from_another_thread_ends_the_waits_of_the_others():
    outs = run_replicas(teardown_from_another_thread, 2)
    assert outs[0] == {"teardown": None}, outs
    told_after = outs[1].pop("told after", None)
    assert outs[1] == {"teardown": None, "waiter": "CallMismatchError", "waiter ended": True}, outs
    assert told_after < WAIT_S / 2, outs  # at once, not at its own timeout


def awaited_in_another_threads_loop():
    """A thread runs an event loop awaiting calls while the main thread
    makes blocking calls; the ticket orders the sends alike on every rank."""
    import asyncio

    rank = zc.get_rank()
    sent = threading.Event()
    seen = {}

    async def main():
        futures = [zc.allreduce_async(rank + k) for k in range(5)]
        sent.set()
        seen["async"] = [await f for f in futures]

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    sent.wait(WAIT_S)
    seen["blocking"] = [zc.allgather(rank * k) for k in range(5)]
    thread.join(WAIT_S)
    return seen


def test_a_coroutine_in_another_threads_loop_awaits_while_the_main_thread_calls():
    outs = run_replicas(awaited_in_another_threads_loop, 3)
    for seen in outs:
        assert seen == {"async": [3 + 3 * k for k in range(5)],
                        "blocking": [[0, k, 2 * k] for k in range(5)]}, seen


def ends_with_a_daemon_thread_in_the_library(markers):
    """Rank 1's program ends (no teardown) while a daemon thread of its own
    still waits in the library for a call nobody else makes (rank 0 ends
    only once rank 1's process has): the end still takes the turn, says
    BYE, delivers the main thread's last result and closes."""
    zc.initialize(timeout=WAIT_S * 3)
    rank = zc.get_rank()
    last = zc.allreduce(rank)
    if rank == 1:
        lone = zc.barrier_async()  # seq 1: rank 0 never makes it
        threading.Thread(target=lambda: lone.result(), daemon=True).start()
        assert not lone.done()
    else:
        wait_for(os.path.join(markers, "rank 1 ended"), timeout=WAIT_S * 3)
    return last


def test_a_program_ends_while_a_daemon_thread_waits_in_the_library(tmp_path):
    with Replicas(ends_with_a_daemon_thread_in_the_library, 2, str(tmp_path), initialize=False) as reps:
        deadline = time.monotonic() + WAIT_S * 3
        while reps.procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # (a process's end: no event to wait on)
        touch(tmp_path / "rank 1 ended")
        outs = reps.wait(60)
    said = report(outs, "")
    assert [(o.ok, o.value) for o in outs] == [(True, 1), (True, 1)], said
    assert "rank 1 (pid" not in outs[0].output, said  # it said BYE: not found lost, nothing to say


def test_an_interrupt_while_a_notified_follower_takes_the_mutex_back_never_releases_anothers():
    """The main thread, notified, waits in Condition.wait to take the turn's
    mutex back from another thread: a SIGINT then is deferred (as anywhere
    the library is halfway through), so it never leaves the wait without the
    mutex and releases the one the other thread holds."""
    from zcollective._io import _interrupts

    mutex = threading.Lock()
    cond = _interrupts.Condition(mutex)
    seen = {}

    def other():
        time.sleep(0.1)
        try:
            with mutex:
                cond.notify_all()  # the main thread wakes and waits for the mutex ...
                threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()  # ... interrupted there
                time.sleep(0.3)
                seen["held"] = mutex.locked()
        except BaseException as exc:  # noqa: B036 (reported)
            seen["other"] = repr(exc)

    _interrupts.hold_signals()
    try:
        thread = threading.Thread(target=other)
        thread.start()
        try:
            with mutex:
                _interrupts.wait_condition(cond, WAIT_S)
            time.sleep(1)  # the deferred interrupt surfaces here
        except KeyboardInterrupt:
            seen["interrupted"] = True
        thread.join(WAIT_S)
    finally:
        _interrupts.release_signals()
    assert seen == {"held": True, "interrupted": True}, seen


def test_a_coroutine_whose_call_another_thread_resolves_as_it_goes_to_sleep_wakes():
    """Another thread (the leader) resolves the future after the coroutine's
    done() said no and before its wake-up is added: it must not sleep for
    ever. The fake driver resolves it just then (when the waiter asks for
    the fds)."""
    import asyncio

    from zcollective._future import CollectiveFuture

    class Driver:
        def progress(self):
            pass  # another thread leads: nothing is taken in here

        def wait_call(self, future, timeout):
            pass

        def fds(self):
            future._set_result(42)
            return []

    future = CollectiveFuture(Driver(), 1, "allreduce")

    async def main():
        return await asyncio.wait_for(future, WAIT_S / 2)
    assert asyncio.run(main()) == 42


def slow_reduction_then_a_call_with_a_timeout(measured):
    """Rank 0's program calls (timeout 0.5 s) while its server thread runs a reduce function
    that lasts until that call has ended (the file ``measured``; 30 s at most; its program was
    away): found by an attack, the call waited the whole reduce function. Now it times out,
    naming the reduce function, and an error note takes its place once the turn is free, so
    the other rank's call at that seq fails too and the next pair."""
    import time

    def slow(a, b):
        deadline = time.monotonic() + 30  # (a call that waited for it would take as long)
        while not os.path.exists(measured) and time.monotonic() < deadline:
            time.sleep(0.01)
        return a + b

    r = zc.get_rank()
    first = zc.allreduce_async(r, slow)
    time.sleep(0.3)  # rank 0's program is away: its server thread takes the turn and reduces
    started = time.monotonic()
    try:
        zc.allreduce(1, timeout=0.5)
        said = None
    except zc.CollectiveError as exc:
        said = (type(exc).__name__, str(exc))
    took = time.monotonic() - started
    if r == 0:
        touch(measured)
    return said, took, first.result(timeout=60), zc.allreduce(10 + r, timeout=30)


def test_a_rank_0_call_waits_for_the_server_threads_reduction_no_longer_than_its_timeout(tmp_path):
    (said0, took0, first0, next0), (said1, _, first1, next1) = run_replicas(
        slow_reduction_then_a_call_with_a_timeout, 2, str(tmp_path / "measured"), timeout=90)
    assert said0[0] == "CollectiveTimeoutError" and took0 < 2.0, (said0, took0)
    if "rank 1 (pid" not in said0[1] or "gave it up (its call timed out" not in said0[1]:  # (loaded: rank
        assert "seq 1 allreduce timed out before it could be made" in said0[1], said0  # 1's own timeout
        assert "reduce function of seq 0 allreduce has been running" in said0[1], said0  # may end it first)
    assert said1 is not None and said1[0] in ("CollectiveTimeoutError", "PeerError"), said1
    assert first0 == first1 == 1 and next0 == next1 == 21  # the calls pair up again
