"""Waiting on many futures at once: :func:`wait` and :func:`as_completed`, the
semantics of :mod:`concurrent.futures`' functions of those names, for
:class:`~zcollective.CollectiveFuture` (of one group or several, collective and
point-to-point mixed), which the stdlib's cannot wait on.

It never spins. A round makes every group with a pending future progress once
(which may resolve any of its calls, not only those waited for: a rank waiting
here still moves its group's collectives and receives), then sleeps in one poll
on all those groups' descriptors, as an awaiting coroutine does (see
:mod:`zcollective._future`): the descriptors are edge-triggered, so progress
comes before each sleep, the sleep is bounded by :data:`WAIT_RECHECK_S`, and
while it sleeps every progress drains the sockets. A future resolved by another
thread meanwhile (the stdlib's :class:`concurrent.futures.Future` too) wakes it
through a done-callback. Knows nothing of sockets but their descriptors.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION, Future
from typing import Any, NamedTuple, Optional

from ._future import CollectiveFuture, drop_callback, finished, runner_of, thread_sleeps
from ._io import _interrupts
from ._io._sockets import Wakeup
from .errors import CollectiveTimeoutError

__all__ = ["wait", "as_completed", "FIRST_COMPLETED", "FIRST_EXCEPTION", "ALL_COMPLETED"]

WAIT_RECHECK_S = 0.5  # a sleeping wait makes progress again this often without traffic (liveness,
# and a descriptor whose edge another thread took), as an awaiting coroutine does
POLLIN = 1  # zmq_poll's readable, for plain descriptors
NAMED_UNFINISHED = 8  # a timeout's message names this many of the futures still pending


class DoneAndNotDone(NamedTuple):
    """What :func:`wait` returns, as :func:`concurrent.futures.wait`."""

    done: set[Any]
    not_done: set[Any]


def wait(futures: Iterable[Any], timeout: Optional[float] = None,
         return_when: str = ALL_COMPLETED) -> DoneAndNotDone:
    """Wait for the futures (of any groups) to complete, as
    :func:`concurrent.futures.wait`: until ``return_when`` holds
    (:data:`FIRST_COMPLETED`, :data:`FIRST_EXCEPTION` or :data:`ALL_COMPLETED`)
    or ``timeout`` seconds pass (None: no bound). Every group with a pending
    future makes progress meanwhile.

    Returns
    -------
    DoneAndNotDone
        ``(done, not_done)``, two sets; a timeout raises nothing, it returns them.

    Raises
    ------
    ValueError
        ``return_when`` is not one of the three, or ``timeout`` is negative or NaN.
    """
    pending = set(futures)
    if return_when not in (FIRST_COMPLETED, FIRST_EXCEPTION, ALL_COMPLETED):
        raise ValueError(f"wait: return_when must be FIRST_COMPLETED, FIRST_EXCEPTION or ALL_COMPLETED, "
                         f"not {return_when!r}")
    deadline = _deadline(timeout, "wait")
    done: set[Any] = set()
    with _Sleeper() as sleeper:
        while True:
            newly = sleeper.round(pending)
            done |= newly
            pending -= newly
            if not pending or (newly or done) and return_when == FIRST_COMPLETED or (
                    return_when == FIRST_EXCEPTION and any(map(_failed, done))):
                break
            if not sleeper.doze(pending, deadline):
                break
    return DoneAndNotDone(done, pending)


def as_completed(futures: Iterable[Any], timeout: Optional[float] = None) -> Iterator[Any]:
    """Yield the futures (of any groups) as they complete, those already done
    first, each once, as :func:`concurrent.futures.as_completed`; every group
    with a pending future makes progress while it waits.

    Raises
    ------
    CollectiveTimeoutError
        ``timeout`` seconds (from the call) passed with futures unfinished (a
        ``TimeoutError``, as the stdlib's); names them.
    ValueError
        ``timeout`` is negative or NaN.
    """
    pending = set(futures)
    deadline = _deadline(timeout, "as_completed")
    total = len(pending)
    return _completing(pending, deadline, timeout, total)


def _completing(pending: set[Any], deadline: Optional[float], timeout: Optional[float],
                total: int) -> Iterator[Any]:
    with _Sleeper() as sleeper:
        while pending:
            newly = sleeper.round(pending)
            pending -= newly
            yield from newly
            if newly:
                continue  # (the consumer may have taken time: look again before sleeping)
            if not sleeper.doze(pending, deadline):
                named = ", ".join(sorted(map(_describe, pending))[:NAMED_UNFINISHED])
                raise CollectiveTimeoutError(f"as_completed: {len(pending)} (of {total}) futures "
                                             f"unfinished after {timeout:g} s: {named}")


class _Sleeper:
    """One wait's rounds: progress for every group with a pending future, then
    a poll on their descriptors and a wake-up pipe the futures' callbacks write."""

    def __init__(self) -> None:
        self.pipe: Optional[Wakeup] = None
        self.lock = threading.Lock()  # a callback writes only while the pipe is open
        self.watched: set[int] = set()  # ids of the futures whose callback is set
        self.callbacks: list[tuple[CollectiveFuture[Any], Any]] = []

    def __enter__(self) -> _Sleeper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        thread_sleeps(self, False)
        with self.lock:
            pipe, self.pipe = self.pipe, None
        for future, callback in self.callbacks:
            drop_callback(future, callback)
        if pipe is not None:
            pipe.close()

    def round(self, pending: set[Any]) -> set[Any]:
        """Make every group of ``pending`` progress once; the futures of ``pending`` now done."""
        runners = {id(r): r for r in map(_runner, pending) if r is not None}
        for runner in runners.values():
            runner.progress()
        return {f for f in pending if _done(f)}

    def doze(self, pending: set[Any], deadline: Optional[float]) -> bool:
        """Sleep until a descriptor of a group of ``pending`` is readable, a future of it is
        resolved by another thread, :data:`WAIT_RECHECK_S` passes or ``deadline``; False
        if ``deadline`` has passed (nothing slept)."""
        left = WAIT_RECHECK_S if deadline is None else min(WAIT_RECHECK_S, deadline - time.monotonic())
        if left <= 0:
            return False
        if self.pipe is None:
            self.pipe = Wakeup()
            thread_sleeps(self, True)  # from now on progress drains the sockets (edge-triggered fds)
        fds = {self.pipe.fd}
        for future in pending:
            if id(future) not in self.watched:
                if isinstance(future, CollectiveFuture):
                    self.watched.add(id(future))
                    self.callbacks.append((future, self.wake))
                    future.add_done_callback(self.wake)
                elif isinstance(future, Future):  # (the stdlib's: its callback stays, a no-op once the
                    self.watched.add(id(future))  # pipe is closed; it cannot be taken back)
                    future.add_done_callback(self.wake)
            runner = _runner(future)
            if runner is not None:
                fds.update(runner.fds())
        if any(map(_done, pending)):
            return True  # (a callback ran at once: resolved since the round)
        woke = _interrupts.wait([(fd, POLLIN) for fd in fds], max(1, math.ceil(left * 1000)))
        if any(fd == self.pipe.fd for fd, _ in woke):
            self.pipe.clear()
        return True

    def wake(self, future: Any) -> None:
        with self.lock:  # (never after __exit__ closed the pipe: a stdlib future's callback stays)
            if self.pipe is not None:
                self.pipe.set()


def _runner(future: Any) -> Any:
    return runner_of(future) if isinstance(future, CollectiveFuture) else None


def _done(future: Any) -> bool:
    """Done, without taking anything in (the round did)."""
    return finished(future) if isinstance(future, CollectiveFuture) else bool(future.done())


def _failed(future: Any) -> bool:
    """A done future that ended with an error (not cancelled), as FIRST_EXCEPTION counts."""
    if future.cancelled():
        return False
    return future.exception(0) is not None


def _deadline(timeout: Optional[float], what: str) -> Optional[float]:
    if timeout is None:
        return None
    if not timeout >= 0:  # (negative, or NaN)
        raise ValueError(f"{what}: timeout must be None or a number of seconds >= 0, not {timeout!r}")
    return time.monotonic() + timeout


def _describe(future: Any) -> str:
    if isinstance(future, CollectiveFuture):
        rank = getattr(runner_of(future), "rank", None)
        on = f" on rank {rank}" if rank is not None else ""
        return f"{future.op}{on}" if future.seq < 0 else f"seq {future.seq} {future.op}{on}"
    return repr(future)
