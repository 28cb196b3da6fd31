"""Every operation as one object: its code on the wire, what each rank sends
and how its result is made (:meth:`Operation.contribute`), the coordinator's check,
route (a reduction's: :class:`Reducing`, :class:`Combine`) and data plan (:meth:`Operation.malformed`,
:meth:`Operation.route`, :meth:`Operation.plan`), and its data-plane job. ``Group`` asks for an
operation by name (:data:`OPERATIONS`) and builds no message; the coordinator
looks the operation of a call up by its code. A new operation is a class
here, a ``Group`` method and a module function (docs/protocol.md,
*Operations*).
"""

from __future__ import annotations

import enum
import operator
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Union, cast

from .._format import _bodies, _serialize
from .._format._wire import FLAG_DATA, FLAG_LOCAL_ERROR, Message, WireError
from . import _ring, _shm
from ._shm import MAX_SYNCS  # noqa: F401 (the coordinator's bound, where it reads the operations)


class Op(enum.IntEnum):
    """An operation's code, the header's ``op`` byte (0: a control message's)."""

    NONE = 0
    ALLREDUCE = 1
    BROADCAST = 2
    ALLGATHER = 3
    GATHER = 4
    SCATTER = 5
    REDUCE = 6
    ALLTOALL = 7
    BARRIER = 8
    TEARDOWN = 9
    GROW = 10  # members admit the newcomers waiting (rule 10 of the coordinator)
    SHRINK = 11  # shrink() in a group that had not failed: a collective call like any other
    REDUCE_SCATTER = 12
    SPLIT = 13  # split(), subgroup(), dup(): each of their two rounds (never on the data plane)

    @property
    def label(self) -> str:
        return LABELS[self]


LABELS = {o: o.name.lower() for o in Op}  # Enum.name is slow on a hot path
NUMERIC_KINDS = frozenset("biufc")  # numpy dtype kinds the data plane reduces
RING_SAFE = frozenset({"add", "maximum", "minimum", "multiply"})  # reductions no rank's code can fail
Routes = list[list[list[Any]]]  # the segments each rank receives, by rank
Build = Callable[[], tuple[list[list[Any]], Any]]  # -> (segments, reduce function or None)
Finish = Callable[[Message], Any]  # the call's RESULT -> its value here
Outgoing = tuple[bytes, Message]  # a message the coordinator sends, and to whom
Parts = list[Optional[list[list[int]]]]  # by rank, the frame sizes of each value it writes into
# its host's shared memory (None: none)
UserCode = Callable[[Callable[..., Any]], Callable[..., Any]]  # a reduce function -> how it is called


def label(op: int) -> str:
    """An operation code's name (its number, if no operation has it)."""
    known = OPS.get(op)
    return LABELS[known] if known is not None else f"operation {op}"


@dataclass(frozen=True)
class Here:
    """What an operation knows of the rank that calls it."""

    rank: int
    size: int
    data: bool = False  # the group has a data plane ...
    data_min_bytes: int = 0  # ... and moves values this large on it
    max_frame_bytes: int = 0
    shared: Any = None  # this rank's part in its host's shared memory (_io._shared.SharedPlane) ...
    shared_min_bytes: int = 0  # ... which moves arrays this large
    across: Any = None  # ... with ranks on several hosts: its plane, for allreduce alone (the others
    # keep the data plane); arrays of shared_min_bytes go through it


class Combining(Protocol):
    """What an operation asks of the coordinator, and what its driver hands back to it
    (:mod:`zcollective._io._combine`)."""

    user_code: UserCode  # the driver's wrapper of a reduce function (rank 0's: _interrupts.user_code)
    newcomers: dict[bytes, Any]  # those a GROW admits (rule 10)

    def admit(self, seq: int) -> list[Any]:
        """Rule 10: WELCOME the newcomers into the group formed next (messages to send)."""

    def combined(self, asked: Combine, results: list[list[Any]]) -> list[Outgoing]:
        """``asked`` ran: the RESULTs to send (none if the call is no longer waiting for it)."""

    def combine_failed(self, asked: Combine, exc: BaseException) -> list[Outgoing]:
        """``asked`` raised ``exc``: the ERRORs to send (likewise)."""


@dataclass
class Contribution:
    """This rank's contribution to one call: ``build()`` serializes what it sends
    (after the call's seq is reserved), ``finish`` makes its value from the
    RESULT, ``transfer`` the data-plane job from a plan (``FLAG_DATA``)."""

    root: int
    build: Build
    finish: Finish
    flags: int = 0
    transfer: Optional[Callable[[Message], Union[_ring.Transfer, _shm.SharedJob]]] = None
    reduce: Any = None  # an allreduce's function, as this rank passed it (an interior rank of the
    # tree reduces its subtree's values with it)


class Refused(ValueError):
    """A contribution this rank cannot make (a wrong number of values): the others
    are told (an error note, at ``root``), so the call fails on every rank."""

    def __init__(self, message: str, root: int = 0) -> None:
        super().__init__(message)
        self.root = root


class Disagree(Exception):
    """The ranks' values cannot be combined (arrays that differ): a mismatch.
    ``described``: each rank's value as rank 0 found it, or None (its plan says)."""

    def __init__(self, described: Optional[list[str]] = None) -> None:
        super().__init__("the ranks' values disagree")
        self.described = described


class Malformed(Exception):
    """Parts no working replica sends (a ProtocolError): the text says why."""


class Unreadable(Exception):
    """A value or function rank 0 cannot unpickle (its sender's fault): the text names the rank."""


@dataclass(frozen=True)
class Combine:
    """The coordinator's outcome once every rank contributed to a reducing call:
    reduce every rank's first ``count`` values, each index in rank order, with
    the root's function ``fn`` (rank 0's own, as it is). The driver runs it
    (:func:`zcollective._io._combine.applied`) and hands back the results or what was raised."""

    seq: int
    op: Op
    root: int
    count: int
    fn: Any
    values: tuple[list[list[Any]], ...]  # each rank's segments, in rank order
    ranks: Optional[tuple[int, ...]] = None  # whose each is (a part of the tree: its first rank), if not
    # each rank's own
    names: Optional[tuple[Optional[str], ...]] = None  # each part's function, if a summary says
    grouped: bool = False  # a subtree's values, reduced ahead of rank 0: only if no grouping can matter


Step = Sequence[Union[Outgoing, Combine]]  # what one step of the coordinator returns, in order


def reduce_name(fn: Any) -> Optional[str]:
    """The name a function known to be associative goes by; None for any other. Known: the
    default ``a += b``, ``operator.add`` and ``mul``, numpy's ``add``, ``multiply``, ``maximum``,
    ``minimum`` (the data plane's names), builtin ``max`` and ``min``, and functions marked
    :func:`~zcollective.elementwise` (which the data plane's ring reduces out of order already)."""
    if fn is max or fn is min:
        return fn.__name__
    return _ring.reduction_name(fn) if fn is not None else None


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
        return Contribution(0, _nothing, _none)

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


def _nothing() -> tuple[list[list[Any]], Any]:
    return [], None


def _none(msg: Message) -> None:
    return None


def _first(msg: Message) -> Any:
    return _serialize.loads(msg.segments[0])


def _value(value: Any) -> Finish:
    return lambda msg: value


def _all(own: Any, rank: int) -> Finish:
    """A list result: every rank's value in rank order, this rank's own
    object in its slot (it is never copied back)."""
    def finish(msg: Message) -> list[Any]:
        return [own if i == rank else _serialize.loads(s) for i, s in enumerate(msg.segments)]
    return finish


def _sent(value: Any) -> Build:
    return lambda: ([_serialize.dumps(value)], None)


def check_root(root: Any, size: int) -> int:
    """``root`` as an int: any integer type (``numpy.int64``, anything with
    ``__index__``) but bool."""
    try:
        index = operator.index(root)
    except TypeError:
        index = -1
    if isinstance(root, bool) or not 0 <= index < size:
        raise ValueError(f"root={root!r} is not a rank of this group of {size} replicas")
    return index


def _per_rank(op: Op, values: Any, size: int, root: int = 0) -> list[Any]:
    """``values`` must hold one value per replica (else :class:`Refused`)."""
    try:
        count = len(values)
    except TypeError:
        count = -1
    if count != size:
        what = "no sequence" if count < 0 else f"{count} values"
        raise Refused(f"{LABELS[op]} needs one value per replica: got {what} for {size} replicas", root)
    return list(values)


def _reducer_of(here: Here, reduce_fn: Any, root: int) -> Callable[[], Any]:
    """Only the root's function is used; rank 0's stays in its process (the
    coordinator is there): handed over as it is when a pickle made now could
    not differ from it."""
    if not callable(reduce_fn):
        raise TypeError(f"reduce_fn must be callable, not {type(reduce_fn).__name__}")
    if here.rank != root:
        return lambda: None
    if root == 0 and _serialize.as_is(reduce_fn):
        return lambda: reduce_fn
    return lambda: _serialize.dumps_function(reduce_fn)


def _one_each(contributions: list[Message], root: int) -> str:
    empty = [r for r, c in enumerate(contributions) if len(c.segments) != 1]
    return f"{rank_list(empty)} sent no value" if empty else ""


def _n_each(contributions: list[Message], root: int) -> str:
    n = len(contributions)
    short = [r for r, c in enumerate(contributions) if len(c.segments) != n]
    return f"{rank_list(short)} did not send exactly {n} values" if short else ""


def rank_list(ranks: Iterable[int], world: Optional[Sequence[int]] = None) -> str:
    """``ranks 1,2``; a sub-group's (``world``: each rank's world rank) ``ranks 0,1 (world ranks 1,2)``."""
    ranks = sorted(ranks)
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {','.join(map(str, ranks))}{in_world(ranks, world)}" if ranks else "no ranks"


def in_world(ranks: Iterable[int], world: Optional[Sequence[int]], lead: str = " (", end: str = ")") -> str:
    """What ``ranks`` of a sub-group are in the world, for its error texts (``world``: each of its
    ranks' world rank); "" in the world itself, whose texts stay as they are."""
    if world is None:
        return ""
    ranks = list(ranks)
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{lead}world {word} {','.join(str(world[r]) if 0 <= r < len(world) else '?' for r in ranks)}{end}"


def group_name(world: Optional[Sequence[int]]) -> str:
    """How a sub-group's errors name it ("" for the world)."""
    if world is None:
        return ""
    shown = ",".join(map(str, world[:MAX_NAMED_RANKS])) + (",..." if len(world) > MAX_NAMED_RANKS else "")
    return f"the sub-group of world ranks {shown}"


MAX_NAMED_RANKS = 16  # a sub-group's name lists at most this many of its world ranks


def _agreed(contributions: list[Message]) -> list[list[Any]]:
    """The plan every rank sent alike (else a :class:`Disagree`)."""
    plans = {bytes(c.segments[0][0]) if c.flags & FLAG_DATA and len(c.segments) == 1
             and len(c.segments[0]) == 1 else None for c in contributions}
    if len(plans) != 1 or None in plans:  # the call matched; only its values disagree
        raise Disagree()
    return [[bytes(contributions[0].segments[0][0])]]


def _shared_agreed(contributions: list[Message], hosts: Optional[list[Optional[int]]]) -> list[list[Any]]:
    """A shared-memory call's plan: the description every rank sent alike (else a
    :class:`Disagree`), and by host whether every rank staged its input, whether some
    rank knows the set is free (see :mod:`zcollective._protocol._shm`)."""
    descriptions = {bytes(c.segments[0][0]) if c.flags & FLAG_DATA and len(c.segments) == 1
                    and len(c.segments[0]) == 2 else None for c in contributions}
    if len(descriptions) != 1 or None in descriptions:
        raise Disagree()
    return [[bytes(contributions[0].segments[0][0]), _host_flags(contributions, hosts)]]


def _host_flags(contributions: list[Message], hosts: Optional[list[Optional[int]]],
                readers: Optional[list[int]] = None) -> bytes:
    """By host: did every rank stage its part (a rank that sent no status did not), does some
    rank know the call's set of slots free (:func:`zcollective._format._bodies.shared_call`).
    ``readers``: ranks that write nothing, whose status is their one frame."""
    if hosts is None or any(h is None for h in hosts):
        raise Malformed("ranks that share no host's memory sent a shared-memory description")
    count = max(h for h in hosts if h is not None) + 1
    staged, free = [True] * count, [False] * count
    for rank, c in enumerate(contributions):
        host = cast(int, hosts[rank])
        reader = readers is not None and rank in readers and len(c.segments) == 1 and len(c.segments[0]) == 1
        if not reader and not (c.flags & FLAG_DATA and _bodies.is_shared(c)):
            staged[host] = False
            continue
        try:
            was_staged, knows_free = _bodies.parse_shared_status(c.segments[0][0 if reader else 1])
        except WireError:
            raise Malformed(f"rank {rank} sent a malformed shared-memory status") from None
        staged[host] = staged[host] and was_staged
        free[host] = free[host] or knows_free
    return _bodies.shared_call(staged, free)


def shared_plan(segments: list[list[Any]]) -> bool:
    """Is this plan a shared-memory call's (its ranks sync through the coordinator)?"""
    return len(segments) >= 1 and len(segments[0]) == 2


def _shared_parts(here: Here, own: list[list[Any]]) -> Optional[list[list[int]]]:
    """The frame sizes of ``own`` (values' frames: the parts this rank writes) if they go
    through the host's shared memory: at least the threshold in all, and room for them."""
    plane = here.shared
    if plane is None or sum(len(frames) for frames in own) > _bodies.MAX_PLAN_FRAMES:
        return None
    parts = [[memoryview(f).nbytes for f in frames] for frames in own]
    total = _shm.offsets(parts)[1]
    return parts if total >= here.shared_min_bytes and plane.fits(total) else None


Got = dict[tuple[int, int], list[Any]]  # (writer, part) -> the frames read


def _exchange(here: Here, op: str, own: Optional[list[list[Any]]], staged: list[bool],
              reads: Callable[[Parts], list[tuple[int, int]]],
              convert: Callable[[Message, Parts, Got], Any]) -> Callable[[Message], Any]:
    """The job of a call whose values go through the host's shared memory, from its plan:
    this rank writes ``own`` (its parts, each a value's frames; None: nothing), reads the
    (writer, part) that ``reads(parts)`` names, and its value is ``convert(plan, parts, got)``."""
    plane = here.shared

    def job(msg: Message) -> _shm.SharedJob:
        parts = _bodies.parse_exchange_plan(msg, here.size)
        host_plan = _shm.HostPlan(*_bodies.parse_shared_call(msg, plane.host))
        need = max((_shm.offsets(p)[1] for p in parts if p is not None), default=0)
        ranks = plane.ranks
        shared = _shm.SharedExchange(op, msg.seq, plane.rank, plane.size, plane.place(need), host_plan,
                                     staged[0], plane.leader, [parts[r] for r in ranks], own,
                                     [(ranks.index(w), p) for w, p in reads(parts)])
        shared.convert = lambda got: convert(msg, parts, {(ranks[w], p): f for (w, p), f in got.items()})
        return shared
    return job


def _status(here: Here, staged: list[bool]) -> Build:
    """The contribution of a rank that writes nothing to a call that may go through shared
    memory: its status, so that the plan needs no sync when every rank knew its set free."""
    plane = here.shared

    def build() -> tuple[list[list[Any]], Any]:
        staged[0] = plane.knows_free()
        return [[_bodies.shared_status(staged[0], staged[0])]], None
    return build


def _gathered(rank: int, size: int, own: Any, index: Optional[int] = None
              ) -> Callable[[Message, Parts, Got], list[Any]]:
    """Every rank's value (``index``: its part for this rank) from a plan and what was read
    (those of ranks that wrote none came inline, after the plan: all their parts); this
    rank's slot holds ``own``."""
    def convert(msg: Message, told: Parts, got: Got) -> list[Any]:
        per, part = (1, 0) if index is None else (size, index)
        inline, at, out = msg.segments[1:], 0, []
        for r in range(size):
            if told[r] is None:  # (inline: all its parts, in rank order)
                frames, at = inline[at + part], at + per
            else:
                frames = got.get((r, part), [])
            out.append(own if r == rank else _serialize.loads(frames))
        return out
    return convert


def _exchange_plan(contributions: list[Message], hosts: Optional[list[Optional[int]]],
                   writers: Optional[list[int]] = None) -> list[list[Any]]:
    """The plan of a call some of whose values go through shared memory: each rank that sent
    a description (``writers``: only those may), its parts; the others' values (all their
    segments) follow it, inline, unless they only read (``writers`` given)."""
    told: Parts = []
    inline: list[list[Any]] = []
    readers = None if writers is None else [r for r in range(len(contributions)) if r not in writers]
    for rank, c in enumerate(contributions):
        if not c.flags & FLAG_DATA:
            if readers is not None and rank not in readers:
                raise Malformed(f"rank {rank} sent no shared-memory description")
            told.append(None)
            inline.extend(c.segments if readers is None else [])
            continue
        try:
            if (readers is not None and rank in readers) or not _bodies.is_shared(c) or len(c.segments) != 1:
                raise WireError("not a shared-memory description")
            told.append(_bodies.parse_parts(c.segments[0][0]))
        except WireError:
            raise Malformed(f"rank {rank} sent a malformed shared-memory description") from None
    return [[_bodies.exchange_plan(told), _host_flags(contributions, hosts, readers)], *inline]


def _either(shared: Callable[[Message], Any], chain: Optional[Callable[[Message], Any]]
            ) -> Callable[[Message], Any]:
    """The job of a plan through shared memory, or else of the data plane's (a broadcast's
    readers do not know which the root chose)."""
    def job(msg: Message) -> Any:
        if _bodies.is_shared(msg) or chain is None:
            return shared(msg)
        return chain(msg)
    return job


def _staged_build(here: Here, parts: list[list[int]], own: list[list[Any]], staged: list[bool]) -> Build:
    """Build a shared-memory contribution: ``own`` (its parts: values' frames, of sizes
    ``parts``) written into this rank's slot now if it knows its set free; its description
    and status."""
    plane = here.shared
    description = _bodies.parts_plan(parts)

    def build() -> tuple[list[list[Any]], Any]:
        slot, free = plane.free_slot(_shm.offsets(parts)[1]), plane.knows_free()
        if slot is not None:
            _shm.write_parts(slot, own)
            staged[0] = True
        return [[description, _bodies.shared_status(staged[0], free)]], None
    return build


# -- arrays on the data plane --------------------------------------------------


def cpu_tensor(value: Any, least: int) -> Any:
    """``value`` as a numpy array sharing its memory, if it is a torch tensor
    of at least ``least`` bytes that numpy can see without a copy (CPU,
    contiguous, a dtype numpy has, no conjugate or negative bit, not
    requiring grad); else None. torch is looked up, never imported."""
    torch = sys.modules.get("torch")
    if torch is None or type(value) is not torch.Tensor:
        return None
    try:
        if (value.device.type != "cpu" or value.requires_grad or not value.is_contiguous()
                or value.is_sparse or value.is_quantized or value.is_conj() or value.is_neg()
                or value.element_size() * value.numel() < least):
            return None
        return value.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, float8, complex32)
        return None


def _array(value: Any, least: int) -> Any:
    """``value`` as a C-contiguous numeric numpy array of at least ``least``
    bytes (a CPU tensor's memory, as numpy sees it), or None."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    tensor = cpu_tensor(value, least)
    if tensor is not None:
        value = tensor  # the same memory, seen by numpy
    elif not isinstance(value, numpy.ndarray):  # (subclasses too: a memmap is an array)
        return None
    if value.dtype.kind not in NUMERIC_KINDS or value.nbytes < least or value.dtype.hasobject:
        return None
    if not value.flags.c_contiguous:  # a view: what it shows, copied (the star pickles so too),
        value = numpy.ascontiguousarray(value)  # so the layout never decides the path
    return value


def _tensor_out(tensor: bool, result: Callable[[], Any]) -> Callable[[], Any]:
    """A tensor in, a tensor out (sharing the result's memory)."""
    if not tensor:
        return result
    from_numpy = sys.modules["torch"].from_numpy
    return lambda: from_numpy(result())


def _is_tensor(value: Any) -> bool:
    return not isinstance(value, sys.modules["numpy"].ndarray)


# -- the operations ------------------------------------------------------------


class Reducing(Operation):
    """An operation whose completed call asks for a reduction (:meth:`combine`),
    then routes its results: to the root alone, if it has one, else to all."""

    each = False  # each rank's every value is reduced by index (reduce_scatter), not its one value

    def combine(self, seq: int, contributions: list[Message], root: int) -> Combine:
        count, values = len(contributions) if self.each else 1, tuple([c.segments for c in contributions])
        return Combine(seq, self.code, root, count, contributions[root].fn, values)

    def route_combined(self, size: int, root: int, results: list[list[Any]]) -> Routes:
        """The segments each rank of ``size`` receives, given the reduction's ``results``."""
        if self.each:  # rank i: index i's
            return [[result] for result in results]
        return [results if r == root or not self.rooted else [] for r in range(size)]


class Allreduce(Reducing):
    code = Op.ALLREDUCE

    def contribute(self, here: Here, value: Any, reduce_fn: Any) -> Contribution:
        fn = _reducer_of(here, reduce_fn, 0)
        finish = _value(value) if here.size == 1 else _first  # nothing was combined with it
        plane = here.shared if here.shared is not None else here.across
        name = _ring.reduction_name(reduce_fn) if here.data or plane is not None else None
        if name is not None and plane is not None:
            array = _array(value, here.shared_min_bytes)
            if array is not None and plane.fits(array.nbytes):
                return self._shared(plane, value, array, name, reduce_fn, finish)
        array = _array(value, here.data_min_bytes) if name is not None and here.data else None
        if array is None or name is None:
            return Contribution(0, lambda: ([_serialize.dumps(value)], fn()), finish, reduce=reduce_fn)
        description = _bodies.plan(dtype=array.dtype.str, shape=list(array.shape), fn=name)
        tensor = _is_tensor(value)

        def job(msg: Message) -> _ring.Transfer:
            ring = _ring.RingAllreduce(here.rank, here.size, array, _ring.reducer(name, reduce_fn))
            ring.finish = _tensor_out(tensor, ring.result)
            return ring
        return Contribution(0, lambda: ([[description]], None), finish, FLAG_DATA, job)

    @staticmethod
    def _shared(plane: Any, value: Any, array: Any, name: str, reduce_fn: Any,
                finish: Finish) -> Contribution:
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
            reduce, place = _ring.reducer(name, reduce_fn), plane.place(array.nbytes)
            shared: _shm.SharedAllreduce = _shm.SharedAllreduce(
                msg.seq, plane.rank, plane.size, array, reduce, place, host_plan, staged[0], plane.leader,
                whole) if leaders is None else _shm.HostsAllreduce(
                msg.seq, plane.rank, plane.size, array, reduce, place, host_plan, staged[0], leaders,
                plane.host_index)
            if tensor:
                shared.convert = sys.modules["torch"].from_numpy
            return shared
        return Contribution(0, build, finish, FLAG_DATA, job)

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
        fn = _reducer_of(here, reduce_fn, root)
        finish = _none if here.rank != root else _value(value) if here.size == 1 else _first
        return Contribution(root, lambda: ([_serialize.dumps(value)], fn()), finish)


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
        fn = _reducer_of(here, reduce_fn, 0)
        own = values[here.rank]
        finish = _value(own) if here.size == 1 else _first
        name = _ring.reduction_name(reduce_fn)
        arrays = [_array(v, 0) for v in values] if here.data and name in RING_SAFE else []
        first = arrays[0] if arrays else None
        if (name is None or first is None
                or any(a is None or a.dtype != first.dtype or a.shape != first.shape for a in arrays)
                or first.nbytes * len(arrays) < here.data_min_bytes):
            return Contribution(0, lambda: ([_serialize.dumps(v) for v in values], fn()), finish)
        n, shape = here.size, first.shape
        description = _bodies.plan(dtype=first.dtype.str, shape=[n, *shape], fn=name)
        tensor = _is_tensor(own)

        def job(msg: Message) -> _ring.Transfer:
            numpy = sys.modules["numpy"]
            laid = numpy.concatenate([arrays[(s - 1) % n].reshape(-1) for s in range(n)])
            ring = _ring.RingAllreduce(here.rank, n, laid, _ring.reducer(name, reduce_fn), gather=False)
            ring.op = self.label  # its messages name reduce_scatter, not allreduce
            ring.finish = _tensor_out(tensor, lambda: ring.result().reshape(shape).copy())  # (its own
            # memory: a view would keep every rank's share alive)
            return ring
        return Contribution(0, lambda: ([[description]], None), finish, FLAG_DATA, job)

    malformed = staticmethod(_n_each)

    def described(self, dtype: str, shape: tuple[int, ...], fn: str) -> str:
        return f"{shape[0]} values, each a {dtype} array of shape {shape[1:]} reduced with {fn}"

    def plan(self, contributions: list[Message], root: int,
             hosts: Optional[list[Optional[int]]] = None) -> list[list[Any]]:
        return _agreed(contributions)


class Broadcast(Operation):
    code = Op.BROADCAST
    rooted = True

    def contribute(self, here: Here, value: Any, root: Any) -> Contribution:
        root = check_root(root, here.size)
        if here.rank != root:
            chain = self._chain(here, root, None) if here.data else None
            if here.shared is None:
                return Contribution(root, _nothing, _first, transfer=chain)
            staged = [False]  # (the root's value decides the way)
            return Contribution(root, _status(here, staged), _first, transfer=_either(_exchange(
                here, self.label, None, staged, lambda parts: [(root, 0)],
                lambda msg, parts, got: _serialize.loads(got[(root, 0)])), chain))
        if not here.data and here.shared is None:
            return Contribution(root, _sent(value), _value(value))
        segment = _serialize.dumps(value)
        parts, staged = _shared_parts(here, [segment]), [False]
        if parts is not None:
            return Contribution(root, _staged_build(here, parts, [segment], staged), _value(value), FLAG_DATA,
                                _exchange(here, self.label, [segment], staged, lambda p: [],
                                          lambda msg, p, got: value))
        if not here.data:
            return Contribution(root, lambda: ([segment], None), _value(value))
        plan = _bodies.sizes_plan(segment, here.data_min_bytes)
        if plan is None:
            return Contribution(root, lambda: ([segment], None), _value(value))
        return Contribution(root, lambda: ([[plan]], None), _value(value), FLAG_DATA,
                    self._chain(here, root, segment, value))

    @staticmethod
    def _chain(here: Here, root: int, segment: Optional[list[Any]], value: Any = None
               ) -> Callable[[Message], _ring.Transfer]:
        """The job of a broadcast whose value goes down the chain (the root's
        plan says the sizes of its frames)."""
        def job(msg: Message) -> _ring.Transfer:
            sizes = _bodies.parse_sizes(msg, here.max_frame_bytes)
            chain = _ring.ChainBroadcast(here.rank, here.size, root, sizes, segment)
            chain.finish = (lambda: value) if segment is not None else (
                lambda: _serialize.loads(chain.result()))
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
            return Contribution(0, _sent(value), _all(value, here.rank))
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
                return [value if r == rank else _serialize.loads(slots[r] or frames[r])  # type: ignore[arg-type]
                        for r in range(size)]
            ring.finish = finish
            return ring
        if plan is None:
            return Contribution(0, lambda: ([segment], None), _all(value, rank), transfer=job)
        return Contribution(0, lambda: ([[plan]], None), _all(value, rank), FLAG_DATA, job)

    @staticmethod
    def _shared(here: Here, value: Any, segment: list[Any]) -> Contribution:
        """Through the host's shared memory if large enough; else inline, with the plan if
        another rank's value goes through it."""
        rank, size = here.rank, here.size
        parts, staged = _shared_parts(here, [segment]), [False]

        def reads(told: Parts) -> list[tuple[int, int]]:
            return [(r, 0) for r in range(size) if told[r] is not None and r != rank]
        job = _exchange(here, "allgather", [segment] if parts is not None else None, staged, reads,
                        _gathered(rank, size, value))
        if parts is None:
            return Contribution(0, lambda: ([segment], None), _all(value, rank), transfer=job)
        build = _staged_build(here, parts, [segment], staged)
        return Contribution(0, build, _all(value, rank), FLAG_DATA, job)

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
        finish = _all(value, rank) if rank == root else _none
        if here.shared is None:
            return Contribution(root, _sent(value), finish)
        segment = _serialize.dumps(value)  # through shared memory if large enough: only the root reads
        parts, staged = _shared_parts(here, [segment]), [False]

        def reads(told: Parts) -> list[tuple[int, int]]:
            return [(r, 0) for r in range(size) if told[r] is not None and r != rank] if rank == root else []
        gathered = _gathered(rank, size, value)
        job = _exchange(here, self.label, [segment] if parts is not None else None, staged, reads,
                        lambda msg, told, got: gathered(msg, told, got) if rank == root else None)
        if parts is None:
            return Contribution(root, lambda: ([segment], None), finish, transfer=job)
        return Contribution(root, _staged_build(here, parts, [segment], staged), finish, FLAG_DATA, job)

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
                return Contribution(root, _nothing, _first)
            staged = [False]  # (the root's values decide the way)
            return Contribution(root, _status(here, staged), _first, transfer=_exchange(
                here, self.label, None, staged, lambda told: [(root, rank)],
                lambda msg, told, got: _serialize.loads(got[(root, rank)])))
        values = _per_rank(self.code, values, here.size, root)
        own = values[root]
        if here.shared is None:
            return Contribution(root, lambda: ([_serialize.dumps(v) for v in values], None), _value(own))
        segments = [_serialize.dumps(v) for v in values]
        mine = [s if r != root else [] for r, s in enumerate(segments)]  # (its own stays here)
        parts, staged = _shared_parts(here, mine), [False]
        if parts is None:
            return Contribution(root, lambda: (segments, None), _value(own))
        return Contribution(root, _staged_build(here, parts, mine, staged), _value(own), FLAG_DATA,
                            _exchange(here, self.label, mine, staged, lambda told: [], lambda m, t, g: own))

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
        finish = _all(values[rank], rank)
        if here.shared is None:
            return Contribution(0, lambda: ([_serialize.dumps(v) for v in values], None), finish)
        segments = [_serialize.dumps(v) for v in values]  # through shared memory if large enough
        mine = [s if r != rank else [] for r, s in enumerate(segments)]  # (its own stays here)
        parts, staged = _shared_parts(here, mine), [False]

        def reads(told: Parts) -> list[tuple[int, int]]:
            return [(r, rank) for r in range(size) if told[r] is not None and r != rank]
        job = _exchange(here, self.label, mine if parts is not None else None, staged, reads,
                        _gathered(rank, size, values[rank], rank))
        if parts is None:
            return Contribution(0, lambda: (segments, None), finish, transfer=job)
        return Contribution(0, _staged_build(here, parts, mine, staged), finish, FLAG_DATA, job)

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
        return Contribution(0, _nothing, _first)

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
        return Contribution(kind, _sent(value), _all(value, here.rank))

    def bad_root(self, root: int, size: int) -> str:
        return "" if 0 <= root < len(self.KINDS) else f"root {root} names none of split, subgroup and dup"

    def describe(self, root: int) -> str:
        return self.KINDS[root] if 0 <= root < len(self.KINDS) else f"{self.label}(root={root})"


OPERATIONS: dict[int, Operation] = {o.code: o for o in (
    Allreduce(), Reduce(), ReduceScatter(), Broadcast(), Allgather(), Gather(), Scatter(), Alltoall(),
    Barrier(), Teardown(), Grow(), Shrink(), Split())}
BY_NAME = {o.label: o for o in OPERATIONS.values()}
SPOKEN = ",".join(o.label for _, o in sorted(OPERATIONS.items()))  # a JOIN's: a group's ranks know
# the same operations (a replica of another release whose protocol version matches may not)
OPS = {int(o): o for o in Op}


def error_contribution(root: int, note: list[list[Any]]) -> Contribution:
    """A contribution that tells the others this rank's call failed here (``note``)."""
    return Contribution(root, lambda: (note, None), _none, FLAG_LOCAL_ERROR)


def describe_call(op: int, root: int) -> str:
    operation = OPERATIONS.get(op)
    return operation.describe(root) if operation is not None else label(op)
