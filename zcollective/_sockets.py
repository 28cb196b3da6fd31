"""Socket options shared by the coordinator's ROUTER and each replica's DEALER,
and the one place where ``zmq.ZMQError`` becomes a library error."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import zmq
from zmq.backend import zmq_poll
from zmq.utils.monitor import parse_monitor_message

from .config import Config

ZERO_COPY_MIN_BYTES = 1 << 16  # pyzmq's copy_threshold: below it a copy is cheaper than
# a zero-copy frame (whose release needs pyzmq's gc thread)
_SNDMORE = int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_send = zmq.backend.Socket.send  # the Cython methods: pyzmq's multipart sugar costs 3x more
_recv = zmq.backend.Socket.recv

RECONNECT_IVL_MS = 100  # first retry soon: replicas usually start within a second of rank 0
RECONNECT_IVL_MAX_MS = 2000  # back off to this, so a missing master is not hammered
CLOSE_LINGER_MS = 2000  # time for the last results of a teardown to leave; bounds teardown
EXIT_LINGER_MS = 5000  # a program ending without teardown: time for what it produced to leave
# (results, contributions, notices); a peer that stopped reading holds a process no longer
POLL_SLICE_S = 0.5  # longest a wait sleeps before re-checking failure and thread liveness


def set_heartbeats(sock: zmq.Socket, config: Config) -> None:
    """ZMTP heartbeats: libzmq's own threads answer them, outside the GIL, so a
    busy replica is never mistaken for a dead one. A silent peer is dropped
    after about ``liveness_timeout`` seconds."""
    ivl = max(100, int(config.liveness_timeout * 1000 / 3))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(config.liveness_timeout * 1000) - ivl)
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(config.liveness_timeout * 1000))


def set_never_drop(sock: zmq.Socket) -> None:
    """No high-water mark: ZeroMQ must never drop a message silently. Memory is
    bounded by the calls in flight, which the application bounds."""
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


@contextlib.contextmanager
def mapped(what: str) -> Iterator[None]:
    """Translate a ZeroMQ error into :class:`CollectiveError`, naming ``what``."""
    from .errors import CollectiveError

    try:
        yield
    except zmq.ZMQError as exc:
        raise CollectiveError(f"{what}: {exc.strerror} (errno {exc.errno})") from exc


def send_frames(sock: zmq.Socket, frames: list[Any], copy: bool = False) -> None:
    """Send a multipart message; large frames go without a copy unless ``copy``."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        if copy and isinstance(frame, zmq.Frame):
            # pyzmq sends a Frame by reference whatever `copy` says: copy its bytes
            frame = frame.buffer
        size = len(frame) if isinstance(frame, bytes) else memoryview(frame).nbytes
        big = not copy and size >= ZERO_COPY_MIN_BYTES
        _send(sock, frame, _SNDMORE if i < last else 0, not big)


def recv_message(sock: zmq.Socket) -> list[Any]:
    """Receive one multipart message that is known to be waiting."""
    frames = [_recv(sock, 0, False)]
    while frames[-1].more:
        frames.append(_recv(sock, 0, False))
    return frames


def readable(sock: zmq.Socket) -> bool:
    """A message is waiting. A zero-timeout poll: reading ZMQ_EVENTS costs
    more, as pyzmq wraps the answer in an enum."""
    return bool(zmq_poll([(sock, _POLLIN)], 0))


def monitor_events(monitor: zmq.Socket) -> Iterator[tuple[int, int]]:
    """The (event, value) pairs waiting on a socket monitor, without blocking."""
    while readable(monitor):
        event = parse_monitor_message(monitor.recv_multipart())
        yield int(event["event"]), int(event["value"])
