"""One replica's end of a group: the DEALER, the sequence counter, the outcomes
that arrived, and the liveness of the coordinator.

Used only by the thread that created it. Knows nothing of the coordinator's
internals: it sends contributions and matches replies by sequence number.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from typing import Any, Callable, Optional

import zmq
from zmq.backend import zmq_poll

from . import _sockets, _wire
from ._coordinator import PYTHON_VERSION
from ._wire import (
    FLAG_LOCAL_ERROR,
    AuthError,
    Kind,
    Message,
    Op,
    Signer,
    VersionError,
    WireError,
    control,
    decode,
    encode,
    error_note,
    join_token,
)
from .config import Config
from .errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveTimeoutError,
    ProtocolError,
    ReplicaLostError,
    from_wire,
)

log = logging.getLogger("zcollective")

STATUS_WAIT_S = 1.0  # how long a timed-out call waits for the coordinator to say who is late
MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)

FOREIGN_PEER_S = 5.0  # handshakes failing this long (and never succeeding) mean a foreign program
FOREIGN_PEER_TRIES = 3  # ... over at least this many connections

def routing_id(rank: int) -> bytes:
    """The rank, then random bytes: a second process claiming the same rank
    reaches the coordinator (which reports it) instead of being silently
    refused by libzmq for reusing a routing id."""
    return b"R" + rank.to_bytes(4, "big") + os.urandom(8)


class Replica:
    """The DEALER side of one group member."""

    def __init__(self, ctx: zmq.Context, config: Config, endpoint: str,
                 alive: Optional[Callable[[], Optional[str]]] = None,
                 busy: Optional[Callable[[], Optional[str]]] = None) -> None:
        # rank 0 (alive is set) shares its process with the coordinator: send
        # copies, so the coordinator never reduces in place into the user's data
        self._copy = alive is not None
        self.config = config
        self.rank = config.rank
        self.endpoint = config.endpoint  # what messages name; rank 0 connects over inproc
        self._alive = alive  # on rank 0: says why the coordinator thread is gone, if it is
        self._busy = busy  # on rank 0: says what the coordinator thread is stuck in, if anything
        self.session = 0
        self.signer = Signer(config.secret) if config.secret is not None else None
        self._nonces: set[str] = set()  # every JOIN this replica sent (it re-sends after a reconnect)
        self._tokens: set[int] = set()  # their tokens: what binds replies before the WELCOME
        self.next_seq = 0
        self.deliver: Callable[[int, Message], None] = lambda seq, msg: None
        self.on_failure: Callable[[Exception], None] = lambda error: None
        self.failure: Optional[Exception] = None
        self.connected = alive is not None  # rank 0's inproc link is there at once
        self._failed_handshakes: list[float] = []  # since the last good one
        self._rejoin = False
        self._in_flight: dict[int, str] = {}
        self._inbox: deque[list[Any]] = deque()  # received, not yet handled (see _drain_dealer)
        self._events: deque[list[Any]] = deque()  # the same for monitor events
        self._unsent: Optional[list[Any]] = None  # a contribution whose send was interrupted
        self._reserved: Optional[tuple[int, Op, int, str]] = None  # seq, op, root, site being built
        self._status: dict[int, dict[str, Any]] = {}
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.ROUTING_ID, routing_id(self.rank))
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.RECONNECT_IVL, _sockets.RECONNECT_IVL_MS)
        self.dealer.setsockopt(zmq.RECONNECT_IVL_MAX, _sockets.RECONNECT_IVL_MAX_MS)
        _sockets.set_never_drop(self.dealer)
        _sockets.set_heartbeats(self.dealer, config)
        try:
            self.monitor = _sockets.monitor_socket(self.dealer, MONITOR_EVENTS)
        except BaseException:
            self.dealer.close(linger=0)
            raise
        self._poll_items = [(self.dealer, zmq.POLLIN), (self.monitor, zmq.POLLIN)]
        try:
            with _sockets.mapped(f"rank {self.rank} cannot connect to {self.endpoint}"):
                self.dealer.connect(endpoint)
        except BaseException:
            self.close()  # sockets left open would make the context's term() wait forever
            raise

    # -- join -------------------------------------------------------------

    def _send_join(self, challenge: Optional[str] = None) -> None:
        """JOIN, with a fresh nonce; with a secret, the coordinator first
        answers with a CHALLENGE that the JOIN sent again must echo."""
        nonce = os.urandom(16).hex()
        self._nonces.add(nonce)
        self._tokens.add(join_token(nonce))
        body = {"rank": self.rank, "num_replicas": self.config.num_replicas,
                "protocol": _wire.PROTOCOL_VERSION, "python": PYTHON_VERSION,
                "pid": os.getpid(), "host": socket.gethostname(), "nonce": nonce}
        if challenge is not None:
            body["challenge"] = challenge
        self._send(control(Kind.JOIN, body, rank=self.rank))

    def join(self, timeout: Optional[float]) -> None:
        """Send JOIN and wait for every replica to have joined.

        Raises
        ------
        CollectiveTimeoutError
            The group was not complete in time; names who was missing.
        ProtocolError, ValueError, CollectiveError
            The coordinator refused the join; the message says why.
        """
        self._send_join()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.wait_for(lambda: self.session != 0, deadline):
            raise CollectiveTimeoutError(self._join_timeout_message(timeout))

    def _join_timeout_message(self, timeout: Optional[float]) -> str:
        base = f"rank {self.rank} timed out after {timeout:g} s joining the group at {self.endpoint}"
        if not self.connected:
            return (f"{base}: could not reach the coordinator (rank 0) at that address "
                    f"(is rank 0 running, and is the address and port right?)")
        status = self._ask_status(0)
        if status and status.get("missing"):
            missing = ",".join(map(str, status["missing"]))
            refused = status.get("refused")
            why = ""
            if isinstance(refused, dict) and refused:
                why = " (" + "; ".join(f"rank {r} was refused: {str(m)[:300]}"
                                       for r, m in list(refused.items())[:3]) + ")"
            return f"{base}: connected, but ranks {missing} had not joined{why}"
        return f"{base}: connected, but the group did not complete"

    # -- calls --------------------------------------------------------------

    def check(self) -> None:
        """Raise the group's failure, if it has one (sticky). A loss not yet
        taken in is found by the next wait, which polls the monitor too."""
        if self.failure is not None:
            raise _fresh(self.failure)

    def reserve(self, op: Op, root: int, callsite: str) -> None:
        """Hold the next seq for a call whose part is being built (see
        :meth:`submit`, :meth:`unreserve`, :meth:`abandon`)."""
        self.check()
        self._reserved = (self.next_seq, op, root, callsite)

    def unreserve(self) -> None:
        """The part could not be built (nothing was sent): the seq stays free."""
        self._reserved = None

    def abandon(self, reason: str) -> None:
        """The part's building was interrupted: send an error note for the
        reserved seq instead, so every rank's call there ends in an error and
        the next call pairs correctly."""
        reserved = self._reserved
        if reserved is None:
            return  # nothing reserved, or the part itself was already queued
        seq, op, root, callsite = reserved
        try:
            self._owe(seq, op, root, callsite, FLAG_LOCAL_ERROR, None, error_note(reason))
        except CollectiveError:
            pass  # the link is gone: the others will hear that instead

    def submit(self, op: Op, root: int, segments: list[list[Any]], fn: Any = None,
               callsite: str = "", flags: int = 0) -> int:
        """Send this rank's contribution to the next call; return its seq.

        Raises
        ------
        ValueError
            A frame is larger than ``max_frame_bytes`` (checked before
            anything is sent: the coordinator would drop the connection).
        """
        self.check()
        limit = self.config.max_frame_bytes
        for segment in segments:
            for frame in segment:
                size = memoryview(frame).nbytes
                if size > limit:
                    raise ValueError(
                        f"rank {self.rank}: a {op.label} value holds a buffer of {size} bytes, "
                        f"above max_frame_bytes={limit}; raise ZCOLLECTIVE_MAX_FRAME_BYTES on "
                        f"every replica, or split the value")
        seq = self.next_seq
        self._owe(seq, op, root, callsite, flags, fn, segments)
        return seq

    def _owe(self, seq: int, op: Op, root: int, callsite: str, flags: int, fn: Any,
             segments: list[list[Any]]) -> None:
        """Make ``seq`` this rank's contribution (or error note), and send it."""
        frames = encode(Message(Kind.CONTRIB, op, self.rank, root, seq, self.session, callsite,
                                flags, fn, segments), self.signer)
        self._in_flight[seq] = op.label
        # the seq is used and the contribution owed in one step: an interrupt after it leaves
        # the frames in _unsent, sent by the next call (a duplicate is dropped by seq)
        self.next_seq, self._unsent, self._reserved = seq + 1, frames, None
        self._send_unsent()

    def wait_for(self, done: Callable[[], bool], deadline: Optional[float]) -> bool:
        """Take in messages until ``done()`` or ``deadline``; False on timeout.

        Raises
        ------
        ReplicaLostError, CallMismatchError, CollectiveError
            The group failed (sticky).
        """
        self._send_unsent()
        while not done():
            if self.failure is not None:
                raise _fresh(self.failure)
            if not self._pump(deadline):
                return done()
        return True

    def progress(self) -> None:
        """Send what an interrupted call still owes; take in whatever has
        arrived, without blocking."""
        self._send_unsent()
        self._pump(time.monotonic())

    def timeout_message(self, seq: int, timeout: Optional[float]) -> str:
        op = self._in_flight.get(seq, "call")
        base = f"seq {seq} {op} timed out after {timeout:g} s on rank {self.rank}"
        status = self._ask_status(seq)
        if status is None:
            busy = self._busy() if self._busy is not None else None
            if busy:
                return f"{base}: {busy}"
            return (f"{base}; the coordinator (rank 0) did not answer a status query within "
                    f"{STATUS_WAIT_S:g} s (is a reduce function stuck?)")
        if status.get("missing"):
            missing = ",".join(map(str, status["missing"]))
            arrived = ",".join(map(str, status.get("arrived", []))) or "none"
            return f"{base}: waiting for ranks {missing} (arrived: {arrived})"
        return f"{base}: every rank arrived; the coordinator (rank 0) is still computing it"

    def _ask_status(self, seq: int) -> Optional[dict[str, Any]]:
        self._status.pop(seq, None)
        self._send(Message(Kind.STATUS, rank=self.rank, seq=seq, session=self.session))
        deadline = time.monotonic() + STATUS_WAIT_S
        while seq not in self._status and self.failure is None:
            if not self._pump(deadline):
                break
        return self._status.pop(seq, None)

    def say_bye(self) -> bool:
        """Tell the coordinator this program is ending, after ``next_seq``
        calls (rule 7 of :mod:`zcollective._coordinator`). False if the group
        has failed or never started, when there is nobody to tell."""
        if self.failure is not None or self.session == 0:
            return False
        self._send(Message(Kind.BYE, rank=self.rank, seq=self.next_seq, session=self.session))
        return True

    # -- I/O ----------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        self._send_unsent()  # what an interrupted call still owes goes first
        self._send_frames(encode(msg, self.signer), msg.seq)

    def _send_unsent(self) -> None:
        frames = self._unsent
        if frames is not None:
            self._send_frames(frames, self.next_seq - 1)
            self._unsent = None

    def _send_frames(self, frames: list[Any], seq: int) -> None:
        try:
            _sockets.send_frames(self.dealer, frames, self._copy)
        except zmq.ZMQError as exc:
            raise CollectiveError(f"rank {self.rank} could not send seq {seq}: {exc.strerror}") from exc

    def _pump(self, deadline: Optional[float]) -> bool:
        """Wait until something arrives or ``deadline``; handle it all.
        Returns False on timeout.

        One poll covers the DEALER and its monitor, so a disconnect ends a wait
        at once; on rank 0 the coordinator thread's liveness is checked between
        slices of at most POLL_SLICE_S."""
        if self._inbox or self._events:  # taken in by a call that was interrupted: handle first
            got = self._drain_dealer()
            self._drain_monitor()
            if got or self.failure is not None:
                return True
        while True:
            remaining = _sockets.POLL_SLICE_S
            if deadline is not None:
                remaining = min(remaining, deadline - time.monotonic())
            ready = zmq_poll(self._poll_items, max(0, int(remaining * 1000)))
            if ready:
                got = self._drain_dealer()  # first: a FAIL that came before a disconnect explains it
                if len(ready) > 1 or ready[0][0] is self.monitor:
                    self._drain_monitor()
                if got or self.failure is not None:
                    return True
                continue
            self._drain_monitor()
            if self.failure is not None:
                return True
            if self._alive is not None and (why := self._alive()) is not None:
                self._fail(ReplicaLostError(f"rank {self.rank}: the coordinator thread is gone: "
                                            f"{why}; {self._describe_in_flight()}"))
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _drain_dealer(self) -> bool:
        """Handle every message waiting; True if there was one.

        A message leaves the inbox only once it has been handled, and handling
        one twice changes nothing, so a ``KeyboardInterrupt`` anywhere in here
        loses no result: the next call picks up where this one stopped. A
        done-callback that calls into the group (``done()``, ``result()``)
        re-enters here while the outer call handles ``inbox[0]``; the nested
        call handles it again (harmlessly) and goes on with the rest.
        """
        got = False
        for frames in _sockets.handled(self.dealer, self._inbox):
            got = True
            self._dispatch(frames)  # may run done-callbacks that come back in here (see above)
        return got

    def _dispatch(self, frames: list[Any]) -> None:
        try:
            msg = decode(frames, signer=self.signer)
        except AuthError as exc:
            if self.session == 0:
                why = "rank 0 has no secret" if exc.missing else "rank 0 has a different secret"
                self._fail(AuthenticationError(
                    f"rank {self.rank}: a reply of the coordinator at {self.endpoint} failed "
                    f"authentication ({exc}): {why}; set the same ZCOLLECTIVE_SECRET everywhere"))
            else:
                self._fail(AuthenticationError(
                    f"rank {self.rank}: a message from the coordinator at {self.endpoint} failed "
                    f"authentication ({exc}); was it altered in flight? {self._describe_in_flight()}"),
                    tell=True)
            return
        except VersionError as exc:
            self._fail(ProtocolError(f"rank {self.rank}: the coordinator at {self.endpoint} speaks "
                                     f"protocol version {exc.version}, this replica speaks "
                                     f"{_wire.PROTOCOL_VERSION}: install the same zcollective everywhere"))
            return
        except WireError as exc:
            log.warning("zcollective rank %d: dropped a malformed message: %s", self.rank, exc)
            return
        try:
            self._act(msg)
        except WireError as exc:
            log.warning("zcollective rank %d: dropped a malformed %s message: %s", self.rank,
                        msg.kind.name, exc)

    def _bound_here(self, msg: Message) -> bool:
        """Is ``msg`` bound to this replica: its rank, and the session (or,
        before the WELCOME, the token of one of its JOINs)? A message that
        proved the secret but is bound elsewhere was moved or replayed."""
        if msg.rank == self.rank:
            if msg.kind is Kind.WELCOME:
                return True  # bound by the nonce in its body, checked by the caller
            if msg.session == self.session if self.session else msg.session in self._tokens:
                return True
            if msg.kind is Kind.CHALLENGE and msg.session in self._tokens:
                return True  # a late answer to a JOIN sent twice (a reconnect): ignored once joined
        what = (f"a {msg.kind.name} message from the coordinator at {self.endpoint} was bound to "
                f"rank {msg.rank}, session {msg.session:#x}, not to this replica")
        if self.signer is not None:
            self._fail(AuthenticationError(f"rank {self.rank}: {what}: was it moved between ranks "
                                           f"or replayed? {self._describe_in_flight()}"), tell=True)
        elif msg.kind is not Kind.RESULT:  # a RESULT of an earlier group on this port is routine
            log.warning("zcollective rank %d: dropped %s", self.rank, what)
        return False

    def _act(self, msg: Message) -> None:
        if not self._bound_here(msg):
            return
        kind = msg.kind
        if kind is Kind.RESULT or kind is Kind.ERROR:
            if kind is Kind.ERROR:
                msg.body()  # parsed before the call is taken off the table: a bad one is dropped
            self.deliver(msg.seq, msg)
            self._in_flight.pop(msg.seq, None)
        elif kind is Kind.STATUS_REPLY:
            self._status[msg.seq] = _status_body(msg.body())
        elif kind is Kind.WELCOME:
            nonce = msg.body().get("nonce")
            if isinstance(nonce, str) and nonce in self._nonces:  # answers a JOIN of ours, not a replay
                self.session = msg.session
        elif kind is Kind.REJECT or kind is Kind.FAIL:
            self._fail(from_wire(msg.body()))
        elif kind is Kind.CHALLENGE and self.session == 0:
            challenge = msg.body().get("challenge")
            if isinstance(challenge, str):
                self._send_join(challenge[:64])

    def _drain_monitor(self) -> None:
        for kind, _ in _sockets.monitor_events(self.monitor, self._events):
            if kind == zmq.EVENT_CONNECTED:
                self.connected = True
            elif kind == zmq.EVENT_DISCONNECTED and self.session == 0:
                self._rejoin = True  # the JOIN may have gone down with that connection
            elif kind == zmq.EVENT_DISCONNECTED and self.session != 0:
                self._fail(ReplicaLostError(
                    f"rank {self.rank} lost the coordinator (rank 0) at {self.endpoint}: "
                    f"connection closed or heartbeats unanswered; {self._describe_in_flight()}"))
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failed_handshakes.clear()
                if self._rejoin and self.session == 0:
                    self._rejoin = False
                    self._send_join()
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                self._on_failed_handshake(kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)

    def _on_failed_handshake(self, protocol_violation: bool) -> None:
        """A ZMTP protocol violation proves a foreign program at once. A connection
        closed during the handshake may be a proxy or a coordinator still starting,
        so that counts only when it keeps happening."""
        if self.session != 0:
            return
        failures = self._failed_handshakes
        failures.append(time.monotonic())
        if protocol_violation or (len(failures) >= FOREIGN_PEER_TRIES
                                  and failures[-1] - failures[0] >= FOREIGN_PEER_S):
            self._fail(ProtocolError(
                f"rank {self.rank}: the program listening at {self.endpoint} is not a zcollective "
                f"coordinator ({len(failures)} ZeroMQ handshakes failed); is the master port "
                f"used by another program?"))

    def _describe_in_flight(self) -> str:
        if not self._in_flight:
            return f"no call was in flight (next seq {self.next_seq})"
        calls = ", ".join(f"seq {s} {op}" for s, op in sorted(self._in_flight.items())[:3])
        return f"in flight: {calls}"

    def _fail(self, error: Exception, tell: bool = False) -> None:
        """Fail the group here (sticky). ``tell``: this replica found the
        failure itself (a message to it was altered or moved), so it asks the
        coordinator to fail the group for everyone (ABORT)."""
        if self.failure is None:
            self.failure = error
            if tell and self.session:
                try:
                    self._send(control(Kind.ABORT, {"error": type(error).__name__, "message": str(error)},
                                       rank=self.rank, session=self.session))
                except Exception:
                    pass  # the link is broken: the others will find this replica lost
            self.on_failure(error)

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets; what is still queued gets ``linger_ms`` to leave."""
        try:
            self.dealer.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.dealer.close(linger=linger_ms)


def _status_body(body: dict[str, Any]) -> dict[str, Any]:
    """A STATUS_REPLY's body, with its rank lists checked (they end up in messages)."""
    for key in ("missing", "arrived"):
        ranks = body.get(key, [])
        if not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
            raise WireError(f"status reply field {key!r} is not a list of ranks")
    return body


def _fresh(error: Exception) -> Exception:
    """A new instance of a sticky error, so each raise has its own traceback."""
    try:
        fresh = type(error).__new__(type(error))
        fresh.__dict__.update(error.__dict__)
        fresh.args = error.args
        return fresh
    except Exception:
        return error
