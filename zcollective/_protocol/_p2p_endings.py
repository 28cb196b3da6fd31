"""Point-to-point endings, the rules without sockets: what this rank's FINAL says (how many it sent each
rank, how many never left it, and exactly which of each rank's messages its program received), and what
another rank's FINAL decides here (sends on their way to it: received, or never to be; receives only it
could answer). :class:`MailEndings` is :class:`~._p2p.Mail`'s part for them. See docs/protocol.md, rule 12.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional, Union

from ..errors import CollectiveError, PeerEndedError
from ._outcomes import CallOutcome
from ._p2p_matching import (
    ANY_SOURCE,
    ANY_TAG,
    PROC_NULL,
    Mailbox,
    Receive,
    ack_of,
    count_received,
    was_received,
)


def describe(call: str, source: int, tag: int) -> str:
    """A receive's or probe's name in messages: ``recv(source=ANY_SOURCE, tag=3)``."""
    name = {ANY_SOURCE: "ANY_SOURCE", PROC_NULL: "PROC_NULL"}.get(source, source)
    return (f"{call}(source={name}, "
            f"tag={'ANY_TAG' if tag == ANY_TAG else tag})")


def described(call: str, receive: Receive) -> str:
    """A posted receive's name in messages (a matched probe's: mprobe)."""
    return describe("mprobe" if receive.matched else call, receive.source, receive.tag)


class MailEndings:
    """The endings of one rank's :class:`~._p2p.Mail` (its attributes, declared here)."""

    rank: int
    size: int
    box: Mailbox
    outcomes: deque[Any]
    waiting: list[deque[Any]]  # (of _p2p's sends waiting for credit)
    probes: list[Receive]
    syncing: dict[tuple[int, int], tuple[int, Any, int, Any]]
    ended_how: dict[int, str]
    tearing: set[int]
    open: dict[int, list[int]]
    lost: dict[int, int]
    cut: list[tuple[int, list[Any]]]

    def final(self, unsent: Optional[dict[int, list[Any]]] = None, leaving: Optional[dict[int, int]] = None
              ) -> tuple[list[int], list[int], list[Union[int, list[int]]]]:
        """This rank sends no more: by rank, how many messages it sent, how many
        never left it (lost), and which of that rank's its program received
        (:meth:`Mailbox.received`, an int n when that is all below n: out of
        order too, one tag's before another's). Sends
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
        received = [self.box.received(r) for r in range(self.size)]
        return sent, lost, [r[0] if len(r) == 1 else r for r in received]

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
        """Take back a send (or ssend) to ``dest`` that never left (it waits for its link):
        only the last numbered for ``dest``, so the pair's numbers stay whole."""
        peer = self.box.peers[dest]
        if not peer.unreceived or peer.unreceived[-1][2] is not handle:
            return False
        seq, size, _, _ = peer.unreceived.pop()
        peer.held -= size
        peer.next_out -= 1
        self.syncing.pop((dest, ack_of(seq)), None)
        return True

    def sent_as(self, handle: Any) -> Any:
        """The handle the driver holds the send ``handle``'s message under (an ssend's is done once sent,
        the ssend itself once received)."""
        return next((sent for _, h, _, sent in self.syncing.values() if h is handle), handle)

    def open_to(self) -> list[Optional[list[int]]]:
        """By rank, the tags (``ANY_TAG``: any) of the receives still posted here
        that its messages could match, in posting order: what its sends to this
        rank in teardown still go for (:meth:`still_takes`)."""
        return [[r.tag for r in self.box.posted if r.source in (ANY_SOURCE, source)]
                if source != self.rank else [] for source in range(self.size)]

    def still_takes(self, dest: int, tag: int) -> Optional[int]:
        """May a send tagged ``tag`` go to ``dest``, which ended? Only if it is in
        teardown with a receive still posted that matches it, taken for it
        here (its FINAL did not say them: any goes, and is dropped if none):
        the tag of the receive it took (None: it may not go)."""
        if dest not in self.tearing:
            return None
        tags = self.open.get(dest)
        return tag if tags is None else _taken_by(tags, tag)

    def ended(self, source: int, count: int, how: str, teardown: bool = False,
              received: Union[None, int, list[int]] = None, lost: int = 0,
              posted: Optional[list[int]] = None) -> None:
        """Rank ``source`` sends no more (``how``: how it ended), having sent this
        rank ``count`` messages (``lost`` more never left it) and received
        ``received`` of its own (:meth:`Mailbox.received`; an int ``n``: those
        numbered below ``n``): sends to it fail (on their way: unless received),
        as do receives only it could answer, once all it sent was taken in. A
        rank in ``teardown`` takes in until its group closes, and receives
        what its receives still ``posted`` (their tags) match: a send that one
        of them waits for, and none past them, still goes."""
        if source == self.rank:
            return
        if isinstance(received, int):
            received = [received]
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
            if posted is not None:  # the messages on their way, and waiting for credit, come first
                tags = list(posted)
                for seq, _, handle, tag in self.box.peers[source].unreceived:
                    if handle is not None and (received is None or not was_received(received, seq)):
                        _taken_by(tags, tag)
                for s in self.waiting[source]:
                    s.promised = _taken_by(tags, s.tag)
                self.open[source] = tags
            self._hopeless()
            return
        queue = self.waiting[source]
        while queue:
            s = queue.popleft()
            gone = self._gone(f"{'send' if s.sent is None else 'ssend'}(dest={source}, tag={s.tag})", source)
            self.outcomes.append(CallOutcome(s.handle, gone))
        peer, decided = self.box.peers[source], []
        for key in [key for key in self.syncing if key[0] == source]:  # synchronous: received, or never
            seq, handle, tag, _ = self.syncing.pop(key)
            decided.append(handle)
            taken = received is not None and was_received(received, seq)
            self.outcomes.append(CallOutcome(handle) if taken else CallOutcome(
                handle, self._gone(f"ssend(dest={source}, tag={tag})", source, (seq, received or [0]))))
        if received is not None:  # (said by every release that says it)
            for seq, _, handle, tag in peer.unreceived:  # on their way: received, or never to be
                if handle is not None and not any(h is handle for h in decided):
                    decided.append(handle)
                    self.outcomes.append(CallOutcome(handle) if was_received(received, seq) else CallOutcome(
                        handle, self._gone(f"send(dest={source}, tag={tag})", source, (seq, received))))
            peer.unreceived.clear()
            peer.held = 0
        self.cut.append((source, decided))
        self._hopeless()

    def gone(self) -> set[int]:
        """The ranks whose programs receive nothing more (ended without teardown)."""
        return self.ended_how.keys() - self.tearing

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
                    f"rank {self.rank}: {described(call, receive)} cannot complete: "
                    f"this rank called teardown, so it sends itself nothing more, and no message "
                    f"here matches")))
            waiting.clear()

    def _hopeless(self) -> None:
        """Fail every posted receive and probe that no message can answer any more."""
        for call, waiting in (("recv", self.box.posted), ("probe", self.probes)):
            for receive in [r for r in waiting if self.box.drained(r.source)]:
                waiting.remove(receive)
                self.outcomes.append(CallOutcome(receive.handle, self._gone(
                    described(call, receive), receive.source)))

    def _gone(self, what: str, rank: int, leaving: Optional[tuple[int, list[int]]] = None
              ) -> PeerEndedError:
        """The error of a call that needs ``rank`` (``ANY_SOURCE``: any other), which
        ended; ``leaving``: a send on its way (its seq, how many that rank received)."""
        if rank == ANY_SOURCE:
            whys = "; ".join(self.ended_how[r] + lost_words(self, r) for r in sorted(self.ended_how))
            error = PeerEndedError(f"rank {self.rank}: {what} cannot complete: no other rank can send "
                                   f"any more ({whys}), and no message here matches")
            error.ended_ranks = tuple(sorted(self.ended_how))
            return error
        how = self.ended_how[rank]
        if leaving is not None:
            seq, received = leaving
            error = PeerEndedError(f"rank {self.rank}: {what} cannot complete: {how}, having received "
                                   f"{count_received(received)} of this rank's messages, not this one "
                                   f"(number {seq} to it): its program receives nothing more")
        elif what.startswith(("send", "ssend")):
            error = PeerEndedError(f"rank {self.rank}: {what} cannot go: {how}: its program receives "
                                   f"nothing more (nothing was sent)")
        else:
            count = self.box.peers[rank].last
            error = PeerEndedError(f"rank {self.rank}: {what} cannot complete: {how}, after sending "
                                   f"this rank {count} message(s), all taken in{lost_words(self, rank)}; "
                                   f"none here matches")
        error.ended_ranks = (rank,)
        return error


def _taken_by(tags: list[int], tag: int) -> Optional[int]:
    """Take the first of a rank's posted receives' ``tags`` that a message tagged ``tag`` matches (returned;
    None: none)."""
    for i, posted in enumerate(tags):
        if posted in (tag, ANY_TAG):
            del tags[i]
            return posted
    return None


def lost_words(mail: MailEndings, rank: int) -> str:
    """What an ended rank's FINAL said it lost of its messages to this rank."""
    lost = mail.lost.get(rank)
    if not lost:
        return ""
    last = mail.box.peers[rank].last or 0
    return (f"; {lost} more it meant for this rank never left it (from number {last} on: it ended "
            f"with them waiting for credit, its link, or this rank to take them in): lost")

def dropped(rank: int, dest: int, tag: int) -> PeerEndedError:
    """The error of a synchronous send whose receiver's teardown dropped its message, unreceived."""
    error = PeerEndedError(f"rank {rank}: ssend(dest={dest}, tag={tag}) cannot complete: rank {dest} called "
                           f"teardown without receiving its message (teardown drops what no receive takes)")
    error.ended_ranks = (dest,)
    return error
