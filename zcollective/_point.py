"""The point-to-point call runner: a group's sends, receives and probes made,
waited for and given up, beside :class:`~zcollective._calls.Calls`, whose turn
and waits it shares. The rules are :mod:`zcollective._protocol._p2p`'s."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from . import _calls
from ._calls import Calls, Timeout, _Default
from ._format import _serialize
from ._future import CollectiveFuture, settle
from ._io import _interrupts
from ._io._interrupts import DEFERRED_SIGNALS, getsignal
from ._limits import STATUS_WAIT_S
from ._protocol._p2p import Mail, Status, check_rank, check_tag, describe
from .errors import CollectiveError, CollectiveTimeoutError, from_signal


class PointToPoint:
    """The point-to-point calls of one open group (its :class:`Calls`)."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.rank, self.size = calls.rank, calls.config.num_replicas
        calls.wait_point = self.wait

    def send(self, value: Any, dest: Any, tag: Any, deadline: Optional[float] = None,
             lead: bool = False) -> CollectiveFuture[None]:
        dest, tag = check_rank(dest, self.size, "dest"), check_tag(tag, False)
        segment = _serialize.dumps(value)  # (a value that cannot travel: nothing is sent)
        what = f"send(dest={dest}, tag={tag})"
        return self._make(what, lambda mail, f: mail.send(dest, tag, segment, f), deadline, lead)

    def receive(self, source: Any, tag: Any, deadline: Optional[float] = None,
                lead: bool = False) -> CollectiveFuture[Any]:
        source, tag = check_rank(source, self.size, "source", any_source=True), check_tag(tag, True)
        what = describe("recv", source, tag)
        return self._make(what, lambda mail, f: mail.receive(source, tag, f), deadline, lead)

    def probe(self, source: Any, tag: Any, deadline: Optional[float] = None,
              lead: bool = False) -> CollectiveFuture[Status]:
        source, tag = check_rank(source, self.size, "source", any_source=True), check_tag(tag, True)
        what = describe("probe", source, tag)
        return self._make(what, lambda mail, f: mail.probe(source, tag, f), deadline, lead)

    def iprobe(self, source: Any, tag: Any) -> Optional[Status]:
        source, tag = check_rank(source, self.size, "source", any_source=True), check_tag(tag, True)
        calls = self.calls
        calls._progress()
        mail = self._mail()
        if not calls.turns.take(None):
            return None
        try:
            return mail.box.probe(source, tag)
        finally:
            calls.turns.give()

    def _mail(self) -> Mail:
        calls = self.calls
        if calls.life.closed or _calls._process != calls.pid:
            calls.life.check_usable()  # raises, saying which
        mail = calls.member.mail
        if mail is None:
            raise RuntimeError(f"rank {self.rank}: this group has no mailbox (a replica of an older "
                               f"release joined it?): point-to-point calls need one on every rank")
        if mail.box.draining:  # (it takes in nothing new: a receive would wait for nothing)
            raise CollectiveError(f"rank {self.rank}: this rank is in teardown, or its teardown was "
                                  f"interrupted: it sends and receives nothing new (call teardown() "
                                  f"again to finish, or end the program)")
        return mail

    def _make(self, what: str, act: Callable[[Mail, Any], None], deadline: Optional[float],
              lead: bool = False) -> CollectiveFuture[Any]:
        """Hand ``act`` the rules and a new future, holding the turn (taken by
        ``deadline``); ``lead``: a call the caller waits for at once, whose
        wait starts here, without letting go of the turn, if no other thread
        waits in the group (see :meth:`_lead`)."""
        if tuple(map(getsignal, DEFERRED_SIGNALS)) != _interrupts.held:  # (as Calls.call)
            _interrupts.hold_new_handlers()
        calls = self.calls
        mail = self._mail()
        turns = calls.turns
        if not turns.take(deadline):
            raise CollectiveTimeoutError(f"rank {self.rank}: {what} timed out before it could be made "
                                         f"(another thread held the group)")
        try:
            driver = calls.driver
            if mail.failure is not None and driver is not None and not calls.life.closed:
                driver.mail_io()  # the group is over: what came before it is still received
            future: CollectiveFuture[Any] = CollectiveFuture(calls, -1, what)
            act(mail, future)
            if driver is not None and (mail.out or driver.tracked) and not calls.life.closed:
                driver.mail_io(take=False)  # sent now, not at the next wait
            outcomes = calls.member.outcomes
            if outcomes:
                settle(outcomes)
            if lead and not future._done and turns.alone():
                self._lead(future, deadline)
            return future
        finally:
            turns.give()

    def _lead(self, future: CollectiveFuture[Any], deadline: Optional[float]) -> None:
        """Holding the turn, with no other thread waiting in the group: wait
        for ``future`` as :class:`~zcollective._io._turns.Turns` leads a wait
        (until it is done, ``deadline``, or another thread wants the turn,
        which then nudges this wait), saving the turn's give and take; what is
        left of the wait, :meth:`result`'s. A timeout or an interrupt takes the
        call back as :meth:`result` does."""
        calls, turns, driver = self.calls, self.calls.turns, self.calls.driver
        settled = calls._settled(future)
        try:
            if driver is not None and not calls.life.closed and driver.wait_mail(settled, deadline):
                return
            calls._drive(lambda: settled() or turns.wanted(), deadline, True)
        except BaseException as exc:
            if not self._withdraw(future, exc, deadline):
                raise

    def result(self, future: CollectiveFuture[Any], timeout: Timeout, deadline: Optional[float]) -> Any:
        """``future.result()`` by ``deadline`` (``timeout`` from the call's
        start, for the message), for a call this thread has just made; a
        timeout or an interrupt takes it back (a message it had received goes
        back, first to be received), then raises."""
        if not future._done:
            try:
                if not self.calls._wait_until(future, deadline) and not future._done:
                    if isinstance(timeout, _Default):
                        timeout = self.calls.config.op_timeout
                    raise CollectiveTimeoutError(self._late(future, timeout))
            except BaseException as exc:
                if not self._withdraw(future, exc, deadline):
                    raise
        if future._error is not None:
            raise future._error
        return future._value

    def wait(self, future: CollectiveFuture[Any], timeout: Optional[float]) -> None:
        """A future's ``result(timeout)`` (or ``exception``): until it is done,
        else :meth:`result`'s timeout, which takes the call back and ends the
        future with that error (nothing else would end it); an interrupt
        leaves it pending, to be waited for again."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.calls._wait_until(future, deadline) or future._done:
            return
        late = CollectiveTimeoutError(self._late(future, timeout))
        if not self._withdraw(future, late, deadline, ends=True):
            raise late

    def _withdraw(self, future: CollectiveFuture[Any], exc: BaseException,
                  deadline: Optional[float] = None, ends: bool = False) -> bool:
        """Take ``future``'s call back (``exc`` ended its wait); False if it
        was taken back (the caller raises), True if it finished (its outcome
        stands; an interrupt's signal comes again once the call returns). A
        send libzmq has (it goes) is let finish if it can within
        :data:`STATUS_WAIT_S`, further signals held back; after a failure,
        one libzmq was sending gets until ``deadline`` (bounded) to leave:
        then it is done, and delivered. ``ends``: a call taken back ends
        with ``exc``."""
        calls, mail = self.calls, self.calls.member.mail
        if mail is None or not calls.turns.take(time.monotonic() + STATUS_WAIT_S):
            return False
        try:
            driver = calls.driver
            if mail.withdraw(future) or (driver is not None and driver.take_back(future)):
                if ends:
                    future._set_exception(exc)
                return False
            if driver is not None and mail.failure is not None and not calls.life.closed:
                driver.mail_io(take=False)  # (a send waiting for its link fails, never sent)
                driver.finish_leaving(future, deadline)
            settled, interrupted = calls._settled(future), from_signal(exc)
            if interrupted and not settled():
                with _interrupts.deferring():  # (holding the turn: this wait never follows)
                    calls.turns.wait(settled, time.monotonic() + STATUS_WAIT_S, calls._drive,
                                     lambda wake: None)
            if interrupted and settled():
                _interrupts.signal_again(exc)
            return settled()
        finally:
            calls.turns.give()

    def _late(self, future: CollectiveFuture[Any], timeout: Optional[float]) -> str:
        """Why a call timed out: what this rank holds unreceived, or waits to send."""
        mail = self.calls.member.mail
        said = f"rank {self.rank}: {future.op} timed out after {timeout:g} s"
        if mail is None:
            return said
        dest = mail.waiting_for(future)
        if dest is not None:  # a send short of credit
            peer = mail.box.peers[dest]
            return (f"{said}: rank {dest} has not yet received the {peer.held} bytes this rank sent it "
                    f"before, which fill its window ({peer.window} bytes: its "
                    f"ZCOLLECTIVE_MAIL_WINDOW_BYTES); nothing was sent")
        where, calls = None, self.calls
        if calls.driver is not None and future.op.startswith("send(") and calls.turns.take(
                time.monotonic() + STATUS_WAIT_S):
            try:  # (holding the turn: the mailbox's sockets are read by their owner only)
                where = calls.driver.where(future)
            finally:
                calls.turns.give()
        if where is not None:
            how, dest, back = where
            if how == "link":
                then = ("taken back: nothing was sent" if back else
                        f"not taken back (a later send to rank {dest} was numbered after it): it goes once "
                        f"the link is made")
                return (f"{said}: its message waits for its link to rank {dest}'s mailbox, whose handshake "
                        f"rank {dest} has not answered (busy in its own code, stopped, or gone); {then}")
            return (f"{said}: rank {dest} has not taken in its message: libzmq still sends its buffers "
                    f"(rank {dest} stopped, or busy in C code?); not taken back: it may still arrive")
        waiting: dict[tuple[int, int], int] = {}
        for came in list(mail.box.arrived):  # (a snapshot: another thread may hold the turn)
            waiting[(came.source, came.tag)] = waiting.get((came.source, came.tag), 0) + 1
        unreceived = "; ".join(f"{n} from rank {s} with tag {t}" for (s, t), n in sorted(waiting.items())[:8])
        return f"{said}: no matching message came" + (f" (here, unreceived: {unreceived})" * bool(unreceived))
