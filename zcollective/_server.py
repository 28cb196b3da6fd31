"""The thread on rank 0 that owns the coordinator's ROUTER socket.

A thin driver: it receives frames, feeds them to the pure
:class:`~zcollective._coordinator.Coordinator`, and sends what it returns.
It is controlled through an inproc PAIR pipe, as pyzmq's auth thread is, and
reports its start-up (bind) result with a bounded wait.

Rank 0's own member needs no socket: it hands its messages to the
coordinator with :meth:`Server.from_host`, a function call under the
server's lock, and takes its replies from :attr:`Server.to_host`, woken
through :attr:`Server.wakeup`. Whichever thread holds the lock may use the
ROUTER (libzmq allows a socket to move between threads across a full memory
barrier, which the lock is); the thread polls the ROUTER's file descriptor,
not the socket, so it never touches the socket without the lock. The thread
stays for progress while rank 0's own code is busy elsewhere.

With a secret the thread also owns the context's ZAP handler
(:class:`~zcollective._zap.Gatekeeper`, made before the ROUTER binds) and
answers each handshake as soon as it is asked, without the lock: a peer
that cannot prove the secret is refused before libzmq takes in a message
from it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Optional

import zmq
from zmq.backend import zmq_poll

from . import _interrupts, _sockets, _zap
from ._coordinator import Coordinator, Member, Out, Phase
from ._link import HOST_PEER, Wakeup, owned
from ._wire import DEFAULT_MAX_FRAMES, Message, Signer, encode
from .config import Config
from .errors import InternalError

log = logging.getLogger("zcollective")

HOST_LOCK_WAIT_S = 0.002  # rank 0's member waits this long for the lock before it hands
# its message to the thread instead (a wake-up of the thread costs more than a short wait)
START_TIMEOUT_S = 10.0  # binding a socket takes milliseconds; longer means something is wrong
STOP_TIMEOUT_S = 5.0  # CLOSE_LINGER_MS plus slack
ACK_POLL_S = 0.01  # rank 0's program ending: how often it looks whether the replicas have it all
EXIT_WAIT_S = 30.0  # rank 0's program ended with calls the others have not reached yet: they
# are usually a step behind, so wait this long for them (a rank that is lost or ends stops the wait)
_STOP, _END, _GIVE_UP, _TAKE = b"stop", b"end", b"give up", b"take"  # pipe commands: close
# now; rank 0's program is ending; it was interrupted while ending (tell the others the group is
# over, close); take what rank 0's member handed over while the lock was held


_REFUSED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class Server:
    """Runs the coordinator of one group in a background thread on rank 0."""

    def __init__(self, ctx: zmq.Context, config: Config) -> None:
        self.ctx = ctx
        self.config = config
        self.session = int.from_bytes(os.urandom(8), "little") | 1  # never 0: 0 means "not joined"
        self.signer = Signer(config.secret) if config.secret is not None else None
        self.coordinator = Coordinator(config.num_replicas, self.session, DEFAULT_MAX_FRAMES,
                                       self.signer, config.max_frame_bytes)
        self.crashed: Optional[str] = None  # set once, by the thread, before _finished
        self._lock = threading.Lock()  # held to use the coordinator or the ROUTER
        self._router: Optional[zmq.Socket] = None  # while serving
        self._from_host: deque[Message] = deque()  # rank 0's member's messages, not yet taken
        self.to_host: deque[Message] = deque()  # replies to rank 0's member, not yet taken
        self._sent = 0  # messages sent on the ROUTER, by either thread
        self._host_owed = False  # to_host grew while the lock was held
        self._take_pending = False  # a _TAKE is on its way to the thread
        self._lost: deque[tuple[int, str]] = deque()  # ranks rank 0's own thread found gone
        self._events: deque[list[Any]] = deque()  # monitor events taken in, not yet handled
        self._closed: dict[bytes, Member] = {}  # peer -> its member whose connection closed
        self._closes: deque[tuple[int, list[Member]]] = deque()  # (fd, its members then): to handle
        self._trackers: dict[bytes, list[Any]] = {}  # while ending, by peer: one per message sent,
        # done once libzmq wrote it
        self.gatekeeper: Optional[_zap.Gatekeeper] = None  # with a secret: the ZAP handler, which
        # the coordinator thread answers (a data socket of rank 0's context uses it too)
        self._started = threading.Event()
        # set when the thread has closed its sockets: unlike Thread.join, whose state a
        # KeyboardInterrupt during the join can leave wrong, waiting on it can be interrupted
        self._finished = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._pipe_endpoint = f"inproc://zcollective-ctl-{id(self):x}-{os.urandom(4).hex()}"
        with _sockets.mapped("rank 0 cannot start its coordinator thread"):
            self._pipe = ctx.socket(zmq.PAIR)
            self._pipe.setsockopt(zmq.SNDHWM, 0)  # a command is never dropped
            self._pipe.bind(self._pipe_endpoint)
        self.wakeup = Wakeup()  # set when to_host grows (made last: nothing after it can fail)
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
            raise InternalError(f"the coordinator thread did not start within {START_TIMEOUT_S} s")
        if self._start_error is not None:
            self._pipe.close(linger=0)
            self._thread.join(STOP_TIMEOUT_S)
            self.wakeup.close()
            raise self._start_error

    def gone(self) -> Optional[str]:
        """Why the coordinator thread is no longer serving, or None if it is."""
        # not Thread.is_alive(): an interrupt inside it can leave a live thread marked stopped
        if not self._finished.is_set():
            return None
        return self.crashed or "it stopped"

    def from_host(self, msg: Message) -> None:
        """Rank 0's member sends ``msg`` (from its own thread): taken here,
        under the lock, when the lock comes free within
        :data:`HOST_LOCK_WAIT_S` and nothing handed over earlier is still
        waiting for the thread; else the thread takes it."""
        self._from_host.append(msg)
        # the thread holds the lock for microseconds after a step (or, in a reduce
        # function, for long): wait that long before handing the message to it
        if self._take_pending or not self._lock.acquire(timeout=HOST_LOCK_WAIT_S):
            self._hand_to_thread()
            return
        try:
            self._take_here()
        finally:
            self._lock.release()

    def _take_here(self) -> None:
        """With the lock, in rank 0's own thread: take what its member handed
        over, up to a contribution that would run a reduce function (user
        code runs in the coordinator thread only, so rank 0's calls can time
        out and be interrupted while it runs); the thread takes the rest."""
        coordinator, sent = self.coordinator, self._sent
        try:
            for msg in _sockets.taken(self._from_host):
                if self._router is None or coordinator.phase is Phase.CLOSED:
                    self._from_host.clear()
                    return
                if coordinator.completes_reduction(msg):
                    self._hand_to_thread()
                    return
                self._send_all(coordinator.receive_message(HOST_PEER, msg))
        except Exception as exc:  # a bug: fail the group for everyone, as the thread would
            self._from_host.clear()
            self._crash(exc)
            raise InternalError(self.crashed or "the coordinator crashed") from exc
        self._host_owed = False  # rank 0's member looks at to_host before it waits
        if self._sent != sent and self._router is not None and _sockets.readable(self._router):
            # sending swallowed the fd's edge of what had arrived meanwhile: the thread takes it
            self._hand_to_thread()

    def _hand_to_thread(self) -> None:
        """Have the thread take what rank 0's member handed over (one wake-up
        at a time: the flag is cleared by the thread when it reads it)."""
        if not self._take_pending:
            self._take_pending = True
            self._command(_TAKE)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The thread's hold of the lock; rank 0's member is woken for what
        was queued for it only once the lock is free for its next call."""
        with self._lock:
            yield
            owed, self._host_owed = self._host_owed, False
        if owed:
            self.wakeup.set()

    def _step(self) -> None:
        """The thread, with the lock: take what rank 0's member handed over,
        then whatever waits on the monitor and the ROUTER (read to the end:
        either thread's use of a socket may have swallowed its fd's edge)."""
        coordinator = self.coordinator
        for msg in _sockets.taken(self._from_host):
            if coordinator.phase is Phase.CLOSED:
                self._from_host.clear()
                break
            self._send_all(coordinator.receive_message(HOST_PEER, msg))
        if self._lost:  # found by rank 0's own thread while it sent
            lost, self._lost = list(self._lost), deque()
            self._take_lost(lost)
        self._drain_monitor()
        self._drain()
        if self._closes:  # read by a drain that was not handling closes (_take_lost's)
            self._drain_monitor()

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
        if not self._finished.is_set():
            self._command(_END if ending else _STOP)
            if ending:  # however long a reduction runs, up to the exit bound: its results are owed
                bound = EXIT_WAIT_S + _sockets.EXIT_LINGER_MS / 1000 + 1
            else:  # a reduce function that never returns cannot be interrupted: do not wait for it
                bound = STOP_TIMEOUT_S if self.coordinator.reducing is None else 0.1
            try:
                _interrupts.wait_event(self._finished, bound)
            except BaseException:  # a second Ctrl-C while rank 0 waits for the others: stop now
                try:
                    self._command(_GIVE_UP)
                    _interrupts.wait_event(self._finished, STOP_TIMEOUT_S)
                finally:
                    self._pipe.close(linger=0)
                raise
            if not self._finished.is_set():
                log.error("zcollective: the coordinator thread did not stop (%s); leaving it behind",
                          self.busy() or "no reason known")
        self._pipe.close(linger=0)
        if self._finished.is_set():
            self.wakeup.close()  # else the thread may still deliver to it

    def _command(self, command: bytes) -> None:
        """Tell the thread ``command`` (the main thread's end of the pipe)."""
        _sockets.notify(self._pipe, command)

    # -- the thread ----------------------------------------------------------

    def _bind(self) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
        config = self.config
        if config.secret is not None:  # before the ROUTER can take a handshake
            with _sockets.mapped("rank 0 cannot start the coordinator's ZAP handler"):
                self.gatekeeper = _zap.Gatekeeper(self.ctx, config.secret)
        try:
            return self._bind_router()
        except BaseException:
            self._close_gatekeeper()
            raise

    def _close_gatekeeper(self) -> None:
        if self.gatekeeper is not None:
            self.gatekeeper.close()
            self.gatekeeper = None

    def _bind_router(self) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
        config = self.config
        with _sockets.mapped("rank 0 cannot make the coordinator's socket"):
            router = self.ctx.socket(zmq.ROUTER)
        try:
            with _sockets.mapped("rank 0 cannot set the coordinator's socket options"):
                if self.gatekeeper is not None:
                    _zap.secure_server(router, self.gatekeeper, _zap.MASTER_DOMAIN)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                router.setsockopt(zmq.LINGER, _sockets.CLOSE_LINGER_MS)
                router.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
                _sockets.set_never_drop(router)
                _sockets.set_heartbeats(router, config)
        except BaseException:
            router.close(linger=0)
            raise
        host = _bindable(config.bind_host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
            router.setsockopt(zmq.IPV6, 1)
        try:
            _sockets.bind(router, f"tcp://{host}:{config.master_port}",
                          in_use=f"rank 0 cannot host the coordinator: port {config.master_port} on "
                                 f"{config.master_addr} is already in use by another program",
                          cannot=f"rank 0 cannot bind the coordinator to {config.endpoint}: {{reason}} "
                                 f"(master_addr must be an address of rank 0's host)")
        except BaseException:
            router.close(linger=0)
            raise
        made: list[zmq.Socket] = [router]
        try:
            with _sockets.mapped("rank 0 cannot start its coordinator thread"):
                events = zmq.EVENT_DISCONNECTED
                if self.gatekeeper is not None:  # to log peers refused before any ZAP request
                    # (a mismatch of mechanisms is seen by whichever end reads the other's greeting
                    # first: when the peer closes first, this end sees no detail)
                    events |= zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                monitor = _sockets.monitor_socket(router, events)
                made.append(monitor)
                pipe = self.ctx.socket(zmq.PAIR)
                made.append(pipe)
                pipe.setsockopt(zmq.RCVHWM, 0)
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
            self._finished.set()
            self._started.set()
            return
        self._monitor = monitor
        fds = [router.FD, monitor.FD]  # read before rank 0's member may use the ROUTER
        if self.gatekeeper is not None:
            fds.append(self.gatekeeper.fd)
        with self._locked():
            self._router = router
        self._started.set()
        try:
            self._serve(fds, pipe)
        except BaseException as exc:  # a bug: tell every replica rather than leave them waiting
            with self._locked():
                self._crash(exc)
        finally:
            # results, or a FAIL just sent to the survivors, must reach them
            linger = _sockets.EXIT_LINGER_MS if self._ending is not None else _sockets.CLOSE_LINGER_MS
            if self._ending is not None and not self._given_up:
                self._acknowledged(linger / 1000)
            with self._locked():  # rank 0's member may be using it
                self._router = None
            pipe.close(linger=0)
            _sockets.close_monitored(router, monitor, linger)
            self._close_gatekeeper()  # after the ROUTER: no handshake is left to answer
            self._finished.set()

    _ending: Optional[float] = None  # when rank 0's program said it was ending

    _given_up = False  # a second interrupt while ending: close at once

    def _acknowledged(self, timeout: float) -> None:
        """Rank 0's program is ending: wait (at most ``timeout`` s) until
        libzmq has written every message sent since (its trackers; the last
        message to each replica still running is one of them) and every such
        replica has acknowledged each byte (see
        :func:`~zcollective._sockets.unacknowledged`). Members whose
        connection closed, before or during the wait, are left out with the
        messages sent to them (libzmq may never let those go): their fd may be
        another socket's by now. The thread's own: rank 0's thread waits in
        :meth:`stop`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._locked():
                self._drain_monitor()
            running = [m for m in self.coordinator.members.values()
                       if m.fd is not None and m.ended is None and self._closed.get(m.peer) is not m]
            if not running:
                return
            pending = False
            for member in running:
                trackers = self._trackers.get(member.peer, [])
                trackers[:] = [t for t in trackers if not t.done]
                pending = pending or bool(trackers)
            if not pending and not any(_sockets.unacknowledged(m.fd) for m in running if m.fd is not None):
                return
            time.sleep(ACK_POLL_S)

    def _crash(self, exc: BaseException) -> None:
        """With the lock: a bug in the coordinator; tell every replica rather
        than leave them waiting."""
        log.exception("zcollective: the coordinator crashed", exc_info=exc)
        self.crashed = f"the coordinator crashed: {type(exc).__name__}: {exc}"
        try:
            self._send_all(self.coordinator.fail("InternalError", self.crashed))
        except Exception:
            pass

    def _serve(self, fds: list[int], pipe: zmq.Socket) -> None:
        # the fds of the ROUTER and its monitor, not the sockets: polling a socket would use it
        # without the lock. They are edge-triggered: each step reads both until they are empty
        items: list[Any] = [(fds[0], zmq.POLLIN), (fds[1], zmq.POLLIN), (pipe, zmq.POLLIN)]
        gatekeeper = self.gatekeeper  # its socket is this thread's alone: served without the lock
        if gatekeeper is not None:
            items.append((gatekeeper.fd, zmq.POLLIN))
        coordinator = self.coordinator
        while coordinator.phase is not Phase.CLOSED:
            timeout = -1
            if self._ending is not None:
                if coordinator.phase is Phase.FAILED:
                    return  # whatever the others must hear is queued
                waited = time.monotonic() - self._ending
                if waited >= EXIT_WAIT_S:
                    with self._locked():
                        self._send_all(coordinator.give_up_ending(waited))
                    return
                timeout = int((EXIT_WAIT_S - waited) * 1000) + 1
            ready = {sock for sock, _ in zmq_poll(items, timeout)}
            if gatekeeper is not None and gatekeeper.fd in ready:
                gatekeeper.serve()  # a handshake waits for it: first
            if pipe in ready:
                try:
                    command = pipe.recv(zmq.NOBLOCK)
                except zmq.Again:
                    command = b""  # (never: the poll said a command waits)
                if command == _TAKE:
                    self._take_pending = False  # before the step: a later hand-over sends another
                elif command in (_STOP, _GIVE_UP, _END):
                    if command == _GIVE_UP and self._ending is not None:
                        self._given_up = True
                        with self._locked():
                            self._send_all(coordinator.give_up_ending(time.monotonic() - self._ending))
                    if command != _END:
                        return
                    self._ending = time.monotonic()
            with self._locked():
                self._step()

    def _drain_monitor(self) -> None:
        """Handle the monitor's events: a member's connection closed."""
        self._read_events()
        while self._closes:
            # what a peer sent before closing (a BYE, a last contribution) is queued
            # before libzmq reports the close: take it in first (the close stays queued
            # meanwhile: a JOIN that came before it on its connection is bound to it)
            self._drain(joins_first=False)
            fd, members = self._closes.popleft()
            self._send_all(self.coordinator.disconnected(fd, members=members))

    def _read_events(self) -> None:
        """Take in every event waiting, each close bound to the members on its
        fd now (the objects: a member that joins again is a new one): a JOIN
        taken in before the close is handled may come on the same fd number,
        reused by a new connection (a stranger's connection closed, then a
        replica's got its number), and must not be taken for the connection
        that closed. (A JOIN sent just before its own connection closed is
        bound to that close when it is taken in: see :meth:`_drain`.)"""
        for kind, value in _sockets.monitor_events(self._monitor, self._events):
            if kind == zmq.EVENT_DISCONNECTED:
                members = [m for m in self.coordinator.members.values() if m.fd == value]
                self._closed.update((m.peer, m) for m in members)
                self._closes.append((value, members))
            elif kind in _REFUSED_EVENTS and self.gatekeeper is not None:
                # a peer without credentials: libzmq refused it before asking the gatekeeper
                # (the event names no peer: the connection's fd may be closed and reused by now)
                self.gatekeeper.log_refusal(None, _zap.MASTER_DOMAIN,
                                            _sockets.handshake_problem(value) if kind ==
                                            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL else
                                            "it closed the connection during the handshake")

    def _drain(self, joins_first: bool = True) -> None:
        """Handle every message waiting on the ROUTER (with the lock)."""
        router, coordinator = self._router, self.coordinator
        while router is not None and coordinator.phase is not Phase.CLOSED and _sockets.readable(router):
            if self._host_owed:  # rank 0's reply is ready: do not keep it waiting for the rest
                self._host_owed = False
                self.wakeup.set()
            frames = _sockets.recv_message(router)
            peer = frames[0].bytes
            if len(frames) < 2 or peer == HOST_PEER:  # that name is rank 0's own member's alone
                continue
            member = coordinator.members.get(peer)
            if member is None or coordinator.phase is Phase.JOINING:
                fd, address = _sockets.origin(frames[1])
                # a JOIN records its connection's fd: first take in every earlier close,
                # so a closed connection's reused fd is not mistaken for it
                if joins_first:
                    self._drain_monitor()
                else:  # (inside _drain_monitor: bound now, handled there next)
                    self._read_events()
            else:  # a running member; the address is only for (rare) warnings
                fd, address = member.fd, member.address
            self._send_all(coordinator.receive(peer, frames[1:], fd, address))
            if fd is not None and self._closes and not _sockets.connection_open(fd):
                self._closed_before(fd)

    def _closed_before(self, fd: int) -> None:
        """A message just taken in came on ``fd``, which a close still to be
        handled names, and no open connection has that number now: the
        message came before that close, on the connection that closed (a
        JOIN, then the program died). A member it made is that close's too.
        (Were the number taken again by a third connection meanwhile, the
        member stays until sending to it fails.)"""
        on_fd = [m for m in self.coordinator.members.values() if m.fd == fd]
        for i, (closed_fd, members) in enumerate(self._closes):
            if closed_fd == fd:
                self._closes[i] = (fd, [*members, *(m for m in on_fd if all(m is not x for x in members))])
                self._closed.update((m.peer, m) for m in on_fd)
                return

    def _send_all(self, outs: list[Out]) -> None:
        """Send what the coordinator returned (with the lock): rank 0's part
        to its queue, the others' on the ROUTER."""
        lost: list[tuple[int, str]] = []
        cache: dict[tuple[int, int, str], Any] = {}  # one payload to many ranks: built, hashed once
        router = self._router
        for peer, msg in outs:
            if peer == HOST_PEER:
                self.to_host.append(owned(msg))
                self._host_owed = True  # woken when the lock is let go (see _locked)
                continue
            if router is None:
                continue  # closed: nothing more reaches anyone
            self._sent += 1
            frames = [peer, *encode(msg, self.signer, cache, self.coordinator.part_bytes)]
            trackers = self._trackers.setdefault(peer, []) if self._ending is not None else None
            if not _sockets.send_to(router, frames, trackers):
                member = self.coordinator.members.get(peer)
                if member is not None:
                    lost.append((member.rank, "its connection is gone"))
        if not lost:
            return
        if threading.get_ident() != self._thread.ident:  # rank 0's own thread (_take_here): what
            # waits on the ROUTER may complete a reduction, which only the thread may run
            self._lost.extend(lost)
            self._hand_to_thread()
            return
        self._take_lost(lost)

    def _take_lost(self, lost: list[tuple[int, str]]) -> None:
        """The thread, with the lock: ranks found gone while sending. A BYE
        one sent before closing may still be queued: a rank that ended is not
        lost."""
        self._drain(joins_first=False)
        for rank, reason in lost:
            self._send_all(self.coordinator.lost(rank, reason))


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
