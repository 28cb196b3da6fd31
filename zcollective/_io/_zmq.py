"""The ZeroMQ transport behind the I/O seam (:mod:`.transport`): the coordinator's end
(:class:`Hub`: a ROUTER at the master address, its monitor, the ZAP handler with a secret).
Only modules behind the seam know it is ZeroMQ; the drivers above ask for frames and events.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Any, Callable, ClassVar, Optional, Union

import zmq
from zmq.backend import zmq_poll

from .._limits import CLOSE_LINGER_MS, FORM_BIND_RETRY_S
from .._protocol._member import ConnectionEvent
from ..config import Config
from ..errors import CollectiveError
from . import _sockets, _zap
from ._interrupts import Waiter

log = logging.getLogger("zcollective")

recv_frame = zmq.backend.Socket.recv  # (the Cython method: pyzmq's sugar costs more; the mailbox's too)
NOBLOCK, _POLLIN = int(zmq.NOBLOCK), int(zmq.POLLIN)
_REFUSED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
ROUTER, MONITOR, ZAP = "router", "monitor", "zap"  # the hub's sources, as a waiter names them


def reader(name: str) -> Callable[[Any, bool], Optional[list[Any]]]:
    """A transport end's ``recv``, reading its socket named ``name`` (one body for both ends; a
    method of each, so no call in between: the read is on every message's path)."""

    def recv(self: Any, waiting: bool) -> Optional[list[Any]]:
        """The next message's frames, without blocking (``waiting``: a poll found one); None if none."""
        sock = getattr(self, name)
        if sock is None or not (waiting or zmq_poll([(sock, _POLLIN)], 0)):
            return None
        try:
            frames = [recv_frame(sock, NOBLOCK, False)]
        except zmq.Again:  # a poll's verdict gone stale: a signal handler's call read it meanwhile
            return None
        while frames[-1].more:
            frames.append(recv_frame(sock, NOBLOCK, False))
        return frames
    return recv


class Hub:
    """The coordinator's end of the star (see :class:`.transport.Hub`)."""

    SOURCES: ClassVar[tuple[str, ...]] = (ROUTER, MONITOR, ZAP)

    def __init__(self, ctx: Any, config: Config, host: str, forming: bool) -> None:
        self.ctx, self.config = ctx, config
        self.host = host  # in errors: its program ("rank 0", "old rank 3")
        self.forming = forming  # binding a formed group's port: the old holder may still be leaving
        self.port = config.master_port  # bound (0: the system chose, a sub-group's)
        self.router: Optional[zmq.Socket] = None
        self.monitor: Optional[zmq.Socket] = None
        self.gatekeeper: Optional[_zap.Gatekeeper] = None  # with a secret: the ZAP handler (a data
        # socket of rank 0's context uses it too)
        self._refusals: list[str] = []  # peers refused at the handshake without a secret here
        self.handover = True  # ROUTER_HANDOVER is on (while joining only)

    def bind(self) -> tuple[zmq.Socket, zmq.Socket]:
        """Bind the ROUTER (with a secret, the ZAP handler first); raise CollectiveError."""
        config = self.config
        if config.secret is not None:  # before the ROUTER can take a handshake
            with _sockets.mapped("rank 0 cannot start the coordinator's ZAP handler"):
                self.gatekeeper = _zap.Gatekeeper(self.ctx, config.secret)
        try:
            return self._bind_router()
        except BaseException:
            self._close_gatekeeper()
            raise

    def watch(self, router: zmq.Socket, monitor: zmq.Socket, waiter: Waiter) -> int:
        """Watch the ROUTER, the ZAP handler, and the monitor by its file descriptor
        (its ZMQ_EVENTS cost a system call a poll: readable whenever an event came since
        :meth:`events` read to the end); the connections closed so far."""
        self.router, self.monitor = router, monitor
        waiter.watch(ROUTER, router)
        waiter.watch(MONITOR, monitor.FD)
        if self.gatekeeper is not None:
            waiter.watch(ZAP, self.gatekeeper.source)
        return self.events()

    def refusals(self) -> list[str]:
        """The first peers refused at the handshake, and why."""
        return self.gatekeeper.first_refusals if self.gatekeeper is not None else self._refusals

    def handshakes(self) -> None:
        """Answer the handshakes waiting for the ZAP handler."""
        if self.gatekeeper is not None:
            self.gatekeeper.serve()

    recv = reader("router")  # (its peer first)

    @staticmethod
    def address(frame: Any) -> str:
        return _sockets.peer_address(frame)

    def send(self, frames: list[Any]) -> bool:
        """Send to the peer named by the first frame (``ROUTER_MANDATORY``); False if its
        connection is gone (no pipe: ``EHOSTUNREACH``, or ``EAGAIN`` for a pipe libzmq closes)."""
        try:
            _sockets.send_frames(self.router, frames)  # type: ignore[arg-type]  # (sent while open)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise CollectiveError(f"the coordinator could not send: {exc.strerror} (errno {exc.errno})"
                                  ) from exc
        return True

    def joined(self) -> None:
        """Joined: nobody takes over a member's routing id any more (libzmq 4.3.5 aborts rank 0,
        'Assertion failed: !_io_error (src/stream_engine_base.cpp:310)', when strangers reuse a
        routing id on quick connections to a ROUTER with handover on)."""
        if self.handover and self.router is not None:
            self.handover = False
            self.router.setsockopt(zmq.ROUTER_HANDOVER, 0)

    def events(self) -> int:
        """Read the monitor to the end: log strangers refused; the connections closed."""
        closed = 0
        if self.monitor is None:
            return closed
        for kind, value in _sockets.monitor_events(self.monitor):
            if kind == zmq.EVENT_DISCONNECTED:
                closed += 1
            elif kind in _REFUSED_EVENTS and self.gatekeeper is not None:
                # a peer without credentials: libzmq refused it before asking the gatekeeper
                self.gatekeeper.log_refusal(None, _zap.MASTER_DOMAIN,
                                            _sockets.handshake_problem(value) if kind ==
                                            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL else
                                            "it closed the connection during the handshake")
            elif kind in _REFUSED_EVENTS:  # no secret here
                why = ("a peer offered credentials: it has a secret and rank 0 has none"
                       if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _sockets.MECHANISM_MISMATCH
                       else "a peer closed its connection during the handshake (a secret on one side only?)")
                if why not in self._refusals and len(self._refusals) < _zap.FIRST_REFUSALS:
                    self._refusals.append(why)
        return closed

    def close(self, linger_ms: int) -> None:
        router, monitor, self.router = self.router, self.monitor, None
        if router is not None and monitor is not None:
            _sockets.close_monitored(router, monitor, linger_ms)
        self._close_gatekeeper()  # after the ROUTER: no handshake is left to answer

    def _close_gatekeeper(self) -> None:
        if self.gatekeeper is not None:
            self.gatekeeper.close()
            self.gatekeeper = None

    def _bind_router(self) -> tuple[zmq.Socket, zmq.Socket]:
        config = self.config
        with _sockets.mapped("rank 0 cannot make the coordinator's socket"):
            router = self.ctx.socket(zmq.ROUTER)
        with _sockets.closed_on_error(router):
            with _sockets.mapped("rank 0 cannot set the coordinator's socket options"):
                if self.gatekeeper is not None:
                    _zap.secure_server(router, self.gatekeeper, _zap.MASTER_DOMAIN)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                router.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
                router.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
                _sockets.set_never_drop(router)
                _sockets.set_heartbeats(router, config)
            host = _bindable(config.bind_host)
            if ":" in host and not host.startswith("["):
                host = f"[{host}]"
                router.setsockopt(zmq.IPV6, 1)
            _sockets.bind(router, f"tcp://{host}:{config.master_port}",
                          in_use=f"{self.host} cannot host the coordinator: port {config.master_port} on "
                                 f"{config.master_addr} is already in use by another program",
                          cannot=f"{self.host} cannot bind the coordinator to {config.endpoint}: {{reason}} "
                                 f"(master_addr must be an address of rank 0's host)",
                          retry_s=FORM_BIND_RETRY_S if self.forming else 0.0)
            self.port = int(router.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2])
            with _sockets.mapped("rank 0 cannot watch the coordinator's connections"):
                # DISCONNECTED, and peers refused before any ZAP request, to name at a join timeout
                # (a mismatch of mechanisms is seen by whichever end reads the other's greeting
                # first: when the peer closes first, this end sees no detail)
                monitor = _sockets.monitor_socket(router, zmq.EVENT_DISCONNECTED | sum(_REFUSED_EVENTS))
        from .._protocol._coordinator import is_loopback  # (rank 0's module: loaded)

        if config.secret is None and not is_loopback(host):
            log.warning(
                "zcollective: the coordinator listens on %s:%d without a secret: anyone who can "
                "reach this port can run code in every replica (pickles are code). Set "
                "ZCOLLECTIVE_SECRET or ZCOLLECTIVE_SECRET_FILE on every replica; see "
                "docs/security.md", config.bind_host, config.master_port)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a replica reconnecting while joining keeps its id
        return router, monitor


def _bindable(host: str) -> str:
    """libzmq binds interfaces and IP literals: resolve a host name to its IP."""
    if host == "*":
        return host
    try:
        ipaddress.ip_address(host.strip("[]"))
        return host
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return host  # let bind report it


_EVENTS: dict[int, ConnectionEvent] = {
    zmq.EVENT_CONNECTED: ConnectionEvent.CONNECTED,
    zmq.EVENT_DISCONNECTED: ConnectionEvent.DISCONNECTED,
    zmq.EVENT_HANDSHAKE_SUCCEEDED: ConnectionEvent.HANDSHAKE_SUCCEEDED,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: ConnectionEvent.HANDSHAKE_FAILED,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: ConnectionEvent.PROTOCOL_VIOLATION,
    zmq.EVENT_CONNECT_RETRIED: ConnectionEvent.REFUSED,  # (also after a disconnect: the member tells)
}
MONITOR_EVENTS = sum(_EVENTS) | zmq.EVENT_HANDSHAKE_FAILED_AUTH  # (one bit each; AUTH: handshake_refusal)
DEALER = "dealer"  # a link's socket, as a waiter names it (its monitor: MONITOR)


def routing_id(rank: int) -> bytes:
    """``b"R"``, the rank, then random bytes (why: see docs/protocol.md, *Topology*)."""
    return b"R" + rank.to_bytes(4, "big") + os.urandom(8)


class Link:
    """A replica's end of the star (see :class:`.transport.Link`): a DEALER connected to the
    coordinator at ``config.endpoint``; with a secret, it offers a single-use token at each
    handshake: a token refused on its first offer means another secret, one refused on a
    connection libzmq re-made was spent (then it connects anew with a fresh one)."""

    SOURCES: ClassVar[tuple[str, ...]] = (DEALER, MONITOR)

    def __init__(self, ctx: Any, config: Config, forming: bool) -> None:
        self._config = config
        self._offers = 0  # TCP connections made since the DEALER got its current token
        with _sockets.mapped(f"rank {config.rank} cannot make its socket"):
            self.dealer = ctx.socket(zmq.DEALER)
            with _sockets.closed_on_error(self.dealer):
                self.dealer.setsockopt(zmq.ROUTING_ID, routing_id(config.rank))
                self.dealer.setsockopt(zmq.LINGER, 0)  # (forming: the host binds within milliseconds)
                self.dealer.setsockopt(zmq.RECONNECT_IVL, _sockets.FORM_RECONNECT_IVL_MS if forming
                                       else _sockets.RECONNECT_IVL_MS)
                self.dealer.setsockopt(zmq.RECONNECT_IVL_MAX, _sockets.FORM_RECONNECT_IVL_MAX_MS
                                       if forming else _sockets.RECONNECT_IVL_MAX_MS)
                _sockets.set_never_drop(self.dealer)
                _sockets.set_heartbeats(self.dealer, config)
                if config.secret is not None:
                    _zap.secure_client(self.dealer, config.secret, _zap.MASTER_DOMAIN)
                self.monitor = _sockets.monitor_socket(self.dealer, MONITOR_EVENTS)

    def connect(self, waiter: Waiter) -> None:
        """Watch the DEALER and its monitor (by its file descriptor, asked once before the
        connect: only :meth:`events` asks it again, reading to the end), then connect."""
        config = self._config
        _sockets.readable(self.monitor)
        waiter.watch(DEALER, self.dealer)
        waiter.watch(MONITOR, self.monitor.FD)
        with _sockets.mapped(f"rank {config.rank} cannot connect to {config.endpoint}", address=True):
            self.dealer.connect(config.endpoint)

    def send(self, frames: list[Any], what: Any = None) -> bool:
        """Send ``frames`` (of message ``what``, named in an error) without blocking; False if
        libzmq dropped the pipe (a re-made connection was refused)."""
        try:
            _sockets.send_frames(self.dealer, frames)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            config = self._config
            raise _sockets.library_error(exc, f"rank {config.rank} could not send {what.kind.name} seq "
                                              f"{what.seq} to the coordinator at {config.endpoint}") from exc
        return True

    recv = reader("dealer")

    def events(self, rank: int, joining: bool) -> list[Union[ConnectionEvent, Exception]]:
        """Read the monitor to the end: what happened to the connection, or the error of a refusal
        over the secret (``joining``: a spent token is renewed)."""
        config, out = self._config, list[Union[ConnectionEvent, Exception]]()
        for kind, value in _sockets.monitor_events(self.monitor):
            if kind == zmq.EVENT_CONNECTED:
                self._offers += 1
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self._offers > 1:
                if joining:  # libzmq re-made a connection with a token an earlier one may have spent
                    self._renew_token()
                continue  # once joined, the lost connection already failed the group
            refusal = _sockets.handshake_refusal(kind, value, rank, config.endpoint,
                                                 config.secret is not None)
            if refusal is not None:
                out.append(refusal)
            elif kind in _EVENTS:
                out.append(_EVENTS[kind])
        return out

    def _renew_token(self) -> None:
        """Connect anew with a fresh token (libzmq stopped trying with the refused one). What
        was queued goes with the old connection: the member joins again once it is made."""
        config = self._config
        assert config.secret is not None
        self._offers = 0
        with _sockets.mapped(f"rank {config.rank} cannot connect to {config.endpoint}", address=True):
            _zap.connect_with_token(self.dealer, config.endpoint, config.secret, _zap.MASTER_DOMAIN)

    def close(self, linger_ms: int) -> None:
        _sockets.close_monitored(self.dealer, self.monitor, linger_ms)


COORDINATOR_IO_THREADS = 2  # rank 0 talks to every replica: a second libzmq I/O thread cut
# 16 MiB allreduce at N=4 from 72 to 45 ms (medians of 5, benchmarks/README.md); others have 1 link


def context(rank: int) -> Any:
    """The transport's state for one group (a ZeroMQ context; raise CollectiveError)."""
    with _sockets.mapped(f"rank {rank} cannot start ZeroMQ"):
        return zmq.Context(io_threads=COORDINATOR_IO_THREADS if rank == 0 else 1)


def end(ctx: Any, rank: int) -> None:
    """Let go of :func:`context`'s (every socket closed: it holds no buffer of ours after)."""
    try:
        with _sockets.mapped(f"rank {rank} could not close ZeroMQ"):
            ctx.term()
    finally:
        _sockets.forget(ctx)


def before_exit() -> None:
    """pyzmq registers the shutdown of its zero-copy garbage collector when that module is first
    imported, which may be at our first large send: import it now, so that an ``atexit`` hook
    registered after this runs first (last-in, first-out)."""
    import zmq.utils.garbage  # noqa: F401
