"""Rank 0's coordinator: its ROUTER socket, served by whichever thread holds
the group's turn. A thin driver: it receives frames, feeds them to the pure
:class:`~zcollective._protocol._coordinator.Coordinator`, and sends what it
returns; rank 0's program thread does so itself inside the library (no
thread hop on the hot path), its background thread only while the program
has been elsewhere for :data:`~zcollective._limits.AWAY_S`. What it does and when: see
docs/protocol.md, *Drivers* and *Concurrency*.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from functools import partial
from threading import get_ident
from typing import Any, Callable, Optional

from .._announce import announce_stall
from .._format._wire import DEFAULT_MAX_FRAMES, Message, Signer, encode, owned
from .._limits import (
    CLOSE_LINGER_MS,
    EXIT_LINGER_MS,
    POLL_SLICE_S,
    STOP_TIMEOUT_S,
)
from .._protocol._coordinator import RANK0_PEER, Coordinator, Forming, Phase, ProbeSchedule
from .._protocol._ops import Step
from ..config import Config
from ..errors import InternalError
from . import _interrupts, _sockets, transport
from ._combine import applied
from ._interrupts import DEADLINE, NUDGE, Waiter
from ._mailbox import mail_woke
from ._turns import STOP, StandIn, Turns
from ._zmq import MONITOR, ROUTER, Hub

log = logging.getLogger("zcollective")

HOLD_TRY_S = 0.02  # rank 0's thread sending waits this long for the turn
# (the background thread gives them back within microseconds unless it runs a reduce function)
DRAIN_BATCH = 256  # messages one step takes in before rank 0's member, if it has news, gets it
# (a peer sending faster than the coordinator reads must not starve rank 0's own calls)
WAKEUP = "wakeup"  # its waiter's name for the pipe an awaiting coroutine watches


class Server:
    """Serves the coordinator of one group on rank 0 (see the module's rule)."""

    SERVED = Hub.SOURCES  # what the turn's holder serves (the ZAP handler: with a secret)
    NUDGED = (*SERVED, NUDGE)  # ... and what a thread wanting the turn writes

    def __init__(self, ctx: Any, config: Config, forming: Optional[Forming] = None,
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
        self.mail_woke = 0  # a wait of the turn's holder ended for its member's mailbox (_mailbox.mail_woke)
        self.crashed: Optional[str] = None  # why the coordinator stopped serving early (a bug)
        self.turns = turns if turns is not None else Turns()  # its holder owns the sockets
        self._away = False  # the background thread serves
        self.hub: transport.Hub = Hub(ctx, config, self.host, forming is not None)  # its sockets (the seam)
        self.to_host: deque[Message] = deque()  # results for rank 0's member, not yet taken
        self.from_member: deque[Message] = deque()  # rank 0's member's messages, not yet taken (from_host)
        self._probes = ProbeSchedule()
        self._stall_due: Optional[float] = None  # the next stall warning due, as _wait_ms found it
        self.stopped = False
        self._standin = StandIn("zcollective-coordinator", self.turns, self._serve_away,
                                lambda: bool(self.coordinator.pending), self._crash, standby=True)
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

    def _watch(self, router: Any, monitor: Any) -> None:
        for _ in range(self.hub.watch(router, monitor, self.waiter)):
            self._probes.closed(time.monotonic())

    def _close_pipes(self) -> None:
        self.wakeup.close()
        self._standin.stop_pipe.close()

    def gone(self) -> Optional[str]:
        """Why the coordinator is no longer served, or None if it is."""
        return self.crashed or ("it stopped" if self.stopped else None)

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
        """Rank 0's member sends ``msg``: taken by the coordinator now, in this thread (a reduce function
        may run here), or by the next owner if the stand-in keeps the turn past HOLD_TRY_S."""
        if self.turns.owner != get_ident():
            self.from_member.append(msg)
            self._briefly(self._take_from_host)
            return
        if self.from_member:  # (in order)
            self.from_member.append(msg)
            self._take_from_host()
            return
        coordinator = self.coordinator  # the common call, holding the turn: _take_from_host's, inline
        if self.hub.router is None or coordinator.phase is Phase.CLOSED or self.crashed:
            return
        try:
            outs = coordinator.receive_message(RANK0_PEER, msg)
            if outs or coordinator.interrupted is not None:
                self._send_all(outs)  # (a reduction asked for runs there)
        except Exception as exc:
            raise self._failed(exc) from exc

    def form_now(self, quorate: bool = False) -> None:
        """Rank 0's thread: the forming bound passed; start with those who came (``quorate``: if enough)."""
        self._briefly(partial(self._take, partial(self.coordinator.form_now, quorate)))

    def _take_from_host(self) -> None:
        """The owner: what rank 0's member sent, in order."""
        queue, receive = self.from_member, self.coordinator.receive_message
        while queue:
            msg = queue.popleft()
            if self.hub.router is None or self.coordinator.phase is Phase.CLOSED or self.crashed:
                continue  # (as _take: nothing is taken any more)
            try:
                outs = receive(RANK0_PEER, msg)
                if outs or self.coordinator.interrupted is not None:
                    self._send_all(outs)  # (a reduction asked for runs there)
            except Exception as exc:
                raise self._failed(exc) from exc

    def serve(self, deadline: Optional[float], deliver: Callable[[Message], None],
              nudged: bool = False, also: tuple[str, ...] = ()) -> bool:
        """Rank 0's thread, holding the turn: serve until something came for its member (to ``deliver``;
        True), the nudge if ``nudged``, or a source of ``also`` (True), or ``deadline`` (False)."""
        if self.from_member:
            self._take_from_host()
        got = self._serve_until(self._news, deadline, (*(self.NUDGED if nudged else self.SERVED), *also),
                                POLL_SLICE_S)
        if self.to_host:
            if self.wakeup.written:
                self.wakeup.clear()
            while self.to_host:
                deliver(self.to_host.popleft())
        return got

    def quick(self, names: tuple[str, ...], deadline: Optional[float], drain: bool = False) -> bool:
        """HostDriver.lead's step: True when the ROUTER alone woke a poll of ``names`` and was read (till
        its member has news, unless ``drain``); False, nothing read, when anything else woke it or is due."""
        if self.from_member or self.crashed is not None or self.stopped or self.hub.gatekeeper is not None:
            return False
        woke = self.waiter.wait(names, deadline, self.sleep_s(POLL_SLICE_S))
        if (len(woke) != 1 or woke[0] != ROUTER or self._probes.due is not None
                or (self._stall_due is not None and time.monotonic() >= self._stall_due)):
            return False
        try:
            self._drain(waiting=True, batch=DRAIN_BATCH if drain else 1)
        except Exception as exc:
            raise self._failed(exc) from exc
        return True

    def _news(self) -> bool:
        return bool(self.to_host) or self.crashed is not None or self.stopped  # (gone(), inline)

    def _serve_until(self, done: Callable[[], bool], deadline: Optional[float], names: tuple[str, ...],
                     slice_s: Optional[float] = None) -> bool:
        """The turn's holder: serve what the waiter finds, in slices of at most ``slice_s`` (never past a
        probe round or a stall warning due), until ``done()`` or a source not served (the nudge, the stop)
        is readable (True, at once), or ``deadline`` (False)."""
        while not done():
            woke = self.waiter.wait(names, deadline, self.sleep_s(slice_s))
            if NUDGE in woke or STOP in woke:
                return True
            mail = mail_woke(woke) if len(woke) > 1 or (woke and woke[0] not in self.SERVED) else 0
            if mail:  # its member's mailbox (the holder takes it in), once what else woke is
                self.mail_woke = mail  # served: a busy mailbox must not starve the coordinator
                if woke[0] in self.SERVED:
                    self._step(woke)
                return True
            if (woke and woke[0] is not DEADLINE) or self._probes.due is not None:
                self._step(woke)
            if self._stall_due is not None and time.monotonic() >= self._stall_due:  # rule 11 of the
                for line, ranks in self.coordinator.stalls(time.monotonic()):  # coordinator (the due
                    log.warning("%s", line)  # time as the last wait's bound found it)
                    announce_stall(self.session, ranks, line)
            if DEADLINE in woke:
                return done()
        return True

    def fds(self) -> list[int]:
        """File descriptors that become readable when the coordinator may have work: watched by an awaiting
        coroutine (read once, at start: only the owner uses the sockets)."""
        return self.waiter.fds((WAKEUP, *self.SERVED))

    def _take(self, step: Callable[[], Step]) -> None:
        """Run one step of the coordinator and send what it returns; a bug fails the group for everyone."""
        if self.hub.router is None or self.coordinator.phase is Phase.CLOSED or self.crashed:
            return
        try:
            self._send_all(step())  # (a reduction asked for runs there)
        except Exception as exc:
            raise self._failed(exc) from exc

    def _step(self, woke: list[str]) -> None:
        """The owner: answer handshakes, then what waits on the monitor and the ROUTER. ``woke``: what a wait
        found readable (read without asking again; the others wait for the next wait); none: each is asked."""
        known = bool(woke) and woke[0] is not DEADLINE
        if known and self.hub.gatekeeper is not None:
            self.hub.handshakes()  # a handshake waits for it: first
        try:
            if not known or MONITOR in woke:
                for _ in range(self.hub.events()):  # (whose connection closed, the probes find out)
                    self._probes.closed(time.monotonic())
            if not known or ROUTER in woke:
                self._drain(waiting=known)
            if self._probes.due is not None and time.monotonic() >= self._probes.due:
                self._probe()
        except Exception as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: Exception) -> InternalError:
        """A bug in the coordinator (``exc``): every replica is told, once; the error for rank 0's caller."""
        if self.crashed is None:
            self._crash(exc)
        return InternalError(self.crashed or "the coordinator crashed")

    def busy(self) -> Optional[str]:
        """What the coordinator has been stuck in for a while, if anything."""
        reducing = self.coordinator.reducing  # one attribute read: safe across threads
        if reducing is None:
            return None
        seq, op, since = reducing
        return (f"every rank arrived; the reduce function of seq {seq} {op.label} has been "
                f"running on the coordinator (rank 0) for {time.monotonic() - since:.1f} s")

    # -- the background thread ---------------------------------------------------

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
        if self.stopped:
            return
        self._standin.stop()
        bound = STOP_TIMEOUT_S if self.coordinator.reducing is None else 0.1
        started = self._thread.ident is not None
        try:
            ended = not started or _interrupts.join(self._thread, bound)
        except BaseException:  # interrupted while the thread ends (it was told): once it has,
            # the sockets are this thread's: close them now (else the port stays bound for good)
            if not started or _interrupts.finish(self._thread, bound):
                self.stopped = True
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
        self.stopped = True
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
        if self.hub.router is not None:
            try:
                self._send_all(self.coordinator.give_up_ending())
            except Exception:
                pass  # nothing more can be said: the sockets close now

    def _close(self, linger_ms: int) -> None:
        self.hub.close(linger_ms)
        self._close_pipes()

    # -- binding ---------------------------------------------------------------

    def _bind(self) -> tuple[Any, Any]:
        return self.hub.bind()

    def _last_byes(self, timeout: float) -> None:
        """Rank 0's program is ending and the group is over: send the last BYEs and wait (at most ``timeout``
        s) for their answers and the TAKENs asked for (rule 7 of the coordinator). A replica busy in its own
        code answers when it next enters the library or ends."""
        coordinator = self.coordinator
        self._send_all(coordinator.last_byes())
        self._serve_until(lambda: not coordinator.waiting(), time.monotonic() + timeout, self.SERVED)

    def _crash(self, exc: BaseException) -> None:
        """A bug in the coordinator: tell every replica (once) rather than leave them waiting."""
        if self.crashed is not None:
            return
        log.exception("zcollective: the coordinator crashed", exc_info=exc)
        self.crashed = f"the coordinator crashed: {type(exc).__name__}: {exc}"
        try:
            self._send_all(self.coordinator.fail("InternalError", self.crashed))
        except Exception:
            pass

    # -- the ROUTER and its monitor ---------------------------------------------

    def _probe(self) -> None:
        """One round of probes, when the schedule says."""
        probes = self.coordinator.probes()
        self._probes.went(time.monotonic(), bool(probes))
        self._send_all(probes)

    def sleep_s(self, limit_s: Optional[float]) -> Optional[float]:
        """How long a wait may sleep: ``limit_s`` (None: for ever), but not
        past the next probe round, nor the next stall warning due (none while no call is pending)."""
        now, due, co = time.monotonic(), self._probes.due, self.coordinator
        if due is not None:  # (ProbeSchedule.limit, inline: at every wait)
            limit_s = due - now if limit_s is None else min(limit_s, due - now)
        stall = self._stall_due = co.next_stall() if co.pending or co.phase is not Phase.RUNNING else None
        if stall is not None:
            limit_s = max(0.0, stall - now) if limit_s is None else max(0.0, min(limit_s, stall - now))
        return limit_s

    def _drain(self, waiting: bool = False, batch: Optional[int] = DRAIN_BATCH) -> None:
        """Handle every message waiting on the ROUTER (``waiting``: a poll just found one); after ``batch``
        (None: no bound), return once rank 0's member has news (a flood of the port must not hold it)."""
        hub, coordinator = self.hub, self.coordinator
        taken = 0
        while coordinator.phase is not Phase.CLOSED:
            if batch is not None and taken >= batch and self.to_host:
                return
            frames = hub.recv(waiting)
            if frames is None:
                return
            waiting, taken = False, taken + 1
            peer = frames[0].bytes
            if len(frames) < 2 or peer == RANK0_PEER:  # that name is rank 0's own member's alone
                continue
            member = coordinator.members.get(peer)
            address = (member.address if member is not None and coordinator.phase is not Phase.JOINING
                       else hub.address(frames[1]))  # (a running member's: only for rare warnings)
            self._send_all(coordinator.receive(peer, frames[1:], address))

    def _send_all(self, outs: Step) -> None:
        """Send what the coordinator returned: rank 0's part to its queue, the
        others' through the hub; a reduction it asks for runs where it stands."""
        coordinator = self.coordinator
        if not outs and coordinator.interrupted is None:
            return  # (most contributions complete no call)
        gone: list[bytes] = []
        cache: dict[tuple[int, int, str], Any] = {}  # one payload to many ranks: built, hashed once
        hub = self.hub
        for peer, msg in applied(outs, coordinator):
            if peer == RANK0_PEER:
                segments = msg.segments  # (one immutable frame, a small call's, needs no copy: owned's test)
                self.to_host.append(msg if len(segments) == 1 and len(segments[0]) == 1 and type(
                    segments[0][0]) is bytes else owned(msg))
                if self._away:  # rank 0's thread is elsewhere: an awaiting coroutine watches this
                    self.wakeup.set()
            elif hub.router is not None and not hub.send(
                    [peer, *encode(msg, self.signer, cache, coordinator.part_bytes)]):
                gone.append(peer)  # (closed: nothing more reaches anyone)
        if gone:  # what one sent before closing (a BYE, a JOIN) is taken in first, so a rank that
            self._drain(batch=None)  # ended is not lost, and a JOIN does not hold a slot
            for peer in gone:
                self._send_all(coordinator.gone(peer))
        if hub.handover and coordinator.phase is not Phase.JOINING:
            hub.joined()
        if coordinator.interrupted is not None:  # in a reduce function, once all are told
            interrupted, coordinator.interrupted = coordinator.interrupted, None
            raise interrupted
