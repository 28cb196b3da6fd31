"""zcollective.wait and zcollective.as_completed (issue 46): concurrent.futures' semantics on the
library's futures. Pure tests on futures of a fake group (its progress, its descriptors), then a
few on 2 real processes: futures of several groups, collective and point to point mixed; one that
errors; a timeout; and a rank that waits only in wait() while the other needs its part."""

import math
import os
import threading
import time

import pytest

import zcollective as zc
from zcollective import _future, _waiting
from zcollective.testing import run_replicas


class FakeGroup:
    """A call runner whose ``progress`` resolves what :meth:`arrive` queued, once its descriptor
    (a pipe) said so, as the real one: edge-triggered, drained by progress."""

    rank = 3

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.queued = []  # (future, value or exception)
        self.progressed = 0
        self.sleeping_seen = []
        self.lock = threading.Lock()

    def close(self):
        os.close(self.read_fd)
        os.close(self.write_fd)

    def future(self, op="allreduce", seq=0):
        return zc.CollectiveFuture(self, seq, op)

    def arrive(self, future, outcome):
        with self.lock:
            self.queued.append((future, outcome))
        os.write(self.write_fd, b"x")

    def progress(self):
        self.progressed += 1
        self.sleeping_seen.append(_future.sleeping())
        try:
            os.read(self.read_fd, 1024)
        except BlockingIOError:
            return
        with self.lock:
            queued, self.queued = self.queued, []
        for future, outcome in queued:
            if isinstance(outcome, BaseException):
                future._set_exception(outcome)
            else:
                future._set_result(outcome)

    def fds(self):
        return [self.read_fd]

    def wait_call(self, future, timeout):
        raise AssertionError("wait() never blocks in one future's result")


@pytest.fixture
def group():
    g = FakeGroup()
    yield g
    g.close()


def later(seconds, fn, *args):
    thread = threading.Timer(seconds, fn, args)
    thread.start()
    return thread


def test_all_completed_waits_for_every_future_and_returns_the_two_sets(group):
    a, b = group.future(seq=0), group.future("recv(source=1, tag=0)", -1)
    later(0.05, group.arrive, a, 1)
    later(0.15, group.arrive, b, 2)
    done, not_done = zc.wait([a, b, a], timeout=10)
    assert done == {a, b} and not_done == set()
    assert (a.result(), b.result()) == (1, 2)


def test_first_completed_returns_once_one_is_done(group):
    a, b = group.future(seq=0), group.future(seq=1)
    later(0.05, group.arrive, a, 1)
    started = time.monotonic()
    done, not_done = zc.wait([a, b], timeout=10, return_when=zc.FIRST_COMPLETED)
    assert (done, not_done) == ({a}, {b})
    assert time.monotonic() - started < 2  # woken by the descriptor, not by the recheck's end


def test_first_exception_returns_at_the_first_error_else_waits_for_all(group):
    a, b, c = group.future(seq=0), group.future(seq=1), group.future(seq=2)
    later(0.05, group.arrive, a, 1)
    later(0.1, group.arrive, b, zc.RemoteError("boom"))
    done, not_done = zc.wait([a, b, c], timeout=10, return_when=zc.FIRST_EXCEPTION)
    assert b in done and c in not_done
    assert isinstance(b.exception(), zc.RemoteError)
    later(0.05, group.arrive, c, 3)
    assert zc.wait([a, c], timeout=10, return_when=zc.FIRST_EXCEPTION) == ({a, c}, set())


def test_the_constants_are_concurrent_futures_own():
    import concurrent.futures as cf

    assert (zc.FIRST_COMPLETED, zc.FIRST_EXCEPTION, zc.ALL_COMPLETED) == (
        cf.FIRST_COMPLETED, cf.FIRST_EXCEPTION, cf.ALL_COMPLETED)


def test_a_timeout_raises_nothing_and_returns_the_sets(group):
    a, b = group.future(seq=0), group.future(seq=1)
    group.arrive(a, 1)
    started = time.monotonic()
    assert zc.wait([a, b], timeout=0.2) == ({a}, {b})
    assert 0.2 <= time.monotonic() - started < 2
    assert zc.wait([b], timeout=0) == (set(), {b})


def test_bad_arguments_are_refused_at_once(group):
    with pytest.raises(ValueError, match="return_when"):
        zc.wait([group.future()], return_when="SOMETIME")
    for bad in (-1, math.nan):
        with pytest.raises(ValueError, match="timeout"):
            zc.wait([group.future()], timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            zc.as_completed([group.future()], timeout=bad)


def test_it_does_not_spin_and_sleeps_on_the_descriptors_as_a_sleeper(group, monkeypatch):
    monkeypatch.setattr(_waiting, "WAIT_RECHECK_S", 0.2)
    never = group.future()
    started = time.monotonic()
    zc.wait([never], timeout=1.0)
    assert time.monotonic() - started >= 1.0
    assert group.progressed <= 1.0 / 0.2 + 2, group.progressed  # one progress per recheck, no spin
    assert not group.sleeping_seen[0]  # before the first sleep: no sleeper
    assert all(group.sleeping_seen[1:]), group.sleeping_seen  # then progress drains (a sleeper counts)
    assert not _future.sleeping()  # and it left


def test_a_future_another_thread_resolves_wakes_it_at_once(group, monkeypatch):
    monkeypatch.setattr(_waiting, "WAIT_RECHECK_S", 30.0)
    a = group.future()
    later(0.1, a._set_result, 5)  # (no descriptor fires: another thread took the result in)
    started = time.monotonic()
    assert zc.wait([a], timeout=20) == ({a}, set())
    assert time.monotonic() - started < 5
    assert a._callbacks == []  # its wake-up callback did not stay behind


def test_as_completed_yields_each_once_done_ones_first(group):
    a, b, c = group.future(seq=0), group.future(seq=1), group.future(seq=2)
    group.arrive(c, 3)
    later(0.05, group.arrive, a, 1)
    later(0.2, group.arrive, b, 2)
    order = list(zc.as_completed([a, b, c, c], timeout=10))
    assert order == [c, a, b]


def test_as_completed_times_out_with_a_timeout_error_naming_the_unfinished(group):
    a, b = group.future(seq=0), group.future("recv(source=1, tag=4)", -1)
    group.arrive(a, 1)
    got = []
    with pytest.raises(TimeoutError) as info:
        for future in zc.as_completed([a, b], timeout=0.2):
            got.append(future)
    assert got == [a]
    assert isinstance(info.value, zc.CollectiveTimeoutError)
    assert "1 (of 2) futures unfinished after 0.2 s: recv(source=1, tag=4) on rank 3" in str(info.value)


def test_futures_of_two_groups_mixed(group):
    other = FakeGroup()
    try:
        a, b = group.future(), other.future()
        later(0.05, other.arrive, b, "b")
        later(0.1, group.arrive, a, "a")
        assert zc.wait([a, b], timeout=10) == ({a, b}, set())
    finally:
        other.close()


# -- real processes ---------------------------------------------------------------------------

def mixed_groups():
    """Futures of the default group and of a dup, collective and point to point, waited for
    together; as_completed over the same mix."""
    r = zc.get_rank()
    other = zc.dup()
    futures = [zc.allreduce_async(r + 1), other.allreduce_async(10 * (r + 1)),
               zc.recv_async(1 - r, 7), zc.send_async(("from", r), 1 - r, 7),
               other.recv_async(1 - r, 8), other.send_async(r, 1 - r, 8)]
    done, not_done = zc.wait(futures, timeout=30)
    assert not not_done, not_done
    values = [f.result() for f in futures]
    more = [zc.broadcast_async("b", 0), other.barrier_async(), other.recv_async(1 - r, 9),
            other.send_async("c", 1 - r, 9)]
    seen = list(zc.as_completed(more, timeout=30))
    assert sorted(map(id, seen)) == sorted(map(id, more))
    other.teardown()
    return values, [f.result() for f in more]


def test_futures_of_several_groups_collective_and_point_to_point_mixed():
    values = run_replicas(mixed_groups, 2, timeout=90)
    assert values[0] == ([3, 30, ("from", 1), None, 1, None], ["b", None, "c", None])
    assert values[1] == ([3, 30, ("from", 0), None, 0, None], ["b", None, "c", None])


def test_a_future_that_errors_and_a_timeout():
    def body():
        r = zc.get_rank()
        never = zc.recv_async(1 - r, 99)
        failing = zc.allreduce_async(1, lambda a, b: 1 / 0)
        done, not_done = zc.wait([never, failing], timeout=30, return_when=zc.FIRST_EXCEPTION)
        started = time.monotonic()
        timed = zc.wait([never], timeout=0.3)
        waited = time.monotonic() - started
        try:
            list(zc.as_completed([never], timeout=0.2))
            late = None
        except zc.CollectiveTimeoutError as exc:
            late = str(exc)
        zc.barrier()  # (both timed out first)
        zc.send("late", 1 - r, 99)  # the receive comes at last: wait() returns it
        final = zc.wait([never], timeout=30)
        return (done == {failing}, not_done == {never}, type(failing.exception()).__name__,
                timed == (set(), {never}), 0.3 <= waited < 5, late, final == ({never}, set()),
                never.result())

    for r, out in enumerate(run_replicas(body, 2, timeout=90)):
        assert out[:5] == (True, True, "RemoteError", True, True), out
        assert out[5] == (f"as_completed: 1 (of 1) futures unfinished after 0.2 s: "
                          f"recv(source={1 - r}, tag=99) on rank {r}"), out
        assert out[6:] == (True, "late"), out


def needs_my_part():
    """Rank 0 needs rank 1 to answer its first send's link handshake and to move its part of a
    data-plane allreduce; rank 1's program only waits in wait() on something else."""
    import numpy as np

    r = zc.get_rank()
    big = np.full(1 << 18, r + 1.0)  # 2 MiB: the data plane (rank 1 must move its part)
    if r == 0:
        zc.send("hello", 1, 1, timeout=30)  # the first to rank 1: its mailbox answers the handshake
        total = zc.allreduce(big, timeout=30)
        zc.send("go", 1, 2, timeout=30)
        return float(total[0])
    gate = zc.recv_async(0, 2)
    summed = zc.allreduce_async(big)
    done, not_done = zc.wait([gate], timeout=30)  # the only place rank 1 gives the library time
    assert not not_done, "rank 0 never got this rank's part: wait() made no progress"
    return float(summed.result(timeout=5)[0]), zc.recv(0, 1, timeout=5), gate.result()


def test_a_rank_waiting_only_in_wait_moves_what_the_others_need():
    pytest.importorskip("numpy")
    assert run_replicas(needs_my_part, 2, timeout=90) == [3.0, (3.0, "hello", "go")]


def ping_pong_in_wait():
    """20 round trips, each receive waited for in wait() (rank 0 hosts the coordinator: its
    mailbox's descriptor must be among those wait() sleeps on)."""
    r = zc.get_rank()
    zc.barrier()
    started = time.monotonic()
    for i in range(20):
        if r == 0:
            zc.send(i, 1, 0)
        got = zc.recv_async(1 - r, 0)
        zc.wait([got], timeout=30)
        if r == 1:
            zc.send(got.result(0), 0, 0)
    return time.monotonic() - started


def test_a_message_wakes_a_wait_at_once_on_every_rank():
    took = run_replicas(ping_pong_in_wait, 2, timeout=90)
    assert max(took) < 4, took  # a missed wake-up costs WAIT_RECHECK_S (0.5 s) a trip: 10 s


def waits_for_a_lost_rank():
    r = zc.get_rank()
    zc.barrier()
    if r == 1:
        os._exit(0)  # lost: without teardown, mid-job
    pending = [zc.allreduce_async(1), zc.recv_async(1, 5)]
    started = time.monotonic()
    done, not_done = zc.wait(pending, timeout=30)
    return time.monotonic() - started, [type(f.exception(0)).__name__ for f in pending if f in done], \
        len(not_done)


def test_a_lost_rank_ends_the_wait_with_each_future_failed():
    from zcollective.testing import Replicas

    with Replicas(waits_for_a_lost_rank, 2, env={"ZCOLLECTIVE_LIVENESS_TIMEOUT": "2"}) as replicas:
        outcomes = replicas.wait(90)
    took, errors, left = outcomes[0].value or (None, None, None)
    assert outcomes[0].ok and errors == ["ReplicaLostError", "ReplicaLostError"] and left == 0, \
        "\n".join(o.describe() for o in outcomes)
    assert took < 20
