"""The call runner: a group's calls made, waited for and given up; one
:class:`Calls` per open group."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union

from ._format import _serialize
from ._format._wire import Message, error_note
from ._future import PENDING, CollectiveFuture, finished, outcome, settle, settled_when
from ._io import _interrupts
from ._io._interrupts import DEFERRED_SIGNALS, getsignal
from ._limits import INTERRUPTED_MOVE_S, STATUS_WAIT_S
from ._protocol._ops import (
    BY_NAME,
    EVERY,
    LABELS,
    NOTHING,
    ONE,
    OWN,
    Contribution,
    Op,
    Refused,
    error_contribution,
)
from .errors import CollectiveError, CollectiveTimeoutError, from_signal, is_interrupt

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

this_pid = os.getpid()  # this process's id, renewed in a forked child: no system call per call


def _forked() -> None:
    global this_pid
    this_pid = os.getpid()


if hasattr(os, "register_at_fork"):  # (no fork without it)
    os.register_at_fork(after_in_child=_forked)

_ours: dict[str, bool] = {}  # file name -> is it this package's
_basenames: dict[str, str] = {}



def bad_timeout(timeout: Any, rank: int, what: str) -> ValueError:
    """The error of a ``timeout`` that is no number of seconds a call could wait."""
    return ValueError(f"rank {rank}: {what}'s timeout must be a number of seconds >= 0, or None for no "
                      f"bound; got {timeout!r}")

# -- a call's value, as its row said it is made (the rules carry bytes, and never unpickle) --------


def _one(msg: Message) -> Any:
    return _serialize.loads(msg.segments[0])


def _own(own: Any, msg: Message) -> Any:
    return own


def _nothing(msg: Message) -> None:
    return None


def decoded(result: int, own: Any, rank: int, parts: list[list[Any]]) -> Any:
    """The value a call's ``parts`` (each a value's frames) make, as its row says (``result``:
    :data:`~._protocol._ops_types.ONE`, ...): ``own``, this rank's value, kept as it is, never
    copied back."""
    if result == ONE:
        return _serialize.loads(parts[0])
    if result == EVERY:
        return [own if i == rank else _serialize.loads(p) for i, p in enumerate(parts)]
    return own if result == OWN else None


def finisher(part: Contribution, rank: int) -> Callable[[Message], Any]:
    """What makes ``part``'s call's value from its RESULT, at ``rank``."""
    result = part.result
    if result == ONE:
        return _one
    if result == OWN:
        return partial(_own, part.own)
    return _nothing if result == NOTHING else partial(_every, part.own, rank)


def _every(own: Any, rank: int, msg: Message) -> list[Any]:
    return [own if i == rank else _serialize.loads(s) for i, s in enumerate(msg.segments)]


def _decoding(part: Contribution, rank: int, msg: Message) -> Any:
    """The data-plane job of ``part``'s call, from its plan ``msg``; a value it moves as frames
    is unpickled as its row says."""
    transfer = part.transfer
    assert transfer is not None  # (wrapped only if it has one)
    job = transfer(msg)
    if job.pickled:
        job.then(partial(decoded, part.result, part.own, rank))
    return job


class Calls:
    """The calls of one open :class:`~zcollective._lifecycle.Lifecycle`: its
    interface is :meth:`run`, :meth:`call`, :meth:`submit`, :meth:`blocking`,
    :meth:`failure_within` for the group, the waits :meth:`wait_until` and
    :meth:`drive` for the point-to-point part, and a future's (:class:`_Runner`)."""

    def __init__(self, life: Lifecycle) -> None:
        self.life = life
        self.member, self.driver, self.turns = life.member, life.driver, life.turns
        self.server, self.here, self.config = life.server, life.here, life.config
        self.pid, self.rank = life.pid, life.config.rank
        self._unsent: list[tuple[Op, int, str, str]] = []  # calls timed out or interrupted before made
        self.wait_point: Callable[[CollectiveFuture[Any], Optional[float]], None]  # a point-to-point
        # call's future's wait (set by :class:`~zcollective._point.PointToPoint`)

    def run(self, name: str, timeout: Timeout, *args: Any) -> Any:
        """A blocking call of operation ``name``: made, then waited for, within ``timeout``."""
        if isinstance(timeout, _Default):
            timeout = self.config.op_timeout
        elif timeout is not None and not timeout >= 0:  # (negative, or NaN)
            raise bad_timeout(timeout, self.rank, name)
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        warn = self.config.warn_after  # (rank 0 warns in its coordinator)
        stalls = warn is not None and self.rank != 0 and (deadline is None or now + warn < deadline)
        lead = now + warn if stalls else deadline  # type: ignore[operator]
        future = self.call(name, *args, deadline=deadline, lead=lead)
        value = outcome(future)  # (raises its error)
        if value is PENDING:  # not led to the end: waited for here
            return self.blocking(future, timeout, deadline, now)
        return value

    def call(self, name: str, *args: Any, deadline: Optional[float] = None,
             lead: Union[float, None, bool] = False) -> CollectiveFuture[Any]:
        """This replica's part of the next call of operation ``name``, made from ``args`` by
        :mod:`zcollective._protocol._ops`. An error while building it leaves the seq unused; an
        interrupt, a part the operation refuses (``ValueError`` here) or a turn not had by
        ``deadline`` (:class:`CollectiveTimeoutError`) owes an error note in its place, so the
        others' call fails too and the next one pairs up: see docs/protocol.md, *Calls*.
        ``lead``: see :meth:`submit`."""
        if tuple(map(getsignal, DEFERRED_SIGNALS)) != _interrupts.held:  # the program installed a
            _interrupts.hold_new_handlers()  # handler since: wrapped before anything is done
        frame: Any = sys._getframe(1)  # the user's code that called into the library (mismatch
        while frame is not None:  # reports need it on every call: cached per file, inline)
            filename = frame.f_code.co_filename
            ours = _ours.get(filename)
            if ours is None:
                ours = _ours[filename] = filename.startswith(_PACKAGE_DIR)
                _basenames[filename] = os.path.basename(filename)
            if not ours:
                site = f"{_basenames[filename]}:{frame.f_lineno}"
                break
            frame = frame.f_back
        else:
            site = "?"
        if self.life.closed or this_pid != self.pid:
            self.life.check_usable()  # raises, saying which
        operation = BY_NAME[name]
        try:
            part = operation.contribute(self.here, *args)
        except Refused as exc:
            if self.member.failure is None and not self.life.closed:
                self.submit(operation.code, error_contribution(exc.root, error_note(str(exc))), site)
            raise ValueError(f"rank {self.rank}: {exc}") from None
        return self.submit(operation.code, part, site, deadline, lead)

    def submit(self, op: Op, part: Contribution, site: str, deadline: Optional[float] = None,
               lead: Union[float, None, bool] = False) -> CollectiveFuture[Any]:
        """Send :meth:`call`'s part, holding the turn (taken by ``deadline``). ``lead`` (not
        False): a blocking call's wait starts here, until the call is done, ``lead`` (a time),
        or another thread wants the turn, without letting go of it if no other thread waits."""
        turns = self.turns
        try:
            taken = turns.take(deadline)
        except BaseException as exc:  # interrupted waiting for the turn: not made, a note in its place
            seq = self.member.next_seq + len(self._unsent)
            self._unsent.append((op, part.root, site, f"rank {self.rank}: seq {seq} {LABELS[op]} was "
                                 f"interrupted ({type(exc).__name__}) before it could be made"))
            raise
        if not taken:
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
            if server is not None and server.coordinator.reducing is not None and turns.held():
                # a call here takes the next seq while every rank waits for this reduction: fails the group
                raise RuntimeError(f"rank {self.rank}: a reduce function may not call zcollective "
                                   f"collectives (it runs inside the coordinator, on rank 0)")
            member, link = self.member, self.driver
            assert link is not None
            seq = member.next_seq
            try:
                if member.failure is not None or member.deferred is not None:
                    member.reserve(op, part.root, site)  # (raises the failure; a deferred one resolved)
                seq = member.next_seq
                segments, fn = part.build()
                future: CollectiveFuture[Any] = CollectiveFuture(self, seq, LABELS[op])
                finish = _one if part.result == ONE else finisher(part, self.rank)  # (ONE: no call)
                member.submit(op, part.root, segments, fn, site, part.flags, future, finish,
                              part.transfer and partial(_decoding, part, self.rank), part.reduce)
            except Exception:
                member.unreserve()
                raise
            except BaseException as exc:
                if member.failure is None and member.next_seq == seq:  # (not submitted)
                    member.reserve(op, part.root, site)
                    member.abandon(f"rank {self.rank} was interrupted ({type(exc).__name__}) before its "
                                   f"part was sent")
                with contextlib.suppress(CollectiveError):
                    link.flush()  # the others hear of it now, not at this replica's next call
                raise
            link.flush()
            outcomes = member.outcomes
            if outcomes:
                settle(outcomes)
            if (lead is not False and seq in member.calls  # this thread alone in the group: held once,
                    and turns.depth == 1 and turns.leader is None and not turns.wanting):  # nobody else waits
                try:
                    if link.lead(seq, lead):  # type: ignore[arg-type]  # (the common wait, first)
                        settle(outcomes)
                    else:
                        led = settled_when(future, outcomes, wanted=turns.wanted)
                        if not led():
                            link.nudged = True  # (drive's, inline: checked above)
                            link.wait_for(led, lead)  # type: ignore[arg-type]
                except BaseException as exc:  # given up here, as blocking() does
                    link.nudged = False
                    if not self._gave_up(future, exc, deadline):
                        raise
                finally:
                    link.nudged = False
            return future
        finally:
            turns.give()

    def teardown(self, *, timeout: Timeout = DEFAULT) -> None:
        """Finish every call made before it, wait until every replica calls
        ``teardown``, then close the sockets. Finished: every collective
        call's future holds its value (collect it after teardown too), every
        ``send_async`` went, and every ``recv_async`` got its message, or,
        when no rank can send it one any more, failed with a
        :class:`CollectiveError` naming it. A failed group closes at once.
        Calling it twice is harmless.

        Raises
        ------
        CollectiveTimeoutError
            Not every replica called ``teardown``, or the calls before it
            did not finish, within ``timeout``; the group is closed all the same.
        """
        life = self.life
        if life.closed:
            return
        if os.getpid() != life.pid:  # a forked child: the sockets are the parent's
            life.closed = True
            return
        with life.turns:
            if life.closed:
                return  # (by another thread, meanwhile)
            interrupted = False
            try:
                failure: Optional[BaseException] = life.member.failure
                if life.driver is not None and failure is None:
                    try:
                        if isinstance(timeout, _Default):
                            timeout = life.config.op_timeout
                        deadline = None if timeout is None else time.monotonic() + timeout
                        try:
                            life.finish(deadline, timeout)  # (what was called before it: finished)
                        except BaseException as exc:  # interrupted before its call: the group stays
                            interrupted = is_interrupt(exc)  # open (teardown again finishes it; an
                            raise  # ending says goodbye), never lost
                        self.blocking(self.call("teardown"), None if deadline is None
                                             else max(0.0, deadline - time.monotonic()))
                    except CollectiveTimeoutError:
                        raise
                    except Exception as exc:  # a failed group closes anyway
                        if interrupted:
                            raise
                        failure = exc
                if failure is not None:  # cleanup, often in a `finally`: said, never raised over
                    log.warning("zcollective rank %d: teardown closed a group that was already over: %s",
                                self.rank, failure)  # the exception in flight
            finally:
                if not interrupted:
                    life.close()

    def failure_within(self, wait_s: float) -> Optional[BaseException]:
        """This group's failure, if it fails within ``wait_s`` (taking in what arrives
        meanwhile); None if it has not."""
        member = self.member
        if member.failure is None and self.driver is not None and not self.life.closed:
            with contextlib.suppress(CollectiveError):  # (its failure, raised: the answer)
                self.turns.wait(lambda: member.failure is not None, time.monotonic() + wait_s,
                                self.drive, lambda wake: None)  # (a follower re-checks every slice)
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

    def blocking(self, future: CollectiveFuture[T], timeout: Timeout, deadline: Optional[float] = None,
                 started: Optional[float] = None) -> T:
        """``future.result(timeout)`` for a call this thread has just made (so
        :meth:`call` has checked the process), by ``deadline`` if given
        (``started``: when the call began); a timeout or an interrupt gives it up."""
        if isinstance(timeout, _Default):
            timeout = self.config.op_timeout
        value = outcome(future)
        if value is not PENDING:
            return value
        if started is None:
            started = time.monotonic()
            deadline = None if timeout is None else started + timeout
        try:
            self._wait(future, timeout, deadline, started)
        except BaseException as exc:
            if not self._gave_up(future, exc, deadline):
                raise
        return future.result()

    def _gave_up(self, future: CollectiveFuture[Any], exc: BaseException, deadline: Optional[float]) -> bool:
        """A blocking call's wait ended by ``exc``: a timeout or an interrupt gives
        it up on every rank alike (True: it had completed; an interrupt comes again)."""
        timed_out = isinstance(exc, CollectiveTimeoutError)
        if ((timed_out or from_signal(exc)) and self.driver is not None and not self.life.closed
                and self._give_up(future, exc, timed_out, deadline)):
            if not timed_out:  # complete everywhere: its result, and its interrupt after
                _interrupts.signal_again(exc)
            return True
        return False

    def _give_up(self, future: CollectiveFuture[Any], exc: BaseException, timed_out: bool,
                 deadline: Optional[float]) -> bool:
        """This rank gave up waiting for ``future`` (``exc``): tell the coordinator, which
        fails the call on every rank, and wait :data:`STATUS_WAIT_S` for its verdict: True
        if the call had completed before it heard. An interrupt first lets a call whose
        data moves here finish (:data:`INTERRUPTED_MOVE_S`), holds back further signals,
        and then waits for the verdict until ``deadline`` (:meth:`_await_verdict`)."""
        link, turns, member = self.driver, self.turns, self.member
        assert link is not None
        if not turns.take(time.monotonic() + STATUS_WAIT_S):  # (the holder is in a long step)
            return False
        settled = settled_when(future, member.outcomes, turns.held)
        hold = contextlib.nullcontext() if timed_out else _interrupts.deferring()
        try:
            with contextlib.suppress(CollectiveError), hold:  # (a broken link: the group failed)
                if not timed_out and member.moving(future.seq):  # (holding the turn: it never follows)
                    turns.wait(settled, time.monotonic() + INTERRUPTED_MOVE_S, self.drive, lambda wake: None)
                gave_up = [] if settled() else member.give_up(future.seq, exc, timed_out)
                link.send(gave_up)
                if gave_up:  # the verdict: an ERROR (failed on every rank), or the result, when the
                    # call completed before the coordinator heard
                    turns.wait(settled, time.monotonic() + STATUS_WAIT_S, self.drive, lambda wake: None)
            if not timed_out and not settled():
                self._await_verdict(future, exc, deadline)
            return settled() and future.exception() is None
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
            self.wait_until(future, deadline, follow=False)

    def wait_call(self, future: CollectiveFuture[Any], timeout: Optional[float]) -> None:
        """A future's ``result(timeout)``: until it is done or ``timeout``."""
        if self.driver is None or self.life.closed:
            return
        _interrupts.hold_new_handlers()
        self.life.check_process()
        if future.seq < 0:  # a point-to-point call's future: its own wait and wording
            self.wait_point(future, timeout)
            return
        started = time.monotonic()
        self._wait(future, timeout, None if timeout is None else started + timeout, started)

    def _wait(self, future: CollectiveFuture[Any], timeout: Optional[float], deadline: Optional[float],
              started: float) -> None:
        """Until ``future`` is done or ``deadline`` (``timeout`` after ``started``):
        then the coordinator says whom it waits for; past ``warn_after``, once before."""
        link = self.driver
        if link is None or self.life.closed:
            return
        turns = self.turns
        warn, since = self.config.warn_after, None
        if warn is not None and self.rank != 0 and (deadline is None or started + warn < deadline):
            if self.wait_until(future, started + warn):  # rank 0 warns in its coordinator
                return
            since = self._say_stalled(future, warn, started)
        if self.wait_until(future, deadline):
            if since is not None:
                log.warning("zcollective rank %d: seq %d %s completed after %.0f s", self.rank,
                            future.seq, future.op, time.monotonic() - since)
            return
        if not turns.take(time.monotonic() + STATUS_WAIT_S):  # the holder is in a long step
            raise CollectiveTimeoutError(self.member.timeout_message(future.seq, timeout, None, link.busy()))
        try:
            seq = future.seq
            message = self.member.timeout_message(seq, timeout, link.ask_status(seq), link.busy())
            if settled_when(future, self.member.outcomes)():
                return  # it arrived while the coordinator was asked
            self.member.check()  # the group failed meanwhile (say, rank 0 ended): that is the answer
            raise CollectiveTimeoutError(message)
        finally:
            turns.give()

    def wait_until(self, future: CollectiveFuture[Any], deadline: Optional[float],
                   follow: bool = True) -> bool:
        """Wait (leading, or following if ``follow``) until ``future`` is done (True) or ``deadline``."""
        turns = self.turns
        return turns.wait(settled_when(future, self.member.outcomes, turns.held), deadline, self.drive,
                          (lambda wake: future.add_done_callback(lambda _: wake())) if follow else
                          lambda wake: None)

    def _say_stalled(self, future: CollectiveFuture[Any], waited: float, started: float) -> Optional[float]:
        """A call waited ``waited`` s (``warn_after``): ask the coordinator whom
        for, and say so once (rule 11 of the coordinator). If said, when the
        call started (``time.monotonic``'s clock: its end is timed from there), else None."""
        link, turns = self.driver, self.turns
        if link is None or finished(future) or not turns.take(time.monotonic() + STATUS_WAIT_S):
            return None
        try:
            with contextlib.suppress(CollectiveError):
                status = link.ask_status(future.seq)
                line = (status or {}).get("stall")
                if isinstance(line, str) and not settled_when(future, self.member.outcomes)():
                    log.warning("zcollective rank %d: %s", self.rank, line[:2000])
                    member = self.member
                    call = member.calls.get(future.seq)  # (made before this wait began, if async)
                    return time.monotonic() - (member.stopwatch() - call.started) if call is not None \
                        else started
            return None
        finally:
            turns.give()

    def drive(self, until: Callable[[], bool], deadline: Optional[float], nudged: bool) -> bool:
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

    def progress(self) -> None:
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

    _progress = progress  # (the name tests use)

    def fds(self) -> list[int]:
        """The descriptors a future's awaiting event loop watches."""
        if self.driver is None or self.life.closed:
            return []
        self.life.check_process()
        data = self.driver.data
        return self.driver.fds() + (data.fds() if data is not None else [])
