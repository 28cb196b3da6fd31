"""The DEALER driver of a replica's member (ranks 1 and up), a thin one: it sends what the
:class:`~zcollective._protocol._member.Member` owes and answers, and hands it every message and
connection event. Used by the holder of the group's turn (:mod:`._turns`).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import zmq

from .._format._wire import Message, encode
from .._limits import POLL_SLICE_S
from .._protocol._member import ConnectionEvent, Member
from ..config import Config
from ..errors import CollectiveError
from . import _sockets, _zap
from ._driver import Driver
from ._interrupts import DEADLINE, NUDGE
from ._mailbox import mail_woke

_EVENTS: dict[int, ConnectionEvent] = {
    zmq.EVENT_CONNECTED: ConnectionEvent.CONNECTED,
    zmq.EVENT_DISCONNECTED: ConnectionEvent.DISCONNECTED,
    zmq.EVENT_HANDSHAKE_SUCCEEDED: ConnectionEvent.HANDSHAKE_SUCCEEDED,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: ConnectionEvent.HANDSHAKE_FAILED,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: ConnectionEvent.PROTOCOL_VIOLATION,
    zmq.EVENT_CONNECT_RETRIED: ConnectionEvent.REFUSED,  # (also after a disconnect: the member tells)
}
MONITOR_EVENTS = sum(_EVENTS) | zmq.EVENT_HANDSHAKE_FAILED_AUTH  # (one bit each; AUTH: handshake_refusal)
DEALER, MONITOR = "dealer", "monitor"  # its sources, as its waiter names them


def routing_id(rank: int) -> bytes:
    """``b"R"``, the rank, then random bytes (why: see docs/protocol.md, *Topology*)."""
    return b"R" + rank.to_bytes(4, "big") + os.urandom(8)


class DealerDriver(Driver):
    """A member's DEALER connected to the coordinator at ``config.endpoint``;
    with a secret, it offers a single-use token at each handshake (see
    docs/protocol.md, *Drivers*): a token refused on its first offer means
    another secret, one refused on a connection libzmq re-made was spent."""

    remote = True

    def __init__(self, ctx: zmq.Context, config: Config, member: Member) -> None:
        super().__init__(member)
        self._config = config
        self._offers = 0  # TCP connections made since the DEALER got its current token
        with _sockets.mapped(f"rank {config.rank} cannot make its socket"):
            self.dealer = ctx.socket(zmq.DEALER)
            with _sockets.closed_on_error(self.dealer):
                self.dealer.setsockopt(zmq.ROUTING_ID, routing_id(config.rank))
                self.dealer.setsockopt(zmq.LINGER, 0)
                forming = member.lineage is not None  # the host binds within milliseconds
                self.dealer.setsockopt(zmq.RECONNECT_IVL, _sockets.FORM_RECONNECT_IVL_MS if forming
                                       else _sockets.RECONNECT_IVL_MS)
                self.dealer.setsockopt(zmq.RECONNECT_IVL_MAX, _sockets.FORM_RECONNECT_IVL_MAX_MS
                                       if forming else _sockets.RECONNECT_IVL_MAX_MS)
                _sockets.set_never_drop(self.dealer)
                _sockets.set_heartbeats(self.dealer, config)
                if config.secret is not None:
                    _zap.secure_client(self.dealer, config.secret, _zap.MASTER_DOMAIN)
                self.monitor = _sockets.monitor_socket(self.dealer, MONITOR_EVENTS)
        try:
            # the monitor by its file descriptor, asked once before the connect (only _drain_monitor
            # asks it again, reading to the end: see docs/protocol.md, *Drivers*)
            _sockets.readable(self.monitor)
            self.waiter.watch(DEALER, self.dealer)
            self.waiter.watch(MONITOR, self.monitor.FD)
            self._watches(DEALER, MONITOR)
            with _sockets.mapped(f"rank {config.rank} cannot connect to {config.endpoint}", address=True):
                self.dealer.connect(config.endpoint)
        except BaseException:
            self.close()  # sockets left open would make the context's term() wait forever
            raise

    def _send(self, msg: Message) -> None:
        member = self.member
        try:
            _sockets.send_frames(self.dealer, encode(msg, member.signer, part_bytes=member.part_bytes))
        except zmq.Again:
            # libzmq dropped the pipe to the coordinator (a re-made connection was refused): a
            # lost connection once joined; before, the member joins again on the next handshake
            self._answer(member.connection(ConnectionEvent.DISCONNECTED))
            member.check()
        except zmq.ZMQError as exc:
            what = (f"rank {member.rank} could not send {msg.kind.name} seq {msg.seq} to the "
                    f"coordinator at {member.endpoint}")
            raise _sockets.library_error(exc, what) from exc

    def pump(self, deadline: Optional[float], until: Optional[Callable[[], bool]] = None) -> bool:
        """One wait covers the DEALER and its monitor, so a disconnect ends a
        wait at once."""
        names = self.watching()
        while True:
            woke = self.waiter.wait(names, deadline, POLL_SLICE_S)
            mail = mail_woke(woke)
            self.mail_ready |= mail
            if not woke or woke[0] is DEADLINE:  # nothing came: the monitor is asked anyway
                self._drain_monitor()
            else:  # first: a FAIL that came before a disconnect explains it
                got = DEALER in woke and self._drain_dealer(True, until)  # (not asked again if the
                if MONITOR in woke:  # poll did not find it: the next wait does)
                    self._drain_dealer()  # all of it, past ``until``: a FAIL explains a close
                    self._drain_monitor()
                if got or NUDGE in woke or mail:
                    return True
            if self.member.failure is not None:
                return True
            if DEADLINE in woke:
                return False

    def slice_s(self) -> Optional[float]:
        return POLL_SLICE_S

    def _drain_dealer(self, waiting: bool = False, until: Optional[Callable[[], bool]] = None) -> bool:
        """Handle every message waiting (``waiting``: a poll just found one); True if there
        was one. Once ``until()`` holds and no other call is in flight, the rest
        stays queued for the next wait (see docs/protocol.md, *Drivers*; and rule 3
        of :mod:`zcollective._future`). A done-callback that calls into the group
        re-enters here and goes on with the rest."""
        dealer, member = self.dealer, self.member
        got = False
        while waiting or _sockets.readable(dealer):
            waiting, got = False, True
            replies = member.receive(_sockets.recv_message(dealer))
            if replies:
                self._answer(replies)
            if member.relay is not None and member.mail is not None and member.mail.out:
                self.mail_io(take=False)  # a result for the subtree goes down at once
            if until is not None and not member.calls and until() and not self.sleepers():
                break
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

    def _drain_monitor(self) -> None:
        config, member = self._config, self.member
        for kind, value in _sockets.monitor_events(self.monitor):
            if kind == zmq.EVENT_CONNECTED:
                self._offers += 1
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self._offers > 1:
                # libzmq re-made a connection with a token an earlier one may have spent
                if not member.joined and member.failure is None:
                    self._renew_token()
                continue  # once joined, the lost connection already failed the group
            refusal = _sockets.handshake_refusal(kind, value, member.rank, member.endpoint,
                                                 config.secret is not None)
            if refusal is not None:
                self._answer(member.fail(refusal))
            elif kind in _EVENTS:
                self._answer(member.connection(_EVENTS[kind]))

    def _renew_token(self) -> None:
        """Connect anew with a fresh token (libzmq stopped trying with the
        refused one). Whatever was queued goes with the old connection: the
        member joins again once the new handshake succeeds."""
        config = self._config
        assert config.secret is not None
        self._offers = 0
        with _sockets.mapped(f"rank {config.rank} cannot connect to {config.endpoint}", address=True):
            _zap.connect_with_token(self.dealer, config.endpoint, config.secret, _zap.MASTER_DOMAIN)

    def close(self, linger_ms: int = 0) -> None:
        if self.member.coordinator_lost:
            linger_ms = 0  # what is queued has nobody to go to: ending must not wait for it
        _sockets.close_monitored(self.dealer, self.monitor, linger_ms)
