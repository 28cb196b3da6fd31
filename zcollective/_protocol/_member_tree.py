"""A member's place in the tree (rule 11 of the member): its parent, its relay, a FAIL held until the
results it says completed came down. A part of :class:`~._member.Member`."""

from __future__ import annotations

from typing import Any, Optional

from .._format import _bodies
from .._format._wire import Kind, Message
from . import _tree
from ._ops import Combine


class TreeRole:
    """What the tree means to one member (see the module docstring)."""

    def __init__(self, member: Any) -> None:
        self.member = member  # its Member (a part reads and sets the member's state; typed Any: no circle)

    def plant(self, fanout: int) -> None:
        """The WELCOME says small calls climb a tree: this rank's place in it."""
        m = self.member
        tree = _tree.shape(m.size, fanout)
        if m.rank == 0:
            return
        m.parent = tree.parent[m.rank]
        m.tree_due = self.due
        if tree.children[m.rank]:
            m.relay = _tree.Relay(m.rank, m.size, fanout, m.user_code, m.clock)
        assert m.mail is not None
        m.mail.tree = self.climbed

    def climb(self, msg: Message) -> list[tuple[int, Message]]:
        """This rank's contribution on its way up: (rank, message) to send (rank 0: the coordinator)."""
        m = self.member
        relay = m.relay
        if relay is None:
            return [(m.parent, msg if m.parent == 0 else _tree.up(msg))]
        call = m.calls.get(msg.seq)
        out = relay.own(msg, call.reduce if call is not None else None)
        return [(m.parent, a) for a in self.in_order(out)]

    def climbed(self, msg: Message) -> None:
        """A child's UP or the parent's RESULT; what it makes this rank send joins the mailbox's (or owed)."""
        m = self.member
        if m.failure is not None:
            return
        if msg.kind is Kind.UP and m.relay is not None:
            self.send_up(m.relay.take(msg))
        elif msg.kind is Kind.RESULT and msg.rank == m.rank and _tree.goes_down(msg.op, msg.flags):
            m.deliver(msg)

    def timer(self, now: float) -> None:
        """Parts held past :data:`~._tree.RELAY_FLUSH_S` go up; a held FAIL past its time fails the group."""
        m = self.member
        if m.relay is not None and m.failure is None:
            self.send_up(m.relay.on_timer(now))
        if m.deferred is not None and now >= m.deferred[3]:
            self.undefer()

    def due(self) -> Optional[float]:
        """When :meth:`timer` has something to do, if ever."""
        m = self.member
        due = m.relay.next_due() if m.relay is not None else None
        held = m.deferred[3] if m.deferred is not None else None
        return due if held is None else held if due is None else min(due, held)

    def defer(self, msg: Message) -> bool:
        """A FAIL whose completed calls' results may still come down: held until they came (True)."""
        complete = _bodies.complete_of(msg)
        if not self.awaits(complete):
            return False
        error, ended = _bodies.parse_error(msg)
        m = self.member
        m.deferred = (error, ended, complete, m.clock() + _tree.TREE_GRACE_S)
        return True

    def awaits(self, below: Optional[int] = None) -> bool:
        """Does a call before seq ``below`` wait for a result down the tree (not a data plan's)?"""
        m = self.member
        moving = {seq for seq, _ in m.transfers}
        return any((below is None or seq < below) and call.op in _tree.DOWN_LABELS and not call.described
                   and seq not in moving for seq, call in m.calls.items())

    def settled(self, call_op: str, error: Any) -> None:
        """A call left the table: a held FAIL takes effect once nothing it waited for is left."""
        m = self.member
        if m.deferred is None:
            return
        if call_op == "teardown" and error is None:
            m.deferred = None
        elif not self.awaits(m.deferred[2]):
            self.undefer()

    def undefer(self) -> None:
        """The held FAIL takes effect now."""
        m = self.member
        if m.deferred is not None:
            (error, ended, _, _), m.deferred = m.deferred, None
            m.owed.extend([*m.fail(error, keep_data=ended), *m.moves.taken()])

    def in_order(self, out: list[Any]) -> list[Message]:
        """What may go up now of ``out``: what comes before the first reduction asked for, if none
        waits. A reduction waits for the driver, and everything after it waits in line behind it
        (:attr:`Member.asks`), so that the parent takes each child's parts in seq order."""
        asks = self.member.asks
        if not asks:
            for i, a in enumerate(out):
                if type(a) is Combine:
                    asks.extend(out[i:])
                    return out[:i]
            return out
        asks.extend(out)
        return []

    def send_up(self, msgs: list[Any]) -> None:
        """What this interior rank sends its parent, in order (see :meth:`in_order`)."""
        self.send_now(self.in_order(msgs))

    def send_now(self, msgs: list[Message]) -> None:
        """Send ``msgs`` to the parent now (they are next in line)."""
        m = self.member
        if m.parent == 0:
            m.owed.extend(msgs)
        elif m.mail is not None:
            m.mail.out.extend((m.parent, a, None) for a in msgs)
