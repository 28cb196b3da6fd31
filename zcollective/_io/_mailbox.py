"""A replica's mailbox: the sockets of its point-to-point messages. It binds
one PULL (its mailbox port, which its JOIN names) and connects a PUSH to
another rank's the first time it sends that rank something. A handshake
needs a token under the group's key for that rank's port, as a data port's
does (docs/protocol.md, *Point to point*); what a message may carry and
which receive takes it is decided by :mod:`zcollective._protocol._p2p`.
"""

from __future__ import annotations

from typing import Any, Optional

import zmq

from .._limits import HANDSHAKE_MIN_MS
from .._protocol import _tokens
from ..config import Config
from . import _sockets, _zap
from ._dataplane import TRACKER_POLL_S, local_address

__all__ = ["MAIL", "TRACKER_POLL_S", "MailSockets"]

MAIL = "mail"  # its socket's name in a waiter
TAKE_BATCH = 256  # messages taken in one go (then the owner looks at its other sockets)


class MailSockets:
    """One replica's mailbox sockets; used only by the thread that owns the group."""

    def __init__(self, ctx: zmq.Context, config: Config, gatekeeper: Optional[_zap.Gatekeeper]) -> None:
        """Bind the mailbox port. Its handshakes are answered by
        ``gatekeeper`` (the context's: rank 0's coordinator's under a secret)
        or by a gate thread of its own, which :attr:`gatekeeper` then is (a
        data plane shares it); none is accepted before :meth:`start`."""
        self.rank, self._ctx, self._config = config.rank, ctx, config
        self._gate: Optional[_zap.GateThread] = None
        self._pushes: dict[int, zmq.Socket] = {}
        self._endpoints: list[str] = []
        self._key = b""
        with _sockets.mapped(f"rank {self.rank} cannot open its mailbox port", address=True):
            if gatekeeper is None:
                self._gate = _zap.GateThread(ctx)
                gatekeeper = self._gate.gatekeeper
            gatekeeper.rekey(None, _zap.MAIL_DOMAIN)  # no token opens it before the WELCOME
            self.gatekeeper = gatekeeper
            self._pull = ctx.socket(zmq.PULL)
            try:
                self._setup(self._pull)
                _zap.secure_server(self._pull, gatekeeper, _zap.MAIL_DOMAIN)
                host = local_address(config)
                if host.startswith("["):
                    self._pull.setsockopt(zmq.IPV6, 1)
                self._pull.bind(f"tcp://{host}:*")
                self.endpoint: str = self._pull.getsockopt(zmq.LAST_ENDPOINT).decode()
            except BaseException:
                self._pull.close(linger=0)
                if self._gate is not None:
                    self._gate.close()
                raise

    @property
    def source(self) -> zmq.Socket:
        """What a waiter watches for a message waiting."""
        return self._pull

    def _setup(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(HANDSHAKE_MIN_MS, int(self._config.liveness_timeout * 1000)))
        sock.setsockopt(zmq.MAXMSGSIZE, self._config.max_frame_bytes)
        _sockets.set_never_drop(sock)  # the senders' windows bound what is queued
        _sockets.set_heartbeats(sock, self._config)

    def start(self, session: int, endpoints: list[str], base: bytes) -> None:
        """The group is welcomed: this port accepts the tokens of its group's
        key (``base``: the secret, or the WELCOME's key); ``endpoints``: every
        rank's mailbox."""
        self._endpoints, self._session, self._base = endpoints, session, base
        key = _tokens.port_key(base, session, self.rank, _tokens.MAIL_LABEL)
        self.gatekeeper.rekey(key, _zap.MAIL_DOMAIN)

    def send(self, dest: int, frames: list[Any], track: bool = False) -> Any:
        """Queue ``frames`` for ``dest`` (never blocks: its window bounds what
        is queued); ``track``: a tracker of the last frame (libzmq writes a
        message's frames in order: once it lets go of the last, it let go of all)."""
        push = self._pushes.get(dest)
        if push is None:
            push = self._connect(dest)
        return push.send_multipart(frames, copy=False, track=track)

    def _connect(self, dest: int) -> zmq.Socket:
        target = self._endpoints[dest]
        key = _tokens.port_key(self._base, self._session, dest, _tokens.MAIL_LABEL)
        with _sockets.mapped(f"rank {self.rank} cannot connect to rank {dest}'s mailbox {target}",
                             address=True):
            push = self._ctx.socket(zmq.PUSH)
            with _sockets.closed_on_error(push):
                self._setup(push)
                if "[" in target:
                    push.setsockopt(zmq.IPV6, 1)
                _zap.secure_client(push, key, _zap.MAIL_DOMAIN)
                push.connect(target)
        self._pushes[dest] = push
        return push

    def take(self) -> list[list[Any]]:
        """The messages waiting (at most :data:`TAKE_BATCH`), without blocking."""
        taken: list[list[Any]] = []
        pull = self._pull
        while len(taken) < TAKE_BATCH and _sockets.readable(pull):
            taken.append(_sockets.recv_message(pull))
        return taken

    def close(self, linger_ms: int = 0) -> None:
        for push in self._pushes.values():
            push.close(linger=linger_ms)
        self._pull.close(linger=0)
        if self._gate is not None:
            self._gate.close()
