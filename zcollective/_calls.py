"""The call runner: a group's calls made, waited for and given up. One
:class:`Calls` per open group; its public methods are the group's, its
underscored ones what a :class:`~zcollective.CollectiveFuture` asks of it."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union

from ._format._wire import error_note
from ._future import CollectiveFuture, settle
from ._io import _interrupts
from ._io._interrupts import DEFERRED_SIGNALS, getsignal
from ._limits import INTERRUPTED_MOVE_S, STATUS_WAIT_S
from ._protocol._ops import BY_NAME, LABELS, Contribution, Op, Refused, error_contribution
from .errors import CollectiveError, CollectiveTimeoutError, from_signal

if TYPE_CHECKING:
    from ._lifecycle import Lifecycle

log = logging.getLogger("zcollective")

T = TypeVar("T")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _Default:
    def __repr__(self) -> str:
        return "<the group's op_timeout>"


DEFAULT = _Default()  # "use the group's op_timeout"
Timeout = Union[float, None, _Default]

_process = os.getpid()  # this process's id, renewed in a forked child: no system call per call


def _forked() -> None:
    global _process
    _process = os.getpid()


if hasattr(os, "register_at_fork"):  # (no fork without it)
    os.register_at_fork(after_in_child=_forked)

_ours: dict[str, bool] = {}  # file name -> is it this package's
_basenames: dict[str, str] = {}


def _callsite() -> str:
    """``file.py:line`` of the user's code that called into the library.
    On every call (mismatch reports need it), so it caches per file."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        ours = _ours.get(filename)
        if ours is None:
            ours = _ours[filename] = filename.startswith(_PACKAGE_DIR)
            _basenames[filename] = os.path.basename(filename)
        if not ours:
            return f"{_basenames[filename]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class Calls:
    """The calls of one open :class:`~zcollective._lifecycle.Lifecycle`."""

    def __init__(self, life: Lifecycle) -> None:
        self.life = life
        self.member, self.driver, self.turns = life.member, life.driver, life.turns
        self.server, self.here, self.config = life.server, life.here, life.config
        self.pid, self.rank = life.pid, life.config.rank
        self._unsent: list[tuple[Op, int, str, str]] = []  # calls that timed out before they were made
        self.wait_point: Callable[[CollectiveFuture[Any], Optional[float]], None]  # a point-to-point
        # call's future's wait (set by :class:`~zcollective._point.PointToPoint`)

    def run(self, name: str, timeout: Timeout, *args: Any) -> Any:
        """A blocking call of operation ``name``: made, then waited for, within ``timeout``."""
        if isinstance(timeout, _Default):
            timeout = self.config.op_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        return self.blocking(self.call(name, *args, deadline=deadline), timeout)

    def call(self, name: str, *args: Any, deadline: Optional[float] = None) -> CollectiveFuture[Any]:
        """This replica's part of the next call of operation ``name``, made from ``args`` by
        :mod:`zcollective._protocol._ops`. An error while building it leaves the seq unused; an
        interrupt, a part the operation refuses (``ValueError`` here) or a turn not had by
        ``deadline`` (:class:`CollectiveTimeoutError`) owes an error note in its place, so the
        others' call fails too and the next one pairs up: see docs/protocol.md, *Calls*."""
        if tuple(map(getsignal, DEFERRED_SIGNALS)) != _interrupts.held:  # the program installed a
            _interrupts.hold_new_handlers()  # handler since: wrapped before anything is done
        site = _callsite()
        if self.life.closed or _process != self.pid:
            self.life.check_usable()  # raises, saying which
        operation = BY_NAME[name]
        try:
            part = operation.contribute(self.here, *args)
        except Refused as exc:
            if self.member.failure is None and not self.life.closed:
                self.submit(operation.code, error_contribution(exc.root, error_note(str(exc))), site)
            raise ValueError(f"rank {self.rank}: {exc}") from None
        return self.submit(operation.code, part, site, deadline)

    def submit(self, op: Op, part: Contribution, site: str,
               deadline: Optional[float] = None) -> CollectiveFuture[Any]:
        """Send :meth:`call`'s part, holding the turn (taken by ``deadline``)."""
        turns = self.turns
        if not turns.take(deadline):
            busy = (self.driver.busy() if self.driver is not None else None) or "another thread holds it"
            why = (f"rank {self.rank}: seq {self.member.next_seq + len(self._unsent)} {LABELS[op]} timed "
                   f"out before it could be made ({busy}); an error note goes in its place, so the "
                   f"others' call fails too")
            self._unsent.append((op, part.root, site, why))
            raise CollectiveTimeoutError(why)
        try:
            if self._unsent:
                self._note_unsent()
            if self.life.closed:  # torn down by another thread meanwhile
                self.life.check_usable()
            server = self.server
            if server is not None and server.reducing_here():
                # a call here would take the next seq while every rank waits for this reduction,
                # so the group would fail for good
                raise RuntimeError(f"rank {self.rank}: a reduce function may not call zcollective "
                                   f"collectives (it runs inside the coordinator, on rank 0)")
            member, link = self.member, self.driver
            assert link is not None
            try:
                seq = member.reserve(op, part.root, site)
                segments, fn = part.build()
                future: CollectiveFuture[Any] = CollectiveFuture(self, seq, LABELS[op])
                member.submit(op, part.root, segments, fn, site, part.flags, future, part.finish,
                              part.transfer, part.reduce)
            except Exception:
                member.unreserve()
                raise
            except BaseException as exc:
                member.abandon(f"rank {self.rank} was interrupted ({type(exc).__name__}) before its "
                               f"part was sent")
                with contextlib.suppress(CollectiveError):
                    link.flush()  # the others hear of it now, not at this replica's next call
                raise
            link.flush()
            if member.outcomes:
                settle(member.outcomes)
            return future
        finally:
            turns.give()

    def failure_within(self, wait_s: float) -> Optional[BaseException]:
        """This group's failure, if it fails within ``wait_s`` (taking in what arrives
        meanwhile); None if it has not."""
        member = self.member
        if member.failure is None and self.driver is not None and not self.life.closed:
            with contextlib.suppress(CollectiveError):  # (its failure, raised: the answer)
                self.turns.wait(lambda: member.failure is not None, time.monotonic() + wait_s,
                                self._drive, lambda wake: None)  # (a follower re-checks every slice)
        return member.failure

    def _note_unsent(self) -> None:
        """Holding the turn: an error note for each call that timed out
        before it could be made, in its place (so the calls pair up again)."""
        member = self.member
        while self._unsent:
            op, root, site, why = self._unsent.pop(0)
            if member.failure is None and not self.life.closed:
                member.reserve(op, root, site)
                member.abandon(why)
        if member.owed and self.driver is not None:
            with contextlib.suppress(CollectiveError):
                self.driver.flush()

    def blocking(self, future: CollectiveFuture[T], timeout: Timeout) -> T:
        """``future.result(timeout)`` for a call this thread has just made
        (so :meth:`call` has checked the process)."""
        if isinstance(timeout, _Default):
            timeout = self.config.op_timeout
        if not future._done:
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                self._wait(future, timeout, checked=True)
            except BaseException as exc:  # given up here: it fails on every rank alike
                timed_out = isinstance(exc, CollectiveTimeoutError)
                if ((timed_out or from_signal(exc)) and self.driver is not None and not self.life.closed
                        and self._give_up(future, exc, timed_out, deadline)):
                    if not timed_out:  # complete everywhere: its result, and its interrupt after
                        _interrupts.signal_again(exc)
                    return future._value  # type: ignore[no-any-return]
                raise
        if future._error is not None:
            raise future._error
        return future._value  # type: ignore[no-any-return]

    def _give_up(self, future: CollectiveFuture[Any], exc: BaseException, timed_out: bool,
                 deadline: Optional[float]) -> bool:
        """This rank gave up waiting for ``future`` (``exc``): tell the
        coordinator, which fails the call on every rank, and wait for its
        verdict: True if the call had completed before it heard. A timeout
        waits :data:`STATUS_WAIT_S`. An interrupt first lets a call whose data
        moves here finish (:data:`INTERRUPTED_MOVE_S`: a rank that finished it
        would keep its result), then waits as long as a timeout, holding back
        further signals, then, saying so, until the call's ``deadline`` (a
        reduce function still running), where another interrupt stops it."""
        link, turns, member = self.driver, self.turns, self.member
        assert link is not None
        if not turns.take(time.monotonic() + STATUS_WAIT_S):  # (the holder is in a long step)
            return False
        settled, hold = self._settled(future), (contextlib.nullcontext() if timed_out else
                                                _interrupts.deferring())
        try:
            with contextlib.suppress(CollectiveError), hold:  # (a broken link: the group failed)
                if not timed_out and member.moving(future.seq):  # (holding the turn: it never follows)
                    turns.wait(settled, time.monotonic() + INTERRUPTED_MOVE_S, self._drive, lambda wake: None)
                gave_up = [] if settled() else member.give_up(future.seq, exc, timed_out)
                link.send(gave_up)
                if gave_up:  # the verdict: an ERROR (failed on every rank), or the result, when the
                    # call completed before the coordinator heard
                    turns.wait(settled, time.monotonic() + STATUS_WAIT_S, self._drive, lambda wake: None)
            if not timed_out and not settled():
                self._await_verdict(future, exc, deadline)
            return settled() and future._error is None
        finally:
            turns.give()

    def _await_verdict(self, future: CollectiveFuture[Any], exc: BaseException,
                       deadline: Optional[float]) -> None:
        """:meth:`_give_up`'s wait after an interrupt, past its first second:
        until ``deadline``, or another interrupt."""
        link = self.driver
        if link is None or future.seq not in self.member.calls:
            return  # (the group failed, or the call settled: it says so)
        log.warning("zcollective rank %d: seq %d %s was interrupted (%s); waiting for the coordinator's "
                    "verdict, so that it ends alike on every rank (%s); interrupt again not to wait",
                    self.rank, future.seq, future.op, type(exc).__name__,
                    link.busy() or "the others may have its result")
        with contextlib.suppress(CollectiveError):
            self.turns.wait(self._settled(future), deadline, self._drive, lambda wake: None)

    def _wait(self, future: CollectiveFuture[Any], timeout: Optional[float], checked: bool = False) -> None:
        """Until ``future`` is done or ``timeout``: then the coordinator says whom it waits for."""
        link = self.driver
        if link is None or self.life.closed:
            return
        if not checked:
            _interrupts.hold_new_handlers()
            self.life.check_process()
        if future.seq < 0:  # a point-to-point call's future: its own wait and wording
            self.wait_point(future, timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        turns = self.turns
        warn, since = self.config.warn_after, None
        if warn is not None and self.rank != 0 and (deadline is None or time.monotonic() + warn < deadline):
            if self._wait_until(future, time.monotonic() + warn):  # rank 0 warns in its coordinator
                return
            since = self._say_stalled(future, warn)
        if self._wait_until(future, deadline):
            if since is not None:
                log.warning("zcollective rank %d: seq %d %s completed after %.0f s", self.rank,
                            future.seq, future.op, time.monotonic() - since)
            return
        if not turns.take(time.monotonic() + STATUS_WAIT_S):  # the holder is in a long step
            raise CollectiveTimeoutError(self.member.timeout_message(future.seq, timeout, None, link.busy()))
        try:
            message = link.timeout_message(future.seq, timeout)
            if self._settled(future)():
                return  # it arrived while the coordinator was asked
            self.member.check()  # the group failed meanwhile (say, rank 0 ended): that is the answer
            raise CollectiveTimeoutError(message)
        finally:
            turns.give()

    def _wait_until(self, future: CollectiveFuture[Any], deadline: Optional[float]) -> bool:
        """Wait (leading or following) until ``future`` is done (True) or ``deadline``."""
        return self.turns.wait(self._settled(future), deadline, self._drive,
                               lambda wake: future.add_done_callback(lambda _: wake()))

    def _settled(self, future: CollectiveFuture[Any]) -> Callable[[], bool]:
        """A wait's predicate: is ``future`` done, once what the rules said
        calls came to is applied (by the turn's holder only: a follower just
        looks)? Asked after every step, so it looks its objects up once."""
        outcomes, held = self.member.outcomes, self.turns.held

        def settled() -> bool:
            if outcomes and held():
                settle(outcomes)
            return future._done
        return settled

    def _say_stalled(self, future: CollectiveFuture[Any], waited: float) -> Optional[float]:
        """A call waited ``waited`` s (``warn_after``): ask the coordinator whom
        for, and say so once (rule 11 of the coordinator). If said, when the
        call started (``time.monotonic``'s clock: its end is timed from there), else None."""
        link, turns = self.driver, self.turns
        if link is None or future._done or not turns.take(time.monotonic() + STATUS_WAIT_S):
            return None
        try:
            with contextlib.suppress(CollectiveError):
                status = link.ask_status(future.seq)
                line = (status or {}).get("stall")
                if isinstance(line, str) and not self._settled(future)():
                    log.warning("zcollective rank %d: %s", self.rank, line[:2000])
                    member, now = self.member, time.monotonic()
                    call = member.calls.get(future.seq)  # (made before this wait began, if async)
                    return now - (member.stopwatch() - call.started) if call is not None else now - waited
            return None
        finally:
            turns.give()

    def _drive(self, until: Callable[[], bool], deadline: Optional[float], nudged: bool) -> bool:
        """The leading thread's wait (see :mod:`zcollective._io._turns`):
        ``nudged``, another thread wanting the turn ends it too."""
        link = self.driver
        if link is None or self.life.closed:
            return True  # (closed meanwhile: every call was failed)
        if self._unsent:
            self._note_unsent()
        link.nudged = nudged
        try:
            return link.wait_for(until, deadline)
        finally:
            link.nudged = False

    def _progress(self) -> None:
        """Take in what has arrived, if no other thread is at work in the library."""
        if self.driver is not None and not self.life.closed:
            _interrupts.hold_new_handlers()
            self.life.check_process()
            turns = self.turns
            if not turns.try_take():
                return  # another thread is at work in the library: it takes in what arrives
            try:
                if not self.life.closed:
                    self.driver.progress()
                    settle(self.member.outcomes)
            finally:
                turns.give()

    def _fds(self) -> list[int]:
        """The descriptors a future's awaiting event loop watches."""
        if self.driver is None or self.life.closed:
            return []
        self.life.check_process()
        data = self.driver.data
        return self.driver.fds() + (data.fds() if data is not None else [])
