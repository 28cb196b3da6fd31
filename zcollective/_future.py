"""The future returned by every ``*_async`` call: a
:class:`concurrent.futures.Future` to its caller, awaitable from asyncio. It
knows nothing of sockets: it asks its group's call runner (:class:`_Runner`)
to make progress, and the runner resolves it through this module's functions
(:func:`settle`, :func:`outcome`, :func:`finished`, :func:`fail`,
:func:`settled_when`).

Awaiting: every coroutine awaiting a future of one group in one event loop
sleeps on that group's one :class:`_AsyncWaiter`, which watches the group's
descriptors while any sleeps on it (rule 1); whatever wakes it (a readable fd,
its recheck, a call made meanwhile) makes progress once for all (rule 2); the
descriptors are edge-triggered, so a coroutine makes progress itself before it
sleeps, and every progress drains the sockets (rule 3).
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Generator
from concurrent.futures import CancelledError
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Generic, Optional, Protocol, TypeVar

if TYPE_CHECKING:
    import asyncio  # at run time, imported by the program that awaits: not on import here

log = logging.getLogger("zcollective")

T = TypeVar("T")

ASYNC_RECHECK_S = 0.5  # an awaiting coroutine re-checks liveness this often without traffic


class _Runner(Protocol):
    """What a future asks of its group (:class:`~zcollective._calls.Calls`)."""

    def wait_call(self, future: CollectiveFuture[Any], timeout: Optional[float]) -> None:
        """Until ``future`` is done, or ``timeout`` (its ``result(timeout)``)."""

    def progress(self) -> None:
        """Take in what has arrived, without blocking."""

    def fds(self) -> list[int]:
        """The descriptors an awaiting event loop watches."""


class CollectiveFuture(Generic[T]):
    """The pending result of one collective call.

    Results progress when a thread of the program enters the library: any
    call, :meth:`result`, :meth:`done` or awaiting. Meanwhile ZeroMQ's I/O
    thread moves the bytes in the background, and on rank 0, while its
    program is elsewhere, a background thread computes the results of all
    ranks. Any thread may wait for it.
    """

    __slots__ = ("seq", "op", "status", "canceller", "_runner", "_done", "_value", "_error", "_callbacks")

    def __init__(self, runner: Optional[_Runner], seq: int, op: str) -> None:
        self.seq = seq
        self.op = op
        self.status: Any = None  # a receive's: where its message came from (a Status)
        self.canceller: Optional[Callable[[CollectiveFuture[Any]], bool]] = None  # a receive's: its cancel()
        self._runner = runner
        self._done = False
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: list[Callable[[CollectiveFuture[T]], None]] = []
        if runner is not None and _waiters:
            _sent(runner)  # the group creates a future as it sends its call (before the send)

    def __repr__(self) -> str:
        state = "finished" if self._done else "pending"
        return f"<CollectiveFuture seq={self.seq} op={self.op} {state}>"

    # -- resolution (by the group) ------------------------------------------

    def _set_result(self, value: Any) -> None:
        self._value = value
        self._done = True  # before looking for callbacks: one another thread adds meanwhile sees
        if self._callbacks:  # it (add_done_callback), or is seen here
            self._finish()
        else:  # (what _finish does when there is no callback to run)
            self._runner = None

    def _set_exception(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    def _finish(self) -> None:
        self._done = True
        self._runner = None
        callbacks = self._callbacks  # each taken by one pop (a thread adding one meanwhile may
        try:  # take its own back: see add_done_callback)
            while (fn := _take(callbacks)) is not None:
                self._run_callback(fn)
        finally:  # one raised KeyboardInterrupt (or SystemExit): the others still run, and each
            # awaiting coroutine is woken; the first such error goes on
            while (fn := _take(callbacks)) is not None:
                try:
                    self._run_callback(fn)
                except BaseException:  # noqa: B036 (the first one is already on its way)
                    log.exception("zcollective: a done-callback of %r raised", self)

    def _run_callback(self, fn: Callable[[CollectiveFuture[T]], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("zcollective: a done-callback of %r raised", self)

    # -- the concurrent.futures.Future interface ------------------------------

    def done(self) -> bool:
        """True if the call finished (takes in what has arrived, never blocks)."""
        if not self._done and self._runner is not None:
            self._runner.progress()
        return self._done

    def running(self) -> bool:
        return not self.done()

    def cancelled(self) -> bool:
        """Was it cancelled (:meth:`cancel` returned True)?"""
        return self._done and type(self._error) is CancelledError

    def cancel(self) -> bool:
        """Cancel a receive (``recv_async``) not yet matched: True, and the
        future ends cancelled (``result()`` raises
        ``concurrent.futures.CancelledError``); a message that comes later
        goes to a later receive. False for a receive matched or done, for a
        send (not cancellable, as MPI-4 deprecates it), and for a collective
        call (it cannot be withdrawn once other replicas may use it)."""
        if self._done:
            return self.cancelled()
        canceller = self.canceller
        return canceller is not None and canceller(self)

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
            future stays pending: calling ``result`` again keeps waiting. A
            point-to-point call's says what it waited for, and the call is
            taken back: its future ends with this error.
        RemoteError, ReplicaLostError, CallMismatchError, CollectiveError
            The call failed.
        """
        if not self._done and self._runner is not None:
            self._runner.wait_call(self, timeout)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Wait like :meth:`result`; return the call's exception, or None."""
        if not self._done and self._runner is not None:
            self._runner.wait_call(self, timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[CollectiveFuture[T]], None]) -> None:
        """Call ``fn(future)`` when the call finishes (at once if it has).
        Callbacks run in the thread that takes the result in, during a
        library call (with several threads, whichever waits at the time)."""
        if not self._done:
            self._callbacks.append(fn)
            if not self._done:
                return
            try:  # resolved meanwhile, by another thread: run it here unless that one took it
                self._callbacks.remove(fn)
            except ValueError:
                return
        self._run_callback(fn)

    # -- asyncio -------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        return self._wait_async().__await__()

    async def _wait_async(self) -> T:
        """Wait without blocking the event loop: sleep on the group's shared
        waiter until this call finishes (in any thread's loop; another
        thread that takes the result in wakes it through its loop)."""
        import asyncio  # awaited: asyncio runs, so this costs a lookup

        loop = asyncio.get_running_loop()
        while not self.done():  # progress before sleeping: the fds only fire on news
            runner = self._runner
            if runner is None:
                break
            woken: asyncio.Future[None] = loop.create_future()
            waiter = _AsyncWaiter.enter(runner, loop, woken)
            wake = partial(_wake_on_finish, waiter, woken)
            self.add_done_callback(wake)  # (resolved meanwhile by another thread: wakes at once)
            try:
                await woken
            finally:
                waiter.leave(woken)
                try:
                    self._callbacks.remove(wake)  # cancelled before the call finished
                except ValueError:
                    pass
        return self.result(0)


class _AsyncWaiter:
    """The one reader on a group's fds in one event loop, shared by every
    coroutine of that loop awaiting a future of that group (see the module docstring)."""

    __slots__ = ("runner", "loop", "sleepers", "fds", "recheck", "kicked")

    def __init__(self, runner: _Runner, loop: asyncio.AbstractEventLoop) -> None:
        self.runner = runner
        self.loop = loop
        self.sleepers: set[asyncio.Future[None]] = set()
        self.fds = runner.fds()
        self.recheck: Optional[asyncio.TimerHandle] = None
        self.kicked = False

    @classmethod
    def enter(cls, runner: _Runner, loop: asyncio.AbstractEventLoop,
              sleeper: asyncio.Future[None]) -> _AsyncWaiter:
        """Add ``sleeper`` to the group's waiter, starting one if none runs."""
        waiter = _waiters.get((runner, loop))
        if waiter is None:
            waiter = cls(runner, loop)
            _waiters[(runner, loop)] = waiter
            for fd in waiter.fds:
                loop.add_reader(fd, waiter.progress)
            waiter.arm()
        waiter.sleepers.add(sleeper)
        return waiter

    def leave(self, sleeper: asyncio.Future[None]) -> None:
        """Remove ``sleeper`` (again is harmless); the last one out stops the waiter."""
        self.sleepers.discard(sleeper)
        if not self.sleepers and self.active():
            del _waiters[(self.runner, self.loop)]
            for fd in self.fds:
                self.loop.remove_reader(fd)
            if self.recheck is not None:
                self.recheck.cancel()

    def active(self) -> bool:
        return _waiters.get((self.runner, self.loop)) is self

    def arm(self) -> None:
        # read at each arming, so a changed ASYNC_RECHECK_S takes effect
        self.recheck = self.loop.call_later(ASYNC_RECHECK_S, self.on_recheck)

    def on_recheck(self) -> None:
        self.progress()
        if self.active():
            self.arm()

    def kick(self) -> None:
        """Make progress on the loop's next turn (once, however often kicked)."""
        if not self.kicked:
            self.kicked = True
            self.loop.call_soon(self.on_kick)

    def on_kick(self) -> None:
        self.kicked = False
        self.progress()

    def progress(self) -> None:
        """Take in what arrived, for every sleeper at once: the futures it
        resolves wake their own sleepers."""
        if not self.active():
            return  # a reader or timer that fired just as the last sleeper left
        try:
            self.runner.progress()
        except Exception:
            # nobody would wake them otherwise: each sleeper makes progress itself
            # (``done()``) and meets the error in its own coroutine
            for sleeper in list(self.sleepers):
                _wake(sleeper)
                self.leave(sleeper)


# One waiter per (group, event loop) while some coroutine awaits that group there;
# only the loop's own thread touches its entries.
_waiters: dict[tuple[_Runner, asyncio.AbstractEventLoop], _AsyncWaiter] = {}


def settle(outcomes: deque[Any], waited: Optional[CollectiveFuture[Any]] = None) -> Any:
    """Apply what the rules said calls came to (``Member.outcomes``: each a
    ``future``, ``error``, ``make``), in order, holding the group's turn: a
    value is made (unpickled) and done-callbacks run here. One interrupted
    stays queued, for the next wait to apply. Returns ``waited``'s value once
    it has one, else :data:`PENDING` (not done, or failed: :func:`outcome`
    raises its error), so that a blocking call asks once."""
    while outcomes:
        outcome = outcomes[0]
        future = outcome.future
        if not future._done:
            if outcome.status is not None:
                future.status = outcome.status
            if outcome.error is not None:
                future._set_exception(outcome.error)
            else:
                try:
                    value = outcome.make() if outcome.make is not None else None
                except Exception as exc:
                    future._set_exception(exc)
                else:  # (_set_result, inline: once per call)
                    future._value = value
                    future._done = True
                    if future._callbacks:
                        future._finish()
                    else:
                        future._runner = None
        if outcomes and outcomes[0] is outcome:  # (a done-callback that waited applied it and more)
            outcomes.popleft()
    if waited is None or not waited._done or waited._error is not None:
        return PENDING
    return waited._value


PENDING: Any = object()  # what :func:`outcome` and :func:`settle` say of a call not yet done


def outcome(future: CollectiveFuture[T]) -> T:
    """``future``'s value, or its error raised; :data:`PENDING` if not done."""
    if not future._done:
        return PENDING  # type: ignore[no-any-return]
    if future._error is not None:
        raise future._error
    return future._value  # type: ignore[no-any-return]


def finished(future: CollectiveFuture[Any]) -> bool:
    """Is ``future`` done (without taking anything in)?"""
    return future._done


def fail(future: CollectiveFuture[Any], error: BaseException) -> None:
    """End ``future`` with ``error`` (a call its runner took back)."""
    future._set_exception(error)


def runner_of(future: CollectiveFuture[Any]) -> Optional[_Runner]:
    """The call runner that makes ``future`` progress (None once it is done)."""
    return future._runner


def drop_callback(future: CollectiveFuture[Any], fn: Callable[[CollectiveFuture[Any]], None]) -> None:
    """Take back a done-callback ``fn`` of ``future`` that has not run (a wait that ended)."""
    try:
        future._callbacks.remove(fn)
    except ValueError:
        pass


def thread_sleeps(key: object, sleeps: bool) -> None:
    """A thread (``key``, any unique object) starts (``sleeps``) or ends a sleep on groups'
    descriptors (:func:`zcollective.wait`): while it sleeps, every progress drains the sockets,
    as for a sleeping coroutine (rule 3)."""
    if sleeps:
        _waiters[(key, None)] = key  # type: ignore[index, assignment]  # (counted by sleeping() only)
    else:
        _waiters.pop((key, None), None)  # type: ignore[arg-type]


def settled_when(future: CollectiveFuture[Any], outcomes: deque[Any],
                 held: Optional[Callable[[], bool]] = None,
                 wanted: Optional[Callable[[], bool]] = None) -> Callable[[], bool]:
    """A wait's predicate, asked after every step: is ``future`` done, once
    ``outcomes`` are applied (by the turn's holder: ``held()``, or None when
    the waiter holds it)? ``wanted()`` ends it too (a holder's lead)."""
    if wanted is not None:
        def led() -> bool:
            if outcomes:
                settle(outcomes)
            return future._done or wanted()
        return led
    if held is None:
        def holding() -> bool:
            if outcomes:
                settle(outcomes)
            return future._done
        return holding

    def settled() -> bool:
        if outcomes and held():
            settle(outcomes)
        return future._done
    return settled


sleeping: Callable[[], int] = _waiters.__len__  # does any coroutine sleep on a group's file descriptors
# (so every progress must drain the sockets: rule 3)? (a C method: no Python call per message)


def _sent(runner: _Runner) -> None:
    """``runner`` is about to send a call: its waiter in this thread's loop, if any, makes
    progress at the loop's next turn, after the send (which makes ZeroMQ take in its pending
    commands, swallowing the fd's edge of a reply that arrived meanwhile: rule 2)."""
    loop = _running_loop()
    if loop is not None and (waiter := _waiters.get((runner, loop))) is not None:
        waiter.kick()


def _wake_on_finish(waiter: _AsyncWaiter, sleeper: asyncio.Future[None],
                    future: CollectiveFuture[Any]) -> None:
    loop = waiter.loop
    if _running_loop() is not loop:  # another thread took the result in: the loop's own thread wakes it
        try:
            loop.call_soon_threadsafe(_wake_on_finish, waiter, sleeper, future)
        except RuntimeError:
            pass  # its loop is closed: nobody awaits there any more
        return
    _wake(sleeper)
    # leave now, not when the coroutine resumes: the group may close its fds right after
    waiter.leave(sleeper)


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    """This thread's running event loop, or None (asyncio never imported: none runs)."""
    asyncio = sys.modules.get("asyncio")
    try:
        return None if asyncio is None else asyncio.get_running_loop()
    except RuntimeError:
        return None


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def _take(callbacks: list[Any]) -> Any:
    """The first callback of ``callbacks``, taken (None: none is left)."""
    try:
        return callbacks.pop(0)
    except IndexError:
        return None
