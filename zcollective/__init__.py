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

import os
import textwrap
from collections.abc import Sequence
from typing import Any, Callable, Optional, TypeVar, Union

from ._elastic import Agreement
from ._future import CollectiveFuture
from ._group import DEFAULT, Group, ReduceFn, Timeout, default_reduce_fn
from ._limits import DEFAULT_INIT_TIMEOUT_S
from ._protocol._ring import elementwise
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
    PeerError,
    ProtocolError,
    RemoteError,
    ReplicaLostError,
    SerializationError,
)

__version__ = "0.1.0"

__all__ = [
    "initialize", "teardown", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "stats",
    "allreduce", "allreduce_async", "reduce", "reduce_async", "reduce_scatter", "reduce_scatter_async",
    "broadcast", "broadcast_async", "allgather", "allgather_async",
    "gather", "gather_async", "scatter", "scatter_async",
    "alltoall", "alltoall_async", "barrier", "barrier_async", "shrink", "agree", "Agreement", "grow",
    "coordinator_address", "lost_ranks", "old_ranks", "status",
    "default_reduce_fn", "elementwise", "Group", "CollectiveFuture",
    "CollectiveError", "RemoteError", "ReplicaLostError", "CollectiveTimeoutError",
    "CallMismatchError", "AuthenticationError", "SerializationError", "ProtocolError",
    "PeerError", "AddressError", "LateJoinError", "LeftOutError", "ForkedProcessError", "InternalError",
    "JobMismatchError",
    "__version__",
]

_group: Optional[Group] = None
_ended: Optional[Group] = None  # the last default group torn down: its stats stay readable



F = TypeVar("F", bound=Callable[..., Any])

_ASYNC_DOC = """Start :func:`{twin}` and return at once, with a future.

Futures may be collected in any order; do not mutate what was passed until
the future is done.

Returns
-------
CollectiveFuture
    Its ``result()`` is what :func:`{twin}` returns.

Raises
------
{raised}
{at_once}
CollectiveError
    From ``result()``, as :func:`{twin}` raises it (at once if the group has
    already failed).
"""


def _async_twin(twin: Callable[..., Any], raised: str, mistakes: str) -> Callable[[F], F]:
    """Give an ``*_async`` function the one docstring all of them share."""
    def document(fn: F) -> F:
        at_once = (f"At once, as :func:`{twin.__name__}` would, for a mistake found before "
                   f"anything is sent: not initialized, {mistakes} (a value is too large when it "
                   f"holds a buffer above ``max_frame_bytes``).")
        fn.__doc__ = _ASYNC_DOC.format(twin=twin.__name__, raised=raised,
                                       at_once=textwrap.fill(at_once, 84, initial_indent="    ",
                                                             subsequent_indent="    "))
        return fn
    return document


def _current() -> Group:
    if _group is not None and _group.closed and _group._life.reforming is not None:
        _group._life.check_usable()  # closed to form the next group, which did not finish: says so
    if _group is None or _group.closed:
        raise RuntimeError("zcollective is not initialized: call zcollective.initialize() first")
    return _group  # in a forked child, its operations raise CollectiveError naming the parent


def _open_here() -> bool:
    """The default group is open and belongs to this process (not a parent we forked from)."""
    return _group is not None and not _group.closed and _group._life.pid == os.getpid()


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
    global _group
    if _open_here():
        raise RuntimeError("zcollective is already initialized: call teardown() first")
    _group = Group(master_addr, master_port, replica_rank, num_replicas, timeout=timeout,
                   op_timeout=op_timeout, warn_after=warn_after, liveness_timeout=liveness_timeout,
                   max_frame_bytes=max_frame_bytes, secret=secret, bind_addr=bind_addr, join=join,
                   job=job)


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
    global _group, _ended
    group = _current()
    try:
        group.teardown(timeout=timeout)
    finally:
        if group.closed:  # not when refused (another thread): the group is still the owner's
            _group, _ended = None, group


def shrink(timeout: Optional[float] = None, *, majority: bool = True) -> None:
    """After a loss (a :class:`ReplicaLostError`), go on with the survivors in
    this process: every survivor calls it, and they all end in one new default
    group, ranked densely in old-rank order (:func:`get_rank` and
    :func:`get_world_size` tell the new values); see :meth:`Group.shrink`.
    The survivors go on only if they are more than half of the ranks not seen
    to die, so after a partition at most one side does; ``majority=False``
    (on every survivor) goes on with whoever came. In a group that lost
    nobody, every rank must call it (it returns at once, nothing changed).

    Raises
    ------
    RuntimeError
        Not initialized.
    LeftOutError
        The others formed their group without this replica.
    CollectiveTimeoutError
        No group could be formed within ``timeout``.
    """
    global _group
    group = _group if _group is not None and _group._life.reforming is not None else _current()
    _group = group.shrink(timeout, majority=majority)  # (again after one that did not finish)


def agree(flag: bool, timeout: Optional[float] = None) -> Agreement:
    """ULFM's agree among the living: every member gets the same AND of the
    members' ``flag`` and the same set of ranks (of the group at the call)
    found lost. In a failed group the survivors shrink first, as
    :func:`shrink` does, and the default group becomes theirs. The building
    block of "rescale now?".

    Raises
    ------
    RuntimeError
        Not initialized.
    LeftOutError
        The others went on without this replica.
    """
    global _group
    _group, agreement = _current().agree(flag, timeout)
    return agreement


def grow(timeout: Timeout = DEFAULT) -> int:
    """Admit every newcomer waiting (started with ``initialize(join=True)``, or
    ``ZCOLLECTIVE_JOIN=1``, at :func:`coordinator_address`): every member
    calls it where it chooses (an epoch boundary, say). Returns how many were
    admitted: 0 at once if none waits; otherwise the default group is the
    next one, of the members (same ranks) and the newcomers (after them).

    Raises
    ------
    RuntimeError
        Not initialized.
    CollectiveError
        As for any collective call.
    """
    global _group
    old = _current()
    _group = old.grow(timeout)
    return _group.admitted if _group is not old else 0


def status() -> dict[str, Any]:
    """What the default group is doing now, from any thread, without waiting
    for it: this rank's calls in flight and, on rank 0, every rank's last call
    and the calls waiting for it (see :meth:`Group.status`).

    Raises
    ------
    RuntimeError
        Not initialized.
    """
    group = _group
    if group is None:
        raise RuntimeError("zcollective is not initialized: call zcollective.initialize() first")
    return group.status()  # (a group closed, or forming the next one, says so: no error)


def lost_ranks() -> list[int]:
    """After :func:`shrink` (or an :func:`agree` that shrank): the ranks of the
    group before that are not in this one; ``[]`` otherwise.

    Raises
    ------
    RuntimeError
        Not initialized.
    """
    return _current().lost_ranks


def old_ranks() -> Optional[list[int]]:
    """After :func:`shrink`: each rank's rank in the group before, by new rank
    (``old_ranks()[get_rank()]`` is this replica's); None if the default
    group was not formed by a shrink.

    Raises
    ------
    RuntimeError
        Not initialized.
    """
    return _current().old_ranks


def coordinator_address() -> str:
    """``host:port`` of the default group's coordinator: where a launcher
    sends newcomers (after rank 0's loss and a shrink, another host's).

    Raises
    ------
    RuntimeError
        Not initialized.
    """
    return _current().coordinator_address()


def is_initialized() -> bool:
    """True between :func:`initialize` and :func:`teardown` (False in a forked
    child until it initializes a group of its own)."""
    return _open_here()


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

    Raises
    ------
    RuntimeError
        No group was ever initialized.
    """
    group = _group if _group is not None else _ended
    if group is None:
        raise RuntimeError("zcollective is not initialized: call zcollective.initialize() first")
    return group.stats()


def allreduce(value: Any, reduce_fn: ReduceFn = default_reduce_fn, *,
              timeout: Timeout = DEFAULT) -> Any:
    """Every replica gets ``reduce_fn`` applied to all replicas' values in
    rank order, ``fn(fn(fn(v0, v1), v2), v3)``, with rank 0's ``reduce_fn``.

    Raises
    ------
    RuntimeError
        Not initialized.
    SerializationError
        ``value`` or ``reduce_fn`` cannot be pickled (nothing was sent).
    RemoteError
        ``reduce_fn`` raised on rank 0; the group stays usable.
    CollectiveTimeoutError, ReplicaLostError, CallMismatchError
        See "When things go wrong" in the README.
    """
    return _current().allreduce(value, reduce_fn, timeout=timeout)


@_async_twin(allreduce, 'RuntimeError, ValueError, TypeError',
              'a value too large or that cannot be pickled, a ``reduce_fn`` that cannot be pickled')
def allreduce_async(value: Any, reduce_fn: ReduceFn = default_reduce_fn) -> CollectiveFuture[Any]:
    return _current().allreduce_async(value, reduce_fn)


def reduce(value: Any, reduce_fn: ReduceFn = default_reduce_fn, root: int = 0, *,
           timeout: Timeout = DEFAULT) -> Any:
    """Like :func:`allreduce`, but only ``root`` gets the result; others get None."""
    return _current().reduce(value, reduce_fn, root, timeout=timeout)


@_async_twin(reduce, 'RuntimeError, ValueError, TypeError',
              'a bad ``root``, a value too large or that cannot be pickled, '
              'a ``reduce_fn`` that cannot be pickled')
def reduce_async(value: Any, reduce_fn: ReduceFn = default_reduce_fn,
                 root: int = 0) -> CollectiveFuture[Any]:
    return _current().reduce_async(value, reduce_fn, root)


def reduce_scatter(values: Sequence[Any], reduce_fn: ReduceFn = default_reduce_fn, *,
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
    return _current().reduce_scatter(values, reduce_fn, timeout=timeout)


@_async_twin(reduce_scatter, 'RuntimeError, ValueError, TypeError',
              '``values`` of the wrong length, a value too large or that cannot be pickled, '
              'a ``reduce_fn`` that cannot be pickled')
def reduce_scatter_async(values: Sequence[Any], reduce_fn: ReduceFn = default_reduce_fn
                         ) -> CollectiveFuture[Any]:
    return _current().reduce_scatter_async(values, reduce_fn)


def broadcast(value: Any, root: int = 0, *, timeout: Timeout = DEFAULT) -> Any:
    """Every replica gets ``root``'s ``value``; the others' values are ignored."""
    return _current().broadcast(value, root, timeout=timeout)


@_async_twin(broadcast, 'RuntimeError, ValueError, SerializationError',
              'a bad ``root``, a value too large or that cannot be pickled')
def broadcast_async(value: Any, root: int = 0) -> CollectiveFuture[Any]:
    return _current().broadcast_async(value, root)


def allgather(value: Any, *, timeout: Timeout = DEFAULT) -> list[Any]:
    """Every replica gets the list of all replicas' values, in rank order."""
    return _current().allgather(value, timeout=timeout)


@_async_twin(allgather, 'RuntimeError, ValueError, SerializationError',
              'a value too large or that cannot be pickled')
def allgather_async(value: Any) -> CollectiveFuture[list[Any]]:
    return _current().allgather_async(value)


def gather(value: Any, root: int = 0, *, timeout: Timeout = DEFAULT) -> Optional[list[Any]]:
    """``root`` gets all values in rank order; the others get None."""
    return _current().gather(value, root, timeout=timeout)


@_async_twin(gather, 'RuntimeError, ValueError, SerializationError',
              'a bad ``root``, a value too large or that cannot be pickled')
def gather_async(value: Any, root: int = 0) -> CollectiveFuture[Optional[list[Any]]]:
    return _current().gather_async(value, root)


def scatter(values: Optional[Sequence[Any]], root: int = 0, *, timeout: Timeout = DEFAULT) -> Any:
    """Replica i gets ``values[i]`` from ``root``."""
    return _current().scatter(values, root, timeout=timeout)


@_async_twin(scatter, 'RuntimeError, ValueError, SerializationError',
              'a bad ``root``, ``values`` of the wrong length (on ``root``), '
              'a value too large or that cannot be pickled')
def scatter_async(values: Optional[Sequence[Any]], root: int = 0) -> CollectiveFuture[Any]:
    return _current().scatter_async(values, root)


def alltoall(values: Sequence[Any], *, timeout: Timeout = DEFAULT) -> list[Any]:
    """Replica i gets ``[values_j[i] for j in ranks]``."""
    return _current().alltoall(values, timeout=timeout)


@_async_twin(alltoall, 'RuntimeError, ValueError, SerializationError',
              '``values`` of the wrong length, a value too large or that cannot be pickled')
def alltoall_async(values: Sequence[Any]) -> CollectiveFuture[list[Any]]:
    return _current().alltoall_async(values)


def barrier(*, timeout: Timeout = DEFAULT) -> None:
    """Return once every replica has called ``barrier``."""
    _current().barrier(timeout=timeout)


def barrier_async() -> CollectiveFuture[None]:
    """Start :func:`barrier` and return at once, with a future.

    Futures may be collected in any order.

    Returns
    -------
    CollectiveFuture
        Its ``result()`` is ``None``.

    Raises
    ------
    RuntimeError
        At once, as :func:`barrier` would, for a mistake found before anything is sent:
        not initialized.
    CollectiveError
        From ``result()``, as :func:`barrier` raises it (at once if the group has
        already failed).
    """
    return _current().barrier_async()
