"""A replica's mailbox: the sockets of its point-to-point messages. It binds
one PULL (its mailbox port, which its JOIN names) and connects a PUSH to
another rank's the first time it sends that rank something. A handshake
needs a token under the group's key for that rank's port, as a data port's
does (docs/protocol.md, *Point to point*); what a message may carry and
which receive takes it is decided by :mod:`zcollective._protocol._p2p`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable
from typing import Any, Optional

import zmq

from .._format._packets import COPY_MAX, ONE_HEAD
from .._protocol import _tokens
from ..config import Config
from . import _sockets, _zap
from ._dataplane import HANDSHAKE_FAILED, RETRY_S, TRACKER_POLL_S, bind_peer_port, set_peer_options
from ._local import LOCAL, LocalLinks
from ._zmq import NOBLOCK, reader

__all__ = ["LOCAL", "MAIL", "MESSAGE", "LINK", "TAKE_BATCH", "TRACKER_POLL_S", "MailSockets", "mail_woke"]

MAIL = "mail"  # its socket's name in a waiter; a link's monitor is "mail <rank>"
MESSAGE, LINK = 1, 2  # what a wait woke for (mail_woke): a message waits; a link's monitor has news
TAKE_BATCH = 256  # messages the driver takes in one go (then the owner looks at its other sockets)
send_frame = zmq.backend.Socket.send  # (the Cython method: a small value's one frame; as _zmq's recv_frame)
LOOK_S = 0.01  # once every link is made, their monitors are read at most this often (unless one woke a wait)


def _unknown(dest: int) -> bool:
    """Not known to take the group's tokens (until the driver says)."""
    return False


def mail_woke(woke: list[str]) -> int:
    """What a wait woke for of the mailbox's: :data:`MESSAGE`, :data:`LINK` (a
    link's handshake, or its refusal), both, or 0."""
    found = 0
    for name in woke:
        if name.startswith(MAIL):
            found |= MESSAGE if name in (MAIL, LOCAL) else LINK  # (the one-host links' news is
    return found  # taken in with their messages)


class MailSockets:
    """One replica's mailbox sockets; used only by the thread that owns the group."""

    def __init__(self, ctx: zmq.Context, config: Config, gatekeeper: Optional[_zap.Gatekeeper]) -> None:
        """Bind the mailbox port. Its handshakes are answered by ``gatekeeper`` (the context's: rank 0's
        coordinator's under a secret) or by a gate thread of its own, which :attr:`gatekeeper` then is (a data
        plane shares it); none is accepted before :meth:`start`."""
        self.rank, self._ctx, self._config = config.rank, ctx, config
        self._gate: Optional[_zap.GateThread] = None
        self._pushes: dict[int, zmq.Socket] = {}
        self.monitors: dict[int, zmq.Socket] = {}  # each PUSH's handshakes
        self._made: set[int] = set()  # links whose handshake succeeded
        self._held: dict[int, list[tuple[list[Any], bool, Any]]] = {}  # what waits for its link
        self._fresh: set[int] = set()  # links connected since their rank was known keyed
        self.keyed: Callable[[int], bool] = _unknown  # does rank k's mailbox take this group's tokens? (the
        # driver's: a message came from k, which k sent after its WELCOME keyed it): then its handshake
        # cannot be refused for want of a key, and what goes there needs no wait for it (an ssend's
        # acknowledgement, made while the receiver's program is in the library, leaves before it is not)
        self.retry: dict[int, float] = {}  # links refused before they were made: when to try again (read
        # by the driver's wait, inline)
        self._broken: Optional[int] = None  # a link found broken while sending
        self._cut_off: set[int] = set()  # links whose messages still leaving are dropped at close
        self._next_look = 0.0  # when the links' monitors are next read, once every link is made
        self.quiet_until = 0.0  # till then progress() has nothing to do without ``look`` (nothing held, no
        # retry, no link broken: the driver asks without a call)
        self._endpoints: list[str] = []
        self._session, self._base = 0, b""  # the group's, from start()
        self.local: Optional[LocalLinks] = None  # the links to the ranks on this host, if offered
        self.via_local: set[int] = set()  # ranks whose one-host link is made: messages go there, unsigned
        self.offered: set[int] = set()  # ranks offering one not yet made (link() makes it, or gives up)
        self._free: dict[int, Any] = {}  # their links holding nothing (LocalLinks.free)
        self._copy_max = min(COPY_MAX, config.max_frame_bytes)  # a small value's one packet at most
        if config.local_mail:
            try:
                self.local = LocalLinks(config.max_frame_bytes)
            except OSError:  # (not Linux: ZeroMQ's links alone)
                self.local = None
        with _sockets.mapped(f"rank {self.rank} cannot open its mailbox port", address=True):
            if gatekeeper is None:
                self._gate = _zap.GateThread(ctx)
                gatekeeper = self._gate.gatekeeper
            gatekeeper.rekey(None, _zap.MAIL_DOMAIN)  # no token opens it before the WELCOME
            self.gatekeeper = gatekeeper
            try:
                self._pull, self.endpoint = bind_peer_port(ctx, config, gatekeeper, _zap.MAIL_DOMAIN,
                                                           config.max_frame_bytes)
            except BaseException:
                if self._gate is not None:
                    self._gate.close()
                if self.local is not None:
                    self.local.close()
                raise

    @property
    def source(self) -> zmq.Socket:
        """What a waiter watches for a message waiting."""
        return self._pull

    @property
    def local_name(self) -> Optional[str]:
        """The name ranks on this host reach this rank's one-host links at (None: none offered)."""
        return None if self.local is None else self.local.name

    def start(self, session: int, endpoints: list[str], base: bytes, rank: int,
              local: Optional[list[Optional[str]]] = None) -> None:
        """The group is welcomed: this port accepts the tokens of its group's key (``base``: the secret, or
        the WELCOME's key) for ``rank``, this replica's rank there (a group formed again numbers its ranks
        anew); ``endpoints``: every rank's mailbox; ``local``: every rank's one-host links' name (None: no
        rank offers them, or the group's host does not pass them on)."""
        self._endpoints, self._session, self._base, self.rank = endpoints, session, base, rank
        self.gatekeeper.rekey(self._key(self.rank), _zap.MAIL_DOMAIN)
        if self.local is not None and (local is None or sum(n is not None for n in local) < 2):
            self.local.close()  # nobody to reach that way
            self.local = None
        if self.local is not None and local is not None:
            key = _tokens.port_key(base, session, 0, _tokens.LOCAL_LABEL)
            self.local.start(key, session, rank, local)
            self.offered = {r for r, name in enumerate(local) if name is not None and r != rank}
            self.local.on_break = self._look_soon  # (a link closed for cause: progress() says it)
            self._free, self.local.then = self.local.free, self._recv_pull  # its recv, then the PULL's:
            self.recv = self.local.recv  # type: ignore[method-assign]  # (an attribute: no call between)

    def _key(self, rank: int) -> bytes:
        """The key of rank ``rank``'s mailbox tokens in this group."""
        return _tokens.port_key(self._base, self._session, rank, _tokens.MAIL_LABEL)

    def send(self, dest: int, frames: list[Any], track: bool, handle: Any) -> list[tuple[Any, Any]]:
        """Send ``frames`` to ``dest`` (never blocks: its window bounds what is
        queued), or keep them until its link is made; what went: (a tracker of
        its buffers if ``track``, else None; ``handle``), in order. To a rank
        :attr:`keyed` says takes the group's tokens, they go at once, libzmq
        queueing them until the handshake is done. To a rank on this host, over
        its one-host link (a tracker while part of it waits for the socket)."""
        if dest in self.via_local:
            go, frame = self._free.get(dest), frames[0]
            if go is not None and len(frames) == 1 and type(frame) is bytes and len(frame) <= self._copy_max:
                try:  # (a small value's one packet, on a link holding nothing: LocalLinks.send's, inline)
                    go(ONE_HEAD + frame)
                    return [(None, handle)]
                except OSError:  # (full: it waits behind; broken: as any message, below)
                    pass
            sent = self.local.send(dest, frames)  # type: ignore[union-attr]  # (a local link's)
            assert sent is not None  # (its link was made by link(): in via_local only then)
            if sent.done:
                return [(None, handle)]
            self.quiet_until = 0.0  # (progress() sends the rest)
            return [(sent if handle is not None else None, handle)]
        if dest not in self._pushes:
            self._connect(dest)
        if dest not in self._made:  # nothing goes before the handshake (a refused one is made again,
            went = self._opened(dest)  # with nothing queued on it to lose) unless it cannot be refused
            if went is None:
                self._held.setdefault(dest, []).append((frames, track, handle))
                self.quiet_until = 0.0
                return []
            return went + self._unhold(dest, [(frames, track, handle)])  # (no monitor event needed:
            # libzmq's I/O thread finishes the handshake without this program, which may be elsewhere)
        try:  # (_send's, inline: once per message; send_frames's too for a small value's one frame)
            if len(frames) == 1 and not track and len(frames[0]) < _sockets.ZERO_COPY_MIN_BYTES:
                send_frame(self._pushes[dest], frames[0], NOBLOCK)
                return [(None, handle)]
            return [(_sockets.send_frames(self._pushes[dest], frames, track), handle)]
        except zmq.Again:
            self._broken, self.quiet_until = dest, 0.0
            return [(None, handle)]

    def _look_soon(self) -> None:
        self.quiet_until = 0.0

    def _opened(self, dest: int) -> Optional[list[tuple[Any, Any]]]:
        """May the link to ``dest``, not yet made, take messages now? Yes (what
        went meanwhile, as :meth:`send` returns it) if ``dest`` is :attr:`keyed`
        and its connection was made since (:attr:`_fresh`: its handshake cannot
        be refused for want of a key), or now is: its monitor says it was made,
        or refused (then connected again, nothing queued on it). None: held (a
        handshake offered before ``dest`` was known keyed, its outcome unknown)."""
        if dest in self._fresh:
            return []
        if not self.keyed(dest):
            return None
        went: list[tuple[Any, Any]] = []
        broken = None
        if _sockets.readable(self.monitors[dest]):
            went, broken = self._look(dest, self.monitors[dest], time.monotonic())
        if broken is not None:
            self._broken, self.quiet_until = broken, 0.0
        if dest in self._made:
            return went
        if self.retry.pop(dest, None) is None:
            return None
        self._reconnect(dest)
        return went

    def _unhold(self, dest: int, more: list[tuple[list[Any], bool, Any]]) -> list[tuple[Any, Any]]:
        """Send what waited for the link to ``dest``, then ``more``, in order (as :meth:`send` returns)."""
        return [(self._send(dest, frames, track), handle)
                for frames, track, handle in [*self._held.pop(dest, []), *more]]

    def _send(self, dest: int, frames: list[Any], track: bool) -> Any:
        """Send without ever blocking: libzmq with no pipe to ``dest`` any more
        (its link broke) takes nothing, and that link is broken."""
        try:
            return _sockets.send_frames(self._pushes[dest], frames, track)
        except zmq.Again:
            self._broken, self.quiet_until = dest, 0.0
            return None

    def progress(self, now: float, look: bool = False) -> tuple[list[tuple[Any, Any]], Optional[int]]:
        """What each link's monitor says (``look``: a wait woke for one): a link made sends what waited for it
        (returned as :meth:`send` returns it); one refused before it was made (the other rank had not yet
        taken its WELCOME's key) is made again with a fresh token a moment later; one refused after (libzmq
        made it again after a reset, with its spent token) is broken: that rank is returned."""
        went: list[tuple[Any, Any]] = []
        broken, self._broken = self._broken, None
        local = self.local
        if local is not None:  # what waited for its socket goes; a one-host link its receiver closed for
            broke = local.progress()  # cause is broken (a link that closed as its rank ended is not:
            broken = broken if broke is None else broke  # the coordinator says that rank ended, or was lost)
        if not look and not self._held and not self.retry and broken is None and now < self._next_look:
            return went, None  # every link made: a refusal can wait a moment (a wait wakes for it)
        self._next_look = now + LOOK_S
        self.quiet_until = 0.0  # (until known again, below)
        for dest, monitor in self.monitors.items():
            if not _sockets.readable(monitor):  # (each look reads a monitor to the end: a wait
                continue  # watches its file descriptor, which only news sets again)
            made, refused = self._look(dest, monitor, now)
            went += made
            broken = broken if refused is None else refused
        for dest, due in list(self.retry.items()):
            if now >= due:
                del self.retry[dest]
                self._reconnect(dest)
        if not self._held and not self.retry and self._broken is None and not (local and local.holding()):
            self.quiet_until = self._next_look
        return went, broken

    def _look(self, dest: int, monitor: zmq.Socket, now: float) -> tuple[list[tuple[Any, Any]],
                                                                         Optional[int]]:
        """Read the monitor of the link to ``dest``, readable, to the end: what
        went once it was made, and ``dest`` if it broke (refused once made, or
        once :attr:`_fresh`)."""
        went: list[tuple[Any, Any]] = []
        broken = None
        for event, _ in _sockets.monitor_events(monitor):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and dest not in self._made:
                self._made.add(dest)
                went += self._unhold(dest, [])
            elif event in HANDSHAKE_FAILED:
                if dest in self._made or (dest in self._fresh and event == zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                    broken = dest  # (messages may have gone on it, and it cannot be made again)
                elif dest not in self._fresh:
                    self.retry.setdefault(dest, now + RETRY_S)
                # else: not made yet, its messages queued in libzmq, which tries again; a rank keyed
                # refuses nothing but a spent token: this one closed its mailbox as its program ended
                # (its FINAL settles what it received), or the connection was cut mid-handshake
        return went, broken

    def _reconnect(self, dest: int) -> None:
        """Connect to ``dest`` again with a fresh token (its handshake was refused)."""
        key, target = self._key(dest), self._endpoints[dest]
        with _sockets.mapped(f"rank {self.rank} cannot connect to rank {dest}'s mailbox {target}",
                             address=True):
            _zap.connect_with_token(self._pushes[dest], target, key, _zap.MAIL_DOMAIN)
        if self.keyed(dest):
            self._fresh.add(dest)

    def holding(self, but: Container[int] = ()) -> bool:
        """Messages wait for a link's handshake (to a rank not in ``but``)."""
        if not but:
            return bool(self._held)
        return any(queue for dest, queue in self._held.items() if dest not in but)

    def drop_held(self) -> dict[int, list[Any]]:
        """What still waits for its link, never to go (this rank sends no
        more): the handles of those messages, by rank."""
        held, self._held = self._held, {}
        return {dest: [handle for _, _, handle in queue] for dest, queue in held.items()}

    def drop_to(self, dest: int, sends_only: bool) -> list[Any]:
        """What waits for the link to ``dest`` never goes (``sends_only``: only
        the point-to-point sends; the tree's results still go): their handles."""
        queue = self._held.get(dest)
        if not queue:
            return []
        kept = [entry for entry in queue if sends_only and entry[2] is None]
        if kept:
            self._held[dest] = kept
        else:
            del self._held[dest]
        return [handle for _, _, handle in queue if handle is not None]

    def holds(self, handle: Any) -> Optional[int]:
        """The rank whose link's handshake the send ``handle`` waits for (None: none)."""
        return next((dest for dest, queue in self._held.items()
                     if any(h is handle for _, _, h in queue)), None)

    def held_last(self, handle: Any) -> Optional[int]:
        """The rank whose link's handshake the send ``handle`` waits for, as
        the last send held for it (None: it is no such send)."""
        for dest, queue in self._held.items():
            last = next((h for _, _, h in reversed(queue) if h is not None), None)
            if last is handle:
                return dest
        return None

    def drop_send(self, dest: int, handle: Any) -> None:
        """The send ``handle``, held for the link to ``dest``, never goes."""
        queue = [entry for entry in self._held.get(dest, []) if entry[2] is not handle]
        if queue:
            self._held[dest] = queue
        else:
            self._held.pop(dest, None)

    def _connect(self, dest: int) -> zmq.Socket:
        target = self._endpoints[dest]
        key = self._key(dest)
        with _sockets.mapped(f"rank {self.rank} cannot connect to rank {dest}'s mailbox {target}",
                             address=True):
            push = self._ctx.socket(zmq.PUSH)
            with _sockets.closed_on_error(push):
                set_peer_options(push, self._config, self._config.max_frame_bytes)  # (windows bound
                # what is queued)
                if "[" in target:
                    push.setsockopt(zmq.IPV6, 1)
                _zap.secure_client(push, key, _zap.MAIL_DOMAIN)
                monitor = self.monitors[dest] = _sockets.monitor_socket(
                    push, zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(HANDSHAKE_FAILED))
                _sockets.readable(monitor)  # asked once before the connect: its descriptor is then
                push.connect(target)  # set by news only (a wait watches it: no poll of its own)
        self._pushes[dest] = push
        if self.keyed(dest):
            self._fresh.add(dest)
        return push

    def link(self, dest: int) -> None:
        """Make the one-host link to ``dest``, which offers one, before its first message is encoded: a
        message that goes there is not signed (the link proved who made it), one to ZeroMQ is; if it cannot
        be made (another host or network namespace, another user's listener), ZeroMQ's, for good: one path a
        pair, so its order holds."""
        self.offered.discard(dest)
        if self.local is not None and self.local.connect(dest):
            self.via_local.add(dest)

    def connect(self, dests: list[int]) -> None:
        """Make the links to ``dests`` now (the tree's: a part must never wait for a handshake
        that only a wait on this group would finish; a one-host link, offered, is made here too)."""
        for dest in dests:
            if dest in self.offered:
                self.link(dest)
            if dest not in self._pushes and dest != self.rank and dest not in self.via_local:
                self._connect(dest)

    def made(self, dests: list[int]) -> bool:
        """Are the links to ``dests`` made (a one-host link's need no handshake)?"""
        return all(dest in self._made or dest in self.via_local for dest in dests)

    def links(self) -> dict[str, int]:
        """The file descriptors of the links' monitors, by their names in a waiter (the one-host
        links' one first, if any)."""
        found = {} if self.local is None else {LOCAL: self.local.fd}
        found.update((f"{MAIL} {dest}", monitor.FD) for dest, monitor in self.monitors.items())
        return found

    recv = reader("_pull")  # the next message waiting, without blocking (``waiting``: a poll found one)
    _recv_pull = recv  # (with one-host links, recv is theirs, which reads this next: see start)

    def cut_off(self, dests: Iterable[int]) -> None:
        """What the links to ``dests`` still send is dropped at :meth:`close`
        (their receivers were told it is lost)."""
        self._cut_off.update(dests)

    def close(self, linger_ms: int = 0) -> None:
        if self.local is not None:
            self.local.close(linger_ms, self._cut_off)
        for dest, push in self._pushes.items():
            push.close(linger=0 if dest in self._cut_off else linger_ms)
        for monitor in self.monitors.values():
            monitor.close(linger=0)
        self._pull.close(linger=0)
        if self._gate is not None:
            self._gate.close()
