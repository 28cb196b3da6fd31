"""A group of replicas as an object: the operations, over one replica end and,
on rank 0, the coordinator. The module-level API in ``__init__`` is a
default instance of this class."""

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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union

import zmq

from . import _elastic
from ._format._wire import DEFAULT_MAX_FRAMES, Signer, error_note
from ._forming import Form, Overslept, Unreachable
from ._future import CollectiveFuture, sleeping
from ._io import _interrupts, _sockets, _stops
from ._io._announce import announce_coordinator, announce_group, write_for_launcher
from ._io._dataplane import DataPlane
from ._io._link import DirectLink, Driver, HostLink
from ._io._replica import Replica
from ._io._server import Server
from ._io._turns import Turns
from ._limits import (
    CLOSE_LINGER_MS,
    DEFAULT_INIT_TIMEOUT_S,
    EXIT_LINGER_MS,
    HOST_WINDOW_S,
    STATUS_WAIT_S,
)
from ._protocol import _ring
from ._protocol._coordinator import Coordinator
from ._protocol._member import Member
from ._protocol._ops import BY_NAME, LABELS, Here, Op, Part, Refused, error_part
from ._protocol._stats import calls_log
from .config import Config, resolve, takes_settings
from .errors import (
    AddressError,
    CollectiveError,
    CollectiveTimeoutError,
    ForkedProcessError,
    LateJoinError,
    ReplicaLostError,
    from_signal,
)

if TYPE_CHECKING:
    from ._elastic import Agreement

log = logging.getLogger("zcollective")

T = TypeVar("T")
Timeout = Union[float, None, "_Default"]
ReduceFn = Callable[[Any, Any], Any]

JOIN_FAILURE_GRACE_S = 2.0  # rank 0 keeps answering this long after a failed join
COORDINATOR_IO_THREADS = 2  # rank 0 talks to every replica: a second libzmq I/O thread cut
# 16 MiB allreduce at N=4 from 72 to 45 ms (medians of 5, benchmarks/README.md); others have 1 link
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_open_groups: dict[int, Group] = {}  # id -> group: ended (delivered, then closed) at exit


class _Default:
    def __repr__(self) -> str:
        return "<the group's op_timeout>"


DEFAULT = _Default()  # "use the group's op_timeout"


def default_reduce_fn(a: Any, b: Any) -> Any:
    """``a += b; return a``, as in adaptdl: sums numbers, numpy arrays and
    Counters, concatenates lists."""
    a += b
    return a


_ring.register_default(default_reduce_fn)


_process = os.getpid()  # this process's id, renewed in a forked child: no system call per call


def _forked() -> None:
    global _process
    _process = os.getpid()


if hasattr(os, "register_at_fork"):  # (no fork without it)
    os.register_at_fork(after_in_child=_forked)

_ours: dict[str, bool] = {}  # file name -> is it this package's
_basenames: dict[str, str] = {}


def _callsite() -> str:
    """``file.py:line`` of the user's code that called into the library.
    On every call (mismatch reports need it), so it caches per file."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        ours = _ours.get(filename)
        if ours is None:
            ours = _ours[filename] = filename.startswith(_PACKAGE_DIR)
            _basenames[filename] = os.path.basename(filename)
        if not ours:
            return f"{_basenames[filename]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class Group:
    """A group of ``size`` replicas; this process is replica ``rank``.

    Creating it joins the group: it blocks until every replica has created
    its own (or ``timeout`` passes). Use it as a context manager to tear it
    down on exit. Every argument left ``None`` comes from the environment (see
    :func:`zcollective.initialize`).

    Raises
    ------
    ValueError
        A configuration value is malformed or out of range, or the replicas
        disagree on ``size``, or a rank is claimed twice.
    CollectiveTimeoutError
        Not every replica joined within ``timeout``.
    ProtocolError
        A replica runs another Python or zcollective protocol version.
    AuthenticationError
        This replica and rank 0 do not share the same secret.
    AddressError
        Rank 0 cannot bind the master address (port taken, not its host's).
    LateJoinError
        The group was already running when this replica tried to join.
    JobMismatchError
        The group at the master address is another job's (a :class:`LateJoinError`).
    """

    @takes_settings(replica_rank="rank", num_replicas="size")
    def __init__(
        self,
        master_addr: Optional[str] = None,
        master_port: Optional[int] = None,
        rank: Optional[int] = None,
        size: Optional[int] = None,
        *,
        timeout: Optional[float] = DEFAULT_INIT_TIMEOUT_S,
        op_timeout: Optional[float] = None,
        warn_after: Optional[float] = None,
        liveness_timeout: Optional[float] = None,
        max_frame_bytes: Optional[int] = None,
        secret: Union[bytes, str, None] = None,
        bind_addr: Optional[str] = None,
        join: Optional[bool] = None,
        job: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> None:
        """Join the group; raises as the class docstring says. Each argument
        left ``None`` is read from the environment, else takes its default;
        error messages call ``rank`` and ``size`` by their names in
        :func:`zcollective.initialize`, ``replica_rank`` and ``num_replicas``."""
        config = resolve(
            master_addr, master_port, rank, size, timeout=timeout, op_timeout=op_timeout,
            warn_after=warn_after, liveness_timeout=liveness_timeout, max_frame_bytes=max_frame_bytes,
            secret=secret, bind_addr=bind_addr, join=join, job=job, env=env,
        )
        if config.join:  # a newcomer: admitted by a grow(), it forms the next group with the members

            try:
                self._open(*self._admission(config))
            except Unreachable as exc:
                raise LateJoinError(f"newcomer: admitted, but the group's coordinator was lost "
                                    f"while it formed again ({exc}); start it again at "
                                    f"coordinator_address() of a member") from None
        else:
            self._open(config)

    @classmethod
    def _admission(cls, config: Config) -> tuple[Config, Form]:
        """A newcomer (``config.join``) waits at the group's address until a
        grow() admits it (rule 10); returns how it joins the group formed next."""
        waiting = cls.__new__(cls)
        waiting._open(config)  # returns once admitted, closed
        admitted = waiting._member.admitted
        assert admitted is not None
        return (dataclasses.replace(config, rank=admitted["rank"], num_replicas=admitted["size"],
                                    join=False), Form(admitted["lineage"]))

    @classmethod
    def _formed(cls, config: Config, form: Form) -> Group:
        """A group formed from an earlier one (see :mod:`zcollective._elastic`):
        ``config`` names this replica by its old rank and size, and the host."""
        group = cls.__new__(cls)
        group._open(config, form)
        return group

    def _open(self, config: Config, form: Optional[Form] = None) -> None:
        """Join the group ``config`` describes (or form one: ``form``)."""
        self.config = config
        self._turns = Turns()  # which of the program's threads uses the sockets now
        self._pid = os.getpid()  # a forked child must never touch this process's sockets
        self._closed = False
        self._reforming: Optional[str] = None  # closed by shrink() or grow() to form the next group
        self._watching = False  # this group counts in _stops' watch
        self._ctx: Optional[zmq.Context] = None
        self._server: Optional[Server] = None
        self._data: Optional[DataPlane] = None
        signer = Signer(config.secret) if config.secret is not None else None
        self._member = Member(config.rank, config.num_replicas, config.endpoint, signer,
                              config.max_frame_bytes)
        self._member.job = config.job
        if form is not None:
            self._member.lineage = form.lineage
        self._member.newcomer = config.join
        if config.log == "calls":
            self._member.log_calls = True
            _show_calls_log()
        self._link: Optional[Driver] = None
        self._here = Here(config.rank, config.num_replicas)
        _open_groups[id(self)] = self
        _register_atexit()
        _interrupts.hold_signals()  # no signal handler's exception splits a message
        if config.stacks:
            _interrupts.stacks_on_request()  # where this rank is, when a stall names it
        _stops.watch()  # was this process stopped? (a loss learned after a stop: see _elastic)
        self._watching = True
        try:
            self._link = self._connect(signer, form)
            self._link.warn_after = config.warn_after
            self._link.nudge = (self._turns.nudge.fd, zmq.POLLIN)
            deadline = None if config.init_timeout is None else time.monotonic() + config.init_timeout
            if config.join:
                self._await_admission()
                self._close(quick=True)
                return
            if form is None:
                self._link.join(config.init_timeout)
            else:
                self._join_forming(form)
            self._start_data(deadline)
            self._here = Here(self.rank, self.size, self._data is not None, self._member.data_min_bytes,
                               self.config.max_frame_bytes)
            announce_group(self.rank, self.size, self._member.session, self._member.lineage,
                           _interrupts.stacks_on())
            if self.config.rank == 0:
                announce_coordinator(self.coordinator_address())
        except BaseException as exc:
            refused = isinstance(exc, (CollectiveError, ValueError)) and not isinstance(
                exc, CollectiveTimeoutError)  # not an interrupt, nor a bug of ours
            if self._server is not None and self._server.gone() is None and refused and form is None:
                # replicas still starting up should hear why, not time out (when it serves:
                # a coordinator that could not bind has nobody to tell; forming, the survivors
                # are told by their own tries, and this one has others to try at once)
                _interrupts.sleep(JOIN_FAILURE_GRACE_S)
            self._close()
            raise

    def _connect(self, signer: Optional[Signer], form: Optional[Form] = None) -> Driver:
        """The member's link: one replica calls the coordinator directly;
        rank 0 of more serves it (in its own thread while in the library);
        the others reach it through a DEALER. Forming a group, its host
        serves it."""
        config, member = self.config, self._member
        alone = config.num_replicas == 1 and form is None and not config.join
        if alone and not config.port_given:  # a script run as it is: no port of its own
            return self._direct(signer)
        with _sockets.mapped(f"rank {config.rank} cannot start ZeroMQ"):
            self._ctx = zmq.Context(io_threads=COORDINATOR_IO_THREADS if config.rank == 0 else 1)
        if (config.rank == 0 and not config.join) if form is None else form.forming is not None:
            self._server = Server(self._ctx, config, form.forming if form is not None else None, self._turns)
            try:
                self._server.start()
            except AddressError as exc:
                if not alone:
                    raise
                # a group of one given a port serves it, so newcomers can come; taken (a
                # MASTER_PORT left in the environment, say), it runs alone all the same
                log.warning("zcollective: a group of one could not listen for newcomers (%s); "
                            "it runs alone, and grow() admits nobody", exc)
                self._server = None
                self._ctx.term()
                _sockets.forget(self._ctx)
                self._ctx = None
                return self._direct(signer)
            link: Driver = HostLink(member, self._server)
        else:
            link = Replica(self._ctx, config, member)
            link.sleepers = sleeping
        if config.join:  # (a newcomer waiting: no data plane until it is a member)
            return link
        if config.data_plane == "on" or (config.data_plane == "auto" and not _on_loopback(config)):
            # bound before the JOIN, which announces it (a master on loopback: one host, no use)
            gate = self._server.gatekeeper if self._server is not None else None
            self._data = DataPlane(self._ctx, config, gate)
            member.data_endpoint, member.data_min_bytes = self._data.endpoint, config.data_plane_min_bytes
            member.data_mode = config.data_plane
        return link

    def _direct(self, signer: Optional[Signer]) -> Driver:
        """A group of one: its member calls the coordinator in-process, no socket."""
        session = int.from_bytes(os.urandom(8), "little") | 1
        return DirectLink(self._member, Coordinator(1, session, DEFAULT_MAX_FRAMES, signer,
                                                    user_code=_interrupts.user_code, job=self.config.job))

    def _await_admission(self) -> None:
        """A newcomer: wait until a grow() of the group admits it (rule 10 of
        the coordinator); :attr:`Member.admitted` then says where it goes."""
        link, member, config = self._link, self._member, self.config
        assert link is not None
        member.newcomer = True
        deadline = None if config.init_timeout is None else time.monotonic() + config.init_timeout
        if not link.send_join(lambda: member.admitted is not None, deadline):  # (parked anew each time)
            raise CollectiveTimeoutError(
                f"a newcomer was not admitted to the group at {config.endpoint} within "
                f"{config.init_timeout:g} s: its members admit newcomers when they call grow()"
                + ("" if member.greeted or member.connected else "; the coordinator could not be "
                   "reached there (is the address right? after rank 0's loss, "
                   "coordinator_address() on a member says where the group is)"))

    def _join_forming(self, form: Form) -> None:
        """Join a group formed from an earlier one (rule 9 of the
        coordinator): the host waits :attr:`Form.wait_s` for the members it
        expects, then starts with those who came; a member gives up on a
        host it cannot reach within :attr:`Form.reach_s` (:class:`Unreachable`).
        Then this replica has the rank and size the WELCOME gave."""
        link, member, server = self._link, self._member, self._server
        assert link is not None
        link.send([member.join()])
        who = f"old rank {self.config.rank}"
        if server is not None:
            waited = time.monotonic()
            link.wait_for(lambda: member.joined, waited + form.wait_s)
            if not member.joined:
                if time.monotonic() - waited > form.wait_s + HOST_WINDOW_S:  # stopped meanwhile
                    raise Overslept(f"{who} overslept the forming of a group at {self.config.endpoint}")
                server.form_now()
            if not link.wait_for(lambda: member.joined, time.monotonic() + STATUS_WAIT_S):
                raise CollectiveTimeoutError(f"{who} could not form a group at {self.config.endpoint}")
        else:
            self._reach_host(form, who)
        self.config = dataclasses.replace(self.config, rank=member.rank, num_replicas=member.size)
        if self._data is not None:
            self._data.rank, self._data.size = member.rank, member.size

    def _reach_host(self, form: Form, who: str) -> None:
        """A member forming a group: reach its would-be host within
        :attr:`Form.reach_s` (a port nobody listens on is :class:`Unreachable`
        with ``refused``: that process died), then wait for its WELCOME. A host
        whose earlier group is still open there (its program is elsewhere) has
        until ``reach_s`` to start forming; one that forms has the forming bound."""
        link, member, endpoint = self._link, self._member, self.config.endpoint
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
        """Joined: use the data plane if every rank has one, else let it go."""
        data, member, link = self._data, self._member, self._link
        if data is None or link is None:
            return
        if member.data_endpoints is None:
            self._data = None
            data.close()
            return
        data.start(member.session, member.data_endpoints, member.mac, member.data_key, deadline,
                   link.progress)
        member.check()  # the group failed while the links were made
        link.data = data

    # -- properties ---------------------------------------------------------

    @property
    def rank(self) -> int:
        """This replica's rank, from 0 to ``size - 1``."""
        return self.config.rank

    @property
    def size(self) -> int:
        """The number of replicas in the group."""
        return self.config.num_replicas

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, Any]:
        """Who is slow, measured on every call (always on; see README).

        ``ops``: per operation, ``calls``, ``bytes_sent`` and
        ``bytes_received`` (this rank's contributions and results), and the
        time from each call to its result being taken in (``wait_median_s``,
        ``wait_p90_s``, over the last 1024 calls). On rank 0 also ``ranks``:
        per rank, how long after the first contribution of a call its own
        arrived (``late_median_s``, ``late_p90_s``) and the share of calls it
        was last to arrive at (``last_share``). Works after teardown too.
        """
        out: dict[str, Any] = {"rank": self.rank, "size": self.size, "ops": self._member.stats.summary()}
        coordinator = self._coordinator()
        if coordinator is not None:
            out["ranks"] = coordinator.lateness.summary()
        return out

    def status(self) -> dict[str, Any]:
        """What this group is doing now, from any thread, without waiting for
        it (say, from a watchdog thread while another is blocked in a call).

        ``calls``: this rank's calls in flight (``seq``, ``op``, ``callsite``,
        ``waiting_s``). On rank 0 also ``ranks``: per rank, its ``last_call``
        (``seq``, ``op``, ``callsite``, ``ago_s``) and the calls that wait for
        it (``waited_for``: ``seq``, ``op``, ``waiting_s``). ``state``:
        ``"running"``, ``"failed"`` (``error`` says why), ``"forming"``
        (closed by shrink() or grow() for the next group, which has not
        formed here yet) or ``"closed"``.
        """
        now = time.perf_counter()
        member = self._member
        calls = [{"seq": seq, "op": call.op, "callsite": call.callsite,
                  "waiting_s": round(now - call.started, 3)}
                 for seq, call in sorted(list(member.calls.items())) if call.future is not None]
        failure = member.failure
        out: dict[str, Any] = {
            "rank": self.rank, "size": self.size, "calls": calls,
            "state": ("forming" if self._reforming is not None else "closed") if self._closed else (
                "failed" if failure is not None else "running")}
        if failure is not None:
            out["error"] = f"{type(failure).__name__}: {failure}"
        coordinator = self._coordinator()
        if coordinator is not None:
            out["ranks"] = coordinator.snapshot(time.monotonic())
        return out

    def _coordinator(self) -> Optional[Coordinator]:
        if self._server is not None:
            return self._server.coordinator
        return self._link.coordinator if isinstance(self._link, DirectLink) else None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<zcollective.Group rank={self.rank} size={self.size} {self.config.endpoint} {state}>"

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.teardown()

    # -- operations ---------------------------------------------------------

    def allreduce(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn, *,
                  timeout: Timeout = DEFAULT) -> Any:
        """Reduce every replica's ``value`` in rank order,
        ``fn(fn(fn(v0, v1), v2), v3)``, with rank 0's ``reduce_fn``; every
        replica gets the result. See :func:`zcollective.allreduce`."""
        return self._blocking(self._call("allreduce", value, reduce_fn), timeout)

    def allreduce_async(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn
                        ) -> CollectiveFuture[Any]:
        """Like :meth:`allreduce`, without blocking; returns a future."""
        return self._call("allreduce", value, reduce_fn)

    def reduce(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn, root: int = 0, *,
               timeout: Timeout = DEFAULT) -> Any:
        """Like :meth:`allreduce`, but only ``root`` gets the result (with
        ``root``'s ``reduce_fn``); the others get ``None``."""
        return self._blocking(self._call("reduce", value, reduce_fn, root), timeout)

    def reduce_async(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn,
                     root: int = 0) -> CollectiveFuture[Any]:
        """Like :meth:`reduce`, without blocking; returns a future
        (see :func:`zcollective.reduce_async`)."""
        return self._call("reduce", value, reduce_fn, root)

    def reduce_scatter(self, values: Sequence[Any], reduce_fn: ReduceFn = default_reduce_fn, *,
                       timeout: Timeout = DEFAULT) -> Any:
        """Each replica passes one value per replica; replica i gets every
        replica's ``values[i]`` reduced in rank order with rank 0's
        ``reduce_fn``. See :func:`zcollective.reduce_scatter`."""
        return self._blocking(self._call("reduce_scatter", values, reduce_fn), timeout)

    def reduce_scatter_async(self, values: Sequence[Any], reduce_fn: ReduceFn = default_reduce_fn
                             ) -> CollectiveFuture[Any]:
        """Like :meth:`reduce_scatter`, without blocking; returns a future."""
        return self._call("reduce_scatter", values, reduce_fn)

    def broadcast(self, value: Any, root: int = 0, *, timeout: Timeout = DEFAULT) -> Any:
        """Every replica gets ``root``'s ``value``; other values are ignored.
        ``root`` gets back its own object, the others an unpickled copy."""
        return self._blocking(self._call("broadcast", value, root), timeout)

    def broadcast_async(self, value: Any, root: int = 0) -> CollectiveFuture[Any]:
        """Like :meth:`broadcast`, without blocking; returns a future
        (see :func:`zcollective.broadcast_async`)."""
        return self._call("broadcast", value, root)

    def allgather(self, value: Any, *, timeout: Timeout = DEFAULT) -> list[Any]:
        """Every replica gets the list of all replicas' values, in rank order."""
        return self._blocking(self._call("allgather", value), timeout)  # type: ignore[no-any-return]

    def allgather_async(self, value: Any) -> CollectiveFuture[list[Any]]:
        """Like :meth:`allgather`, without blocking; returns a future
        (see :func:`zcollective.allgather_async`)."""
        return self._call("allgather", value)

    def gather(self, value: Any, root: int = 0, *, timeout: Timeout = DEFAULT) -> Optional[list[Any]]:
        """``root`` gets the list of all replicas' values in rank order; the
        others get ``None``. Values travel only to ``root``."""
        return self._blocking(self._call("gather", value, root), timeout)  # type: ignore[no-any-return]

    def gather_async(self, value: Any, root: int = 0) -> CollectiveFuture[Optional[list[Any]]]:
        """Like :meth:`gather`, without blocking; returns a future
        (see :func:`zcollective.gather_async`)."""
        return self._call("gather", value, root)

    def scatter(self, values: Optional[Sequence[Any]], root: int = 0, *,
                timeout: Timeout = DEFAULT) -> Any:
        """Replica i gets ``values[i]`` of ``root`` (``values`` is ignored
        elsewhere). A ``values`` of the wrong length raises ``ValueError`` on
        ``root`` and :class:`PeerError` on the others."""
        return self._blocking(self._call("scatter", values, root), timeout)

    def scatter_async(self, values: Optional[Sequence[Any]], root: int = 0) -> CollectiveFuture[Any]:
        """Like :meth:`scatter`, without blocking; returns a future
        (see :func:`zcollective.scatter_async`)."""
        return self._call("scatter", values, root)

    def alltoall(self, values: Sequence[Any], *, timeout: Timeout = DEFAULT) -> list[Any]:
        """Replica i gets ``[values_j[i] for j in ranks]``: each replica
        passes one value per replica."""
        return self._blocking(self._call("alltoall", values), timeout)  # type: ignore[no-any-return]

    def alltoall_async(self, values: Sequence[Any]) -> CollectiveFuture[list[Any]]:
        """Like :meth:`alltoall`, without blocking; returns a future
        (see :func:`zcollective.alltoall_async`)."""
        return self._call("alltoall", values)

    def barrier(self, *, timeout: Timeout = DEFAULT) -> None:
        """Return once every replica has called ``barrier``."""
        self._blocking(self.barrier_async(), timeout)

    def barrier_async(self) -> CollectiveFuture[None]:
        """Like :meth:`barrier`, without blocking; returns a future
        (see :func:`zcollective.barrier_async`)."""
        return self._call("barrier")

    def teardown(self, *, timeout: Timeout = DEFAULT) -> None:
        """Wait until every replica calls ``teardown``, then close the
        sockets. A failed group closes at once. Calling it twice is harmless.

        Raises
        ------
        CollectiveTimeoutError
            Not every replica called ``teardown`` within ``timeout``; the
            group is closed all the same.
        """
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child: the sockets are the parent's
            self._closed = True
            return
        with self._turns:
            self._teardown(timeout)

    def _teardown(self, timeout: Timeout) -> None:
        """:meth:`teardown`, holding the turn."""
        if self._closed:
            return  # (by another thread, meanwhile)
        try:
            failure: Optional[BaseException] = self._member.failure
            if self._link is not None and failure is None:
                future = self._call("teardown")
                try:
                    self._blocking(future, timeout)
                except CollectiveTimeoutError:
                    raise
                except Exception as exc:  # a failed group closes anyway
                    failure = exc
            if failure is not None:  # cleanup, often in a `finally`: said, never raised over
                log.warning("zcollective rank %d: teardown closed a group that was already over: %s",
                            self.rank, failure)  # the exception in flight
        finally:
            self._close()

    # -- elastic groups ---------------------------------------------------------

    def shrink(self, timeout: Optional[float] = None, *, majority: bool = True) -> Group:
        """After a loss, the survivors' new group, in the same processes: call
        it on every survivor (the rules: README, "Elastic groups"). This group
        is closed; the new one ranks the survivors densely in old-rank order
        (:attr:`old_ranks`, :attr:`lost_ranks` say how). If rank 0 was lost,
        the lowest surviving rank ``r`` hosts the coordinator, on its own host
        at the master port + ``r``. The survivors form a group only if they are
        more than half of the ranks not seen to die (a partition never leaves
        two groups going on); ``majority=False`` (on every survivor) forms one
        with whoever came. In a group that lost nobody it is a collective call:
        it returns this group once every rank has called it.

        Raises
        ------
        LeftOutError
            The others formed their group without this replica (it came too
            late, or they had counted it lost).
        CollectiveTimeoutError
            No group could be formed within ``timeout``.
        CallMismatchError
            Called in a group that had lost nobody, while another rank made
            another call: a healthy group shrinks only when every rank calls it.
        CollectiveError
            The group had failed for another reason than a loss (a mismatch,
            ...): that error, as every later call of it raises.
        """
        self._check_process()
        if self._closed and self._reforming is None:
            raise RuntimeError("this zcollective group was torn down: there is nothing to shrink")
        if not self._closed and self._member.failure is None:  # nothing lost that this rank knows of:
            try:  # a collective call of every member (one calling it alone is a mismatch)
                self._blocking(self._call("shrink"),
                               DEFAULT if timeout is None else timeout)
                return self  # every member called it, and nobody was lost
            except ReplicaLostError:
                pass  # lost meanwhile: shrink as after any loss
        return _elastic.shrink(self, timeout, majority)

    def grow(self, timeout: Timeout = DEFAULT) -> Group:
        """Admit every newcomer waiting (started with ``join=True`` at this
        group's coordinator address): a collective call of every member. With
        nobody waiting, returns this group at once, unchanged; otherwise this
        group closes, and its members and the newcomers form the next one at
        the same address, the members keeping their ranks, the newcomers
        numbered after them (:attr:`admitted` says how many joined). No call
        ever mixes the two memberships. A member lost while the group forms
        again: the others shrink instead (the newcomers are told to start
        again), and ``admitted`` is 0.

        Raises
        ------
        CollectiveError
            As for any collective call (the group goes on, unchanged).
        """
        count = self._blocking(self._call("grow"), timeout)
        if not count:
            return self
        grown = _elastic.regroup(self, count)
        old = grown.old_ranks or []  # newcomers were numbered from this group's size on
        grown.admitted = sum(r >= self.size for r in old)  # those in the group formed
        return grown

    def coordinator_address(self) -> str:
        """``host:port`` of this group's coordinator: where newcomers go (it
        moves when rank 0 is lost and the survivors shrink)."""
        host = self.config.master_addr
        return f"[{host}]:{self.config.master_port}" if ":" in host else f"{host}:{self.config.master_port}"

    def agree(self, flag: bool, timeout: Optional[float] = None) -> tuple[Group, Agreement]:
        """ULFM's agree: every living member gets the same AND of the
        members' ``flag`` and the same set of ranks found lost (of this
        group). In a failed group (or one failing meanwhile) the survivors
        shrink first: returns the group they agreed in (this one if nothing
        was lost) and the :class:`~zcollective.Agreement`.

        Raises
        ------
        LeftOutError
            The others went on without this replica (see :meth:`shrink`).
        CollectiveError
            The group failed for another reason than a loss.
        """
        return _elastic.agree(self, flag, timeout)

    admitted = 0  # a group grow() formed: how many newcomers that grow admitted

    @property
    def old_ranks(self) -> Optional[list[int]]:
        """A group formed by :meth:`shrink`: every rank's rank in the group
        before (by new rank); None otherwise."""
        return self._member.old_ranks

    @property
    def lost_ranks(self) -> list[int]:
        """A group formed by :meth:`shrink`: the ranks of the group before
        that are not in this one."""
        old = self._member.old_ranks
        return [] if old is None else sorted(set(range(self._member.old_size)) - set(old))

    def _close_to_form(self, quick: bool) -> None:
        """Close, holding the turn, for the next group to form: ``quick``, the
        group failed, so nothing queued is worth waiting for; else (a grow)
        rank 0's last results and admissions leave first."""
        with self._turns:
            self._reforming = self._reforming or ("shrink()" if quick else "grow()")
            if not self._closed:
                self._member.forget_calls(lambda call, seq: self._member.failure or RuntimeError(
                    f"seq {seq} {call.op}: the group was formed again before the call finished"))
                self._close(quick=quick)

    # -- machinery ------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> CollectiveFuture[Any]:
        """This replica's part of the next call of operation ``name``
        (:mod:`zcollective._protocol._ops` makes it from ``args``).

        An error while building it (a value that cannot be pickled) leaves
        the seq unused: the call never happened here. An interrupt (a signal
        handler's exception) while building still sends a part, an error note,
        so every replica's call at that seq ends in an error and the next call
        pairs correctly. A part the operation refuses (a wrong number of
        values) is told to the others, and raises ``ValueError`` here.
        """
        site = _callsite()
        if self._closed or _process != self._pid:
            self._check_usable()  # raises, saying which
        operation = BY_NAME[name]
        try:
            part = operation.part(self._here, *args)
        except Refused as exc:
            if self._member.failure is None and not self._closed:
                self._submit(operation.code, error_part(exc.root, error_note(str(exc))), site)
            raise ValueError(f"rank {self.rank}: {exc}") from None
        return self._submit(operation.code, part, site)

    def _submit(self, op: Op, part: Part, site: str) -> CollectiveFuture[Any]:
        """:meth:`_call`'s part sent, holding the turn."""
        with self._turns:
            if self._closed:  # torn down by another thread meanwhile
                self._check_usable()
            server = self._server
            if server is not None and server.reducing_here():
                # a call here would take the next seq while every rank waits for this reduction,
                # so the group would fail for good
                raise RuntimeError(f"rank {self.rank}: a reduce function may not call zcollective "
                                   f"collectives (it runs inside the coordinator, on rank 0)")
            member, link = self._member, self._link
            assert link is not None
            try:
                seq = member.reserve(op, part.root, site)
                segments, fn = part.build()
                future: CollectiveFuture[Any] = CollectiveFuture(self, seq, LABELS[op])
                member.submit(op, part.root, segments, fn, site, part.flags, future, part.finish,
                              part.data_job)
            except Exception:
                member.unreserve()
                raise
            except BaseException as exc:
                member.abandon(f"rank {self.rank} was interrupted ({type(exc).__name__}) before its "
                               f"part was sent")
                with contextlib.suppress(CollectiveError):
                    link.flush()  # the others hear of it now, not at this replica's next call
                raise
            link.flush()
            return future

    def _blocking(self, future: CollectiveFuture[T], timeout: Timeout) -> T:
        """``future.result(timeout)`` for a call this thread has just made
        (so :meth:`_submit` has checked the process)."""
        if isinstance(timeout, _Default):
            timeout = self.config.op_timeout
        if not future._done:
            try:
                self._wait(future, timeout, checked=True)
            except BaseException as exc:  # given up here: it fails on every rank alike
                timed_out = isinstance(exc, CollectiveTimeoutError)
                if (timed_out or from_signal(exc)) and self._link is not None and not self._closed:
                    got = self._give_up(future, exc, timed_out)
                    if got:
                        return future._value  # type: ignore[no-any-return]
                raise
        if future._error is not None:
            raise future._error
        return future._value  # type: ignore[no-any-return]

    def _give_up(self, future: CollectiveFuture[Any], exc: BaseException, timed_out: bool) -> bool:
        """This rank gave up waiting for ``future`` (``exc``): tell the
        coordinator, which fails the call on every rank. True if the call had
        completed before it heard (a timeout waits for the verdict; an
        interrupt does not)."""
        link, turns = self._link, self._turns
        assert link is not None
        if not turns.take(time.monotonic() + STATUS_WAIT_S):  # (the holder is in a long step)
            return False
        try:
            with contextlib.suppress(CollectiveError):  # (a broken link: the group failed)
                gave_up = self._member.give_up(future.seq, exc, timed_out)
                link.send(gave_up)
                if gave_up and timed_out:  # the coordinator's verdict: an ERROR (failed on every
                    # rank), or the result, when the call completed before it heard
                    turns.wait(lambda: future._done, time.monotonic() + STATUS_WAIT_S, self._drive,
                               _never)
            return future._done and future._error is None
        finally:
            turns.give()

    def _check_usable(self) -> None:
        if self._closed and self._reforming is not None:
            then = ("the grown group formed without it: call shrink() to be told so (LeftOutError), "
                    "and start this process again as a newcomer" if self._reforming == "grow()" else
                    "call shrink() again to join the survivors' group (it raises LeftOutError if they "
                    "went on without this replica)")
            raise RuntimeError(
                f"old rank {self.rank}: this zcollective group was closed for {self._reforming} to "
                f"form the next one, which did not finish here (interrupted, or it raised): {then}")
        if self._closed:
            raise RuntimeError("this zcollective group was torn down; call initialize() "
                               "(or create a new Group) first")
        self._check_process()

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"this zcollective group belongs to process {self._pid}, the parent of this forked "
                f"process {os.getpid()}; a child cannot use its parent's group: call "
                f"zcollective.initialize() (or create a Group) in the child for a group of its own")

    # -- driver interface for futures -----------------------------------------

    def _wait(self, future: CollectiveFuture[Any], timeout: Optional[float], checked: bool = False) -> None:
        link = self._link
        if link is None or self._closed:
            return
        if not checked:
            self._check_process()
        deadline = None if timeout is None else time.monotonic() + timeout
        turns = self._turns
        warn = self.config.warn_after
        if warn is not None and self.rank != 0 and (deadline is None or time.monotonic() + warn < deadline):
            if self._wait_until(future, time.monotonic() + warn):  # rank 0 warns in its coordinator
                return
            said = self._say_stalled(future)
            if self._wait_until(future, deadline):
                if said:
                    log.warning("zcollective rank %d: seq %d %s completed after %.0f s", self.rank,
                                future.seq, future.op, time.monotonic() - said)
                return
        elif self._wait_until(future, deadline):
            return
        if not turns.take(time.monotonic() + STATUS_WAIT_S):  # the holder is in a long step
            raise CollectiveTimeoutError(self._member.timeout_message(future.seq, timeout, None, link.busy()))
        try:
            message = link.timeout_message(future.seq, timeout)
            if future._done:
                return  # it arrived while the coordinator was asked
            self._member.check()  # the group failed meanwhile (say, rank 0 ended): that is the answer
            raise CollectiveTimeoutError(message)
        finally:
            turns.give()

    def _wait_until(self, future: CollectiveFuture[Any], deadline: Optional[float]) -> bool:
        """Wait (leading or following) until ``future`` is done (True) or ``deadline``."""
        return self._turns.wait(lambda: future._done, deadline, self._drive,
                                lambda wake: future.add_done_callback(lambda _: wake()))

    def _say_stalled(self, future: CollectiveFuture[Any]) -> Optional[float]:
        """A call waited ``warn_after``: ask the coordinator whom for, and say
        so once (rule 11 of the coordinator). When it was said, or None."""
        link, turns = self._link, self._turns
        if link is None or future._done or not turns.take(time.monotonic() + STATUS_WAIT_S):
            return None
        try:
            with contextlib.suppress(CollectiveError):
                status = link.ask_status(future.seq)
                line = (status or {}).get("stall")
                if isinstance(line, str) and not future._done:
                    log.warning("zcollective rank %d: %s", self.rank, line[:2000])
                    return time.monotonic()
            return None
        finally:
            turns.give()

    def _drive(self, until: Callable[[], bool], deadline: Optional[float], nudged: bool) -> bool:
        """The leading thread's wait (see :mod:`zcollective._io._turns`):
        ``nudged``, another thread wanting the turn ends it too."""
        link = self._link
        if link is None or self._closed:
            return True  # (closed meanwhile: every call was failed)
        link.nudged = nudged
        try:
            return link.wait_for(until, deadline)
        finally:
            link.nudged = False

    def _progress(self) -> None:
        if self._link is not None and not self._closed:
            self._check_process()
            turns = self._turns
            if not turns.try_take():
                return  # another thread is at work in the library: it takes in what arrives
            try:
                if not self._closed:
                    self._link.progress()
            finally:
                turns.give()

    def _fds(self) -> list[int]:
        if self._link is None or self._closed:
            return []
        self._check_process()
        data = self._link.data
        return self._link.fds() + (data.fds() if data is not None else [])

    def _close(self, ending: bool = False, hurry: bool = False, quick: bool = False) -> None:
        """Close the sockets. ``ending``: the program is ending without
        teardown: rank 0 first serves until its calls are delivered, and what
        is queued gets :data:`~zcollective._limits.EXIT_LINGER_MS` to leave.
        ``hurry``: it was interrupted while ending: rank 0 tells the others
        the group is over and waits for nothing. ``quick``: nothing queued
        is worth waiting for (a failed group shrinks)."""
        self._closed = True
        _open_groups.pop(id(self), None)
        if self.rank == 0 and not self.config.join:  # (a newcomer waiting has no stats to say)
            write_for_launcher(self.stats(), self._member.session)
        self._member.forget_calls(lambda call, seq: RuntimeError(
            f"seq {seq} {call.op}: the group was torn down before the call finished"))
        try:
            if self._server is not None:
                self._server.stop(ending, hurry, 0 if quick else CLOSE_LINGER_MS)
        finally:  # an interrupt while rank 0 waits for the others still closes everything
            try:
                stuck = self._server is not None and self._server.gone() is None
                if self._data is not None:  # (ending: the next rank said it has its chunks, see
                    # rule 7 of the coordinator; or the wait for it ran out)
                    self._data.close(EXIT_LINGER_MS if ending else 0)
                if self._link is not None:
                    self._link.close(EXIT_LINGER_MS if ending else 0)
                if self._ctx is not None and not stuck:
                    # after term() libzmq holds no buffer of ours: the interpreter may free them
                    with _sockets.mapped(f"rank {self.rank} could not close ZeroMQ"):
                        self._ctx.term()
                    _sockets.forget(self._ctx)
            finally:  # only now: while rank 0 serves its ending (or stops), a signal surfaces at
                # a wait, never halfway through a message or before the sockets are closed
                self._turns.close()
                if self._watching:
                    self._watching = False
                    _stops.unwatch()
                if not _open_groups:
                    _interrupts.release_signals()

    def _end(self) -> None:
        """The program is ending without teardown (at exit): deliver what this
        process produced, bounded, then close. Rule 7 of the coordinator."""
        if self._closed or os.getpid() != self._pid:
            return
        turns = self._turns
        if not turns.take(time.monotonic() + STATUS_WAIT_S):
            return  # a thread left running (a daemon) is busy in a step: the sockets are its
        try:
            if not self._closed:
                self._end_turn()
        finally:
            turns.give()

    def _end_turn(self) -> None:
        """:meth:`_end`, holding the turn."""
        interrupted: Optional[BaseException] = None
        if self._link is not None:
            try:
                self._link.progress()  # take in a FAIL that would make a BYE pointless
                self._link.finish_data(EXIT_LINGER_MS / 1000)  # the others need our chunks
                self._link.say_bye(EXIT_LINGER_MS / 1000)
            except Exception:
                pass  # the group failed: nothing to announce, only to flush
            except BaseException as exc:  # an interrupt: the BYE still goes (flagged if data is
                # left), unwaited, so the others are told now; rank 0 then waits for nothing
                interrupted = exc
                bye = self._member.bye()
                with contextlib.suppress(BaseException):
                    if bye is not None:
                        self._link.send([bye])
        self._close(ending=True, hurry=interrupted is not None)
        if interrupted is not None:
            raise interrupted


def _on_loopback(config: Config) -> bool:
    """Is the master reached over loopback (so every replica is on its host)?"""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(
            config.master_addr, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def _show_calls_log() -> None:
    """``ZCOLLECTIVE_LOG=calls`` asks to see the lines: print them to stderr,
    unless the program has configured logging itself."""
    if not calls_log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        calls_log.addHandler(handler)
    if calls_log.getEffectiveLevel() > logging.INFO:
        calls_log.setLevel(logging.INFO)


def _end_all() -> None:
    for group in list(_open_groups.values()):
        try:
            group._end()
        except KeyboardInterrupt:
            log.warning("zcollective: interrupted while delivering the last results at exit; "
                        "the others were told the group is over")
        except BaseException:
            log.exception("zcollective: ending a group at exit failed")


_atexit_registered = False
_finalizer_pid: Optional[int] = None  # the process whose multiprocessing finalizers hold _end_all
MP_EXIT_PRIORITY = 100  # above multiprocessing's own finalizers (a queue's flush is 10): the
# group's last results leave before multiprocessing joins or terminates anything


def _register_atexit() -> None:
    """Have every open group end when the process does: through ``atexit``
    and, in a multiprocessing child, through multiprocessing's finalizers
    (a ``fork`` or ``forkserver`` child ends with ``os._exit`` after them,
    skipping ``atexit``; a ``spawn`` child runs both: ending twice is a no-op)."""
    global _atexit_registered, _finalizer_pid
    if not _atexit_registered:
        # pyzmq registers the shutdown of its zero-copy garbage collector when that module is
        # first imported, which may be at our first large send; import it now, so that ours,
        # registered later, runs first (atexit runs last-in, first-out)
        import zmq.utils.garbage  # noqa: F401

        atexit.register(_end_all)
        _atexit_registered = True
    multiprocessing = sys.modules.get("multiprocessing")  # a child has it imported; else no cost
    if multiprocessing is None or _finalizer_pid == os.getpid() or multiprocessing.parent_process() is None:
        return
    from multiprocessing import util  # a child's registry starts empty: register in each child

    util.Finalize(None, _end_all, exitpriority=MP_EXIT_PRIORITY)
    _finalizer_pid = os.getpid()


def _never(wake: Callable[[], None]) -> None:
    """(A wait that holds the turn never follows.)"""
