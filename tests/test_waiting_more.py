"""zcollective.wait and as_completed wake for a stdlib concurrent.futures.Future resolved by another
thread at once, not at the wait's periodic recheck (review of issue 46): the recheck is set far
beyond the test's bound, so a wait that only notices it there fails."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import zcollective as zc
from zcollective import _waiting

LATE_S = 0.1  # the stdlib future is done this long after the wait starts
BOUND_S = 5.0  # a wait that wakes for it returns well within this


@pytest.fixture
def slow_recheck(monkeypatch):
    monkeypatch.setattr(_waiting, "WAIT_RECHECK_S", 60.0)


@pytest.mark.parametrize("mixed", [False, True])
def test_wait_wakes_for_a_stdlib_future(slow_recheck, mixed):
    with zc.Group(rank=0, size=1) as group, ThreadPoolExecutor(1) as pool:
        pending = group.recv_async(0, 9)
        stdlib = pool.submit(time.sleep, LATE_S)
        started = time.monotonic()
        done, not_done = zc.wait([stdlib, pending] if mixed else [stdlib], timeout=2 * BOUND_S,
                                 return_when=zc.FIRST_COMPLETED)
        took = time.monotonic() - started
        assert done == {stdlib} and took < BOUND_S, took
        assert pending.cancel()


def test_as_completed_wakes_for_a_stdlib_future(slow_recheck):
    with zc.Group(rank=0, size=1) as group, ThreadPoolExecutor(1) as pool:
        group.send("here", 0, 1)
        received = group.recv_async(0, 1)
        stdlib = pool.submit(time.sleep, LATE_S)
        started = time.monotonic()
        order = list(zc.as_completed([stdlib, received], timeout=2 * BOUND_S))
        took = time.monotonic() - started
        assert order == [received, stdlib] and took < BOUND_S, (order, took)
