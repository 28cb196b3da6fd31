"""A group of replicas as an object: the operations, over one replica end and,
on rank 0, the coordinator. The module-level API in ``__init__`` is a
default instance of this class."""

from __future__ import annotations

import functools
import inspect
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Concatenate, Optional, ParamSpec, TypeVar, Union, cast

from ._calls import DEFAULT, Calls, Timeout
from ._elastic import Elastic
from ._forming import Unreachable
from ._future import CollectiveFuture
from ._lifecycle import Lifecycle
from ._lifecycle import stats as life_stats
from ._lifecycle import status as life_status
from ._limits import DEFAULT_INIT_TIMEOUT_S
from ._point import PointToPoint
from ._protocol import _ring
from ._subgroups import SubGroups
from .config import Config, resolve, takes_settings
from .errors import LateJoinError

ReduceFn = Callable[[Any, Any], Any]


def default_reduce_fn(a: Any, b: Any) -> Any:
    """``a += b; return a``, as in adaptdl: sums numbers, numpy arrays and
    Counters, concatenates lists."""
    a += b
    return a


_ring.register_default(default_reduce_fn)


def life_of(group: Group) -> Lifecycle:
    """The lifecycle behind ``group`` (the module API checks its default's)."""
    return group._life


def calls_of(group: Group) -> Calls:
    """``group``'s call runner (the module API runs its default's blocking calls)."""
    return group._calls


def point_of(group: Group) -> PointToPoint:
    """``group``'s point-to-point part (the module API calls its default's)."""
    return group._point


F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")


def _front(part: str, method: Callable[Concatenate[Any, P], R],
           returns: Optional[str] = None) -> Callable[Concatenate[Group, P], R]:
    """A :class:`Group` method done by one of its parts (the attribute ``part``): ``method``,
    with its name, signature and docstring; ``returns``: its return type, said as Group's."""
    @functools.wraps(method)
    def front(self: Group, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(getattr(self, part), *args, **kwargs)
    signature = inspect.signature(method)
    first, *rest = signature.parameters.values()  # "self", whatever the part calls it
    front.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[first.replace(name="self", annotation=inspect.Parameter.empty), *rest],
        return_annotation=signature.return_annotation if returns is None else returns)
    return front


def _property(fget: Callable[[Group], R]) -> R:
    """A :class:`Group` property read by ``fget`` (typed as what it reads)."""
    return cast(R, property(fget))


_ASYNC_DOC = """Start ``{twin}`` and return at once, with a future.

Futures may be collected in any order{passed}.

Returns
-------
CollectiveFuture
    Its ``result()`` is what ``{twin}`` returns.

Raises
------
{raised}
{at_once}
CollectiveError
    From ``result()``, as ``{twin}`` raises it (at once if the group has
    already failed).
"""
_ROOT, _LENGTH = "a bad ``root``", "``values`` of the wrong length"
_VALUE, _FN = "a value too large or that cannot be pickled", "a ``reduce_fn`` that cannot be pickled"


def _async_twin(twin: str, *mistakes: str) -> Callable[[F], F]:
    """Give an ``*_async`` method the one docstring all of them share; ``mistakes``: what
    its arguments may get wrong, found before anything is sent."""
    at_once = ", ".join(["not initialized or torn down", *mistakes])
    if _VALUE in mistakes:
        at_once += " (a value is too large when it holds a buffer above ``max_frame_bytes``)"
    raised = "RuntimeError, ValueError, " + ("TypeError" if _FN in mistakes else "SerializationError")

    def document(fn: F) -> F:
        fn.__doc__ = _ASYNC_DOC.format(
            twin=twin, passed="; do not mutate what was passed until\nthe future is done" if mistakes else "",
            raised=raised if mistakes else "RuntimeError", at_once=textwrap.fill(
                f"At once, as ``{twin}`` would, for a mistake found before anything is sent: {at_once}.",
                84, initial_indent="    ", subsequent_indent="    "))
        return fn
    return document


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

    _life: Lifecycle  # its parts (see _compose)
    _calls: Calls
    _point: PointToPoint
    _subgroups: SubGroups[Group]
    _elastic: Elastic[Group]

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
        shared_memory_min_bytes: Union[int, str, None] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> None:
        """Join the group; raises as the class docstring says. Each argument
        left ``None`` is read from the environment, else takes its default;
        error messages call ``rank`` and ``size`` by their names in
        :func:`zcollective.initialize`, ``replica_rank`` and ``num_replicas``."""
        config = resolve(
            master_addr, master_port, rank, size, timeout=timeout, op_timeout=op_timeout,
            warn_after=warn_after, liveness_timeout=liveness_timeout, max_frame_bytes=max_frame_bytes,
            secret=secret, bind_addr=bind_addr, join=join, job=job,
            shared_memory_min_bytes=shared_memory_min_bytes, env=env,
        )
        if config.join:  # a newcomer: admitted by a grow(), it forms the next group with the members
            try:
                life = Lifecycle(*Lifecycle.admission(config))
            except Unreachable as exc:
                raise LateJoinError(f"newcomer: admitted, but it could not reach the next group's host "
                                    f"({exc}): the group's coordinator was lost while it formed again, "
                                    f"or the others formed it without this newcomer, which came too late "
                                    f"(stopped, or busy?); start it again at coordinator_address() of a "
                                    f"member") from None
        else:
            life = Lifecycle(config)
        _compose(self, life)

    # -- properties ---------------------------------------------------------

    @property
    def config(self) -> Config:
        """The group's validated configuration (this replica's rank and size in it)."""
        return self._life.config

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
        return self._life.closed

    stats = _front("_life", life_stats)
    status = _front("_life", life_status)

    def __repr__(self) -> str:
        state = "closed" if self._life.closed else "open"
        return f"<zcollective.Group rank={self.rank} size={self.size} {self.config.endpoint} {state}>"

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.teardown()

    # -- operations: zcollective's module functions are these, on the default group ----------

    def allreduce(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn, *,
                  timeout: Timeout = DEFAULT) -> Any:
        """Every replica gets ``reduce_fn`` applied to all replicas' values in
        rank order, ``fn(fn(fn(v0, v1), v2), v3)``, with rank 0's ``reduce_fn``.

        Raises
        ------
        RuntimeError
            Not initialized, or torn down.
        SerializationError
            ``value`` or ``reduce_fn`` cannot be pickled (nothing was sent).
        RemoteError
            ``reduce_fn`` raised on rank 0; the group stays usable.
        CollectiveTimeoutError, ReplicaLostError, CallMismatchError
            See "When things go wrong" in the README.
        """
        return self._calls.run("allreduce", timeout, value, reduce_fn)

    @_async_twin("allreduce", _VALUE, _FN)
    def allreduce_async(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn
                        ) -> CollectiveFuture[Any]:
        return self._calls.call("allreduce", value, reduce_fn)

    def scan(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn, *,
             timeout: Timeout = DEFAULT) -> Any:
        """Replica r gets ranks 0..r's values reduced in rank order (mpi4py's ``scan``), with
        rank 0's ``reduce_fn``; replica 0 gets its own ``value`` back. Raises as ``allreduce``."""
        return self._calls.run("scan", timeout, value, reduce_fn)

    @_async_twin("scan", _VALUE, _FN)
    def scan_async(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn) -> CollectiveFuture[Any]:
        return self._calls.call("scan", value, reduce_fn)

    def exscan(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn, *,
               timeout: Timeout = DEFAULT) -> Any:
        """Replica r gets ranks 0..r-1's values reduced in rank order (mpi4py's ``exscan``),
        with rank 0's ``reduce_fn``; replica 0 gets ``None``. Raises as ``allreduce``."""
        return self._calls.run("exscan", timeout, value, reduce_fn)

    @_async_twin("exscan", _VALUE, _FN)
    def exscan_async(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn) -> CollectiveFuture[Any]:
        return self._calls.call("exscan", value, reduce_fn)

    def reduce(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn, root: int = 0, *,
               timeout: Timeout = DEFAULT) -> Any:
        """Like ``allreduce``, but only ``root`` gets the result (with
        ``root``'s ``reduce_fn``); the others get ``None``."""
        return self._calls.run("reduce", timeout, value, reduce_fn, root)

    @_async_twin("reduce", _ROOT, _VALUE, _FN)
    def reduce_async(self, value: Any, reduce_fn: ReduceFn = default_reduce_fn,
                     root: int = 0) -> CollectiveFuture[Any]:
        return self._calls.call("reduce", value, reduce_fn, root)

    def reduce_scatter(self, values: Sequence[Any], reduce_fn: ReduceFn = default_reduce_fn, *,
                       timeout: Timeout = DEFAULT) -> Any:
        """Each replica passes one value per replica; replica i gets every
        replica's ``values[i]`` reduced in rank order, ``fn(fn(v0[i], v1[i]), v2[i])``,
        with rank 0's ``reduce_fn``. Equal numeric arrays (or CPU tensors) of every
        rank go peer to peer on the data plane, as an allreduce's do.

        Raises
        ------
        ValueError
            ``values`` does not hold one value per replica (the others' call
            fails with :class:`PeerError`; the group stays usable).
        RemoteError
            ``reduce_fn`` raised on rank 0; the group stays usable.
        CollectiveTimeoutError, ReplicaLostError, CallMismatchError
            See "When things go wrong" in the README.
        """
        return self._calls.run("reduce_scatter", timeout, values, reduce_fn)

    @_async_twin("reduce_scatter", _LENGTH, _VALUE, _FN)
    def reduce_scatter_async(self, values: Sequence[Any], reduce_fn: ReduceFn = default_reduce_fn
                             ) -> CollectiveFuture[Any]:
        return self._calls.call("reduce_scatter", values, reduce_fn)

    def broadcast(self, value: Any, root: int = 0, *, timeout: Timeout = DEFAULT) -> Any:
        """Every replica gets ``root``'s ``value``; the others' values are ignored.
        ``root`` gets back its own object, the others an unpickled copy."""
        return self._calls.run("broadcast", timeout, value, root)

    @_async_twin("broadcast", _ROOT, _VALUE)
    def broadcast_async(self, value: Any, root: int = 0) -> CollectiveFuture[Any]:
        return self._calls.call("broadcast", value, root)

    def allgather(self, value: Any, *, timeout: Timeout = DEFAULT) -> list[Any]:
        """Every replica gets the list of all replicas' values, in rank order."""
        return self._calls.run("allgather", timeout, value)  # type: ignore[no-any-return]

    @_async_twin("allgather", _VALUE)
    def allgather_async(self, value: Any) -> CollectiveFuture[list[Any]]:
        return self._calls.call("allgather", value)

    def gather(self, value: Any, root: int = 0, *, timeout: Timeout = DEFAULT) -> Optional[list[Any]]:
        """``root`` gets the list of all replicas' values in rank order; the
        others get ``None``. Values travel only to ``root``."""
        return self._calls.run("gather", timeout, value, root)  # type: ignore[no-any-return]

    @_async_twin("gather", _ROOT, _VALUE)
    def gather_async(self, value: Any, root: int = 0) -> CollectiveFuture[Optional[list[Any]]]:
        return self._calls.call("gather", value, root)

    def scatter(self, values: Optional[Sequence[Any]], root: int = 0, *,
                timeout: Timeout = DEFAULT) -> Any:
        """Replica i gets ``values[i]`` of ``root`` (``values`` is ignored
        elsewhere). A ``values`` of the wrong length raises ``ValueError`` on
        ``root`` and :class:`PeerError` on the others."""
        return self._calls.run("scatter", timeout, values, root)

    @_async_twin("scatter", _ROOT, _LENGTH + " (on ``root``)", _VALUE)
    def scatter_async(self, values: Optional[Sequence[Any]], root: int = 0) -> CollectiveFuture[Any]:
        return self._calls.call("scatter", values, root)

    def alltoall(self, values: Sequence[Any], *, timeout: Timeout = DEFAULT) -> list[Any]:
        """Replica i gets ``[values_j[i] for j in ranks]``: each replica
        passes one value per replica."""
        return self._calls.run("alltoall", timeout, values)  # type: ignore[no-any-return]

    @_async_twin("alltoall", _LENGTH, _VALUE)
    def alltoall_async(self, values: Sequence[Any]) -> CollectiveFuture[list[Any]]:
        return self._calls.call("alltoall", values)

    def barrier(self, *, timeout: Timeout = DEFAULT) -> None:
        """Return once every replica has called ``barrier``."""
        self._calls.run("barrier", timeout)

    @_async_twin("barrier")
    def barrier_async(self) -> CollectiveFuture[None]:
        return self._calls.call("barrier")

    teardown = _front("_calls", Calls.teardown)

    # -- point to point: its part's (zcollective._point) --------------------------

    send = _front("_point", PointToPoint.send)
    send_async = _front("_point", PointToPoint.send_async)
    recv = _front("_point", PointToPoint.recv)
    recv_async = _front("_point", PointToPoint.recv_async)
    sendrecv = _front("_point", PointToPoint.sendrecv)
    probe = _front("_point", PointToPoint.probe)
    iprobe = _front("_point", PointToPoint.iprobe)
    ssend = _front("_point", PointToPoint.ssend)
    ssend_async = _front("_point", PointToPoint.ssend_async)
    mprobe = _front("_point", PointToPoint.mprobe)
    improbe = _front("_point", PointToPoint.improbe)

    # -- sub-groups: their part's (zcollective._subgroups) --------------------------

    split = _front("_subgroups", SubGroups["Group"].split, "Optional[Group]")
    subgroup = _front("_subgroups", SubGroups["Group"].subgroup, "Optional[Group]")
    dup = _front("_subgroups", SubGroups["Group"].dup, "Group")
    parent_ranks = _property(_front("_subgroups", SubGroups["Group"].parent_ranks))

    # -- elastic groups: their part's (zcollective._elastic) --------------------------

    shrink = _front("_elastic", Elastic["Group"].shrink, "Group")
    grow = _front("_elastic", Elastic["Group"].grow, "Group")
    coordinator_address = _front("_elastic", Elastic["Group"].coordinator_address)
    agree = _front("_elastic", Elastic["Group"].agree, "tuple[Group, Agreement]")

    admitted = 0  # a group grow() formed: how many newcomers that grow admitted

    old_ranks = _property(_front("_elastic", Elastic["Group"].old_ranks))
    lost_ranks = _property(_front("_elastic", Elastic["Group"].lost_ranks))


def _compose(group: Group, life: Lifecycle) -> Group:
    """``group`` over the open ``life``, with its parts."""
    group._life = life
    group._calls = calls = Calls(life)
    group._point = PointToPoint(calls)
    group._subgroups = SubGroups(calls, _formed)
    group._elastic = Elastic(group, calls, _formed, _elastic_part)
    return group


def _formed(life: Lifecycle) -> Group:
    """The group of a life a part formed (a sub-group, the next group)."""
    return _compose(Group.__new__(Group), life)


def _elastic_part(group: Group) -> Elastic[Group]:
    return group._elastic
