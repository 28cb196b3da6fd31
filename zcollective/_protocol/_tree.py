"""The tree small calls climb in a large group: its shape, and one interior rank's rules (:class:`Relay`).
Pure: fed messages and the clock, it returns what to send; sockets and threads are the drivers'.

Every rank heads a contiguous range (its subtree), so partial reductions keep rank order. An interior rank
sends up one *summary* when its range called alike with parts it can combine; otherwise, or after
:data:`RELAY_FLUSH_S`, each part as it came. Failures and liveness stay on the star. See docs/protocol.md,
*The tree*.
"""

from __future__ import annotations

import functools
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

from .._format._wire import FLAG_DATA, FLAG_FN, FLAG_LOCAL_ERROR, Kind, Message
from ._ops import Combine, Op, reduce_name

TREE_FANOUT = 4  # children per interior rank: the best K measured (benchmarks/scale_model.py: K = 4-5)
TREE_MIN_RANKS = 16  # "auto" uses the tree from this size: below, the star is as fast and folds exactly
RELAY_FLUSH_S = 0.2  # then what came goes up as it is, so a stall names the ranks missing, not a subtree
SUMMARIZED = frozenset({Op.ALLREDUCE, Op.BROADCAST, Op.BARRIER})  # kinds combined on the way up
DOWN = SUMMARIZED | {Op.TEARDOWN}  # results that come down the tree (a teardown's must not overtake them)
DOWN_LABELS = frozenset(o.name.lower() for o in DOWN)
MAX_DONE_CALLS = 1024  # calls an interior rank remembers sending up or down (their replays are dropped)
TREE_GRACE_S = 5.0  # a FAIL saying a rank ended waits this long for its calls' results to come down
FLAG_RANGE = 0x80  # an UP speaks for ranks rank .. end (its first segment): a summary
_END = struct.Struct("<i")
_OWN_FLAGS = FLAG_DATA | FLAG_FN | FLAG_LOCAL_ERROR  # a part's own (not its framing's): none in a summary

UserCode = Callable[[Callable[..., Any]], Callable[..., Any]]


@dataclass(frozen=True)
class Shape:
    """Every rank's parent (-1 for rank 0), children, and the end of its range."""

    parent: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    end: tuple[int, ...]


@functools.lru_cache(maxsize=16)
def shape(size: int, fanout: int = TREE_FANOUT) -> Shape:
    """The tree over ``size`` ranks: a range's first rank heads it, the rest is cut into at most ``fanout``
    contiguous ranges of sizes that differ by at most one, each headed by a child."""
    parent, end = [-1] * size, [0] * size
    children: list[tuple[int, ...]] = [()] * size

    def head(lo: int, hi: int) -> None:
        end[lo] = hi
        rest, kids = hi - lo - 1, []
        parts = min(fanout, rest)
        start = lo + 1
        for i in range(parts):
            width = rest // parts + (1 if i < rest % parts else 0)
            kids.append(start)
            parent[start] = lo
            head(start, start + width)
            start += width
        children[lo] = tuple(kids)
    if size:
        head(0, size)
    return Shape(tuple(parent), tuple(children), tuple(end))


def depth(size: int, fanout: int = TREE_FANOUT) -> int:
    """Hops from the deepest rank to rank 0."""
    tree, most = shape(size, fanout), 0
    for rank in range(size):
        hops, r = 0, rank
        while tree.parent[r] >= 0:
            r, hops = tree.parent[r], hops + 1
        most = max(most, hops)
    return most


def goes_down(op: int, flags: int) -> bool:
    """Does a RESULT of this kind come down the tree (both ends decide alike)?"""
    return op in DOWN and not flags & FLAG_DATA


def up(msg: Message) -> Message:
    """A rank's own contribution as it climbs the tree."""
    return replace(msg, kind=Kind.UP)


def summary(first: Message, end: int, value: list[list[Any]], reduced_with: str = "") -> Message:
    """An UP for ranks ``first.rank`` .. ``end`` - 1 that all called as ``first`` did."""
    head = [_END.pack(end), *([reduced_with.encode()] if reduced_with else [])]
    return Message(Kind.UP, first.op, first.rank, first.root, first.seq, first.session, first.callsite,
                   FLAG_RANGE, None, [head, *value])


def reduced_with(msg: Message) -> Optional[str]:
    """The name of the function a summary's value was reduced with (None: none said)."""
    if not msg.flags & FLAG_RANGE or len(msg.segments[0]) < 2:
        return None
    return bytes(msg.segments[0][1])[:200].decode("utf-8", "replace")


def span(msg: Message) -> tuple[int, int]:
    """The ranks an UP speaks for, ``lo``, ``end``; raises ValueError if malformed."""
    if not msg.flags & FLAG_RANGE:
        return msg.rank, msg.rank + 1
    head = msg.segments[0] if msg.segments else []
    if len(head) not in (1, 2) or memoryview(head[0]).nbytes != _END.size:
        raise ValueError("a summary without its range")
    end = _END.unpack(bytes(head[0]))[0]
    if end <= msg.rank:
        raise ValueError(f"a summary of ranks {msg.rank}..{end - 1}")
    return msg.rank, end


def parts(msg: Message) -> list[list[Any]]:
    """An UP's segments as a contribution's (a summary's range left out)."""
    return msg.segments[1:] if msg.flags & FLAG_RANGE else msg.segments


@dataclass
class _Call:
    """One call's parts held at an interior rank."""

    since: float
    items: list[Message] = field(default_factory=list)
    covered: int = 0
    firsts: set[int] = field(default_factory=set)  # the first rank of each part taken: once each
    flushed: bool = False  # what came went up as it came; so does what comes
    reduce: Any = None  # this rank's own reduce function (an allreduce)


class Relay:
    """An interior rank's rules: :meth:`own` and :meth:`take` return the UPs to send its parent, or a
    :class:`~._ops.Combine` for its driver to run (one UP once run)."""

    def __init__(self, rank: int, size: int, fanout: int = TREE_FANOUT,
                 user_code: UserCode = lambda fn: fn, clock: Callable[[], float] = time.monotonic) -> None:
        tree = shape(size, fanout)
        self.rank, self.parent = rank, tree.parent[rank]
        self.children, self.end = tree.children[rank], tree.end[rank]
        self.user_code, self.clock = user_code, clock
        self.calls: dict[int, _Call] = {}
        self._finished: OrderedDict[int, bool] = OrderedDict()  # calls sent up (False) or passed down (True)
        self.asked: dict[int, list[Message]] = {}  # calls whose reduction was asked for: their parts
        self.interrupted: Optional[BaseException] = None  # a signal handler's, in a reduce function run here

    def own(self, msg: Message, reduce: Any = None) -> list[Union[Message, Combine]]:
        """This rank's contribution (a CONTRIB) to call ``msg.seq``; ``reduce``: its function."""
        call = self._call(msg.seq)
        call.reduce = reduce
        return self._add(msg.seq, call, up(msg), 1)

    def take(self, msg: Message) -> list[Union[Message, Combine]]:
        """A child's UP (checked: for ranks of this subtree, not this rank, of a call not yet sent up)."""
        try:
            lo, end = span(msg)
        except ValueError:
            return []
        if not self.rank < lo < end <= self.end or msg.seq in self._finished:
            return []
        return self._add(msg.seq, self._call(msg.seq), msg, end - lo)

    def next_due(self) -> Optional[float]:
        """When a call held here goes up as it came, if one is held."""
        waiting = [c.since for c in self.calls.values() if not c.flushed]
        return min(waiting) + RELAY_FLUSH_S if waiting else None

    def on_timer(self, now: float) -> list[Message]:
        """Calls held :data:`RELAY_FLUSH_S` go up as they came."""
        out: list[Message] = []
        for _, call in sorted(self.calls.items()):
            if not call.flushed and now - call.since >= RELAY_FLUSH_S:
                call.flushed = True
                out += sorted(call.items, key=_first)
                call.items = []
        return out

    def down(self, msg: Message) -> list[tuple[int, Message]]:
        """A RESULT that came down: the same to each child, once."""
        if self._finished.get(msg.seq):
            return []
        self._remember(msg.seq, True)
        return [(child, replace(msg, rank=child)) for child in self.children]

    def _remember(self, seq: int, down: bool) -> None:
        self._finished[seq] = down or self._finished.get(seq, False)
        while len(self._finished) > MAX_DONE_CALLS:
            self._finished.popitem(last=False)

    def forget(self) -> None:
        """The group failed or closed: nothing held goes up."""
        self.calls.clear()
        self.asked.clear()

    def combined(self, asked: Combine, results: list[list[Any]]) -> list[Message]:
        """The subtree's values reduced (``asked`` ran): its summary goes up."""
        items = self.asked.pop(asked.seq, None)
        name = reduce_name(asked.fn) or ""
        return [] if items is None else [summary(items[0], self.end, [results[0]], name)]

    def combine_failed(self, asked: Combine, exc: BaseException) -> list[Message]:
        """Not reducible here: the values go up as they came (an interrupt is raised once they went)."""
        if not isinstance(exc, Exception):
            self.interrupted = exc
        return self.asked.pop(asked.seq, [])

    def _call(self, seq: int) -> _Call:
        call = self.calls.get(seq)
        if call is None:
            call = self.calls[seq] = _Call(self.clock())
        return call

    def _add(self, seq: int, call: _Call, msg: Message, width: int) -> list[Union[Message, Combine]]:
        if msg.rank in call.firsts:  # a part taken twice (replayed): dropped
            return []
        call.firsts.add(msg.rank)
        call.covered += width
        done = call.covered >= self.end - self.rank
        if done:
            del self.calls[seq]
            self._remember(seq, False)
        if call.flushed:
            return [msg]
        call.items.append(msg)
        if not done:
            return []
        items = sorted(call.items, key=_first)
        made = self._summarize(items, call.reduce)
        return [made] if made is not None else list(items)

    def _summarize(self, items: list[Message], reduce: Any) -> Optional[Union[Message, Combine]]:
        """One UP for the whole range, or None; an allreduce's: the reduction to ask for."""
        head = items[0]
        op, root, site = head.op, head.root, head.callsite
        if op not in SUMMARIZED:
            return None
        for item in items:
            if item.op != op or item.root != root or item.callsite != site or item.flags & _OWN_FLAGS:
                return None
        if op == Op.ALLREDUCE:
            name = reduce_name(reduce)  # (None: not known associative: rank 0 folds left to right)
            if name is None or any(item.flags & FLAG_RANGE and reduced_with(item) != name for item in items):
                return None  # (a child reduced with another function: rank 0 names the mismatch)
            if any(len(parts(item)) != 1 for item in items):
                return None
            self.asked[head.seq] = items  # (the driver runs it: combined, or combine_failed)
            return Combine(head.seq, Op.ALLREDUCE, self.rank, 1, reduce, tuple(parts(item) for item in items),
                           tuple(item.rank for item in items), grouped=True)
        if op == Op.BROADCAST:
            carried = [parts(item) for item in items if parts(item)]
            ranged = self.rank <= root < self.end
            if len(carried) != (1 if ranged else 0) or (carried and len(carried[0]) != 1):
                return None  # (the coordinator names what is wrong)
            return summary(head, self.end, carried[0] if carried else [])
        if any(parts(item) for item in items):  # a barrier sends nothing
            return None
        return summary(head, self.end, [])


def _first(msg: Message) -> int:
    return msg.rank
