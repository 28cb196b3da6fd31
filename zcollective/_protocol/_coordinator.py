"""The coordinator's rules: a pure object fed messages and peer events,
returning the messages to send and the reductions to run. Rank 0 hosts it; a driver
(:mod:`zcollective._io._server`, or :class:`~zcollective._io._driver.DirectDriver`
for a group of one) feeds it and applies what it returns (:func:`._ops.applied`), so every rule is
tested without a network.

Rules 1-14 (cited by number in the code): see docs/protocol.md,
*Coordinator rules*.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import ipaddress
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

from .._format import _bodies
from .._format._bodies import NOT_FORMING, PYTHON_VERSION, error_body
from .._format._mac import HMAC_SHA256, POLY1305
from .._format._wire import (
    FLAG_AUTH,
    FLAG_DATA,
    FLAG_LAST,
    FLAG_LOCAL_ERROR,
    NO_RANK,
    PROTOCOL_VERSION,
    AuthError,
    Kind,
    Message,
    Signer,
    VersionError,
    WireError,
    control,
    decode,
    join_token,
)
from .._limits import EXIT_WAIT_S, LOCAL_PART_BYTES, MAX_STALL_WARNINGS, WIRE_PART_BYTES
from ..errors import from_signal
from . import _ops, _tree
from ._ops import (
    LABELS,
    OPERATIONS,
    OPS,
    SPOKEN,
    Disagree,
    Malformed,
    Op,
    Outgoing,
    describe_call,
    in_world,
    rank_list,
)
from ._stats import Lateness

log = logging.getLogger("zcollective")

MAX_WARNED_PEERS = 1024  # bounds the memory a flood of strangers can take
MAX_NEWCOMERS = 64  # newcomers parked at once (rule 10); more are refused until a GROW
MAX_CHALLENGES_PER_PEER = 8  # a replica asks again after each reconnect while joining; more is a replay
MAX_ANSWERED_PEERS = 1024  # refused peers remembered (each gets one REJECT); past this, refusals
MAX_SHARED_CALLS = 1024  # shared-memory calls whose syncs are taken: the latest planned (rule 13;
# more in flight at once than this would lose the oldest ones' syncs)
MAX_RESENT_CALLS = 64  # results sent down the tree kept, for the subtree of an interior rank lost
# before it passed them on (rule 14): more calls in flight than this at one loss is rare
MAX_RESENT_BYTES = 16 << 20  # ... and at most this much of them (large results keep fewer)
MAX_EARLY_GIVE_UPS = 1024  # give-ups that came before their rank's part climbed the tree (rule 14);
# past this the oldest are forgotten (its call then completes on the others)
MAX_SYNCS_WAITING = 4096  # syncs some but not all ranks of a host reached, at most (a member's
# SYNCs for calls that never sync again would otherwise hold memory)
MAX_REFUSAL_BYTES = 1000  # go unanswered; a REJECT's text is cut to this, so strangers can make
# rank 0 hold at most about 1.2 MiB of answers

GONE = "connection closed or heartbeats unanswered"  # ZeroMQ does not say which: a process that
# ended or was killed, and one stopped (SIGSTOP) or cut off past the liveness bound, look alike
SEEN_DEAD_SHARE = 0.5  # a connection gone within this share of the liveness bound after the peer's
# last message was closed, not timed out (heartbeats take 2/3 of it): the process died (rule 8)
MUTATED = ("or did its program change a buffer (an array) it had passed to an _async call before "
           "the call completed (large buffers are sent without a copy)")  # the usual cause, by far
RANK0_PEER = b"\x00L0"  # its name for the member in its own process; no DEALER of ours has it
# (theirs start with b"R"), and the server drops any peer announcing it


PROBE_GAP_S = 0.001  # a close: probe rounds at once, then after 1, 2, 4 ... ms (a pipe goes in one or
PROBE_MAX_GAP_S = 0.25  # two), the gap growing to this, until PROBE_SPAN_S after the last close;
PROBE_SPAN_S = 1.0  # a close during a schedule brings the next round to PROBE_FLOOD_GAP_S after the
PROBE_FLOOD_GAP_S = 0.05  # last: a stranger costs a dozen rounds, a flood 20 a second


class ProbeSchedule:
    """When the driver sends :meth:`Coordinator.probes` (rule 8). ZeroMQ
    says only that *a* connection closed; a send fails once libzmq has
    dropped that peer's pipe, which the driver's next poll or send may do, so
    rounds follow at growing gaps (constants above)."""

    def __init__(self) -> None:
        self.due: Optional[float] = None  # when the next round is (None: no schedule)
        self._gap = PROBE_GAP_S  # the gap after it
        self._went = 0.0  # when the last round went
        self._until = 0.0  # the schedule ends after this

    def closed(self, now: float) -> None:
        """A connection closed."""
        self._until = now + PROBE_SPAN_S
        if self.due is None:  # a new schedule: a round at once
            self.due, self._gap = now, PROBE_GAP_S
        else:  # a flood is coalesced: at most a round per PROBE_FLOOD_GAP_S
            self.due = min(self.due, self._went + PROBE_FLOOD_GAP_S)

    def went(self, now: float, probed: bool) -> None:
        """A round went (``probed``: to someone); the next is due after the
        gap, which doubles, until the schedule ends."""
        self._went = now
        if not probed or now >= self._until:
            self.due = None
        else:
            self.due, self._gap = now + self._gap, min(2 * self._gap, PROBE_MAX_GAP_S)

    def limit(self, wait_s: Optional[float], now: float) -> Optional[float]:
        """``wait_s`` (None: for ever), but not past the next round."""
        if self.due is None:
            return wait_s
        return self.due - now if wait_s is None else min(wait_s, self.due - now)


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
    nonce: str = ""  # echoed in WELCOME: binds it to this JOIN, so an old WELCOME cannot be replayed
    address: str = "?"
    ended: Optional[int] = None  # its program ended after this many calls (BYE)
    sent: int = 0  # the point-to-point messages it sent, as its FINAL counts them
    data: Optional[str] = None  # its data port's endpoint, if it has one
    data_min: int = 0  # the smallest array it would send peer to peer (rank 0's is used)
    data_mode: str = "auto"  # "on": even if every rank is on one host (rank 0's is used)
    mail: Optional[str] = None  # its mailbox's endpoint (point to point), if it has one
    mail_window: int = 0  # what its mailbox holds at most from each sender (0: not said)
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


@dataclass(frozen=True)
class Forming:
    """Members of an earlier group, whose session was ``lineage`` (hex), form a
    new group here (rule 9): ``expected`` are their old ranks, the host's (rank
    0's here) the lowest, of a group of ``old_size``. With ``majority``, the
    group forms only with more than half of the old ranks not in ``dead``
    (those seen to die), so a partition never leaves two groups going on."""

    lineage: str
    expected: frozenset[int]
    old_size: int
    dead: frozenset[int] = frozenset()
    majority: bool = True
    voters: Optional[int] = None  # only ranks below this count for the majority (a grow: the
    # members; newcomers that vanish never outvote them); None: every old rank
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


class Coordinator:
    """Per-group collective state; see the module docstring for the rules."""

    def __init__(self, num_replicas: int, session: int, max_frames: int,
                 signer: Optional[Signer] = None, max_frame_bytes: Optional[int] = None,
                 user_code: _ops.UserCode = lambda fn: fn,
                 forming: Optional[Forming] = None, host_address: str = "?",
                 liveness_s: Optional[float] = None, job: Optional[str] = None,
                 warn_after: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 entropy: Callable[[int], bytes] = os.urandom, tree: str = "auto",
                 world: Optional[list[int]] = None) -> None:
        self.clock = clock  # every time this object reads or keeps (a test passes a fake one)
        self.world = world  # a sub-group's: each rank's world rank, which its errors name (None: the world)
        self.name = _ops.group_name(world)  # (its errors start with it)
        self.ending_since: Optional[float] = None  # rank 0's program said it was ending (rule 7)
        self.forming = forming
        self.liveness_s = liveness_s  # the group's bound: tells a closed connection from a silent one
        self.failed_at: Optional[float] = None  # when (its clock) it failed
        self.job = job  # the job's name (None: unnamed): a JOIN must carry the same (rule 6)
        self.warn_after = warn_after  # a stall is named after this (rule 11); None: never
        self.started_at = clock()  # (the join's stall is timed from here)
        self._join_warned = 0
        if forming is not None:
            num_replicas = len(forming.expected)  # at most; those who came, once formed
        self.host_address = host_address  # rank 0's, as the others reach it
        self.old_ranks: Optional[list[int]] = None  # formed: every new rank's old one
        self.newcomers: dict[bytes, Joined] = {}  # parked until a GROW (rule 10), by routing id
        self.num_replicas = num_replicas
        self.user_code = user_code  # how the driver calls a reduce function it runs (_ops.applied)
        self.signer = signer
        self._challenge_key = entropy(32)  # challenges are HMAC(this, peer): nothing to store
        self._challenged: OrderedDict[bytes, int] = OrderedDict()  # peer -> CHALLENGEs sent (LRU)
        self._ended: list[Joined] = []  # members that said BYE, in that order
        self.session = session
        self.max_frames = max_frames
        self.max_frame_bytes = max_frame_bytes  # a frame sent in parts, joined, is no larger
        self.phase = Phase.JOINING
        self.members: dict[bytes, Joined] = {}  # by routing id
        self.by_rank: dict[int, Joined] = {}
        self.next_seq = [0] * num_replicas
        self.pending: dict[int, PendingCall] = {}
        self.combining: dict[int, PendingCall] = {}  # calls complete here whose reduction was asked for
        self.failure: Optional[dict[str, Any]] = None
        self.reducing: Optional[tuple[int, Op, float]] = None  # (seq, op, since): a reduction was asked
        # for and is not handed back yet, so the driver runs the reduce function (read by other threads)
        self.interrupted: Optional[BaseException] = None  # a signal handler's, in a reduce function: to
        # raise once its call's errors are sent
        self._warned: set[tuple[str, str]] = set()
        self._answered: set[bytes] = set()  # refused peers that got their one REJECT
        self._welcomed = False  # WELCOME went out: members know the session
        self.refused: dict[int, str] = {}  # rank -> why a JOIN claiming it was refused (joining)
        self.lateness = Lateness(num_replicas)  # who is slow (read by rank 0's own thread too)
        self._moving: Optional[tuple[int, Op]] = None  # the last call whose data went peer to peer
        self.part_bytes = WIRE_PART_BYTES  # frames above this travel in parts (see _settle)
        self.mac = HMAC_SHA256  # the chunk MACs every rank can use
        self._data_ports: Optional[list[str]] = None  # by rank, when the group uses the data plane
        self._data_key = entropy(_bodies.DATA_KEY_BYTES).hex()  # data ports' tokens, without a secret
        self.hosts: Optional[list[Optional[int]]] = None  # by rank, the host whose segment it shares
        self._shared: Optional[dict[str, Any]] = None  # the WELCOME's shared memory (see _settle)
        self._shared_calls: OrderedDict[int, Op] = OrderedDict()  # shared-memory calls planned (rule 13)
        self._syncing: dict[tuple[int, int, int], set[int]] = {}  # (seq, sync, host) -> the ranks
        # that reached it, until all did
        self.unanswered: set[bytes] = set()  # peers sent the last BYE that have not answered it
        self.tree_mode = tree  # "auto", "on", "off": see _settle
        self.tree: Optional[_tree.Shape] = None  # small calls climb it (rule 14), once settled
        self._down: list[int] = []  # the ranks a result that comes down the tree is sent to
        self._sent_down: OrderedDict[int, tuple[Op, int, int, list[list[Any]], int]] = OrderedDict()  # seq ->
        # op, root, flags, segments, bytes of the latest results sent down the tree (rule 14) ...
        self._sent_down_bytes = 0  # ... and those bytes together
        self._early: OrderedDict[tuple[int, int], tuple[str, str]] = OrderedDict()  # (seq, rank) ->
        # its give-up, come before its part did (rule 14)
        self.held: dict[int, list[tuple[int, Outgoing]]] = {}  # rank -> (seq, BYE answer) held until that
        # rank says it has taken the data of every call through seq (rule 7)

    # -- entry points -------------------------------------------------

    def receive(self, peer: bytes, frames: list[Any], address: str = "?") -> _ops.Step:
        """Handle one message from ``peer``; return what to send to whom, and
        the reduction to run where it stands (:func:`~._ops.applied`).
        Input that does not parse is dropped and logged: it never raises."""
        try:
            return self._receive(peer, frames, address)
        except WireError as exc:
            self._warn(address, "malformed", f"dropped a malformed message from {address}: {exc}")
            return []

    def receive_message(self, peer: bytes, msg: Message,
                        address: str = "rank 0's own process") -> _ops.Step:
        """Handle one decoded message: from the member in this process, which
        needs no decoding (nor authentication); as :meth:`receive`."""
        try:
            return self._handle(peer, msg, address)
        except WireError as exc:
            self._warn(address, "malformed", f"dropped a malformed message from {address}: {exc}")
            return []

    def _receive(self, peer: bytes, frames: list[Any], address: str) -> _ops.Step:
        if peer in self._answered and self.phase is not Phase.JOINING and peer not in self.members:
            return []  # refused once the group ran: nothing it sends is read again (a flood of
            # large JOINs cost rank 0 a parse each)
        try:
            msg = decode(frames, self.max_frames, self.signer, self.max_frame_bytes)
        except AuthError as exc:
            return self._on_auth_error(peer, frames, exc, self.members.get(peer), address)
        except VersionError as exc:
            return self._on_version_error(peer, frames, exc, self.members.get(peer), address)
        except WireError as exc:
            member = self.members.get(peer)
            self._warn(address, "malformed", f"dropped a malformed message from "
                       f"{member.describe() if member else 'unknown peer'} at {address}: {exc}")
            return []
        return self._handle(peer, msg, address)

    def _handle(self, peer: bytes, msg: Message, address: str) -> _ops.Step:
        member = self.members.get(peer)
        if member is not None:
            member.heard = self.clock()
        if (msg.kind is Kind.CONTRIB and member is not None and msg.rank == member.rank
                and msg.session == self.session and self.phase is not Phase.FAILED):
            return self._on_contribution(member, msg, address)  # the common case: what follows, in one test
        if msg.kind is Kind.UP and member is not None and msg.session == self.session:
            return self._on_up(member, msg, address) if self.phase is not Phase.FAILED else []
        if msg.kind is Kind.JOIN and (member is None or msg.rank in (member.rank, member.old_rank)):
            # (a formed group's member repeats its JOIN, after a reconnect, under its old rank)
            return self._on_join(peer, msg, member, address)
        if member is None:
            self._warn(address, "stranger", f"dropped a {msg.kind.name} message from "
                       f"a peer at {address} that has not joined the group")
            return []
        if not self._bound(member, msg):
            what = (f"a {msg.kind.name} message on the connection of {member.describe()} at "
                    f"{address} claimed rank {msg.rank}, session {msg.session:#x}")
            if self.signer is not None:  # it proved the secret, so it was moved or replayed
                return self.fail("AuthenticationError", f"{what}: was it moved between connections "
                                 f"or replayed? {self._in_flight()}", bad=[member.rank])
            self._warn(address, "forged", f"dropped {what}")
            return []
        if msg.kind is Kind.BYE and msg.flags & FLAG_LAST:  # the answer to our last BYE
            self.unanswered.discard(peer)
            return []
        if msg.kind is Kind.TAKEN:  # (after rank 0 ended too: the group failed, data still moves)
            return self._release(member.rank, msg.seq)
        if msg.kind is Kind.SYNC:  # (likewise: a failure of ended ranks keeps calls whose data moves)
            return self._on_sync(member, msg.seq, msg.root)
        if self.phase is Phase.FAILED:
            return [self._fail_message(member)]
        if msg.kind is Kind.BYE:
            return self._on_bye(member, msg.seq, msg.flags)
        if msg.kind is Kind.FINAL:
            return self._on_final(member, msg)
        if msg.kind is Kind.ABORT:
            return self._on_abort(member, msg)
        if msg.kind is Kind.STATUS:
            return [(member.peer, self._status(msg.seq, member, welcomed=msg.session != 0))]
        self._warn(address, "unexpected", f"dropped an unexpected {msg.kind.name} from {member.describe()}")
        return []

    def _bound(self, member: Joined, msg: Message) -> bool:
        """Does ``msg`` carry its member's rank and the session? A STATUS sent
        before its WELCOME arrived (a join timing out) may carry none."""
        if msg.rank != member.rank:
            return False
        return msg.session == self.session or (
            msg.kind is Kind.STATUS and (self.phase is Phase.JOINING or msg.session == 0))

    def _on_abort(self, member: Joined, msg: Message) -> list[Outgoing]:
        # only the secret's holders reach here when there is one
        error, said, ranks, data_plane, abandoned = _bodies.parse_abort(msg, self.num_replicas)
        if abandoned:
            return self._abandon(member, msg.seq, error, said)
        if error == "PeerError" and self.phase is Phase.RUNNING and msg.seq < min(self.next_seq):
            # a reduce function raised mid-ring: that call fails on every rank, the group goes on
            return self._error_all(msg.seq, Op.ALLREDUCE, error_body("PeerError", said))
        if error == "AuthenticationError" and data_plane:  # a data link altered
            return self.fail("AuthenticationError", f"{said} (reported by {member.describe()})", bad=ranks)
        if error == "ReplicaLostError":  # its data plane lost a link
            return self.fail(error, f"{said} (reported by {member.describe()})", lost=ranks)
        return self.fail("AuthenticationError", f"{member.describe()} found its link to the "
                         f"coordinator tampered with: {said}", bad=[member.rank])

    def _abandon(self, member: Joined, seq: int, error: str, said: str) -> list[Outgoing]:
        """``member`` gave up call ``seq`` (rule 4)."""
        call = self.pending.get(seq)
        if error not in ("CollectiveTimeoutError", "PeerError"):
            return []
        shared = self._shared_calls.get(seq)
        moving = shared if shared is not None else (
            self._moving[1] if self._moving is not None and self._moving[0] == seq else None)
        if call is None and moving is not None:  # its data moves peer to peer (or through shared
            # memory): it fails on every rank still moving it, as when a reduce function raises
            how = "through shared memory" if shared is not None else "peer to peer"
            return self._error_all(seq, moving, error_body(
                error, f"seq {seq} {moving.label}: {member.describe()} gave it up ({said}) "
                       f"while its data moved {how}, so it failed on every rank that had not "
                       f"finished it (the group goes on)"))
        if (self.tree is not None and seq >= self.next_seq[member.rank] and moving is None
                and (call is None or call.abandoned is None)):  # its part still climbs the tree
            self._early[(seq, member.rank)] = (error, said)
            while len(self._early) > MAX_EARLY_GIVE_UPS:
                self._early.popitem(last=False)
            return []
        if call is None or call.abandoned is not None or member.rank not in call.contributions:
            return []  # complete: every rank was sent its result (the giver's is on its way)
        call.abandoned = error_body(error, f"seq {seq} {describe_call(call.op, call.root)}: "
                                           f"{member.describe()} gave it up ({said}), so it failed on "
                                           f"every rank (the group goes on)")
        return self._error_all(seq, call.op, call.abandoned, list(call.contributions))

    def _on_sync(self, member: Joined, seq: int, sync: int) -> list[Outgoing]:
        """Rule 12: ``member`` reached sync ``sync`` of shared-memory call ``seq``; once every
        rank of its host did, each is told."""
        op = self._shared_calls.get(seq)
        host = self.hosts[member.rank] if self.hosts is not None else None
        key = (seq, sync, host if host is not None else -1)
        if op is None or host is None or not 0 <= sync < _ops.MAX_SYNCS or (
                key not in self._syncing and len(self._syncing) >= MAX_SYNCS_WAITING):
            return []  # (a call that failed meanwhile: its ERROR went out)
        reached = self._syncing.setdefault(key, set())
        reached.add(member.rank)
        ranks = [r for r, h in enumerate(self.hosts or ()) if h == host]
        if len(reached) < len(ranks):
            return []
        del self._syncing[key]
        return [(self.by_rank[r].peer, Message(Kind.SYNC, op=op, rank=r, root=sync, seq=seq,
                                               session=self.session)) for r in ranks]

    def probes(self) -> list[Outgoing]:
        """A connection closed, whose is not known: a PROBE for each peer
        whose loss would matter (rule 8). Never rank 0, which hosts this."""
        if self.phase in (Phase.JOINING, Phase.RUNNING):
            peers = [m for m in self.members.values() if m.ended is None and m.rank != 0]
        else:  # over: only those that owe an answer
            peers = [m for m in self.members.values() if m.peer in self.unanswered or self.held.get(m.rank)]
        probes = [(m.peer, Message(Kind.PROBE, rank=m.rank, session=self._binding(m))) for m in peers]
        return probes + [(n.peer, Message(Kind.PROBE, rank=n.rank, session=join_token(n.nonce)))
                         for n in self.newcomers.values()]  # one that timed out or died is dropped

    def gone(self, peer: bytes, reason: str = GONE) -> list[Outgoing]:
        """A send to ``peer`` failed: its connection is gone (rule 8). A
        member is lost while the group runs; before it starts, the rank's
        slot opens again."""
        self.unanswered.discard(peer)
        member = self.members.get(peer)
        if member is None:
            self.newcomers.pop(peer, None)  # a newcomer that left, or a stranger
            return []
        released = self._release(member.rank)  # it takes no more data
        if member.ended is not None:
            return released  # it said BYE: a program that ended is not a lost one
        if self.phase is Phase.JOINING:
            del self.members[member.peer], self.by_rank[member.rank]
            log.warning("zcollective coordinator: %s left before the group started; "
                        "waiting for rank %d again", member.describe(), member.rank)
            return []
        return self.lost(member.rank, reason) + released

    def waiting(self) -> bool:
        """Rank 0 may not close yet: an answer to a last BYE, or a data
        rank's TAKEN, is still to come (rule 7)."""
        return bool(self.unanswered) or any(self.held.values())

    def last_byes(self) -> list[Outgoing]:
        """Rank 0's program ends and the group is over: a last BYE to every
        member still running, each to be answered (rule 7)."""
        if not self._welcomed:
            return []  # nobody was sent a result
        running = [m for m in self.members.values() if m.ended is None and m.rank != 0]
        self.unanswered.update(m.peer for m in running)
        return [(m.peer, Message(Kind.BYE, rank=m.rank, session=self.session, flags=FLAG_LAST))
                for m in running]

    def lost(self, rank: int, reason: str) -> list[Outgoing]:
        """Rank ``rank`` is gone: fail the group and tell every other member."""
        if self.phase in (Phase.CLOSED, Phase.FAILED):
            return []
        member = self.by_rank.get(rank)
        if member is not None and member.ended is not None:
            return []
        who = member.describe() if member else f"rank {rank}"
        message = f"{who} was lost ({reason}); {self._in_flight()}"
        dead = member is not None and self.liveness_s is not None and (
            self.clock() - member.heard < SEEN_DEAD_SHARE * self.liveness_s)
        resent = self._resend_down(rank)
        return resent + self.fail("ReplicaLostError", message, lost=[rank], dead=[rank] if dead else [],
                                  exclude={rank})

    def fail(self, error: str, message: str, exclude: Iterable[int] = (), level: int = logging.ERROR,
             **extra: Any) -> list[Outgoing]:
        """Enter FAILED for good and tell every member (but ``exclude``)."""
        if self.phase is Phase.FAILED:
            return []
        if self.tree is not None and self.phase is Phase.RUNNING:  # calls before this seq completed: their
            # results may still come down the tree, behind this FAIL (rule 14)
            extra["complete"] = min([*self.pending, *self.combining, max(self.next_seq)])
        self.phase = Phase.FAILED
        self.failed_at = self.clock()
        if self.name:
            message = f"{self.name}: {message}"
        self.failure = error_body(error, message, **extra)
        if extra.get("ended") is not True:  # (a rank that ended had moved its data: the calls
            self._shared_calls.clear()  # whose data moves go on, their syncs answered)
            self._syncing.clear()
        log.log(level, "zcollective coordinator: %s", message)
        skip = set(exclude)
        return [self._fail_message(m) for m in self.members.values() if m.rank not in skip]

    def _on_auth_error(self, peer: bytes, frames: list[Any], exc: AuthError,
                       member: Optional[Joined], address: str) -> list[Outgoing]:
        if member is not None:  # only a member can write on this connection: altered in flight
            return self.fail("AuthenticationError", f"a message on the connection of "
                             f"{member.describe()} at {address} failed authentication ({exc}); "
                             f"was it altered in flight, {MUTATED}? {self._in_flight()}",
                             bad=[member.rank])
        self._warn(address, "auth", f"refused a message from {address} that failed "
                   f"authentication ({exc}): it does not know the job's secret")
        head = bytes(memoryview(frames[0])[:4]) if frames else b""
        if len(head) == 4 and head[3] == Kind.JOIN:  # tell a misconfigured replica at once
            return self._refuse(peer, frames, "AuthenticationError",
                                "the coordinator (rank 0) refused this replica: its messages do not "
                                "carry the job's secret (set the same ZCOLLECTIVE_SECRET everywhere)")
        return []

    def _refuse(self, peer: bytes, join: Any, error: str, message: str) -> list[Outgoing]:
        """One REJECT for a peer that is not a member: never a second, and none
        past :data:`MAX_ANSWERED_PEERS` peers, so refusals cost rank 0 nothing.
        ``join`` (a JOIN's frames or Message) names the rank and nonce the
        REJECT is bound to, as far as they can be read."""
        if peer in self._answered or len(self._answered) >= MAX_ANSWERED_PEERS:
            return []
        self._answered.add(peer)
        rank, token = _claimed(join)
        return [(peer, control(Kind.REJECT, error_body(error, message, MAX_REFUSAL_BYTES),
                               rank=rank, session=token))]

    # -- join -----------------------------------------------------------

    def _on_version_error(self, peer: bytes, frames: list[Any], exc: VersionError,
                          member: Optional[Joined], address: str) -> list[Outgoing]:
        head = bytes(memoryview(frames[0])[:4])
        if member is None and len(head) == 4 and head[3] == Kind.JOIN and self.phase is Phase.JOINING:
            message = (f"a replica at {address} speaks zcollective protocol version "
                       f"{exc.version}, the coordinator (rank 0) speaks {PROTOCOL_VERSION}: "
                       f"install the same zcollective version on every host")
            return [*self._refuse(peer, frames, "ProtocolError", message),
                    *self.fail("ProtocolError", message)]
        self._warn(address, "version", f"dropped a message of protocol version {exc.version} "
                   f"from {address}")
        return []

    def _on_join(self, peer: bytes, msg: Message, member: Optional[Joined], address: str) -> list[Outgoing]:
        """A JOIN from a stranger, or again from a member (it reconnected)."""
        if member is not None:
            if self.phase is Phase.RUNNING:  # a reconnect lost our WELCOME: say it again
                challenge = self._challenge(peer, msg)
                if challenge is not None:
                    return challenge
                member.nonce = _bodies.join_nonce(msg)
                return [(peer, self._welcome(member))]
            if self.phase is Phase.FAILED:
                return [self._fail_message(member)]
            if self.phase is not Phase.JOINING:
                return []
            del self.members[peer], self.by_rank[member.rank]  # joins again, below
        try:
            info = _bodies.parse_join(msg)
        except WireError as exc:
            self._warn(address, "join", f"dropped a malformed JOIN from {address}: {exc}")
            return []
        python, n, ops = info.pop("python"), info.pop("num_replicas"), info.pop("ops")
        lineage, newcomer = info.pop("lineage"), info.pop("newcomer")
        job = info.pop("job")
        join = Joined(peer=b"", **info)
        if job != self.job:  # another job's replica: refused alone, the right one may still come
            return self._refuse_foreign(peer, msg, join, job, newcomer, address)
        join.newcomer = bool(newcomer and lineage is None)
        if newcomer and lineage is None:  # while joining, running, or failed (its survivors form
            return self._park(peer, msg, join, python, ops, address)  # the next group: it comes again)
        if lineage == f"{self.session:x}":  # this group's members forming the next one (rule 9), early
            # at its address: once this one closes they find the next; meanwhile they know its
            # host is alive, but not (yet) forming (its program is elsewhere)
            return self._refuse(peer, msg, NOT_FORMING, f"{join.describe()} came to form the next "
                                f"group, but its would-be host has not closed this one yet")
        if self.phase is not Phase.JOINING:  # nothing from a non-member changes a running group
            return self._refuse_late(peer, msg, join, address, lineage)
        forming = self.forming
        if lineage != (forming.lineage if forming is not None else None):
            return self._refuse_stranger(peer, msg, join, address, lineage)
        if msg.flags & FLAG_AUTH and self.signer is None:  # unproven: refuse this peer alone
            message = (f"{join.describe()} uses a secret, but the coordinator (rank 0) has none: "
                       f"set the same ZCOLLECTIVE_SECRET on every replica")
            self._warn(address, "secret", f"refused a join: {message}")
            if 0 <= join.rank < self.num_replicas:
                self.refused[join.rank] = message
            return self._refuse(peer, msg, "AuthenticationError", message)
        challenge = self._challenge(peer, msg)
        if challenge is not None:
            return challenge
        if forming is not None and join.rank not in forming.expected and 0 <= join.rank < n:
            return self._refuse(peer, msg, "LeftOutError", self._left_out(join))
        if forming is not None and n != forming.old_size:  # of the lineage, but it went another way
            # (a grow it left, shrinking the group before it): it alone is refused, the group forms
            return self._refuse(peer, msg, "LeftOutError", (
                f"{join.describe()} came to form a group from one of {n} replicas, but the group "
                f"here forms from {forming.old_size} (a grow that went on without it)"))
        problem = self._join_problem(join, python, n, ops)
        if problem is not None:
            return [*self._refuse(peer, msg, *problem), *self.fail(*problem)]
        join.peer, join.address, join.heard = peer, address, self.clock()
        if self.world is not None and 0 <= join.rank < len(self.world):
            join.world = self.world[join.rank]
        self.members[peer] = join
        self.by_rank[join.rank] = join
        if len(self.by_rank) < self.num_replicas:
            return []
        return self._start()

    def _park(self, peer: bytes, msg: Message, join: Joined, python: str, ops: str,
              address: str) -> list[Outgoing]:
        """Rule 10: a newcomer waits for a GROW (refused alone if it could not
        join the group formed next: it runs another Python, or release)."""
        challenge = self._challenge(peer, msg)
        if challenge is not None:
            return challenge
        if python != PYTHON_VERSION:
            return self._refuse(peer, msg, "ProtocolError", f"{join.describe()} runs Python "
                                f"{python}, the group runs {PYTHON_VERSION}")
        if ops != SPOKEN:
            return self._refuse(peer, msg, "ProtocolError", f"{join.describe()} knows the operations "
                                f"{ops}, the group knows {SPOKEN}: every replica must run the same "
                                f"zcollective release")
        if peer not in self.newcomers and len(self.newcomers) >= MAX_NEWCOMERS:
            return self._refuse(peer, msg, "LateJoinError", f"{join.describe()}: "
                                f"{MAX_NEWCOMERS} newcomers already wait to be admitted")
        join.peer, join.address = peer, address
        self.newcomers[peer] = join
        log.info("zcollective coordinator: %s waits to be admitted (grow)", join.describe())
        return []

    def dismiss_newcomers(self) -> list[Outgoing]:
        """The group ends for good (not to form again): every newcomer still
        parked is told so, rather than left waiting (rule 10)."""
        newcomers, self.newcomers = list(self.newcomers.values()), {}
        return [(n.peer, control(Kind.REJECT, error_body(
            "LateJoinError", f"{n.describe()}: the group ended before a grow() admitted it"),
            rank=n.rank, session=join_token(n.nonce))) for n in newcomers]

    def admit(self, seq: int) -> list[Outgoing]:
        """Rule 10: a GROW completed: WELCOME each newcomer in, then close."""
        newcomers, self.newcomers = list(self.newcomers.values()), {}
        if not newcomers:
            return []
        size, lineage = self.num_replicas + len(newcomers), f"{self.session:x}"
        log.info("zcollective coordinator: seq %d grow: admitting %d newcomers (%s); the group "
                 "of %d forms again here", seq, len(newcomers), ", ".join(n.describe() for n in newcomers),
                 size)
        self.phase = Phase.CLOSED  # its members, and the newcomers, form the next group here
        return [(n.peer, _bodies.welcome(size, n.nonce, None, None, None, 0, None, admitted={
            "rank": self.num_replicas + i, "size": size, "lineage": lineage},
            rank=n.rank, session=join_token(n.nonce))) for i, n in enumerate(newcomers)]

    def _start(self) -> list[Outgoing]:
        """Every member joined (or, forming, the bound passed): WELCOME them."""
        if self.forming is not None:
            if not self.forming.quorate(self.by_rank):
                return self._no_quorum()
            self._renumber()
        self.phase = Phase.RUNNING
        self._settle()
        self._welcomed = True
        return [(m.peer, self._welcome(m)) for m in self.members.values()]

    def _renumber(self) -> None:
        """Rule 9: the members that came, ranked densely in old-rank order, the
        host first (a lower rank is there only when it could not host)."""
        host = self.forming.host_rank if self.forming is not None else 0
        old = sorted(self.by_rank, key=lambda r: (r != host, r))
        members = [self.by_rank[r] for r in old]
        self.num_replicas = len(members)
        self.by_rank = {}
        for rank, member in enumerate(members):
            member.old_rank, member.rank = member.rank, rank
            self.by_rank[rank] = member
        self.old_ranks = old
        self.next_seq = [0] * self.num_replicas
        self.lateness = Lateness(self.num_replicas)

    def _no_quorum(self) -> list[Outgoing]:
        """Rule 9: too few came to form the group: each is told it is left out."""
        forming = self.forming
        assert forming is not None
        came = sorted(self.by_rank)
        dead = f" ({rank_list(forming.dead)} seen to die)" if forming.dead else ""
        voters = forming.old_size if forming.voters is None else forming.voters
        message = (f"old {rank_list(came)} could not form a group: fewer than half of the "
                   f"{voters} ranks of the group before{dead} came, so the others may "
                   f"be alive and going on (a partition?); shrink(majority=False) goes on anyway")
        members, self.members, self.by_rank = list(self.members.values()), {}, {}
        body = error_body("LeftOutError", message, MAX_REFUSAL_BYTES)
        outs = [(m.peer, control(Kind.REJECT, body, rank=m.rank, session=join_token(m.nonce)))
                for m in members]
        self.fail("LeftOutError", message, level=logging.WARNING)
        return outs

    def form_now(self) -> list[Outgoing]:
        """The forming bound passed (the driver's clock): start with the members
        that came, if the host's own member is among them."""
        forming = self.forming
        if forming is None or self.phase is not Phase.JOINING or forming.host_rank not in self.by_rank:
            return []
        return self._start()

    def _left_out(self, join: Joined) -> str:
        forming = self.forming
        assert forming is not None
        if self.old_ranks is not None:
            return (f"{join.describe()} was left out: the survivors formed a group of "
                    f"{self.num_replicas} without it (old ranks {','.join(map(str, self.old_ranks))}); "
                    f"it did not come within the bound")
        return (f"{join.describe()} was left out: the survivors counted it as lost (they form "
                f"a group of old ranks {','.join(map(str, sorted(forming.expected)))})")

    def _refuse_stranger(self, peer: bytes, msg: Message, join: Joined, address: str,
                         lineage: Optional[str]) -> list[Outgoing]:
        """A JOIN for another group: of another lineage, or forming where this
        group is not (or the other way round)."""
        if lineage is None:
            message = (f"{join.describe()} tried to join a group the survivors of an earlier one "
                       f"form here, with no part in it (another job on this port? give each job "
                       f"its own)")
        else:
            message = (f"{join.describe()} came to form a group from an earlier one here, but "
                       f"the group here is {'another' if self.forming else 'a new'} one")
        self._warn(address, "late", f"refused a join: {message}")
        return self._refuse(peer, msg, "LateJoinError", message)

    def _refuse_foreign(self, peer: bytes, msg: Message, join: Joined, job: Optional[str],
                        newcomer: bool, address: str) -> list[Outgoing]:
        """Rule 6: a JOIN of another job refuses that peer alone, naming both jobs."""
        who = f"a newcomer (pid {join.pid} on {join.host})" if newcomer else join.describe()
        fix = (f"set ZCOLLECTIVE_JOB={self.job!r} on it" if self.job is not None else
               "give every replica the same ZCOLLECTIVE_JOB")
        message = (f"{who} {_of_job(job)}, but the group at this address {_of_job(self.job)}: "
                   f"two jobs on one master address and port? give each its own port (or, if it is "
                   f"of this job, {fix})")
        self._warn(address, "job", f"refused a join: {message}")
        if self.phase is Phase.JOINING and not newcomer and 0 <= join.rank < self.num_replicas:
            self.refused[join.rank] = message  # (rank 0's join timeout says why it never came)
        return self._refuse(peer, msg, "JobMismatchError", message)

    def _refuse_late(self, peer: bytes, msg: Message, join: Joined, address: str,
                     lineage: Optional[str] = None) -> list[Outgoing]:
        if self.forming is not None and lineage == self.forming.lineage and self.phase is Phase.RUNNING:
            return self._refuse(peer, msg, "LeftOutError", self._left_out(join))
        if self.phase is Phase.FAILED:
            failure = self.failure or {}
            return self._refuse(peer, msg, str(failure.get("error")), str(failure.get("message")))
        state = "has already started" if self.phase is Phase.RUNNING else f"is {self.phase.value}"
        message = (f"{join.describe()} tried to join the group at seq {min(self.next_seq, default=0)}, "
                   f"but the group of {self.num_replicas} replicas {state} (another job on this "
                   f"port? give each job its own)")
        self._warn(address, "late", f"refused a join: {message}")
        return self._refuse(peer, msg, "LateJoinError", message)

    def _join_problem(self, join: Joined, python: str, n: int, ops: str) -> Optional[tuple[str, str]]:
        """Why a proven JOIN fails the whole group (error name, text), or None."""
        who = join.describe()
        if python != PYTHON_VERSION:
            return ("ProtocolError", f"{who} runs Python {python}, the coordinator (rank 0) runs "
                    f"Python {PYTHON_VERSION}; pickles are only compatible between identical "
                    f"Python versions")
        if ops != SPOKEN:
            return ("ProtocolError", f"{who} knows the operations {ops}, the coordinator (rank 0) "
                    f"knows {SPOKEN}: every replica must run the same zcollective release")
        size = self.forming.old_size if self.forming is not None else self.num_replicas
        if n != size:
            return ("ValueError", f"replicas disagree on num_replicas: {who} says {n}, "
                    f"the coordinator (rank 0) says {size}")
        if not 0 <= join.rank < size:
            return ("ValueError", f"{who} is out of range for num_replicas={size}")
        if join.rank in self.by_rank:
            return ("ValueError", f"rank {join.rank} was claimed twice: by "
                    f"{self.by_rank[join.rank].describe()} and by pid {join.pid} on {join.host}")
        return None

    def _settle(self) -> None:
        """Every rank joined: what the group uses, from what they all can.
        A group on one host sends frames whole up to a large size (no join
        at the receiver); across hosts in parts, so heartbeats keep flowing.
        With a secret, the fast MACs when every rank has them."""
        members = [self.by_rank[r] for r in range(self.num_replicas)]
        ports = [m.data for m in members]
        one_host = (all(ports) and len({_host_of(p) for p in ports}) == 1) or all(
            is_loopback(m.address) for m in members[1:])
        self.part_bytes = LOCAL_PART_BYTES if one_host else WIRE_PART_BYTES
        self.mac = POLY1305 if all(POLY1305 in m.macs for m in members) else HMAC_SHA256
        if self.signer is not None and self.mac == POLY1305:
            self.signer.fast = True  # every rank can verify the fast tag
        if all(ports) and (members[0].data_mode == "on" or not one_host):
            self._data_ports = cast("list[str]", ports)
        self._settle_shared(members)
        n = self.num_replicas
        wanted = self.tree_mode == "on" or (self.tree_mode == "auto" and n >= _tree.TREE_MIN_RANKS
                                            and not _oversubscribed(members))
        if wanted and n > 2 and all(m.mail for m in members):  # (the tree's links are the mailboxes')
            self.tree = _tree.shape(n)
            self._down = [0, *self.tree.children[0]]

    def _settle_shared(self, members: list[Joined]) -> None:
        """Rule 12: which ranks share a host's segment. A host is told by the address rank 0
        sees a rank at (loopback or its own: rank 0's host) and the host name its JOIN gave; a
        host's ranks share memory if there are two or more and each offered it (rank 0's
        threshold is the group's); its segment may take half the least room they reported.
        With ranks on several hosts, only if every rank's host shares memory (the allreduce
        through it takes each host's sum round the data plane's ring between the hosts'
        leaders: see docs/protocol.md, *Shared memory*)."""
        keys: dict[tuple[str, str], int] = {}
        found: list[int] = []
        for m in members:
            here = m.rank == 0 or is_loopback(m.address) or m.address == self.host_address
            found.append(keys.setdefault((m.host, "" if here else m.address), len(keys)))
        offered = [all(m.shm is not None for m, h in zip(members, found, strict=True) if h == host)
                   for host in range(len(keys))]
        if members[0].shm is None or not offered[0]:
            return
        if len(keys) > 1 and (self._data_ports is None or not all(offered)
                              or any(found.count(h) < 2 for h in range(len(keys)))):
            return  # ranks on several hosts share memory, for allreduce, only if every host has two
            # or more that offered it, and the group a data plane (its ring between the hosts' leaders)
        hosts: list[Optional[int]] = [h if offered[h] and found.count(h) > 1 else None for h in found]
        if not any(h is not None for h in hosts):
            return
        room = [min(m.shm[1] for m, h in zip(members, found, strict=True) if h == host and m.shm) // 2
                for host in range(len(keys))]
        if len(keys) > 1:  # one call is one ring between hosts: an array fits every host's segment or
            # none (SharedPlane.fits: 2 x its ranks x the array within its room), else the hosts where
            # it fits went the shared way, the others the ring of all ranks, and the call failed
            per_rank = min(r // found.count(h) for h, r in enumerate(room))
            room = [per_rank * found.count(h) for h in range(len(keys))]
        self.hosts = hosts
        self._shared = _bodies.shared_plan(members[0].shm[0], hosts, room)

    def _welcome(self, member: Joined) -> Message:  # rank 0's data threshold for all
        addresses = [self.host_address] + [self.by_rank[r].address for r in range(1, self.num_replicas)]
        renumber, rank = None, member.rank
        if self.old_ranks is not None:  # bound to the rank its JOIN claimed: its old one
            renumber, rank = {"rank": member.rank, "old": self.old_ranks}, cast(int, member.old_rank)
        mail = [self.by_rank[r].mail for r in range(self.num_replicas)]
        return _bodies.welcome(self.num_replicas, member.nonce, self.part_bytes, self.mac, self._data_ports,
                               self.by_rank[0].data_min, self._data_key, addresses, renumber, rank=rank,
                               session=self.session, mail=cast("list[str]", mail) if all(mail) else None,
                               shm=self._shared, tree=_tree.TREE_FANOUT if self.tree is not None else None,
                               mail_windows=[self.by_rank[r].mail_window for r in range(self.num_replicas)])

    def _challenge(self, peer: bytes, join: Message) -> Optional[list[Outgoing]]:
        """With a secret, a JOIN is fresh only if it echoes the challenge this
        coordinator gives its peer (an HMAC of the peer's routing id under a key
        of this coordinator alone): None for such a JOIN, else the CHALLENGE
        to answer it with. So a JOIN captured from an earlier group with the
        same secret claims nothing here: its sender cannot sign the answer.
        Nothing is stored per challenge; a peer gets at most
        :data:`MAX_CHALLENGES_PER_PEER` of them (counted for the last
        :data:`MAX_ANSWERED_PEERS` peers). Without a secret anyone may join."""
        if self.signer is None:
            return None
        expected = hmac.new(self._challenge_key, peer, "sha256").hexdigest()[:32]
        echoed = _bodies.challenge_of(join)
        if echoed is not None and hmac.compare_digest(echoed.encode("utf-8", "replace"),
                                                      expected.encode()):
            return None
        sent = self._challenged.pop(peer, 0)
        if sent >= MAX_CHALLENGES_PER_PEER:
            self._challenged[peer] = sent
            return []
        self._challenged[peer] = sent + 1
        if len(self._challenged) > MAX_ANSWERED_PEERS:
            self._challenged.popitem(last=False)
        rank, token = _claimed(join)
        return [(peer, _bodies.challenge(expected, rank=rank, session=token))]

    def _binding(self, member: Joined) -> int:
        """What the header of a message to ``member`` carries as its session:
        the group's once it was welcomed, else the token of its JOIN."""
        return self.session if self._welcomed else join_token(member.nonce)

    def missing_joins(self) -> list[int]:
        expected = self.forming.expected if self.forming is not None else range(self.num_replicas)
        return [r for r in sorted(expected) if r not in self.by_rank]

    # -- calls ----------------------------------------------------------

    def _on_contribution(self, member: Joined, msg: Message, address: str) -> _ops.Step:
        rank, seq = member.rank, msg.seq
        if self.phase is not Phase.RUNNING:
            self._warn(address, "early", f"dropped seq {seq} from {member.describe()}: "
                       f"group is {self.phase.value}")
            return []
        if seq != self.next_seq[rank]:
            if seq == self.next_seq[rank] - 1:  # sent again by a call interrupted just after it
                log.debug("zcollective coordinator: dropped seq %d of %s sent twice", seq, member.describe())
                return []
            self._warn(address, "seq", f"dropped seq {seq} from {member.describe()}: "
                       f"expected seq {self.next_seq[rank]} (a replay or a forgery)")
            return []
        op = OPS.get(msg.op)
        if op is None:  # no working replica sends it; a member that does cannot pair its calls again
            return self.fail("ProtocolError", f"{member.describe()} sent seq {seq} with operation code "
                             f"{msg.op}, which no operation has here (another release, or altered?)",
                             bad=[rank])
        self.next_seq[rank] += 1
        call = self.pending.get(seq)
        if call is None:
            call = self.pending[seq] = PendingCall(op, msg.root)
        call.contributions[rank] = msg
        call.arrived[rank] = self.clock()
        member.last = (seq, LABELS[op], msg.callsite, call.arrived[rank])
        return self._counted(seq, call, msg, rank, rank + 1)

    def _counted(self, seq: int, call: PendingCall, msg: Message, lo: int, end: int) -> _ops.Step:
        """Ranks ``lo`` .. ``end`` - 1 contributed ``msg`` to call ``seq``: a mismatch, a give-up,
        nothing yet, or the call is complete."""
        if msg.op != call.op or msg.root != call.root:
            return self.fail("CallMismatchError", self._mismatch(seq, call), seq=seq)
        early = self._gave_up_early(seq, lo, end) if self._early else []
        if call.abandoned is not None:  # given up by a rank: these hear so, as the others did
            if len(call.contributions) == self.num_replicas:
                del self.pending[seq]
            told = [] if early else self._error_all(seq, call.op, call.abandoned, list(range(lo, end)))
            return early + told + self._check_endings()
        if len(call.contributions) < self.num_replicas:
            return self._check_endings() if self._ended else []
        del self.pending[seq]
        self.lateness.record(call.arrived)
        if call.warned:
            self._stall_ended(seq, call, lo)
        if call.spans is not None:
            climbed = self._climbed(seq, call)
            if climbed and isinstance(climbed[0], _ops.Combine):  # (handed back: combined())
                return climbed
            return self._then(call, cast("list[Outgoing]", climbed))
        contributions = call.ranked()
        out = self._problem(seq, call, contributions)
        if out is None:
            operation = OPERATIONS[call.op]
            if isinstance(operation, _ops.Reducing):  # the driver runs it, hands it back: combined()
                self.combining[seq], self.reducing = call, (seq, call.op, self.clock())
                return [operation.combine(seq, contributions, call.root)]
            out = self._results(seq, call, operation.route(self, contributions, call.root))
        return self._then(call, out)

    # -- the tree (rule 14) -------------------------------------------------

    def _on_up(self, member: Joined, msg: Message, address: str) -> _ops.Step:
        """A part of a call that climbed the tree to ``member``, rank 0's child: one
        rank's contribution, or a summary of ranks of its subtree."""
        tree = self.tree
        try:
            lo, end = _tree.span(msg)
        except ValueError as exc:
            self._warn(address, "malformed", f"dropped an UP from {member.describe()}: {exc}")
            return []
        if tree is None or not member.rank <= lo < end <= tree.end[member.rank]:
            self._warn(address, "forged", f"dropped an UP of ranks {lo}..{end - 1} from {member.describe()}, "
                       f"whose subtree they are not")
            return []
        if not msg.flags & _tree.FLAG_RANGE:
            own = dataclasses.replace(msg, kind=Kind.CONTRIB)
            return self._on_contribution(self.by_rank[lo], own, address)
        seq, op = msg.seq, OPS.get(msg.op)
        if self.phase is not Phase.RUNNING or op is None or self.next_seq[lo:end] != [seq] * (end - lo):
            self._warn(address, "seq", f"dropped a summary of seq {seq} of ranks {lo}..{end - 1} "
                       f"from {member.describe()}: out of order (a replay or a forgery)")
            return []
        next_seq, now, label = self.next_seq, self.clock(), LABELS[op]
        call = self.pending.get(seq)
        if call is None:
            call = self.pending[seq] = PendingCall(op, msg.root)
        if call.spans is None:
            call.spans = {}
        call.spans[lo] = end
        ranks, last = range(lo, end), (seq, label, msg.callsite, now)
        next_seq[lo:end] = [seq + 1] * (end - lo)  # (in C: a summary of a thousand ranks costs rank 0 little)
        call.contributions.update(dict.fromkeys(ranks, msg))
        call.arrived.update(dict.fromkeys(ranks, now))
        by_rank = self.by_rank
        for rank in ranks:
            by_rank[rank].last = last
        return self._counted(seq, call, msg, lo, end)

    def _parts(self, call: PendingCall) -> list[tuple[int, Message]]:
        """A call's parts as they came, by first rank: summaries once each."""
        spans, contributions, out, rank = call.spans or {}, call.contributions, [], 0
        while rank < self.num_replicas:
            out.append((rank, contributions[rank]))
            rank = spans.get(rank, rank + 1)
        return out

    def _climbed(self, seq: int, call: PendingCall) -> _ops.Step:
        """A complete call some of whose parts are summaries: checked as the star's
        (each rank of a summary as having sent a well-formed part), then reduced over
        its parts in rank order, or routed."""
        op, root, came, spans = call.op, call.root, self._parts(call), call.spans or {}
        stand_ins: list[Message] = []
        for lo, c in came:  # (one per summary, and its root's: no work per rank)
            if not c.flags & _tree.FLAG_RANGE:
                stand_ins.append(c)
                continue
            end = spans[lo]
            alike = dataclasses.replace(c, flags=0, segments=self._stand_in(op, root, -1, c))
            stand_ins += [alike] * (end - lo)
            if lo <= root < end and op == Op.BROADCAST:
                stand_ins[root] = dataclasses.replace(alike, segments=self._stand_in(op, root, root, c))
        out = self._problem(seq, call, stand_ins)
        if out is not None:
            return out
        parts = tuple(_tree.parts(c) for _, c in came)
        if op == Op.ALLREDUCE:
            self.combining[seq], self.reducing = call, (seq, op, self.clock())
            return [_ops.Combine(seq, op, 0, 1, call.contributions[0].fn, parts, tuple(lo for lo, _ in came),
                                 tuple(_tree.reduced_with(c) for _, c in came))]
        value: list[list[Any]] = []
        if op == Op.BROADCAST:  # (the root's part: another rank's may carry a shared-memory status)
            value = next(_tree.parts(c) for lo, c in came if lo <= root < spans.get(lo, lo + 1))
        return self._results(seq, call, [value] * self.num_replicas)

    @staticmethod
    def _stand_in(op: int, root: int, rank: int, summary: Message) -> list[list[Any]]:
        """What rank ``rank`` of ``summary`` sent, as far as the checks look."""
        if op == Op.ALLREDUCE:
            return [[b""]]
        if op == Op.BROADCAST and rank == root:
            return _tree.parts(summary)
        return []

    def _keep_down(self, seq: int, call: PendingCall, flags: int, segments: list[list[Any]]) -> None:
        """Keep a result sent down the tree, to send again if an interior rank is lost with it."""
        size = sum(len(f) if type(f) is bytes else memoryview(f).nbytes for s in segments for f in s)
        kept = self._sent_down
        kept[seq] = (call.op, call.root, flags, segments, size)
        self._sent_down_bytes += size
        while len(kept) > MAX_RESENT_CALLS or (len(kept) > 1 and self._sent_down_bytes > MAX_RESENT_BYTES):
            self._sent_down_bytes -= kept.popitem(last=False)[1][4]

    def _resend_down(self, rank: int) -> list[Outgoing]:
        """Interior rank ``rank`` is lost: the latest results sent down the tree go again to its
        subtree, straight (a rank that had one drops the second), before the FAIL."""
        if self.tree is None or not self.tree.children[rank]:
            return []
        return [(self.by_rank[r].peer, Message(Kind.RESULT, op, r, root, seq, self.session, flags=flags,
                                               segments=segments))
                for seq, (op, root, flags, segments, _) in self._sent_down.items()
                for r in range(rank + 1, self.tree.end[rank]) if r in self.by_rank]

    def _gave_up_early(self, seq: int, lo: int, end: int) -> list[Outgoing]:
        """Give-ups of ranks ``lo`` .. ``end`` - 1 that came before their parts."""
        out: list[Outgoing] = []
        for rank in range(lo, end):
            early = self._early.pop((seq, rank), None)
            if early is not None and not out:
                out = self._abandon(self.by_rank[rank], seq, *early)
        return out

    def _then(self, call: PendingCall, out: list[Outgoing]) -> list[Outgoing]:
        """``out``, a completed call's answer, then: a teardown closes the group; an ended rank fails it."""
        operation = OPERATIONS.get(call.op)
        if operation is not None and operation.closes:
            self.phase = Phase.CLOSED
            return out
        return out + self._check_endings() if self._ended else out

    def combined(self, asked: _ops.Combine, results: list[list[Any]]) -> list[Outgoing]:
        """The driver ran the reduction ``asked`` (rule 4): the RESULTs, given its
        ``results``; none if the call no longer waits for it (the group failed meanwhile)."""
        call, operation = self._handed_back(asked), OPERATIONS[asked.op]
        if call is None or not isinstance(operation, _ops.Reducing):
            return []
        out = self._results(asked.seq, call, operation.route_combined(self.num_replicas, call.root, results))
        return out + self._check_endings() if self._ended else out  # (a reduction never closes the group)

    def combine_failed(self, asked: _ops.Combine, exc: BaseException) -> list[Outgoing]:
        """The reduction ``asked`` raised ``exc``: an ERROR to every rank; as :meth:`combined`."""
        call = self._handed_back(asked)
        return [] if call is None else self._then(call, self._call_failed(asked.seq, call, exc))

    def _handed_back(self, asked: _ops.Combine) -> Optional[PendingCall]:
        """The call whose reduction ``asked`` was, if it still waits for it."""
        self.reducing, call = None, self.combining.pop(asked.seq, None)
        return call if self.phase is Phase.RUNNING else None

    # -- ending without teardown ------------------------------------------

    def _on_bye(self, member: Joined, calls: int, flags: int = 0) -> list[Outgoing]:
        # answered, after every reply before it: all it sent has been taken, so it may close
        answer = (member.peer, Message(Kind.BYE, rank=member.rank, seq=calls, session=self._binding(member)))
        if any(out[0] == member.peer for held in self.held.values() for _, out in held):
            return []  # sent again (a reconnect): its answer is still held for its data
        if self.phase is not Phase.RUNNING or member.ended is not None:
            return [answer]
        member.ended = max(calls, self.next_seq[member.rank])
        self._ended.append(member)
        log.info("zcollective coordinator: %s", member.describe_end())
        if flags & FLAG_DATA:  # its part of a call moving peer to peer never left: no ring completes
            told = self.fail("ReplicaLostError", f"{member.describe_end()} before it had moved its "
                             f"data of the calls going peer to peer; {self._in_flight()}",
                             lost=[member.rank], exclude={member.rank})
            return [*told, *self._release(member.rank), answer]
        farewell = self._hold(member, answer) + self._release(member.rank)  # it moves no more data
        if len(self._ended) == len(self.members):
            self.phase = Phase.CLOSED  # everyone is done: nothing can be waiting
            return farewell
        return self._check_endings() + farewell

    def _on_final(self, member: Joined, msg: Message) -> list[Outgoing]:
        """Rule 12: ``member`` sends no more point-to-point messages; every
        other member still running is told how many it sent that member."""
        final = _bodies.parse_final(msg, self.num_replicas)
        member.sent = sum(final["sent"])  # (its BYE comes next: said when it ended)
        if self.phase is not Phase.RUNNING:
            return []
        how = "called teardown" if final["teardown"] else "ended its program (without teardown)"
        calls = final["calls"]
        if calls is not None:
            how += f" after seq {calls - 1}" if calls else " with no collective call before"
        who = f"rank {member.rank} {how} ({member.in_world(', ')}pid {member.pid} on {member.host})"
        sent, lost, received = final["sent"], final["lost"], final["received"]
        return [(m.peer, _bodies.ended(who, None if received is None else received[m.rank], lost[m.rank],
                                       teardown=final["teardown"], rank=m.rank, root=member.rank,
                                       seq=sent[m.rank], session=self._binding(m)))
                for m in self.members.values() if m is not member and m.ended is None and not m.newcomer]

    def _hold(self, member: Joined, answer: Outgoing) -> list[Outgoing]:
        """The answer to ``member``'s BYE, or, when data went peer to peer and
        the next rank still runs, the TAKEN asking it (the answer is held)."""
        nxt = self.by_rank.get((member.rank + 1) % self.num_replicas)
        if self._moving is None or nxt is None or nxt is member or nxt.ended is not None:
            return [answer]
        seq = self._moving[0]  # every data call had every rank: this is the member's last
        self.held.setdefault(nxt.rank, []).append((seq, answer))
        return [(nxt.peer, Message(Kind.TAKEN, rank=nxt.rank, seq=seq, session=self.session))]

    def _release(self, rank: int, seq: Optional[int] = None) -> list[Outgoing]:
        """The BYE answers held for ``rank``'s data through ``seq`` (None: all)."""
        held = self.held.get(rank)
        if not held:
            return []
        self.held[rank] = [(s, out) for s, out in held if seq is not None and s > seq]
        return [out for s, out in held if seq is None or s <= seq]

    def _check_endings(self) -> list[Outgoing]:
        """Fail the group if a pending call needs a rank that ended (rule 7),
        or if rank 0 ended and every call it made is complete."""
        ended = self._ended  # kept by _on_bye: no scan of every member on every contribution
        if not ended or self.phase is not Phase.RUNNING:
            return []
        for seq in sorted(self.pending):
            gone = [m for m in ended if m.ended <= seq]  # type: ignore[operator]
            if gone:
                return self._fail_ended(gone[0], f"seq {seq} {self._pending_call(seq)}")
        host = self.by_rank.get(0)
        if host is not None and host.ended is not None and not any(s < host.ended for s in self.pending):
            # the usual end of a program: not worth more than an info line
            return self._fail_ended(host, "the coordinator it hosted is gone, so the group is over",
                                    logging.INFO)
        return []

    def _pending_call(self, seq: int) -> str:
        call = self.pending[seq]
        return (f"{describe_call(call.op, call.root)} was in flight on "
                f"{rank_list(call.contributions, self.world)}")

    def _fail_ended(self, member: Joined, context: str, level: int = logging.ERROR) -> list[Outgoing]:
        gone = {m.rank for m in self._ended}
        return self.fail("ReplicaLostError", f"{member.describe_end()}; {context}",
                         lost=[member.rank], ended=True, exclude=gone, level=level)

    def start_ending(self) -> None:
        """Rule 7: rank 0's program is ending; its last calls get
        :data:`EXIT_WAIT_S` to complete (:meth:`ending_due`)."""
        if self.ending_since is None:
            self.ending_since = self.clock()

    def ending_due(self) -> Optional[float]:
        """When rank 0 stops waiting for its last calls (then
        :meth:`give_up_ending`); None once the group is over, or not ending."""
        if self.ending_since is None or self.phase in (Phase.CLOSED, Phase.FAILED):
            return None
        return self.ending_since + EXIT_WAIT_S

    def give_up_ending(self) -> list[Outgoing]:
        """Rank 0's program ended and waited for the others to reach its
        last calls (or was interrupted): tell them the group is over."""
        host = self.by_rank.get(0)
        if self.phase is not Phase.RUNNING or host is None or self.ending_since is None:
            return []
        waited = round(self.clock() - self.ending_since, 1)
        if host.ended is None:  # interrupted before its BYE went: it ends now, after its calls
            host.ended = self.next_seq[0]
            self._ended.append(host)
            return self._fail_ended(host, "it was interrupted while ending, so the group is over")
        waiting = [f"seq {seq} {self._pending_call(seq)}" for seq in sorted(self.pending)
                   if seq < host.ended][:3]
        return self._fail_ended(host, f"it waited {waited:g} s for its last calls, but "
                                      f"{'; '.join(waiting) or 'they did not complete'}")

    def _mismatch(self, seq: int, call: PendingCall) -> str:
        groups: dict[tuple[str, str], list[int]] = {}
        for rank, contribution in sorted(call.contributions.items()):
            what = describe_call(contribution.op, contribution.root)
            groups.setdefault((what, contribution.callsite or "?"), []).append(rank)
        world = self.world
        parts = [f"{rank_list(ranks, world)} called {what} at {site}"
                 for (what, site), ranks in groups.items()]
        waiting = self._missing(call)
        if waiting:
            parts.append(f"{rank_list(waiting, world)} had not called yet")
        return f"seq {seq}: " + "; ".join(parts)

    def _problem(self, seq: int, call: PendingCall, contributions: list[Message]) -> Optional[list[Outgoing]]:
        """What a complete call is answered with instead of its route, if
        anything: an ERROR (no rules; a sender's own error, PeerError; parts no
        working replica sends, ProtocolError), a plan, a failure."""
        if call.op not in OPERATIONS:  # no working replica sends it
            return self._error_all(seq, call.op, error_body(
                "ProtocolError", f"seq {seq}: operation {call.op.label!r} has no rules"))
        flags = 0  # any rank's
        for c in contributions:
            flags |= c.flags
        if flags & FLAG_DATA and not flags & FLAG_LOCAL_ERROR:
            if self._ended:  # its program ended before this call's plan came: no ring completes
                member = self._ended[0]
                return self.fail("ReplicaLostError", f"{member.describe_end()} before the plan of "
                                 f"seq {seq} {call.op.label} came, whose data goes peer to peer; "
                                 f"that call cannot complete", lost=[member.rank],
                                 exclude={m.rank for m in self._ended})
            return self._plan(seq, call)
        for rank, c in enumerate(contributions):
            if c.flags & FLAG_LOCAL_ERROR:
                try:
                    said = c.body().get("message", "?")
                except WireError:  # a sender's error note that is not JSON: still its error
                    said = "?"
                return self._error_all(seq, call.op, error_body(
                    "PeerError", f"seq {seq} {call.op.label}: rank {rank}{in_world([rank], self.world)} "
                                 f"failed: {said}"))
        operation, root, n = OPERATIONS[call.op], call.root, self.num_replicas
        why = ((operation.bad_root(root, n) if not 0 <= root < n else "")  # (replicas check it: a
               or operation.malformed(contributions, root))  # broken or altered one; a split's root is
        # its kind, which a group of one or two has no rank for)
        return self._call_failed(seq, call, Malformed(why)) if why else None

    def _results(self, seq: int, call: PendingCall, routes: list[list[list[Any]]],
                 flags: int = 0) -> list[Outgoing]:
        """Call ``seq``'s RESULTs: a header of its own for each rank; ranks
        given one payload share its frames, which the driver hashes once."""
        if self.tree is not None and _tree.goes_down(call.op, flags):  # the rest from their parents
            whole = next((r for r in routes if r), routes[0])  # (a broadcast's root gets it too: its
            # subtree's ranks need it)
            outs: list[Outgoing] = [(self.by_rank[rank].peer, Message(
                Kind.RESULT, call.op, rank, call.root, seq, self.session, flags=flags, segments=whole))
                for rank in self._down]
            self._keep_down(seq, call, flags, whole)
            return outs + OPERATIONS[call.op].completed(self, seq)
        outs = [(self.by_rank[rank].peer, Message(
            Kind.RESULT, call.op, rank, call.root, seq, self.session, flags=flags, segments=segments))
            for rank, segments in enumerate(routes)]
        return outs + OPERATIONS[call.op].completed(self, seq)

    def _plan(self, seq: int, call: PendingCall) -> list[Outgoing]:
        """A call whose data travels on the data plane: matched here like any
        other, then every rank is sent the plan (:meth:`Operation.plan`) and
        moves the data itself. Ranks whose values disagree: a mismatch."""
        try:
            segments = OPERATIONS[call.op].plan(call.ranked(), call.root, self.hosts)
        except (Disagree, Malformed) as exc:
            return self._call_failed(seq, call, exc)
        self._moving = (seq, call.op)
        if _ops.shared_plan(segments):  # its ranks sync through the coordinator (rule 13)
            self._shared_calls[seq] = call.op
            while len(self._shared_calls) > MAX_SHARED_CALLS:
                self._shared_calls.popitem(last=False)
        return self._results(seq, call, [segments] * self.num_replicas, FLAG_DATA)

    def _call_failed(self, seq: int, call: PendingCall, exc: BaseException) -> list[Outgoing]:
        """Call ``seq`` failed here (``exc``): an ERROR to every rank, the group goes on."""
        head = f"seq {seq} {call.op.label}: "
        if isinstance(exc, Malformed):  # parts no working replica sends
            body = error_body("ProtocolError", f"{head}{exc}")
        elif isinstance(exc, _ops.Unreadable):  # the reduce function never ran: not a RemoteError
            body = error_body("SerializationError", f"{head}the coordinator (rank 0) {exc}")
        elif isinstance(exc, Disagree):  # nor here: arrays the data plane would have refused too
            body = error_body("CallMismatchError", head + self._disagreement(call, exc.described))
        else:  # the reduce function raised (SystemExit too: the user's error)
            if from_signal(exc):  # a signal handler's, on rank 0's thread: everyone hears of it,
                self.interrupted = exc  # then the driver raises it there
            body = _bodies.remote_error_body(f"{head}the reduction raised on the coordinator (rank 0)", exc)
        return self._error_all(seq, call.op, body)

    def _disagreement(self, call: PendingCall, described: Optional[list[str]] = None) -> str:
        """The ranks' values, grouped by what each passed and where: from
        their data plans, or as rank 0 found them (``described``)."""
        groups: dict[tuple[str, str], list[int]] = {}
        if described is not None and call.spans is not None:  # by part: each of its ranks passed it
            spans = call.spans
            described = [what for (lo, _), what in zip(self._parts(call), described, strict=True)
                         for _ in range(spans.get(lo, lo + 1) - lo)]
        for rank, c in enumerate(call.ranked()):
            what = ("a value that does not go peer to peer (not a numeric array that large, "
                    "reduced elementwise)")
            if described is not None:
                what = described[rank]
            elif c.flags & FLAG_DATA:
                try:
                    dtype, shape, fn = _bodies.parse_array_plan(c)
                    what = OPERATIONS[call.op].described(dtype, shape, fn)
                except WireError:
                    what = "a malformed array description"
            groups.setdefault((_bodies.printable(what[:300]), c.callsite or "?"), []).append(rank)
        world = self.world
        parts = [f"{rank_list(ranks, world)} passed {what} at {site}"
                 for (what, site), ranks in groups.items()]
        return "the ranks disagree: " + "; ".join(parts) + " (this call failed; the group goes on)"

    def _error_all(self, seq: int, op: Op, body: dict[str, Any],
                   ranks: Optional[list[int]] = None) -> list[Outgoing]:
        """An ERROR of call ``seq`` to every rank (or to ``ranks``)."""
        if self._shared_calls.pop(seq, None) is not None:  # (its syncs wait for nobody now)
            for key in [k for k in self._syncing if k[0] == seq]:
                del self._syncing[key]
        if self.name:  # (a sub-group's: named, as its FAILs are)
            body = {**body, "message": f"{self.name}: {body.get('message', '?')}"}
        msg = control(Kind.ERROR, body, seq=seq, op=op, session=self.session)
        return [(self.by_rank[r].peer, dataclasses.replace(msg, rank=r))
                for r in (range(self.num_replicas) if ranks is None else ranks)]

    # -- status and failure ----------------------------------------------

    def _status(self, seq: int, member: Joined, welcomed: bool = True) -> Message:
        binding = self._binding(member) if welcomed else join_token(member.nonce)
        if self.phase is Phase.JOINING:
            refused = {str(r): m for r, m in self.refused.items() if r not in self.by_rank}
            return _bodies.status(seq, "joining", {"missing": self.missing_joins(), "arrived": sorted(
                self.by_rank), "refused": refused}, rank=member.rank, session=binding)
        call = self.pending.get(seq)
        arrived = sorted(call.contributions) if call is not None else [
            r for r in range(self.num_replicas) if self.next_seq[r] > seq]
        missing = [r for r in range(self.num_replicas) if r not in arrived]
        state = "pending" if missing else ("done" if call is None else "computing")
        fields: dict[str, Any] = {"arrived": arrived, "missing": missing}
        if call is not None:
            fields["op"] = describe_call(call.op, call.root)
            if missing and call.arrived:
                fields["stall"] = self.stall_line(seq, call, self.clock())
        return _bodies.status(seq, state, fields, rank=member.rank, session=binding)

    # -- stalls (rule 11) ------------------------------------------------

    def next_stall(self) -> Optional[float]:
        """When (its clock) a stall warning may next be due; None: none can."""
        if self.warn_after is None:
            return None
        if self.phase is Phase.JOINING:
            if self._join_warned >= MAX_STALL_WARNINGS:
                return None
            return self.started_at + self.warn_after * (1 << self._join_warned)
        if self.phase is not Phase.RUNNING or not self.pending:
            return None
        return min(filter(None, map(self._stall_due, self.pending.values())), default=None)

    def _stall_due(self, call: PendingCall) -> Optional[float]:
        """When ``call``'s next stall warning is due (rule 11); None: no more."""
        if self.warn_after is None or call.warned >= MAX_STALL_WARNINGS or not call.arrived:
            return None
        return min(call.arrived.values()) + self.warn_after * (1 << call.warned)

    def _missing(self, call: PendingCall) -> list[int]:
        """The ranks ``call`` waits for."""
        return [r for r in range(self.num_replicas) if r not in call.contributions]

    def stalls(self, now: float) -> list[tuple[str, list[int]]]:
        """The stall warnings due at ``now``: each line, with the ranks it names
        (the driver logs them, and may ask the launcher for their stacks)."""
        due = self.next_stall()
        if due is None or now < due:
            return []
        if self.phase is Phase.JOINING:
            self._join_warned += 1
            missing = self.missing_joins()
            joined = "; ".join(f"{m.describe()} from {m.address}" for _, m in sorted(self.by_rank.items()))
            return [(f"zcollective coordinator: {self.name or 'the group'} has waited "
                     f"{now - self.started_at:.0f} s for {rank_list(missing, self.world)} to join "
                     f"(joined: {joined or 'none'})", missing)]
        out = []
        for seq, call in sorted(self.pending.items()):
            call_due = self._stall_due(call)
            if call_due is not None and now >= call_due:
                call.warned += 1
                line = f"zcollective coordinator: {self.stall_line(seq, call, now)}"
                out.append((line, self._missing(call)))
        return out

    def stall_line(self, seq: int, call: PendingCall, now: float) -> str:
        """``seq 42 allreduce at train.py:88 has waited 61 s for rank 3 ...``"""
        site = next((c.callsite for c in call.contributions.values() if c.callsite), "?")
        missing = self._missing(call)
        waited, arrived = now - min(call.arrived.values()), ",".join(map(str, sorted(call.contributions)))
        return (f"seq {seq} {describe_call(call.op, call.root)} at {site} has waited {waited:.0f} s "
                f"for {rank_list(missing, self.world)} (arrived: {arrived}); "
                + "; ".join(self._last_call(r, now) for r in missing))

    def snapshot(self, now: float) -> dict[int, dict[str, Any]]:
        """Per rank: its last call (seq, op, call site, how long ago) and the
        calls pending for it. Read by any thread (``Group.status``): only
        copies are iterated, so a change meanwhile costs at most a stale view."""
        ranks: dict[int, dict[str, Any]] = {}
        for rank, member in list(self.by_rank.items()):
            last = member.last
            ranks[rank] = {"describe": member.describe(), "ended": member.ended is not None,
                           "last_call": None if last is None else {
                               "seq": last[0], "op": last[1], "callsite": last[2],
                               "ago_s": round(now - last[3], 3)},
                           "waited_for": []}
        for seq, call in list(self.pending.items()):
            arrived = dict(call.arrived)
            if not arrived:
                continue
            waiting = round(now - min(arrived.values()), 3)
            for rank, entry in ranks.items():
                if rank not in arrived:
                    entry["waited_for"].append({"seq": seq, "op": describe_call(call.op, call.root),
                                                "waiting_s": waiting})
        return ranks

    def _last_call(self, rank: int, now: float) -> str:
        member = self.by_rank.get(rank)
        if member is None:
            return f"rank {rank} is not a member"
        if member.ended is not None:
            return member.describe_end()
        if member.last is None:
            return f"{member.describe()} has made no call yet"
        seq, op, site, at = member.last
        return f"{member.describe()}'s last call was seq {seq} {op} at {site or '?'}, {now - at:.0f} s ago"

    def _stall_ended(self, seq: int, call: PendingCall, last: int) -> None:
        waited = call.arrived[last] - min(call.arrived.values())
        log.warning("zcollective coordinator: seq %d %s completed after %.0f s; rank %d was last",
                    seq, describe_call(call.op, call.root), waited, last)

    def _in_flight(self) -> str:
        if self.phase is Phase.JOINING:
            return f"while joining ({rank_list(self.missing_joins(), self.world)} had not joined)"
        moving = self._moving
        if not self.pending:
            if moving is not None and moving[0] == min(self.next_seq) - 1:
                return f"seq {moving[0]} {moving[1].label} was matched; its data moves peer to peer"
            return f"no call was in flight (next seq {min(self.next_seq)})"
        return "in flight: " + ", ".join(f"seq {seq} {describe_call(call.op, call.root)} (arrived: "
                                         f"{rank_list(call.contributions, self.world)})"
                                         for seq, call in sorted(self.pending.items())[:3])

    def _fail_message(self, member: Joined) -> Outgoing:
        assert self.failure is not None
        return member.peer, control(Kind.FAIL, self.failure, rank=member.rank,
                                    session=self._binding(member))

    def _warn(self, address: str, category: str, text: str) -> None:
        key = (address, category)
        if key in self._warned:
            return
        if len(self._warned) < MAX_WARNED_PEERS:
            self._warned.add(key)
        log.warning("zcollective coordinator: %s", text)


def _oversubscribed(members: list[Joined]) -> bool:
    """Does some host run more ranks than it has cores? (Then every hop of the tree waits for
    the kernel to run its rank, and the star is faster: benchmarks/README.md.)"""
    ranks: dict[str, int] = {}
    for m in members:  # (by host name: rank 0's own member has no address)
        ranks[m.host] = ranks.get(m.host, 0) + 1
        if ranks[m.host] > m.cores:
            return True
    return False


def is_loopback(address: str) -> bool:
    """Is ``address`` (a peer's; a host to bind, bracketed or ``*``) a loopback one?"""
    try:
        return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def _host_of(endpoint: Optional[str]) -> str:
    """``tcp://host:port`` -> ``host``."""
    return (endpoint or "").rpartition(":")[0]


def _of_job(job: Optional[str]) -> str:
    """What a JOIN or a coordinator is of: "is of job 'train-a'", or "names no job"."""
    return "names no job" if job is None else f"is of job {job!r}"


def _claimed(join: Any) -> tuple[int, int]:
    """The rank and JOIN token a refused JOIN claimed, as far as they can be
    read (it may have failed authentication or be malformed): what its REJECT
    is bound to."""
    try:
        msg = join if isinstance(join, Message) else decode(join)  # a tag is stripped unread
        return msg.rank, join_token(_bodies.join_nonce(msg))
    except Exception:  # anything unreadable: the REJECT is bound to nobody
        return NO_RANK, 0


__all__ = ["Coordinator", "Phase", "NO_RANK"]
