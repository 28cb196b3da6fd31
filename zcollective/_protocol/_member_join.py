"""One replica's joining: its JOINs and their timer (rules 1 and 8), what it saw of its connection to the
coordinator, the WELCOME, and which replies are bound to it (rule 2). A part of :class:`~._member.Member`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .._format import _bodies
from .._format._bodies import PYTHON_VERSION
from .._format._mac import POLY1305
from .._format._wire import Kind, Message, join_token
from .._limits import JOIN_RESEND_S, MAX_STALL_WARNINGS
from ..errors import AuthenticationError, ProtocolError, ReplicaLostError
from . import _tree
from ._ops import SPOKEN, in_world
from ._p2p import Mail

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
class JoinTimer:
    """A join under way (rule 8)."""

    started: float
    due: float  # when the JOIN is sent again
    warn_after: Optional[float]
    warned: int = 0  # the warnings said


class Joining:
    """A member's joining (see the module docstring)."""

    def __init__(self, member: Any, entropy: Callable[[int], bytes]) -> None:
        self.member = member  # its Member (a part reads and sets the member's state; typed Any: no circle)
        self.entropy = entropy  # its JOINs' nonces
        self.nonces: set[str] = set()  # every JOIN sent (a reconnect sends another)
        self.tokens: set[int] = set()  # their tokens: what binds replies before the WELCOME
        self.rejoin = False
        self.token = 0  # the last JOIN's
        self.withdrawn = False  # it took its JOIN back (rule 9 of the coordinator): no JOIN goes again
        self.failed_handshakes: list[float] = []  # since the last good one
        self.timer: Optional[JoinTimer] = None  # while joining (rule 8)

    def join(self, challenge: Optional[str] = None) -> Message:
        """A JOIN with a fresh nonce (rule 1), echoing the coordinator's last challenge unless given one."""
        m = self.member
        challenge = challenge if challenge is not None else m.challenge
        nonce = self.entropy(16).hex()
        self.nonces.add(nonce)
        self.token = join_token(nonce)
        self.tokens.add(self.token)
        return _bodies.join(m.rank, m.size, PYTHON_VERSION, nonce, challenge, m.data_endpoint,
                            m.data_min_bytes, m.data_mode, m.lineage, m.newcomer, m.job,
                            SPOKEN, m.mail_endpoint, m.shm_offer, m.mail_window, m.local_name)

    def start(self, warn_after: Optional[float] = None) -> list[Message]:
        """Begin joining (rule 8): a JOIN now and at each timer deadline; warn at ``warn_after``."""
        now = self.member.clock()
        self.timer = JoinTimer(now, now + JOIN_RESEND_S, warn_after)
        return [self.join()]

    def stop(self) -> None:
        """The driver stopped waiting to join (done, or out of time)."""
        self.timer = None

    def withdraw(self) -> Message:
        """A BYE taking back this member's JOIN before its WELCOME (interrupted, or out of time: rule 9 of
        the coordinator): the host answers it with a BYE, unless it formed the group with this member first
        (its WELCOME then comes before). No JOIN goes after it."""
        self.timer, self.rejoin, self.withdrawn = None, False, True
        return Message(Kind.BYE, rank=self.member.rank, session=self.token)

    def running(self) -> Optional[JoinTimer]:
        """The join's timer, while it runs (until welcomed or admitted)."""
        m = self.member
        return None if m.joined or m.admitted is not None else self.timer

    def on_timer(self, now: float) -> list[Message]:
        timer = self.running()
        if timer is None or now < timer.due:
            return []
        self._stalled(timer, now)
        timer.due = now + JOIN_RESEND_S
        return [self.join()]

    def _stalled(self, timer: JoinTimer, now: float) -> None:
        """Rule 11 of the coordinator, while joining: say so at ``warn_after`` (and 2, 4, 8 times it)."""
        m = self.member
        after, warned = timer.warn_after, timer.warned
        waited = now - timer.started
        if after is None or warned >= MAX_STALL_WARNINGS or waited < after * (1 << warned):
            return
        if m.newcomer:  # (waiting for a grow() is what newcomers do, for minutes in a healthy job)
            return
        if m.greeted:
            what = "for the others to join (the coordinator answers: rank 0 warns whom it waits for)"
        else:
            what = ("for the coordinator (rank 0), which it cannot reach there (is rank 0 running, "
                    "and the address right?)")
        log.warning("zcollective %s has waited %.0f s at %s %s", m.who, waited, m.endpoint, what)
        timer.warned = warned + 1

    def connection(self, event: ConnectionEvent, now: Optional[float] = None) -> list[Message]:
        """Handle what the driver saw of its connection; return what to send."""
        m = self.member
        if event is ConnectionEvent.CONNECTED:
            m.connected = True
        elif event is ConnectionEvent.REFUSED:  # (a connection the kernel took for a process being killed is
            m.refused = not m.shook  # no sign of life; a handshake is)
        elif event is ConnectionEvent.DISCONNECTED:
            m.greeted = False
            if not m.joined:
                self.rejoin = True  # the JOIN may have gone down with that connection
                return []
            m.coordinator_lost = True
            if m.deferred is not None:  # rank 0 said it ended: what it completed still comes down
                return []
            lost = lost_rank_0(ReplicaLostError(
                f"{m.who} lost the coordinator (rank 0{in_world([0], m.world, ', ', '')}) at "
                f"{m.endpoint}: connection closed or heartbeats unanswered; {m.describe_in_flight()}"))
            if m.parent > 0 and m.tree.awaits():  # (rank 0 may have closed after a teardown
                m.deferred = (lost, False, None, m.clock() + _tree.TREE_GRACE_S)  # whose result
                return []  # still comes down: held, as a FAIL is)
            return m.fail(lost)
        elif event is ConnectionEvent.HANDSHAKE_SUCCEEDED:
            m.greeted = m.shook = True
            m.refused = False
            self.failed_handshakes.clear()
            if self.rejoin and not m.joined and not self.withdrawn:
                self.rejoin = False
                return [self.join()]
        else:
            return self._failed_handshake(event is ConnectionEvent.PROTOCOL_VIOLATION,
                                          m.clock() if now is None else now)
        return []

    def _failed_handshake(self, protocol_violation: bool, now: float) -> list[Message]:
        m = self.member
        if m.joined:
            return []
        failures = self.failed_handshakes
        failures.append(now)
        if protocol_violation or (len(failures) >= FOREIGN_PEER_TRIES
                                  and failures[-1] - failures[0] >= FOREIGN_PEER_S):
            if m.signer is not None and not protocol_violation:
                # a coordinator without a secret closes a PLAIN handshake (seen here only by a race)
                return m.fail(AuthenticationError(
                    f"{m.who}: the coordinator at {m.endpoint} closed {len(failures)} "
                    f"ZeroMQ handshakes with this replica, which offers credentials: rank 0 has no "
                    f"secret (or the program there is not a zcollective coordinator); set the same "
                    f"ZCOLLECTIVE_SECRET everywhere"))
            if not protocol_violation:  # closed: a coordinator that requires a secret closes too
                return m.fail(ProtocolError(
                    f"{m.who}: the program listening at {m.endpoint} is not a zcollective "
                    f"coordinator, or is one that requires a secret ({len(failures)} ZeroMQ "
                    f"handshakes failed); set the job's ZCOLLECTIVE_SECRET if it has one, else is the "
                    f"master port used by another program?"))
            return m.fail(ProtocolError(
                f"{m.who}: the program listening at {m.endpoint} is not a zcollective "
                f"coordinator ({len(failures)} ZeroMQ handshakes failed); is the master port "
                f"used by another program?"))
        return []

    def welcome(self, msg: Message) -> None:
        """A WELCOME answering a JOIN of ours (the first one counts): this member's place in the group."""
        m = self.member
        welcome = _bodies.parse_welcome(msg, m.old_size or m.size)
        if welcome["nonce"] not in self.nonces or m.joined:
            return
        if m.newcomer:  # rule 10 of the coordinator: admitted to the group formed next
            m.admitted = welcome["admitted"]
            return
        renumber = welcome["renumber"]
        if renumber is not None and m.lineage is not None:  # rule 9 of the coordinator
            m.old_ranks, m.old_size = renumber["old"], m.size
            m.rank, m.size = renumber["rank"], len(m.old_ranks)
        m.addresses = welcome["addresses"]
        self._data_plan(welcome)
        shared = welcome["shm"]
        if m.shm_offer and shared and shared["hosts"][m.rank] is not None:
            m.shared = shared  # (its host's ranks share memory)
        m.session = msg.session
        if (m.mail_endpoint is not None and welcome["mail"] is not None) or m.size == 1:
            m.mail_endpoints, m.mail_key = welcome["mail"], welcome["mail_key"]
            m.local_names = welcome["local"]
            m.mail = Mail(m.rank, m.size, m.mail_window, m.session, m.outcomes, welcome["mail_windows"])
            fanout = welcome["tree"]
            if fanout is not None and m.mail_endpoints is not None:
                m.tree.plant(fanout)

    def _data_plan(self, welcome: dict[str, Any]) -> None:
        """Use the framing, MAC and data ports the WELCOME gives."""
        m = self.member
        m.part_bytes, m.mac = welcome["parts"] or m.part_bytes, welcome["mac"] or m.mac
        if m.signer is not None and welcome["mac"] == POLY1305:
            m.signer.fast = True  # every rank can verify the fast tag
        if m.data_endpoint is not None and welcome["data"] is not None:
            m.data_endpoints, m.data_min_bytes = welcome["data"], welcome["data_min"]
            m.data_key = welcome["data_key"]

    def bound(self, msg: Message) -> bool:
        """Rule 2: is ``msg`` bound to this rank and session (or, before the WELCOME, to a JOIN)?"""
        m = self.member
        if msg.kind is Kind.WELCOME:  # bound by the nonce in its body, checked by welcome; once
            # renumbered, a WELCOME repeated for a JOIN repeated under the old rank is bound to that
            old = m.old_ranks
            return msg.rank == m.rank or (old is not None and msg.rank == old[m.rank])
        if msg.rank != m.rank:
            return False
        if msg.session == m.session if m.joined else msg.session in self.tokens:
            return True
        # a late answer to a JOIN sent twice (a reconnect): ignored once joined
        return msg.kind is Kind.CHALLENGE and msg.session in self.tokens

    def misbound(self, msg: Message) -> list[Message]:
        m = self.member
        what = (f"a {msg.kind.name} message from the coordinator at {m.endpoint} was bound to "
                f"rank {msg.rank}, session {msg.session:#x}, not to this replica")
        if m.signer is not None:
            return m.fail(AuthenticationError(f"{m.who}: {what}: was it moved between "
                                              f"ranks or replayed? {m.describe_in_flight()}"), tell=True)
        if msg.kind is not Kind.RESULT:  # a RESULT of an earlier group on this port is routine
            log.warning("zcollective rank %d: dropped %s", m.rank, what)
        return []

    def timeout_message(self, timeout: Optional[float], status: Optional[dict[str, Any]]) -> str:
        """Why joining timed out, from the coordinator's status reply (None: none came)."""
        m = self.member
        base = f"{m.who} timed out after {timeout:g} s joining the group at {m.endpoint}"
        if not m.connected:
            return (f"{base}: could not reach the coordinator (rank 0) at that address "
                    f"(is rank 0 running, with the same num_replicas (a rank 0 told none, or 1, "
                    f"runs alone and listens on nothing), and is the address and port right?)")
        if status and status.get("missing"):
            missing = ",".join(map(str, status["missing"]))
            refused = status.get("refused")
            why = ""
            if isinstance(refused, dict) and refused:
                why = " (" + "; ".join(f"rank {r} was refused: {str(w)[:300]}"
                                       for r, w in list(refused.items())[:3]) + ")"
            handshakes = status.get("handshakes")
            if isinstance(handshakes, list) and handshakes:
                why += " (refused at the ZeroMQ handshake: " + "; ".join(
                    str(h)[:300] for h in handshakes[:3]) + ")"
            missing += checked_in_world(status["missing"], m.world)
            return f"{base}: connected, but ranks {missing} had not joined{why}"
        return f"{base}: connected, but the group did not complete"


def checked_in_world(ranks: Any, world: Optional[list[int]]) -> str:
    """`` (world ranks 1,2)`` for a sub-group's ``ranks`` (a status reply's: checked), else ""."""
    if world is None or not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
        return ""
    return in_world(ranks, world)


def lost_rank_0(error: Exception) -> Exception:
    """``error`` says the connection to rank 0 was lost: a lead for a shrink, not proof (rank 0 closes it to
    shrink too)."""
    error.lost_inferred = (0,)  # type: ignore[attr-defined]
    return error
