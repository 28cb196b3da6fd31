"""Same-host schedules: what each rank of a host does with its host's shared-memory segment for one call,
between syncs. Pure: the segment comes as a numpy array of bytes (:mod:`zcollective._io._shared` maps it and
sends the syncs). See docs/protocol.md, *Shared memory* (two sets of slots, staged inputs, syncs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ._ring import HOSTS, RingAllreduce, Transfer, _bounds

CREATE, ATTACH, UNLINK = "create", "attach", "unlink"  # the segment's steps
SYNC = "sync"  # every rank of the host reached this point
STAGE, REDUCE, COLLECT = "stage", "reduce", "collect"  # the memory's steps
RING = "ring"  # a host's leader: the ring between hosts (the data plane moves it)
PUBLISH, READ = "publish", "read"  # ... which its leader writes into its slot, the others read
BLOCK_BYTES = 1 << 18  # a reduction goes block by block, its accumulator kept in the L2 cache
SYMMETRIC_MAX_BYTES = 2 << 20  # up to this much read of the others' inputs, every rank reduces the whole
# array (no sync); beyond, its own slice then a sync (benchmarks/README.md, *Shared memory*)
MAX_SYNCS = 8  # syncs per call, at most (the coordinator takes no later one)


def aligned(nbytes: int) -> int:
    """The slot capacity that holds ``nbytes`` (a multiple of 64 KiB: slots start on pages)."""
    return -(-max(1, nbytes) // (1 << 16)) << 16


@dataclass(frozen=True)
class Place:
    """Where a call's data goes, alike on every rank of a host (:meth:`SharedPlane.place`)."""

    set: int  # which set of slots
    capacity: int  # bytes per slot of the segment the call uses
    gen: int  # that segment's generation
    grow: bool  # the call makes that segment (its array does not fit the last one)
    index: int = 0  # the calls placed before it (the set is this modulo 2)


@dataclass(frozen=True)
class HostPlan:
    """What the coordinator's plan says of this host's ranks."""

    staged: bool  # every one wrote its input when it made the call
    free: bool  # some one knows the set is free (its last call here completed)


def schedule(place: Place, plan: HostPlan, staged: bool, leader: bool, tail: list[str]) -> list[str]:
    """The steps before ``tail``: make or reach the segment, write the input, and the syncs."""
    if place.grow:  # a new segment: made at a sync, its name unlinked at the next (linked only meanwhile)
        made = [SYNC, CREATE, SYNC] if leader else [SYNC, SYNC, ATTACH]
        return made + [STAGE, SYNC, UNLINK] + tail
    if plan.staged:  # every input is in: the plan was the barrier
        return list(tail)
    return ([] if plan.free else [SYNC]) + ([] if staged else [STAGE]) + [SYNC] + tail


def symmetric(nbytes: int, size: int, safe: bool) -> bool:
    """Does every rank reduce the whole array (else its own slice, then a sync)? Only if ``safe``: a
    program's function that raises on one rank must fail the call on all, at a sync after it."""
    return safe and nbytes * (size - 1) <= SYMMETRIC_MAX_BYTES


def slice_of(elements: int, size: int, rank: int) -> tuple[int, int]:
    """The elements rank ``rank`` of ``size`` reduces when each reduces a slice."""
    return _bounds(elements, size)[rank]


def stage(slot: Any, array: Any, rank: int, size: int, whole: bool) -> None:
    """Write ``array`` into ``slot`` (bytes): all of it (``whole``: every rank reduces the whole array), or
    all but this rank's own slice (it reads that from ``array`` itself)."""
    flat = array.reshape(-1)
    into = slot[:flat.nbytes].view(flat.dtype)
    if whole:
        into[...] = flat
        return
    start, end = slice_of(flat.size, size, rank)
    into[:start] = flat[:start]
    into[end:] = flat[end:]


def reduce_blocks(out: Any, sources: list[Any], reduce: Callable[[Any, Any, Any], None]) -> None:
    """``out = reduce(...reduce(s0, s1)..., s_last)`` in order, block by block (stays in cache)."""
    if len(sources) == 1:
        out[...] = sources[0]
        return
    per = max(1, BLOCK_BYTES // max(1, out.itemsize))
    for s in range(0, out.size, per):
        acc = out[s:s + per]
        reduce(acc, sources[0][s:s + per], sources[1][s:s + per])
        for source in sources[2:]:
            reduce(acc, acc, source[s:s + per])


class SharedJob:
    """One call's steps at one rank: the plane runs :attr:`steps`, calling :meth:`memory` for each."""

    shared = True  # (a data-plane Transfer has none: the driver moves each its own way)
    pickled = False  # its value is parts to unpickle (the call runner's :meth:`then`), not arrays
    kind_name = "shared memory"
    op = "?"

    def __init__(self, seq: int, rank: int, size: int, place: Place, steps: list[str]) -> None:
        self.seq = seq
        self.rank = rank  # among the host's ranks
        self.size = size
        self.place = place
        self.steps = steps
        self.at = 0  # the next step
        self.syncs = 0  # syncs passed
        self.asked = False  # this rank said it reached the next sync
        self.received_bytes = 0
        self.convert: Optional[Callable[[Any], Any]] = None  # the result's last touch (array to tensor);
        # never a method of the job's own: a reference cycle would hold its arrays until gc runs

    def finish(self) -> Any:
        """The call's value, once done."""
        out = self.result()
        return out if self.convert is None else self.convert(out)

    def then(self, decode: Callable[[Any], Any]) -> None:
        """The call's value is ``decode`` of what it made (the call runner's decoder)."""
        made = self.convert
        self.convert = decode if made is None else lambda out: decode(made(out))

    @property
    def step(self) -> Optional[str]:
        return self.steps[self.at] if self.at < len(self.steps) else None

    def advance(self) -> None:
        if self.steps[self.at] == SYNC:
            self.syncs += 1
            self.asked = False
        self.at += 1

    def synced(self, phase: int) -> bool:
        """Every rank of the host reached sync ``phase``: True if this job waited for it."""
        if self.step != SYNC or phase != self.syncs or not self.asked:
            return False
        self.advance()
        return True

    def memory(self, step: str, slots: Any) -> None:
        """Do ``step`` on ``slots``: this call's set, one row of bytes per rank."""
        raise NotImplementedError

    def ring(self) -> Transfer:
        """The transfer of its :data:`RING` step (a job across hosts alone has one)."""
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError

    def progress(self) -> str:
        step = self.step
        where = "done" if step is None else (
            f"waiting at sync {self.syncs} for the others on this host" if step == SYNC else f"at {step}")
        return (f"{self.kind_name} on rank {self.rank} of {self.size} on this host: {where} "
                f"(steps {', '.join(self.steps) or 'none'})")


class SharedAllreduce(SharedJob):
    """An allreduce through the segment: every rank reduces the whole array, or its own slice which
    the others copy (:func:`symmetric`); in rank order, so the same bits as the star."""

    kind_name = "shared-memory allreduce"
    op = "allreduce"

    def __init__(self, seq: int, rank: int, size: int, array: Any, reduce: Callable[[Any, Any, Any], None],
                 place: Place, plan: HostPlan, staged: bool, leader: bool, whole: bool) -> None:
        import numpy
        self._input = array.reshape(-1)
        self._shape = array.shape
        self._reduce = reduce
        self._out = numpy.empty_like(self._input)
        self._whole = whole  # (symmetric())
        super().__init__(seq, rank, size, place, schedule(place, plan, staged, leader, self._tail(leader)))

    def _tail(self, leader: bool) -> list[str]:
        """The operation's own steps."""
        return [REDUCE] if self._whole else [REDUCE, SYNC, COLLECT]

    def _views(self, slots: Any) -> list[Any]:
        """Every rank's input, in rank order (this rank's own from its array)."""
        flat, n = self._input, self._input.nbytes
        return [flat if k == self.rank else slots[k, :n].view(flat.dtype) for k in range(self.size)]

    def memory(self, step: str, slots: Any) -> None:
        flat, out = self._input, self._out
        if step == STAGE:
            stage(slots[self.rank], flat, self.rank, self.size, self._whole)
            return
        views = self._views(slots)
        if self._whole:  # (REDUCE: the whole array)
            reduce_blocks(out, views, self._reduce)
            self.received_bytes = flat.nbytes * (self.size - 1)
            return
        if step == REDUCE:  # this rank's slice, then published in its own slot
            start, end = slice_of(flat.size, self.size, self.rank)
            reduce_blocks(out[start:end], [v[start:end] for v in views], self._reduce)
            views[self.rank] = slots[self.rank, :flat.nbytes].view(flat.dtype)
            views[self.rank][start:end] = out[start:end]
            self.received_bytes = (flat.nbytes // self.size) * (self.size - 1)
            return
        for k in range(self.size):  # COLLECT: the others' slices
            if k != self.rank:
                start, end = slice_of(flat.size, self.size, k)
                out[start:end] = views[k][start:end]
        self.received_bytes += (flat.nbytes // self.size) * (self.size - 1)

    def result(self) -> Any:
        return self._out.reshape(self._shape)


class HostsAllreduce(SharedAllreduce):
    """An allreduce of ranks on several hosts: the host reduces in the segment, its leader takes the
    sum round the leaders' ring (``via`` :data:`HOSTS`) and writes the result for the others."""

    kind_name = "shared-memory allreduce across hosts"

    def __init__(self, seq: int, rank: int, size: int, array: Any, reduce: Callable[[Any, Any, Any], None],
                 place: Place, plan: HostPlan, staged: bool, leaders: list[int], host: int) -> None:
        """``leaders``: each host's leader, in ring order; ``host``: this host's place among them."""
        self._leaders, self._host = leaders, host
        self._ring: Optional[RingAllreduce] = None
        super().__init__(seq, rank, size, array, reduce, place, plan, staged, rank == 0, False)

    def _tail(self, leader: bool) -> list[str]:
        return [REDUCE, SYNC, COLLECT, RING, PUBLISH, SYNC] if leader else [REDUCE, SYNC, SYNC, READ]

    def ring(self) -> Transfer:
        """The ring between hosts, of the host's sum (made at the first :data:`RING` step)."""
        if self._ring is None:
            self._ring = RingAllreduce(self._host, len(self._leaders), self._out, self._reduce)
            self._ring.via, self._ring.ranks, self._ring.op = HOSTS, self._leaders, self.op
        return self._ring

    def memory(self, step: str, slots: Any) -> None:
        n = self._input.nbytes
        if step == PUBLISH:  # (every rank of the host is past its REDUCE: the slot is free)
            assert self._ring is not None
            self._out = self._ring.result().reshape(-1)
            self.received_bytes += self._ring.received_bytes
            slots[self.rank, :n].view(self._out.dtype)[...] = self._out
        elif step == READ:
            self._out[...] = slots[0, :n].view(self._out.dtype)
            self.received_bytes += n
        else:
            super().memory(step, slots)

    def progress(self) -> str:
        said = super().progress()
        return said if self.step != RING or self._ring is None else f"{said}; {self._ring.progress()}"


LINE = 64  # each frame starts on a cache line of its slot


def offsets(parts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Where each frame of ``parts`` starts in its writer's slot, and the bytes they take in all."""
    at, out = 0, []
    for sizes in parts:
        starts = []
        for n in sizes:
            starts.append(at)
            at += -(-n // LINE) * LINE
        out.append(starts)
    return out, at


def write_parts(slot: Any, parts: list[list[Any]]) -> None:
    """Copy ``parts`` (each a value's frames) into ``slot`` at their :func:`offsets`."""
    starts, _ = offsets([[memoryview(f).nbytes for f in frames] for frames in parts])
    view = memoryview(slot).cast("B")
    for frames, where in zip(parts, starts, strict=True):
        for frame, at in zip(frames, where, strict=True):
            data = memoryview(frame).cast("B")
            view[at:at + data.nbytes] = data


class SharedExchange(SharedJob):
    """Serialized values through the segment (broadcast, allgather): writers fill their slots, then each
    rank copies the parts it receives (no sync after: the next call uses the other set)."""

    kind_name = "shared-memory exchange"
    pickled = True

    def __init__(self, op: str, seq: int, rank: int, size: int, place: Place, plan: HostPlan, staged: bool,
                 leader: bool, parts: list[Optional[list[list[int]]]], own: Optional[list[list[Any]]],
                 reads: list[tuple[int, int]]) -> None:
        """``parts``: by rank, its parts' frame sizes (None: nothing); ``reads``: (writer, part) pairs."""
        self.op = op
        self._parts, self._own, self._reads = parts, own, reads
        self._got: dict[tuple[int, int], list[Any]] = {}
        writes = own is not None
        steps = schedule(place, plan, staged or not writes, leader, [COLLECT] if reads else [])
        if not writes:  # (a rank with nothing to write stages nothing)
            steps = [s for s in steps if s != STAGE]
        super().__init__(seq, rank, size, place, steps)

    def memory(self, step: str, slots: Any) -> None:
        if step == STAGE:
            assert self._own is not None
            write_parts(slots[self.rank], self._own)
            return
        for writer, part in self._reads:  # COLLECT
            sizes = self._parts[writer]
            assert sizes is not None
            starts, _ = offsets(sizes)
            view = memoryview(slots[writer]).cast("B")
            frames = [bytearray(view[at:at + n]) for at, n in zip(starts[part], sizes[part], strict=True)]
            self._got[(writer, part)] = frames
            self.received_bytes += sum(sizes[part])

    def result(self) -> dict[tuple[int, int], list[Any]]:
        """The frames of each (writer, part) received."""
        return self._got
