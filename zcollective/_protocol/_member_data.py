"""A member's calls whose data moves off the control plane: their jobs' queue, a lost data link (rule 9)
and the TAKEN a BYE waits for (rule 7). A part of :class:`~._member.Member`."""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

from .._format import _bodies
from .._format._wire import Kind, Message, WireError
from .._limits import DATA_LOSS_GRACE_S
from ..errors import ProtocolError
from ._ops import Op
from ._outcomes import CallOutcome


class DataMoves:
    """The member's data jobs (:attr:`~._member.Member.transfers`), a data link lost, a TAKEN to answer."""

    def __init__(self, member: Any) -> None:
        self.member = member  # its Member (a part reads and sets the member's state; typed Any: no circle)
        self.loss: Optional[tuple[Exception, float]] = None  # a link lost; rank 0 may say why till (rule 9)
        self.asked: Optional[int] = None  # the seq of a TAKEN to answer once its data is in (rule 7)

    def due(self) -> Optional[float]:
        """When :meth:`on_timer` has something to do (once failed, at once: that FAIL said why)."""
        if self.loss is None:
            return None
        return self.loss[1] if self.member.failure is None else self.member.failed_at

    def on_timer(self, now: float) -> list[Message]:
        loss = self.loss
        if loss is not None and (self.member.failure is not None or now >= loss[1]):
            self.loss = None
            return self.failure(loss[0])
        return []

    def lost(self, error: Exception) -> list[Message]:
        """The data plane failed here (rule 9); what to send now (more from :meth:`on_timer`)."""
        m = self.member
        if getattr(error, "lost_rank", None) is not None and m.failure is None and self.loss is None:
            self.loss = (error, m.clock() + DATA_LOSS_GRACE_S)
            return []
        return self.failure(error)

    def failure(self, error: Exception) -> list[Message]:
        m = self.member
        lost, seq = getattr(error, "lost_rank", None), getattr(error, "seq", None)
        if m.failure is not None:  # a call kept by the failure (see fail) broke
            if m.transfers:
                self.failed(m.transfers[0][0], error)
            return []
        if seq is not None:  # only this call failed (the reduce function raised here)
            self.failed(seq, error)
        else:
            m.fail(error)
        if not m.joined:
            return []
        return [_bodies.abort(error, True, lost, rank=m.rank, session=m.session,
                              seq=seq or 0, op=Op.ALLREDUCE)]  # (only an allreduce has a seq here)

    def failed(self, seq: int, error: Exception) -> None:
        """Call ``seq``'s data move failed here (not the group): its job stops, its future gets ``error``."""
        m = self.member
        m.transfers = deque((s, j) for s, j in m.transfers if s != seq)
        m.owed.extend(self.taken())
        call = m.calls.pop(seq, None)
        if call is not None and call.future is not None:
            m.outcomes.append(CallOutcome(call.future, error))

    def done(self) -> None:
        """The first queued job moved all its data: its call's value is ready (the job's ``finish``)."""
        m = self.member
        seq, job = m.transfers.popleft()
        call = m.calls.pop(seq, None)
        if call is not None and call.future is not None:
            m.record(seq, call, job.received_bytes, "done")
            m.outcomes.append(CallOutcome(call.future, make=job.finish))
        m.owed.extend(self.taken())

    def start(self, msg: Message, call: Any) -> None:
        """A call whose data travels off the star was matched: its job joins the queue, once."""
        m = self.member
        if call.transfer is None or any(seq == msg.seq for seq, _ in m.transfers):
            return
        try:
            job = call.transfer(msg)
        except (WireError, ValueError, KeyError, TypeError) as exc:
            m.fail(ProtocolError(f"seq {msg.seq} {call.op}: rank {m.rank} got a data plan "
                                 f"it cannot follow from the coordinator: {exc}"), tell=True)
            return
        m.transfers.append((msg.seq, job))

    def drop(self, seq: int) -> None:
        """Call ``seq``'s data move stops where it is (its call failed)."""
        m = self.member
        if m.transfers:
            m.transfers = deque((s, j) for s, j in m.transfers if s != seq)

    def taken(self) -> list[Message]:
        """The answer to a TAKEN once no data job through its seq is left here (rule 7); none until then."""
        asked, m = self.asked, self.member
        if asked is None or any(seq <= asked for seq, _ in m.transfers):
            return []
        self.asked = None
        return [Message(Kind.TAKEN, rank=m.rank, seq=asked, session=m.session)]

    def moving(self, seq: int) -> bool:
        """Does call ``seq``'s data move here now (an interrupt lets it finish first)?"""
        return any(s == seq for s, _ in self.member.transfers)

    def job(self, seq: int) -> Any:
        """Call ``seq``'s data job, if it is queued."""
        return next((j for s, j in self.member.transfers if s == seq), None)
