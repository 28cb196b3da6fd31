"""One open group's lifecycle: its I/O (transport, rank 0's server, the driver, the data plane) and its
life: open (join, be admitted, or form from an earlier group), close, end at exit, close to form the next."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from ._announce import announce_coordinator, announce_group, write_for_launcher
from ._format._wire import Signer
from ._forming import Form, Overslept, Unreachable
from ._future import settle, sleeping
from ._io import _interrupts, _shared, _sockets, _stacks, _stops, _zmq
from ._io._dataplane import DataPlane
from ._io._dealer import DealerDriver
from ._io._driver import DirectDriver, Driver, HostDriver
from ._io._edges import Edges
from ._io._interrupts import NUDGE
from ._io._mailbox import MailSockets
from ._io._reducing import reducer
from ._io._shared import SharedPlane
from ._io._turns import Turns
from ._io._withdraw import withdraw
from ._limits import (
    CLOSE_LINGER_MS,
    EXIT_LINGER_MS,
    EXIT_WAIT_S,
    GROW_FORM_WAIT_S,
    HOST_WINDOW_S,
    LEAVING_SHARE,
    STATUS_WAIT_S,
)
from ._protocol._member import Member
from ._protocol._ops import Here
from ._protocol._stats import calls_log
from .config import Config
from .errors import (
    AddressError,
    CollectiveError,
    CollectiveTimeoutError,
    ForkedProcessError,
    ReplicaLostError,
    is_interrupt,
)

if TYPE_CHECKING:  # (rank 0's only, imported when it serves: the other ranks never load them)
    from ._io._server import Server
    from ._io._turns import StandIn  # (an interior rank's relay of the tree)
    from ._protocol._coordinator import Coordinator

log = logging.getLogger("zcollective")

JOIN_FAILURE_GRACE_S = 2.0  # rank 0 keeps answering this long after a failed join
_open_lives: dict[int, Lifecycle] = {}  # id -> lifecycle: ended (delivered, then closed) at exit


class Lifecycle:
    """The I/O and life of one open group (see the module docstring)."""

    @classmethod
    def admission(cls, config: Config) -> tuple[Config, Form]:
        """A newcomer waits until a grow() admits it (rule 10); returns how it joins the next group."""
        admitted = cls(config).member.admitted  # (returns once admitted, closed)
        assert admitted is not None
        return (dataclasses.replace(config, rank=admitted["rank"], num_replicas=admitted["size"],
                                    join=False), Form(admitted["lineage"], wait_s=GROW_FORM_WAIT_S))

    def __init__(self, config: Config, form: Optional[Form] = None, *, nested: bool = False,
                 opened: Optional[Callable[[str], None]] = None,
                 world: Optional[list[int]] = None, check: Optional[Callable[[], None]] = None) -> None:
        """Join the group ``config`` describes (or ``form`` one from an earlier group, ``config`` naming the
        old rank and size). ``nested``: a sub-group (tells the launcher nothing; ``opened`` is told where it
        listens; its errors name ``world`` ranks; ``check()`` raises to end the join)."""
        self.config = config
        self.nested = nested
        self.world = world  # a sub-group's ranks' world ranks (its errors name them); None: the world
        self.parent_ranks: Optional[list[int]] = None  # a sub-group's members' ranks in its parent
        self.parent: Optional[Lifecycle] = None  # a sub-group's parent
        self.suspects: set[int] = set()  # ranks a sub-group of this one lost (see end)
        self.turns = Turns()  # which of the program's threads uses the sockets now
        self.pid = os.getpid()  # a forked child must never touch this process's sockets
        self.closed = False
        self.reforming: Optional[str] = None  # closed by shrink() or grow() to form the next group
        self._watching = False  # this group counts in _stops' watch
        self.ctx: Any = None  # the transport's state (a ZeroMQ context)
        self.server: Optional[Server] = None
        self.data: Optional[DataPlane] = None
        self.mail: Optional[MailSockets] = None  # its mailbox (point to point)
        self.shared: Optional[SharedPlane] = None  # its host's shared memory, if it shares some
        self.relayer: Optional[StandIn] = None  # an interior rank's background thread (the tree)
        signer = Signer(config.secret) if config.secret is not None else None
        self.member = _new_member(config, signer, form, world)
        self.driver: Optional[Driver] = None
        self.here = Here(config.rank, config.num_replicas)
        _open_lives[id(self)] = self
        _register_atexit()
        _stacks.answer(config.stacks)  # where this rank is, when a stall names it
        _interrupts.hold_signals()  # no signal handler's exception splits a message
        _stops.watch()  # was this process stopped? (a loss learned after a stop: see _elastic)
        self._watching = True
        told = False  # the others were told why it failed (``opened`` raised)
        try:
            self.driver = self._connect(signer, form)
            if self.server is not None and not config.master_port:  # (a sub-group's)
                self.config = config = dataclasses.replace(config, master_port=self.server.hub.port)
                self.member.endpoint = config.endpoint
            if opened is not None:
                told = True
                opened(self.coordinator_address())
                told = False
            self.driver.warn_after = config.warn_after
            self.driver.waiter.watch(NUDGE, self.turns.nudge.fd)  # a thread wanting the turn wakes a wait
            self.driver.turns = self.turns
            deadline = None if config.init_timeout is None else time.monotonic() + config.init_timeout
            if config.join:
                Edges(self.driver).await_admission(config, deadline)
                self.close(quick=True)
                return
            if form is None:
                self.driver.join(config.init_timeout, check)
            else:
                self._join_forming(form)
            self._start_data(deadline)
            config, member = self.config, self.member
            self.here = _here(self.config, self.member, self.shared, self.data is not None)
            if not nested:
                announce_group(config.rank, config.num_replicas, member.session, member.lineage,
                               _stacks.answering())
                if self.config.rank == 0:
                    announce_coordinator(self.coordinator_address())
        except BaseException as exc:
            refused = isinstance(exc, (CollectiveError, ValueError)) and not isinstance(
                exc, CollectiveTimeoutError)  # not an interrupt, nor a bug of ours
            if (self.server is not None and self.server.gone() is None and refused and form is None
                    and not told):  # replicas still starting up should hear why, not time out
                _interrupts.sleep(JOIN_FAILURE_GRACE_S)
            self.close()
            raise

    def _connect(self, signer: Optional[Signer], form: Optional[Form] = None) -> Driver:
        """The member's link: a lone replica calls the coordinator directly; rank 0 (or a forming group's
        host) serves it; the others reach it through a DEALER."""
        config, member = self.config, self.member
        alone = config.num_replicas == 1 and form is None and not config.join
        if alone and not config.port_given:  # a script run as it is: no port of its own
            return DirectDriver.alone(self.member, signer, self.config)
        if self.nested:  # (a process may open many: it may be out of descriptors by now)
            _sockets.check_descriptors(f"rank {config.rank} cannot start ZeroMQ")
        self.ctx = _zmq.context(config.rank)
        if (config.rank == 0 and not config.join) if form is None else form.forming is not None:
            from ._io._server import Server

            self.server = Server(self.ctx, config, form.forming if form is not None else None, self.turns,
                                 self.world)
            try:
                self.server.start()
            except AddressError as exc:
                if not alone:
                    raise
                # a group of one given a port serves it for newcomers (taken: alone all the same)
                log.warning("zcollective: a group of one could not listen for newcomers (%s); "
                            "it runs alone, and grow() admits nobody", exc)
                self.server = None
                _zmq.end(self.ctx, config.rank)
                self.ctx = None
                return DirectDriver.alone(self.member, signer, self.config)
            link: Driver = HostDriver(member, self.server)
        else:
            link = DealerDriver(self.ctx, config, member)
            link.sleepers = sleeping
        if config.join:  # (a newcomer waiting: no data plane until it is a member)
            return link
        try:
            gate = self.server.hub.gatekeeper if self.server is not None else None  # the context's one
            self.mail, self.data = _open_ports(self.ctx, config, member, gate)
        except BaseException:  # (no route to the master, say): the link is not ours yet to close,
            link.close()  # and a socket left open makes the context's term() wait forever
            raise
        return link

    def _join_forming(self, form: Form) -> None:
        """Join a group formed from an earlier one (rule 9 of the coordinator): the host waits
        :attr:`Form.wait_s` for its members; a member gives up after :attr:`Form.reach_s`."""
        link, member, server = self.driver, self.member, self.server
        assert link is not None
        link.send([member.join()])
        who = f"old rank {self.config.rank}"
        if server is not None:
            waited = time.monotonic()
            link.wait_for(lambda: member.joined, waited + form.wait_s)
            if not member.joined:
                if time.monotonic() - waited > form.wait_s + HOST_WINDOW_S:  # stopped meanwhile
                    raise Overslept(f"{who} overslept the forming of a group at {self.config.endpoint}")
                if form.quorum_s > form.wait_s:  # too few yet: wait on for each to come or withdraw
                    server.form_now(quorate=True)  # (not past an interrupt held back: formed, or not, now)
                    link.wait_for(lambda: member.joined or _interrupts.pending(), waited + form.quorum_s)
                if not member.joined:
                    server.form_now()
            if not link.wait_for(lambda: member.joined, time.monotonic() + STATUS_WAIT_S):
                raise CollectiveTimeoutError(f"{who} could not form a group at {self.config.endpoint}")
        else:
            try:
                self._reach_host(form, who)
            except BaseException as exc:  # its JOIN may be there: taken back, or it is a member
                withdraw(link, member, exc, form.wait_s, form.reach_s)
        self.config = dataclasses.replace(self.config, rank=member.rank, num_replicas=member.size)
        if self.data is not None:
            self.data.rank, self.data.size = member.rank, member.size

    def _reach_host(self, form: Form, who: str) -> None:
        """A member forming a group: reach its would-be host within :attr:`Form.reach_s` (a refused port:
        :class:`Unreachable` with ``refused``), then wait for its WELCOME."""
        link, member, endpoint = self.driver, self.member, self.config.endpoint
        assert link is not None
        reached = time.monotonic() + form.reach_s
        if not link.wait_for(lambda: member.joined or member.greeted, reached):
            raise Unreachable(f"{who} could not reach {endpoint} within {form.reach_s:g} s"
                              + (" (refused: nobody listens there)" if member.refused else ""),
                              refused=member.refused)
        formed = time.monotonic() + form.wait_s + form.reach_s
        if link.wait_for(lambda: member.joined or member.host_busy, formed):
            if member.joined or link.wait_for(lambda: member.joined, reached):
                return
            raise Unreachable(f"{who} reached {endpoint}, but its host did not start forming a group "
                              f"within {form.reach_s:g} s (busy in its own code, or stopped?)")
        raise Unreachable(f"{who} reached {endpoint}, but no group was formed there within "
                          f"{form.wait_s + form.reach_s:g} s")

    def _start_data(self, deadline: Optional[float]) -> None:
        """Joined: open the mailbox; share memory if told; keep the data plane if all have it."""
        data, member, link = self.data, self.member, self.driver
        leaders = None
        if member.shared is not None and link is not None:
            self.shared = link.shared = SharedPlane.welcomed(member)
            leaders = self.shared.leaders
        if self.mail is not None and link is not None:
            if member.mail_endpoints is None:  # (a newcomer of an older release: no point to point)
                self.mail.close()
                self.mail = None
            else:
                base = self.config.secret or bytes.fromhex(member.mail_key or "")
                self.mail.start(member.session, member.mail_endpoints, base, member.rank, member.local_names)
                link.attach_mail(self.mail)
                Edges(link).link_tree(deadline)
                if member.relay is not None:  # an interior rank of the tree: its subtree's calls move
                    from ._io._relayer import relayer  # while its program is elsewhere

                    self.relayer = relayer(self.turns, link, member)
                    self.relayer.start()
        if data is None or link is None:
            return
        if member.data_endpoints is None:
            self.data = None
            data.close()
            return
        data.start(member.session, member.data_endpoints, member.mac, member.data_key, deadline,
                   link.progress, leaders)
        member.check()  # the group failed while the links were made
        link.data = data

    def coordinator_address(self) -> str:
        """:meth:`zcollective.Group.coordinator_address`."""
        host = self.config.master_addr
        return f"[{host}]:{self.config.master_port}" if ":" in host else f"{host}:{self.config.master_port}"

    def coordinator(self) -> Optional[Coordinator]:
        if self.server is not None:
            return self.server.coordinator
        return self.driver.coordinator if isinstance(self.driver, DirectDriver) else None

    def check_usable(self) -> None:
        if self.closed and self.reforming is not None:
            then = ("the grown group formed without it: call shrink() to be told so (LeftOutError), "
                    "and start this process again as a newcomer" if self.reforming == "grow()" else
                    "call shrink() again to join the survivors' group (it raises LeftOutError if they "
                    "went on without this replica)")
            raise RuntimeError(
                f"old rank {self.config.rank}: this zcollective group was closed for {self.reforming} to "
                f"form the next one, which did not finish here (interrupted, or it raised): {then}")
        if self.closed:
            raise RuntimeError("this zcollective group was torn down; call initialize() "
                               "(or create a new Group) first")
        self.check_process()

    def check_process(self) -> None:
        if os.getpid() != self.pid:
            raise ForkedProcessError(
                f"this zcollective group belongs to process {self.pid}, the parent of this forked "
                f"process {os.getpid()}; a child cannot use its parent's group: call "
                f"zcollective.initialize() (or create a Group) in the child for a group of its own")

    def finish(self, deadline: Optional[float], timeout: Optional[float]) -> None:
        """``teardown()``, holding the turn: finish what this rank called (sends go, its FINAL counts them,
        every message sent to it is taken in), so closing loses nothing; else at ``deadline``
        :class:`CollectiveTimeoutError` (``timeout`` is how long that was)."""
        driver, member = self.driver, self.member
        assert driver is not None
        mail = member.mail
        if mail is not None:
            mail.closing()
        sent = Edges(driver).send_waiting(deadline)
        if sent:  # (what still waits for a link goes to a rank whose program ended: never)
            final = Edges(driver).final(True, time.monotonic())  # the others' receives from this rank end
            if final is not None:  # once what it sent was taken in
                driver.send([final])
        if not sent or not Edges(driver).finish_calls(deadline):
            waits = ([member.describe_in_flight()] if member.calls else []) + (
                mail.unfinished() if mail is not None else [])
            raise CollectiveTimeoutError(
                f"rank {self.config.rank}: teardown timed out after {timeout:g} s finishing the calls "
                f"made before it: {'; '.join(waits) or 'libzmq still sends its messages'}")
        if mail is not None:
            mail.torn_down()
        settle(member.outcomes)

    def close_to_form(self, quick: bool) -> None:
        """Close, holding the turn, for the next group to form (``quick``: it failed, wait for nothing)."""
        with self.turns:
            self.reforming = self.reforming or ("shrink()" if quick else "grow()")
            if not self.closed:
                self.member.forget_calls(lambda call, seq: self.member.failure or RuntimeError(
                    f"seq {seq} {call.op}: the group was formed again before the call finished"))
                self.close(quick=quick, forming=True)

    def close(self, ending: bool = False, hurry: bool = False, quick: bool = False,
              forming: bool = False) -> None:
        """Close the sockets. ``ending`` (no teardown): rank 0 serves until its calls are delivered, what is
        queued gets :data:`EXIT_LINGER_MS`; ``hurry`` (interrupted) and ``quick`` wait for nothing;
        ``forming``: the next group opens now, so signals stay held (no interrupt between the two)."""
        self.closed = True
        _open_lives.pop(id(self), None)
        if self.parent is not None and self.parent_ranks is not None:
            self.parent.suspects.update(self.parent_ranks[r] for r in lost_for_sure(self.member.failure)
                                        if 0 <= r < len(self.parent_ranks))
        if self.config.rank == 0 and not self.config.join and not self.nested:  # (stats of the job's group)
            write_for_launcher(stats(self), self.member.session)
        self.member.forget_calls(lambda call, seq: RuntimeError(
            f"seq {seq} {call.op}: the group was torn down before the call finished"))
        settle(self.member.outcomes)  # (what came before, and these errors)
        try:
            if self.server is not None:
                self.server.stop(ending, hurry, 0 if quick else CLOSE_LINGER_MS)
        finally:  # an interrupt while rank 0 waits for the others still closes everything
            try:
                stuck = self.server is not None and self.server.gone() is None
                if self.relayer is not None:
                    from ._io._relayer import STOP_WAIT_S

                    self.relayer.end(STOP_WAIT_S)
                if self.driver is not None and not quick:
                    with contextlib.suppress(CollectiveError):  # (a failure: the sockets still close)
                        Edges(self.driver).hand_down(time.monotonic() + EXIT_LINGER_MS / 1000)
                if self.mail is not None:  # (an interior rank's results passed down leave first)
                    lingers = (ending or self.relayer is not None) and not quick
                    self.mail.close(EXIT_LINGER_MS if lingers else 0)
                if self.data is not None:  # (ending: the next rank has its chunks, rule 7 of the coordinator)
                    self.data.close(EXIT_LINGER_MS if ending else 0)
                if self.shared is not None:  # (unlinking a name not ours is refused, and let be)
                    self.shared.close()
                if self.driver is not None:
                    self.driver.close(EXIT_LINGER_MS if ending else 0)
                if self.ctx is not None and not stuck:
                    _zmq.end(self.ctx, self.config.rank)  # (then the interpreter may free our buffers)
            finally:  # only now: a signal surfaces at a wait, never halfway through a message
                self.turns.close()
                if self._watching:
                    self._watching = False
                    _stops.unwatch()
                if not _open_lives and not forming:
                    _interrupts.release_signals()

    def _await_verdict(self, driver: Driver) -> None:
        """Ending while a sub-group lost ranks of this one: wait up to a liveness bound for this group to
        fail too, so the others hear of the rank lost, not that this one ended."""
        wait = self.config.liveness_timeout
        if self.suspects and self.member.failure is None and wait:
            driver.wait_for(lambda: self.member.failure is not None, time.monotonic() + wait)

    def end(self) -> None:
        """The program ends without teardown: deliver what it produced, bounded, then close (rule 7)."""
        if self.closed or os.getpid() != self.pid:
            return
        _interrupts.hold_new_handlers()  # (one the program installed since its last call)
        turns, driver = self.turns, self.driver
        if not turns.take(time.monotonic() + STATUS_WAIT_S):
            return  # a thread left running (a daemon) is busy in a step: the sockets are its
        try:
            if self.closed:
                return
            interrupted: Optional[BaseException] = None
            if driver is not None:
                try:
                    driver.progress()  # take in a FAIL that would make a BYE pointless
                    self._await_verdict(driver)
                    Edges(driver).relay_out(time.monotonic() + EXIT_WAIT_S)  # an interior rank of the tree
                    driver.finish_data(EXIT_LINGER_MS / 1000)  # the others need our chunks
                    Edges(driver).send_waiting(time.monotonic() + EXIT_LINGER_MS / 1000, links=False)
                    Edges(driver).say_bye(EXIT_LINGER_MS / 1000, LEAVING_SHARE * self.config.liveness_timeout)
                except BaseException as exc:
                    if is_interrupt(exc):  # the BYE still goes, unwaited; rank 0 then waits for nothing
                        interrupted = exc
                        bye = self.member.bye()
                        with contextlib.suppress(BaseException):
                            if bye is not None:
                                final = Edges(driver).final(False, time.monotonic())  # (no wait for a link)
                                driver.send([bye] if final is None else [final, bye])
            self.close(ending=True, hurry=interrupted is not None)
            if interrupted is not None:
                raise interrupted
        finally:
            turns.give()


def _new_member(config: Config, signer: Optional[Signer], form: Optional[Form],
                world: Optional[list[int]]) -> Member:
    """The member's rules for ``config`` (forming from an earlier group: ``form``)."""
    member = Member(config.rank, config.num_replicas, config.endpoint, signer, config.max_frame_bytes)
    member.world, member.job, member.newcomer = world, config.job, config.join
    member.user_code = _interrupts.user_code  # (an interior rank of the tree reduces there)
    if form is not None:
        member.lineage = form.lineage
    if config.log == "calls":
        member.log_calls = True
        _show_calls_log()
    return member


def _open_ports(ctx: Any, config: Config, member: Member,
                gate: Any) -> tuple[MailSockets, Optional[DataPlane]]:
    """Bind the mailbox's and data plane's ports before the JOIN names them (``gate``: rank 0's ZAP)."""
    mail = MailSockets(ctx, config, gate)
    member.mail_endpoint, member.mail_window = mail.endpoint, config.mail_window_bytes
    member.local_name = mail.local_name
    if config.shared_memory_min_bytes is not None and _shared.available():
        member.shm_offer = (config.shared_memory_min_bytes, _shared.room())
    if not (config.data_plane == "on" or (config.data_plane == "auto" and not _on_loopback(config))):
        return mail, None  # (a master on loopback: one host, no use)
    try:
        data = DataPlane(ctx, config, mail.gatekeeper)
    except BaseException:
        mail.close()
        raise
    member.data_endpoint, member.data_min_bytes = data.endpoint, config.data_plane_min_bytes
    member.data_mode = config.data_plane
    return mail, data


def _here(config: Config, member: Member, plane: Optional[SharedPlane], data: bool) -> Here:
    """What the operations know of this rank once joined (across hosts, shared memory is allreduce's only)."""
    least = member.shared["min"] if member.shared is not None else 0
    across = plane is not None and plane.leaders is not None
    return Here(config.rank, config.num_replicas, data, member.data_min_bytes, config.max_frame_bytes,
                None if across else plane, max(least, member.data_min_bytes) if across else least,
                plane if across else None, reducer)


def lost_for_sure(failure: Optional[BaseException]) -> set[int]:
    """The ranks ``failure`` says were lost, not ended: the other groups they are in lose them too."""
    if not isinstance(failure, ReplicaLostError):
        return set()
    ended = set(getattr(failure, "ended_ranks", ()))
    return (set(getattr(failure, "lost_ranks", ())) - ended) | set(getattr(failure, "lost_inferred", ()))


def _on_loopback(config: Config) -> bool:
    """Is the master reached over loopback (so every replica is on its host)?"""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(
            config.master_addr, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def _show_calls_log() -> None:
    """``ZCOLLECTIVE_LOG=calls``: print the lines to stderr, unless the program configured logging."""
    if not calls_log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        calls_log.addHandler(handler)
    if calls_log.getEffectiveLevel() > logging.INFO:
        calls_log.setLevel(logging.INFO)


def _end_all() -> None:
    for life in reversed(list(_open_lives.values())):  # sub-groups before the groups they came from
        try:
            life.end()
        except KeyboardInterrupt:
            log.warning("zcollective: interrupted while delivering the last results at exit; "
                        "the others were told the group is over")
        except BaseException:
            log.exception("zcollective: ending a group at exit failed")


_atexit_registered = False
_finalizer_pid: Optional[int] = None  # the process whose multiprocessing finalizers hold _end_all
MP_EXIT_PRIORITY = 100  # above multiprocessing's finalizers (a queue's flush is 10): results leave first


def _register_atexit() -> None:
    """Have every open group end with the process: by ``atexit`` and multiprocessing's finalizers (a forked
    child skips ``atexit``; ending twice is a no-op)."""
    global _atexit_registered, _finalizer_pid
    if not _atexit_registered:
        _zmq.before_exit()  # (our hook runs before pyzmq's)

        atexit.register(_end_all)
        _atexit_registered = True
    multiprocessing = sys.modules.get("multiprocessing")  # a child has it imported; else no cost
    if multiprocessing is None or _finalizer_pid == os.getpid() or multiprocessing.parent_process() is None:
        return
    from multiprocessing import util  # a child's registry starts empty: register in each child

    util.Finalize(None, _end_all, exitpriority=MP_EXIT_PRIORITY)
    _finalizer_pid = os.getpid()


def stats(life: Lifecycle) -> dict[str, Any]:
    """Who is slow, measured on every call (always on; see README).

    ``ops``: per operation, ``calls``, ``bytes_sent`` and ``bytes_received`` (this rank's contributions and
    results), and the time from each call to its result being taken in (``wait_median_s``, ``wait_p90_s``,
    over the last 1024 calls). On rank 0 also ``ranks``: per rank, how long after the first contribution of
    a call its own arrived (``late_median_s``, ``late_p90_s``) and the share of calls it was last to arrive
    at (``last_share``). Works after teardown too.
    """
    config = life.config
    out: dict[str, Any] = {"rank": config.rank, "size": config.num_replicas,
                           "ops": life.member.stats.summary()}
    coordinator = life.coordinator()
    if coordinator is not None:
        out["ranks"] = coordinator.lateness.summary()
    return out

def status(life: Lifecycle) -> dict[str, Any]:
    """What this group is doing now, from any thread, without waiting for it (say, from a watchdog thread
    while another is blocked in a call).

    ``calls``: this rank's calls in flight (``seq``, ``op``, ``callsite``, ``waiting_s``). On rank 0 also
    ``ranks``: per rank, its ``last_call`` (``seq``, ``op``, ``callsite``, ``ago_s``) and the calls that
    wait for it (``waited_for``: ``seq``, ``op``, ``waiting_s``). ``state``: ``"running"``, ``"failed"``
    (``error`` says why), ``"forming"`` (closed by shrink() or grow() for the next group, which has not
    formed here yet) or ``"closed"``.
    """
    now = time.perf_counter()
    member = life.member
    calls = [{"seq": seq, "op": call.op, "callsite": call.callsite,
              "waiting_s": round(now - call.started, 3)}
             for seq, call in sorted(list(member.calls.items())) if call.future is not None]
    failure = member.failure
    out: dict[str, Any] = {
        "rank": life.config.rank, "size": life.config.num_replicas, "calls": calls,
        "state": ("forming" if life.reforming is not None else "closed") if life.closed else (
            "failed" if failure is not None else "running")}
    if failure is not None:
        out["error"] = f"{type(failure).__name__}: {failure}"
    coordinator = life.coordinator()
    if coordinator is not None:
        out["ranks"] = coordinator.snapshot(time.monotonic())
    return out
