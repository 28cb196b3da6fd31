"""Point to point, a group's part: its sends, receives and probes made,
waited for and given up, beside :class:`~zcollective._calls.Calls`, whose turn
and waits it shares; :class:`~zcollective.Group` offers its public methods.
The rules are :mod:`zcollective._protocol._p2p`'s."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import CancelledError
from functools import partial
from threading import get_ident
from typing import Any, Callable, Optional

from . import _calls
from ._calls import DEFAULT, Calls, Timeout, _Default, bad_timeout
from ._format import _serialize
from ._future import PENDING, CollectiveFuture, fail, finished, settle, settled_when
from ._io import _interrupts
from ._io._edges import Edges
from ._io._interrupts import DEFERRED_SIGNALS, getsignal
from ._limits import STATUS_WAIT_S
from ._matched import Message
from ._protocol._outcomes import CallOutcome
from ._protocol._p2p import (
    ANY_SOURCE,
    ANY_TAG,
    MAX_TAG,
    PROC_NULL,
    Mail,
    Status,
    check_rank,
    check_tag,
    describe,
)
from .errors import CollectiveError, CollectiveTimeoutError, from_signal


class PointToPoint:
    """The point-to-point calls of one open group (its :class:`Calls`)."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.rank, self.size, self.config = calls.rank, calls.config.num_replicas, calls.config
        calls.wait_point = self._wait

    def send(self, value: Any, dest: int, tag: int = 0, *, timeout: Timeout = DEFAULT) -> None:
        """Send ``value`` to rank ``dest``, to be received with a matching
        :meth:`recv` there; ``tag`` (0 to 2**31 - 1) tells messages apart.
        Returns once it is on its way and its buffers may be reused: at once,
        unless ``dest`` holds its ``mail_window_bytes`` (``dest``'s setting)
        of this rank's messages not yet received, when it waits for them to
        be (see the README, *Point to point*). Sending to oneself works. The
        value goes straight to ``dest``, not through rank 0; arrays and
        tensors without a copy. To ``PROC_NULL``: at once, doing nothing.

        Raises
        ------
        ValueError
            ``dest`` is not a rank of the group, or ``tag`` not a valid tag.
        SerializationError
            ``value`` cannot be pickled (nothing was sent).
        CollectiveTimeoutError
            Not done within ``timeout``; the message says what it waited for:
            ``dest``'s window (nothing was sent), its link to ``dest`` (taken
            back if nothing was numbered after it), or ``dest`` taking it in
            (it may still arrive).
        PeerEndedError
            ``dest`` ended (it called teardown, or its program ended) before
            its program received the message.
        ReplicaLostError, CollectiveError
            The group failed (a rank was lost, ...); a message not yet on its
            way then never goes.
        """
        if isinstance(timeout, _Default):
            timeout = self.config.op_timeout
        elif timeout is not None and not timeout >= 0:  # (negative, or NaN)
            raise bad_timeout(timeout, self.rank, "send")
        deadline = None if timeout is None else time.monotonic() + timeout
        if type(dest) is int and 0 <= dest < self.size and type(tag) is int and 0 <= tag <= MAX_TAG:
            future, done = self._make(f"send(dest={dest}, tag={tag})", Mail.send,  # (_send's, inline:
                                      (dest, tag, _serialize.dumps(value)), deadline, True)  # the usual case)
        else:
            future, done = self._send(value, dest, tag, deadline, True)
        if done is PENDING:  # (not done, or failed: raises its error)
            self._finish(future, timeout, deadline)

    def send_async(self, value: Any, dest: int, tag: int = 0) -> CollectiveFuture[None]:
        """:meth:`send`, returning at once a future done when :meth:`send` would
        return; do not change ``value`` until it is. A send cannot be
        cancelled (its future's ``cancel()`` returns False, as MPI-4 deprecates it)."""
        return self._send(value, dest, tag)[0]

    def ssend(self, value: Any, dest: int, tag: int = 0, *, timeout: Timeout = DEFAULT) -> None:
        """A synchronous :meth:`send`: returns once a matching receive (or
        matched probe) on ``dest`` has taken the message, ``dest`` telling
        this rank so. To ``PROC_NULL``: at once, doing nothing.

        Raises
        ------
        CollectiveTimeoutError
            Not taken within ``timeout`` (says what it waited for; a message
            already sent may still be received).
        ValueError, SerializationError, PeerEndedError, ReplicaLostError, CollectiveError
            As :meth:`send` (PeerEndedError: ``dest`` ended before receiving it).
        """
        deadline = self._deadline(timeout)
        self._finish(self._send(value, dest, tag, deadline, True, True)[0], timeout, deadline)

    def ssend_async(self, value: Any, dest: int, tag: int = 0) -> CollectiveFuture[None]:
        """:meth:`ssend`, returning at once a future done when :meth:`ssend`
        would return (not cancellable, as :meth:`send_async`)."""
        return self._send(value, dest, tag, None, False, True)[0]

    def recv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: Timeout = DEFAULT,
             status: Optional[Status] = None) -> Any:
        """The next message from ``source`` with ``tag`` (either may be
        ``ANY_SOURCE``/``ANY_TAG``): messages from one rank with one tag come
        in the order sent; with ``ANY_SOURCE``, the earliest arrived. A
        :class:`Status` passed as ``status`` is filled with where it came from.
        From ``PROC_NULL``: None at once (status: ``PROC_NULL``, ``ANY_TAG``, 0).

        Raises
        ------
        CollectiveTimeoutError
            No matching message came within ``timeout`` (says what did come).
        PeerEndedError
            Only ranks that ended (teardown, or their program ended) could
            send it, and all they sent here was taken in.
        ReplicaLostError, CollectiveError
            The group failed (a rank was lost, ...).
        """
        if isinstance(timeout, _Default):
            timeout = self.config.op_timeout
        elif timeout is not None and not timeout >= 0:  # (negative, or NaN)
            raise bad_timeout(timeout, self.rank, "recv")
        deadline = None if timeout is None else time.monotonic() + timeout
        if type(source) is int and 0 <= source < self.size and type(tag) is int and 0 <= tag <= MAX_TAG:
            future, value = self._make(f"recv(source={source}, tag={tag})", _RECEIVE, (source, tag),
                                       deadline, True)  # (_receive's, inline: the usual case)
        else:
            future, value = self._receive(source, tag, deadline, True)
        if value is PENDING:  # (not done, or failed: raises its error)
            value = self._finish(future, timeout, deadline)
        if status is not None:
            _fill(status, future.status)
        return value

    def recv_async(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> CollectiveFuture[Any]:
        """:meth:`recv`, returning at once a future of the value; its ``status``
        says where the message came from, once done. Its ``cancel()`` takes
        back a receive not yet matched (True: the future is cancelled, and
        the message it would have taken goes to a later receive); False once
        matched or done."""
        future = self._receive(source, tag)[0]
        future.canceller = self._cancel
        return future

    def sendrecv(self, value: Any, dest: int, source: int = ANY_SOURCE, sendtag: int = 0,
                 recvtag: int = ANY_TAG, *, timeout: Timeout = DEFAULT,
                 status: Optional[Status] = None) -> Any:
        """Send ``value`` to ``dest`` and receive from ``source`` at once (a
        ring of ranks each sending to the next never deadlocks): what
        :meth:`recv` returns."""
        deadline = self._deadline(timeout)
        received = self._receive(source, recvtag, deadline)[0]
        sent = self._send(value, dest, sendtag, deadline)[0]
        value = self._finish(received, timeout, deadline)
        self._finish(sent, timeout, deadline)
        _fill(status, received.status)
        return value

    def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None, *,
              timeout: Timeout = DEFAULT) -> Status:
        """Wait for a message :meth:`recv` with these arguments would take,
        and say where it came from (also in ``status``, if given), without
        receiving it; raises as :meth:`recv` does."""
        deadline = self._deadline(timeout)
        future = self._receive(source, tag, deadline, True, "probe")[0]
        result: Status = self._finish(future, timeout, deadline)
        _fill(status, result)
        return result

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: Optional[Status] = None) -> Optional[Status]:
        """:meth:`probe` without waiting: None if no such message is here yet
        (``status`` then untouched)."""
        return self._peek(source, tag, False, status)  # type: ignore[no-any-return]

    def mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None, *,
               timeout: Timeout = DEFAULT) -> Message:
        """A matched probe: wait for a message :meth:`recv` with these
        arguments would take and take it out of matching (no other receive or
        probe gets it), as a :class:`Message` to receive later; ``status`` is
        filled as :meth:`recv` fills it. Raises as :meth:`recv` does."""
        deadline = self._deadline(timeout)
        future = self._receive(source, tag, deadline, True, "mprobe")[0]
        came = self._finish(future, timeout, deadline)
        message = Message.no_proc() if came is None else Message(self.rank, came)  # (None: PROC_NULL's)
        _fill(status, message)
        return message

    def improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
                status: Optional[Status] = None) -> Optional[Message]:
        """:meth:`mprobe` without waiting: None if no such message is here yet
        (``status`` then untouched)."""
        return self._peek(source, tag, True, status)  # type: ignore[no-any-return]

    def _peek(self, source: Any, tag: Any, matched: bool, status: Optional[Status]) -> Any:
        """:meth:`iprobe`'s Status, or (``matched``) :meth:`improbe`'s Message, or None."""
        source = check_rank(source, self.size, "source", any_source=True, proc_null=True)
        tag = check_tag(tag, True)
        if source == PROC_NULL:
            self._mail()  # (raises if no call may be made)
            found: Any = Message.no_proc() if matched else Status(PROC_NULL, ANY_TAG, 0)
        else:
            calls = self.calls
            calls.progress()
            mail = self._mail()
            if not calls.turns.take(None):
                return None
            try:
                came = mail.improbe(source, tag) if matched else None
                found = mail.box.probe(source, tag) if not matched else came and Message(self.rank, came)
                if mail.out and calls.driver is not None and not calls.life.closed:
                    calls.driver.mail_io(take=False)  # its credit (an ssend's acknowledgement) goes now
            finally:
                calls.turns.give()
        _fill(status, found)
        return found

    def _deadline(self, timeout: Timeout) -> Optional[float]:
        if isinstance(timeout, _Default):
            timeout = self.config.op_timeout
        elif timeout is not None and not timeout >= 0:  # (negative, or NaN)
            raise bad_timeout(timeout, self.rank, "a point-to-point call")
        return None if timeout is None else time.monotonic() + timeout

    def _send(self, value: Any, dest: Any, tag: Any, deadline: Optional[float] = None,
              lead: bool = False, sync: bool = False) -> tuple[CollectiveFuture[None], Any]:
        if type(dest) is not int or not 0 <= dest < self.size:  # (checked inline: the usual case)
            dest = check_rank(dest, self.size, "dest", proc_null=True)
            if dest == PROC_NULL:
                call = "ssend" if sync else "send"
                return self._null(f"{call}(dest=PROC_NULL, tag={check_tag(tag, False)})")
        if type(tag) is not int or not 0 <= tag <= MAX_TAG:
            tag = check_tag(tag, False)
        segment = _serialize.dumps(value)  # (a value that cannot travel: nothing is sent)
        if sync:  # (its message's own handle, done once sent: nobody waits for it)
            sent: CollectiveFuture[None] = CollectiveFuture(None, -1, f"ssend(dest={dest}, tag={tag}) sent")
            return self._make(f"ssend(dest={dest}, tag={tag})", partial(Mail.send, sent=sent),
                              (dest, tag, segment), deadline, lead)
        return self._make(f"send(dest={dest}, tag={tag})", Mail.send, (dest, tag, segment), deadline, lead)

    def _receive(self, source: Any, tag: Any, deadline: Optional[float] = None,
                 lead: bool = False, call: str = "recv") -> tuple[CollectiveFuture[Any], Any]:
        if type(source) is not int or not ANY_SOURCE <= source < self.size:
            source = check_rank(source, self.size, "source", any_source=True, proc_null=True)
            if source == PROC_NULL:
                what = describe(call, source, check_tag(tag, True))
                return self._null(what, Status(PROC_NULL, ANY_TAG, 0) if call == "probe" else None)
        if type(tag) is not int or not ANY_TAG <= tag <= MAX_TAG:
            tag = check_tag(tag, True)
        what = (f"{call}(source={source}, tag={tag})" if source >= 0 and tag >= 0  # (describe's, inline)
                else describe(call, source, tag))
        act = _RECEIVE if call == "recv" else Mail.probe if call == "probe" else _MATCHED_PROBE
        return self._make(what, act, (source, tag), deadline, lead)

    def _null(self, what: str, value: Any = None) -> tuple[CollectiveFuture[Any], Any]:
        """A call with ``PROC_NULL``: done at once, doing nothing (a receive's status says
        source=PROC_NULL, tag=ANY_TAG, nbytes=0), as MPI's; as :meth:`_make` returns it."""
        self._mail()  # (raises if no call may be made)
        future: CollectiveFuture[Any] = CollectiveFuture(None, -1, what)
        done = CallOutcome(future, None, lambda: value, Status(PROC_NULL, ANY_TAG, 0))
        return future, settle(deque([done]), future)

    def _cancel(self, future: CollectiveFuture[Any]) -> bool:
        """A receive future's ``cancel()``: take its receive back if not yet matched (True: the
        future ends cancelled). It waits while another thread holds the group, as a call does
        (CollectiveTimeoutError after ``op_timeout``, not cancelled)."""
        calls, mail = self.calls, self.calls.member.mail
        if mail is None or finished(future):
            return False
        bound = self.config.op_timeout  # (False must mean matched or done: wait for the turn, as a call)
        if not calls.turns.take(None if bound is None else time.monotonic() + bound):
            why = f"{bound:g} s (op_timeout): another thread held the group; not cancelled"
            raise CollectiveTimeoutError(f"rank {self.rank}: cancel() of {future.op} timed out after {why}")
        try:
            if finished(future) or not mail.box.cancel(future):
                return False
            fail(future, CancelledError(f"rank {self.rank}: {future.op} was cancelled"))
            return True
        finally:
            calls.turns.give()

    def _mail(self) -> Mail:
        """This group's mail rules, for a call; raises if it may make none."""
        calls = self.calls
        if calls.life.closed or _calls.this_pid != calls.pid:
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

    def _make(self, what: str, act: Callable[..., None], args: tuple[Any, ...], deadline: Optional[float],
              lead: bool = False) -> tuple[CollectiveFuture[Any], Any]:
        """``act(mail, *args, future)`` with a new future, holding the turn
        (taken by ``deadline``); ``lead``: the caller waits for it at once, so
        the wait starts here, without letting go of the turn, if no other
        thread waits in the group: until a call is done, ``deadline``, or another
        thread wants the turn; a timeout or an interrupt takes it back. The future,
        and its value (PENDING, as ``settle`` says: then the caller's :meth:`_finish`)."""
        if tuple(map(getsignal, DEFERRED_SIGNALS)) != _interrupts.held:  # (as Calls.call)
            _interrupts.hold_new_handlers()
        calls = self.calls
        mail = calls.member.mail
        if calls.life.closed or _calls.this_pid != calls.pid or mail is None or mail.box.draining:
            mail = self._mail()  # (raises, saying why)
        turns = calls.turns
        lock = turns.lock
        if lock.acquire(False):  # (Turns.take's uncontended case, inline: once per call)
            turns.depth += 1
            turns.owner = get_ident()
        elif not turns.take(deadline):
            raise CollectiveTimeoutError(f"rank {self.rank}: {what} timed out before it could be made "
                                         f"(another thread held the group)")
        try:
            driver = calls.driver
            if mail.failure is not None and driver is not None and not calls.life.closed:
                driver.mail_io()  # the group is over: what came before it is still received
            future: CollectiveFuture[Any] = CollectiveFuture(calls, -1, what)
            act(mail, *args, future)
            if driver is not None and (mail.out or driver.tracked) and not calls.life.closed:
                driver.mail_io(take=False)  # sent now, not at the next wait
            outcomes, value, done = calls.member.outcomes, PENDING, False
            try:  # (settling runs other calls' done-callbacks: one that raises, an interrupt say, ends
                # this call as its wait would, so it is taken back or, finished, its signal comes again)
                if outcomes:  # (only an outcome resolves it: a send with credit is done by now)
                    value = settle(outcomes, future)
                    done = value is not PENDING or finished(future)
                if lead and not done and turns.depth == 1 and turns.leader is None and not turns.wanting:
                    # (the mail's wait ends once any call is done: this one, most likely)
                    if calls.life.closed or not (driver and driver.wait_mail(outcomes.__len__, deadline)):
                        calls.drive(settled_when(future, outcomes, wanted=turns.wanted), deadline, True)
                    value = settle(outcomes, future)
            except BaseException as exc:
                if not self._withdraw(future, exc, deadline):
                    raise
                value = PENDING  # (finished: the caller's _finish takes its value)
            return future, value
        finally:  # (Turns.give, inline)
            turns.depth -= 1
            if not turns.depth:
                turns.owner = None
                turns.left = time.monotonic()
            lock.release()

    def _finish(self, future: CollectiveFuture[Any], timeout: Timeout, deadline: Optional[float]) -> Any:
        """``future.result()`` by ``deadline`` (``timeout``: for the message),
        for a call this thread has just made; a timeout or an interrupt takes
        it back (a message it had received goes back, first to be received)."""
        try:
            if not self.calls.wait_until(future, deadline) and not finished(future):
                if isinstance(timeout, _Default):
                    timeout = self.config.op_timeout
                raise CollectiveTimeoutError(_late(self.calls, future, timeout))
        except BaseException as exc:
            if not self._withdraw(future, exc, deadline):
                raise
        return future.result()

    def _wait(self, future: CollectiveFuture[Any], timeout: Optional[float]) -> None:
        """A future's ``result(timeout)`` (or ``exception``): until it is done,
        else :meth:`_finish`'s timeout, which takes the call back and ends the
        future with that error; an interrupt leaves it pending."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.calls.wait_until(future, deadline) or finished(future):
            return
        late = CollectiveTimeoutError(_late(self.calls, future, timeout))
        if not self._withdraw(future, late, deadline, ends=True):
            raise late

    def _withdraw(self, future: CollectiveFuture[Any], exc: BaseException,
                  deadline: Optional[float] = None, ends: bool = False) -> bool:
        """Take ``future``'s call back (``exc`` ended its wait): False if taken
        back (the caller raises; ``ends``: the future ends with ``exc``), True
        if it finished (an interrupt's signal comes again). A send libzmq has
        is let finish within :data:`STATUS_WAIT_S`, further signals held back;
        after a failure, one libzmq was sending gets until ``deadline``."""
        calls, mail = self.calls, self.calls.member.mail
        if mail is None or not calls.turns.take(time.monotonic() + STATUS_WAIT_S):
            return False
        try:
            driver = calls.driver
            if (driver is not None and Edges(driver).take_back(future)) or mail.withdraw(future):  # (an ssend
                # waiting for its link: taken back, not only its acknowledgement no longer awaited)
                if ends:
                    fail(future, exc)
                return False
            if driver is not None and mail.failure is not None and not calls.life.closed:
                driver.mail_io(take=False)  # (a send waiting for its link fails, never sent)
                Edges(driver).finish_leaving(future, deadline)
            settled, interrupted = settled_when(future, calls.member.outcomes), from_signal(exc)
            if interrupted and not settled():
                with _interrupts.deferring():  # (holding the turn: this wait never follows)
                    calls.wait_until(future, time.monotonic() + STATUS_WAIT_S, follow=False)
            if interrupted and settled():
                _interrupts.signal_again(exc)
            return settled()
        finally:
            calls.turns.give()


_RECEIVE = partial(Mail.receive, decode=_serialize.loads)  # a receive's act: its value unpickled here
_MATCHED_PROBE = partial(Mail.receive, matched=True)  # a matched probe's: the message, unpickled later


def _late(calls: Calls, future: CollectiveFuture[Any], timeout: Optional[float]) -> str:
    """Why a point-to-point call of ``calls`` timed out: what this rank holds unreceived, or waits to send."""
    mail = calls.member.mail
    said = f"rank {calls.rank}: {future.op} timed out after {timeout:g} s"
    if mail is None:
        return said
    acked = next((dest for (dest, _), (_, h, _, _) in list(mail.syncing.items()) if h is future),
                 None)  # (a snapshot: another thread may hold the turn)
    dest = mail.waiting_for(future)
    if dest is not None:  # a send short of credit
        peer = mail.box.peers[dest]
        return (f"{said}: rank {dest} has not yet received the {peer.held} bytes this rank sent it "
                f"before, which fill its window ({peer.window} bytes: its "
                f"ZCOLLECTIVE_MAIL_WINDOW_BYTES); nothing was sent")
    where = None
    if calls.driver is not None and future.op.startswith(("send(", "ssend(")) and calls.turns.take(
            time.monotonic() + STATUS_WAIT_S):
        try:  # (holding the turn: the mailbox's sockets are read by their owner only)
            where = Edges(calls.driver).where(future)
        finally:
            calls.turns.give()
    if acked is not None and (where is None or where[0] != "link"):  # (sent, or leaving)
        return (f"{said}: rank {acked}'s program has not received its message yet (no matching "
                f"receive there yet): not taken back, it may still be received")
    if where is not None:
        how, dest, back = where
        if how == "link":
            then = ("taken back: nothing was sent" if back else
                    f"not taken back (a later send to rank {dest} was numbered after it): it goes once "
                    f"the link is made")
            return (f"{said}: its message waits for its link to rank {dest}'s mailbox, whose handshake "
                    f"rank {dest} has not answered (busy in its own code, stopped, or gone); {then}")
        return (f"{said}: rank {dest} has not taken in its message: its buffers are still being sent "
                f"(rank {dest} stopped, or busy in C code?); not taken back: it may still arrive")
    waiting: dict[tuple[int, int], int] = {}
    for came in list(mail.box.arrived):  # (a snapshot: another thread may hold the turn)
        waiting[(came.source, came.tag)] = waiting.get((came.source, came.tag), 0) + 1
    unreceived = "; ".join(f"{n} from rank {s} with tag {t}" for (s, t), n in sorted(waiting.items())[:8])
    return f"{said}: no matching message came" + (f" (here, unreceived: {unreceived})" * bool(unreceived))


def _fill(status: Optional[Status], found: Any) -> None:
    """Fill a caller's ``status`` from what a call found (a receive's or probe's Status, or a Message;
    None: nothing)."""
    if status is not None and found is not None:
        status.source, status.tag, status.nbytes = found.source, found.tag, found.nbytes

