"""The coordinator's rules: a pure object fed messages and peer events, returning the messages
to send and the reductions to run (:func:`._ops.applied`); rank 0's driver feeds it. It owns the
group's state; each concern is a part (:mod:`._joining`, :mod:`._membership`, :mod:`._matching`,
:mod:`._climbing`, :mod:`._endings`, :mod:`._stalls`), and a table routes each message kind to one.

Rules 1-14 (cited by number in the code): see docs/protocol.md,
*Coordinator rules*.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any, Callable, Optional

from .._format import _bodies, _wire
from .._format._bodies import PYTHON_VERSION, error_body
from .._format._mac import HMAC_SHA256
from .._format._wire import NO_RANK, Kind, Message, Signer, WireError, join_token
from .._limits import WIRE_PART_BYTES
from . import _ops, _tree
from ._climbing import Climb
from ._endings import Endings
from ._joining import MAX_ANSWERED_PEERS, Joining
from ._matching import Calls
from ._membership import Membership
from ._ops import Outgoing
from ._parts import Forming, Joined, PendingCall, Phase, is_loopback
from ._stalls import Stalls
from ._stats import Lateness

log = logging.getLogger("zcollective")

MAX_WARNED_PEERS = 1024  # bounds the memory a flood of strangers can take
GONE = "connection closed or heartbeats unanswered"  # ZeroMQ does not say which (ended, killed, stopped)
SEEN_DEAD_SHARE = 0.5  # gone within this share of the liveness bound after its last message: it died (rule 8)
RANK0_PEER = b"\x00L0"  # the member in rank 0's process (DEALERs start with b"R"; the server drops it)
PROBE_GAP_S = 0.001  # a close: probe rounds at once, then after 1, 2, 4 ... ms (a pipe goes in one or
PROBE_MAX_GAP_S = 0.25  # two), the gap growing to this, until PROBE_SPAN_S after the last close;
PROBE_SPAN_S = 1.0  # a close during a schedule brings the next round to PROBE_FLOOD_GAP_S after the
PROBE_FLOOD_GAP_S = 0.05  # last: a stranger costs a dozen rounds, a flood 20 a second


class ProbeSchedule:
    """When the driver sends :meth:`Coordinator.probes` (rule 8): ZeroMQ says only that *a*
    connection closed, and a send fails once libzmq dropped its pipe, so rounds go at growing gaps."""

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
        """A round went (``probed``: to someone); the next after the gap, which doubles."""
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


class Coordinator:
    """Per-group collective state, composed of its parts; see the module docstring for the rules."""

    def __init__(self, num_replicas: int, session: int, max_frames: int,
                 signer: Optional[Signer] = None, max_frame_bytes: Optional[int] = None,
                 user_code: _ops.UserCode = lambda fn: fn,
                 forming: Optional[Forming] = None, host_address: str = "?",
                 liveness_s: Optional[float] = None, job: Optional[str] = None,
                 warn_after: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 entropy: Callable[[int], bytes] = os.urandom, tree: str = "auto",
                 world: Optional[list[int]] = None) -> None:
        self.clock = clock  # every time this object reads or keeps (a test passes a fake one)
        self.world, self.name = world, _ops.group_name(world)  # a sub-group's world ranks; its errors' prefix
        self.forming, self.liveness_s, self.job, self.warn_after = forming, liveness_s, job, warn_after
        self.failed_at: Optional[float] = None  # when (its clock) it failed
        self.started_at = clock()  # (the join's stall is timed from here)
        if forming is not None:
            num_replicas = len(forming.expected)  # at most; those who came, once formed
        self.host_address = host_address  # rank 0's, as the others reach it
        self.old_ranks: Optional[list[int]] = None  # formed: every new rank's old one
        self.newcomers: dict[bytes, Joined] = {}  # parked until a GROW (rule 10), by routing id
        self.num_replicas, self.session, self.signer = num_replicas, session, signer
        self.user_code = user_code  # how the driver calls a reduce function it runs (_ops.applied)
        self.max_frames, self.max_frame_bytes = max_frames, max_frame_bytes
        self.phase = Phase.JOINING
        self.members: dict[bytes, Joined] = {}  # by routing id
        self.by_rank: dict[int, Joined] = {}
        self.next_seq = [0] * num_replicas
        self.pending: dict[int, PendingCall] = {}
        self.combining: dict[int, PendingCall] = {}  # calls complete here whose reduction was asked for
        self.failure: Optional[dict[str, Any]] = None
        self.reducing: Optional[tuple[int, _ops.Op, float]] = None  # (seq, op, since): asked, not handed back
        self.interrupted: Optional[BaseException] = None  # a reduce function's signal, raised later
        self.ended: list[Joined] = []  # members that said BYE, in that order
        self.welcomed = False  # WELCOME went out: members know the session
        self.refused: dict[int, str] = {}  # rank -> why a JOIN claiming it was refused (joining)
        self.lateness = Lateness(num_replicas)  # who is slow (read by rank 0's own thread too)
        self.part_bytes = WIRE_PART_BYTES  # frames above this travel in parts (settled at the start)
        self.mac = HMAC_SHA256  # the chunk MACs every rank can use
        self.hosts: Optional[list[Optional[int]]] = None  # by rank, the host whose segment it shares
        self.tree_mode = tree  # "auto", "on", "off"
        self.tree: Optional[_tree.Shape] = None  # small calls climb it (rule 14), once settled
        self._warned: set[tuple[str, str]] = set()
        self._challenge_key, self._data_key = entropy(32), entropy(_bodies.DATA_KEY_BYTES).hex()

        self.joining = Joining(self, self._challenge_key)
        self.membership = Membership(self, self._data_key)
        self.calls = calls = Calls(self)
        self.climb = Climb(self)
        self.endings = endings = Endings(self)
        self.watch = watch = Stalls(self)
        self._answered = self.joining.answered
        self.unanswered, self.held = endings.unanswered, endings.held  # (the same objects)
        # each message kind of a bound member -> its part's handler
        self._routes: dict[Kind, Callable[[Joined, Message, str], _ops.Step]] = {
            Kind.CONTRIB: calls.on_contribution, Kind.UP: self.climb.on_up, Kind.SYNC: calls.on_sync,
            Kind.ABORT: calls.on_abort, Kind.BYE: endings.on_bye, Kind.TAKEN: endings.on_taken,
            Kind.FINAL: endings.on_final, Kind.STATUS: watch.on_status}
        # the parts' entry points for the drivers, as the coordinator's own (no hop)
        self.combined, self.combine_failed = calls.combined, calls.combine_failed
        self.admit, self.dismiss_newcomers = self.membership.admit, self.membership.dismiss_newcomers
        self.form_now, self.missing_joins = self.membership.form_now, self.membership.missing_joins
        self.start_ending, self.ending_due = endings.start_ending, endings.ending_due
        self.give_up_ending, self.last_byes = endings.give_up_ending, endings.last_byes
        self.waiting = endings.waiting
        self.next_stall, self.stalls, self.snapshot = watch.next_stall, watch.stalls, watch.snapshot

    def receive(self, peer: bytes, frames: list[Any], address: str = "?") -> _ops.Step:
        """One message from ``peer``: what to send to whom, and reductions to run where they
        stand. Input that does not parse is dropped and logged: it never raises."""
        if peer in self._answered and self.phase is not Phase.JOINING and peer not in self.members:
            return []  # refused once the group ran: nothing it sends is read again
        try:
            msg = _wire.decode(frames, self.max_frames, self.signer, self.max_frame_bytes)
        except WireError as exc:
            return self._undecoded(peer, frames, exc, address)
        return self.receive_message(peer, msg, address)

    def receive_message(self, peer: bytes, msg: Message, address: str = "rank 0's own process") -> _ops.Step:
        """One decoded message (rank 0's member's, or from :meth:`receive`): a member's, bound to
        it, goes straight to its part's handler."""
        try:
            member = self.members.get(peer)
            if member is not None:
                member.heard = self.clock()
                if msg.session == self.session and msg.rank == member.rank and self.phase is not Phase.FAILED:
                    handle = self._routes.get(msg.kind)
                    if handle is not None:
                        return handle(member, msg, address)
            return self._handle(peer, member, msg, address)
        except WireError as exc:
            self.warn(address, "malformed", f"dropped a malformed message from {address}: {exc}")
            return []

    def _handle(self, peer: bytes, member: Optional[Joined], msg: Message, address: str) -> _ops.Step:
        """The rest: JOINs, strangers, a member's message not bound to it, a failed group's."""
        kind = msg.kind
        if kind is Kind.BYE and msg.session != self.session:  # a JOIN taken back before its WELCOME
            return self.joining.on_withdraw(peer, member, msg)
        if kind is Kind.UP and member is not None and msg.session == self.session:
            return self.climb.on_up(member, msg, address)
        if kind is Kind.JOIN and (member is None or msg.rank in (member.rank, member.old_rank)):
            # (a formed group's member repeats its JOIN, after a reconnect, under its old rank)
            return self.joining.on_join(peer, msg, member, address)
        if member is None:
            self.warn(address, "stranger", f"dropped a {kind.name} message from "
                      f"a peer at {address} that has not joined the group")
            return []
        if msg.rank != member.rank or not (msg.session == self.session or (  # a STATUS sent before
                kind is Kind.STATUS and (self.phase is Phase.JOINING or msg.session == 0))):  # its WELCOME
            what = (f"a {kind.name} message on the connection of {member.describe()} at "
                    f"{address} claimed rank {msg.rank}, session {msg.session:#x}")
            if self.signer is not None:  # it proved the secret, so it was moved or replayed
                return self.fail("AuthenticationError", f"{what}: was it moved between connections "
                                 f"or replayed? {self.watch.in_flight()}", bad=[member.rank])
            self.warn(address, "forged", f"dropped {what}")
            return []
        if self.phase is Phase.FAILED and kind not in (Kind.BYE, Kind.TAKEN, Kind.SYNC):  # (data still
            return [self.fail_message(member)]  # moves after a failure of ended ranks)
        handle = self._routes.get(kind)
        if handle is None:
            self.warn(address, "unexpected", f"dropped an unexpected {kind.name} from {member.describe()}")
            return []
        return handle(member, msg, address)

    def _undecoded(self, peer: bytes, frames: list[Any], exc: WireError, address: str) -> _ops.Step:
        try:
            if isinstance(exc, _wire.AuthError):
                return self.joining.on_auth_error(peer, frames, exc, address)
            if isinstance(exc, _wire.VersionError):
                return self.joining.on_version_error(peer, frames, exc, address)
            member = self.members.get(peer)
            self.warn(address, "malformed", f"dropped a malformed message from "
                      f"{member.describe() if member else 'unknown peer'} at {address}: {exc}")
        except WireError as again:
            self.warn(address, "malformed", f"dropped a malformed message from {address}: {again}")
        return []

    def probes(self) -> list[Outgoing]:
        """A connection closed, whose is not known: a PROBE to each peer whose loss matters (rule 8)."""
        if self.phase in (Phase.JOINING, Phase.RUNNING):
            peers = [m for m in self.members.values() if m.ended is None and m.rank != 0]
        else:  # over: only those that owe an answer
            peers = [m for m in self.members.values() if m.peer in self.unanswered or self.held.get(m.rank)]
        probes = [(m.peer, Message(Kind.PROBE, rank=m.rank, session=self.binding(m))) for m in peers]
        return probes + [(n.peer, Message(Kind.PROBE, rank=n.rank, session=join_token(n.nonce)))
                         for n in self.newcomers.values()]  # one that timed out or died is dropped

    def gone(self, peer: bytes, reason: str = GONE) -> list[Outgoing]:
        """A send to ``peer`` failed (rule 8): a member is lost; while joining, its slot opens again."""
        self.unanswered.discard(peer)
        member = self.members.get(peer)
        if member is None:
            self.newcomers.pop(peer, None)  # a newcomer that left, or a stranger
            return []
        released = self.endings.release(member.rank)  # it takes no more data
        if member.ended is not None:
            return released  # it said BYE: a program that ended is not a lost one
        if self.phase is Phase.JOINING:
            del self.members[member.peer], self.by_rank[member.rank]
            log.warning("zcollective coordinator: %s left before the group started; "
                        "waiting for rank %d again", member.describe(), member.rank)
            return []
        return self.lost(member.rank, reason) + released

    def lost(self, rank: int, reason: str) -> list[Outgoing]:
        """Rank ``rank`` is gone: fail the group and tell every other member."""
        if self.phase in (Phase.CLOSED, Phase.FAILED):
            return []
        member = self.by_rank.get(rank)
        if member is not None and member.ended is not None:
            return []
        who = member.describe() if member else f"rank {rank}"
        message = f"{who} was lost ({reason}); {self.watch.in_flight()}"
        dead = member is not None and self.liveness_s is not None and (
            self.clock() - member.heard < SEEN_DEAD_SHARE * self.liveness_s)
        resent = self.climb.resend_down(rank)
        return resent + self.fail("ReplicaLostError", message, lost=[rank], dead=[rank] if dead else [],
                                  exclude={rank})

    def fail(self, error: str, message: str, exclude: Iterable[int] = (), level: int = logging.ERROR,
             **extra: Any) -> list[Outgoing]:
        """Enter FAILED for good and tell every member (but ``exclude``)."""
        if self.phase is Phase.FAILED:
            return []
        if self.tree is not None and self.phase is Phase.RUNNING:  # results may still come down (rule 14)
            extra["complete"] = min([*self.pending, *self.combining, max(self.next_seq)])
        self.phase = Phase.FAILED
        self.failed_at = self.clock()
        if self.name:
            message = f"{self.name}: {message}"
        self.failure = error_body(error, message, **extra)
        if extra.get("ended") is not True:  # (a rank that ended moved its data: those calls go on)
            self.calls.forget_syncs()
        log.log(level, "zcollective coordinator: %s", message)
        skip = set(exclude)
        return [self.fail_message(m) for m in self.members.values() if m.rank not in skip]

    def fail_message(self, member: Joined) -> Outgoing:
        """The FAIL ``member`` is sent."""
        assert self.failure is not None
        return member.peer, _wire.control(Kind.FAIL, self.failure, rank=member.rank,
                                          session=self.binding(member))

    def binding(self, member: Joined) -> int:
        """The session a message to ``member`` carries: the group's once welcomed, else its JOIN's token."""
        return self.session if self.welcomed else join_token(member.nonce)

    def warn(self, address: str, category: str, text: str) -> None:
        """Log ``text``, once per address and category (bounded)."""
        key = (address, category)
        if key in self._warned:
            return
        if len(self._warned) < MAX_WARNED_PEERS:
            self._warned.add(key)
        log.warning("zcollective coordinator: %s", text)


__all__ = ["Coordinator", "Phase", "NO_RANK", "Forming", "Joined", "PendingCall", "PYTHON_VERSION",
           "MAX_ANSWERED_PEERS", "ProbeSchedule", "RANK0_PEER", "is_loopback"]
