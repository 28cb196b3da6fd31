"""What the coordinator's parts share: its phases and records of members and calls. Each part holds the
coordinator (``co``), reads it through public names, and handles the kinds routed to it."""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from .._format._wire import Message, Signer
from . import _tree
from ._ops import Combining, Op, Outgoing
from ._stats import Lateness

MAX_REFUSAL_BYTES = 1000  # a REJECT's text is cut to this (strangers make rank 0 hold ~1.2 MiB at most)


class Phase(enum.Enum):
    JOINING = "joining"
    RUNNING = "running"
    CLOSED = "closed"
    FAILED = "failed"


@dataclass
class Joined:
    """The coordinator's record of a replica that joined (or is parked, a newcomer)."""

    rank: int
    peer: bytes
    pid: int = 0
    host: str = "?"
    nonce: str = ""  # echoed in WELCOME: an old WELCOME cannot be replayed
    address: str = "?"
    ended: Optional[int] = None  # its program ended after this many calls (BYE)
    sent: int = 0  # the point-to-point messages it sent, as its FINAL counts them
    data: Optional[str] = None  # its data port's endpoint, if it has one
    data_min: int = 0  # the smallest array it would send peer to peer (rank 0's is used)
    data_mode: str = "auto"  # "on": even if every rank is on one host (rank 0's is used)
    mail: Optional[str] = None  # its mailbox's endpoint (point to point), if it has one
    mail_window: int = 0  # what its mailbox holds at most from each sender (0: not said)
    local: Optional[str] = None  # its one-host mailbox's name (ranks on its host send there), if any
    shm: Optional[tuple[int, int]] = None  # it can use shared memory: (threshold, room on its host)
    macs: tuple[str, ...] = ()  # the chunk MAC backends it can use (see _mac)
    cores: int = 1  # the CPU cores its process may run on (the tree needs one a rank: rule 14)
    old_rank: Optional[int] = None  # in a group formed from an earlier one: its rank there
    heard: float = 0.0  # when (the coordinator's clock) its last message came (see Coordinator.lost)
    last: Optional[tuple[int, str, str, float]] = None  # its last call: seq, label, call site, when
    newcomer: bool = False  # parked until a GROW (rule 10): the rank it claims means nothing yet
    world: Optional[int] = None  # a sub-group's member: its world rank (its errors name it)

    def describe(self) -> str:
        who = "newcomer" if self.newcomer else f"rank {self.rank}"
        return f"{who} ({self.in_world(', ')}pid {self.pid} on {self.host})"

    def describe_end(self) -> str:
        assert self.ended is not None
        sends = f"{self.sent} point-to-point sends" if self.sent else ""
        after = (f"after seq {self.ended - 1}" + (f" and {sends}" if sends else "") if self.ended else
                 f"before its first collective call, after {sends}" if sends else "before its first call")
        return (f"rank {self.rank} ended its program (without teardown) {after} "
                f"({self.in_world(', ')}pid {self.pid} on {self.host})")

    def in_world(self, then: str = "") -> str:
        return "" if self.world is None else f"world rank {self.world}{then}"


@dataclass
class PendingCall:
    op: Op
    root: int
    contributions: dict[int, Message] = field(default_factory=dict)
    arrived: dict[int, float] = field(default_factory=dict)  # rank -> when (the coordinator's clock)
    abandoned: Optional[dict[str, Any]] = None  # a rank gave it up: the ERROR every rank gets
    warned: int = 0  # stall warnings said of it (rule 11)
    spans: Optional[dict[int, int]] = None  # with a summary (rule 14): each part's first rank -> end

    def ranked(self) -> list[Message]:
        """Every rank's contribution, in rank order (once all came)."""
        return [self.contributions[r] for r in range(len(self.contributions))]

    def missing(self, size: int) -> list[int]:
        """The ranks of a group of ``size`` this call waits for."""
        return [r for r in range(size) if r not in self.contributions]


@dataclass(frozen=True)
class Forming:
    """Members of group ``lineage`` (hex) form a new group here (rule 9): ``expected`` old ranks, the host's
    lowest; with ``majority``, only with more than half of the old ranks not ``dead`` (no split groups)."""

    lineage: str
    expected: frozenset[int]
    old_size: int
    dead: frozenset[int] = frozenset()
    majority: bool = True
    voters: Optional[int] = None  # only ranks below this count for the majority (a grow's members)
    host: Optional[int] = None  # the host's old rank (its new rank is 0); None: the lowest expected

    @property
    def host_rank(self) -> int:
        return min(self.expected) if self.host is None else self.host

    def quorate(self, came: Iterable[int]) -> bool:
        """Are the old ranks that ``came`` enough to form the group?"""
        voters = self.old_size if self.voters is None else self.voters
        came = {r for r in came if r < voters}
        dead = {r for r in self.dead if r < voters} - came
        return not self.majority or 2 * len(came) > voters - len(dead)


class Owner(Combining, Protocol):
    """What the parts read and call of the coordinator: its state, services and parts."""

    clock: Callable[[], float]
    world: Optional[list[int]]
    name: str
    forming: Optional[Forming]
    job: Optional[str]
    warn_after: Optional[float]
    started_at: float
    host_address: str
    old_ranks: Optional[list[int]]
    newcomers: dict[bytes, Joined]
    num_replicas: int
    session: int
    signer: Optional[Signer]
    phase: Phase
    members: dict[bytes, Joined]
    by_rank: dict[int, Joined]
    next_seq: list[int]
    pending: dict[int, PendingCall]
    combining: dict[int, PendingCall]
    failure: Optional[dict[str, Any]]
    reducing: Optional[tuple[int, Op, float]]
    interrupted: Optional[BaseException]
    ended: list[Joined]
    welcomed: bool
    refused: dict[int, str]
    lateness: Lateness
    part_bytes: int
    mac: str
    hosts: Optional[list[Optional[int]]]
    tree_mode: str
    tree: Optional[_tree.Shape]
    joining: Any  # the parts (typed where each is made: a part's module imports no other part)
    membership: Any
    calls: Any
    climb: Any
    endings: Any
    watch: Any

    def fail(self, error: str, message: str, exclude: Iterable[int] = (), level: int = ...,
             **extra: Any) -> list[Outgoing]: ...

    def fail_message(self, member: Joined) -> Outgoing: ...

    def binding(self, member: Joined) -> int: ...

    def warn(self, address: str, category: str, text: str) -> None: ...

    def missing_joins(self) -> list[int]: ...


def is_loopback(address: str) -> bool:
    """Is ``address`` (a peer's; a host to bind, bracketed or ``*``) a loopback one?"""
    try:
        return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False
