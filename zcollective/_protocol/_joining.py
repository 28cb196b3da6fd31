"""The coordinator's admission: JOINs, challenges, refusals (one REJECT a peer), newcomers parked for a
GROW (rule 10), and messages that fail authentication or speak another version (rule 6)."""

from __future__ import annotations

import hmac
import logging
from collections import OrderedDict
from typing import Any, Optional

from .._format import _bodies, _wire
from .._format._bodies import NOT_FORMING, PYTHON_VERSION, error_body
from .._format._wire import Kind, Message, WireError, control
from ._ops import SPOKEN, Outgoing
from ._parts import MAX_REFUSAL_BYTES, Joined, Owner, Phase

log = logging.getLogger("zcollective")

MAX_NEWCOMERS = 64  # newcomers parked at once (rule 10); more are refused until a GROW
MAX_CHALLENGES_PER_PEER = 8  # a replica asks again after each reconnect while joining; more is a replay
MAX_ANSWERED_PEERS = 1024  # refused peers remembered (one REJECT each); past this, refusals go unanswered
MUTATED = ("or did its program change a buffer (an array) it had passed to an _async call before "
           "the call completed (large buffers are sent without a copy)")  # the usual cause, by far


class Joining:
    """Who may join, and what a refused peer is told."""

    def __init__(self, co: Owner, challenge_key: bytes) -> None:
        self.co = co
        self.challenge_key = challenge_key  # challenges are HMAC(this, peer): nothing to store
        self.challenged: OrderedDict[bytes, int] = OrderedDict()  # peer -> CHALLENGEs sent (LRU)
        self.answered: set[bytes] = set()  # refused peers that got their one REJECT
        self.withdrawn: set[bytes] = set()  # peers that took their JOIN back: never counted here
        self.withdrawn_ranks: set[int] = set()  # the ranks they claimed: gone by their own word, counted
        # as dead for the majority (rule 9), never waited for

    def on_join(self, peer: bytes, msg: Message, member: Optional[Joined], address: str) -> list[Outgoing]:
        """A JOIN from a stranger, or again from a member (it reconnected)."""
        co = self.co
        if peer in self.withdrawn:  # (one sent before its withdrawal: a resend, a challenge's echo)
            return []
        if member is not None:
            if co.phase is Phase.RUNNING:  # a reconnect lost our WELCOME: say it again
                challenge = self._challenge(peer, msg)
                if challenge is not None:
                    return challenge
                member.nonce = _bodies.join_nonce(msg)
                return [(peer, co.membership.welcome(member))]
            if co.phase is Phase.FAILED:
                return [co.fail_message(member)]
            if co.phase is not Phase.JOINING:
                return []
            del co.members[peer], co.by_rank[member.rank]  # joins again, below
        try:
            info = _bodies.parse_join(msg)
        except WireError as exc:
            co.warn(address, "join", f"dropped a malformed JOIN from {address}: {exc}")
            return []
        python, n, ops = info.pop("python"), info.pop("num_replicas"), info.pop("ops")
        lineage, newcomer, job = info.pop("lineage"), info.pop("newcomer"), info.pop("job")
        join = Joined(peer=b"", **info)
        if job != co.job:  # another job's replica: refused alone, the right one may still come
            return self._refuse_foreign(peer, msg, join, job, newcomer, address)
        join.newcomer = bool(newcomer and lineage is None)
        if join.newcomer:  # while joining, running, or failed (its survivors form the next group)
            return self._park(peer, msg, join, python, ops, address)
        if lineage == f"{co.session:x}":  # this group's members forming the next one (rule 9), early
            return self.refuse(peer, msg, NOT_FORMING, f"{join.describe()} came to form the next "
                               f"group, but its would-be host has not closed this one yet", once=False)
        if co.phase is not Phase.JOINING:  # nothing from a non-member changes a running group
            return self._refuse_late(peer, msg, join, address, lineage)
        forming = co.forming
        if lineage != (forming.lineage if forming is not None else None):
            return self._refuse_stranger(peer, msg, join, address, lineage)
        if msg.flags & _wire.FLAG_AUTH and co.signer is None:  # unproven: refuse this peer alone
            message = (f"{join.describe()} uses a secret, but the coordinator (rank 0) has none: "
                       f"set the same ZCOLLECTIVE_SECRET on every replica")
            co.warn(address, "secret", f"refused a join: {message}")
            if 0 <= join.rank < co.num_replicas:
                co.refused[join.rank] = message
            return self.refuse(peer, msg, "AuthenticationError", message)
        challenge = self._challenge(peer, msg)
        if challenge is not None:
            return challenge
        if forming is not None and join.rank not in forming.expected and 0 <= join.rank < n:
            return self.refuse(peer, msg, "LeftOutError", co.membership.left_out(join))
        if forming is not None and n != forming.old_size:  # of the lineage, but a grow went on without it
            return self.refuse(peer, msg, "LeftOutError", (
                f"{join.describe()} came to form a group from one of {n} replicas, but the group "
                f"here forms from {forming.old_size} (a grow that went on without it)"))
        problem = self._join_problem(join, python, n, ops)
        if problem is not None:
            return [*self.refuse(peer, msg, *problem), *co.fail(*problem)]
        join.peer, join.address, join.heard = peer, address, co.clock()
        if co.world is not None and 0 <= join.rank < len(co.world):
            join.world = co.world[join.rank]
        co.members[peer] = join
        co.by_rank[join.rank] = join
        self.withdrawn_ranks.discard(join.rank)
        return self._complete()

    def _complete(self) -> list[Outgoing]:
        """The group starts once every rank joined (forming: or withdrew, the host among those that came)."""
        co, forming = self.co, self.co.forming
        if forming is None:
            return co.membership.start() if len(co.by_rank) >= co.num_replicas else []
        if forming.host_rank not in co.by_rank or not forming.expected <= (
                co.by_rank.keys() | self.withdrawn_ranks | forming.dead):
            return []
        return co.membership.start()

    def on_withdraw(self, peer: bytes, member: Optional[Joined], msg: Message) -> list[Outgoing]:
        """Rule 9: a replica not welcomed takes its JOIN back (a BYE bound to it: interrupted, or out of
        time). Before the group starts it is forgotten (nothing from that peer counts again here) and told
        so by a BYE; once started, its WELCOME went before, so it is a member and nothing changes."""
        co = self.co
        if member is not None and co.phase is not Phase.JOINING:
            return []  # welcomed (or told of a failure) before: it knows its place
        if peer not in self.withdrawn and len(self.withdrawn) >= MAX_ANSWERED_PEERS:
            return []  # (a flood of strangers: bounded memory)
        self.withdrawn.add(peer)
        newcomer = co.newcomers.pop(peer, None)
        if member is not None:
            del co.members[peer], co.by_rank[member.rank]
        rank = member.rank if member is not None else msg.rank
        ranks = co.forming.expected if co.forming is not None and co.phase is Phase.JOINING else range(
            co.num_replicas)  # (forming: old ranks; else the earlier group's, for the host forming next)
        if newcomer is None and rank in ranks and co.phase is not Phase.RUNNING and (
                co.phase is not Phase.JOINING or rank not in co.by_rank):
            # said so itself: not partitioned away, not forming elsewhere
            self.withdrawn_ranks.add(rank)
            log.info("zcollective coordinator: rank %d withdrew its join: the group forms without it", rank)
        bye = [(peer, Message(Kind.BYE, rank=msg.rank, session=msg.session))]
        return bye + self._complete() if co.phase is Phase.JOINING else bye

    def _park(self, peer: bytes, msg: Message, join: Joined, python: str, ops: str,
              address: str) -> list[Outgoing]:
        """Rule 10: a newcomer waits for a GROW (refused alone if it runs another Python or release)."""
        challenge = self._challenge(peer, msg)
        if challenge is not None:
            return challenge
        if python != PYTHON_VERSION:
            return self.refuse(peer, msg, "ProtocolError", f"{join.describe()} runs Python "
                               f"{python}, the group runs {PYTHON_VERSION}")
        if ops != SPOKEN:
            return self.refuse(peer, msg, "ProtocolError", f"{join.describe()} knows the operations "
                               f"{ops}, the group knows {SPOKEN}: every replica must run the same "
                               f"zcollective release")
        newcomers = self.co.newcomers
        if peer not in newcomers and len(newcomers) >= MAX_NEWCOMERS:
            return self.refuse(peer, msg, "LateJoinError", f"{join.describe()}: "
                               f"{MAX_NEWCOMERS} newcomers already wait to be admitted")
        join.peer, join.address = peer, address
        newcomers[peer] = join
        log.info("zcollective coordinator: %s waits to be admitted (grow)", join.describe())
        return []

    def refuse(self, peer: bytes, join: Any, error: str, message: str, once: bool = True) -> list[Outgoing]:
        """One REJECT for a peer that is not a member (none past :data:`MAX_ANSWERED_PEERS`), bound to the
        rank and nonce ``join`` names, as far as they can be read (``once=False``: a "not yet", said to
        each JOIN, and the peer's later messages, its withdrawal say, are still read)."""
        if once:
            if peer in self.answered or len(self.answered) >= MAX_ANSWERED_PEERS:
                return []
            self.answered.add(peer)
        rank, token = _claimed(join)
        return [(peer, control(Kind.REJECT, error_body(error, message, MAX_REFUSAL_BYTES),
                               rank=rank, session=token))]

    def on_auth_error(self, peer: bytes, frames: list[Any], exc: _wire.AuthError,
                      address: str) -> list[Outgoing]:
        co = self.co
        member = co.members.get(peer)
        if member is not None:  # only a member can write on this connection: altered in flight
            return co.fail("AuthenticationError", f"a message on the connection of "
                           f"{member.describe()} at {address} failed authentication ({exc}); "
                           f"was it altered in flight, {MUTATED}? {co.watch.in_flight()}", bad=[member.rank])
        co.warn(address, "auth", f"refused a message from {address} that failed "
                f"authentication ({exc}): it does not know the job's secret")
        head = bytes(memoryview(frames[0])[:4]) if frames else b""
        if len(head) == 4 and head[3] == Kind.JOIN:  # tell a misconfigured replica at once
            return self.refuse(peer, frames, "AuthenticationError",
                               "the coordinator (rank 0) refused this replica: its messages do not "
                               "carry the job's secret (set the same ZCOLLECTIVE_SECRET everywhere)")
        return []

    def on_version_error(self, peer: bytes, frames: list[Any], exc: _wire.VersionError,
                         address: str) -> list[Outgoing]:
        co = self.co
        head = bytes(memoryview(frames[0])[:4])
        if peer not in co.members and len(head) == 4 and head[3] == Kind.JOIN and co.phase is Phase.JOINING:
            message = (f"a replica at {address} speaks zcollective protocol version "
                       f"{exc.version}, the coordinator (rank 0) speaks {_wire.PROTOCOL_VERSION}: "
                       f"install the same zcollective version on every host")
            return [*self.refuse(peer, frames, "ProtocolError", message), *co.fail("ProtocolError", message)]
        co.warn(address, "version", f"dropped a message of protocol version {exc.version} from {address}")
        return []

    def _refuse_stranger(self, peer: bytes, msg: Message, join: Joined, address: str,
                         lineage: Optional[str]) -> list[Outgoing]:
        """A JOIN for another group: of another lineage, or forming where this group is not (or back)."""
        if lineage is None:
            message = (f"{join.describe()} tried to join a group the survivors of an earlier one "
                       f"form here, with no part in it (another job on this port? give each job its own)")
        else:
            message = (f"{join.describe()} came to form a group from an earlier one here, but "
                       f"the group here is {'another' if self.co.forming else 'a new'} one")
        self.co.warn(address, "late", f"refused a join: {message}")
        return self.refuse(peer, msg, "LateJoinError", message)

    def _refuse_foreign(self, peer: bytes, msg: Message, join: Joined, job: Optional[str],
                        newcomer: bool, address: str) -> list[Outgoing]:
        """Rule 6: a JOIN of another job refuses that peer alone, naming both jobs."""
        co = self.co
        who = f"a newcomer (pid {join.pid} on {join.host})" if newcomer else join.describe()
        fix = (f"set ZCOLLECTIVE_JOB={co.job!r} on it" if co.job is not None else
               "give every replica the same ZCOLLECTIVE_JOB")
        message = (f"{who} {_of_job(job)}, but the group at this address {_of_job(co.job)}: "
                   f"two jobs on one master address and port? give each its own port (or, if it is "
                   f"of this job, {fix})")
        co.warn(address, "job", f"refused a join: {message}")
        if co.phase is Phase.JOINING and not newcomer and 0 <= join.rank < co.num_replicas:
            co.refused[join.rank] = message  # (rank 0's join timeout says why it never came)
        return self.refuse(peer, msg, "JobMismatchError", message)

    def _refuse_late(self, peer: bytes, msg: Message, join: Joined, address: str,
                     lineage: Optional[str] = None) -> list[Outgoing]:
        co = self.co
        if co.forming is not None and lineage == co.forming.lineage and co.phase is Phase.RUNNING:
            return self.refuse(peer, msg, "LeftOutError", co.membership.left_out(join))
        if co.phase is Phase.FAILED:
            failure = co.failure or {}
            return self.refuse(peer, msg, str(failure.get("error")), str(failure.get("message")))
        state = "has already started" if co.phase is Phase.RUNNING else f"is {co.phase.value}"
        message = (f"{join.describe()} tried to join the group at seq {min(co.next_seq, default=0)}, "
                   f"but the group of {co.num_replicas} replicas {state} (another job on this "
                   f"port? give each job its own)")
        co.warn(address, "late", f"refused a join: {message}")
        return self.refuse(peer, msg, "LateJoinError", message)

    def _join_problem(self, join: Joined, python: str, n: int, ops: str) -> Optional[tuple[str, str]]:
        """Why a proven JOIN fails the whole group (error name, text), or None."""
        co, who = self.co, join.describe()
        if python != PYTHON_VERSION:
            return ("ProtocolError", f"{who} runs Python {python}, the coordinator (rank 0) runs "
                    f"Python {PYTHON_VERSION}; pickles are only compatible between identical Python versions")
        if ops != SPOKEN:
            return ("ProtocolError", f"{who} knows the operations {ops}, the coordinator (rank 0) "
                    f"knows {SPOKEN}: every replica must run the same zcollective release")
        size = co.forming.old_size if co.forming is not None else co.num_replicas
        if n != size:
            return ("ValueError", f"replicas disagree on num_replicas: {who} says {n}, "
                    f"the coordinator (rank 0) says {size}")
        if not 0 <= join.rank < size:
            return ("ValueError", f"{who} is out of range for num_replicas={size}")
        if join.rank in co.by_rank:
            return ("ValueError", f"rank {join.rank} was claimed twice: by "
                    f"{co.by_rank[join.rank].describe()} and by pid {join.pid} on {join.host}")
        return None

    def _challenge(self, peer: bytes, join: Message) -> Optional[list[Outgoing]]:
        """With a secret, a JOIN is fresh only if it echoes our challenge to its peer: None for such a JOIN,
        else the CHALLENGE (none past :data:`MAX_CHALLENGES_PER_PEER`): a replayed JOIN claims nothing."""
        if self.co.signer is None:
            return None
        expected = hmac.new(self.challenge_key, peer, "sha256").hexdigest()[:32]
        echoed = _bodies.challenge_of(join)
        if echoed is not None and hmac.compare_digest(echoed.encode("utf-8", "replace"), expected.encode()):
            return None
        sent = self.challenged.pop(peer, 0)
        if sent >= MAX_CHALLENGES_PER_PEER:
            self.challenged[peer] = sent
            return []
        self.challenged[peer] = sent + 1
        if len(self.challenged) > MAX_ANSWERED_PEERS:
            self.challenged.popitem(last=False)
        rank, token = _claimed(join)
        return [(peer, _bodies.challenge(expected, rank=rank, session=token))]


def _of_job(job: Optional[str]) -> str:
    """What a JOIN or a coordinator is of: "is of job 'train-a'", or "names no job"."""
    return "names no job" if job is None else f"is of job {job!r}"


def _claimed(join: Any) -> tuple[int, int]:
    """The rank and JOIN token a refused JOIN claimed, as far as they can be read (its REJECT's)."""
    try:
        msg = join if isinstance(join, Message) else _wire.decode(join)  # a tag is stripped unread
        return msg.rank, _wire.join_token(_bodies.join_nonce(msg))
    except Exception:  # anything unreadable: the REJECT is bound to nobody
        return _wire.NO_RANK, 0
