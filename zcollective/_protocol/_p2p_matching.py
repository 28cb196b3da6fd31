"""Point-to-point matching and windows, the rules of one rank's mailbox
(:class:`Mailbox`): each pair's messages numbered and received in order, a
receive taking the earliest arrived that matches, and each sender's window at
this rank, credited back as the program receives. :mod:`._p2p` sends, ends
and fails calls over it. See docs/protocol.md, *Point to point*.
"""

from __future__ import annotations

import bisect
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .._limits import MAX_TAG

ANY_SOURCE = -1
ANY_TAG = -1
PROC_NULL = -2  # MPI's null rank: a send to it or a receive from it completes at once, doing nothing
SYNC = 1  # a SEND's op: synchronous (ssend), its receiver's CREDIT acknowledges it (see ack_of)
EXACT = 1  # a CREDIT's op: message ``seq`` alone was received (out of order), not every one up to it
CREDIT_SHARE = 4  # the receiver credits once this fraction of the window (1/4) was taken


@dataclass
class Status:
    """Where a received message came from: its ``source`` rank, its ``tag``
    and ``nbytes``, its size as it travelled."""

    source: int = ANY_SOURCE
    tag: int = ANY_TAG
    nbytes: int = 0


@dataclass
class Arrived:
    """A message taken in, not yet received by the program."""

    source: int
    tag: int
    seq: int
    nbytes: int
    message: Any  # what the driver decoded (its segments make the value)
    sync: bool = False  # its sender waits until a receive here takes it (ssend)


@dataclass(eq=False)
class Receive:
    """A receive the program posted (``handle``: what the driver resolves)."""

    source: int
    tag: int
    handle: Any
    matched: bool = False  # a matched probe's (mprobe): it takes the message, unpickled later
    decode: Optional[Callable[[list[Any], str], Any]] = None  # what makes its value (the caller's)

    def matches(self, source: int, tag: int) -> bool:
        return self.source in (ANY_SOURCE, source) and self.tag in (ANY_TAG, tag)


@dataclass
class Credit:
    """Tell ``to`` that this rank's program received its messages up to ``seq``."""

    to: int
    seq: int
    ack: int = 0  # :func:`ack_of` a synchronous message just received (0: none; negated: dropped by
    # teardown, never received), in the CREDIT's root
    exact: bool = False  # it says only that message ``seq`` was received (out of order), not those before


@dataclass
class _Peer:
    """What one rank knows of its exchanges with one other rank (or itself)."""

    window: int = 0  # the bytes it holds at most from this rank (its setting)
    next_out: int = 0  # the seq of the next message sent to it
    unreceived: deque[tuple[int, int, Any, int]] = field(default_factory=deque)  # uncredited:
    # (seq, nbytes, the send's handle, tag)
    held: int = 0  # their bytes
    asked: bool = False  # this rank waits for credit from it and asked for it
    next_in: int = 0  # the seq of the next message expected from it
    taken: int = -1  # its program received (or teardown dropped) every one of its messages up to this ...
    loose: list[int] = field(default_factory=list)  # ... and these after it (out of order; ranges, as
    # above's), each credited alone at once
    credited: int = -1  # the last it was told of (cumulative)
    taken_bytes: int = 0  # bytes received since then
    owed: bool = False  # it asked for credit: send it as soon as there is any
    last: Optional[int] = None  # it sends no more: how many it sent (FINAL); a later one is dropped
    below: int = 0  # its program received every one of its messages numbered below this ...
    above: list[int] = field(default_factory=list)  # ... and these above it (received out of order), as
    # ranges [a1, b1, a2, b2, ...]: from each a up to (not with) its b; as many as the holes, not the messages


def ack_of(seq: int) -> int:
    """The acknowledgement of a synchronous message number ``seq``, as a CREDIT's root carries it (an
    int32 above 0: numbers :data:`MAX_TAG` apart share one, never both awaited at once)."""
    return seq % MAX_TAG + 1


def was_received(received: list[int], seq: int) -> bool:
    """Is ``seq`` among ``received`` (as :meth:`Mailbox.received` says it)?"""
    if seq < received[0]:
        return True
    return any(received[i] <= seq < received[i + 1] for i in range(1, len(received) - 1, 2))


def count_received(received: list[int]) -> int:
    """How many messages ``received`` (as :meth:`Mailbox.received` says it) counts."""
    return received[0] + sum(received[i + 1] - received[i] for i in range(1, len(received) - 1, 2))


def _marked(below: int, above: list[int], seq: int) -> int:
    """``seq`` joins the numbers counted (every one below ``below``, and ``above``'s ranges: ``[a1, b1,
    ...]``, from each ``a`` up to, not with, its ``b``): the new ``below``."""
    i = bisect.bisect_right(above, seq)
    if seq < below or i % 2:  # (counted already)
        return below
    if i and above[i - 1] == seq:  # it ends the range before it ...
        above[i - 1] = seq + 1
        if i < len(above) and above[i] == seq + 1:  # ... and joins the next
            del above[i - 1:i + 1]
    elif i < len(above) and above[i] == seq + 1:  # it starts the next
        above[i] = seq
    else:
        above[i:i] = [seq, seq + 1]
    if above[0] == below:
        below = above[1]
        del above[:2]
    return below


class OutOfOrder(ValueError):
    """A message whose number is not the next of its pair: a replay, or altered."""


def _index(value: Any) -> Optional[int]:
    """``value`` as an int: any integer type (``numpy.int64``, anything with ``__index__``) but bool."""
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


def check_tag(tag: Any, receiving: bool) -> int:
    """A tag as an int: 0 to :data:`MAX_TAG`, or :data:`ANY_TAG` to receive."""
    if type(tag) is int and 0 <= tag <= MAX_TAG:  # (the usual case, without a call)
        return tag
    index = _index(tag)
    if index is not None and (0 <= index <= MAX_TAG or (receiving and index == ANY_TAG)):
        return index
    anything = " or ANY_TAG" if receiving else ""
    raise ValueError(f"tag={tag!r} is not an int from 0 to {MAX_TAG}{anything}")


def check_rank(rank: Any, size: int, what: str, any_source: bool = False, proc_null: bool = False) -> int:
    """A rank as an int: 0 to ``size - 1``, or :data:`ANY_SOURCE` / :data:`PROC_NULL` where allowed."""
    if type(rank) is int and 0 <= rank < size:  # (the usual case, without a call)
        return rank
    index = _index(rank)
    if index is not None and (0 <= index < size or (any_source and index == ANY_SOURCE)
                              or (proc_null and index == PROC_NULL)):
        return index
    anything = " or ANY_SOURCE" * any_source + " or PROC_NULL" * proc_null
    raise ValueError(f"{what}={rank!r} is not a rank of this group of {size} replicas{anything}")


class Mailbox:
    """One rank's point-to-point rules (see the module docstring)."""

    def __init__(self, rank: int, size: int, window: int, windows: Optional[list[int]] = None) -> None:
        """``window``: what this rank holds from each sender; ``windows``: each rank's (0: this one's)."""
        self.rank = rank
        self.window = window
        self.peers = [_Peer(window=(windows[r] if windows and windows[r] > 0 else window))
                      for r in range(size)]
        self.arrived: deque[Arrived] = deque()  # in arrival order
        self.posted: list[Receive] = []  # in posting order
        self.draining = False  # teardown: its program posts no more receives (see drain)

    # -- sending --------------------------------------------------------------

    def may_send(self, dest: int, nbytes: int) -> bool:
        peer = self.peers[dest]
        return peer.held == 0 or peer.held + nbytes <= peer.window

    def send(self, dest: int, nbytes: int, handle: Any = None, tag: int = 0) -> int:
        """A message of ``nbytes`` goes to ``dest`` (:meth:`may_send` said so): its seq (Mail.send does
        this inline, as may_send's test)."""
        peer = self.peers[dest]
        seq = peer.next_out
        peer.next_out += 1
        peer.unreceived.append((seq, nbytes, handle, tag))
        peer.held += nbytes
        return seq

    def ask(self, dest: int) -> bool:
        """This rank waits for credit from ``dest``: should it ask (once)?"""
        peer = self.peers[dest]
        if peer.asked:
            return False
        peer.asked = True
        return True

    def credited(self, source: int, seq: int, exact: bool = False) -> None:
        """``source`` received this rank's messages up to ``seq`` (``exact``: message ``seq`` alone)."""
        peer = self.peers[source]
        unreceived = peer.unreceived
        if exact:  # (received out of order: rare, so searched)
            for i, entry in enumerate(unreceived):
                if entry[0] == seq:
                    del unreceived[i]
                    peer.held -= entry[1]
                    break
        else:
            while unreceived and unreceived[0][0] <= seq:
                peer.held -= unreceived.popleft()[1]
        peer.asked = False

    # -- receiving ------------------------------------------------------------

    def arrive(self, source: int, tag: int, seq: int, nbytes: int, message: Any, sync: bool = False
               ) -> tuple[Optional[tuple[Receive, Arrived]], list[Credit]]:
        """A message came: the posted receive it completes (and the credit due), else it waits."""
        peer = self.peers[source]
        if seq != peer.next_in:
            raise OutOfOrder(f"message {seq} from rank {source}, where {peer.next_in} was next")
        peer.next_in += 1
        if peer.last is not None and seq >= peer.last:  # it ended counting this one lost: it stays lost
            raise OutOfOrder(f"message {seq} from rank {source}, which ended having sent {peer.last}")
        came = Arrived(source, tag, seq, nbytes, message, sync)
        for i, receive in enumerate(self.posted):
            if receive.source in (ANY_SOURCE, source) and receive.tag in (ANY_TAG, tag):  # (matches, inline)
                del self.posted[i]
                return (receive, came), self._taken(came)
        if self.draining:  # nothing can receive it any more: dropped, and credited as taken
            return None, self._taken(came, True)
        self.arrived.append(came)
        return None, []

    def post(self, receive: Receive) -> tuple[Optional[Arrived], list[Credit]]:
        """The earliest arrived message that matches (and the credit due), or None: posted."""
        for i, came in enumerate(self.arrived):
            if receive.source in (ANY_SOURCE, came.source) and receive.tag in (ANY_TAG, came.tag):  # (inline)
                del self.arrived[i]
                return came, self._taken(came)
        self.posted.append(receive)
        return None, []

    def match(self, source: int, tag: int) -> tuple[Optional[Arrived], list[Credit]]:
        """A matched probe that does not wait (improbe): the earliest arrived message that matches,
        taken out of matching (and the credit due), or None."""
        for i, came in enumerate(self.arrived):
            if source in (ANY_SOURCE, came.source) and tag in (ANY_TAG, came.tag):
                del self.arrived[i]
                return came, self._taken(came)
        return None, []

    def cancel(self, handle: Any) -> bool:
        """Take back the posted receive of ``handle``, not yet matched: was it posted?"""
        receive = next((r for r in self.posted if r.handle is handle), None)
        return receive is not None and self.withdraw(receive)

    def drain(self) -> list[Credit]:
        """Teardown: no more receives, so what no posted receive matches is dropped, as taken."""
        self.draining = True
        credits: list[Credit] = []
        while self.arrived:
            credits += self._taken(self.arrived.popleft(), True)
        return credits

    def withdraw(self, receive: Receive) -> bool:
        """Take back a posted receive (timed out, interrupted): was it still posted?"""
        for i, posted in enumerate(self.posted):
            if posted is receive:
                del self.posted[i]
                return True
        return False

    def probe(self, source: int, tag: int) -> Optional[Status]:
        """The earliest arrived message a receive for ``(source, tag)`` would take."""
        wanted = Receive(source, tag, None)
        for came in self.arrived:
            if wanted.matches(came.source, came.tag):
                return Status(came.source, came.tag, came.nbytes)
        return None

    def asked(self, source: int) -> list[Credit]:
        """``source`` waits for credit: now, if any is due, else at the next take."""
        peer = self.peers[source]
        if peer.taken > peer.credited:
            return [self._credit(source, peer)]
        peer.owed = True
        return []

    def _taken(self, came: Arrived, dropped: bool = False) -> list[Credit]:
        """``came`` is received (or matched, or ``dropped``): the credit due (at once for a synchronous
        one, which it acknowledges, negated if dropped: to this rank itself too, which sends nothing)."""
        peer, seq = self.peers[came.source], came.seq
        if seq == peer.taken + 1 and not peer.loose:  # (in order: the usual case, without a call)
            peer.taken = seq
        else:  # a later one first (another tag's), or the one that fills a hole
            peer.taken = _marked(peer.taken + 1, peer.loose, seq) - 1
        exact = peer.taken < seq  # beyond what the others' credit covers: credited alone, at once
        peer.taken_bytes += 0 if exact else came.nbytes
        if seq == peer.below and not peer.above and not dropped:  # (in order: the usual case, without
            peer.below += 1  # a call; one dropped is not received, and its FINAL does not count it)
        elif not dropped:  # received out of order (another tag's first)
            peer.below = _marked(peer.below, peer.above, seq)
        ack = (seq % MAX_TAG + 1) * (-1 if dropped else 1) if came.sync else 0  # (ack_of, inline)
        if came.source == self.rank:  # its own: credited at once, nothing travels
            self.credited(self.rank, seq if exact else peer.taken, exact)
            if not exact:
                peer.credited, peer.taken_bytes = peer.taken, 0
            return [Credit(self.rank, seq, ack)] if ack else []
        if exact:
            return [Credit(came.source, seq, ack, True)]
        if ack or peer.owed or peer.taken_bytes * CREDIT_SHARE >= self.window:
            return [self._credit(came.source, peer, ack)]
        return []

    def _credit(self, source: int, peer: _Peer, ack: int = 0) -> Credit:
        peer.credited, peer.taken_bytes, peer.owed = peer.taken, 0, False
        return Credit(source, peer.taken, ack)

    def ended(self, source: int, count: int) -> None:
        """``source`` sends no more, having sent this rank ``count`` messages."""
        self.peers[source].last = count

    def drained(self, source: int) -> bool:
        """Has ``source`` (``ANY_SOURCE``: every other rank) ended, all it sent taken in?"""
        if source != ANY_SOURCE:
            peer = self.peers[source]
            return source != self.rank and peer.last is not None and peer.next_in >= peer.last
        return all(self.drained(r) for r in range(len(self.peers)) if r != self.rank)

    def untake(self, came: Arrived) -> None:
        """A message received but not yet applied goes back, first to be received (its call was given
        up): no longer counted as received (a credit or acknowledgement sent for it stays said)."""
        self.arrived.appendleft(came)
        peer, seq = self.peers[came.source], came.seq
        above = peer.above
        if seq < peer.below:
            if seq + 1 < peer.below:
                above[:0] = [seq + 1, peer.below]
            peer.below = seq
            return
        i = bisect.bisect_right(above, seq)
        if i % 2:  # within the range [above[i - 1], above[i]): split around it
            start, stop = above[i - 1], above[i]
            above[i - 1:i + 1] = [start, seq] * (start < seq) + [seq + 1, stop] * (seq + 1 < stop)

    def received(self, source: int) -> list[int]:
        """Which of ``source``'s messages this rank's program received, as FINAL says it: ``[n, a1, b1,
        a2, b2, ...]``, every number below ``n`` and from each ``a`` up to (not with) its ``b``."""
        peer = self.peers[source]
        return [peer.below, *peer.above]

    def held_from(self, source: int) -> int:
        """Bytes of ``source``'s messages taken in and not yet received."""
        return sum(c.nbytes for c in self.arrived if c.source == source)
