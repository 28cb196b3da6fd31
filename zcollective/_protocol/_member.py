"""One replica's rules: a pure object fed messages and connection events,
returning the messages to send. Every replica, rank 0 included, has one
:class:`Member`; its driver (:mod:`zcollective._io._driver`) gives it what
arrives and sends what it returns and owes. It holds the one table of calls
in flight and says what each came to (:class:`CallOutcome`), for the call
runner to apply.

Rules 1-11 (cited by number in the code): see docs/protocol.md, *Member rules*.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .._format import _bodies, _wire
from .._format._bodies import NOT_FORMING, PYTHON_VERSION
from .._format._bodies import is_data_key as _is_key  # noqa: F401 (tests check it here)
from .._format._mac import HMAC_SHA256, POLY1305
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
    join_token,
)
from .._limits import DATA_LOSS_GRACE_S, JOIN_RESEND_S, MAX_STALL_WARNINGS, STATUS_WAIT_S, WIRE_PART_BYTES
from ..errors import AuthenticationError, ProtocolError, ReplicaLostError
from . import _tree
from ._ops import LABELS, SPOKEN, Combine, Op, group_name, in_world
from ._outcomes import CallOutcome, fresh
from ._p2p import Mail
from ._stats import CallStats, calls_log

log = logging.getLogger("zcollective")

FOREIGN_PEER_S = 5.0  # handshakes failing this long (and never succeeding) mean a foreign program
FOREIGN_PEER_TRIES = 3  # ... over at least this many connections


class ConnectionEvent(enum.Enum):
    """What a driver saw of its connection to the coordinator."""

    CONNECTED = "connected"  # a TCP connection was made (not yet a ZeroMQ handshake)
    HANDSHAKE_SUCCEEDED = "handshake succeeded"
    HANDSHAKE_FAILED = "handshake failed"  # closed during the handshake: maybe a proxy
    PROTOCOL_VIOLATION = "protocol violation"  # a handshake no ZeroMQ peer would send
    DISCONNECTED = "disconnected"  # closed, or heartbeats unanswered
    REFUSED = "refused"  # a connection attempt failed at once (nobody listens: its process died)


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


@dataclass(slots=True)
class JoinTimer:
    """A join under way (rule 8)."""

    started: float
    due: float  # when the JOIN is sent again
    warn_after: Optional[float]
    warned: int = 0  # the warnings said


class Member:
    """One replica's rules; see the module docstring."""

    def __init__(self, rank: int, size: int, endpoint: str, signer: Optional[Signer] = None,
                 max_frame_bytes: Optional[int] = None, clock: Callable[[], float] = time.monotonic,
                 entropy: Callable[[int], bytes] = os.urandom,
                 stopwatch: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # when it failed, its handshakes and timers (a test passes a fake one)
        self.stopwatch = stopwatch  # what a call took (its stats)
        self._entropy = entropy  # its JOINs' nonces
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
        self._asked: Optional[int] = None  # the seq of a TAKEN to answer once its data is in (rule 7)
        self._nonces: set[str] = set()  # every JOIN sent (a reconnect sends another)
        self._tokens: set[int] = set()  # their tokens: what binds replies before the WELCOME
        self._rejoin = False
        self.challenge: Optional[str] = None  # the coordinator's last CHALLENGE (with a secret)
        self._failed_handshakes: list[float] = []  # since the last good one
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
        self.mail_endpoints: Optional[list[str]] = None  # every rank's, from the WELCOME ...
        self.mail_key: Optional[str] = None  # ... and their tokens' key (hex)
        self.mail: Optional[Mail] = None  # its point-to-point rules, once welcomed
        self.parent = -1  # its parent in the tree of small calls (rule 11); -1: none (rank 0, no tree)
        self.relay: Optional[_tree.Relay] = None  # its rules there, if it has children
        self.asks: deque[Combine] = deque()  # reductions its relay asked for: the driver runs them
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
        self._join_timer: Optional[JoinTimer] = None  # while joining (rule 8)
        self._data_loss: Optional[tuple[Exception, float]] = None  # a data link lost, and until when
        # the control plane may say why (rule 9)

    # -- join ---------------------------------------------------------------

    def join(self, challenge: Optional[str] = None) -> Message:
        """A JOIN with a fresh nonce (rule 1), echoing the coordinator's last
        challenge (with a secret) unless given another."""
        challenge = challenge if challenge is not None else self.challenge
        nonce = self._entropy(16).hex()
        self._nonces.add(nonce)
        self._tokens.add(join_token(nonce))
        return _bodies.join(self.rank, self.size, PYTHON_VERSION, nonce, challenge, self.data_endpoint,
                            self.data_min_bytes, self.data_mode, self.lineage, self.newcomer, self.job,
                            SPOKEN, self.mail_endpoint, self.shm_offer, self.mail_window)

    @property
    def joined(self) -> bool:
        return self.session != 0

    # -- timers (rules 8 and 9) ----------------------------------------------------

    def start_join(self, warn_after: Optional[float] = None) -> list[Message]:
        """Begin joining (rule 8): a JOIN now, and again at each of its
        timer's deadlines. ``warn_after``: over a connection, say so when the
        join waits this long (None: never)."""
        now = self.clock()
        self._join_timer = JoinTimer(now, now + JOIN_RESEND_S, warn_after)
        return [self.join()]

    def stop_join(self) -> None:
        """The driver stopped waiting to join (done, or out of time)."""
        self._join_timer = None

    def next_deadline(self) -> Optional[float]:
        """When (its clock) :meth:`on_timer` next has something to do; None: no timer runs."""
        deadlines = []
        timer = self._joining()
        if timer is not None:
            deadlines.append(timer.due)
        if self._data_loss is not None:  # (once failed, at once: that FAIL said why)
            deadlines.append(self._data_loss[1] if self.failure is None else self.failed_at)
        return min(deadlines, default=None)

    def on_timer(self, now: float) -> list[Message]:
        """The timers due at ``now`` (rules 8 and 9); the messages to send."""
        out: list[Message] = []
        loss = self._data_loss
        if loss is not None and (self.failure is not None or now >= loss[1]):
            self._data_loss = None
            out += self._data_failure(loss[0])
        timer = self._joining()
        if timer is not None and now >= timer.due:
            self._join_stalled(timer, now)
            timer.due = now + JOIN_RESEND_S
            out.append(self.join())
        return out

    def _joining(self) -> Optional[JoinTimer]:
        """The join's timer, while it runs (until welcomed or admitted)."""
        return None if self.joined or self.admitted is not None else self._join_timer

    def _join_stalled(self, timer: JoinTimer, now: float) -> None:
        """Rule 11 of the coordinator, on a replica waiting to join: say so at
        ``warn_after`` (and 2, 4, 8 times it)."""
        after, warned = timer.warn_after, timer.warned
        waited = now - timer.started
        if after is None or warned >= MAX_STALL_WARNINGS or waited < after * (1 << warned):
            return
        if self.newcomer:  # (waiting for a grow() is what newcomers do, for minutes in a healthy job)
            return
        if self.greeted:
            what = "for the others to join (the coordinator answers: rank 0 warns whom it waits for)"
        else:
            what = ("for the coordinator (rank 0), which it cannot reach there (is rank 0 running, "
                    "and the address right?)")
        log.warning("zcollective %s has waited %.0f s at %s %s", self.who, waited, self.endpoint, what)
        timer.warned = warned + 1

    def data_lost(self, error: Exception) -> list[Message]:
        """The data plane failed here (rule 9); what to send now (more may
        come from :meth:`on_timer`, while :attr:`losing_data`)."""
        if getattr(error, "lost_rank", None) is not None and self.failure is None and self._data_loss is None:
            self._data_loss = (error, self.clock() + DATA_LOSS_GRACE_S)
            return []
        return self._data_failure(error)

    @property
    def losing_data(self) -> bool:
        """A data link was lost and the member waits for the coordinator to say why."""
        return self._data_loss is not None

    def _data_failure(self, error: Exception) -> list[Message]:
        lost, seq = getattr(error, "lost_rank", None), getattr(error, "seq", None)
        if self.failure is not None:  # a call kept by the failure (see fail) broke
            if self.transfers:
                self.data_failed(self.transfers[0][0], error)
            return []
        if seq is not None:  # only this call failed (the reduce function raised here)
            self.data_failed(seq, error)
        else:
            self.fail(error)
        if not self.joined:
            return []
        return [_bodies.abort(error, True, lost, rank=self.rank, session=self.session,
                              seq=seq or 0, op=Op.ALLREDUCE)]  # (only an allreduce has a seq here)

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
            self._owe(seq, op, root, callsite, FLAG_LOCAL_ERROR, None, error_note(reason), Call(op.label))

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
        self._owe(seq, op, root, callsite, flags, fn, segments,
                  Call(LABELS[op], future, finish, self.stopwatch(), sent, callsite, transfer,
                       bool(flags & FLAG_DATA), reduce))
        return seq

    def _owe(self, seq: int, op: Op, root: int, callsite: str, flags: int, fn: Any,
             segments: list[list[Any]], call: Call) -> None:
        msg = Message(Kind.CONTRIB, op, self.rank, root, seq, self.session, callsite, flags, fn, segments)
        self.calls[seq] = call
        # the seq is used and the contribution owed in one step (rule 4)
        self.next_seq, self._reserved = seq + 1, None
        self.owed.append(msg)

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
        return _bodies.final(sent, teardown, received, lost, self.next_seq, rank=self.rank,
                             session=self.session)

    def give_up(self, seq: int, error: BaseException, timed_out: bool) -> list[Message]:
        """This rank gives up call ``seq`` (``error`` is why): tell the coordinator, so that the
        call fails alike on every rank (rule 4 of the coordinator); nothing once the group failed
        or the call completed."""
        if self.failure is not None or not self.joined or seq not in self.calls:
            return []  # (settled calls leave the table)
        why = (f"its call timed out ({error})" if timed_out else
               f"its call was interrupted ({type(error).__name__})")
        return [_bodies.abandon(why[:1000], timed_out, rank=self.rank, seq=seq, session=self.session)]

    def moving(self, seq: int) -> bool:
        """Does call ``seq``'s data move here (its plan came, the move is not
        done)? A call failed while it moves keeps its result on the ranks
        that had finished: an interrupt lets it finish first."""
        return any(s == seq for s, _ in self.transfers)

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
                self._deliver(msg)  # bound here (rule 2): what _act does with it, spelled out
                return []
            return self._act(msg)
        except WireError as exc:
            log.warning("zcollective rank %d: dropped a malformed %s message: %s", self.rank,
                        msg.kind.name, exc)
            return []

    def _act(self, msg: Message) -> list[Message]:
        if not self._bound_here(msg):
            return self._misbound(msg)
        kind = msg.kind
        if kind is Kind.RESULT or kind is Kind.ERROR:
            self._deliver(msg)
        elif kind is Kind.STATUS_REPLY:
            self.status[msg.seq] = _bodies.parse_status(msg)
        elif kind is Kind.WELCOME:
            welcome = _bodies.parse_welcome(msg, self.old_size or self.size)
            if welcome["nonce"] in self._nonces and not self.joined:  # answers a JOIN of ours (again,
                # after a reconnect: the first one counts)
                if self.newcomer:  # rule 10 of the coordinator: admitted to the group formed next
                    self.admitted = welcome["admitted"]
                    return []
                renumber = welcome["renumber"]
                if renumber is not None and self.lineage is not None:  # rule 9 of the coordinator
                    self.old_ranks, self.old_size = renumber["old"], self.size
                    self.rank, self.size = renumber["rank"], len(self.old_ranks)
                self.addresses = welcome["addresses"]
                self._data_plan(welcome)
                shared = welcome["shm"]
                if self.shm_offer and shared and shared["hosts"][self.rank] is not None:
                    self.shared = shared  # (its host's ranks share memory)
                self.session = msg.session
                if (self.mail_endpoint is not None and welcome["mail"] is not None) or self.size == 1:
                    self.mail_endpoints, self.mail_key = welcome["mail"], welcome["mail_key"]
                    self.mail = Mail(self.rank, self.size, self.mail_window, self.session, self.outcomes,
                                     welcome["mail_windows"])
                    fanout = welcome["tree"]
                    if fanout is not None and self.mail_endpoints is not None:
                        self._plant(fanout)
        elif kind is Kind.REJECT and self.lineage is not None and not self.joined and (
                msg.body().get("error") == NOT_FORMING):  # its host is alive: it may form soon
            self.host_busy = True
        elif kind is Kind.FAIL and self.parent > 0 and self._defer(msg):
            return []
        elif kind is Kind.REJECT or kind is Kind.FAIL:
            error, ended = _bodies.parse_error(msg)
            # a rank's program ended: calls whose data moves peer to peer need only their ring
            return [*self.fail(error, keep_data=ended), *self._taken()]
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
            self._asked = max(msg.seq, self._asked or 0)
        elif kind is Kind.FINAL and self.mail is not None and 0 <= msg.root < self.size:
            self.mail.ended(msg.root, msg.seq, _bodies.parse_ended(msg),  # (its own: ignored)
                            _bodies.ended_by_teardown(msg), *_bodies.ended_counts(msg))
        elif kind is Kind.SYNC:  # every rank of this host reached a sync of a shared-memory call (rule 10)
            transfers = self.transfers
            if transfers and transfers[0][0] == msg.seq and getattr(transfers[0][1], "shared", False):
                transfers[0][1].synced(msg.root)
        return self._taken() if self._asked is not None else []

    # -- the tree of small calls (rule 11) --------------------------------------------

    def _plant(self, fanout: int) -> None:
        """The WELCOME says small calls climb a tree: this rank's place in it (rank 0's
        is the coordinator's: its own part goes to it as ever)."""
        tree = _tree.shape(self.size, fanout)
        if self.rank == 0:
            return
        self.parent = tree.parent[self.rank]
        if tree.children[self.rank]:
            self.relay = _tree.Relay(self.rank, self.size, fanout, self.user_code, self.clock)
        assert self.mail is not None
        self.mail.tree = self.climbed

    def climb(self, msg: Message) -> list[tuple[int, Message]]:
        """This rank's own contribution ``msg``, on its way up: (rank, message) to send;
        rank 0: the coordinator, on the link to it."""
        relay = self.relay
        if relay is None:
            return [(self.parent, msg if self.parent == 0 else _tree.up(msg))]
        call = self.calls.get(msg.seq)
        out = relay.own(msg, call.reduce if call is not None else None)
        self.asks.extend(m for m in out if type(m) is Combine)
        return [(self.parent, m) for m in out if isinstance(m, Message)]

    def climbed(self, msg: Message) -> None:
        """A message of the tree that came to the mailbox: a child's UP, or a RESULT
        from the parent; what it makes this rank send joins the mailbox's (or
        :attr:`owed`, to rank 0)."""
        if self.failure is not None:
            return
        relay = self.relay
        if msg.kind is Kind.UP and relay is not None:
            self.send_up(relay.take(msg))
        elif msg.kind is Kind.RESULT and msg.rank == self.rank and _tree.goes_down(msg.op, msg.flags):
            self._deliver(msg)

    def tree_timer(self, now: float) -> None:
        """Parts held past :data:`~._tree.RELAY_FLUSH_S` go up as they came; a held FAIL
        whose results did not come in time fails the group here."""
        if self.relay is not None and self.failure is None:
            self.send_up(self.relay.on_timer(now))
        if self.deferred is not None and now >= self.deferred[3]:
            self.undefer()

    def tree_due(self) -> Optional[float]:
        """When :meth:`tree_timer` has something to do, if ever."""
        due = self.relay.next_due() if self.relay is not None else None
        held = self.deferred[3] if self.deferred is not None else None
        return due if held is None else held if due is None else min(due, held)

    def _defer(self, msg: Message) -> bool:
        """A FAIL behind which the results of calls it says completed may still come
        down the tree: held until they came (True), so the group fails after them here too."""
        complete = _bodies.complete_of(msg)
        if not self.awaits_tree(complete):
            return False
        error, ended = _bodies.parse_error(msg)
        self.deferred = (error, ended, complete, self.clock() + _tree.TREE_GRACE_S)
        return True

    def awaits_tree(self, below: Optional[int] = None) -> bool:
        """Does a call of this rank's (before seq ``below``) wait for a result that comes down the
        tree (not a data plan's: that one came straight, and its data moves)?"""
        moving = {seq for seq, _ in self.transfers}
        return any((below is None or seq < below) and call.op in _tree.DOWN_LABELS and not call.described
                   and seq not in moving for seq, call in self.calls.items())

    def _awaited(self) -> bool:
        """Does a held FAIL still wait for a result?"""
        return self.deferred is not None and self.awaits_tree(self.deferred[2])

    def undefer(self) -> None:
        """The held FAIL takes effect now."""
        if self.deferred is not None:
            (error, ended, _, _), self.deferred = self.deferred, None
            self.owed.extend([*self.fail(error, keep_data=ended), *self._taken()])

    def send_up(self, msgs: list[Any]) -> None:
        """What this interior rank sends its parent; a reduction asked for waits for the driver."""
        if any(type(m) is Combine for m in msgs):
            self.asks.extend(m for m in msgs if type(m) is Combine)
            msgs = [m for m in msgs if type(m) is not Combine]
        if self.parent == 0:
            self.owed.extend(msgs)
        elif self.mail is not None:
            self.mail.out.extend((self.parent, m, None) for m in msgs)

    def _taken(self) -> list[Message]:
        """The answer to a TAKEN once no data job through its seq is left
        here (rule 7); none until then."""
        asked = self._asked
        if asked is None or any(seq <= asked for seq, _ in self.transfers):
            return []
        self._asked = None
        return [Message(Kind.TAKEN, rank=self.rank, seq=asked, session=self.session)]

    def _bound_here(self, msg: Message) -> bool:
        """Rule 2: is ``msg`` bound to this rank and session (or, before the
        WELCOME, to one of its JOINs)?"""
        if msg.kind is Kind.WELCOME:  # bound by the nonce in its body, checked by _act; once
            # renumbered, a WELCOME repeated for a JOIN repeated under the old rank is bound to that
            old = self.old_ranks
            return msg.rank == self.rank or (old is not None and msg.rank == old[self.rank])
        if msg.rank != self.rank:
            return False
        if msg.session == self.session if self.joined else msg.session in self._tokens:
            return True
        # a late answer to a JOIN sent twice (a reconnect): ignored once joined
        return msg.kind is Kind.CHALLENGE and msg.session in self._tokens

    def _misbound(self, msg: Message) -> list[Message]:
        what = (f"a {msg.kind.name} message from the coordinator at {self.endpoint} was bound to "
                f"rank {msg.rank}, session {msg.session:#x}, not to this replica")
        if self.signer is not None:
            return self.fail(AuthenticationError(f"{self.who}: {what}: was it moved between "
                                                 f"ranks or replayed? {self.describe_in_flight()}"),
                             tell=True)
        if msg.kind is not Kind.RESULT:  # a RESULT of an earlier group on this port is routine
            log.warning("zcollective rank %d: dropped %s", self.rank, what)
        return []

    def _data_plan(self, welcome: dict[str, Any]) -> None:
        """Use the framing, MAC and data ports the WELCOME gives."""
        self.part_bytes, self.mac = welcome["parts"] or self.part_bytes, welcome["mac"] or self.mac
        if self.signer is not None and welcome["mac"] == POLY1305:
            self.signer.fast = True  # every rank can verify the fast tag
        if self.data_endpoint is not None and welcome["data"] is not None:
            self.data_endpoints, self.data_min_bytes = welcome["data"], welcome["data_min"]
            self.data_key = welcome["data_key"]

    def _deliver(self, msg: Message) -> None:
        """Resolve the call ``msg`` answers (rule 3)."""
        # an ERROR's body is parsed first: a malformed one is dropped, its call still waits
        error = _bodies.parse_error(msg)[0] if msg.kind is Kind.ERROR else None
        if self.relay is not None and error is None and _tree.goes_down(msg.op, msg.flags) and self.mail:
            self.mail.out.extend((child, m, None) for child, m in self.relay.down(msg))
        call = self.calls.get(msg.seq)
        if call is None:
            return
        if msg.flags & FLAG_DATA and error is None:
            return self._start_data(msg, call)
        if error is not None and self.transfers:  # its data move stops where it is
            self.transfers = deque((s, j) for s, j in self.transfers if s != msg.seq)
        if call.future is not None:
            self._record(msg.seq, call, _received(msg), "error" if error is not None else "done")
            finish = call.finish
            self.outcomes.append(CallOutcome(call.future, error, None if error is not None or finish is None
                                         else lambda: finish(msg)))
        self.calls.pop(msg.seq, None)
        if self.deferred is not None and call.op == "teardown" and error is None:
            self.deferred = None  # the group closed as every rank agreed: what was held is moot
        elif self.deferred is not None and not self._awaited():
            self.undefer()

    def _start_data(self, msg: Message, call: Call) -> None:
        """The coordinator matched a call whose data travels peer to peer: its
        job joins the queue the driver moves (the call stays in the table
        until the job is done). Handled twice, it is queued once."""
        if call.transfer is None or any(seq == msg.seq for seq, _ in self.transfers):
            return
        try:
            job = call.transfer(msg)
        except (WireError, ValueError, KeyError, TypeError) as exc:
            self.fail(ProtocolError(f"seq {msg.seq} {call.op}: rank {self.rank} got a data plan "
                                    f"it cannot follow from the coordinator: {exc}"), tell=True)
            return
        self.transfers.append((msg.seq, job))

    def data_failed(self, seq: int, error: Exception) -> None:
        """Call ``seq``'s data move failed here (not the group): its job
        stops, its future gets ``error``; the others hear it from rank 0."""
        self.transfers = deque((s, j) for s, j in self.transfers if s != seq)
        self.owed.extend(self._taken())
        call = self.calls.pop(seq, None)
        if call is not None and call.future is not None:
            self.outcomes.append(CallOutcome(call.future, error))

    def data_done(self) -> None:
        """The first queued job moved all its data: its call's value is ready
        (the job's ``finish``, made by the runner)."""
        seq, job = self.transfers.popleft()
        call = self.calls.pop(seq, None)
        if call is not None and call.future is not None:
            self._record(seq, call, job.received_bytes, "done")
            self.outcomes.append(CallOutcome(call.future, make=job.finish))
        self.owed.extend(self._taken())

    def _record(self, seq: int, call: Call, received: int, outcome: str) -> None:
        """Count a call answered (see :mod:`zcollective._protocol._stats`)."""
        waited = self.stopwatch() - call.started
        self.stats.record(call.op, call.sent, received, waited)
        if self.log_calls:
            calls_log.info("zcollective rank %d: seq %d %s at %s: %s, sent %d B, received %d B, "
                           "waited %.3f ms", self.rank, seq, call.op, call.callsite or "?",
                           outcome, call.sent, received, waited * 1000)

    def connection(self, event: ConnectionEvent, now: Optional[float] = None) -> list[Message]:
        """Handle what the driver saw of its connection; return what to send."""
        if event is ConnectionEvent.CONNECTED:
            self.connected = True
        elif event is ConnectionEvent.REFUSED:  # (a connection the kernel took for a process being killed is
            self.refused = not self.shook  # no sign of life; a handshake is)
        elif event is ConnectionEvent.DISCONNECTED:
            self.greeted = False
            if not self.joined:
                self._rejoin = True  # the JOIN may have gone down with that connection
                return []
            self.coordinator_lost = True
            if self.deferred is not None:  # rank 0 said it ended: what it completed still comes down
                return []
            lost = lost_rank_0(ReplicaLostError(
                f"{self.who} lost the coordinator (rank 0{in_world([0], self.world, ', ', '')}) at "
                f"{self.endpoint}: connection closed or heartbeats unanswered; {self.describe_in_flight()}"))
            if self.parent > 0 and self.awaits_tree():  # (rank 0 may have closed after a teardown
                self.deferred = (lost, False, None, self.clock() + _tree.TREE_GRACE_S)  # whose result
                return []  # still comes down: held, as a FAIL is)
            return self.fail(lost)
        elif event is ConnectionEvent.HANDSHAKE_SUCCEEDED:
            self.greeted = self.shook = True
            self.refused = False
            self._failed_handshakes.clear()
            if self._rejoin and not self.joined:
                self._rejoin = False
                return [self.join()]
        else:
            return self._failed_handshake(event is ConnectionEvent.PROTOCOL_VIOLATION,
                                          self.clock() if now is None else now)
        return []

    def _failed_handshake(self, protocol_violation: bool, now: float) -> list[Message]:
        if self.joined:
            return []
        failures = self._failed_handshakes
        failures.append(now)
        if protocol_violation or (len(failures) >= FOREIGN_PEER_TRIES
                                  and failures[-1] - failures[0] >= FOREIGN_PEER_S):
            if self.signer is not None and not protocol_violation:
                # a coordinator without a secret closes a PLAIN handshake; this end sees the
                # mismatch only when it reads the greeting before the close (a race)
                return self.fail(AuthenticationError(
                    f"{self.who}: the coordinator at {self.endpoint} closed {len(failures)} "
                    f"ZeroMQ handshakes with this replica, which offers credentials: rank 0 has no "
                    f"secret (or the program there is not a zcollective coordinator); set the same "
                    f"ZCOLLECTIVE_SECRET everywhere"))
            if not protocol_violation:  # closed: a coordinator that requires a secret closes too
                return self.fail(ProtocolError(
                    f"{self.who}: the program listening at {self.endpoint} is not a zcollective "
                    f"coordinator, or is one that requires a secret ({len(failures)} ZeroMQ "
                    f"handshakes failed); set the job's ZCOLLECTIVE_SECRET if it has one, else is the "
                    f"master port used by another program?"))
            return self.fail(ProtocolError(
                f"{self.who}: the program listening at {self.endpoint} is not a zcollective "
                f"coordinator ({len(failures)} ZeroMQ handshakes failed); is the master port "
                f"used by another program?"))
        return []

    @property
    def who(self) -> str:
        """This replica, as its errors name it: a newcomer has no rank yet; a
        sub-group's member by its world rank too, and its group."""
        if self.newcomer:
            return "a newcomer"
        if self.world is None:
            return f"rank {self.rank}"
        return f"rank {self.rank}{in_world([self.rank], self.world)} of {group_name(self.world)}"

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

    def describe_in_flight(self) -> str:
        if not self.calls:
            return f"no call was in flight (next seq {self.next_seq})"
        calls = ", ".join(f"seq {s} {c.op}" for s, c in sorted(self.calls.items())[:3])
        return f"in flight: {calls}"

    def timeout_message(self, seq: int, timeout: Optional[float], status: Optional[dict[str, Any]],
                        busy: Optional[str] = None) -> str:
        """Why call ``seq`` timed out, from the coordinator's status reply
        (None: it did not answer) and, on rank 0, what its thread is stuck in."""
        call = self.calls.get(seq)
        base = f"seq {seq} {call.op if call else 'call'} timed out after {timeout:g} s on {self.who}"
        if status is None:
            if busy:
                return f"{base}: {busy}"
            return (f"{base}; the coordinator (rank 0) did not answer a status query within "
                    f"{STATUS_WAIT_S:g} s (is a reduce function stuck?)")
        if status.get("missing"):
            missing = ",".join(map(str, status["missing"])) + self._in_world(status["missing"])
            arrived = ",".join(map(str, status.get("arrived", []))) or "none"
            return f"{base}: waiting for ranks {missing} (arrived: {arrived})"
        job = next((j for s, j in self.transfers if s == seq), None)
        if job is not None:
            how = "through its host's shared memory" if getattr(job, "shared", False) else "peer to peer"
            return (f"{base}: every rank arrived and its data moves {how}; "
                    f"{job.progress()}" + ("" if self.transfers[0][1] is job else
                                           f" (after seq {self.transfers[0][0]}'s)"))
        if status.get("state") == "done":
            return (f"{base}: every rank arrived and the coordinator (rank 0) sent the result, "
                    f"which had not arrived here yet")
        return f"{base}: every rank arrived; the coordinator (rank 0) is still computing it"

    def _in_world(self, ranks: Any) -> str:
        """`` (world ranks 1,2)`` for a sub-group's ``ranks`` (a status reply's: checked), else ""."""
        if self.world is None or not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
            return ""
        return in_world(ranks, self.world)

    def join_timeout_message(self, timeout: Optional[float], status: Optional[dict[str, Any]]) -> str:
        base = f"{self.who} timed out after {timeout:g} s joining the group at {self.endpoint}"
        if not self.connected:
            return (f"{base}: could not reach the coordinator (rank 0) at that address "
                    f"(is rank 0 running, with the same num_replicas (a rank 0 told none, or 1, "
                    f"runs alone and listens on nothing), and is the address and port right?)")
        if status and status.get("missing"):
            missing = ",".join(map(str, status["missing"]))
            refused = status.get("refused")
            why = ""
            if isinstance(refused, dict) and refused:
                why = " (" + "; ".join(f"rank {r} was refused: {str(m)[:300]}"
                                       for r, m in list(refused.items())[:3]) + ")"
            handshakes = status.get("handshakes")
            if isinstance(handshakes, list) and handshakes:
                why += " (refused at the ZeroMQ handshake: " + "; ".join(
                    str(h)[:300] for h in handshakes[:3]) + ")"
            missing += self._in_world(status["missing"])
            return f"{base}: connected, but ranks {missing} had not joined{why}"
        return f"{base}: connected, but the group did not complete"


def _received(msg: Message) -> int:
    """Bytes of a reply's values."""
    received = 0
    for segment in msg.segments:
        for f in segment:
            received += len(f) if type(f) is bytes else memoryview(f).nbytes
    return received


def lost_rank_0(error: Exception) -> Exception:
    """``error`` says the connection to rank 0 (the coordinator) was lost: a lead
    for a shrink, not proof (rank 0 also closes it to shrink; a FAIL's
    ``lost_ranks`` are the coordinator's word)."""
    error.lost_inferred = (0,)  # type: ignore[attr-defined]
    return error
