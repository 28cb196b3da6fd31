"""The driver of a replica's member (ranks 1 and up), a thin one: it sends what the
:class:`~zcollective._protocol._member.Member` owes and answers, and hands it every message and
connection event of its link to the coordinator (a :class:`.transport.Link`; ZeroMQ's today).
Used by the holder of the group's turn (:mod:`._turns`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .._format._wire import Message, encode
from .._limits import POLL_SLICE_S
from .._protocol._member import ConnectionEvent, Member
from ..config import Config
from ..errors import CollectiveError
from . import transport
from ._driver import Driver, pending_else
from ._interrupts import DEADLINE, NUDGE
from ._mailbox import mail_woke
from ._zmq import DEALER, MONITOR, Link, routing_id

__all__ = ["DealerDriver", "routing_id"]


class DealerDriver(Driver):
    """A member's link to the coordinator at ``config.endpoint`` (see docs/protocol.md, *Drivers*)."""

    remote = True
    fixed_slice_s = POLL_SLICE_S

    def __init__(self, ctx: Any, config: Config, member: Member) -> None:
        super().__init__(member)
        self.link: transport.Link = Link(ctx, config, member.lineage is not None)
        self.dealer = getattr(self.link, "dealer", None)  # (tests look at its queue)
        self._watches(*self.link.SOURCES)
        try:
            self.link.connect(self.waiter)
        except BaseException:
            self.close()  # sockets left open would make the context's term() wait forever
            raise

    def _send(self, msg: Message) -> None:
        member = self.member
        if not self.link.send(encode(msg, member.signer, part_bytes=member.part_bytes), msg):
            self._no_pipe()

    def _no_pipe(self) -> None:
        """No pipe to the coordinator (a re-made connection was refused): a lost connection
        once joined; before, the member joins again on the next handshake."""
        member = self.member
        self._answer(member.connection(ConnectionEvent.DISCONNECTED))
        member.check()

    def flush(self) -> None:
        member = self.member
        owed, send = member.owed, self.link.send
        if member.parent > 0 or member.relay is not None or member.asks:
            return super().flush()  # (up the tree)
        while owed:  # (Driver.flush's, inline: one call per message saved)
            msg = owed[0]
            if not send(encode(msg, member.signer, part_bytes=member.part_bytes), msg):
                self._no_pipe()
            if owed:  # a failure while sending empties it
                owed.popleft()

    def _pump(self, deadline: Optional[float], until: Optional[Callable[[], bool]] = None) -> bool:
        """One wait covers the link and its events, so a disconnect ends a wait at once."""
        names = self._nudged_names if self.nudged else self._names  # (watching(), inline)
        while True:
            woke = self.waiter.wait(names, deadline, POLL_SLICE_S)
            mail = mail_woke(woke) if len(woke) > 1 or (woke and woke[0] != DEALER) else 0
            self.mail_ready |= mail
            if not woke or woke[0] is DEADLINE:  # nothing came: the events are asked anyway
                self._drain_events()
            else:  # first: a FAIL that came before a disconnect explains it; but while joining, a
                if not self.member.joined:  # connection closed before the one a WELCOME comes over
                    self._drain_events()  # is no loss: what happened to the connections goes first
                got = DEALER in woke and self._drain_dealer(True, until)  # (not asked again if the
                if MONITOR in woke:  # poll did not find it: the next wait does)
                    self._drain_dealer()  # all of it, past ``until``: a FAIL explains a close
                    self._drain_events()
                if got or NUDGE in woke or mail:
                    return True
            if self.member.failure is not None:
                return True
            if DEADLINE in woke:
                return False

    def lead(self, seq: int, deadline: Optional[float]) -> bool:
        """The common wait, first (see :meth:`Driver.lead`): while nothing but the link to the
        coordinator has anything to do here, poll it (the nudge and the mailbox too) and hand what
        came to the member, until call ``seq`` is answered (True). False, having taken in nothing
        else, once anything else woke it or is pending: the general wait goes on from there."""
        member, link, waiter = self.member, self.link, self.waiter
        calls, names = member.calls, self._nudged_names
        while seq in calls:
            if pending_else(self):
                return False
            woke = waiter.wait(names, deadline, POLL_SLICE_S)
            if len(woke) != 1 or woke[0] != DEALER:
                return False  # (each source stays readable: the general wait finds it at once)
            frames, receive = link.recv(True), member.receive
            while frames is not None:
                replies = receive(frames)
                if replies:
                    self._answer(replies)
                if not calls and not self.sleepers():  # (as _drain_dealer: the rest stays queued)
                    return True
                frames = link.recv(False)
        return True

    def slice_s(self) -> Optional[float]:
        return POLL_SLICE_S

    def _drain_dealer(self, waiting: bool = False, until: Optional[Callable[[], bool]] = None) -> bool:
        """Handle every message waiting (``waiting``: a poll just found one); True if there was
        one. Once ``until()`` holds and no other call is in flight, the rest stays queued for the
        next wait (rule 3 of :mod:`zcollective._future`). A done-callback that calls into the
        group re-enters here and goes on with the rest."""
        recv, member = self.link.recv, self.member
        got = False
        while True:
            frames = recv(waiting)
            if frames is None:
                return got
            waiting, got = False, True
            replies = member.receive(frames)
            if replies:
                self._answer(replies)
            if member.relay is not None and member.mail is not None and member.mail.out:
                self.mail_io(take=False)  # a result for the subtree goes down at once
            if until is not None and not member.calls and until() and not self.sleepers():
                return got

    def _answer(self, replies: list[Message]) -> None:
        """Send what the member answered; an ABORT that cannot leave (the link
        broke) must not hide the failure it reports."""
        try:
            if replies:
                self.send(replies)
        except CollectiveError:
            if self.member.failure is None:
                raise

    def _drain_events(self) -> None:
        member = self.member
        for event in self.link.events(member.rank, not member.joined and member.failure is None):
            self._answer(member.fail(event) if isinstance(event, Exception) else member.connection(event))

    def close(self, linger_ms: int = 0) -> None:
        if self.member.coordinator_lost:
            linger_ms = 0  # what is queued has nobody to go to: ending must not wait for it
        self.link.close(linger_ms)
