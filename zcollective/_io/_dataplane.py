"""The data plane's sockets: each replica binds one PULL (its data port) and connects one PUSH to the next
rank's, to move a :class:`~zcollective._protocol._ring.Transfer`'s chunks; a host's leader connects one
more to the next host's leader (``via`` :data:`HOSTS`). See docs/protocol.md, *The data plane*.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional

import zmq

from .._format._mac import ChunkMac
from .._limits import CHUNK_BYTES, HANDSHAKE_MIN_MS, POLL_SLICE_S
from .._protocol import _chunks, _tokens
from .._protocol._ring import HOSTS, RING, Transfer
from ..config import Config
from ..errors import AddressError, CollectiveTimeoutError, PeerError, ReplicaLostError
from . import _sockets, _zap
from ._interrupts import DEADLINE, Waiter

if TYPE_CHECKING:
    from .._protocol._member import Member

log = logging.getLogger("zcollective")

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH)
PUSH_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
               | sum(HANDSHAKE_FAILED))  # (one bit each)
PULL_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED  # the fewest: none for a stranger's connection
CLOSED = "connection closed or heartbeats unanswered"  # why a data link is lost
BROKEN = "its connection broke after an earlier call (a data link is made once)"
REFUSED = "its connection broke and was refused when re-made (a data link is made once)"
RETRY_S = 0.05  # a data link refused before it was made is tried again this soon (the next rank is joining)
TRACKER_POLL_S = 0.001  # how often a finished job looks whether its last sends have left
OURS = ("chunks", "pull events", "push events", "hosts push events")  # its sockets' names in a waiter


class _Out:
    """A PUSH to rank ``target``'s data port, its monitor, whether its handshake was made, why it is lost."""

    def __init__(self, target: int, endpoint: str, key: bytes, push: zmq.Socket, monitor: zmq.Socket) -> None:
        self.target = target
        self.endpoint = endpoint
        self.key = key  # its tokens' (the target's port accepts only its own)
        self.push = push
        self.monitor = monitor
        self.made = False  # its handshake succeeded
        self.retry_at: Optional[float] = None  # refused before it was made: tried again then
        self.refused = 0
        self.broken: Optional[str] = None  # why it is lost (a link is made once)


def local_address(config: Config) -> str:
    """The address of the interface this host reaches the master by (a connected UDP socket's: no packet)."""
    try:
        infos = socket.getaddrinfo(config.master_addr, config.master_port or 1, type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            host = probe.getsockname()[0]
    except OSError as exc:  # (no route: an interface down, a cable pulled; a name unknown)
        raise AddressError(f"rank {config.rank} cannot reach the master address {config.master_addr} "
                           f"from this host, to open its ports on the interface that does: {exc}") from exc
    return f"[{host}]" if ":" in host else host


def set_peer_options(sock: zmq.Socket, config: Config, max_message_bytes: int) -> None:
    """The options of a socket between two replicas (a data port's or a mailbox's, either end)."""
    sock.setsockopt(zmq.LINGER, 0)
    # a handshake unfinished within the liveness bound is dropped: a stranger cannot hold a connection
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(HANDSHAKE_MIN_MS, int(config.liveness_timeout * 1000)))
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # no frame of ours is larger: a stranger's
    _sockets.set_never_drop(sock)  # cannot make this process allocate more
    _sockets.set_heartbeats(sock, config)


def bind_peer_port(ctx: zmq.Context, config: Config, gatekeeper: _zap.Gatekeeper, domain: str,
                   max_message_bytes: int) -> tuple[zmq.Socket, str]:
    """A PULL bound where this host reaches the master, on a port the system chooses, admitting only peers
    whose token ``gatekeeper`` takes for ``domain``; and its endpoint."""
    pull = ctx.socket(zmq.PULL)
    with _sockets.closed_on_error(pull):
        set_peer_options(pull, config, max_message_bytes)
        _zap.secure_server(pull, gatekeeper, domain)
        host = local_address(config)
        if host.startswith("["):
            pull.setsockopt(zmq.IPV6, 1)
        pull.bind(f"tcp://{host}:*")
        return pull, pull.getsockopt(zmq.LAST_ENDPOINT).decode()


class DataPlane:
    """One replica's data sockets (see the module docstring). Used only by the thread that owns the group."""

    def __init__(self, ctx: zmq.Context, config: Config,
                 gatekeeper: Optional[_zap.Gatekeeper] = None) -> None:
        """Bind the data port; ``gatekeeper`` (else a :class:`~._zap.GateThread`) answers its handshakes."""
        self.rank = config.rank
        self.size = config.num_replicas
        self._config = config
        self._ctx = ctx
        self._rules = _chunks.ChunkRules(self.rank, self.size)  # which chunk it takes
        self.endpoints: list[str] = []
        self._via: dict[str, _Out] = {}  # the links this rank sends on (RING; a host's leader: HOSTS)
        self._inbound = 1  # the links this rank's port takes chunks from
        self._early: dict[int, list[list[Any]]] = {}  # seq -> chunks that came before its job
        self._trackers: deque[Any] = deque()
        self._warned: set[str] = set()
        self._gate: Optional[_zap.GateThread] = None  # ours (not rank 0's coordinator's)
        with _sockets.mapped(f"rank {self.rank} cannot open its data port", address=True):
            if gatekeeper is None:
                self._gate = _zap.GateThread(ctx)
                gatekeeper = self._gate.gatekeeper
            gatekeeper.rekey(None, _zap.DATA_DOMAIN)  # no token opens it before the WELCOME
            self._gatekeeper = gatekeeper
            try:
                self._pull, self.endpoint = bind_peer_port(ctx, config, gatekeeper, _zap.DATA_DOMAIN,
                                                           CHUNK_BYTES)
                with _sockets.closed_on_error(self._pull):
                    self._pull_monitor = _sockets.monitor_socket(self._pull, PULL_EVENTS)
            except BaseException:
                if self._gate is not None:
                    self._gate.close()
                raise

    def start(self, session: int, endpoints: list[str], mac: str, data_key: Optional[str],
              deadline: Optional[float], pump: Callable[[], None],
              leaders: Optional[list[int]] = None) -> None:
        """Welcomed: connect to the next rank's data port (a leader also to the next host's: ``leaders``)
        and wait for every handshake, else :class:`CollectiveTimeoutError` at ``deadline``. Tokens are
        made under the secret, else under ``data_key`` (hex, from the WELCOME)."""
        self.endpoints = endpoints
        base = self._config.secret  # with one, chunks carry the MAC every rank of the group has
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        senders = {RING: prev}  # whose link a job by each link takes reduce-scatter chunks from
        if base is None:
            assert data_key is not None  # (the member takes no data plan without one)
            base = bytes.fromhex(data_key)
        self._gatekeeper.rekey(_tokens.port_key(base, session, self.rank), _zap.DATA_DOMAIN)
        self._via[RING] = self._open(nxt, _tokens.port_key(base, session, nxt))
        if leaders is not None and self.rank in leaders:
            at, count = leaders.index(self.rank), len(leaders)
            to, came = leaders[(at + 1) % count], leaders[(at - 1) % count]
            self._via[HOSTS] = self._via[RING] if to == nxt else self._open(
                to, _tokens.port_key(base, session, to))
            self._inbound += came != prev
            senders[HOSTS] = came
        secret = self._config.secret
        self._rules.start(session, None if secret is None else ChunkMac(secret, mac), self.rank, self.size,
                          senders)
        self._handshakes(deadline, pump)

    def _open(self, target: int, key: bytes) -> _Out:
        """A link to rank ``target``'s data port, its handshake begun."""
        endpoint = self.endpoints[target]
        with _sockets.mapped(f"rank {self.rank} cannot connect to the data port {endpoint}", address=True):
            push = self._ctx.socket(zmq.PUSH)
            with _sockets.closed_on_error(push):
                set_peer_options(push, self._config, CHUNK_BYTES)
                if "[" in endpoint:
                    push.setsockopt(zmq.IPV6, 1)
                out = _Out(target, endpoint, key, push, _sockets.monitor_socket(push, PUSH_EVENTS))
        self._connect(out)  # one token: a link is made once
        return out

    def _outs(self) -> list[_Out]:
        """The links this rank sends on, each once."""
        return list({id(out): out for out in self._via.values()}.values())

    def _handshakes(self, deadline: Optional[float], pump: Callable[[], None]) -> None:
        """Wait for every link's handshake; nothing was sent yet, so a refused attempt is made again."""
        inbound = 0
        waiter = self._watched(Waiter())
        outs = self._outs()
        while True:
            for out in outs:
                for event, _ in _sockets.monitor_events(out.monitor):
                    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        out.made, out.retry_at = True, None
                    elif event == zmq.EVENT_DISCONNECTED or event in HANDSHAKE_FAILED:
                        out.refused += event in HANDSHAKE_FAILED
                        out.made, out.retry_at = False, time.monotonic() + RETRY_S
            for event, _ in _sockets.monitor_events(self._pull_monitor):
                inbound += event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if all(out.made for out in outs) and inbound >= self._inbound:
                break
            for out in outs:
                if out.retry_at is not None and time.monotonic() >= out.retry_at:
                    out.retry_at = None
                    self._connect(out)
            pump()
            if deadline is not None and time.monotonic() >= deadline:
                raise CollectiveTimeoutError(self._unmade(outs, inbound))
            waiter.wait(OURS[1:], deadline, 0.05)

    def _unmade(self, outs: list[_Out], inbound: int) -> str:
        """Which data links were not made in time."""
        missing = [f"to rank {out.target} at {out.endpoint}" + (
            f" (its data port refused this rank's token {out.refused} times)" if out.refused else "")
            for out in outs if not out.made]
        if inbound < self._inbound:
            ranks = " and ".join(str(r) for r in sorted(self._rules.origins))
            missing.append(f"from rank{'s' if self._inbound > 1 else ''} {ranks} (to {self.endpoint})")
        if self._gate is not None and self._gate.crashed is not None:
            missing[-1] += f" (this rank's handshake thread crashed: {self._gate.crashed})"
        return (f"rank {self.rank} joined the group but could not make its data links "
                f"{' and '.join(missing)} in time (a firewall between the hosts? "
                f"ZCOLLECTIVE_DATA_PLANE=off keeps every byte on the master port)")

    def _connect(self, out: _Out) -> None:
        """Connect ``out`` to its rank's data port with a fresh token."""
        what = f"rank {self.rank} cannot connect to the data port {out.endpoint}"
        with _sockets.mapped(what, address=True):
            _zap.connect_with_token(out.push, out.endpoint, out.key, _zap.DATA_DOMAIN)

    def _watched(self, waiter: Waiter) -> Waiter:
        """``waiter``, watching this data plane's sockets too (as :data:`OURS`)."""
        monitors = [out.monitor for out in self._outs()]
        for name, sock in zip(OURS, (self._pull, self._pull_monitor, *monitors), strict=False):
            waiter.watch(name, sock)
        return waiter

    def fds(self) -> list[int]:
        return [s.FD for s in (self._pull, self._pull_monitor, *(out.monitor for out in self._outs()))]

    def close(self, linger_ms: int = 0) -> None:
        """Close the data sockets; what is queued to the next rank gets ``linger_ms`` to leave."""
        for out in self._outs():
            _sockets.close_monitored(out.push, out.monitor, 0 if out.broken is not None else linger_ms)
        self._via.clear()
        _sockets.close_monitored(self._pull, self._pull_monitor, 0)
        if self._gate is not None:
            self._gate.close()  # after the data port: no handshake is left to answer
        self._early.clear()

    # -- one job ------------------------------------------------------------

    def run(self, seq: int, job: Transfer, deadline: Optional[float], member: Member, waiter: Waiter,
            control: tuple[str, ...], pump: Callable[[], None],
            fail: Callable[[Exception], None], until: Optional[Callable[[], bool]] = None,
            owner: Any = None) -> bool:
        """Move ``job``'s chunks until done and sent, or the group fails (True), or ``deadline``, or
        ``until()`` after news on ``control`` (False). ``pump`` moves the rest of the group (docs/protocol.md,
        *Progress*); ``fail`` fails the group; ``owner``: the member's job, if ``job`` is a step of it."""
        for stale in [s for s in self._early if s < seq]:  # calls that failed before their move
            del self._early[stale]
        owner = job if owner is None else owner
        for frames in self._early.pop(seq, []):
            self._take(frames, seq, job, member, fail)
        names = (*OURS, *control)
        self._watched(waiter)
        out = self._via.get(job.via)
        if out is None:  # (a ring between hosts at a rank that is no host's leader: a bug of ours)
            raise RuntimeError(f"rank {self.rank} has no data link for {job.via} ({job.progress()})")
        while member.transfers and member.transfers[0][1] is owner:  # (a failure empties it, or keeps it)
            if job.outbox and (out.broken is not None or not self._send(seq, job, out.push)):
                # the link went down since it was made: a re-made connection may have lost chunks
                fail(self._lost(seq, job, out, out.broken or REFUSED))
                continue
            if job.done and self._sent():
                return True
            woke = waiter.wait(names, deadline, TRACKER_POLL_S if job.done else POLL_SLICE_S)
            self._drain(seq, job, owner, member, fail)
            self._events(seq, job, fail)
            if not woke or any(name in control for name in woke):  # (idle for a slice: what is
                pump()  # due may be rank 0's coordinator's own, a probe round no socket wakes)
                if until is not None and until():
                    return False
            if DEADLINE in woke:
                return False
        return True

    def _sent(self) -> bool:
        """Have libzmq's I/O threads let go of every buffer sent without a copy?"""
        trackers = self._trackers
        while trackers and trackers[0].done:
            trackers.popleft()
        return not trackers

    def _send(self, seq: int, job: Transfer, push: zmq.Socket) -> bool:
        """Send the job's outbox on ``push`` without blocking; False if libzmq has no pipe to its rank."""
        rules = self._rules
        outbox = job.outbox
        try:
            for out in outbox:
                if out.frames is not None:  # forwarded as it came: header, tag, payload
                    push.send_multipart(out.frames, zmq.NOBLOCK, copy=False)
                else:
                    header = rules.header(out.kind, seq, out.step, out.index)
                    payload = memoryview(out.payload).cast("B")
                    tag = rules.mac.tag(header, payload) if rules.mac is not None else b""
                    tracker = push.send_multipart([header, tag, payload], zmq.NOBLOCK, copy=False,
                                                  track=True)
                    if tracker is not None and not tracker.done:
                        self._trackers.append(tracker)
                job.sent += 1
        except zmq.Again:
            return False
        outbox.clear()
        return True

    def _drain(self, seq: int, job: Transfer, owner: Any, member: Member,
               fail: Callable[[Exception], None]) -> None:
        """Take every chunk waiting while ``job`` (``owner``'s) goes on."""
        pull = self._pull
        while member.transfers and member.transfers[0][1] is owner and _sockets.readable(pull):
            self._take(_sockets.recv_message(pull), seq, job, member, fail)

    def _take(self, frames: list[Any], seq: int, job: Transfer, member: Member,
              fail: Callable[[Exception], None]) -> None:
        """Give one chunk to ``job``, keep it for later, or drop it (:mod:`zcollective._protocol._chunks`)."""
        verdict = self._rules.check(frames, seq, member.next_seq, job.via)
        reason = verdict.reason
        if reason == _chunks.NOW:
            try:
                taken = job.receive(verdict.kind, verdict.step, verdict.index, frames[2], frames,
                                    verdict.origin)
            except Exception as exc:  # the user's elementwise function raised: this call fails
                error = PeerError(f"seq {seq} {job.op}: the reduce function raised on rank "
                                  f"{self.rank} during the ring: {type(exc).__name__}: {exc}")
                error.seq = seq  # type: ignore[attr-defined]
                fail(error)
                return
            if not taken:
                self._warn("duplicate", self._rules.unexpected(verdict))
        elif reason == _chunks.EARLY:
            self._early.setdefault(verdict.seq, []).append(frames)
        elif reason == _chunks.ENDED:
            log.debug("zcollective rank %d: dropped a chunk of the ended seq %d", self.rank, verdict.seq)
        elif reason == _chunks.ALTERED:
            fail(self._rules.altered(verdict, job.op))
        else:
            self._warn(reason, verdict.why)

    def _events(self, seq: int, job: Transfer, fail: Callable[[Exception], None]) -> None:
        """The monitors: the link ``job`` sends on closed fails the group; another, once broken, is lost."""
        mine = self._via.get(getattr(job, "via", RING))
        for out in self._outs():
            for event, _ in _sockets.monitor_events(out.monitor):
                if event == zmq.EVENT_DISCONNECTED or event in HANDSHAKE_FAILED:
                    why = CLOSED if event == zmq.EVENT_DISCONNECTED else REFUSED
                    if out is mine and (job.sent < job.to_send or not self._sent()):
                        return fail(self._lost(seq, job, out, why))
                    # it had all it needed (and may have ended): a later call finds the link lost
                    out.broken = out.broken or (BROKEN if why is CLOSED else why)
        for _ in _sockets.monitor_events(self._pull_monitor):  # (handshakes only: no peer named)
            pass
        return None

    def _lost(self, seq: int, job: Transfer, out: _Out, why: str) -> ReplicaLostError:
        """The link to ``out``'s rank is lost (the only one this rank can tell)."""
        out.broken = out.broken or why  # nothing more goes that way, not even at exit
        error = ReplicaLostError(
            f"seq {seq} {job.op}: rank {self.rank} lost its data link to rank {out.target} "
            f"({out.endpoint}): {why}; {job.progress()}")
        error.lost_rank = out.target  # type: ignore[attr-defined]
        return error

    def _warn(self, category: str, text: str) -> None:
        if category not in self._warned:
            self._warned.add(category)
            log.warning("zcollective rank %d: %s", self.rank, text)

