"""The coordinator's calls: sequence, matching, mismatch, completion and give-ups
(rules 2-5), and the syncs of calls through shared memory (rule 13). The common
call: a CONTRIB goes from the coordinator's route table to :meth:`Calls.on_contribution`."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any, Optional, cast

from .._format import _bodies
from .._format._bodies import error_body
from .._format._wire import FLAG_DATA, FLAG_LOCAL_ERROR, Kind, Message, WireError, control
from ..errors import from_signal
from . import _ops, _tree
from ._ops import OPERATIONS, OPS, Disagree, Malformed, Op, Outgoing, describe_call, rank_list
from ._parts import Joined, Owner, PendingCall, Phase

log = logging.getLogger("zcollective")

MAX_SHARED_CALLS = 1024  # shared-memory calls whose syncs are taken: the latest planned (rule 13)
MAX_SYNCS_WAITING = 4096  # syncs some but not all ranks of a host reached, at most


class Calls:
    """Collects each seq's contributions, checks them and answers the call (rules 2-5)."""

    def __init__(self, co: Owner) -> None:
        self.co = co
        self.moving: Optional[tuple[int, Op]] = None  # the last call whose data went peer to peer
        self.shared_calls: OrderedDict[int, Op] = OrderedDict()  # shared-memory calls planned (rule 13)
        self.syncing: dict[tuple[int, int, int], set[int]] = {}  # (seq, sync, host) -> ranks that reached it

    def on_contribution(self, member: Joined, msg: Message, address: str) -> _ops.Step:
        co, rank, seq = self.co, member.rank, msg.seq
        if co.phase is not Phase.RUNNING:
            co.warn(address, "early", f"dropped seq {seq} from {member.describe()}: "
                    f"group is {co.phase.value}")
            return []
        next_seq = co.next_seq
        if seq != next_seq[rank]:
            if seq == next_seq[rank] - 1:  # sent again by a call interrupted just after it
                log.debug("zcollective coordinator: dropped seq %d of %s sent twice", seq, member.describe())
                return []
            co.warn(address, "seq", f"dropped seq {seq} from {member.describe()}: "
                    f"expected seq {next_seq[rank]} (a replay or a forgery)")
            return []
        op = OPS.get(msg.op)
        if op is None:  # a member that sends it cannot pair its calls again
            return co.fail("ProtocolError", f"{member.describe()} sent seq {seq} with operation code "
                           f"{msg.op}, which no operation has here (another release, or altered?)",
                           bad=[rank])
        next_seq[rank] += 1
        call = co.pending.get(seq)
        if call is None:
            call = co.pending[seq] = PendingCall(op, msg.root)
        call.contributions[rank] = msg
        now = call.arrived[rank] = co.clock()
        member.last = (seq, _ops.LABELS[op], msg.callsite, now)
        return self.counted(seq, call, msg, rank, rank + 1)

    def counted(self, seq: int, call: PendingCall, msg: Message, lo: int, end: int) -> _ops.Step:
        """Ranks ``lo`` .. ``end`` - 1 contributed ``msg`` to call ``seq``: a mismatch, a give-up,
        nothing yet, or the call is complete."""
        co = self.co
        if msg.op != call.op or msg.root != call.root:
            return co.fail("CallMismatchError", self.mismatch(seq, call), seq=seq)
        early = co.climb.gave_up_early(seq, lo, end) if co.climb.early else []
        if call.abandoned is not None:  # given up by a rank: these hear so, as the others did
            if len(call.contributions) == co.num_replicas:
                del co.pending[seq]
            told = [] if early else self.error_all(seq, call.op, call.abandoned, list(range(lo, end)))
            return early + told + co.endings.check()
        if len(call.contributions) < co.num_replicas:
            return co.endings.check() if co.ended else []
        del co.pending[seq]
        co.lateness.record(call.arrived)
        if call.warned:
            co.watch.completed_late(seq, call, lo)
        if call.spans is not None:
            climbed = co.climb.climbed(seq, call)
            if climbed and isinstance(climbed[0], _ops.Combine):  # (handed back: combined())
                return climbed
            return self.then(call, cast("list[Outgoing]", climbed))
        contributions = list(map(call.contributions.__getitem__, range(co.num_replicas)))  # (no Python call)
        out = self.problem(seq, call, contributions)
        if out is None:
            operation = OPERATIONS[call.op]
            if isinstance(operation, _ops.Reducing):  # the driver runs it, hands it back: combined()
                co.combining[seq], co.reducing = call, (seq, call.op, co.clock())
                return [operation.combine(seq, contributions, call.root)]
            out = self.results(seq, call, operation.route(co, contributions, call.root))
            if not operation.closes and not co.ended:
                return out
        return self.then(call, out)

    def then(self, call: PendingCall, out: list[Outgoing]) -> list[Outgoing]:
        """``out``, a completed call's answer, then: a teardown closes the group; an ended rank fails it."""
        operation = OPERATIONS.get(call.op)
        if operation is not None and operation.closes:
            self.co.phase = Phase.CLOSED
            return out
        return out + self.co.endings.check() if self.co.ended else out

    def combined(self, asked: _ops.Combine, results: list[list[Any]]) -> list[Outgoing]:
        """The driver ran the reduction ``asked`` (rule 4): the RESULTs, given its
        ``results``; none if the call no longer waits for it (the group failed meanwhile)."""
        co = self.co
        co.reducing, call = None, co.combining.pop(asked.seq, None)
        operation = OPERATIONS[asked.op]
        if call is None or co.phase is not Phase.RUNNING or not isinstance(operation, _ops.Reducing):
            return []
        out = self.results(asked.seq, call, operation.route_combined(co.num_replicas, call.root, results))
        return out + co.endings.check() if co.ended else out  # (a reduction never closes the group)

    def combine_failed(self, asked: _ops.Combine, exc: BaseException) -> list[Outgoing]:
        """The reduction ``asked`` raised ``exc``: an ERROR to every rank; as :meth:`combined`."""
        co = self.co
        co.reducing, call = None, co.combining.pop(asked.seq, None)
        if call is None or co.phase is not Phase.RUNNING:
            return []
        return self.then(call, self.call_failed(asked.seq, call, exc))

    def problem(self, seq: int, call: PendingCall, contributions: list[Message]) -> Optional[list[Outgoing]]:
        """What a complete call is answered with instead of its route, if anything: an ERROR
        (no rules; a sender's own error; parts no working replica sends), a plan, a failure."""
        co = self.co
        if call.op not in OPERATIONS:  # no working replica sends it
            return self.error_all(seq, call.op, error_body(
                "ProtocolError", f"seq {seq}: operation {call.op.label!r} has no rules"))
        flags = 0  # any rank's
        for c in contributions:
            flags |= c.flags
        if flags & FLAG_DATA and not flags & FLAG_LOCAL_ERROR:
            if co.ended:  # its program ended before this call's plan came: no ring completes
                member = co.ended[0]
                return co.fail("ReplicaLostError", f"{member.describe_end()} before the plan of "
                               f"seq {seq} {call.op.label} came, whose data goes peer to peer; "
                               f"that call cannot complete", lost=[member.rank],
                               exclude={m.rank for m in co.ended})
            return self._plan(seq, call)
        for rank, c in enumerate(contributions):
            if c.flags & FLAG_LOCAL_ERROR:
                try:
                    said = c.body().get("message", "?")
                except WireError:  # a sender's error note that is not JSON: still its error
                    said = "?"
                return self.error_all(seq, call.op, error_body(
                    "PeerError", f"seq {seq} {call.op.label}: rank {rank}{_ops.in_world([rank], co.world)} "
                                 f"failed: {said}"))
        operation, root, n = OPERATIONS[call.op], call.root, co.num_replicas
        # (replicas check the root too: a broken or altered one; a split's root is its kind)
        why = ((operation.bad_root(root, n) if not 0 <= root < n else "")
               or operation.malformed(contributions, root))
        return self.call_failed(seq, call, Malformed(why)) if why else None

    def results(self, seq: int, call: PendingCall, routes: list[list[list[Any]]],
                flags: int = 0) -> list[Outgoing]:
        """Call ``seq``'s RESULTs: a header of its own for each rank; ranks
        given one payload share its frames, which the driver hashes once."""
        co = self.co
        by_rank, session = co.by_rank, co.session
        if co.tree is not None and _tree.goes_down(call.op, flags):  # the rest from their parents
            whole = next((r for r in routes if r), routes[0])  # (a broadcast's root's subtree needs it too)
            outs: list[Outgoing] = [(by_rank[rank].peer, Message(
                Kind.RESULT, call.op, rank, call.root, seq, session, flags=flags, segments=whole))
                for rank in co.climb.down]
            co.climb.keep_down(seq, call, flags, whole)
            return outs + OPERATIONS[call.op].completed(co, seq)
        outs = []
        for rank, segments in enumerate(routes):  # (a loop: no Python call on the common path)
            outs.append((by_rank[rank].peer, Message(Kind.RESULT, call.op, rank, call.root, seq, session,
                                                     flags=flags, segments=segments)))
        return outs + OPERATIONS[call.op].completed(co, seq)

    def _plan(self, seq: int, call: PendingCall) -> list[Outgoing]:
        """A call whose data travels on the data plane: matched here, then every rank
        is sent the plan and moves the data itself. Values that disagree: a mismatch."""
        try:
            segments = OPERATIONS[call.op].plan(call.ranked(), call.root, self.co.hosts)
        except (Disagree, Malformed) as exc:
            return self.call_failed(seq, call, exc)
        self.moving = (seq, call.op)
        if _ops.shared_plan(segments):  # its ranks sync through the coordinator (rule 13)
            self.shared_calls[seq] = call.op
            while len(self.shared_calls) > MAX_SHARED_CALLS:
                self.shared_calls.popitem(last=False)
        return self.results(seq, call, [segments] * self.co.num_replicas, FLAG_DATA)

    def call_failed(self, seq: int, call: PendingCall, exc: BaseException) -> list[Outgoing]:
        """Call ``seq`` failed here (``exc``): an ERROR to every rank, the group goes on."""
        head = f"seq {seq} {call.op.label}: "
        if isinstance(exc, Malformed):  # parts no working replica sends
            body = error_body("ProtocolError", f"{head}{exc}")
        elif isinstance(exc, _ops.Unreadable):  # the reduce function never ran: not a RemoteError
            body = error_body("SerializationError", f"{head}the coordinator (rank 0) {exc}")
        elif isinstance(exc, Disagree):  # nor here: arrays the data plane would have refused too
            body = error_body("CallMismatchError", head + self.disagreement(call, exc.described))
        else:  # the reduce function raised (SystemExit too: the user's error)
            if from_signal(exc):  # a signal handler's, on rank 0's thread: the driver raises it
                self.co.interrupted = exc  # once everyone heard
            body = _bodies.remote_error_body(f"{head}the reduction raised on the coordinator (rank 0)", exc)
        return self.error_all(seq, call.op, body)

    def disagreement(self, call: PendingCall, described: Optional[list[str]] = None) -> str:
        """The ranks' values, grouped by what each passed and where: from
        their data plans, or as rank 0 found them (``described``)."""
        groups: dict[tuple[str, str], list[int]] = {}
        if described is not None and call.spans is not None:  # by part: each of its ranks passed it
            spans = call.spans
            described = [what for (lo, _), what in zip(self.co.climb.parts(call), described, strict=True)
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
        world = self.co.world
        parts = [f"{rank_list(ranks, world)} passed {what} at {site}"
                 for (what, site), ranks in groups.items()]
        return "the ranks disagree: " + "; ".join(parts) + " (this call failed; the group goes on)"

    def mismatch(self, seq: int, call: PendingCall) -> str:
        groups: dict[tuple[str, str], list[int]] = {}
        for rank, contribution in sorted(call.contributions.items()):
            what = describe_call(contribution.op, contribution.root)
            groups.setdefault((what, contribution.callsite or "?"), []).append(rank)
        world = self.co.world
        parts = [f"{rank_list(ranks, world)} called {what} at {site}"
                 for (what, site), ranks in groups.items()]
        waiting = call.missing(self.co.num_replicas)
        if waiting:
            parts.append(f"{rank_list(waiting, world)} had not called yet")
        return f"seq {seq}: " + "; ".join(parts)

    def error_all(self, seq: int, op: Op, body: dict[str, Any],
                  ranks: Optional[list[int]] = None) -> list[Outgoing]:
        """An ERROR of call ``seq`` to every rank (or to ``ranks``)."""
        co = self.co
        if self.shared_calls.pop(seq, None) is not None:  # (its syncs wait for nobody now)
            for key in [k for k in self.syncing if k[0] == seq]:
                del self.syncing[key]
        if co.name:  # (a sub-group's: named, as its FAILs are)
            body = {**body, "message": f"{co.name}: {body.get('message', '?')}"}
        msg = control(Kind.ERROR, body, seq=seq, op=op, session=co.session)
        return [(co.by_rank[r].peer, dataclasses.replace(msg, rank=r))
                for r in (range(co.num_replicas) if ranks is None else ranks)]

    def on_abort(self, member: Joined, msg: Message, address: str) -> list[Outgoing]:
        co = self.co  # (only the secret's holders reach here when there is one)
        error, said, ranks, data_plane, abandoned = _bodies.parse_abort(msg, co.num_replicas)
        if abandoned:
            return self.abandon(member, msg.seq, error, said)
        if error == "PeerError" and co.phase is Phase.RUNNING and msg.seq < min(co.next_seq):
            # a reduce function raised mid-ring: that call fails on every rank, the group goes on
            return self.error_all(msg.seq, Op.ALLREDUCE, error_body("PeerError", said))
        if error == "AuthenticationError" and data_plane:  # a data link altered
            return co.fail("AuthenticationError", f"{said} (reported by {member.describe()})", bad=ranks)
        if error == "ReplicaLostError":  # its data plane lost a link
            return co.fail(error, f"{said} (reported by {member.describe()})", lost=ranks)
        return co.fail("AuthenticationError", f"{member.describe()} found its link to the "
                       f"coordinator tampered with: {said}", bad=[member.rank])

    def abandon(self, member: Joined, seq: int, error: str, said: str) -> list[Outgoing]:
        """``member`` gave up call ``seq`` (rule 4)."""
        co = self.co
        call = co.pending.get(seq)
        if error not in ("CollectiveTimeoutError", "PeerError"):
            return []
        shared = self.shared_calls.get(seq)
        moving = shared if shared is not None else (
            self.moving[1] if self.moving is not None and self.moving[0] == seq else None)
        if call is None and moving is not None:  # its data moves: it fails on every rank still moving it
            how = "through shared memory" if shared is not None else "peer to peer"
            return self.error_all(seq, moving, error_body(
                error, f"seq {seq} {moving.label}: {member.describe()} gave it up ({said}) "
                       f"while its data moved {how}, so it failed on every rank that had not "
                       f"finished it (the group goes on)"))
        if (co.tree is not None and seq >= co.next_seq[member.rank] and moving is None
                and (call is None or call.abandoned is None)):  # its part still climbs the tree
            co.climb.gave_up(seq, member.rank, error, said)
            return []
        if call is None or call.abandoned is not None or member.rank not in call.contributions:
            return []  # complete: every rank was sent its result (the giver's is on its way)
        call.abandoned = error_body(error, f"seq {seq} {describe_call(call.op, call.root)}: "
                                           f"{member.describe()} gave it up ({said}), so it failed on "
                                           f"every rank (the group goes on)")
        return self.error_all(seq, call.op, call.abandoned, list(call.contributions))

    def on_sync(self, member: Joined, msg: Message, address: str) -> list[Outgoing]:
        """Rule 12: ``member`` reached sync ``msg.root`` of shared-memory call ``msg.seq``;
        once every rank of its host did, each is told."""
        co, seq, sync = self.co, msg.seq, msg.root
        op = self.shared_calls.get(seq)
        host = co.hosts[member.rank] if co.hosts is not None else None
        key = (seq, sync, host if host is not None else -1)
        if op is None or host is None or not 0 <= sync < _ops.MAX_SYNCS or (
                key not in self.syncing and len(self.syncing) >= MAX_SYNCS_WAITING):
            return []  # (a call that failed meanwhile: its ERROR went out)
        reached = self.syncing.setdefault(key, set())
        reached.add(member.rank)
        ranks = [r for r, h in enumerate(co.hosts or ()) if h == host]
        if len(reached) < len(ranks):
            return []
        del self.syncing[key]
        return [(co.by_rank[r].peer, Message(Kind.SYNC, op=op, rank=r, root=sync, seq=seq,
                                             session=co.session))
                for r in ranks]

    def forget_syncs(self) -> None:
        """The group failed: no shared-memory call goes on."""
        self.shared_calls.clear()
        self.syncing.clear()
