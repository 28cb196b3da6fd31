"""The data plane's schedules (ring allreduce, chain broadcast, ring allgather): what a rank sends and does
with each chunk. Pure (:mod:`zcollective._io._dataplane` moves the chunks); see protocol.md, *The data plane*.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .._limits import CHUNK_BYTES, CHUNKS_PER_PART, MIN_CHUNK_BYTES


def chunk_size(nbytes: int, parts: int) -> int:
    """The chunk size for ``nbytes`` moved as ``parts`` parts (ring segments, chain hops)."""
    return max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, nbytes // (max(1, parts) * CHUNKS_PER_PART)))


RS, AG, BC, GA = 1, 2, 3, 4  # chunk kinds: reduce-scatter, allgather, broadcast, gathered value
KIND_NAMES = {RS: "reduce-scatter", AG: "allgather", BC: "broadcast", GA: "allgather value"}
RING, HOSTS = "ring", "hosts"  # Transfer.via: to the next rank; from a host's leader to the next host's


def reduction_name(fn: Any) -> Optional[str]:
    """The name the data plane knows ``fn`` by, or None if it must keep the star: ``add`` for the default
    ``a += b``, ``operator.add``/``iadd`` and ``numpy.add``; ``maximum``, ``minimum``, ``multiply`` for
    numpy's; a function marked :func:`~zcollective.elementwise` by its module and qualified name."""
    try:
        name = _KNOWN.get(fn)
    except TypeError:  # unhashable: none of ours
        name = None
    if name is not None:
        return name
    if getattr(fn, "__zcollective_elementwise__", False):
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    numpy = sys.modules.get("numpy")  # (not imported: fn is none of its functions)
    if numpy is not None:
        for ufunc, label in ((numpy.add, "add"), (numpy.maximum, "maximum"),
                             (numpy.minimum, "minimum"), (numpy.multiply, "multiply")):
            if fn is ufunc:
                return label
    return None


_KNOWN: dict[Any, str] = {operator.add: "add", operator.iadd: "add", operator.mul: "multiply",
                          operator.imul: "multiply"}


def register_default(fn: Callable[[Any, Any], Any]) -> None:
    """The group's default reduce function (``a += b``) is ``add`` here."""
    _KNOWN[fn] = "add"


@dataclass
class Chunk:
    """A chunk to send to the next rank (``frames``: forwarded as received; None: made here)."""

    kind: int
    step: int  # reduce-scatter: the step; allgather and broadcast: the segment or frame
    index: int  # the chunk within its segment or frame
    payload: Any
    frames: Optional[list[Any]] = None  # forwarded as they came: header, tag, payload


def _bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(total)``, sizes within one."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def _chunks(start: int, end: int, per: int) -> list[tuple[int, int]]:
    return [(s, min(s + per, end)) for s in range(start, end, per)] or [(start, end)]


class Transfer:
    """One call's transfer at one rank: chunks to send (:attr:`outbox`), fed chunks by :meth:`receive`."""

    kind_name = "?"
    op = "?"  # the operation's label, for messages
    via = RING
    pickled = False  # its value is parts to unpickle (the call runner's :meth:`then`), not arrays

    def __init__(self, rank: int, size: int) -> None:
        self.finish: Callable[[], Any] = self.result  # the call's value, once done (set by the caller)
        self.rank = rank
        self.size = size
        self.prev = (rank - 1) % size
        self.next = (rank + 1) % size
        self.outbox: list[Chunk] = []
        self.expected = 0  # chunks to receive in all
        self.received = 0
        self.received_bytes = 0
        self.total_bytes = 0  # what this rank receives in all
        self.to_send = 0  # chunks this rank sends in all
        self.sent = 0  # ... of which handed to the socket (counted by the data plane)
        self._seen: set[tuple[int, ...]] = set()  # the chunks taken
        self.ranks: Optional[list[int]] = None  # the group's rank of each of its ring's (None: the same)

    def then(self, decode: Callable[[Any], Any]) -> None:
        """The call's value is ``decode`` of what :attr:`finish` made (the call runner's decoder)."""
        made = self.finish
        self.finish = lambda: decode(made())

    @property
    def done(self) -> bool:
        return self.received >= self.expected

    def receive(self, kind: int, step: int, index: int, payload: Any, frames: list[Any],
                origin: int = -1) -> bool:
        """Take one chunk from the previous rank (``origin``: the rank whose header it carries); False if it
        is not one this job expects (a duplicate, or out of range): the caller drops it."""
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError

    def progress(self) -> str:
        return (f"{self.kind_name}: received {self.received} of {self.expected} chunks "
                f"({self.received_bytes} of {self.total_bytes} bytes) from rank "
                f"{self.prev if self.ranks is None else self.ranks[self.prev]}")

    def _copy_in(self, key: tuple[int, ...], per_frame: list[list[tuple[int, int]]], into: list[Any],
                 step: int, index: int, payload: Any) -> bool:
        """Take chunk ``per_frame[step][index]`` into ``into[step]``; False if out of range, or not new."""
        if not 0 <= step < len(per_frame) or not 0 <= index < len(per_frame[step]) or key in self._seen:
            return False
        s, e = per_frame[step][index]
        view = memoryview(payload)
        if view.nbytes != e - s:
            return False
        self._seen.add(key)
        self.received += 1
        self.received_bytes += e - s
        memoryview(into[step])[s:e] = view.cast("B")
        return True


class RingAllreduce(Transfer):
    """The ring allreduce of a contiguous numeric array (see the module docstring)."""

    kind_name = "ring allreduce"
    op = "allreduce"

    def __init__(self, rank: int, size: int, array: Any, reduce: Callable[[Any, Any, Any], None],
                 chunk_bytes: Optional[int] = None, gather: bool = True) -> None:
        """``gather=False``: only the reduce-scatter; :meth:`result` is segment ``(rank + 1) % size``."""
        import numpy
        super().__init__(rank, size)
        self._gather = gather
        self._input = array.reshape(-1)
        self._out = numpy.empty_like(self._input)
        self._shape = array.shape
        self._reduce = reduce
        itemsize = max(1, array.itemsize)
        per = max(1, (chunk_bytes or chunk_size(array.nbytes, size)) // itemsize)
        self._segments = [_chunks(s, e, per) for s, e in _bounds(self._input.size, size)]
        n = size
        for t in range(n - 1):  # what arrives: reduce-scatter then allgather, one segment a step
            for segment in ((rank - t - 1) % n, (rank - t) % n)[:2 if gather else 1]:
                chunks = self._segments[segment]
                self.expected += len(chunks)
                self.total_bytes += sum(e - s for s, e in chunks) * itemsize
        self.to_send = sum(len(self._segments[(rank - t) % n])
                           + (len(self._segments[(rank + 1 - t) % n]) if gather else 0) for t in range(n - 1))
        for j, (s, e) in enumerate(self._segments[rank]):  # step 0: this rank's own segment
            self.outbox.append(Chunk(RS, 0, j, self._input[s:e]))
        if n == 1:
            self._out[...] = self._input

    def receive(self, kind: int, step: int, index: int, payload: Any, frames: list[Any],
                origin: int = -1) -> bool:
        n, rank = self.size, self.rank
        if kind == RS:
            if not 0 <= step < n - 1:
                return False
            segment = (rank - step - 1) % n
        elif kind == AG and self._gather:
            segment = step  # an allgather chunk names its segment
            if (rank - segment) % n == n - 1:  # this rank's own reduced segment never comes back
                return False
        else:
            return False
        chunks = self._segments[segment]
        key = (kind, step, index)
        if not 0 <= index < len(chunks) or key in self._seen:
            return False
        s, e = chunks[index]
        if memoryview(payload).nbytes != (e - s) * self._input.itemsize:
            return False
        import numpy
        incoming = numpy.frombuffer(payload, dtype=self._input.dtype)
        self._seen.add(key)
        self.received += 1
        self.received_bytes += incoming.nbytes
        dst = self._out[s:e]
        if kind == RS:
            self._reduce(dst, incoming, self._input[s:e])
            if step < n - 2:
                self.outbox.append(Chunk(RS, step + 1, index, dst))
            elif self._gather:  # reduced over every rank: it starts round the ring
                self.outbox.append(Chunk(AG, segment, index, dst))
        else:
            dst[...] = incoming
            if (rank - segment) % n < n - 2:  # the next rank has not had it yet
                self.outbox.append(Chunk(AG, segment, index, payload, frames))
        return True

    def result(self) -> Any:
        if not self._gather:
            held = self._segments[(self.rank + 1) % self.size]
            return self._out[held[0][0]:held[-1][1]]
        return self._out.reshape(self._shape)


class ChainBroadcast(Transfer):
    """The root's serialized value (frames of known sizes) down the chain."""

    kind_name = "chain broadcast"
    op = "broadcast"
    pickled = True

    def __init__(self, rank: int, size: int, root: int, sizes: list[int],
                 frames: Optional[list[Any]] = None, chunk_bytes: Optional[int] = None) -> None:
        super().__init__(rank, size)
        chunk_bytes = chunk_bytes or chunk_size(sum(sizes), size)
        self.root = root
        self._position = (rank - root) % size  # 0 at the root
        self._last = self._position == size - 1
        self._chunks = [_chunks(0, n, chunk_bytes) for n in sizes]
        if not self._last:
            self.to_send = sum(len(c) for c in self._chunks)
        if self._position == 0:
            assert frames is not None
            self._frames: list[Any] = frames
            for f, frame in enumerate(frames):
                view = memoryview(frame).cast("B")
                for j, (s, e) in enumerate(self._chunks[f]):
                    self.outbox.append(Chunk(BC, f, j, view[s:e]))
        else:
            self._frames = [bytearray(n) for n in sizes]
            self.expected = sum(len(c) for c in self._chunks)
            self.total_bytes = sum(sizes)

    def receive(self, kind: int, step: int, index: int, payload: Any, frames: list[Any],
                origin: int = -1) -> bool:
        if kind != BC or self._position == 0 or not self._copy_in(
                (step, index), self._chunks, self._frames, step, index, payload):
            return False
        if not self._last:
            self.outbox.append(Chunk(BC, step, index, payload, frames))
        return True

    def result(self) -> list[Any]:
        """The frames of the value (the root's own, at the root)."""
        return self._frames


class RingAllgather(Transfer):
    """Each rank's value once round the ring; ``sizes[r]``: rank r's frame lengths (None: in the plan)."""

    kind_name = "ring allgather"
    op = "allgather"
    pickled = True

    def __init__(self, rank: int, size: int, sizes: list[Optional[list[int]]],
                 own: Optional[list[Any]], chunk_bytes: Optional[int] = None) -> None:
        super().__init__(rank, size)
        chunk_bytes = chunk_bytes or chunk_size(sum(sum(s) for s in sizes if s), size)
        self._chunks = [None if s is None else [_chunks(0, n, chunk_bytes) for n in s] for s in sizes]
        self._frames: list[Optional[list[Any]]] = [None] * size
        for owner, per_frame in enumerate(self._chunks):
            if per_frame is None:
                continue
            count = sum(len(c) for c in per_frame)
            if owner == rank:
                assert own is not None
                self._frames[owner] = own
                for f, frame in enumerate(own):
                    view = memoryview(frame).cast("B")
                    for j, (s, e) in enumerate(per_frame[f]):
                        self.outbox.append(Chunk(GA, f, j, view[s:e]))
                self.to_send += count
                continue
            self._frames[owner] = [bytearray(n) for n in sizes[owner] or []]
            self.expected += count
            self.total_bytes += sum(sizes[owner] or [])
            if self.next != owner:  # it goes on to the next rank, which has not had it
                self.to_send += count

    def receive(self, kind: int, step: int, index: int, payload: Any, frames: list[Any],
                origin: int = -1) -> bool:
        if kind != GA or not 0 <= origin < self.size or origin == self.rank:
            return False
        per_frame, into = self._chunks[origin], self._frames[origin]
        if per_frame is None or into is None or not self._copy_in(
                (origin, step, index), per_frame, into, step, index, payload):
            return False
        if self.next != origin:
            self.outbox.append(Chunk(GA, step, index, payload, frames))
        return True

    def result(self) -> list[Optional[list[Any]]]:
        """Each rank's frames, by rank (None: its value came with the plan)."""
        return self._frames
