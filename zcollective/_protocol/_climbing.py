"""The tree at the coordinator (rule 14): parts that climbed it, checked and combined; results sent down
it, kept to resend if an interior rank is lost; give-ups that came before their rank's part."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

from .._format._wire import Kind, Message
from . import _ops, _tree
from ._ops import OPS, Op, Outgoing
from ._parts import Joined, Owner, PendingCall, Phase

MAX_RESENT_CALLS = 64  # results sent down the tree kept, for the subtree of an interior rank lost
MAX_RESENT_BYTES = 16 << 20  # ... and at most this much of them (large results keep fewer)
MAX_EARLY_GIVE_UPS = 1024  # give-ups come before their rank's part; past this the oldest are forgotten


class Climb:
    """Rank 0's side of the tree, once the group settled on one (``co.tree``)."""

    def __init__(self, co: Owner) -> None:
        self.co = co
        self.down: list[int] = []  # the ranks a result that comes down the tree is sent to
        self.sent_down: OrderedDict[int, tuple[Op, int, int, list[list[Any]], int]] = OrderedDict()  # latest
        self.sent_down_bytes = 0  # ... and those bytes together
        self.early: OrderedDict[tuple[int, int], tuple[str, str]] = OrderedDict()  # (seq, rank) -> give-up

    def on_up(self, member: Joined, msg: Message, address: str) -> _ops.Step:
        """A part that climbed to ``member``, rank 0's child: one rank's contribution, or a summary."""
        co = self.co
        if co.phase is Phase.FAILED:
            return []
        tree = co.tree
        try:
            lo, end = _tree.span(msg)
        except ValueError as exc:
            co.warn(address, "malformed", f"dropped an UP from {member.describe()}: {exc}")
            return []
        if tree is None or not member.rank <= lo < end <= tree.end[member.rank]:
            co.warn(address, "forged", f"dropped an UP of ranks {lo}..{end - 1} from {member.describe()}, "
                    f"whose subtree they are not")
            return []
        if not msg.flags & _tree.FLAG_RANGE:
            own = dataclasses.replace(msg, kind=Kind.CONTRIB)
            return co.calls.on_contribution(co.by_rank[lo], own, address)
        seq, op = msg.seq, OPS.get(msg.op)
        next_seq = co.next_seq
        if co.phase is not Phase.RUNNING or op is None or next_seq[lo:end] != [seq] * (end - lo):
            co.warn(address, "seq", f"dropped a summary of seq {seq} of ranks {lo}..{end - 1} "
                    f"from {member.describe()}: out of order (a replay or a forgery)")
            return []
        now = co.clock()
        call = co.pending.get(seq)
        if call is None:
            call = co.pending[seq] = PendingCall(op, msg.root)
        if call.spans is None:
            call.spans = {}
        call.spans[lo] = end
        ranks, last = range(lo, end), (seq, _ops.LABELS[op], msg.callsite, now)
        next_seq[lo:end] = [seq + 1] * (end - lo)  # (in C: a summary of a thousand ranks costs little)
        call.contributions.update(dict.fromkeys(ranks, msg))
        call.arrived.update(dict.fromkeys(ranks, now))
        by_rank = co.by_rank
        for rank in ranks:
            by_rank[rank].last = last
        return co.calls.counted(seq, call, msg, lo, end)

    def parts(self, call: PendingCall) -> list[tuple[int, Message]]:
        """A call's parts as they came, by first rank: summaries once each."""
        spans, contributions, out, rank = call.spans or {}, call.contributions, [], 0
        while rank < self.co.num_replicas:
            out.append((rank, contributions[rank]))
            rank = spans.get(rank, rank + 1)
        return out

    def climbed(self, seq: int, call: PendingCall) -> _ops.Step:
        """A complete call with summaries among its parts: checked as the star's, then reduced or routed."""
        co = self.co
        op, root, came, spans = call.op, call.root, self.parts(call), call.spans or {}
        stand_ins: list[Message] = []
        for lo, c in came:  # (one per summary, and its root's: no work per rank)
            if not c.flags & _tree.FLAG_RANGE:
                stand_ins.append(c)
                continue
            end = spans[lo]
            alike = dataclasses.replace(c, flags=0, segments=_stand_in(op, root, -1, c))
            stand_ins += [alike] * (end - lo)
            if lo <= root < end and op == Op.BROADCAST:
                stand_ins[root] = dataclasses.replace(alike, segments=_stand_in(op, root, root, c))
        out = co.calls.problem(seq, call, stand_ins)
        if out is not None:
            return out
        parts = tuple(_tree.parts(c) for _, c in came)
        if op == Op.ALLREDUCE:
            co.combining[seq], co.reducing = call, (seq, op, co.clock())
            return [_ops.Combine(seq, op, 0, 1, call.contributions[0].fn, parts, tuple(lo for lo, _ in came),
                                 tuple(_tree.reduced_with(c) for _, c in came))]
        value: list[list[Any]] = []
        if op == Op.BROADCAST:  # (the root's part: another rank's may carry a shared-memory status)
            value = next(_tree.parts(c) for lo, c in came if lo <= root < spans.get(lo, lo + 1))
        return co.calls.results(seq, call, [value] * co.num_replicas)

    def keep_down(self, seq: int, call: PendingCall, flags: int, segments: list[list[Any]]) -> None:
        """Keep a result sent down the tree, to send again if an interior rank is lost with it."""
        size = sum(len(f) if type(f) is bytes else memoryview(f).nbytes for s in segments for f in s)
        kept = self.sent_down
        kept[seq] = (call.op, call.root, flags, segments, size)
        self.sent_down_bytes += size
        while len(kept) > MAX_RESENT_CALLS or (len(kept) > 1 and self.sent_down_bytes > MAX_RESENT_BYTES):
            self.sent_down_bytes -= kept.popitem(last=False)[1][4]

    def resend_down(self, rank: int) -> list[Outgoing]:
        """Interior rank ``rank`` is lost: the latest results go straight to its subtree, before the FAIL."""
        co, tree = self.co, self.co.tree
        if tree is None or not tree.children[rank]:
            return []
        return [(co.by_rank[r].peer, Message(Kind.RESULT, op, r, root, seq, co.session, flags=flags,
                                             segments=segments))
                for seq, (op, root, flags, segments, _) in self.sent_down.items()
                for r in range(rank + 1, tree.end[rank]) if r in co.by_rank]

    def gave_up(self, seq: int, rank: int, error: str, said: str) -> None:
        """``rank`` gave up call ``seq`` before its part climbed to rank 0."""
        self.early[(seq, rank)] = (error, said)
        while len(self.early) > MAX_EARLY_GIVE_UPS:
            self.early.popitem(last=False)

    def gave_up_early(self, seq: int, lo: int, end: int) -> list[Outgoing]:
        """Give-ups of ranks ``lo`` .. ``end`` - 1 that came before their parts."""
        out: list[Outgoing] = []
        for rank in range(lo, end):
            early = self.early.pop((seq, rank), None)
            if early is not None and not out:
                out = self.co.calls.abandon(self.co.by_rank[rank], seq, *early)
        return out


def _stand_in(op: int, root: int, rank: int, summary: Message) -> list[list[Any]]:
    """What rank ``rank`` of ``summary`` sent, as far as the checks look."""
    if op == Op.ALLREDUCE:
        return [[b""]]
    if op == Op.BROADCAST and rank == root:
        return _tree.parts(summary)
    return []
