"""Socket options of the coordinator's ROUTER and each replica's DEALER, and the one place where
``zmq.ZMQError`` (or a monitor's handshake refusal) becomes a library error (:func:`mapped`)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import zmq
from zmq.backend import zmq_poll

from .._limits import heartbeats
from ..config import Config
from ..errors import AddressError, AuthenticationError, CollectiveError
from . import _interrupts

ZERO_COPY_MIN_BYTES = 1 << 16  # pyzmq's copy_threshold: below it a copy is cheaper than zero-copy
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)  # every send: EAGAIN says that link is gone (docs/protocol.md, *Drivers*)
_POLLIN = int(zmq.POLLIN)
_MONITOR_EVENT = struct.Struct("=HI")  # a monitor event: id, value (zmq.utils.monitor imports asyncio)
_send = zmq.backend.Socket.send  # the Cython methods: pyzmq's multipart sugar costs 3x more
_recv = zmq.backend.Socket.recv

RECONNECT_IVL_MS = 100  # first retry soon: replicas usually start within a second of rank 0
RECONNECT_IVL_MAX_MS = 200  # back off to this: a missing master is not hammered, a late one soon reached
FORM_RECONNECT_IVL_MS = 10  # a survivor reaching the host of a formed group: it binds within
FORM_RECONNECT_IVL_MAX_MS = 100  # milliseconds of the loss, and every one counts (issue 23)
BIND_RETRY_STEP_S = 0.005  # a port held by a process that is being killed: tried again this often
_ADDRESS_ERRNOS = {zmq.EADDRINUSE, zmq.EADDRNOTAVAIL, zmq.EPROTONOSUPPORT}  # an unusable address


def set_heartbeats(sock: zmq.Socket, config: Config) -> None:
    """ZMTP heartbeats: libzmq's own threads answer them, outside the GIL, so a busy replica is never mistaken
    for a dead one. A silent peer is dropped after about ``liveness_timeout`` seconds."""
    ivl, timeout, ttl = heartbeats(config.liveness_timeout)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ttl)


def set_never_drop(sock: zmq.Socket) -> None:
    """No high-water mark: ZeroMQ must never drop a message silently (the calls in flight bound memory)."""
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


@contextlib.contextmanager
def mapped(what: str, address: bool = False) -> Iterator[None]:
    """Translate a ZeroMQ error into :func:`library_error`'s."""
    try:
        yield
    except zmq.ZMQError as exc:
        raise library_error(exc, what, address) from exc


@contextlib.contextmanager
def closed_on_error(sock: zmq.Socket) -> Iterator[None]:
    """Close ``sock`` at once if the block (its setting up) raises."""
    try:
        yield
    except BaseException:
        sock.close(linger=0)
        raise


def library_error(exc: zmq.ZMQError, what: str, address: bool = False) -> CollectiveError:
    """The library error for ``exc``, naming ``what``: :class:`AddressError` for an unusable ``address``,
    else :class:`CollectiveError`."""
    unusable = exc.errno in _ADDRESS_ERRNOS or address and exc.errno == zmq.EINVAL
    return (AddressError if unusable else CollectiveError)(f"{what}: {exc.strerror} (errno {exc.errno})")


CONTEXT_DESCRIPTORS = 8  # a context's first socket needs these (threads' pollers, wake-ups): libzmq
# aborts the process if it cannot make them, so a context starts only with these many left


def check_descriptors(what: str, count: int = CONTEXT_DESCRIPTORS) -> None:
    """Raise :class:`CollectiveError` naming ``what`` if this process cannot open ``count`` more files."""
    held: list[int] = []
    try:
        for _ in range(count):
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        raise CollectiveError(f"{what}: {exc.strerror} (errno {exc.errno}): {len(held)} more file "
                              f"descriptors could be opened, a ZeroMQ context needs {count} to start; "
                              f"raise the limit (ulimit -n)") from None
    finally:
        for fd in held:
            os.close(fd)


LISTEN_BACKLOG = 100  # libzmq's own default (ZMQ_BACKLOG): a whole job may connect at once
_listening: dict[int, tuple[int, int, int]] = {}  # fd -> (family, port, context): our ports, kept until
# their context ends (libzmq closes them later); a forked child closes those still listening
_forking = threading.RLock()  # a fork waits while a descriptor is made (RLock: a handler may fork)


def _close_in_child() -> None:
    """A forked child must not hold its parent's ports: a group forming again binds them (issue 31)."""
    _forking.release()
    for fd, (family, port, _) in list(_listening.items()):
        if _listens_at(fd, family, port):
            with contextlib.suppress(OSError):
                os.close(fd)  # the child's copy: the parent's stays open
    _listening.clear()


def _listens_at(fd: int, family: int, port: int) -> bool:
    """Is ``fd`` (still) a listening TCP socket on ``port``? (Its number may have been reused.)"""
    try:
        with socket.socket(family, socket.SOCK_STREAM, fileno=os.dup(fd)) as sock:  # (a duplicate)
            return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)) and (
                sock.getsockname()[1] == port)
    except OSError:
        return False


if hasattr(os, "register_at_fork"):  # (no fork without it)
    os.register_at_fork(before=_forking.acquire, after_in_parent=_forking.release,
                        after_in_child=_close_in_child)


def bind(sock: zmq.Socket, endpoint: str, in_use: str, cannot: str, retry_s: float = 0.0) -> None:
    """Bind ``sock``; raise :class:`AddressError` saying ``in_use`` when the port is taken (after
    ``retry_s``), else ``cannot``. TCP listens through a descriptor made here (``ZMQ_USE_FD``) that a
    forked child closes (:func:`_close_in_child`)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            fd = _listen(endpoint, id(sock.context))
            if fd is not None:
                sock.setsockopt(zmq.USE_FD, fd)
            try:
                sock.bind(endpoint)
            except BaseException:
                if fd is not None:
                    _listening.pop(fd, None)
                    os.close(fd)
                raise
            return
        except (zmq.ZMQError, OSError) as exc:
            if exc.errno != zmq.EADDRINUSE:
                reason = exc.strerror if isinstance(exc, zmq.ZMQError) else str(exc)
                raise AddressError(cannot.format(reason=reason)) from None
            if time.monotonic() >= deadline:
                raise AddressError(in_use) from None
        _interrupts.sleep(BIND_RETRY_STEP_S)


def forget(context: zmq.Context) -> None:
    """``context`` was terminated: its descriptors are no longer ours to close in a child."""
    with _forking:
        for fd in [fd for fd, (_, _, owner) in _listening.items() if owner == id(context)]:
            del _listening[fd]


def _listen(endpoint: str, owner: int) -> Optional[int]:
    """A listening TCP socket's descriptor for ``tcp://host:port``, recorded; None for what only libzmq
    can bind (an interface name, port ``*``)."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isdigit():
        return None
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.inet_pton(family, "0.0.0.0" if host == "*" else host)
    except OSError:
        return None  # not an IP literal: libzmq resolves it (and reports what it cannot)
    with _forking:  # listening and recorded before a fork can copy it unseen
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq: TIME_WAIT is no bar
            sock.bind(("0.0.0.0" if host == "*" else host, int(port)))
            sock.listen(LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
        _listening[sock.fileno()] = (family, int(port), owner)
    return sock.detach()


MECHANISM_MISMATCH = int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)  # one side has a secret, one not


def handshake_refusal(event: int, value: int, rank: int, endpoint: str,
                      secret: bool) -> Optional[AuthenticationError]:
    """The error for rank ``rank``'s handshake with the coordinator at ``endpoint`` (``secret``: the rank has
    one) that failed over the secret, from a socket monitor's event; None for any other event."""
    who, peer, holder = f"rank {rank}", f"the coordinator at {endpoint}", "rank 0"
    advice = "set the same ZCOLLECTIVE_SECRET everywhere"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return AuthenticationError(
            f"{who}: {peer} refused its credentials at the ZeroMQ handshake (ZAP status {value}): "
            f"{holder} has a different secret, or the port is another job's (zcollective-run gives "
            f"each job a secret of its own); {advice}, and give each job its own port")
    if event != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL or value != MECHANISM_MISMATCH:
        return None
    if secret:
        return AuthenticationError(
            f"{who}: {peer} does not authenticate peers at the ZeroMQ handshake (security "
            f"mechanism mismatch: this replica speaks PLAIN): {holder} has no secret; {advice}")
    return AuthenticationError(
        f"{who}: {peer} refused it at the ZeroMQ handshake (security mechanism mismatch: it "
        f"requires credentials): {holder} has a secret and this replica has none; {advice}")


def handshake_problem(value: int) -> str:
    """What a server's ``EVENT_HANDSHAKE_FAILED_PROTOCOL`` says of its peer."""
    if value == MECHANISM_MISMATCH:
        return "it offered no credentials (another ZeroMQ security mechanism than PLAIN)"
    return f"it broke the ZeroMQ handshake (protocol error {value:#x})"


def peer_address(frame: Any) -> str:
    """The peer address a received frame came in on (libzmq's metadata)."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:  # a legacy ZMTP 1.0 peer: libzmq gives no address
        return "an unknown address"


def close_monitored(sock: zmq.Socket, monitor: zmq.Socket, linger_ms: int) -> None:
    """Close a socket and its monitor; what is queued gets ``linger_ms`` to leave."""
    with contextlib.suppress(zmq.ZMQError):  # never enabled, or already off
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=linger_ms)


def send_frames(sock: zmq.Socket, frames: list[Any], track: bool = False) -> Any:
    """Send a multipart message without blocking (``zmq.Again``: no pipe to the peer, the link is lost);
    large frames go without a copy. ``track``: the last such frame's tracker (frames are let go in order)."""
    last, tracker = len(frames) - 1, None
    for i, frame in enumerate(frames):
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        flags, copy = (_SNDMORE if i < last else 0) | _NOBLOCK, size < ZERO_COPY_MIN_BYTES
        if track and not copy:
            tracker = _send(sock, frame, flags, False, True)
        else:
            _send(sock, frame, flags, copy)
    return tracker


def recv_message(sock: zmq.Socket) -> list[Any]:
    """Receive one multipart message known to be waiting (never blocks: frames come together)."""
    frames = [_recv(sock, _NOBLOCK, False)]
    while frames[-1].more:
        frames.append(_recv(sock, _NOBLOCK, False))
    return frames


def kernel_port(host: str) -> int:
    """A TCP port of ``host`` the kernel just chose as free (port 0 bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def readable(sock: zmq.Socket) -> bool:
    """A message is waiting (a zero-timeout poll: cheaper than ZMQ_EVENTS's enum)."""
    return bool(zmq_poll([(sock, _POLLIN)], 0))


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR receiving ``sock``'s monitor events with no bound (RCVHWM 0): libzmq's I/O threads *block* on
    a full monitor pipe, so a stranger's connections would stop heartbeats while the reader is busy."""
    endpoint = f"inproc://zcollective-monitor-{id(sock):x}-{os.urandom(4).hex()}"
    sock.monitor(endpoint, events)
    pair = sock.context.socket(zmq.PAIR)
    with closed_on_error(pair):
        pair.setsockopt(zmq.RCVHWM, 0)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(endpoint)
    return pair


def monitor_events(monitor: zmq.Socket) -> Iterator[tuple[int, int]]:
    """The (event, value) pairs waiting on a socket monitor, without blocking."""
    while readable(monitor):
        frames = recv_message(monitor)
        if len(frames) == 2 and len(frames[0]) == _MONITOR_EVENT.size:  # (else not libzmq's)
            yield _MONITOR_EVENT.unpack(frames[0].bytes)


class Wakeup:
    """A pipe one thread writes to wake another watching its read end, readable until :meth:`clear`."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)
        self.written = False  # a byte may be in the pipe: clear() must read it
        self._open = True

    def set(self) -> None:
        if not self._open:
            return  # (its numbers may be another file's now)
        with contextlib.suppress(OSError):  # full (it is readable anyway) or closed (nobody waits)
            os.write(self._write, b"\0")
        # after the write: a clear() between costs one spurious wake; before, it could lose the wake
        self.written = True

    def clear(self) -> None:
        if not self.written or not self._open:
            return  # nothing written since the last clear: spare the system call
        self.written = False
        with contextlib.suppress(OSError):
            os.read(self.fd, 4096)

    def close(self) -> None:
        fds, self._open = (self.fd, self._write) if self._open else (), False  # once: the numbers
        for fd in fds:  # may be another file's afterwards
            with contextlib.suppress(OSError):
                os.close(fd)
