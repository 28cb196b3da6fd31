"""The future returned by every ``*_async`` call.

It behaves like :class:`concurrent.futures.Future` for a caller and is
awaitable from asyncio. It knows nothing of sockets: it asks its group to make
progress (``_wait``, ``_progress``, ``_fds``) and is resolved by the group.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator
from typing import Any, Callable, Generic, Optional, Protocol, TypeVar

log = logging.getLogger("zcollective")

T = TypeVar("T")

ASYNC_RECHECK_S = 0.5  # an awaiting coroutine re-checks liveness this often without traffic


class _Driver(Protocol):
    def _wait(self, future: CollectiveFuture[Any], timeout: Optional[float]) -> None: ...
    def _progress(self) -> None: ...
    def _fds(self) -> list[int]: ...


class CollectiveFuture(Generic[T]):
    """The pending result of one collective call.

    Results progress when the calling thread enters the library: any call,
    :meth:`result`, :meth:`done` or awaiting. Meanwhile ZeroMQ's I/O thread
    moves the bytes in the background, and on rank 0 the coordinator thread
    computes the results of all ranks in the background.
    """

    __slots__ = ("seq", "op", "_driver", "_done", "_value", "_error", "_callbacks")

    def __init__(self, driver: Optional[_Driver], seq: int, op: str) -> None:
        self.seq = seq
        self.op = op
        self._driver = driver
        self._done = False
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: list[Callable[[CollectiveFuture[T]], None]] = []

    def __repr__(self) -> str:
        state = "finished" if self._done else "pending"
        return f"<CollectiveFuture seq={self.seq} op={self.op} {state}>"

    # -- resolution (by the group) ------------------------------------------

    def _set_result(self, value: Any) -> None:
        self._value = value
        self._finish()

    def _set_exception(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    def _finish(self) -> None:
        self._done = True
        self._driver = None
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._run_callback(fn)

    def _run_callback(self, fn: Callable[[CollectiveFuture[T]], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("zcollective: a done-callback of %r raised", self)

    # -- the concurrent.futures.Future interface ------------------------------

    def done(self) -> bool:
        """True if the call finished (takes in what has arrived, never blocks)."""
        if not self._done and self._driver is not None:
            self._driver._progress()
        return self._done

    def running(self) -> bool:
        return not self.done()

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        """A collective call cannot be withdrawn once other replicas may use it."""
        return False

    def result(self, timeout: Optional[float] = None) -> T:
        """Wait for the result.

        Parameters
        ----------
        timeout
            Seconds to wait; ``None`` waits without a bound (a lost replica
            still ends the wait with :class:`ReplicaLostError`).

        Raises
        ------
        CollectiveTimeoutError
            ``timeout`` passed; names the ranks that had not arrived. The
            future stays pending: calling ``result`` again keeps waiting.
        RemoteError, ReplicaLostError, CallMismatchError, CollectiveError
            The call failed.
        """
        if not self._done and self._driver is not None:
            self._driver._wait(self, timeout)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Wait like :meth:`result`; return the call's exception, or None."""
        if not self._done and self._driver is not None:
            self._driver._wait(self, timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[CollectiveFuture[T]], None]) -> None:
        """Call ``fn(future)`` when the call finishes (at once if it has).
        Callbacks run in the thread that owns the group, during a library call."""
        if self._done:
            self._run_callback(fn)
        else:
            self._callbacks.append(fn)

    # -- asyncio -------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        return self._wait_async().__await__()

    async def _wait_async(self) -> T:
        """Wait without blocking the event loop: sleep on the sockets' file
        descriptors, then take in what arrived. Must run in the group's thread."""
        loop = asyncio.get_running_loop()
        while not self.done():
            driver = self._driver
            if driver is None:
                break
            woken = loop.create_future()
            fds = driver._fds()
            for fd in fds:
                loop.add_reader(fd, _wake, woken)
            handle = loop.call_later(ASYNC_RECHECK_S, _wake, woken)
            try:
                await woken
            finally:
                handle.cancel()
                for fd in fds:
                    loop.remove_reader(fd)
        return self.result(0)


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def completed(seq: int, op: str, value: Any) -> CollectiveFuture[Any]:
    """A future that is already resolved (single-replica groups)."""
    future: CollectiveFuture[Any] = CollectiveFuture(None, seq, op)
    future._set_result(value)
    return future
