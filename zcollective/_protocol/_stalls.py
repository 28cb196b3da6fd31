"""The coordinator's watch on calls: stall warnings (rule 11), STATUS, ``Group.status``, calls in flight."""

from __future__ import annotations

import logging
from typing import Any, Optional

from .._format import _bodies
from .._format._wire import Message, join_token
from .._limits import MAX_STALL_WARNINGS
from ._ops import Outgoing, describe_call, rank_list
from ._parts import Joined, Owner, PendingCall, Phase

log = logging.getLogger("zcollective")


class Stalls:
    """Who each call waits for, and when a wait is worth a warning."""

    def __init__(self, co: Owner) -> None:
        self.co = co
        self.join_warned = 0

    def on_status(self, member: Joined, msg: Message, address: str) -> list[Outgoing]:
        co, seq = self.co, msg.seq
        binding = co.binding(member) if msg.session != 0 else join_token(member.nonce)
        if co.phase is Phase.JOINING:
            refused = {str(r): m for r, m in co.refused.items() if r not in co.by_rank}
            return [(member.peer, _bodies.status(seq, "joining", {
                "missing": co.missing_joins(), "arrived": sorted(co.by_rank), "refused": refused},
                rank=member.rank, session=binding))]
        call = co.pending.get(seq)
        arrived = sorted(call.contributions) if call is not None else [
            r for r in range(co.num_replicas) if co.next_seq[r] > seq]
        missing = [r for r in range(co.num_replicas) if r not in arrived]
        state = "pending" if missing else ("done" if call is None else "computing")
        fields: dict[str, Any] = {"arrived": arrived, "missing": missing}
        if call is not None:
            fields["op"] = describe_call(call.op, call.root)
            if missing and call.arrived:
                fields["stall"] = self.stall_line(seq, call, co.clock())
        return [(member.peer, _bodies.status(seq, state, fields, rank=member.rank, session=binding))]

    def next_stall(self) -> Optional[float]:
        """When (its clock) a stall warning may next be due; None: none can."""
        co = self.co
        if co.warn_after is None:
            return None
        if co.phase is Phase.JOINING:
            if self.join_warned >= MAX_STALL_WARNINGS:
                return None
            return co.started_at + co.warn_after * (1 << self.join_warned)
        if co.phase is not Phase.RUNNING or not co.pending:
            return None
        due: Optional[float] = None
        for call in co.pending.values():  # (as _due, inline: the server asks at every step)
            if call.warned < MAX_STALL_WARNINGS and call.arrived:
                at = min(call.arrived.values()) + co.warn_after * (1 << call.warned)
                if at and (due is None or at < due):
                    due = at
        return due

    def _due(self, call: PendingCall) -> Optional[float]:
        """When ``call``'s next stall warning is due (rule 11); None: no more."""
        warn_after = self.co.warn_after
        if warn_after is None or call.warned >= MAX_STALL_WARNINGS or not call.arrived:
            return None
        return min(call.arrived.values()) + warn_after * (1 << call.warned)

    def stalls(self, now: float) -> list[tuple[str, list[int]]]:
        """The stall warnings due at ``now``: each line, with the ranks it names (for their stacks)."""
        co = self.co
        due = self.next_stall()
        if due is None or now < due:
            return []
        if co.phase is Phase.JOINING:
            self.join_warned += 1
            missing = co.missing_joins()
            joined = "; ".join(f"{m.describe()} from {m.address}" for _, m in sorted(co.by_rank.items()))
            return [(f"zcollective coordinator: {co.name or 'the group'} has waited "
                     f"{now - co.started_at:.0f} s for {rank_list(missing, co.world)} to join "
                     f"(joined: {joined or 'none'})", missing)]
        out = []
        for seq, call in sorted(co.pending.items()):
            call_due = self._due(call)
            if call_due is not None and now >= call_due:
                call.warned += 1
                out.append((f"zcollective coordinator: {self.stall_line(seq, call, now)}",
                            call.missing(co.num_replicas)))
        return out

    def stall_line(self, seq: int, call: PendingCall, now: float) -> str:
        """``seq 42 allreduce at train.py:88 has waited 61 s for rank 3 ...``"""
        site = next((c.callsite for c in call.contributions.values() if c.callsite), "?")
        missing = call.missing(self.co.num_replicas)
        waited, arrived = now - min(call.arrived.values()), ",".join(map(str, sorted(call.contributions)))
        return (f"seq {seq} {describe_call(call.op, call.root)} at {site} has waited {waited:.0f} s "
                f"for {rank_list(missing, self.co.world)} (arrived: {arrived}); "
                + "; ".join(self._last_call(r, now) for r in missing))

    def snapshot(self, now: float) -> dict[int, dict[str, Any]]:
        """Per rank: its last call and the calls pending for it; any thread reads it (copies iterated)."""
        ranks: dict[int, dict[str, Any]] = {}
        for rank, member in list(self.co.by_rank.items()):
            last = member.last
            ranks[rank] = {"describe": member.describe(), "ended": member.ended is not None,
                           "last_call": None if last is None else {
                               "seq": last[0], "op": last[1], "callsite": last[2],
                               "ago_s": round(now - last[3], 3)},
                           "waited_for": []}
        for seq, call in list(self.co.pending.items()):
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
        member = self.co.by_rank.get(rank)
        if member is None:
            return f"rank {rank} is not a member"
        if member.ended is not None:
            return member.describe_end()
        if member.last is None:
            return f"{member.describe()} has made no call yet"
        seq, op, site, at = member.last
        return f"{member.describe()}'s last call was seq {seq} {op} at {site or '?'}, {now - at:.0f} s ago"

    def completed_late(self, seq: int, call: PendingCall, last: int) -> None:
        """A call warned of as stalled completed: say so, and who came last."""
        waited = call.arrived[last] - min(call.arrived.values())
        log.warning("zcollective coordinator: seq %d %s completed after %.0f s; rank %d was last",
                    seq, describe_call(call.op, call.root), waited, last)

    def in_flight(self) -> str:
        """The calls in flight, for an error message."""
        co = self.co
        if co.phase is Phase.JOINING:
            return f"while joining ({rank_list(co.missing_joins(), co.world)} had not joined)"
        moving = co.calls.moving
        if not co.pending:
            if moving is not None and moving[0] == min(co.next_seq) - 1:
                return f"seq {moving[0]} {moving[1].label} was matched; its data moves peer to peer"
            return f"no call was in flight (next seq {min(co.next_seq)})"
        return "in flight: " + ", ".join(f"seq {seq} {describe_call(call.op, call.root)} (arrived: "
                                         f"{rank_list(call.contributions, co.world)})"
                                         for seq, call in sorted(co.pending.items())[:3])
