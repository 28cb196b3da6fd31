"""Authentication at the ZeroMQ handshake: a peer that cannot prove it knows the secret is refused before
libzmq takes in a message from it (tokens: :mod:`zcollective._protocol._tokens`; docs/protocol.md, *Drivers*).

Use (the drivers')::

    gate = Gatekeeper(ctx, secret)            # first: binds ctx's ZAP endpoint
    secure_server(router, gate, MASTER_DOMAIN)  # before router.bind(...)
    ... watch gate.source in a waiter (_interrupts.Waiter), gate.serve() when readable
    gate.close()                               # by the thread that made it
    secure_client(dealer, secret, MASTER_DOMAIN)  # before each dealer.connect(...), or
    connect_with_token(dealer, endpoint, secret, MASTER_DOMAIN)
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Optional

import zmq

from .._protocol._tokens import NOT_YET, TokenChecker, client_credentials, zap_reply
from . import _interrupts, _sockets

log = logging.getLogger("zcollective")

__all__ = ["MASTER_DOMAIN", "DATA_DOMAIN", "MAIL_DOMAIN", "Gatekeeper", "GateThread", "connect_with_token",
           "secure_client", "secure_server"]

MASTER_DOMAIN = "zcollective-master"  # the coordinator's ROUTER
DATA_DOMAIN = "zcollective-data"  # a replica's data socket
MAIL_DOMAIN = "zcollective-mail"  # a replica's mailbox (point to point)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27
MAX_EARLY_NONCES = 1 << 16  # tokens offered before a port's key, remembered as spent (~4 MiB)
GATE_JOIN_S = 5.0  # a gate thread stops within one poll; more means something is badly wrong
FIRST_REFUSALS = 3  # the first refusals (of different addresses), for a join timeout to name
MAX_LOGGED_ADDRESSES = 1024  # refused addresses remembered for logging once; past it, silence


class Gatekeeper:
    """The ZAP handler of one context, answered by :meth:`serve` from the thread that made it; tokens are
    checked under ``secret`` (None: all refused) or a domain's key (rekey). Raises ``zmq.ZMQError``."""

    def __init__(self, ctx: zmq.Context, secret: Optional[bytes]) -> None:
        self.first_refusals: list[str] = []  # "a peer at <address>: <why>", at most FIRST_REFUSALS
        self.ctx = ctx
        self._checker = TokenChecker(secret) if secret is not None else None
        self._domains: dict[bytes, Optional[TokenChecker]] = {}  # keys of their own (see rekey)
        self._early: dict[bytes, set[bytes]] = {}  # usernames offered to a domain before its key
        self._lock = threading.Lock()  # rekey (any thread) against serve (the serving thread)
        self._logged: set[str] = set()
        self.refused = 0  # handshakes refused so far (for tests and stats)
        self.accepted = 0
        self._sock = ctx.socket(zmq.ROUTER)  # a ROUTER never blocks nor enters a bad state
        with _sockets.closed_on_error(self._sock):
            self._sock.setsockopt(zmq.LINGER, 0)
            _sockets.set_never_drop(self._sock)  # a handshake waiting for us is never dropped
            self._sock.bind(ZAP_ENDPOINT)
        self.fd: int = self._sock.FD  # poll for POLLIN, then call serve()

    def serve(self) -> int:
        """Answer every request waiting, without blocking; return how many."""
        sock, answered = self._sock, 0
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            answered += 1
            # [peer id, empty delimiter, request...]
            if len(frames) < 2 or frames[1]:
                continue  # not libzmq's ZAP client: nobody to answer
            domain = frames[4] if len(frames) > 4 else b""
            with self._lock:
                reply, why, address = zap_reply(frames[2:], self._domains.get(domain, self._checker))
                if why is NOT_YET and len(frames) == 10:  # its username: spent, though refused (a
                    early = self._early.setdefault(domain, set())  # copy must not pass once keyed)
                    if len(early) < MAX_EARLY_NONCES:
                        early.add(frames[8])
            with contextlib.suppress(zmq.ZMQError):  # (else the handshake that asked is gone)
                sock.send_multipart([frames[0], b"", *reply], zmq.NOBLOCK)
            if why is None:
                self.accepted += 1
            elif why is not NOT_YET:
                self.refused += 1
                self.log_refusal(address, domain.decode("ascii", "replace")[:40], why)

    def rekey(self, secret: Optional[bytes], domain: str) -> None:
        """Check ``domain``'s tokens under ``secret`` from now on (None: refuse all); from any thread."""
        name = domain.encode()
        with self._lock:
            checker = TokenChecker(secret) if secret is not None else None
            if checker is not None:
                checker.spend(self._early.pop(name, set()))
            self._domains = {**self._domains, name: checker}

    @property
    def source(self) -> zmq.Socket:
        """What to wait on (level-triggered) for a request waiting."""
        return self._sock

    def log_refusal(self, address: Optional[str], domain: str, why: str) -> None:
        """Log a peer refused at the handshake, once per address (None: refused by libzmq, unknown)."""
        key = address or ""
        if key in self._logged or len(self._logged) >= MAX_LOGGED_ADDRESSES:
            return
        self._logged.add(key)
        if len(self.first_refusals) < FIRST_REFUSALS:
            self.first_refusals.append(f"a peer at {address}: {why}" if address else f"a peer: {why}")
        where = domain or "no domain"
        if address is None:
            log.warning("zcollective: refused a peer at the ZeroMQ handshake (%s): %s; libzmq "
                        "does not say from where, and later such refusals are not logged", where, why)
            return
        log.warning("zcollective: refused a peer at %s at the ZeroMQ handshake (%s): %s; "
                    "it sent nothing further, and later refusals of %s are not logged",
                    address, where, why, address)

    def close(self) -> None:
        self._sock.close(linger=0)


class GateThread:
    """A :class:`Gatekeeper` answered at once by a daemon thread owning its socket until :meth:`close`: a
    replica idle in user code must not let strangers' handshakes queue up. Raises as :class:`Gatekeeper`."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.gatekeeper = Gatekeeper(ctx, None)
        try:
            self._stop = _sockets.Wakeup()  # readable once the thread must end
        except BaseException:
            self.gatekeeper.close()
            raise
        self.crashed: Optional[str] = None  # what ended the thread early (a bug of ours)
        self._thread = threading.Thread(target=self._serve, name="zcollective-gate", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            waiter = _interrupts.Waiter(("zap", self.gatekeeper.source), ("stop", self._stop.fd))
            while "stop" not in waiter.wait(("zap", "stop"), None):
                self.gatekeeper.serve()
        except zmq.ZMQError:
            return  # the context is being torn down
        except Exception as exc:  # a bug of ours: every handshake now fails; say why, once
            self.crashed = f"{type(exc).__name__}: {exc}"
            log.exception("zcollective: the data port's gatekeeper thread crashed; its handshakes "
                          "now fail (a bug in zcollective: please report it)")
        finally:
            self.gatekeeper.close()

    def close(self) -> None:
        """Stop the thread (it closes the gatekeeper), then close the pipe."""
        self._stop.set()
        if _interrupts.finish(self._thread, GATE_JOIN_S):
            self._stop.close()
        else:  # (the pipe is left open to it)
            log.warning("zcollective: the gatekeeper thread did not stop within %g s", GATE_JOIN_S)


def secure_server(sock: zmq.Socket, gatekeeper: Gatekeeper, domain: str) -> None:
    """Make ``sock`` (before it binds) accept only peers with a token for ``domain``, checked by
    ``gatekeeper``: ValueError unless it serves ``sock``'s context."""
    if sock.context.underlying != gatekeeper.ctx.underlying:
        raise ValueError("the gatekeeper serves another ZeroMQ context than this socket's")
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


def secure_client(sock: zmq.Socket, secret: bytes, domain: str) -> None:
    """Give ``sock`` a fresh token for ``domain``: before each ``connect`` (one handshake each)."""
    username, password = client_credentials(secret, domain)
    sock.setsockopt(zmq.PLAIN_USERNAME, username)
    sock.setsockopt(zmq.PLAIN_PASSWORD, password)


def connect_with_token(sock: zmq.Socket[Any], endpoint: str, secret: bytes, domain: str) -> None:
    """Connect ``sock`` to ``endpoint`` with a fresh token, dropping any connection there first."""
    with contextlib.suppress(zmq.ZMQError):  # none, or libzmq let go of it (a refused handshake)
        sock.disconnect(endpoint)
    secure_client(sock, secret, domain)
    sock.connect(endpoint)
