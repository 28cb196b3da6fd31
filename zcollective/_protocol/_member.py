"""One replica's rules: a pure object fed messages and connection events,
returning the messages to send. Every replica, rank 0 included, has one
:class:`Member`; its driver (:mod:`zcollective._io._driver`) gives it what
arrives and sends what it returns and owes. It holds the one table of calls
in flight and says what each came to (:class:`CallOutcome`), for the call
runner to apply. Its parts: joining (:mod:`._member_join`), data moved off
the star (:mod:`._member_data`), the tree (:mod:`._member_tree`).

Rules 1-11 (cited by number in the code): see docs/protocol.md, *Member rules*.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

from .._format import _bodies, _wire
from .._format._bodies import NOT_FORMING
from .._format._bodies import is_data_key as _is_key  # noqa: F401 (tests check it here)
from .._format._mac import HMAC_SHA256
from .._format._wire import (
    FLAG_DATA,
    FLAG_LAST,
    FLAG_LOCAL_ERROR,
    AuthError,
    Kind,
    Message,
    Signer,
    VersionError,
    WireError,
    decode,
    error_note,
)
from .._limits import STATUS_WAIT_S, WIRE_PART_BYTES
from ..errors import AuthenticationError, ProtocolError, ReplicaLostError
from . import _tree
from ._member_data import DataMoves
from ._member_join import (  # noqa: F401 (importable here, as ever)
    FOREIGN_PEER_S,
    FOREIGN_PEER_TRIES,
    ConnectionEvent,
    Joining,
    JoinTimer,
    checked_in_world,
    lost_rank_0,
)
from ._member_tree import TreeRole
from ._ops import LABELS, Op, group_name, in_world
from ._outcomes import CallOutcome, fresh
from ._p2p import Mail
from ._stats import CallStats, calls_log

log = logging.getLogger("zcollective")
NO_DUE: Callable[[], Optional[float]] = itertools.repeat(None).__next__  # no timer of the tree (no
# Python call on the common path: the driver asks every wait)


@dataclass(slots=True)
class Call:
    """A call in flight: its label, and (for the caller's own calls) the
    future its outcome is for and the finisher that makes its value from a
    RESULT."""

    op: str
    future: Any = None  # the runner's (a CollectiveFuture), never read here; None for an error note
    finish: Optional[Callable[[Message], Any]] = None
    started: float = 0.0  # when submitted (the member's stopwatch)
    sent: int = 0  # bytes of the contribution
    callsite: str = ""
    transfer: Optional[Callable[[Message], Any]] = None  # a plan -> the data plane's Transfer
    described: bool = False  # its contribution describes data of its own to move (FLAG_DATA)
    reduce: Any = None  # an allreduce's function (for this rank's subtree, in the tree)


class Member:
    """One replica's rules; see the module docstring."""

    def __init__(self, rank: int, size: int, endpoint: str, signer: Optional[Signer] = None,
                 max_frame_bytes: Optional[int] = None, clock: Callable[[], float] = time.monotonic,
                 entropy: Callable[[int], bytes] = os.urandom,
                 stopwatch: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # when it failed, its handshakes and timers (a test passes a fake one)
        self.stopwatch = stopwatch  # what a call took (its stats)
        self.rank = rank
        self.size = size
        self.endpoint = endpoint  # what messages name as the coordinator's address
        self.world: Optional[list[int]] = None  # a sub-group's: its ranks' world ranks (its errors name them)
        self.signer = signer
        self.max_frame_bytes = max_frame_bytes
        self.session = 0  # 0 until the WELCOME
        self.next_seq = 0
        self.calls: dict[int, Call] = {}
        self.owed: deque[Message] = deque()  # contributions to send, in order (rule 4)
        self.failure: Optional[Exception] = None
        self.failed_at = 0.0  # when (its clock) it failed here
        self.connected = False
        self.greeted = False  # a ZeroMQ handshake with the coordinator succeeded on the connection now up
        self.refused = False  # a connection attempt was refused, and no handshake ever succeeded
        self.shook = False  # a handshake with the coordinator ever succeeded
        self.host_busy = False  # forming: the would-be host's earlier group is still open there
        self.coordinator_lost = False  # its connection to rank 0 broke after the WELCOME
        self.status: dict[int, dict[str, Any]] = {}  # seq -> the coordinator's STATUS_REPLY
        self.farewell = False  # the coordinator answered this member's BYE (rule 7)
        self.challenge: Optional[str] = None  # the coordinator's last CHALLENGE (with a secret)
        self._reserved: Optional[tuple[int, Op, int, str]] = None  # seq, op, root, site being built
        self.stats = CallStats()
        self.log_calls = False  # one line per call on the logger "zcollective.calls"
        self.data_endpoint: Optional[str] = None  # this replica's data port, if it has one
        self.data_min_bytes = 0  # what it asks of the group (rank 0's is used)
        self.data_mode = "auto"  # "on": use it even on one host (rank 0's is used)
        self.data_endpoints: Optional[list[str]] = None  # every rank's, from the WELCOME
        self.data_key: Optional[str] = None  # the data ports' token key (hex), from the WELCOME
        self.mail_endpoint: Optional[str] = None  # this replica's mailbox (point to point), if any
        self.mail_window = 0  # what a sender may leave unreceived here (its Config's)
        self.local_name: Optional[str] = None  # its one-host mailbox's name (_io/_local), if any
        self.local_names: Optional[list[Optional[str]]] = None  # every rank's, from the WELCOME
        self.mail_endpoints: Optional[list[str]] = None  # every rank's, from the WELCOME ...
        self.mail_key: Optional[str] = None  # ... and their tokens' key (hex)
        self.mail: Optional[Mail] = None  # its point-to-point rules, once welcomed
        self.parent = -1  # its parent in the tree of small calls (rule 11); -1: none (rank 0, no tree)
        self.relay: Optional[_tree.Relay] = None  # its rules there, if it has children
        self.asks: deque[Any] = deque()  # reductions its relay asked for (the driver runs them), and
        # what goes up after them, in line
        self.user_code: Callable[[Any], Any] = lambda fn: fn  # how its driver runs a reduce function
        self.deferred: Optional[tuple[Exception, bool, Optional[int], float]] = None  # a failure (its error,
        # keep_data, the calls it says completed; None: all made) held until their results came, and
        # until when at most: a FAIL, or rank 0's connection lost meanwhile (rule 11)
        self.shm_offer: Optional[tuple[int, int]] = None  # it can share memory on its host: (threshold, room)
        self.shared: Optional[dict[str, Any]] = None  # the WELCOME's shared memory: min, hosts, room
        self.outcomes: deque[CallOutcome] = deque()  # calls settled, for the runner to apply (rule 3)
        self.transfers: deque[tuple[int, Any]] = deque()  # (seq, Transfer) ready to move, in order
        self.part_bytes = WIRE_PART_BYTES  # frames above this are sent in parts (the WELCOME says)
        self.mac = HMAC_SHA256  # the chunk MACs of the group (the WELCOME says)
        self.lineage: Optional[str] = None  # joining a group formed from an earlier one: its session
        self.newcomer = False  # joining a running group: wait to be admitted
        self.job: Optional[str] = None  # its job's name, which every JOIN carries (None: unnamed)
        self.admitted: Optional[dict[str, Any]] = None  # a newcomer's rank, size and lineage (WELCOME)
        self.addresses: Optional[list[str]] = None  # every rank's host, as rank 0 sees it (WELCOME)
        self.old_ranks: Optional[list[int]] = None  # formed from an earlier group: every rank's old one
        self.old_size = 0  # ... and the size of that group
        # its parts, and what the drivers call of them
        self.joining = joining = Joining(self, entropy)
        self.moves = moves = DataMoves(self)
        self.tree = tree = TreeRole(self)
        self._nonces = joining.nonces
        self.join, self.start_join, self.stop_join = joining.join, joining.start, joining.stop
        self.connection, self.join_timeout_message = joining.connection, joining.timeout_message
        self.data_lost, self.data_failed, self.data_done = moves.lost, moves.failed, moves.done
        self.moving = moves.moving
        self.timeout_message = partial(timeout_message, self)
        self.climb, self.climbed, self.tree_timer = tree.climb, tree.climbed, tree.timer
        self.tree_due = NO_DUE  # (the tree's, once this rank has a parent: see TreeRole.plant)
        self.awaits_tree, self.undefer, self.send_up = tree.awaits, tree.undefer, tree.send_up
        self.send_now = tree.send_now

    @property
    def joined(self) -> bool:
        return self.session != 0

    @property
    def losing_data(self) -> bool:
        """A data link was lost and the member waits for the coordinator to say why."""
        return self.moves.loss is not None

    def next_deadline(self) -> Optional[float]:
        """When (its clock) :meth:`on_timer` next has something to do; None: no timer runs."""
        timer, loss = self.joining.running(), self.moves.due()
        if timer is None or loss is None:
            return loss if timer is None else timer.due
        return min(timer.due, loss)

    def on_timer(self, now: float) -> list[Message]:
        """The timers due at ``now`` (rules 8 and 9); the messages to send."""
        return [*self.moves.on_timer(now), *self.joining.on_timer(now)]

    # -- calls ----------------------------------------------------------------

    def check(self) -> None:
        """Raise the group's failure, if it has one (rule 5)."""
        if self.failure is not None:
            raise fresh(self.failure)

    def reserve(self, op: Op, root: int, callsite: str) -> int:
        """Hold the next seq for a call whose part is being built; return it
        (then :meth:`submit`, or :meth:`unreserve` or :meth:`abandon`)."""
        if self.deferred is not None:  # (every call it waited for came before)
            self.undefer()
        if self.failure is not None:
            self.check()
        self._reserved = (self.next_seq, op, root, callsite)
        return self.next_seq

    def unreserve(self) -> None:
        """The part could not be built (nothing was sent): the seq stays free."""
        self._reserved = None

    def abandon(self, reason: str) -> None:
        """The part's building was interrupted: owe an error note for the
        reserved seq instead, so every rank's call there ends in an error and
        the next call pairs correctly."""
        reserved = self._reserved
        if reserved is not None and self.failure is None:
            seq, op, root, callsite = reserved
            self.calls[seq] = Call(op.label)
            self.next_seq, self._reserved = seq + 1, None
            self.owed.append(Message(Kind.CONTRIB, op, self.rank, root, seq, self.session, callsite,
                                     FLAG_LOCAL_ERROR, None, error_note(reason)))

    def submit(self, op: Op, root: int, segments: list[list[Any]], fn: Any = None,
               callsite: str = "", flags: int = 0, future: Any = None,
               finish: Optional[Callable[[Message], Any]] = None,
               transfer: Optional[Callable[[Message], Any]] = None, reduce: Any = None) -> int:
        """Owe this rank's contribution to the next call (rule 4); return its seq.

        Raises
        ------
        ValueError
            A frame is larger than ``max_frame_bytes`` (checked before
            anything is owed: the coordinator would drop the connection).
        """
        if self.failure is not None:
            self.check()
        limit = self.max_frame_bytes or sys.maxsize
        sent = 0
        for segment in segments:
            for frame in segment:
                size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
                if size > limit:
                    raise ValueError(
                        f"{self.who}: a {op.label} value holds a buffer of {size} bytes, "
                        f"above max_frame_bytes={limit}; raise ZCOLLECTIVE_MAX_FRAME_BYTES on "
                        f"every replica, or split the value")
                sent += size
        seq = self.next_seq
        self.calls[seq] = Call(LABELS[op], future, finish, self.stopwatch(), sent, callsite, transfer,
                               bool(flags & FLAG_DATA), reduce)
        # the seq is used and the contribution owed in one step (rule 4)
        self.next_seq, self._reserved = seq + 1, None
        self.owed.append(Message(Kind.CONTRIB, op, self.rank, root, seq, self.session, callsite, flags, fn,
                                 segments))
        return seq

    def bye(self) -> Optional[Message]:
        """BYE: this program is ending after ``next_seq`` calls (rule 7 of
        :mod:`zcollective._protocol._coordinator`); None when there is nobody to tell
        (the group failed or never started)."""
        if self.failure is not None or not self.joined:
            return None
        # (finish_data ran out) a plan came and its data is not moved, or this rank described data
        # of its own; a call whose plan did not come may need no data plane at all (a small
        # broadcast or allgather): the coordinator fails it if it goes peer to peer after all
        unsent = bool(self.transfers) or any(c.described and c.transfer is not None
                                             for c in self.calls.values())
        return Message(Kind.BYE, rank=self.rank, seq=self.next_seq, session=self.session,
                       flags=FLAG_DATA if unsent else 0)

    def final(self, teardown: bool, unsent: Optional[dict[int, list[Any]]] = None,
              leaving: Optional[dict[int, int]] = None) -> Optional[Message]:
        """FINAL: this rank sends no more point-to-point messages (``teardown``,
        or its program ends; ``unsent``, ``leaving``: see :meth:`Mail.final`);
        None when there is nobody to tell."""
        if self.failure is not None or not self.joined or self.mail is None or self.size == 1:
            return None
        sent, lost, received = self.mail.final(unsent, leaving)
        return _bodies.final(sent, teardown, received, lost, self.next_seq,
                             self.mail.open_to() if teardown else None, rank=self.rank, session=self.session)

    def give_up(self, seq: int, error: BaseException, timed_out: bool) -> list[Message]:
        """This rank gives up call ``seq`` (``error`` is why): tell the coordinator, so that the
        call fails alike on every rank (rule 4 of the coordinator); nothing once the group failed
        or the call completed."""
        if self.failure is not None or not self.joined or seq not in self.calls:
            return []  # (settled calls leave the table)
        why = (f"its call timed out ({error})" if timed_out else
               f"its call was interrupted ({type(error).__name__})")
        return [_bodies.abandon(why[:1000], timed_out, rank=self.rank, seq=seq, session=self.session)]

    def status_query(self, seq: int) -> Message:
        """A STATUS for ``seq``; the reply lands in :attr:`status`."""
        self.status.pop(seq, None)
        return Message(Kind.STATUS, rank=self.rank, seq=seq, session=self.session)

    # -- what arrives -------------------------------------------------------------

    def receive(self, frames: list[Any]) -> list[Message]:
        """Handle one message's frames from the coordinator; return the
        messages to send back. Never raises on bad input: a reply that fails
        authentication or speaks another version fails the group (rule 5),
        one that does not parse is dropped and logged."""
        try:
            msg = decode(frames, signer=self.signer, max_frame_bytes=self.max_frame_bytes)
            if msg.kind is Kind.RESULT and msg.session == self.session != 0 and msg.rank == self.rank:
                self.deliver(msg)  # bound here (rule 2): the common case of receive_message, inline
                return []
        except AuthError as exc:
            if not self.joined:
                why = "rank 0 has no secret" if exc.missing else "rank 0 has a different secret"
                return self.fail(AuthenticationError(
                    f"{self.who}: a reply of the coordinator at {self.endpoint} failed "
                    f"authentication ({exc}): {why}; set the same ZCOLLECTIVE_SECRET everywhere"))
            return self.fail(AuthenticationError(
                f"{self.who}: a message from the coordinator at {self.endpoint} failed "
                f"authentication ({exc}); was it altered in flight, or did rank 0's program change a "
                f"buffer it had passed to an _async call before the call completed? "
                f"{self.describe_in_flight()}"),
                tell=True)
        except VersionError as exc:
            return self.fail(ProtocolError(
                f"{self.who}: the coordinator at {self.endpoint} speaks protocol version "
                f"{exc.version}, this replica speaks {_wire.PROTOCOL_VERSION}: install the same "
                f"zcollective everywhere"))
        except WireError as exc:
            log.warning("zcollective rank %d: dropped a malformed message: %s", self.rank, exc)
            return []
        return self.receive_message(msg)

    def receive_message(self, msg: Message) -> list[Message]:
        """Handle one decoded message (an in-process link's); as :meth:`receive`."""
        try:
            if msg.kind is Kind.RESULT and msg.session == self.session != 0 and msg.rank == self.rank:
                self.deliver(msg)  # bound here (rule 2): what _act does with it, spelled out
                return []
            return self._act(msg)
        except WireError as exc:
            log.warning("zcollective rank %d: dropped a malformed %s message: %s", self.rank,
                        msg.kind.name, exc)
            return []

    def _act(self, msg: Message) -> list[Message]:
        joining = self.joining
        if not joining.bound(msg):
            return joining.misbound(msg)
        kind = msg.kind
        if kind is Kind.RESULT or kind is Kind.ERROR:
            self.deliver(msg)
        elif kind is Kind.STATUS_REPLY:
            self.status[msg.seq] = _bodies.parse_status(msg)
        elif kind is Kind.WELCOME:
            joining.welcome(msg)
        elif kind is Kind.REJECT and self.lineage is not None and not self.joined and (
                msg.body().get("error") == NOT_FORMING):  # its host is alive: it may form soon
            self.host_busy = True
        elif kind is Kind.FAIL and self.parent > 0 and self.tree.defer(msg):
            return []
        elif kind is Kind.REJECT or kind is Kind.FAIL:
            error, ended = _bodies.parse_error(msg)
            # a rank's program ended: calls whose data moves peer to peer need only their ring
            return [*self.fail(error, keep_data=ended), *self.moves.taken()]
        elif kind is Kind.BYE:
            self.farewell = True
            if msg.flags & FLAG_LAST:  # rank 0 ends: everything before this was read
                return [Message(Kind.BYE, rank=self.rank, seq=self.next_seq, session=self.session,
                                flags=FLAG_LAST)]
        elif kind is Kind.CHALLENGE and not self.joined:
            challenge = _bodies.challenge_of(msg)
            if challenge is not None:
                self.challenge = challenge[:64]
                return [self.join()]
        elif kind is Kind.TAKEN:
            self.moves.asked = max(msg.seq, self.moves.asked or 0)
        elif kind is Kind.FINAL and self.mail is not None and 0 <= msg.root < self.size:
            self.mail.ended(msg.root, msg.seq, _bodies.parse_ended(msg),  # (its own: ignored)
                            _bodies.ended_by_teardown(msg), *_bodies.ended_counts(msg),
                            _bodies.ended_posted(msg))
        elif kind is Kind.SYNC:  # every rank of this host reached a sync of a shared-memory call (rule 10)
            transfers = self.transfers
            if transfers and transfers[0][0] == msg.seq and getattr(transfers[0][1], "shared", False):
                transfers[0][1].synced(msg.root)
        return self.moves.taken() if self.moves.asked is not None else []

    def deliver(self, msg: Message) -> None:
        """Resolve the call ``msg`` answers (rule 3)."""
        # an ERROR's body is parsed first: a malformed one is dropped, its call still waits
        error = _bodies.parse_error(msg)[0] if msg.kind is Kind.ERROR else None
        if self.relay is not None and error is None and _tree.goes_down(msg.op, msg.flags) and self.mail:
            self.mail.out.extend((child, m, None) for child, m in self.relay.down(msg))
        call = self.calls.get(msg.seq)
        if call is None:
            return
        if msg.flags & FLAG_DATA and error is None:
            return self.moves.start(msg, call)
        if error is not None:  # its data move stops where it is
            self.moves.drop(msg.seq)
        if call.future is not None:
            received = 0
            for segment in msg.segments:
                for f in segment:
                    received += len(f) if type(f) is bytes else memoryview(f).nbytes
            waited = self.stopwatch() - call.started
            self.stats.record(call.op, call.sent, received, waited)
            if self.log_calls:
                self.log_call(msg.seq, call, received, "error" if error is not None else "done", waited)
            finish = call.finish
            self.outcomes.append(CallOutcome(call.future, error, None if error is not None or finish is None
                                             else partial(finish, msg)))
        del self.calls[msg.seq]
        if self.deferred is not None:
            self.tree.settled(call.op, error)

    def record(self, seq: int, call: Call, received: int, outcome: str) -> None:
        """Count a call answered (see :mod:`zcollective._protocol._stats`)."""
        waited = self.stopwatch() - call.started
        self.stats.record(call.op, call.sent, received, waited)
        if self.log_calls:
            self.log_call(seq, call, received, outcome, waited)

    def log_call(self, seq: int, call: Call, received: int, outcome: str, waited: float) -> None:
        calls_log.info("zcollective rank %d: seq %d %s at %s: %s, sent %d B, received %d B, "
                       "waited %.3f ms", self.rank, seq, call.op, call.callsite or "?",
                       outcome, call.sent, received, waited * 1000)

    # -- failure ---------------------------------------------------------------

    def coordinator_gone(self, why: str) -> None:
        """Rank 0's own member: the coordinator stopped serving."""
        self.fail(lost_rank_0(ReplicaLostError(f"{self.who}: the coordinator is gone: {why}; "
                                                f"{self.describe_in_flight()}")))

    def fail(self, error: Exception, tell: bool = False, keep_data: bool = False) -> list[Message]:
        """Fail the group here, for good (rule 5): every call in the table
        gets ``error``. ``tell``: this member found the failure itself (a
        message to it was altered or moved), so it asks the coordinator to
        fail the group for everyone (the ABORT returned). ``keep_data``: a
        call whose data is moving peer to peer (its plan came) goes on to
        its end, as it needs only the ring (a rank whose program ended has
        delivered its part: rule 7 of the coordinator)."""
        if self.failure is not None:
            return []
        self.failure = error
        self.failed_at = self.clock()
        self.owed.clear()  # nobody will pair them now
        kept = {seq for seq, _ in self.transfers} if keep_data else set()
        if not kept:
            self.transfers.clear()
        calls = self.calls
        self.calls = {seq: call for seq, call in calls.items() if seq in kept}
        self.outcomes.extend(CallOutcome(call.future, fresh(error)) for seq, call in calls.items()
                             if seq not in kept and call.future is not None)
        if self.mail is not None:
            self.mail.fail(error)
        if self.relay is not None:
            self.relay.forget()
        if tell and self.joined:
            return [_bodies.abort(error, rank=self.rank, session=self.session)]
        return []

    def forget_calls(self, error_for: Callable[[Call, int], BaseException]) -> None:
        """The group closes: every call still in the table gets an error."""
        calls, self.calls = self.calls, {}
        self.transfers.clear()
        self.outcomes.extend(CallOutcome(call.future, error_for(call, seq)) for seq, call in calls.items()
                             if call.future is not None)
        if self.mail is not None:
            self.mail.fail(RuntimeError("the group was closed before the point-to-point call finished"))

    # -- wording ---------------------------------------------------------------

    @property
    def who(self) -> str:
        """This replica, as its errors name it: a newcomer has no rank yet; a
        sub-group's member by its world rank too, and its group."""
        if self.newcomer:
            return "a newcomer"
        if self.world is None:
            return f"rank {self.rank}"
        return f"rank {self.rank}{in_world([self.rank], self.world)} of {group_name(self.world)}"

    def describe_in_flight(self) -> str:
        if not self.calls:
            return f"no call was in flight (next seq {self.next_seq})"
        calls = ", ".join(f"seq {s} {c.op}" for s, c in sorted(self.calls.items())[:3])
        return f"in flight: {calls}"


def timeout_message(member: Member, seq: int, timeout: Optional[float], status: Optional[dict[str, Any]],
                    busy: Optional[str] = None) -> str:
    """Why call ``seq`` of ``member`` timed out, from the coordinator's status reply
    (None: it did not answer) and, on rank 0, what its thread is stuck in (``busy``)."""
    call = member.calls.get(seq)
    base = f"seq {seq} {call.op if call else 'call'} timed out after {timeout:g} s on {member.who}"
    if status is None:
        if busy:
            return f"{base}: {busy}"
        return (f"{base}; the coordinator (rank 0) did not answer a status query within "
                f"{STATUS_WAIT_S:g} s (is a reduce function stuck?)")
    if status.get("missing"):
        missing = ",".join(map(str, status["missing"])) + checked_in_world(status["missing"], member.world)
        arrived = ",".join(map(str, status.get("arrived", []))) or "none"
        return f"{base}: waiting for ranks {missing} (arrived: {arrived})"
    job = member.moves.job(seq)
    if job is not None:
        how = "through its host's shared memory" if getattr(job, "shared", False) else "peer to peer"
        return (f"{base}: every rank arrived and its data moves {how}; "
                f"{job.progress()}" + ("" if member.transfers[0][1] is job else
                                       f" (after seq {member.transfers[0][0]}'s)"))
    if status.get("state") == "done":
        return (f"{base}: every rank arrived and the coordinator (rank 0) sent the result, "
                f"which had not arrived here yet")
    return f"{base}: every rank arrived; the coordinator (rank 0) is still computing it"
