"""A coordinator and its members joined by an in-memory link: no sockets, no
processes, no threads (h11's ConnectionPair, for this protocol).

Every message travels as real frames, encoded by its sender (with its
sender's secret) and decoded by its receiver, in the order it was sent. A
test drives the members as a driver would (join, call, connection events)
and reads what a user would see: a future's outcome, a member's failure.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Any, Optional

import zcollective._format._wire
import zcollective._protocol._member
import zcollective._protocol._member_join
from zcollective._format import _serialize
from zcollective._format._wire import DEFAULT_MAX_FRAMES, Message, Signer, encode
from zcollective._future import CollectiveFuture, settle
from zcollective._io._combine import applied
from zcollective._protocol._coordinator import Coordinator
from zcollective._protocol._member import ConnectionEvent, Member
from zcollective._protocol._ops import Op

SESSION = 0x5E55_10
ENDPOINT = "tcp://10.0.0.1:29500"
LIST_OPS = (Op.ALLGATHER, Op.GATHER, Op.ALLTOALL)
NOTHING = object()  # a call that sends no value (barrier; scatter and broadcast off the root)


class FakeClock:
    """A clock a test moves by hand (the coordinator's and member's ``clock``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def peer(rank: int) -> bytes:
    return b"R%d" % rank


def address(rank: int) -> str:
    return f"10.0.0.{10 + rank}:5{rank:04d}"


def finish(op: Op):
    """The finisher a group gives a call of ``op``: its value from a RESULT."""
    def value(msg: Message) -> Any:
        if op in LIST_OPS:
            return [_serialize.loads(s) for s in msg.segments] if msg.segments else None
        return _serialize.loads(msg.segments[0]) if msg.segments else None
    return value


class Pair:
    """``n`` members and one coordinator.

    ``secret`` is the coordinator's; ``secrets`` maps a rank to its member's
    secret (by default the coordinator's). ``installs`` maps a rank to the
    module attributes its side runs with, as if another zcollective or Python
    were installed there (``{"PROTOCOL_VERSION": 99}``). Nothing moves until
    a test sends something; then every message sent in reply is delivered
    too, in order, until nothing is left in flight.
    """

    def __init__(self, n: int, secret: Optional[bytes] = None,
                 secrets: Optional[dict[int, Optional[bytes]]] = None,
                 installs: Optional[dict[int, dict[str, Any]]] = None) -> None:
        self.n = n
        self.coordinator = Coordinator(n, SESSION, DEFAULT_MAX_FRAMES, _signer(secret))
        secrets = secrets or {}
        self.members = [Member(r, n, ENDPOINT, _signer(secrets.get(r, secret))) for r in range(n)]
        self.installs = installs or {}
        self.in_flight: deque[tuple[str, int, list[Any]]] = deque()  # (to, rank, frames)
        self.delivered: list[tuple[str, int, Message]] = []  # ("up" | "down", rank, message)
        self.lost: set[tuple[int, Any]] = set()  # (rank, Kind): such messages to rank are lost
        self.held: dict[tuple[int, Any], list[list[Any]]] = {}  # (rank, Kind) -> frames held back

    # -- moving messages ------------------------------------------------------

    def send(self, rank: int, *msgs: Message) -> None:
        """``rank``'s member sends ``msgs`` (and what it owes); deliver everything."""
        self._queue_up(rank, list(msgs))
        self.settle()

    def post(self, rank: int, msg: Message) -> None:
        """``rank`` sends ``msg`` alone (nothing it owes leaves with it)."""
        with self.installed(rank):
            self._record("up", rank, msg, self.members[rank].signer)
        self.settle()

    def hold(self, rank: int, kind: Any) -> None:
        """Hold back messages of ``kind`` to ``rank`` until :meth:`release`."""
        self.held[(rank, kind)] = []

    def release(self, rank: int, kind: Any) -> list[list[Any]]:
        """Deliver what was held back (in order); return its frames."""
        frames = self.held.pop((rank, kind))
        self.in_flight.extend(("member", rank, f) for f in frames)
        self.settle()
        return frames

    def flush(self, rank: int) -> None:
        """Send what ``rank`` owes, as its driver does after each call."""
        self.send(rank)

    def settle(self) -> None:
        """Deliver everything in flight; then, as a group's call runner does,
        apply what each member said its calls came to."""
        while self.in_flight:
            to, rank, frames = self.in_flight.popleft()
            if to == "coordinator":
                step = self.coordinator.receive(peer(rank), frames, address(rank))
                for out_peer, out in applied(step, self.coordinator):  # a reduction runs as a driver runs it
                    self._queue_down(_rank_of(out_peer), out)
            else:
                with self.installed(rank):
                    replies = self.members[rank].receive(frames)
                self._queue_up(rank, replies)
        for member in self.members:
            settle(member.outcomes)

    def _queue_up(self, rank: int, msgs: list[Message]) -> None:
        member = self.members[rank]
        with self.installed(rank):
            while member.owed:  # rule 4: it leaves the queue once sent whole
                self._record("up", rank, member.owed[0], member.signer)
                member.owed.popleft()
            for msg in msgs:
                self._record("up", rank, msg, member.signer)

    def _queue_down(self, rank: int, msg: Message) -> None:
        if (rank, msg.kind) in self.lost:
            return
        held = self.held.get((rank, msg.kind))
        if held is not None:
            held.append(encode(msg, self.coordinator.signer))
            return
        self._record("down", rank, msg, self.coordinator.signer)

    def _record(self, direction: str, rank: int, msg: Message, signer: Optional[Signer]) -> None:
        self.delivered.append((direction, rank, msg))
        self.in_flight.append(("coordinator" if direction == "up" else "member", rank, encode(msg, signer)))

    @contextmanager
    def installed(self, rank: int):
        """Run as ``rank``'s installation would (its versions)."""
        patches = self.installs.get(rank, {})
        modules = (zcollective._format._wire, zcollective._protocol._member,
                   zcollective._protocol._member_join)
        saved = [(m, k, getattr(m, k)) for k in patches for m in modules if hasattr(m, k)]
        for module, key, _ in saved:
            setattr(module, key, patches[key])
        try:
            yield
        finally:
            for module, key, value in saved:
                setattr(module, key, value)

    # -- what a driver does ---------------------------------------------------

    def join(self, *ranks: int) -> None:
        """Each of ``ranks`` (default: all) connects and sends its JOIN."""
        for rank in ranks or range(self.n):
            self.connection(rank, ConnectionEvent.CONNECTED)
            self.connection(rank, ConnectionEvent.HANDSHAKE_SUCCEEDED)
            with self.installed(rank):
                join = self.members[rank].join()
            self.send(rank, join)

    def joined(self) -> Pair:
        self.join()
        assert all(m.joined for m in self.members), [m.failure for m in self.members]
        return self

    def call(self, rank: int, op: Op, value: Any = NOTHING, root: int = 0, fn: Any = None,
             site: str = "train.py:10", segments: Optional[list[list[Any]]] = None,
             flags: int = 0, send: bool = True) -> CollectiveFuture[Any]:
        """``rank`` makes a call, as a group does: reserve its seq, then
        submit its part (sent at once unless ``send`` is false)."""
        member = self.members[rank]
        seq = member.reserve(op, root, site)
        if segments is None:
            segments = [] if value is NOTHING else [_serialize.dumps(value)]
        fn_frame = None if fn is None else _serialize.dumps_function(fn)
        future: CollectiveFuture[Any] = CollectiveFuture(None, seq, op.label)
        member.submit(op, root, segments, fn_frame, site, flags, future, finish(op))
        if send:
            self.flush(rank)
        return future

    def call_all(self, op: Op, values: Optional[list[Any]] = None,
                 **kwargs: Any) -> list[CollectiveFuture[Any]]:
        """Every rank makes the same call, with ``values[rank]``."""
        return [self.call(r, op, NOTHING if values is None else values[r], **kwargs) for r in range(self.n)]

    def connection(self, rank: int, event: ConnectionEvent, now: Optional[float] = None) -> None:
        """``rank``'s driver saw ``event``; what the member answers is sent."""
        self.send(rank, *self.members[rank].connection(event, now))

    def status(self, rank: int, seq: int) -> Optional[dict[str, Any]]:
        """Ask the coordinator about ``seq`` for ``rank``: the STATUS_REPLY's body."""
        member = self.members[rank]
        self.send(rank, member.status_query(seq))
        return member.status.pop(seq, None)

    def disconnect(self, rank: int, reason: str = "connection closed") -> None:
        """``rank``'s connection closes: the coordinator finds it gone (its
        member's own event is the test's to give)."""
        for out_peer, out in self.coordinator.gone(peer(rank), reason):
            self._queue_down(_rank_of(out_peer), out)
        self.settle()

    # -- what a user sees -----------------------------------------------------

    def failure(self, rank: int) -> Optional[Exception]:
        return self.members[rank].failure

    def sent(self, direction: str, kind: Any, rank: Optional[int] = None) -> list[Message]:
        """Messages of ``kind`` delivered ``up`` (to the coordinator) or ``down``."""
        return [m for d, r, m in self.delivered if d == direction and m.kind is kind
                and (rank is None or r == rank)]


def outcome(future: CollectiveFuture[Any]) -> Any:
    """A finished future's value, or its exception; a pending one is a test failure."""
    assert future._done, f"{future!r} is still pending"
    return future._error if future._error is not None else future._value


def _signer(secret: Optional[bytes]) -> Optional[Signer]:
    return None if secret is None else Signer(secret)


def _rank_of(out_peer: bytes) -> int:
    return int(out_peer[1:])
