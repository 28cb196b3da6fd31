"""What the operations' rows speak in (:mod:`._ops`): an operation's code, what it knows of
the rank calling it and what it contributes, the coordinator's ask for a reduction
(:class:`Combine`), the errors a plan or route raises, and how ranks are named.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Union

from .._format._wire import Message
from . import _ring, _shm


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
    SCAN = 14
    EXSCAN = 15

    @property
    def label(self) -> str:
        return LABELS[self]


LABELS = {o: o.name.lower() for o in Op}  # Enum.name is slow on a hot path
NUMERIC_KINDS = frozenset("biufc")  # numpy dtype kinds the data plane reduces
RING_SAFE = frozenset({"add", "maximum", "minimum", "multiply"})  # reductions no rank's code can fail
Routes = list[list[list[Any]]]  # the segments each rank receives, by rank
Build = Callable[[], tuple[list[list[Any]], Any]]  # -> (segments, reduce function or None)
NOTHING, OWN, ONE, EVERY = range(4)  # what a call's value is made of (Contribution.result): None; the
# value this rank passed, as it is; the first part sent back, unpickled; a list by rank, each part
# unpickled but this rank's own value in its slot. The call runner decodes it (zcollective._calls):
# the rules carry bytes and never unpickle
Outgoing = tuple[bytes, Message]  # a message the coordinator sends, and to whom
Parts = list[Optional[list[list[int]]]]  # by rank, the frame sizes of each value it writes into
# its host's shared memory (None: none)
UserCode = Callable[[Callable[..., Any]], Callable[..., Any]]  # a reduce function -> how it is called


def label(op: int) -> str:
    """An operation code's name (its number, if no operation has it)."""
    known = OPS.get(op)
    return LABELS[known] if known is not None else f"operation {op}"


OPS = {int(o): o for o in Op}


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
    reducer: Any = None  # (name, fn) -> reduce(dst, acc, mine): the drivers' (_io._reducing.reducer), which
    # runs the program's function for the data plane's and shared memory's jobs, never the rules


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
    (after the call's seq is reserved), ``result`` says what its value is made of
    (:data:`ONE`, ...; ``own``: the value this rank passed), from the RESULT's parts or
    from a data-plane job's (``pickled``; its arrays are its value), ``transfer`` the
    data-plane job from a plan (``FLAG_DATA``)."""

    root: int
    build: Build
    result: int
    flags: int = 0
    transfer: Optional[Callable[[Message], Union[_ring.Transfer, _shm.SharedJob]]] = None
    reduce: Any = None  # an allreduce's function, as this rank passed it (an interior rank of the
    # tree reduces its subtree's values with it)
    own: Any = None


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
    prefix: bool = False  # a scan's: one result per rank, the fold of the values up to its own


Step = Sequence[Union[Outgoing, Combine]]  # what one step of the coordinator returns, in order


def reduce_name(fn: Any) -> Optional[str]:
    """The name a function known to be associative goes by; None for any other. Known: the
    default ``a += b``, ``operator.add`` and ``mul``, numpy's ``add``, ``multiply``, ``maximum``,
    ``minimum`` (the data plane's names), builtin ``max`` and ``min``, and functions marked
    :func:`~zcollective.elementwise` (which the data plane's ring reduces out of order already)."""
    if fn is max or fn is min:
        return fn.__name__
    return _ring.reduction_name(fn) if fn is not None else None



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

