"""Point-to-point messages, the rules without sockets: MPI's matching (a
pair's messages, numbered, in the order sent; ``ANY_SOURCE``/``ANY_TAG`` take
the earliest arrived; an arriving message goes to the earliest posted receive),
the ends of ranks that send no more (:class:`~zcollective.errors.PeerEndedError`,
not a loss), and each sender's window at a receiver, credited back as its
program receives. See docs/protocol.md, *Point to point*.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

from .._format import _serialize
from .._format._wire import Kind, Message, owned
from ..errors import CollectiveError, PeerEndedError, ReplicaLostError
from ._outcomes import CallOutcome, fresh
from ._p2p_matching import (  # (importable from here too)
    ANY_SOURCE,
    ANY_TAG,
    MAX_TAG,  # noqa: F401
    PROC_NULL,
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


def describe(call: str, source: int, tag: int) -> str:
    """A receive's or probe's name in messages: ``recv(source=ANY_SOURCE, tag=3)``."""
    name = {ANY_SOURCE: "ANY_SOURCE", PROC_NULL: "PROC_NULL"}.get(source, source)
    return (f"{call}(source={name}, "
            f"tag={'ANY_TAG' if tag == ANY_TAG else tag})")


def _described(call: str, receive: Receive) -> str:
    """A posted receive's name in messages (a matched probe's: mprobe)."""
    return describe("mprobe" if receive.matched else call, receive.source, receive.tag)


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


class Mail:
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
        self.syncing: dict[tuple[int, int], tuple[int, Any, int]] = {}  # synchronous sends on their
        # way, by (dest, ack_of(seq)): (seq, handle, tag); done when dest's CREDIT acknowledges it
        self.failure: Optional[BaseException] = None
        self.dropped = 0  # messages out of their pair's order (a replay, or malformed): dropped, counted
        self.gap: Optional[str] = None  # a message of a pair never came: later ones did
        self.ended_how: dict[int, str] = {}  # ranks that send no more: how each ended (FINAL)
        self.tearing: set[int] = set()  # ... of which those in teardown: they take in until it ends
        self.lost: dict[int, int] = {}  # how many of an ended rank's messages to this one never left it
        self.cut: list[tuple[int, list[Any]]] = []  # for the driver: ranks whose messages waiting for
        # their link never go, with the handles of sends on their way there, decided here
        self.tree: Optional[Callable[[Message], None]] = None  # where the tree's messages go (the member's)

    def send(self, dest: int, tag: int, segment: list[Any], handle: Any, sent: Any = None) -> None:
        """Send when the window allows (the handle is then done), in order. Given ``sent`` (done once
        the message left), synchronous: ``handle`` is done once ``dest``'s program received it (a
        CREDIT whose root is its :func:`ack_of`)."""
        if self.failure is not None:
            self.outcomes.append(CallOutcome(handle, fresh(self.failure)))
            return
        if dest in self.ended_how:
            self.outcomes.append(CallOutcome(handle, self._gone(f"send(dest={dest}, tag={tag})", dest)))
            return
        size = len(segment[0]) if len(segment) == 1 and type(segment[0]) is bytes else nbytes(segment)  # (a
        self.waiting[dest].append(_Sending(dest, tag, segment, size, handle, sent))  # small value's, inline)
        self._flush(dest)

    def _flush(self, dest: int) -> None:
        queue, box = self.waiting[dest], self.box
        peer = box.peers[dest]  # (may_send's test, inline: once per message)
        while queue and (peer.held == 0 or peer.held + queue[0].size <= peer.window):
            s = queue.popleft()
            seq = box.send(dest, s.size, s.handle, s.tag)
            if s.sent is not None:  # done once acknowledged (see ssend)
                self.syncing[(dest, seq % MAX_TAG + 1)] = (seq, s.handle, s.tag)  # (ack_of, inline)
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

    def receive(self, source: int, tag: int, handle: Any, matched: bool = False) -> None:
        """A receive: done with a message here that matches (after a failure too), else posted;
        ``matched`` (a matched probe, mprobe): done with the :class:`Arrived` it takes out of matching,
        not its value (it counts as received: credited, and acknowledged if synchronous)."""
        if self.failure is not None:
            for i, here in enumerate(self.box.arrived):
                if Receive(source, tag, None).matches(here.source, here.tag):
                    del self.box.arrived[i]
                    self._received(handle, here, matched)
                    return
            self.outcomes.append(CallOutcome(handle, fresh(self.failure)))
            return
        came, credits = self.box.post(Receive(source, tag, handle, matched))
        if came is not None:
            self._received(handle, came, matched)
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
            self._flush(self.rank)  # (its own credit: a send to itself that waited for it goes now)
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
                    return True
        for key, (_, waiting, _) in self.syncing.items():  # sent: it may still be received
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
            self.box.credited(source, msg.seq)
            if msg.root:  # it received (or its teardown dropped) a synchronous message of this rank's
                self._acked(source, msg.root)
            self._flush(source)
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
                self._received(done[0].handle, done[1], done[0].matched)
            if source in self.ended_how:  # perhaps its last: the receives left for it fail
                self._hopeless()
            if credits:
                self._credit(credits)

    def _received(self, handle: Any, came: Arrived, matched: bool = False) -> None:
        make = (partial(_serialize.loads, came.message.segments[0], f"message from rank {came.source}")
                if not matched else _value(came))
        status = Status(came.source, came.tag, came.nbytes)
        undo = partial(self.box.arrived.appendleft, came)
        self.outcomes.append(CallOutcome(handle, None, make, status, undo))
        if came.source == self.rank and self.waiting[self.rank]:  # its own credit: a send to itself
            self._flush(self.rank)  # that waited for the window goes now

    def _credit(self, credits: list[Credit]) -> None:
        for c in credits:
            if c.to == self.rank:  # (only an acknowledgement of a synchronous send to itself)
                self._acked(self.rank, c.ack)
            else:
                self.out.append((c.to, Message(Kind.CREDIT, 0, self.rank, c.ack, c.seq, self.session), None))

    def _acked(self, dest: int, ack: int) -> None:
        """``dest`` received the synchronous message whose :func:`ack_of` is ``ack``: its send is done
        (``-ack``: its teardown dropped it, never received: PeerEndedError)."""
        sending = self.syncing.pop((dest, abs(ack)), None)
        if sending is not None:
            error = None if ack > 0 else _dropped(self.rank, dest, sending[2])
            self.outcomes.append(CallOutcome(sending[1], error))

    def final(self, unsent: Optional[dict[int, list[Any]]] = None, leaving: Optional[dict[int, int]] = None
              ) -> tuple[list[int], list[int], list[int]]:
        """This rank sends no more: by rank, how many messages it sent, how many
        never left it (lost), and how many of that rank's it received. Sends
        waiting for credit fail, as do ``unsent`` (by rank: handles its link
        never took) and those from seq ``leaving[r]`` on (cut off)."""
        unsent, leaving = unsent or {}, leaving or {}
        why = "when this rank stopped sending (teardown, or its program ended): it was not sent"
        for dest, handles in unsent.items():
            for handle in handles:
                if handle is not None:
                    self.outcomes.append(CallOutcome(handle, RuntimeError(
                        f"rank {self.rank}: a send to rank {dest} waited for its link to rank {dest}'s "
                        f"mailbox {why}")))
        lost = [len(queue) for queue in self.waiting]
        for queue in self.waiting:
            while queue:
                s = queue.popleft()
                error = RuntimeError(f"rank {self.rank}: send(dest={s.dest}, tag={s.tag}) waited for "
                                     f"rank {s.dest}'s window {why}")
                self.outcomes.append(CallOutcome(s.handle, error))
        sent = []
        for dest, peer in enumerate(self.box.peers):
            numbered = peer.next_out - sum(h is not None for h in unsent.get(dest, ()))  # (a send's
            went = leaving.get(dest, numbered)  # handle is never None; a CREDIT's or the tree's is)
            for seq, _, handle, tag in peer.unreceived:
                if went <= seq and handle is not None and seq < numbered:
                    self.outcomes.append(CallOutcome(handle, RuntimeError(
                        f"rank {self.rank}: send(dest={dest}, tag={tag}) was still leaving, rank {dest} not "
                        f"taking it in (stopped?), when this rank's program ended and its wait for it ran "
                        f"out: it was cut off, and rank {dest} told so")))
            sent.append(went)
            lost[dest] += peer.next_out - went
        received = [peer.taken + 1 for peer in self.box.peers]
        return sent, lost, received

    def leaving(self, handles: set[int]) -> dict[int, int]:
        """By rank still running, the first seq of its sends whose handles' ids are ``handles``."""
        first = {}
        for dest, peer in enumerate(self.box.peers):
            if dest not in self.ended_how:
                seq = next((seq for seq, _, handle, _ in peer.unreceived if id(handle) in handles), None)
                if seq is not None:
                    first[dest] = seq
        return first

    def unsend(self, dest: int, handle: Any) -> bool:
        """Take back a send to ``dest`` that never left (it waits for its link): only
        the last numbered for ``dest``, so the pair's numbers stay whole."""
        peer = self.box.peers[dest]
        if not peer.unreceived or peer.unreceived[-1][2] is not handle:
            return False
        peer.held -= peer.unreceived.pop()[1]
        peer.next_out -= 1
        return True

    def ended(self, source: int, count: int, how: str, teardown: bool = False,
              received: Optional[int] = None, lost: int = 0) -> None:
        """Rank ``source`` sends no more (``how``: how it ended), having sent this
        rank ``count`` messages (``lost`` more never left it) and received
        ``received`` of its own: sends to it fail (on their way: unless received),
        as do receives only it could answer, once all it sent was taken in. A
        rank in ``teardown`` takes in until its group closes."""
        if source == self.rank:
            return
        if source in self.ended_how:  # said before: only an exit after a teardown that was
            if teardown or source not in self.tearing:  # interrupted says more (it takes in
                return  # nothing more: what waits for it is decided as for any exit)
            self.tearing.discard(source)
        self.box.ended(source, count)
        self.ended_how[source] = how
        if lost:
            self.lost[source] = lost
        if teardown:
            self.tearing.add(source)
            self._hopeless()
            return
        queue = self.waiting[source]
        while queue:
            s = queue.popleft()
            gone = self._gone(f"send(dest={source}, tag={s.tag})", source)
            self.outcomes.append(CallOutcome(s.handle, gone))
        peer, decided = self.box.peers[source], []
        for key in [key for key in self.syncing if key[0] == source]:  # synchronous: received, or never
            seq, handle, tag = self.syncing.pop(key)
            decided.append(handle)
            taken = received is not None and seq < received
            self.outcomes.append(CallOutcome(handle) if taken else CallOutcome(
                handle, self._gone(f"ssend(dest={source}, tag={tag})", source, (seq, received or 0))))
        if received is not None:  # (said by every release that says it)
            for seq, _, handle, tag in peer.unreceived:  # on their way: received, or never to be
                if handle is not None and not any(h is handle for h in decided):
                    decided.append(handle)
                    self.outcomes.append(CallOutcome(handle) if seq < received else CallOutcome(
                        handle, self._gone(f"send(dest={source}, tag={tag})", source, (seq, received))))
            peer.unreceived.clear()
            peer.held = 0
        self.cut.append((source, decided))
        self._hopeless()

    def closing(self) -> None:
        """This rank tears down: it posts no more receives (see :meth:`Mailbox.drain`)."""
        self._credit(self.box.drain())

    def gone(self) -> set[int]:
        """The ranks whose programs receive nothing more (ended without teardown)."""
        return self.ended_how.keys() - self.tearing

    def sending(self) -> bool:
        """Does a send of this rank's wait for its receiver's credit?"""
        return any(self.waiting)

    def unfinished(self) -> list[str]:
        """What this rank's teardown still waits for, in words."""
        peers, out = self.box.peers, []
        waiting = [str(dest) for dest, queue in enumerate(self.waiting) if queue]
        if waiting:
            out.append(f"sends waiting for the credit of ranks {','.join(waiting)}")
        running = [str(r) for r, peer in enumerate(peers) if r != self.rank and peer.last is None]
        if running:
            out.append(f"ranks {','.join(running)} had not called teardown (nor ended)")
        out += [f"{peer.last - peer.next_in} message(s) rank {r} sent this rank had not come"
                for r, peer in enumerate(peers) if peer.last is not None and peer.next_in < peer.last]
        return out

    def torn_down(self) -> None:
        """Teardown, all the others' messages taken in: a receive or probe still posted fails."""
        for call, waiting in (("recv", self.box.posted), ("probe", self.probes)):
            for receive in waiting:
                self.outcomes.append(CallOutcome(receive.handle, CollectiveError(
                    f"rank {self.rank}: {_described(call, receive)} cannot complete: "
                    f"this rank called teardown, so it sends itself nothing more, and no message "
                    f"here matches")))
            waiting.clear()

    def _hopeless(self) -> None:
        """Fail every posted receive and probe that no message can answer any more."""
        for call, waiting in (("recv", self.box.posted), ("probe", self.probes)):
            for receive in [r for r in waiting if self.box.drained(r.source)]:
                waiting.remove(receive)
                self.outcomes.append(CallOutcome(receive.handle, self._gone(
                    _described(call, receive), receive.source)))

    def _gone(self, what: str, rank: int, leaving: Optional[tuple[int, int]] = None
              ) -> PeerEndedError:
        """The error of a call that needs ``rank`` (``ANY_SOURCE``: any other), which
        ended; ``leaving``: a send on its way (its seq, how many that rank received)."""
        if rank == ANY_SOURCE:
            whys = "; ".join(self.ended_how[r] + _lost(self, r) for r in sorted(self.ended_how))
            error = PeerEndedError(f"rank {self.rank}: {what} cannot complete: no other rank can send "
                                   f"any more ({whys}), and no message here matches")
            error.ended_ranks = tuple(sorted(self.ended_how))
            return error
        how = self.ended_how[rank]
        if leaving is not None:
            seq, received = leaving
            error = PeerEndedError(f"rank {self.rank}: {what} cannot complete: {how}, having received "
                                   f"{received} of this rank's messages, not this one "
                                   f"(number {seq} to it): its program receives nothing more")
        elif what.startswith("send"):
            error = PeerEndedError(f"rank {self.rank}: {what} cannot go: {how}: its program receives "
                                   f"nothing more (nothing was sent)")
        else:
            count = self.box.peers[rank].last
            error = PeerEndedError(f"rank {self.rank}: {what} cannot complete: {how}, after sending "
                                   f"this rank {count} message(s), all taken in{_lost(self, rank)}; none "
                                   f"here matches")
        error.ended_ranks = (rank,)
        return error

    def link_broke(self, dest: Optional[int]) -> ReplicaLostError:
        """The group's failure when a mailbox link broke: to ``dest``, or one whose
        messages to this rank went missing (:attr:`gap`)."""
        if dest is not None:
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
        handles += [handle for _, handle, _ in self.syncing.values()]
        self.syncing.clear()
        self.box.posted.clear()
        self.probes.clear()
        for queue in self.waiting:
            queue.clear()
        self.outcomes.extend(CallOutcome(h, fresh(error)) for h in handles)


def _lost(mail: Mail, rank: int) -> str:
    """What an ended rank's FINAL said it lost of its messages to this rank."""
    lost = mail.lost.get(rank)
    if not lost:
        return ""
    last = mail.box.peers[rank].last or 0
    return (f"; {lost} more it meant for this rank never left it (from number {last} on: it ended "
            f"with them waiting for credit, its link, or this rank to take them in): lost")


def _dropped(rank: int, dest: int, tag: int) -> PeerEndedError:
    """The error of a synchronous send whose receiver's teardown dropped its message, unreceived."""
    error = PeerEndedError(f"rank {rank}: ssend(dest={dest}, tag={tag}) cannot complete: rank {dest} called "
                           f"teardown without receiving its message (teardown drops what no receive takes)")
    error.ended_ranks = (dest,)
    return error
