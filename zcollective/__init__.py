"""zcollective: collective operations on arbitrary Python objects over ZeroMQ.

A drop-in for ``adaptdl.collective``::

    import zcollective
    zcollective.initialize()            # reads ZCOLLECTIVE_* / ADAPTDL_* / torchrun variables
    total = zcollective.allreduce(1)    # == number of replicas
    zcollective.teardown()

The module functions act on one default :class:`Group`; create a ``Group``
yourself to hold several groups at once. This module holds no logic.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Concatenate, Optional, ParamSpec, TypeVar, Union

from ._calls import DEFAULT, Calls, Timeout
from ._elastic import Agreement
from ._future import CollectiveFuture
from ._group import Group, calls_of, default_reduce_fn, life_of, point_of
from ._io._reducing import elementwise
from ._lifecycle import Lifecycle
from ._limits import DEFAULT_INIT_TIMEOUT_S
from ._matched import Message
from ._point import PointToPoint
from ._protocol._p2p import ANY_SOURCE, ANY_TAG, PROC_NULL, Status
from ._waiting import ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION, as_completed, wait
from .config import takes_settings
from .errors import (
    AddressError,
    AuthenticationError,
    CallMismatchError,
    CollectiveError,
    CollectiveTimeoutError,
    ForkedProcessError,
    InternalError,
    JobMismatchError,
    LateJoinError,
    LeftOutError,
    PeerEndedError,
    PeerError,
    ProtocolError,
    RemoteError,
    ReplicaLostError,
    SerializationError,
)

__version__ = "0.1.0"

__all__ = [
    "initialize", "teardown", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "stats",
    "allreduce", "allreduce_async", "scan", "scan_async", "exscan", "exscan_async",
    "reduce", "reduce_async", "reduce_scatter", "reduce_scatter_async",
    "broadcast", "broadcast_async", "allgather", "allgather_async",
    "gather", "gather_async", "scatter", "scatter_async",
    "alltoall", "alltoall_async", "barrier", "barrier_async", "shrink", "agree", "Agreement", "grow",
    "coordinator_address", "lost_ranks", "old_ranks", "status", "split", "subgroup", "dup",
    "send", "send_async", "recv", "recv_async", "sendrecv", "probe", "iprobe",
    "ANY_SOURCE", "ANY_TAG", "Status",
    "ssend", "ssend_async", "mprobe", "improbe", "PROC_NULL", "Message",
    "wait", "as_completed", "FIRST_COMPLETED", "FIRST_EXCEPTION", "ALL_COMPLETED",
    "default_reduce_fn", "elementwise", "Group", "CollectiveFuture",
    "CollectiveError", "RemoteError", "ReplicaLostError", "CollectiveTimeoutError",
    "CallMismatchError", "AuthenticationError", "SerializationError", "ProtocolError",
    "PeerError", "AddressError", "LateJoinError", "LeftOutError", "ForkedProcessError", "InternalError",
    "JobMismatchError", "PeerEndedError",
    "__version__",
]

_group: Optional[Group] = None
_life: Optional[Lifecycle] = None  # the default group's (its calls check it) ...
_point: Optional[PointToPoint] = None  # ... and its point-to-point part
_calls: Optional[Calls] = None  # ... and its call runner
_ended: Optional[Group] = None  # the last default group torn down: its stats stay readable


def _use(group: Optional[Group]) -> None:
    """Make ``group`` the default group (None: there is none)."""
    global _group, _life, _point, _calls
    _group, _life, _point, _calls = (None, None, None, None) if group is None else (
        group, life_of(group), point_of(group), calls_of(group))


P = ParamSpec("P")
R = TypeVar("R")


def _on_default(method: Callable[Concatenate[Group, P], R],
                point: Optional[Callable[Concatenate[PointToPoint, P], R]] = None,
                run: Optional[str] = None) -> Callable[P, R]:
    """The module function of a :class:`Group` method: the method, called on the default group
    (same signature without ``self``, same docstring); ``point``: the point-to-point part's
    method behind it, called on the default's part; ``run``: the blocking operation it runs
    (``self._calls.run(run, timeout, *positional)``), run by the default's call runner (no front
    in between)."""
    signature = inspect.signature(method)
    parameters = list(signature.parameters.values())[1:]
    positional = [p for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    defaults = tuple(p.default for p in positional)
    least = sum(p.default is p.empty for p in positional)

    def on_default(*args: P.args, **kwargs: P.kwargs) -> R:
        life = _life
        if life is None or life.closed:  # (checked inline: no call on the common path)
            return method(_current(), *args, **kwargs)
        if point is not None:
            return point(_point, *args, **kwargs)  # type: ignore[arg-type]
        if run is not None and least <= len(args) <= len(defaults) and (
                not kwargs or (len(kwargs) == 1 and "timeout" in kwargs)):
            return _calls.run(run, kwargs.get("timeout", DEFAULT), *args,  # type: ignore[union-attr, arg-type]
                              *defaults[len(args):])
        return method(_group, *args, **kwargs)  # type: ignore[arg-type]
    on_default.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters)
    on_default.__name__ = on_default.__qualname__ = method.__name__
    on_default.__module__, on_default.__doc__ = __name__, method.__doc__
    return on_default


def _current() -> Group:
    group, life = _group, _life
    if group is None or life is None or life.closed:
        if life is not None and life.reforming is not None:
            life.check_usable()  # closed to form the next group, which did not finish: says so
        raise RuntimeError("zcollective is not initialized: call zcollective.initialize() first")
    return group  # in a forked child, its operations raise CollectiveError naming the parent


@takes_settings()
def initialize(
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    replica_rank: Optional[int] = None,
    num_replicas: Optional[int] = None,
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
    shared_memory_min_bytes: Union[int, str, None] = None,
) -> None:
    """Join the default group; blocks until every replica has called it.

    Each argument left ``None`` is read from the environment, else takes its
    default: ``ZCOLLECTIVE_*`` names first, then adaptdl's ``ADAPTDL_*``, then
    torchrun's; with no configuration at all, one replica on loopback. The
    README's "Configuration" table lists the same.

    Raises
    ------
    RuntimeError
        Already initialized.
    ValueError
        A malformed or inconsistent configuration; names its source.
    AuthenticationError
        This replica and rank 0 do not share the same secret.
    CollectiveTimeoutError, ProtocolError, AddressError, LateJoinError, JobMismatchError
        As for :class:`Group`.
    """
    if is_initialized():
        raise RuntimeError("zcollective is already initialized: call teardown() first")
    _use(Group(master_addr, master_port, replica_rank, num_replicas, timeout=timeout,
                   op_timeout=op_timeout, warn_after=warn_after, liveness_timeout=liveness_timeout,
                   max_frame_bytes=max_frame_bytes, secret=secret, bind_addr=bind_addr, join=join,
                   job=job, shared_memory_min_bytes=shared_memory_min_bytes))


def teardown(*, timeout: Timeout = DEFAULT) -> None:
    """Wait until every replica calls ``teardown``, then close everything; a
    new :func:`initialize` may follow (with another size or port).

    Raises
    ------
    RuntimeError
        Not initialized.
    CollectiveTimeoutError
        Not every replica called it in time; the group is closed all the same.
    """
    global _ended
    group = _current()
    try:
        group.teardown(timeout=timeout)
    finally:
        if group.closed:  # not when refused (another thread): the group is still the owner's
            _use(None)
            _ended = group


def shrink(timeout: Optional[float] = None, *, majority: bool = True) -> None:
    """After a loss (a :class:`ReplicaLostError`), every survivor calls it, and
    they go on in this process in one new default group (:func:`get_rank` and
    :func:`get_world_size` tell the new values): :meth:`Group.shrink` says
    how, and when the survivors may not (``majority``). Returns None, where
    :meth:`Group.shrink` returns the new group.

    Raises
    ------
    RuntimeError
        Not initialized.
    LeftOutError, CollectiveTimeoutError, CallMismatchError, CollectiveError
        As :meth:`Group.shrink` raises them.
    """
    group = _group if _group is not None and _life is not None and _life.reforming is not None else _current()
    _use(group.shrink(timeout, majority=majority))  # (again after one that did not finish)


def agree(flag: bool, timeout: Optional[float] = None) -> Agreement:
    """ULFM's agree among the living, as :meth:`Group.agree`; when the
    survivors shrank first, the default group becomes theirs. The building
    block of "rescale now?". Returns the :class:`Agreement` only, where
    :meth:`Group.agree` returns the group agreed in with it.

    Raises
    ------
    RuntimeError
        Not initialized.
    LeftOutError
        The others went on without this replica.
    """
    group, agreement = _current().agree(flag, timeout)
    _use(group)
    return agreement


def grow(timeout: Timeout = DEFAULT) -> int:
    """Admit every newcomer waiting (started with ``initialize(join=True)``, or
    ``ZCOLLECTIVE_JOIN=1``, at :func:`coordinator_address`): every member
    calls it where it chooses (an epoch boundary, say). Returns how many were
    admitted: 0 at once if none waits; otherwise the default group is the
    next one, of the members (same ranks) and the newcomers (after them).
    (:meth:`Group.grow` returns that group instead, its ``admitted`` the count.)

    Raises
    ------
    RuntimeError
        Not initialized.
    CollectiveError
        As for any collective call.
    """
    old = _current()
    group = old.grow(timeout)
    _use(group)
    return group.admitted if group is not old else 0


def status() -> dict[str, Any]:
    """What the default group is doing now, from any thread, without waiting
    for it: see :meth:`Group.status`. Raises ``RuntimeError`` if not initialized."""
    group = _group
    if group is None:
        raise RuntimeError("zcollective is not initialized: call zcollective.initialize() first")
    return group.status()  # (a group closed, or forming the next one, says so: no error)


def lost_ranks() -> list[int]:
    """After :func:`shrink` (or an :func:`agree` that shrank), or a
    :func:`grow`: the ranks of the group before that are not in this one;
    ``[]`` otherwise. Raises ``RuntimeError`` if not initialized."""
    return _current().lost_ranks


def old_ranks() -> Optional[list[int]]:
    """After :func:`shrink`, or a :func:`grow` that admitted newcomers: each
    rank's rank in the group before, by new rank (``old_ranks()[get_rank()]``
    is this replica's; a newcomer's is the number grow gave it, from the size
    before on); None if the default group was not formed from an earlier one.
    Raises ``RuntimeError`` if not initialized."""
    return _current().old_ranks


def coordinator_address() -> str:
    """``host:port`` of the default group's coordinator: where a launcher
    sends newcomers (after rank 0's loss and a shrink, another host's).
    Raises ``RuntimeError`` if not initialized."""
    return _current().coordinator_address()


def is_initialized() -> bool:
    """True between :func:`initialize` and :func:`teardown` (False in a forked
    child until it initializes a group of its own)."""
    return _group is not None and _life is not None and not _life.closed and _life.pid == os.getpid()


def get_rank() -> int:
    """This replica's rank in the default group."""
    return _current().rank


def get_world_size() -> int:
    """The number of replicas in the default group."""
    return _current().size


def get_local_rank() -> Optional[int]:
    """This replica's index among those on its host, as its launcher said
    (``None`` when none did); see ``ZCOLLECTIVE_LOCAL_RANK`` in the README."""
    return _current().config.local_rank


def stats() -> dict[str, Any]:
    """Who is slow: call statistics of the default group (see
    :meth:`Group.stats`); after :func:`teardown`, those of the group it closed.
    Raises ``RuntimeError`` if no group was ever initialized."""
    group = _group if _group is not None else _ended
    if group is None:
        raise RuntimeError("zcollective is not initialized: call zcollective.initialize() first")
    return group.stats()


allreduce = _on_default(Group.allreduce, run="allreduce")
allreduce_async = _on_default(Group.allreduce_async)
scan = _on_default(Group.scan, run="scan")
scan_async = _on_default(Group.scan_async)
exscan = _on_default(Group.exscan, run="exscan")
exscan_async = _on_default(Group.exscan_async)
reduce = _on_default(Group.reduce, run="reduce")
reduce_async = _on_default(Group.reduce_async)
reduce_scatter = _on_default(Group.reduce_scatter, run="reduce_scatter")
reduce_scatter_async = _on_default(Group.reduce_scatter_async)
broadcast = _on_default(Group.broadcast, run="broadcast")
broadcast_async = _on_default(Group.broadcast_async)
allgather = _on_default(Group.allgather, run="allgather")
allgather_async = _on_default(Group.allgather_async)
gather = _on_default(Group.gather, run="gather")
gather_async = _on_default(Group.gather_async)
scatter = _on_default(Group.scatter, run="scatter")
scatter_async = _on_default(Group.scatter_async)
alltoall = _on_default(Group.alltoall, run="alltoall")
alltoall_async = _on_default(Group.alltoall_async)
barrier = _on_default(Group.barrier, run="barrier")
barrier_async = _on_default(Group.barrier_async)
split = _on_default(Group.split)
subgroup = _on_default(Group.subgroup)
dup = _on_default(Group.dup)
send = _on_default(Group.send, PointToPoint.send)
send_async = _on_default(Group.send_async, PointToPoint.send_async)
recv = _on_default(Group.recv, PointToPoint.recv)
recv_async = _on_default(Group.recv_async, PointToPoint.recv_async)
sendrecv = _on_default(Group.sendrecv, PointToPoint.sendrecv)
probe = _on_default(Group.probe, PointToPoint.probe)
iprobe = _on_default(Group.iprobe, PointToPoint.iprobe)
ssend = _on_default(Group.ssend, PointToPoint.ssend)
ssend_async = _on_default(Group.ssend_async, PointToPoint.ssend_async)
mprobe = _on_default(Group.mprobe, PointToPoint.mprobe)
improbe = _on_default(Group.improbe, PointToPoint.improbe)
