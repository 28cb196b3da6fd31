"""Every operation as one object: its code on the wire, what each rank sends and how its result is made
(:meth:`Operation.contribute`), the coordinator's check, route (a reduction's: :class:`Reducing`,
:class:`Combine`) and data plan (:meth:`Operation.malformed`, :meth:`Operation.route`,
:meth:`Operation.plan`), and its data-plane job. ``Group`` asks for an operation by name
(:data:`OPERATIONS`) and builds no message; the coordinator looks the operation of a call up by its code.
A new operation is a class here (its code in :class:`~._ops_types.Op`), a ``Group`` method and a module
function (docs/protocol.md, *Operations*). What the rows speak in is :mod:`._ops_types`; their plans
and jobs off the star, and their pieces, :mod:`._ops_data`.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from functools import partial
from operator import attrgetter
from typing import Any, Callable, Optional

from .._format import _bodies, _serialize
from .._format._wire import FLAG_DATA, FLAG_LOCAL_ERROR, Message, WireError
from . import _ring, _shm
from ._ops_data import (  # noqa: F401 (importable here, as ever)
    PLAIN,
    _agreed,
    _array,
    _either,
    _exchange,
    _exchange_plan,
    _gathered,
    _is_tensor,
    _n_each,
    _nothing,
    _one_each,
    _per_rank,
    _sent,
    _shared_agreed,
    _shared_parts,
    _staged_build,
    _status,
    _tensor_out,
    _with,
    check_root,
    reducing,
    shared_plan,
)
from ._ops_types import (  # noqa: F401 (importable here, as ever)
    EVERY,
    LABELS,
    NOTHING,
    ONE,
    OPS,
    OWN,
    RING_SAFE,
    Combine,
    Combining,
    Contribution,
    Disagree,
    Here,
    Malformed,
    Op,
    Outgoing,
    Parts,
    Refused,
    Routes,
    Step,
    Unreadable,
    UserCode,
    group_name,
    in_world,
    label,
    rank_list,
    reduce_name,
)
from ._shm import MAX_SYNCS  # noqa: F401 (the coordinator's bound, where it reads the operations)


class Operation:
    """One operation (a subclass per operation; see the module docstring)."""

    code = Op.NONE
    rooted = False  # called with a root (named wherever the call is described)
    closes = False  # completing a call of it closes the group (teardown)

    @property
    def label(self) -> str:
        return LABELS[self.code]

    def contribute(self, here: Here, *args: Any) -> Contribution:
        """This rank's contribution; raises ValueError or TypeError for bad arguments."""
        return Contribution(0, _nothing, NOTHING)

    def malformed(self, contributions: list[Message], root: int) -> str:
        """Why the parts cannot be combined as they came ("" if they can)."""
        return ""

    def bad_root(self, root: int, size: int) -> str:
        """Why the root every rank sent cannot be this call's ("" if it can)."""
        return "" if 0 <= root < size else f"root {root} is not a rank of this group of {size} replicas"

    def describe(self, root: int) -> str:
        """The call, as a mismatch names it."""
        return f"{self.label}(root={root})" if self.rooted else self.label

    def route(self, at: Combining, contributions: list[Message], root: int) -> Routes:
        """The segments each rank receives (ranks given one list get the same frames)."""
        return [[] for _ in contributions]

    def plan(self, contributions: list[Message], root: int,
             hosts: Optional[list[Optional[int]]] = None) -> list[list[Any]]:
        """A call whose data goes on the data plane (or through shared memory: ``hosts``,
        each rank's host): the plan every rank is sent; raises :class:`Disagree` or
        :class:`Malformed`."""
        raise Malformed("has no data plane")

    def completed(self, at: Combining, seq: int) -> list[Any]:
        """What completing call ``seq`` does besides sending its results."""
        return []

    def described(self, dtype: str, shape: tuple[int, ...], fn: str) -> str:
        """What a rank passed, as a mismatch names it, from its array plan."""
        return f"a {dtype} array of shape {shape} reduced with {fn}"


# -- the operations ------------------------------------------------------------


class Reducing(Operation):
    """An operation whose completed call asks for a reduction (:meth:`combine`),
    then routes its results: to the root alone, if it has one, else to all."""

    each = False  # each rank's every value is reduced by index (reduce_scatter), not its one value

    def combine(self, seq: int, contributions: list[Message], root: int) -> Combine:
        count, values = len(contributions) if self.each else 1, tuple(map(SEGMENTS, contributions))
        return Combine(seq, self.code, root, count, contributions[root].fn, values)

    def route_combined(self, size: int, root: int, results: list[list[Any]]) -> Routes:
        """The segments each rank of ``size`` receives, given the reduction's ``results``."""
        if self.each:  # rank i: index i's
            return [[result] for result in results]
        if not self.rooted:
            return [results] * size
        return [results if r == root else [] for r in range(size)]


SEGMENTS = attrgetter("segments")


class Allreduce(Reducing):
    code = Op.ALLREDUCE

    def contribute(self, here: Here, value: Any, reduce_fn: Any) -> Contribution:
        build = partial(_with, value, None, False) if here.rank and callable(reduce_fn) else reducing(
            here, value, reduce_fn, 0)  # (a replica's function is never sent: made with no call)
        finish = OWN if here.size == 1 else ONE  # (one rank: nothing was combined with its value)
        plane = here.shared if here.shared is not None else here.across
        if isinstance(value, PLAIN) or not (here.data or plane is not None):  # (the common call)
            return Contribution(0, build, finish, reduce=reduce_fn, own=value)
        name = _ring.reduction_name(reduce_fn)
        if name is not None and plane is not None:
            array = _array(value, here.shared_min_bytes)
            if array is not None and plane.fits(array.nbytes):
                return self._shared(plane, value, array, name, here.reducer(name, reduce_fn), finish)
        array = _array(value, here.data_min_bytes) if name is not None and here.data else None
        if array is None or name is None:
            return Contribution(0, build, finish, reduce=reduce_fn, own=value)
        description = _bodies.plan(dtype=array.dtype.str, shape=list(array.shape), fn=name)
        tensor = _is_tensor(value)

        def job(msg: Message) -> _ring.Transfer:
            ring = _ring.RingAllreduce(here.rank, here.size, array, here.reducer(name, reduce_fn))
            ring.finish = _tensor_out(tensor, ring.result)
            return ring
        return Contribution(0, lambda: ([[description]], None), finish, FLAG_DATA, job, own=value)

    @staticmethod
    def _shared(plane: Any, value: Any, array: Any, name: str, reduce: Any, finish: int) -> Contribution:
        """Through the host's shared memory (``plane``; with ranks on several hosts, and the
        ring between hosts): the input written into this rank's slot at once if its set is
        known to be free, else once the plan says how."""
        description = _bodies.plan(dtype=array.dtype.str, shape=list(array.shape), fn=name, shm=True)
        tensor, staged = _is_tensor(value), [False]
        leaders = plane.leaders
        whole = leaders is None and _shm.symmetric(array.nbytes, plane.size, name in RING_SAFE)

        def build() -> tuple[list[list[Any]], Any]:
            slot, free = plane.free_slot(array.nbytes), plane.knows_free()
            if slot is not None:
                _shm.stage(slot, array, plane.rank, plane.size, whole)
                staged[0] = True
            return [[description, _bodies.shared_status(staged[0], free)]], None

        def job(msg: Message) -> _shm.SharedJob:
            host_plan = _shm.HostPlan(*_bodies.parse_shared_call(msg, plane.host))
            place = plane.place(array.nbytes)
            shared: _shm.SharedAllreduce = _shm.SharedAllreduce(
                msg.seq, plane.rank, plane.size, array, reduce, place, host_plan, staged[0], plane.leader,
                whole) if leaders is None else _shm.HostsAllreduce(
                msg.seq, plane.rank, plane.size, array, reduce, place, host_plan, staged[0], leaders,
                plane.host_index)
            if tensor:
                shared.convert = sys.modules["torch"].from_numpy
            return shared
        return Contribution(0, build, finish, FLAG_DATA, job, own=value)

    malformed = staticmethod(_one_each)

    def plan(self, contributions: list[Message], root: int,
             hosts: Optional[list[Optional[int]]] = None) -> list[list[Any]]:
        if contributions and len(contributions[0].segments) == 1 and len(contributions[0].segments[0]) == 2:
            return _shared_agreed(contributions, hosts)
        return _agreed(contributions)


class Reduce(Reducing):
    code = Op.REDUCE
    rooted = True
    malformed = staticmethod(_one_each)

    def contribute(self, here: Here, value: Any, reduce_fn: Any, root: Any) -> Contribution:
        root = check_root(root, here.size)
        finish = NOTHING if here.rank != root else OWN if here.size == 1 else ONE
        return Contribution(root, reducing(here, value, reduce_fn, root), finish, own=value)


class ReduceScatter(Reducing):
    """Rank i gets every rank's i-th value reduced in rank order with rank 0's
    function. Equal arrays (or CPU tensors) with a data plane, reduced by a
    numpy reduction (:data:`RING_SAFE`), go round the ring's reduce-scatter
    half, this rank's share coming out of it: the values are laid out one
    segment later, since rank r ends holding segment r + 1. A function of the
    program's own stays on the star: without the allgather half a rank may
    finish before another's function raised, and the call must fail alike."""

    code = Op.REDUCE_SCATTER
    each = True

    def contribute(self, here: Here, values: Any, reduce_fn: Any) -> Contribution:
        values = _per_rank(self.code, values, here.size)
        build = reducing(here, values, reduce_fn, 0, each=True)
        own = values[here.rank]
        finish = OWN if here.size == 1 else ONE
        name = _ring.reduction_name(reduce_fn)
        arrays = [_array(v, 0) for v in values] if here.data and name in RING_SAFE else []
        first = arrays[0] if arrays else None
        if (name is None or first is None
                or any(a is None or a.dtype != first.dtype or a.shape != first.shape for a in arrays)
                or first.nbytes * len(arrays) < here.data_min_bytes):
            return Contribution(0, build, finish, own=own)
        n, shape = here.size, first.shape
        description = _bodies.plan(dtype=first.dtype.str, shape=[n, *shape], fn=name)
        tensor = _is_tensor(own)

        def job(msg: Message) -> _ring.Transfer:
            numpy = sys.modules["numpy"]
            laid = numpy.concatenate([arrays[(s - 1) % n].reshape(-1) for s in range(n)])
            ring = _ring.RingAllreduce(here.rank, n, laid, here.reducer(name, reduce_fn), gather=False)
            ring.op = self.label  # its messages name reduce_scatter, not allreduce
            ring.finish = _tensor_out(tensor, lambda: ring.result().reshape(shape).copy())  # (its own
            # memory: a view would keep every rank's share alive)
            return ring
        return Contribution(0, lambda: ([[description]], None), finish, FLAG_DATA, job, own=own)

    malformed = staticmethod(_n_each)

    def described(self, dtype: str, shape: tuple[int, ...], fn: str) -> str:
        return f"{shape[0]} values, each a {dtype} array of shape {shape[1:]} reduced with {fn}"

    def plan(self, contributions: list[Message], root: int,
             hosts: Optional[list[Optional[int]]] = None) -> list[list[Any]]:
        return _agreed(contributions)


class Scan(Reducing):
    """Rank r gets the fold of ranks 0..r's values in rank order, with rank 0's function
    (mpi4py's ``scan``); ``exclusive``: of ranks 0..r-1, None on rank 0 (``exscan``)."""

    code = Op.SCAN
    exclusive = False
    malformed = staticmethod(_one_each)

    def contribute(self, here: Here, value: Any, reduce_fn: Any) -> Contribution:
        mine = (NOTHING if self.exclusive else OWN) if here.rank == 0 else ONE
        return Contribution(0, reducing(here, value, reduce_fn, 0), mine, own=value)

    def combine(self, seq: int, contributions: list[Message], root: int) -> Combine:
        if self.exclusive and len(contributions) > 1:  # (the last rank's value is in no result)
            contributions = contributions[:-1]
        return replace(super().combine(seq, contributions, root), prefix=True)

    def route_combined(self, size: int, root: int, results: list[list[Any]]) -> Routes:
        return [[]] + [[results[r - 1 if self.exclusive else r]] for r in range(1, size)]


class Exscan(Scan):
    code = Op.EXSCAN
    exclusive = True


class Broadcast(Operation):
    code = Op.BROADCAST
    rooted = True

    def contribute(self, here: Here, value: Any, root: Any) -> Contribution:
        if type(root) is not int or not 0 <= root < here.size:  # (an int in range: no call)
            root = check_root(root, here.size)
        if here.rank != root:
            chain = self._chain(here, root, None) if here.data else None
            if here.shared is None:
                return Contribution(root, _nothing, ONE, transfer=chain)
            staged = [False]  # (the root's value decides the way; its job is made once a plan comes)
            status = partial(_status, here.shared, staged)
            return Contribution(root, status, ONE, transfer=lambda msg: _either(_exchange(
                here, LABELS[Op.BROADCAST], None, staged, lambda parts: [(root, 0)],
                lambda msg, parts, got: [got[(root, 0)]]), chain)(msg))
        if not here.data and here.shared is None:
            return Contribution(root, _sent(value), OWN, own=value)
        segment = _serialize.dumps(value)
        parts, staged = _shared_parts(here, [segment]), [False]
        if parts is not None:
            return Contribution(root, _staged_build(here, parts, [segment], staged), OWN, FLAG_DATA,
                                _exchange(here, self.label, [segment], staged, lambda p: [],
                                          lambda msg, p, got: None), own=value)
        if not here.data:
            return Contribution(root, lambda: ([segment], None), OWN, own=value)
        plan = _bodies.sizes_plan(segment, here.data_min_bytes)
        if plan is None:
            return Contribution(root, lambda: ([segment], None), OWN, own=value)
        return Contribution(root, lambda: ([[plan]], None), OWN, FLAG_DATA, self._chain(here, root, segment),
                            own=value)

    @staticmethod
    def _chain(here: Here, root: int, segment: Optional[list[Any]]) -> Callable[[Message], _ring.Transfer]:
        """The job of a broadcast whose value goes down the chain (the root's
        plan says the sizes of its frames): the value's frames, as one part."""
        def job(msg: Message) -> _ring.Transfer:
            sizes = _bodies.parse_sizes(msg, here.max_frame_bytes)
            chain = _ring.ChainBroadcast(here.rank, here.size, root, sizes, segment)
            chain.finish = lambda: [chain.result()]
            return chain
        return job

    def malformed(self, contributions: list[Message], root: int) -> str:
        return "" if len(contributions[root].segments) == 1 else f"root {root} sent no value"

    def route(self, at: Combining, contributions: list[Message], root: int) -> Routes:
        value = contributions[root].segments  # as the root sent it, never unpickled here
        return [[] if r == root else value for r in range(len(contributions))]

    def plan(self, contributions: list[Message], root: int,
             hosts: Optional[list[Optional[int]]] = None) -> list[list[Any]]:
        sender = contributions[root]
        others = [r for r, c in enumerate(contributions) if c.flags & FLAG_DATA and r != root]
        if others or not sender.flags & FLAG_DATA or len(sender.segments) != 1:
            who = rank_list(others) if others else "the root"
            raise Malformed(f"only the root may send a data plan ({who} sent a malformed one)")
        if _bodies.is_shared(sender):  # through shared memory: the root alone writes
            return _exchange_plan(contributions, hosts, [root])
        return [[bytes(sender.segments[0][0])]]


class Allgather(Operation):
    code = Op.ALLGATHER

    def contribute(self, here: Here, value: Any) -> Contribution:
        if not here.data and here.shared is None:
            return Contribution(0, _sent(value), EVERY, own=value)
        segment = _serialize.dumps(value)  # before the seq: a value that cannot travel uses none
        rank, size = here.rank, here.size
        if here.shared is not None:
            return self._shared(here, value, segment)
        plan = _bodies.sizes_plan(segment, here.data_min_bytes)

        def job(msg: Message) -> _ring.Transfer:
            told = _bodies.parse_gather_plan(msg, size)
            ring = _ring.RingAllgather(rank, size, told, segment if told[rank] is not None else None)
            inline = iter(msg.segments[1:])
            slots = [None if s is not None else next(inline) for s in told]

            def finish() -> list[Any]:
                frames = ring.result()
                return [slots[r] or frames[r] for r in range(size)]
            ring.finish = finish
            return ring
        if plan is None:
            return Contribution(0, lambda: ([segment], None), EVERY, transfer=job, own=value)
        return Contribution(0, lambda: ([[plan]], None), EVERY, FLAG_DATA, job, own=value)

    @staticmethod
    def _shared(here: Here, value: Any, segment: list[Any]) -> Contribution:
        """Through the host's shared memory if large enough; else inline, with the plan if
        another rank's value goes through it."""
        rank, size = here.rank, here.size
        parts, staged = _shared_parts(here, [segment]), [False]

        def reads(told: Parts) -> list[tuple[int, int]]:
            return [(r, 0) for r in range(size) if told[r] is not None and r != rank]
        job = _exchange(here, "allgather", [segment] if parts is not None else None, staged, reads,
                        _gathered(size))
        if parts is None:
            return Contribution(0, lambda: ([segment], None), EVERY, transfer=job, own=value)
        build = _staged_build(here, parts, [segment], staged)
        return Contribution(0, build, EVERY, FLAG_DATA, job, own=value)

    malformed = staticmethod(_one_each)

    def route(self, at: Combining, contributions: list[Message], root: int) -> Routes:
        values = [c.segments[0] for c in contributions]
        return [values for _ in contributions]

    def plan(self, contributions: list[Message], root: int,
             hosts: Optional[list[Optional[int]]] = None) -> list[list[Any]]:
        """Some values go round the ring (or through shared memory): the plan names whose
        (and their frames' sizes); the small values come with it."""
        if any(c.flags & FLAG_DATA and _bodies.is_shared(c) for c in contributions):
            return _exchange_plan(contributions, hosts)
        sizes: list[Any] = []
        inline: list[list[Any]] = []
        for rank, c in enumerate(contributions):
            if len(c.segments) != 1:
                raise Malformed(f"rank {rank} sent no value")
            if not c.flags & FLAG_DATA:
                sizes.append(None)
                inline.append(c.segments[0])
                continue
            try:
                sizes.append(_bodies.parse_sizes(c))
            except WireError:
                raise Malformed(f"rank {rank} sent a malformed description") from None
        return [[_bodies.plan(sizes=sizes)], *inline]



class Gather(Operation):
    code = Op.GATHER
    rooted = True

    def contribute(self, here: Here, value: Any, root: Any) -> Contribution:
        root = check_root(root, here.size)
        rank, size = here.rank, here.size
        finish = EVERY if rank == root else NOTHING
        if here.shared is None:
            return Contribution(root, _sent(value), finish, own=value)
        segment = _serialize.dumps(value)  # through shared memory if large enough: only the root reads
        parts, staged = _shared_parts(here, [segment]), [False]

        def reads(told: Parts) -> list[tuple[int, int]]:
            return [(r, 0) for r in range(size) if told[r] is not None and r != rank] if rank == root else []
        job = _exchange(here, self.label, [segment] if parts is not None else None, staged, reads,
                        _gathered(size) if rank == root else lambda msg, told, got: None)
        if parts is None:
            return Contribution(root, lambda: ([segment], None), finish, transfer=job, own=value)
        return Contribution(root, _staged_build(here, parts, [segment], staged), finish, FLAG_DATA, job,
                            own=value)

    malformed = staticmethod(_one_each)

    def plan(self, contributions: list[Message], root: int,
             hosts: Optional[list[Optional[int]]] = None) -> list[list[Any]]:
        return _exchange_plan(contributions, hosts)

    def route(self, at: Combining, contributions: list[Message], root: int) -> Routes:
        values = [c.segments[0] for c in contributions]
        return [values if r == root else [] for r in range(len(contributions))]


class Scatter(Operation):
    code = Op.SCATTER
    rooted = True

    def contribute(self, here: Here, values: Any, root: Any) -> Contribution:
        root = check_root(root, here.size)
        rank = here.rank
        if rank != root:
            if here.shared is None:
                return Contribution(root, _nothing, ONE)
            staged = [False]  # (the root's values decide the way)
            return Contribution(root, partial(_status, here.shared, staged), ONE, transfer=_exchange(
                here, self.label, None, staged, lambda told: [(root, rank)],
                lambda msg, told, got: [got[(root, rank)]]))
        values = _per_rank(self.code, values, here.size, root)
        own = values[root]
        if here.shared is None:
            return Contribution(root, lambda: ([_serialize.dumps(v) for v in values], None), OWN, own=own)
        segments = [_serialize.dumps(v) for v in values]
        mine = [s if r != root else [] for r, s in enumerate(segments)]  # (its own stays here)
        parts, staged = _shared_parts(here, mine), [False]
        if parts is None:
            return Contribution(root, lambda: (segments, None), OWN, own=own)
        return Contribution(root, _staged_build(here, parts, mine, staged), OWN, FLAG_DATA,
                            _exchange(here, self.label, mine, staged, lambda told: [], lambda m, t, g: None),
                            own=own)

    def plan(self, contributions: list[Message], root: int,
             hosts: Optional[list[Optional[int]]] = None) -> list[list[Any]]:
        return _exchange_plan(contributions, hosts, [root])

    def malformed(self, contributions: list[Message], root: int) -> str:
        sent, n = len(contributions[root].segments), len(contributions)
        return "" if sent == n else f"root {root} sent {sent} values for {n} replicas"

    def route(self, at: Combining, contributions: list[Message], root: int) -> Routes:
        parts = contributions[root].segments  # the root keeps its own value
        return [[] if r == root else [parts[r]] for r in range(len(contributions))]


class Alltoall(Operation):
    code = Op.ALLTOALL

    def contribute(self, here: Here, values: Any) -> Contribution:
        values = _per_rank(self.code, values, here.size)
        rank, size = here.rank, here.size
        finish, own = EVERY, values[rank]
        if here.shared is None:
            return Contribution(0, lambda: ([_serialize.dumps(v) for v in values], None), finish, own=own)
        segments = [_serialize.dumps(v) for v in values]  # through shared memory if large enough
        mine = [s if r != rank else [] for r, s in enumerate(segments)]  # (its own stays here)
        parts, staged = _shared_parts(here, mine), [False]

        def reads(told: Parts) -> list[tuple[int, int]]:
            return [(r, rank) for r in range(size) if told[r] is not None and r != rank]
        job = _exchange(here, self.label, mine if parts is not None else None, staged, reads,
                        _gathered(size, rank))
        if parts is None:
            return Contribution(0, lambda: (segments, None), finish, transfer=job, own=own)
        return Contribution(0, _staged_build(here, parts, mine, staged), finish, FLAG_DATA, job, own=own)

    malformed = staticmethod(_n_each)

    def plan(self, contributions: list[Message], root: int,
             hosts: Optional[list[Optional[int]]] = None) -> list[list[Any]]:
        return _exchange_plan(contributions, hosts)

    def route(self, at: Combining, contributions: list[Message], root: int) -> Routes:
        return [[c.segments[r] for c in contributions] for r in range(len(contributions))]


class Barrier(Operation):
    code = Op.BARRIER


class Teardown(Operation):
    code = Op.TEARDOWN
    closes = True


class Shrink(Operation):
    code = Op.SHRINK  # (a healthy group: nothing to leave out)


class Grow(Operation):
    code = Op.GROW  # (rule 10)

    def contribute(self, here: Here, *args: Any) -> Contribution:
        return Contribution(0, _nothing, ONE)

    def route(self, at: Combining, contributions: list[Message], root: int) -> Routes:
        told = [_serialize.dumps(len(at.newcomers), "the number of newcomers")]
        return [told for _ in contributions]

    def completed(self, at: Combining, seq: int) -> list[Any]:
        return at.admit(seq)


class Split(Allgather):
    """A round of split(), subgroup() or dup(): an allgather on the star (a
    call of its own, so a rank splitting while another gathers is a mismatch;
    :mod:`zcollective._subgroups` makes three rounds). Its root says which of
    the three calls made it, so one rank's split beside another's dup is a
    mismatch too."""

    code = Op.SPLIT
    KINDS = ("split", "subgroup", "dup")  # by root

    def contribute(self, here: Here, value: Any, kind: int = 0) -> Contribution:
        return Contribution(kind, _sent(value), EVERY, own=value)

    def bad_root(self, root: int, size: int) -> str:
        return "" if 0 <= root < len(self.KINDS) else f"root {root} names none of split, subgroup and dup"

    def describe(self, root: int) -> str:
        return self.KINDS[root] if 0 <= root < len(self.KINDS) else f"{self.label}(root={root})"


OPERATIONS: dict[int, Operation] = {o.code: o for o in (
    Allreduce(), Reduce(), ReduceScatter(), Broadcast(), Allgather(), Gather(), Scatter(), Alltoall(),
    Barrier(), Teardown(), Grow(), Shrink(), Split(), Scan(), Exscan())}
BY_NAME = {o.label: o for o in OPERATIONS.values()}
SPOKEN = ",".join(o.label for _, o in sorted(OPERATIONS.items()))  # a JOIN's: a group's ranks know
# the same operations (a replica of another release whose protocol version matches may not)


def error_contribution(root: int, note: list[list[Any]]) -> Contribution:
    """A contribution that tells the others this rank's call failed here (``note``)."""
    return Contribution(root, lambda: (note, None), NOTHING, FLAG_LOCAL_ERROR)


def describe_call(op: int, root: int) -> str:
    operation = OPERATIONS.get(op)
    return operation.describe(root) if operation is not None else label(op)
