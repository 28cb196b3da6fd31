"""The coordinator's endings (rule 7): BYEs, FINALs (rule 12), rank 0's own end and its last BYEs."""

from __future__ import annotations

import logging
from typing import Optional

from .._format import _bodies
from .._format._wire import FLAG_DATA, FLAG_LAST, Kind, Message
from .._limits import EXIT_WAIT_S
from ._ops import Outgoing, describe_call, rank_list
from ._parts import Joined, Owner, Phase

log = logging.getLogger("zcollective")


class Endings:
    """BYEs, FINALs, the answers held until data is taken (TAKEN), and rank 0's end."""

    def __init__(self, co: Owner) -> None:
        self.co = co
        self.ending_since: Optional[float] = None  # rank 0's program said it was ending
        self.unanswered: set[bytes] = set()  # peers sent the last BYE that have not answered it
        self.held: dict[int, list[tuple[int, Outgoing]]] = {}  # rank -> (seq, BYE answer) till it took seq

    def on_bye(self, member: Joined, msg: Message, address: str) -> list[Outgoing]:
        co = self.co
        if msg.flags & FLAG_LAST:  # the answer to our last BYE
            self.unanswered.discard(member.peer)
            return []
        if co.phase is Phase.FAILED:
            return [co.fail_message(member)]
        # answered after every reply before it: all it sent has been taken, so it may close
        answer = (member.peer, Message(Kind.BYE, rank=member.rank, seq=msg.seq, session=co.binding(member)))
        if any(out[0] == member.peer for held in self.held.values() for _, out in held):
            return []  # sent again (a reconnect): its answer is still held for its data
        if co.phase is not Phase.RUNNING or member.ended is not None:
            return [answer]
        member.ended = max(msg.seq, co.next_seq[member.rank])
        co.ended.append(member)
        log.info("zcollective coordinator: %s", member.describe_end())
        if msg.flags & FLAG_DATA:  # its part of a call moving peer to peer never left: no ring completes
            told = co.fail("ReplicaLostError", f"{member.describe_end()} before it had moved its "
                           f"data of the calls going peer to peer; {co.watch.in_flight()}",
                           lost=[member.rank], exclude={member.rank})
            return [*told, *self.release(member.rank), answer]
        farewell = self._hold(member, answer) + self.release(member.rank)  # it moves no more data
        if len(co.ended) == len(co.members):
            co.phase = Phase.CLOSED  # everyone is done: nothing can be waiting
            return farewell
        return self.check() + farewell

    def on_final(self, member: Joined, msg: Message, address: str) -> list[Outgoing]:
        """Rule 12: ``member`` sends no more; every other member running is told how many it sent it."""
        co = self.co
        final = _bodies.parse_final(msg, co.num_replicas)
        member.sent = sum(final["sent"])  # (its BYE comes next: said when it ended)
        if co.phase is not Phase.RUNNING:
            return []
        how = "called teardown" if final["teardown"] else "ended its program (without teardown)"
        calls = final["calls"]
        if calls is not None:
            how += f" after seq {calls - 1}" if calls else " with no collective call before"
        who = f"rank {member.rank} {how} ({member.in_world(', ')}pid {member.pid} on {member.host})"
        sent, lost, received = final["sent"], final["lost"], final["received"]
        return [(m.peer, _bodies.ended(who, None if received is None else received[m.rank], lost[m.rank],
                                       teardown=final["teardown"], posted=final["posted"][m.rank],
                                       rank=m.rank, root=member.rank,
                                       seq=sent[m.rank], session=co.binding(m)))
                for m in co.members.values() if m is not member and m.ended is None and not m.newcomer]

    def on_taken(self, member: Joined, msg: Message, address: str) -> list[Outgoing]:
        return self.release(member.rank, msg.seq)

    def _hold(self, member: Joined, answer: Outgoing) -> list[Outgoing]:
        """The answer to ``member``'s BYE, or the TAKEN asking the next rank (the answer then held)."""
        co = self.co
        nxt, moving = co.by_rank.get((member.rank + 1) % co.num_replicas), co.calls.moving
        if moving is None or nxt is None or nxt is member or nxt.ended is not None:
            return [answer]
        seq = moving[0]  # every data call had every rank: this is the member's last
        self.held.setdefault(nxt.rank, []).append((seq, answer))
        return [(nxt.peer, Message(Kind.TAKEN, rank=nxt.rank, seq=seq, session=co.session))]

    def release(self, rank: int, seq: Optional[int] = None) -> list[Outgoing]:
        """The BYE answers held for ``rank``'s data through ``seq`` (None: all)."""
        held = self.held.get(rank)
        if not held:
            return []
        self.held[rank] = [(s, out) for s, out in held if seq is not None and s > seq]
        return [out for s, out in held if seq is None or s <= seq]

    def check(self) -> list[Outgoing]:
        """Fail the group if a pending call needs a rank that ended, or rank 0 ended done (rule 7)."""
        co = self.co
        ended = co.ended
        if not ended or co.phase is not Phase.RUNNING:
            return []
        for seq in sorted(co.pending):
            gone = [m for m in ended if m.ended <= seq]  # type: ignore[operator]
            if gone:
                return self._fail_ended(gone[0], f"seq {seq} {self._pending_call(seq)}")
        host = co.by_rank.get(0)
        if host is not None and host.ended is not None and not any(s < host.ended for s in co.pending):
            # the usual end of a program: not worth more than an info line
            return self._fail_ended(host, "the coordinator it hosted is gone, so the group is over",
                                    logging.INFO)
        return []

    def _pending_call(self, seq: int) -> str:
        call = self.co.pending[seq]
        on = rank_list(call.contributions, self.co.world)
        return f"{describe_call(call.op, call.root)} was in flight on {on}"

    def _fail_ended(self, member: Joined, context: str, level: int = logging.ERROR) -> list[Outgoing]:
        return self.co.fail("ReplicaLostError", f"{member.describe_end()}; {context}", lost=[member.rank],
                            ended=True, exclude={m.rank for m in self.co.ended}, level=level)

    def start_ending(self) -> None:
        """Rule 7: rank 0's program is ending; its last calls get :data:`EXIT_WAIT_S` to complete."""
        if self.ending_since is None:
            self.ending_since = self.co.clock()

    def ending_due(self) -> Optional[float]:
        """When rank 0 stops waiting for its last calls (:meth:`give_up_ending`); None if not ending."""
        if self.ending_since is None or self.co.phase in (Phase.CLOSED, Phase.FAILED):
            return None
        return self.ending_since + EXIT_WAIT_S

    def give_up_ending(self) -> list[Outgoing]:
        """Rank 0's program ended and waited (or was interrupted): tell the others the group is over."""
        co = self.co
        host = co.by_rank.get(0)
        if co.phase is not Phase.RUNNING or host is None or self.ending_since is None:
            return []
        waited = round(co.clock() - self.ending_since, 1)
        if host.ended is None:  # interrupted before its BYE went: it ends now, after its calls
            host.ended = co.next_seq[0]
            co.ended.append(host)
            return self._fail_ended(host, "it was interrupted while ending, so the group is over")
        waiting = [f"seq {s} {self._pending_call(s)}" for s in sorted(co.pending) if s < host.ended][:3]
        return self._fail_ended(host, f"it waited {waited:g} s for its last calls, but "
                                      f"{'; '.join(waiting) or 'they did not complete'}")

    def last_byes(self) -> list[Outgoing]:
        """Rank 0's program ends: a last BYE to every member still running, each answered (rule 7)."""
        co = self.co
        if not co.welcomed:
            return []  # nobody was sent a result
        running = [m for m in co.members.values() if m.ended is None and m.rank != 0]
        self.unanswered.update(m.peer for m in running)
        return [(m.peer, Message(Kind.BYE, rank=m.rank, session=co.session, flags=FLAG_LAST))
                for m in running]

    def waiting(self) -> bool:
        """Rank 0 may not close yet: an answer to a last BYE, or a data rank's TAKEN, is still to come."""
        return bool(self.unanswered) or any(self.held.values())
