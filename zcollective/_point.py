"""The point-to-point call runner: a group's sends, receives and probes made,
waited for and given up, beside :class:`~zcollective._calls.Calls`, whose turn
and waits it shares. The rules are :mod:`zcollective._protocol._p2p`'s."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from ._calls import Calls, Timeout, _Default
from ._format import _serialize
from ._future import CollectiveFuture, settle
from ._limits import STATUS_WAIT_S
from ._protocol._p2p import ANY_SOURCE, ANY_TAG, Mail, Status, check_rank, check_tag
from .errors import CollectiveTimeoutError


class PointToPoint:
    """The point-to-point calls of one open group (its :class:`Calls`)."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.rank, self.size = calls.rank, calls.config.num_replicas

    def send(self, value: Any, dest: Any, tag: Any,
             deadline: Optional[float] = None) -> CollectiveFuture[None]:
        dest, tag = check_rank(dest, self.size, "dest"), check_tag(tag, False)
        segment = _serialize.dumps(value)  # (a value that cannot travel: nothing is sent)
        what = f"send(dest={dest}, tag={tag})"
        return self._make(what, lambda mail, f: mail.send(dest, tag, segment, f), deadline)

    def receive(self, source: Any, tag: Any, deadline: Optional[float] = None) -> CollectiveFuture[Any]:
        source, tag = check_rank(source, self.size, "source", any_source=True), check_tag(tag, True)
        what = f"recv(source={_source(source)}, tag={_tag(tag)})"
        return self._make(what, lambda mail, f: mail.receive(source, tag, f), deadline)

    def probe(self, source: Any, tag: Any, deadline: Optional[float] = None) -> CollectiveFuture[Status]:
        source, tag = check_rank(source, self.size, "source", any_source=True), check_tag(tag, True)
        what = f"probe(source={_source(source)}, tag={_tag(tag)})"
        return self._make(what, lambda mail, f: mail.probe(source, tag, f), deadline)

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
        if calls.life.closed:
            calls.life.check_usable()  # raises, saying which
        calls.life.check_process()
        mail = calls.member.mail
        if mail is None:
            raise RuntimeError(f"rank {self.rank}: this group has no mailbox (a replica of an older "
                               f"release joined it?): point-to-point calls need one on every rank")
        return mail

    def _make(self, what: str, act: Callable[[Mail, Any], None],
              deadline: Optional[float]) -> CollectiveFuture[Any]:
        """Hand ``act`` the rules and a new future, holding the turn (taken by ``deadline``)."""
        calls = self.calls
        mail = self._mail()
        if not calls.turns.take(deadline):
            raise CollectiveTimeoutError(f"rank {self.rank}: {what} timed out before it could be made "
                                         f"(another thread held the group)")
        try:
            if mail.failure is not None and calls.driver is not None and not calls.life.closed:
                calls.driver.mail_io()  # the group is over: what came before it is still received
            future: CollectiveFuture[Any] = CollectiveFuture(calls, -1, what)
            act(mail, future)
            driver = calls.driver
            if driver is not None and (mail.out or driver._tracked) and not calls.life.closed:
                driver.mail_io(take=False)  # sent now, not at the next wait
            settle(calls.member.outcomes)
            return future
        finally:
            calls.turns.give()

    def result(self, future: CollectiveFuture[Any], timeout: Timeout) -> Any:
        """``future.result()`` within ``timeout``, for a call this thread has
        just made; a timeout or an interrupt takes it back (a message it had
        received goes back, first to be received), then raises."""
        calls = self.calls
        if isinstance(timeout, _Default):
            timeout = calls.config.op_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if not future._done:
            try:
                if not calls._wait_until(future, deadline) and not future._done:
                    raise CollectiveTimeoutError(self._late(future, timeout))
            except BaseException:
                if not self._withdraw(future):
                    raise
        if future._error is not None:
            raise future._error
        return future._value

    def _withdraw(self, future: CollectiveFuture[Any]) -> bool:
        """Take ``future``'s call back; False if it was taken back (the caller
        raises), True if it finished meanwhile (its outcome stands)."""
        calls, mail = self.calls, self.calls.member.mail
        if mail is None or not calls.turns.take(time.monotonic() + STATUS_WAIT_S):
            return False
        try:
            if mail.withdraw(future):
                return False
            settle(calls.member.outcomes)
            return future._done
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
            held = mail.box.peers[dest].held
            return (f"{said}: rank {dest} has not yet received the {held} bytes this rank sent it "
                    f"before, which fill its window ({mail.box.window} bytes: "
                    f"ZCOLLECTIVE_MAIL_WINDOW_BYTES)")
        waiting: dict[tuple[int, int], int] = {}
        for came in list(mail.box.arrived):  # (a snapshot: another thread may hold the turn)
            waiting[(came.source, came.tag)] = waiting.get((came.source, came.tag), 0) + 1
        unreceived = "; ".join(f"{n} from rank {s} with tag {t}" for (s, t), n in sorted(waiting.items())[:8])
        return f"{said}: no matching message came" + (f" (here, unreceived: {unreceived})" * bool(unreceived))


def _source(source: int) -> str:
    return "ANY_SOURCE" if source == ANY_SOURCE else str(source)


def _tag(tag: int) -> str:
    return "ANY_TAG" if tag == ANY_TAG else str(tag)

