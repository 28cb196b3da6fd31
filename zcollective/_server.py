"""The thread on rank 0 that owns the coordinator's ROUTER socket.

A thin driver: it receives frames, feeds them to the pure
:class:`~zcollective._coordinator.Coordinator`, and sends what it returns.
It is controlled through an inproc PAIR pipe, as pyzmq's auth thread is, and
reports its start-up (bind) result with a bounded wait.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any, Optional

import zmq
from zmq.backend import zmq_poll

from . import _sockets
from ._coordinator import Coordinator, Out, Phase
from ._wire import DEFAULT_MAX_FRAMES, Signer, encode
from .config import Config
from .errors import CollectiveError

log = logging.getLogger("zcollective")

START_TIMEOUT_S = 10.0  # binding a socket takes milliseconds; longer means something is wrong
STOP_TIMEOUT_S = 5.0  # CLOSE_LINGER_MS plus slack
EXIT_WAIT_S = 30.0  # rank 0's program ended with calls the others have not reached yet: they
# are usually a step behind, so wait this long for them (a rank that is lost or ends stops the wait)
_STOP, _END, _GIVE_UP = b"stop", b"end", b"give up"  # pipe commands: close now; rank 0's
# program is ending; it was interrupted while ending (tell the others the group is over, close)


class Server:
    """Runs the coordinator of one group in a background thread on rank 0."""

    def __init__(self, ctx: zmq.Context, config: Config, local_endpoint: str) -> None:
        self.ctx = ctx
        self.config = config
        self.local_endpoint = local_endpoint
        self.session = int.from_bytes(os.urandom(8), "little") | 1  # never 0: 0 means "not joined"
        self.signer = Signer(config.secret) if config.secret is not None else None
        self.coordinator = Coordinator(config.num_replicas, self.session, DEFAULT_MAX_FRAMES,
                                       self.signer)
        self.crashed: Optional[str] = None
        self._events: deque[list[Any]] = deque()  # monitor events taken in, not yet handled
        self._started = threading.Event()
        # set when the thread has closed its sockets: unlike Thread.join, whose state a
        # KeyboardInterrupt during the join can leave wrong, waiting on it can be interrupted
        self._finished = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._pipe_endpoint = f"inproc://zcollective-ctl-{id(self):x}-{os.urandom(4).hex()}"
        self._pipe = ctx.socket(zmq.PAIR)
        self._pipe.bind(self._pipe_endpoint)
        self._thread = threading.Thread(target=self._run, name="zcollective-coordinator", daemon=True)

    def start(self) -> None:
        """Bind and start serving.

        Raises
        ------
        CollectiveError
            The master address could not be bound (port in use, address not
            on this host).
        """
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise CollectiveError(f"the coordinator thread did not start within {START_TIMEOUT_S} s")
        if self._start_error is not None:
            self._pipe.close(linger=0)
            self._thread.join(STOP_TIMEOUT_S)
            raise self._start_error

    def gone(self) -> Optional[str]:
        """Why the coordinator thread is no longer serving, or None if it is."""
        if not self._finished.is_set() and self._thread.is_alive():
            return None
        return self.crashed or "it stopped"

    def busy(self) -> Optional[str]:
        """What the coordinator thread has been stuck in for a while, if anything."""
        reducing = self.coordinator.reducing  # one attribute read: safe across threads
        if reducing is None:
            return None
        seq, op, since = reducing
        return (f"every rank arrived; the reduce function of seq {seq} {op.label} has been "
                f"running on the coordinator (rank 0) for {time.monotonic() - since:.1f} s")

    def stop(self, ending: bool = False) -> None:
        """Ask the thread to close its sockets and wait for it, with a bound.

        ``ending``: rank 0's program is ending (its member has sent BYE). The
        thread serves on until every call rank 0 made is complete and its
        results are on their way (at most :data:`EXIT_WAIT_S`), then closes,
        giving what is queued :data:`~zcollective._sockets.EXIT_LINGER_MS` to leave.
        """
        if not self._finished.is_set() and self._thread.is_alive():
            try:
                self._pipe.send(_END if ending else _STOP, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if ending:  # however long a reduction runs, up to the exit bound: its results are owed
                bound = EXIT_WAIT_S + _sockets.EXIT_LINGER_MS / 1000 + 1
            else:  # a reduce function that never returns cannot be interrupted: do not wait for it
                bound = STOP_TIMEOUT_S if self.coordinator.reducing is None else 0.1
            try:
                self._finished.wait(bound)
            except BaseException:  # a second Ctrl-C while rank 0 waits for the others: stop now
                try:
                    self._pipe.send(_GIVE_UP, zmq.NOBLOCK)
                    self._finished.wait(STOP_TIMEOUT_S)
                finally:
                    self._pipe.close(linger=0)
                raise
            if not self._finished.is_set():
                log.error("zcollective: the coordinator thread did not stop (%s); leaving it behind",
                          self.busy() or "no reason known")
        self._pipe.close(linger=0)

    # -- the thread ----------------------------------------------------------

    def _bind(self) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
        config = self.config
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.LINGER, _sockets.CLOSE_LINGER_MS)
        router.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
        _sockets.set_never_drop(router)
        _sockets.set_heartbeats(router, config)
        host = _bindable(config.bind_host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
            router.setsockopt(zmq.IPV6, 1)
        try:
            router.bind(f"tcp://{host}:{config.master_port}")
        except zmq.ZMQError as exc:
            router.close(linger=0)
            if exc.errno == zmq.EADDRINUSE:
                raise CollectiveError(
                    f"rank 0 cannot host the coordinator: port {config.master_port} on "
                    f"{config.master_addr} is already in use by another program") from None
            raise CollectiveError(
                f"rank 0 cannot bind the coordinator to {config.endpoint}: {exc.strerror} "
                f"(master_addr must be an address of rank 0's host)") from None
        made: list[zmq.Socket] = [router]
        try:
            router.bind(self.local_endpoint)
            monitor = _sockets.monitor_socket(router, zmq.EVENT_DISCONNECTED)
            made.append(monitor)
            pipe = self.ctx.socket(zmq.PAIR)
            made.append(pipe)
            pipe.connect(self._pipe_endpoint)
        except BaseException:
            for sock in made:
                sock.close(linger=0)
            raise
        if config.secret is None and not _is_loopback(host):
            log.warning(
                "zcollective: the coordinator listens on %s:%d without a secret: anyone who can "
                "reach this port can run code in every replica (pickles are code). Set "
                "ZCOLLECTIVE_SECRET or ZCOLLECTIVE_SECRET_FILE on every replica; see "
                "docs/security.md", config.bind_host, config.master_port)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a replica reconnecting while joining keeps its id
        return router, monitor, pipe

    def _run(self) -> None:
        try:
            router, monitor, pipe = self._bind()
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        self._router, self._monitor = router, monitor
        try:
            self._serve(router, monitor, pipe)
        except BaseException as exc:  # a bug: tell every replica rather than leave them waiting
            log.exception("zcollective: the coordinator crashed")
            self.crashed = f"the coordinator crashed: {type(exc).__name__}: {exc}"
            try:
                self._send_all(self.coordinator.fail("CollectiveError", self.crashed))
            except Exception:
                pass
        finally:
            # results, or a FAIL just sent to the survivors, must reach them
            linger = _sockets.EXIT_LINGER_MS if self._ending is not None else _sockets.CLOSE_LINGER_MS
            router.disable_monitor()
            monitor.close(linger=0)
            pipe.close(linger=0)
            router.close(linger=linger)
            self._finished.set()

    _ending: Optional[float] = None  # when rank 0's program said it was ending

    def _serve(self, router: zmq.Socket, monitor: zmq.Socket, pipe: zmq.Socket) -> None:
        items = [(router, zmq.POLLIN), (monitor, zmq.POLLIN), (pipe, zmq.POLLIN)]
        coordinator = self.coordinator
        while coordinator.phase is not Phase.CLOSED:
            timeout = -1
            if self._ending is not None:
                if coordinator.phase is Phase.FAILED:
                    return  # whatever the others must hear is queued
                waited = time.monotonic() - self._ending
                if waited >= EXIT_WAIT_S:
                    self._send_all(coordinator.give_up_ending(waited))
                    return
                timeout = int((EXIT_WAIT_S - waited) * 1000) + 1
            ready = {sock for sock, _ in zmq_poll(items, timeout)}
            if pipe in ready:
                command = pipe.recv()
                if command == _GIVE_UP and self._ending is not None:
                    self._send_all(coordinator.give_up_ending(time.monotonic() - self._ending))
                if command != _END:
                    return
                self._ending = time.monotonic()
            if monitor in ready:
                self._drain_monitor()
            if router in ready:
                self._drain(router)

    def _drain_monitor(self) -> None:
        for kind, fd in _sockets.monitor_events(self._monitor, self._events):
            if kind == zmq.EVENT_DISCONNECTED:
                # what a peer sent before closing (a BYE, a last contribution) is queued
                # before libzmq reports the close: take it in first
                self._drain(self._router, joins_first=False)
                self._send_all(self.coordinator.disconnected(fd))

    def _drain(self, router: zmq.Socket, joins_first: bool = True) -> None:
        coordinator = self.coordinator
        while coordinator.phase is not Phase.CLOSED and _sockets.readable(router):
            frames = _sockets.recv_message(router)
            peer = frames[0].bytes
            if len(frames) < 2:
                continue
            member = coordinator.members.get(peer)
            if member is None or coordinator.phase is Phase.JOINING:
                fd, address = _origin(frames[1])
                if joins_first:
                    # a JOIN records its connection's fd: first take in every earlier
                    # disconnect, so a closed connection's reused fd is not mistaken for it
                    self._drain_monitor()
            else:  # a running member; the address is only for (rare) warnings
                fd, address = member.fd, member.address
            self._send_all(coordinator.receive(peer, frames[1:], fd, address))

    def _send_all(self, outs: list[Out]) -> None:
        lost: list[tuple[int, str]] = []
        cache: dict[tuple[int, int, str], Any] = {}  # one payload to many ranks: built, hashed once
        for peer, msg in outs:
            frames = encode(msg, self.signer, cache)
            member = self.coordinator.members.get(peer)
            # rank 0 shares this process: give it copies, so mutating its result
            # cannot change buffers still being sent to the other ranks
            local = member is not None and member.rank == 0
            try:
                _sockets.send_frames(self._router, [peer, *frames], copy=local)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                if member is not None:
                    lost.append((member.rank, "its connection is gone"))
        if lost:  # a BYE it sent before closing may still be queued: a rank that ended is not lost
            self._drain(self._router, joins_first=False)
        for rank, reason in lost:
            self._send_all(self.coordinator.lost(rank, reason))


def _origin(frame: Any) -> tuple[Optional[int], str]:
    """The connection fd and peer address a frame came in on (None for inproc)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        fd = None
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:  # inproc (rank 0), or a legacy ZMTP 1.0 peer: libzmq gives no address
        address = "an unknown address"
    return (fd if fd is not None and fd >= 0 else None), address


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


def _is_loopback(host: str) -> bool:
    """Is ``host`` (as returned by :func:`_bindable`) a loopback address?"""
    if host == "*":
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
