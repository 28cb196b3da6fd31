"""The operations' plans and jobs off the star (:mod:`._ops`): plans every rank sent alike,
values through the host's shared memory, and arrays (numpy's, CPU tensors) for the data plane.
"""

from __future__ import annotations

import operator
import sys
from functools import partial
from itertools import chain
from operator import attrgetter
from typing import Any, Callable, Optional, cast

from .._format import _bodies, _serialize
from .._format._wire import FLAG_DATA, Message, WireError
from . import _shm
from ._ops_types import (
    LABELS,
    NUMERIC_KINDS,
    Build,
    Disagree,
    Here,
    Malformed,
    Op,
    Parts,
    Refused,
    rank_list,
)


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
    if plane is None:
        return None
    frames = list(chain.from_iterable(own))  # (no Python call: a small value, the common call, is
    count = len(frames)  # below the threshold even with each frame's padding to its cache line)
    if count > _bodies.MAX_PLAN_FRAMES or sum(map(len, frames)) + count * _shm.LINE < here.shared_min_bytes:
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


def _status(plane: Any, staged: list[bool]) -> tuple[list[list[Any]], Any]:
    """The contribution of a rank that writes nothing to a call that may go through shared
    memory (``plane``, this rank's part in its host's): its status, so that the plan needs no
    sync when every rank knew its set free (a build: ``partial(_status, plane, staged)``)."""
    staged[0] = plane.knows_free()
    return [[_bodies.shared_status(staged[0], staged[0])]], None


def _gathered(size: int, index: Optional[int] = None) -> Callable[[Message, Parts, Got], list[Any]]:
    """Every rank's value's frames (``index``: its part for this rank), by rank, from a plan and
    what was read (those of ranks that wrote none came inline, after the plan: all their parts);
    the call runner unpickles them, this rank's own value in its slot."""
    def convert(msg: Message, told: Parts, got: Got) -> list[Any]:
        per, part = (1, 0) if index is None else (size, index)
        inline, at, out = msg.segments[1:], 0, []
        for r in range(size):
            if told[r] is None:  # (inline: all its parts, in rank order)
                frames, at = inline[at + part], at + per
            else:
                frames = got.get((r, part), [])
            out.append(frames)
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


PLAIN = (int, float, complex, str, bytes, list, tuple, dict, type(None))  # never an array (a numpy
# scalar may be a float: not an array either)


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


# -- pieces of the rows: builds, checks ------------------------------------------


def _nothing() -> tuple[list[list[Any]], Any]:
    return [], None


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


def reducing(here: Here, value: Any, reduce_fn: Any, root: int, each: bool = False) -> Build:
    """Build a reduction's contribution: ``value`` pickled (``each``: every value of it), with
    the function (only the root's is used; rank 0's stays in its process, where the coordinator
    is: handed over as it is when a pickle made now could not differ from it)."""
    if not callable(reduce_fn):
        raise TypeError(f"reduce_fn must be callable, not {type(reduce_fn).__name__}")
    if here.rank != root:
        return partial(_with, value, None, each)
    if root == 0 and _serialize.as_is(reduce_fn):
        return partial(_with, value, reduce_fn, each)
    return partial(_with, value, reduce_fn, each, True)


def _with(value: Any, fn: Any, each: bool, pickled: bool = False) -> tuple[list[list[Any]], Any]:
    segments = [_serialize.dumps(v) for v in value] if each else [_serialize.dumps(value)]
    return segments, _serialize.dumps_function(fn) if pickled else fn


def _one_each(contributions: list[Message], root: int) -> str:
    if set(map(len, map(attrgetter("segments"), contributions))) == {1}:  # (no Python call: the common call)
        return ""
    empty = [r for r, c in enumerate(contributions) if len(c.segments) != 1]
    return f"{rank_list(empty)} sent no value" if empty else ""


def _n_each(contributions: list[Message], root: int) -> str:
    n = len(contributions)
    short = [r for r, c in enumerate(contributions) if len(c.segments) != n]
    return f"{rank_list(short)} did not send exactly {n} values" if short else ""
