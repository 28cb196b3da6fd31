"""A group of replicas as an object: the operations, over one replica end and,
on rank 0, the coordinator. The module-level API in ``__init__`` is a
default instance of this class."""

from __future__ import annotations

import functools
import logging
import operator
import os
import textwrap
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Concatenate, Optional, ParamSpec, TypeVar, Union

from . import _elastic, _subgroups
from ._calls import DEFAULT, Calls, Timeout, _Default
from ._elastic import Agreement
from ._forming import Unreachable
from ._future import CollectiveFuture
from ._io import _interrupts
from ._lifecycle import Lifecycle
from ._limits import DEFAULT_INIT_TIMEOUT_S
from ._point import PointToPoint
from ._protocol import _ring
from ._protocol._member import fresh
from .config import Config, resolve, takes_settings
from .errors import (
    CollectiveTimeoutError,
    LateJoinError,
    ReplicaLostError,
    is_interrupt,
)

log = logging.getLogger("zcollective")
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

F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")


def _front(part: str, method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Group, P], R]:
    """A :class:`Group` method done by one of its parts (the attribute ``part``): ``method``,
    with its name, signature and docstring."""
    @functools.wraps(method)
    def front(self: Group, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(getattr(self, part), *args, **kwargs)
    return front

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
                raise LateJoinError(f"newcomer: admitted, but the group's coordinator was lost "
                                    f"while it formed again ({exc}); start it again at "
                                    f"coordinator_address() of a member") from None
        else:
            life = Lifecycle(config)
        self._life, self._calls = life, Calls(life)
        self._point = PointToPoint(self._calls)

    @classmethod
    def _of(cls, life: Lifecycle) -> Group:
        """The group of an open life (one :mod:`zcollective._elastic` formed)."""
        group = cls.__new__(cls)
        group._life, group._calls = life, Calls(life)
        group._point = PointToPoint(group._calls)
        return group

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
        return self._life.stats()

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
        return self._life.status()

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

    def teardown(self, *, timeout: Timeout = DEFAULT) -> None:
        """Finish every call made before it, wait until every replica calls
        ``teardown``, then close the sockets. Finished: every collective
        call's future holds its value (collect it after teardown too), every
        ``send_async`` went, and every ``recv_async`` got its message, or,
        when no rank can send it one any more, failed with a
        :class:`CollectiveError` naming it. A failed group closes at once.
        Calling it twice is harmless.

        Raises
        ------
        CollectiveTimeoutError
            Not every replica called ``teardown``, or the calls before it
            did not finish, within ``timeout``; the group is closed all the same.
        """
        life = self._life
        if life.closed:
            return
        if os.getpid() != life.pid:  # a forked child: the sockets are the parent's
            life.closed = True
            return
        with life.turns:
            if life.closed:
                return  # (by another thread, meanwhile)
            interrupted = False
            try:
                failure: Optional[BaseException] = life.member.failure
                if life.driver is not None and failure is None:
                    try:
                        if isinstance(timeout, _Default):
                            timeout = life.config.op_timeout
                        deadline = None if timeout is None else time.monotonic() + timeout
                        try:
                            life.finish(deadline, timeout)  # (what was called before it: finished)
                        except BaseException as exc:  # interrupted before its call: the group stays
                            interrupted = is_interrupt(exc)  # open (teardown again finishes it; an
                            raise  # ending says goodbye), never lost
                        self._calls.blocking(self._calls.call("teardown"), None if deadline is None
                                             else max(0.0, deadline - time.monotonic()))
                    except CollectiveTimeoutError:
                        raise
                    except Exception as exc:  # a failed group closes anyway
                        if interrupted:
                            raise
                        failure = exc
                if failure is not None:  # cleanup, often in a `finally`: said, never raised over
                    log.warning("zcollective rank %d: teardown closed a group that was already over: %s",
                                self.rank, failure)  # the exception in flight
            finally:
                if not interrupted:
                    life.close()

    # -- point to point: its part's (zcollective._point) --------------------------

    send = _front("_point", PointToPoint.send)
    send_async = _front("_point", PointToPoint.send_async)
    recv = _front("_point", PointToPoint.recv)
    recv_async = _front("_point", PointToPoint.recv_async)
    sendrecv = _front("_point", PointToPoint.sendrecv)
    probe = _front("_point", PointToPoint.probe)
    iprobe = _front("_point", PointToPoint.iprobe)

    # -- sub-groups -------------------------------------------------------------

    def split(self, color: Any, key: int = 0, *, timeout: Timeout = DEFAULT) -> Optional[Group]:
        """A collective call: every rank with the same ``color`` (any hashable
        value: an int, a host name) ends in one new group, ranked by ``key``
        then by rank here; ``color=None`` takes part and gets ``None``.
        Colors are the same when equal, as a dict's keys are: ``1``, ``1.0``
        and ``True`` are one color, ``"1"`` another.

        A sub-group is a whole group in the same processes: every operation,
        its own sequence (its calls and this group's interleave freely, from
        any thread), its own coordinator (its rank 0) on a port the system
        chooses, the data plane, the secret (one of its own, made from this
        group's), timeouts. A lost process fails the groups it is in, and only
        those. :attr:`parent_ranks` says who is who. Close it with
        :meth:`teardown` (or let the program end).

        Raises
        ------
        ValueError
            A rank passed a key that is not an int or a color that is not
            hashable: raised on every rank alike; the group goes on.
        AddressError
            A new group's rank 0 could not listen: raised on every rank
            alike, naming it; the group goes on.
        CollectiveError
            A rank could not open its part of its new group (no file
            descriptors left, say): raised on every rank alike, naming it
            and why; the group goes on. Otherwise as for any collective call.
        CallMismatchError
            Another rank called something else, ``subgroup`` or ``dup`` too:
            this group fails, as for any mismatch.
        """
        life = _subgroups.split(self._calls, color, key, timeout)
        return None if life is None else Group._of(life)

    def subgroup(self, ranks: Sequence[int], *, timeout: Timeout = DEFAULT) -> Optional[Group]:
        """A collective call: the ranks listed form a new group, ranked in the
        list's order; every rank calls it with the same list, and those not in
        it get ``None``. Otherwise as :meth:`split`.

        Raises
        ------
        CallMismatchError
            The ranks passed different lists (on every rank; the group goes on).
        ValueError
            The list names a rank twice, none, or one outside the group.
        """
        life = _subgroups.split(self._calls, None, 0, timeout, ranks, "subgroup")
        return None if life is None else Group._of(life)

    def dup(self, *, timeout: Timeout = DEFAULT) -> Group:
        """A collective call: a new group of the same ranks, in the same
        order, whose calls never mix with this one's (a library's own
        group, say). As :meth:`split`."""
        life = _subgroups.split(self._calls, None, 0, timeout, range(self.size), "dup")
        assert life is not None
        return Group._of(life)

    @property
    def parent_ranks(self) -> Optional[list[int]]:
        """A sub-group's: the rank, in the group it came from, of each of its
        ranks (``parent_ranks[i]`` was rank i's); None for any other group."""
        return self._life.parent_ranks

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
        it returns this group once every rank has called it. (The module's
        :func:`~zcollective.shrink` returns None: the new group becomes the default.)

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
        life = self._life
        _interrupts.hold_new_handlers()  # (a handler the program installed since: wrapped first)
        life.check_process()
        if life.closed and life.reforming is None:
            raise RuntimeError("this zcollective group was torn down: there is nothing to shrink")
        if not life.closed and life.member.failure is None:  # nothing lost that it knows of:
            try:  # a collective call of every member (one calling it alone is a mismatch)
                self._calls.blocking(self._calls.call("shrink"), DEFAULT if timeout is None else timeout)
                return self  # every member called it, and nobody was lost
            except ReplicaLostError:
                pass  # lost meanwhile: shrink as after any loss
        return Group._of(_elastic.shrink(self._life, timeout, majority))

    def grow(self, timeout: Timeout = DEFAULT) -> Group:
        """Admit every newcomer waiting (started with ``join=True`` at this
        group's coordinator address): a collective call of every member. With
        nobody waiting, returns this group at once, unchanged; otherwise this
        group closes, and its members and the newcomers form the next one at
        the same address, the members keeping their ranks, the newcomers
        numbered after them (:attr:`admitted` says how many joined). No call
        ever mixes the two memberships. A member lost while the group forms
        again: the others shrink instead (the newcomers are told to start
        again), and ``admitted`` is 0. (The module's :func:`~zcollective.grow`
        returns the count, and makes the new group the default.)

        Raises
        ------
        CollectiveError
            As for any collective call (the group goes on, unchanged).
        """
        count = self._calls.run("grow", timeout)
        if not count:
            return self
        grown = Group._of(_elastic.regroup(self._life, count))
        old = grown.old_ranks or []  # newcomers were numbered from this group's size on
        grown.admitted = sum(r >= self.size for r in old)  # those in the group formed
        return grown

    def coordinator_address(self) -> str:
        """``host:port`` of this group's coordinator: where newcomers go (it
        moves when rank 0 is lost and the survivors shrink)."""
        return self._life.coordinator_address()

    def agree(self, flag: bool, timeout: Optional[float] = None) -> tuple[Group, Agreement]:
        """ULFM's agree: every living member gets the same AND of the
        members' ``flag`` and the same set of ranks found lost (of this
        group). In a failed group (or one failing meanwhile) the survivors
        shrink first: returns the group they agreed in (this one if nothing
        was lost) and the :class:`~zcollective.Agreement`. (The module's
        :func:`~zcollective.agree` returns the agreement only, and makes that
        group the default.)

        Raises
        ------
        LeftOutError
            The others went on without this replica (see :meth:`shrink`).
        CollectiveError
            The group failed for another reason than a loss.
        """
        at_call = list(range(self.size))  # each rank of the current group, as a rank of this one
        current = self
        while True:
            failure = current._life.member.failure
            if failure is None:
                try:
                    together = current.allreduce(bool(flag), operator.and_, timeout=timeout)
                    return current, Agreement(bool(together), frozenset(set(range(self.size)) - set(at_call)))
                except ReplicaLostError:
                    pass
            elif not isinstance(failure, ReplicaLostError):
                raise fresh(failure)
            current = current.shrink(timeout)
            at_call = [at_call[old] for old in current.old_ranks or range(current.size)]

    admitted = 0  # a group grow() formed: how many newcomers that grow admitted

    @property
    def old_ranks(self) -> Optional[list[int]]:
        """A group formed from an earlier one, by :meth:`shrink` or a
        :meth:`grow` that admitted newcomers: every rank's rank in the group
        before (by new rank; a newcomer's is the number :meth:`grow` gave it,
        from the size before on); None for any other group."""
        return self._life.member.old_ranks

    @property
    def lost_ranks(self) -> list[int]:
        """A group formed from an earlier one (:attr:`old_ranks`): the ranks
        of the group before that are not in this one; ``[]`` otherwise."""
        old = self._life.member.old_ranks
        return [] if old is None else sorted(set(range(self._life.member.old_size)) - set(old))

