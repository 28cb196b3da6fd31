"""Point-to-point messages, the rules without sockets: MPI's matching (a
pair's messages, numbered, in the order sent; ``ANY_SOURCE``/``ANY_TAG`` take
the earliest arrived; an arriving message goes to the earliest posted receive),
the ends of ranks that send no more (:class:`~zcollective.errors.PeerEndedError`,
not a loss: :mod:`._p2p_endings`), and each sender's window at a receiver,
credited back as its program receives. The rules never unpickle: a receive's
value is made by the decode its caller gives. See docs/protocol.md, *Point to point*.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

from .._format._wire import Kind, Message, owned
from ..errors import ReplicaLostError
from ._outcomes import CallOutcome, fresh
from ._p2p_endings import MailEndings, describe, dropped  # noqa: F401 (describe: importable from here too)
from ._p2p_matching import (  # (importable from here too)
    ANY_SOURCE,  # noqa: F401
    ANY_TAG,  # noqa: F401
    EXACT,
    MAX_TAG,  # noqa: F401
    PROC_NULL,  # noqa: F401
    SYNC,
    Arrived,
    Credit,
    Mailbox,
    OutOfOrder,
    Receive,
    Status,
    check_rank,  # noqa: F401
    check_tag,  # noqa: F401
)


def _value(value: Any) -> Callable[[], Any]:
    return lambda: value


def nbytes(segment: list[Any]) -> int:
    """A segment's size as it travels."""
    if len(segment) == 1:  # (a small value's: as sent, or as it came, inline)
        kind = type(segment[0])
        if kind is bytes:
            return len(segment[0])
        if kind is memoryview:
            return segment[0].nbytes  # type: ignore[no-any-return]
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes for f in segment)


@dataclass(eq=False)
class _Sending:
    dest: int
    tag: int
    segment: list[Any]
    size: int
    handle: Any
    sent: Any = None  # a synchronous send's: the handle the driver resolves once its message is sent
    promised: Optional[int] = None  # the posted receive's tag it took of a rank in teardown (given back
    # if the send is taken back)


class Mail(MailEndings):
    """One rank's point-to-point exchanges: :class:`Mailbox`'s rules, the messages
    to send (:attr:`out`, for the driver) and what calls came to (``outcomes``)."""

    def __init__(self, rank: int, size: int, window: int, session: int, outcomes: deque[Any],
                 windows: Optional[list[int]] = None) -> None:
        self.rank, self.size, self.session = rank, size, session
        self.box = Mailbox(rank, size, window, windows)
        self.outcomes = outcomes
        self.out: list[tuple[int, Message, Any]] = []  # (to, message, the send's handle or None)
        self.waiting: list[deque[_Sending]] = [deque() for _ in range(size)]  # sends short of credit
        self.probes: list[Receive] = []
        self.syncing: dict[tuple[int, int], tuple[int, Any, int, Any]] = {}  # synchronous sends on their
        # way, by (dest, ack_of(seq)): (seq, handle, tag, its message's handle, done once sent); done when
        # dest's CREDIT acknowledges it
        self.failure: Optional[BaseException] = None
        self.dropped = 0  # messages out of their pair's order (a replay, or malformed): dropped, counted
        self.gap: Optional[str] = None  # a message of a pair never came: later ones did
        self.ended_how: dict[int, str] = {}  # ranks that send no more: how each ended (FINAL)
        self.tearing: set[int] = set()  # ... of which those in teardown: they take in until it ends
        self.open: dict[int, list[int]] = {}  # ... the tags its receives still posted wait for from here
        self.lost: dict[int, int] = {}  # how many of an ended rank's messages to this one never left it
        self.cut: list[tuple[int, list[Any]]] = []  # for the driver: ranks whose messages waiting for
        # their link never go, with the handles of sends on their way there, decided here
        self.tree: Optional[Callable[[Message], None]] = None  # where the tree's messages go (the member's)

    def send(self, dest: int, tag: int = 0, segment: Optional[list[Any]] = None, handle: Any = None,
             sent: Any = None) -> None:
        """Send ``segment`` when the window allows (the handle is then done), after what waits for it, in
        order; without one, what waits goes if the window now allows. Given ``sent`` (done once the message
        left), synchronous: ``handle`` is done once ``dest``'s program received it (a CREDIT whose root is
        its :func:`ack_of`)."""
        queue, box = self.waiting[dest], self.box
        if segment is not None:
            if self.failure is not None:
                self.outcomes.append(CallOutcome(handle, fresh(self.failure)))
                return
            promised = None
            if dest in self.ended_how:
                promised = self.still_takes(dest, tag)
                if promised is None:
                    call = f"{'send' if sent is None else 'ssend'}(dest={dest}, tag={tag})"
                    self.outcomes.append(CallOutcome(handle, self._gone(call, dest)))
                    return
            one = segment[0] if len(segment) == 1 else None  # (a small value's size, inline)
            size = len(one) if type(one) is bytes else nbytes(segment)
            queue.append(_Sending(dest, tag, segment, size, handle, sent, promised))
        peer = box.peers[dest]  # (may_send's test and Mailbox.send's numbering, inline: once per message)
        while queue and (peer.held == 0 or peer.held + queue[0].size <= peer.window):
            s = queue.popleft()
            seq, peer.next_out, peer.held = peer.next_out, peer.next_out + 1, peer.held + s.size
            peer.unreceived.append((seq, s.size, s.handle, s.tag))
            if s.sent is not None:  # done once acknowledged (see ssend)
                self.syncing[(dest, seq % MAX_TAG + 1)] = (seq, s.handle, s.tag, s.sent)  # (ack_of, inline)
            msg = Message(Kind.SEND, 0 if s.sent is None else SYNC, self.rank, s.tag, seq, self.session,
                          segments=[s.segment])
            if dest == self.rank:
                if s.sent is None:
                    self.outcomes.append(CallOutcome(s.handle))
                self.take(owned(msg))  # its own buffers, as a socket would give them
            else:  # done once sent (the driver says when its buffers are free again)
                self.out.append((dest, msg, s.handle if s.sent is None else s.sent))
        if queue and dest != self.rank and box.ask(dest):
            self.out.append((dest, Message(Kind.ASK, 0, self.rank, 0, 0, self.session), None))

    def receive(self, source: int, tag: int, handle: Any, matched: bool = False,
                decode: Optional[Callable[[list[Any], str], Any]] = None) -> None:
        """A receive: done with a message here that matches (after a failure too), else posted; its
        value is ``decode(frames, whose)``, the caller's (without: the :class:`Arrived` itself, as a
        matched probe's, mprobe's: it takes the message out of matching, and counts as received:
        credited, and acknowledged if synchronous)."""
        if self.failure is not None:
            for i, here in enumerate(self.box.arrived):
                if Receive(source, tag, None).matches(here.source, here.tag):
                    del self.box.arrived[i]
                    self._received(handle, here, decode)
                    return
            self.outcomes.append(CallOutcome(handle, fresh(self.failure)))
            return
        came, credits = self.box.post(Receive(source, tag, handle, matched, decode))
        if came is not None:
            self._received(handle, came, decode)
        elif self.ended_how:
            self._hopeless()
        if credits:
            self._credit(credits)

    def improbe(self, source: int, tag: int) -> Optional[Arrived]:
        """A matched probe that does not wait: the message taken out of matching, or None."""
        came, credits = self.box.match(source, tag)
        if credits:
            self._credit(credits)
        if came is not None and came.source == self.rank and self.waiting[self.rank]:
            self.send(self.rank)  # (its own credit: a send to itself that waited for it goes now)
        return came

    def probe(self, source: int, tag: int, handle: Any) -> None:
        """A blocking probe: done with the first matching message's :class:`Status`."""
        if self.failure is not None:
            self.outcomes.append(CallOutcome(handle, fresh(self.failure)))
            return
        status = self.box.probe(source, tag)
        if status is not None:
            self.outcomes.append(CallOutcome(handle, None, _value(status)))
        else:
            self.probes.append(Receive(source, tag, handle))
            if self.ended_how:
                self._hopeless()

    def waiting_for(self, handle: Any) -> Optional[int]:
        """The rank a send waiting for credit goes to (None: ``handle`` is no such send)."""
        for dest, queue in enumerate(self.waiting):
            if any(s.handle is handle for s in queue):
                return dest
        return None

    def withdraw(self, handle: Any) -> bool:
        """Take back a call not yet done: True if it waited (a message received, not yet
        applied, goes back first to be received)."""
        for outcome in self.outcomes:
            if outcome.future is handle and outcome.undo is not None:
                self.outcomes.remove(outcome)
                outcome.undo()
                return True
        for receive in [*self.box.posted, *self.probes]:
            if receive.handle is handle:
                if not self.box.withdraw(receive):
                    self.probes.remove(receive)
                return True
        for queue in self.waiting:
            for s in queue:
                if s.handle is handle:
                    queue.remove(s)
                    if s.promised is not None and self.open.get(s.dest) is not None:
                        self.open[s.dest].insert(0, s.promised)  # (its receive waits for the next)
                    return True
        for key, (_, waiting, _, _) in self.syncing.items():  # sent: it may still be received
            if waiting is handle:
                del self.syncing[key]
                return True
        return False

    def take(self, msg: Message) -> None:
        """A message from a mailbox (after a failure, still a SEND, to be received)."""
        if msg.session != self.session or not 0 <= msg.rank < self.size:
            return  # (an earlier group's, on a reused port)
        if self.failure is not None and msg.kind is not Kind.SEND:
            return
        if msg.kind is Kind.UP or msg.kind is Kind.RESULT:
            if self.tree is not None:
                self.tree(msg)
            return
        source = msg.rank
        if msg.kind is Kind.CREDIT:
            self.box.credited(source, msg.seq, msg.op == EXACT)
            if msg.root:  # it received (or its teardown dropped) a synchronous message of this rank's
                self._acked(source, msg.root)
            self.send(source)
        elif msg.kind is Kind.ASK:
            self._credit(self.box.asked(source))
        elif msg.kind is Kind.SEND and len(msg.segments) == 1:
            try:
                segment = msg.segments[0]
                first = segment[0] if len(segment) == 1 else None  # (a small value's size, inline)
                size = (first.nbytes if type(first) is memoryview else len(first) if type(first) is bytes
                        else nbytes(segment))
                done, credits = self.box.arrive(source, msg.root, msg.seq, size, msg, msg.op == SYNC)
            except OutOfOrder as exc:
                if msg.seq > self.box.peers[source].next_in and self.gap is None:  # (below: a replay)
                    self.gap = f"messages from rank {source} went missing: {exc}"
                self.dropped += 1
                return
            if self.probes:
                for probe in [p for p in self.probes if p.matches(source, msg.root)]:
                    self.probes.remove(probe)
                    status = Status(source, msg.root, size)
                    self.outcomes.append(CallOutcome(probe.handle, None, _value(status)))
            if done is not None:
                self._received(done[0].handle, done[1], done[0].decode)
            if source in self.ended_how:  # perhaps its last: the receives left for it fail
                self._hopeless()
            if credits:
                self._credit(credits)

    def _received(self, handle: Any, came: Arrived, decode: Optional[Callable[[list[Any], str], Any]]
                  ) -> None:
        make = (partial(decode, came.message.segments[0], f"message from rank {came.source}")  # (the
                if decode is not None else _value(came))  # frames handed over: the caller unpickles)
        status = Status(came.source, came.tag, came.nbytes)
        undo = partial(self.box.untake, came)
        self.outcomes.append(CallOutcome(handle, None, make, status, undo))
        if came.source == self.rank and self.waiting[self.rank]:  # its own credit: a send to itself
            self.send(self.rank)  # that waited for the window goes now

    def _credit(self, credits: list[Credit]) -> None:
        for c in credits:
            if c.to == self.rank:  # (only an acknowledgement of a synchronous send to itself)
                self._acked(self.rank, c.ack)
            else:
                op = EXACT if c.exact else 0
                self.out.append((c.to, Message(Kind.CREDIT, op, self.rank, c.ack, c.seq, self.session), None))

    def _acked(self, dest: int, ack: int) -> None:
        """``dest`` received the synchronous message whose :func:`ack_of` is ``ack``: its send is done
        (``-ack``: its teardown dropped it, never received: PeerEndedError)."""
        sending = self.syncing.pop((dest, abs(ack)), None)
        if sending is not None:
            error = None if ack > 0 else dropped(self.rank, dest, sending[2])
            self.outcomes.append(CallOutcome(sending[1], error))

    def closing(self) -> None:
        """This rank tears down: it posts no more receives (see :meth:`Mailbox.drain`)."""
        self._credit(self.box.drain())

    def sending(self) -> bool:
        """Does a send of this rank's wait for its receiver's credit?"""
        return any(self.waiting)

    def link_broke(self, dest: Optional[int], local: bool = False) -> ReplicaLostError:
        """The group's failure when a mailbox link broke: to ``dest`` (``local``: a one-host link, which
        ``dest`` closed for cause), or one whose messages to this rank went missing (:attr:`gap`)."""
        if dest is not None and local:
            why = (f"rank {self.rank}: its one-host link to rank {dest} broke: rank {dest} closed it for "
                   f"cause (its log says why: a frame above its max_frame_bytes?): messages on it are lost, "
                   f"so the group fails")
        elif dest is not None:
            why = (f"rank {self.rank}: its mailbox link to rank {dest} broke and could not be made again "
                   f"(a reset connection?): messages on it may be lost, so the group fails")
        else:
            why = (f"rank {self.rank}: {self.gap}: a mailbox link broke (a reset connection?), so the "
                   f"group fails")
        self.gap = None
        error = ReplicaLostError(why)
        error.lost_rank = dest  # type: ignore[attr-defined]
        return error

    def fail(self, error: BaseException) -> None:
        """The group failed: every receive, probe and send waiting gets ``error``."""
        if self.failure is not None:
            return
        self.failure = error
        self.cut = [(r, []) for r in range(self.size)]  # (sends waiting for their link never go)
        handles = [r.handle for r in (*self.box.posted, *self.probes)]
        handles += [s.handle for queue in self.waiting for s in queue]
        handles += [handle for _, handle, _, _ in self.syncing.values()]
        self.syncing.clear()
        self.box.posted.clear()
        self.probes.clear()
        for queue in self.waiting:
            queue.clear()
        self.outcomes.extend(CallOutcome(h, fresh(error)) for h in handles)
