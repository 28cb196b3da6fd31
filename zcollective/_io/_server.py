"""Rank 0's coordinator: its ROUTER socket, served by whichever thread holds
the group's turn. A thin driver: it receives frames, feeds them to the pure
:class:`~zcollective._protocol._coordinator.Coordinator`, and sends what it
returns; rank 0's program thread does so itself inside the library (no
thread hop on the hot path), its background thread only while the program
has been elsewhere for :data:`~zcollective._limits.AWAY_S`. What it does and when: see
docs/protocol.md, *Drivers* and *Concurrency*.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from collections import deque
from functools import partial
from typing import Any, Callable, Optional

import zmq

from .._announce import announce_stall
from .._format._wire import DEFAULT_MAX_FRAMES, Message, Signer, encode, owned
from .._limits import (
    CLOSE_LINGER_MS,
    EXIT_LINGER_MS,
    FORM_BIND_RETRY_S,
    POLL_SLICE_S,
    STOP_TIMEOUT_S,
)
from .._protocol._coordinator import RANK0_PEER, Coordinator, Forming, Phase, ProbeSchedule, is_loopback
from .._protocol._ops import Step, applied
from ..config import Config
from ..errors import InternalError
from . import _interrupts, _sockets, _zap
from ._interrupts import DEADLINE, NUDGE, Waiter
from ._mailbox import mail_woke
from ._turns import STOP, StandIn, Turns

log = logging.getLogger("zcollective")

HOLD_TRY_S = 0.02  # rank 0's thread sending waits this long for the turn
# (the background thread gives them back within microseconds unless it runs a reduce function)
DRAIN_BATCH = 256  # messages one step takes in before rank 0's member, if it has news, gets it
# (a peer sending faster than the coordinator reads must not starve rank 0's own calls)
_REFUSED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
ROUTER, MONITOR, ZAP, WAKEUP = "router", "monitor", "zap", "wakeup"  # its waiter's names


class Server:
    """Serves the coordinator of one group on rank 0 (see the module's rule)."""

    SERVED = (ROUTER, MONITOR, ZAP)  # what the turn's holder serves (the ZAP handler: with a secret)
    NUDGED = (*SERVED, NUDGE)  # ... and what a thread wanting the turn writes

    def __init__(self, ctx: zmq.Context, config: Config, forming: Optional[Forming] = None,
                 turns: Optional[Turns] = None, world: Optional[list[int]] = None) -> None:
        self.ctx = ctx
        self.config = config
        self.session = int.from_bytes(os.urandom(8), "little") | 1  # never 0: 0 means "not joined"
        self.signer = Signer(config.secret) if config.secret is not None else None
        self.coordinator = Coordinator(config.num_replicas, self.session, DEFAULT_MAX_FRAMES,
                                       self.signer, config.max_frame_bytes, _interrupts.user_code,
                                       forming, config.master_addr, config.liveness_timeout,
                                       config.job, config.warn_after, tree=config.tree, world=world)
        self.host = "rank 0" if forming is None else f"old rank {config.rank}"  # in errors: its program
        self.port = config.master_port  # bound (0: the system chose, a sub-group's)
        self.mail_woke = 0  # a wait of the turn's holder ended for its member's mailbox (_mailbox.mail_woke)
        self.crashed: Optional[str] = None  # why the coordinator stopped serving early (a bug)
        self.turns = turns if turns is not None else Turns()  # its holder owns the sockets
        self._away = False  # the background thread serves
        self._router: Optional[zmq.Socket] = None
        self._monitor: Optional[zmq.Socket] = None
        self.to_host: deque[Message] = deque()  # results for rank 0's member, not yet taken
        self._from_host: deque[Message] = deque()  # its messages, not yet taken (see from_host)
        self._probes = ProbeSchedule()
        self._stall_due: Optional[float] = None  # the next stall warning due, as _wait_ms found it
        self._refusals: list[str] = []  # peers refused at the handshake without a secret here
        self.gatekeeper: Optional[_zap.Gatekeeper] = None  # with a secret: the ZAP handler (a data
        # socket of rank 0's context uses it too)
        self._handover = True  # ROUTER_HANDOVER is on (while joining only)
        self._stopped = False
        self._standin = StandIn("zcollective-coordinator", self.turns, self._serve_away,
                                lambda: bool(self.coordinator.pending), self._crash_once, standby=True)
        self._thread = self._standin.thread
        self.wakeup = _sockets.Wakeup()
        self.waiter = Waiter((WAKEUP, self.wakeup.fd), (NUDGE, self.turns.nudge.fd),
                             (STOP, self._standin.stop_pipe.fd))

    def start(self) -> None:
        """Bind, then start the background thread.

        Raises
        ------
        CollectiveError
            The master address could not be bound (port in use, address not
            on this host).
        """
        try:
            router, monitor = self._bind()
        except BaseException:
            self._close_pipes()
            raise
        self._watch(router, monitor)
        self._standin.start()

    def _watch(self, router: zmq.Socket, monitor: zmq.Socket) -> None:
        """Watch the ROUTER, the ZAP handler, and the monitor by its file
        descriptor (its ZMQ_EVENTS cost a system call a poll): readable
        whenever an event came since it was last found empty, which only
        :meth:`_drain_monitor` asks, reading to the end; so once here."""
        self._router, self._monitor = router, monitor
        self.waiter.watch(ROUTER, router)
        self.waiter.watch(MONITOR, monitor.FD)
        if self.gatekeeper is not None:
            self.waiter.watch(ZAP, self.gatekeeper.source)
        self._drain_monitor()

    def _close_pipes(self) -> None:
        self.wakeup.close()
        self._standin.stop_pipe.close()

    def gone(self) -> Optional[str]:
        """Why the coordinator is no longer served, or None if it is."""
        return self.crashed or ("it stopped" if self._stopped else None)

    # -- rank 0's member --------------------------------------------------------

    def _briefly(self, step: Callable[[], None]) -> None:
        """Take the turn (nested takes count), waiting at most :data:`HOLD_TRY_S`,
        for ``step``; else leave it to whichever owner comes next."""
        if self.turns.try_take() or self.turns.take(time.monotonic() + HOLD_TRY_S):
            try:
                step()
            finally:
                self.turns.give()

    def from_host(self, msg: Message) -> None:
        """Rank 0's member sends ``msg``: taken by the coordinator now, in this
        thread (a reduce function may run here), or, when the background
        thread does not let go within :data:`HOLD_TRY_S` (it runs a reduce
        function), by whichever owner comes next: sending never blocks."""
        self._from_host.append(msg)
        self._briefly(self._take_from_host)

    def form_now(self) -> None:
        """Rank 0's thread: the forming bound passed; start with those who came."""
        self._briefly(partial(self._take, self.coordinator.form_now))

    def has_from_host(self) -> bool:
        """Has rank 0's member sent something the coordinator has not yet taken?"""
        return bool(self._from_host)

    def _take_from_host(self) -> None:
        """The owner: what rank 0's member sent, in order."""
        queue, receive = self._from_host, self.coordinator.receive_message
        while queue:
            self._take(partial(receive, RANK0_PEER, queue.popleft()))

    def serve(self, deadline: Optional[float], deliver: Callable[[Message], None],
              nudged: bool = False, also: tuple[str, ...] = ()) -> bool:
        """Rank 0's thread, holding the turn: serve until something came for its member
        (handed to ``deliver``; True), the nudge is readable if ``nudged``, or a source of
        ``also`` (its member's mailbox; True), or ``deadline`` (False)."""
        self._take_from_host()
        got = self._serve_until(self._news, deadline, (*(self.NUDGED if nudged else self.SERVED), *also),
                                POLL_SLICE_S)
        if self.to_host:
            self.wakeup.clear()
            while self.to_host:
                deliver(self.to_host.popleft())
        return got

    def _news(self) -> bool:
        return bool(self.to_host) or self.gone() is not None

    def _serve_until(self, done: Callable[[], bool], deadline: Optional[float], names: tuple[str, ...],
                     slice_s: Optional[float] = None) -> bool:
        """The turn's holder: serve what the waiter finds, in slices of at most
        ``slice_s`` (never past a probe round or a stall warning due), until
        ``done()`` or a source not served (the nudge, the stop) is readable
        (True, at once: what else came is the next holder's), or ``deadline``
        (False)."""
        while not done():
            woke = self.waiter.wait(names, deadline, self.sleep_s(slice_s))
            if NUDGE in woke or STOP in woke:
                return True
            mail = mail_woke(woke)
            if mail:  # its member's mailbox (the holder takes it in), once what else woke is
                self.mail_woke = mail  # served: a busy mailbox must not starve the coordinator
                if woke[0] in self.SERVED:
                    self._step(woke)
                return True
            if (woke and woke[0] is not DEADLINE) or self._probes.due is not None:
                self._step(woke)
            self._watch_stalls()
            if DEADLINE in woke:
                return done()
        return True

    def refusals(self) -> list[str]:
        """The first peers refused at the handshake, and why."""
        return self.gatekeeper.first_refusals if self.gatekeeper is not None else self._refusals

    def fds(self) -> list[int]:
        """File descriptors that become readable when the coordinator may have
        work: watched by an awaiting coroutine (read once, at start: only the
        owner uses the sockets)."""
        return self.waiter.fds((WAKEUP, *self.SERVED))

    def _take(self, step: Callable[[], Step]) -> None:
        """Run one step of the coordinator and send what it returns; a bug
        fails the group for everyone."""
        if self._router is None or self.coordinator.phase is Phase.CLOSED or self.crashed:
            return
        try:
            self._send_all(step())  # (a reduction asked for runs there)
        except Exception as exc:
            raise self._failed(exc) from exc

    def _step(self, woke: list[str]) -> None:
        """The owner: answer handshakes, then whatever waits on the monitor and
        the ROUTER. ``woke`` is what the owner's wait just found readable: a
        source it did not name is not asked again (the next wait finds what
        came since), one it named is read without asking again; none (a
        probe round is due, or nothing is known): each is asked."""
        known = bool(woke) and woke[0] is not DEADLINE
        if self.gatekeeper is not None and known:
            self.gatekeeper.serve()  # a handshake waits for it: first
        try:
            if not known or MONITOR in woke:
                self._drain_monitor()
            if not known or ROUTER in woke:
                self._drain(waiting=known)
            if self._probes.due is not None and time.monotonic() >= self._probes.due:
                self._probe()
        except Exception as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: Exception) -> InternalError:
        """A bug in the coordinator (``exc``): every replica is told, once; the
        error for rank 0's caller."""
        if self.crashed is None:
            self._crash(exc)
        return InternalError(self.crashed or "the coordinator crashed")

    def reducing_here(self) -> bool:
        """Is the calling thread inside a reduce function it runs (rank 0's
        thread, or the background thread)?"""
        return self.coordinator.reducing is not None and self.turns.held()

    def busy(self) -> Optional[str]:
        """What the coordinator has been stuck in for a while, if anything."""
        reducing = self.coordinator.reducing  # one attribute read: safe across threads
        if reducing is None:
            return None
        seq, op, since = reducing
        return (f"every rank arrived; the reduce function of seq {seq} {op.label} has been "
                f"running on the coordinator (rank 0) for {time.monotonic() - since:.1f} s")

    # -- the background thread ---------------------------------------------------

    def _crash_once(self, exc: BaseException) -> None:
        if self.crashed is None:
            self._crash(exc)

    def _serve_away(self) -> bool:
        """The stand-in, holding the turn while rank 0's program is elsewhere: serve
        until a program thread nudges for it (False) or the thread must end (True)."""
        standin = self._standin
        self._away = True
        try:
            self._take_from_host()
            self._serve_until(lambda: standin.stopping, None, (*self.NUDGED, STOP))
            return standin.stopping
        finally:
            self._away = False

    # -- stopping -------------------------------------------------------------

    def stop(self, ending: bool = False, hurry: bool = False, linger_ms: int = CLOSE_LINGER_MS) -> None:
        """Close the coordinator's sockets, in rank 0's thread, once the
        background thread has ended (with a bound: one stuck in a reduce
        function is left behind, with the sockets).

        ``ending``: rank 0's program is ending (its member has sent BYE): it
        serves on until every call it made is complete and its results are on
        their way (at most :data:`~zcollective._limits.EXIT_WAIT_S`), then what is queued gets
        :data:`~zcollective._limits.EXIT_LINGER_MS` to leave. An interrupt
        meanwhile tells the others the group is over, and closes at once;
        so does ``hurry`` (the program was interrupted while ending).
        """
        if self._stopped:
            return
        self._standin.stop()
        bound = STOP_TIMEOUT_S if self.coordinator.reducing is None else 0.1
        started = self._thread.ident is not None
        try:
            ended = not started or _interrupts.join(self._thread, bound)
        except BaseException:  # interrupted while the thread ends (it was told): once it has,
            # the sockets are this thread's: close them now (else the port stays bound for good)
            if not started or _interrupts.finish(self._thread, bound):
                self._stopped = True
                try:
                    if ending and self.crashed is None:
                        self._give_up_ending()
                finally:
                    self._close(0 if ending else CLOSE_LINGER_MS)
            raise
        if not ended:
            log.error("zcollective: the coordinator thread did not stop (%s); leaving it behind, "
                      "with the sockets", self.busy() or "no reason known")
            return  # (gone() stays None: the group leaves the context to it)
        self._stopped = True
        linger = linger_ms
        if linger_ms and self.crashed is None:  # (not forming the next group: it ends)
            self._send_all(self.coordinator.dismiss_newcomers())
        try:
            if ending and self.crashed is None:
                if hurry:  # interrupted while ending: its BYE may not have gone
                    self._give_up_ending()
                else:
                    linger = EXIT_LINGER_MS
                    self._serve_ending()
                    self._last_byes(linger / 1000)
        except BaseException:
            linger = 0  # interrupted again while ending: close now
            self._give_up_ending()
            raise
        finally:
            self._close(linger)

    def _serve_ending(self) -> None:
        """Rank 0's program is ending: serve until the group is over, or until
        the coordinator's ending is due (rule 7; then the others are told)."""
        coordinator = self.coordinator
        coordinator.start_ending()
        self._take_from_host()  # (its BYE may wait there, sent while the thread was reducing)
        due = coordinator.ending_due()
        if due is not None and not self._serve_until(lambda: coordinator.ending_due() is None, due,
                                                     self.SERVED):
            self._give_up_ending()

    def _give_up_ending(self) -> None:
        """Rank 0's program is ending and waits no more: the others are told (rule 7)."""
        self.coordinator.start_ending()
        if self._router is not None:
            try:
                self._send_all(self.coordinator.give_up_ending())
            except Exception:
                pass  # nothing more can be said: the sockets close now

    def _close(self, linger_ms: int) -> None:
        router, monitor, self._router = self._router, self._monitor, None
        if router is not None and monitor is not None:
            _sockets.close_monitored(router, monitor, linger_ms)
        self._close_gatekeeper()  # after the ROUTER: no handshake is left to answer
        self._close_pipes()

    # -- binding ---------------------------------------------------------------

    def _bind(self) -> tuple[zmq.Socket, zmq.Socket]:
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
                          retry_s=FORM_BIND_RETRY_S if self.coordinator.forming is not None else 0.0)
            self.port = int(router.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2])
            with _sockets.mapped("rank 0 cannot watch the coordinator's connections"):
                # DISCONNECTED, and peers refused before any ZAP request, to name at a join timeout
                # (a mismatch of mechanisms is seen by whichever end reads the other's greeting
                # first: when the peer closes first, this end sees no detail)
                monitor = _sockets.monitor_socket(router, zmq.EVENT_DISCONNECTED | sum(_REFUSED_EVENTS))
        if config.secret is None and not is_loopback(host):
            log.warning(
                "zcollective: the coordinator listens on %s:%d without a secret: anyone who can "
                "reach this port can run code in every replica (pickles are code). Set "
                "ZCOLLECTIVE_SECRET or ZCOLLECTIVE_SECRET_FILE on every replica; see "
                "docs/security.md", config.bind_host, config.master_port)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a replica reconnecting while joining keeps its id
        return router, monitor

    # -- ending and failing -------------------------------------------------------

    def _last_byes(self, timeout: float) -> None:
        """Rank 0's program is ending and the group is over: send the last
        BYEs and wait (at most ``timeout`` s) for their answers and the
        TAKENs asked for (rule 7 of the coordinator). A replica busy in its
        own code answers when it next enters the library or ends."""
        coordinator = self.coordinator
        self._send_all(coordinator.last_byes())
        self._serve_until(lambda: not coordinator.waiting(), time.monotonic() + timeout, self.SERVED)

    def _crash(self, exc: BaseException) -> None:
        """A bug in the coordinator: tell every replica rather than leave them
        waiting."""
        log.exception("zcollective: the coordinator crashed", exc_info=exc)
        self.crashed = f"the coordinator crashed: {type(exc).__name__}: {exc}"
        try:
            self._send_all(self.coordinator.fail("InternalError", self.crashed))
        except Exception:
            pass

    # -- the ROUTER and its monitor ---------------------------------------------

    def _drain_monitor(self) -> None:
        """Handle the monitor's events: a connection closed (whose, the probes
        find out), a stranger refused."""
        if self._monitor is None:
            return
        for kind, value in _sockets.monitor_events(self._monitor):
            if kind == zmq.EVENT_DISCONNECTED:
                self._probes.closed(time.monotonic())
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

    def _probe(self) -> None:
        """One round of probes, when the schedule says."""
        probes = self.coordinator.probes()
        self._probes.went(time.monotonic(), bool(probes))
        self._send_all(probes)

    def _watch_stalls(self) -> None:
        """Rule 11 of the coordinator: say who a stalled call waits for (and
        have the launcher show where they are)."""
        now = time.monotonic()
        if self._stall_due is None or now < self._stall_due:  # (as the last wait's bound found it)
            return
        for line, ranks in self.coordinator.stalls(now):
            log.warning("%s", line)
            announce_stall(self.session, ranks, line)

    def sleep_s(self, limit_s: Optional[float]) -> Optional[float]:
        """How long a wait may sleep: ``limit_s`` (None: for ever), but not
        past the next probe round, nor the next stall warning due."""
        now = time.monotonic()
        limit_s = self._probes.limit(limit_s, now)
        stall = self._stall_due = self.coordinator.next_stall()
        if stall is not None:
            limit_s = max(0.0, stall - now) if limit_s is None else max(0.0, min(limit_s, stall - now))
        return limit_s

    def _drain(self, waiting: bool = False, batch: Optional[int] = DRAIN_BATCH) -> None:
        """Handle every message waiting on the ROUTER (``waiting``: a poll just
        found one, so the first needs no second poll); after ``batch`` of them
        (None: no bound), return once rank 0's member has news, so that it
        gets it (the owner's next poll finds the rest at once): a stranger
        flooding the port would otherwise keep rank 0's thread here, and
        every call of the group waiting for rank 0."""
        router, coordinator = self._router, self.coordinator
        taken = 0
        while router is not None and coordinator.phase is not Phase.CLOSED and (
                waiting or _sockets.readable(router)):
            waiting = False
            if batch is not None and taken >= batch and self.to_host:
                return
            taken += 1
            frames = _sockets.recv_message(router)
            peer = frames[0].bytes
            if len(frames) < 2 or peer == RANK0_PEER:  # that name is rank 0's own member's alone
                continue
            member = coordinator.members.get(peer)
            address = (member.address if member is not None and coordinator.phase is not Phase.JOINING
                       else _sockets.peer_address(frames[1]))  # (a running member's: only for rare warnings)
            self._send_all(coordinator.receive(peer, frames[1:], address))

    def _send_all(self, outs: Step) -> None:
        """Send what the coordinator returned: rank 0's part to its queue, the
        others' on the ROUTER; a reduction it asks for runs where it stands."""
        if not outs and self.coordinator.interrupted is None:
            return  # (most contributions complete no call)
        gone: list[bytes] = []
        cache: dict[tuple[int, int, str], Any] = {}  # one payload to many ranks: built, hashed once
        router = self._router
        for peer, msg in applied(outs, self.coordinator):
            if peer == RANK0_PEER:
                self.to_host.append(owned(msg))
                if self._away:  # rank 0's thread is elsewhere: an awaiting coroutine watches this
                    self.wakeup.set()
                continue
            if router is None:
                continue  # closed: nothing more reaches anyone
            frames = [peer, *encode(msg, self.signer, cache, self.coordinator.part_bytes)]
            if not _sockets.send_to(router, frames):
                gone.append(peer)
        if gone:
            self._take_gone(gone)
        if self._handover and self.coordinator.phase is not Phase.JOINING and router is not None:
            # joined: nobody takes over a member's routing id any more (libzmq 4.3.5 aborts rank 0,
            # 'Assertion failed: !_io_error (src/stream_engine_base.cpp:310)', when strangers
            # reuse a routing id on quick connections to a ROUTER with handover on)
            self._handover = False
            router.setsockopt(zmq.ROUTER_HANDOVER, 0)
        if self.coordinator.interrupted is not None:  # in a reduce function, once all are told
            interrupted, self.coordinator.interrupted = self.coordinator.interrupted, None
            raise interrupted

    def _take_gone(self, peers: list[bytes]) -> None:
        """Peers found gone while sending. What one sent before closing (a
        BYE, a JOIN) is still queued: taken in first, so a rank that ended
        is not lost, and a JOIN is not left holding a slot."""
        self._drain(batch=None)
        for peer in peers:
            self._send_all(self.coordinator.gone(peer))


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
