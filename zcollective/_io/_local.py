"""One host's point-to-point links: Unix ``SOCK_SEQPACKET`` sockets between the ranks of one host.

Why (issue 47): a ZeroMQ message crosses libzmq's I/O thread on both sides; a Unix socket round trip
between two processes costs a fifth of it (benchmarks/README.md, *One host: small messages*). Each rank
listens at an abstract name (Linux: nothing on any filesystem, nothing left behind by a kill) of 128
random bits, and connects to a rank the first time it sends there. A link carries one direction only, so
a pair's two directions never wait on each other; SEQPACKET keeps packets whole and in order.

Who may connect: the abstract namespace has no permissions, so every connection is checked. The peer's
uid (``SO_PEERCRED``) must be this process's, and its first packet must prove, under the group's key, the
rank it claims in this session (HMAC-SHA256). A sender checks its listener's uid likewise.

Packets (little-endian)::

    AUTH   'A' MAGIC rank:u32 hmac:32B           a link's first packet
    ONE    'O' frame                             a message of one frame of at most FRAGMENT_BYTES
    WHOLE  'W' count:u32 length:u64*count frames  a message of at most FRAGMENT_BYTES, in one packet
    FIRST  'F' count:u32 size:u64                 a larger one: its ``size`` bytes (the lengths, then the
    MORE   'M' bytes                              frames) follow in packets of at most FRAGMENT_BYTES
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import select
import socket
import struct
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Optional

__all__ = ["LOCAL", "FRAGMENT_BYTES", "MAX_FRAMES", "LocalLinks", "Sent"]

LOCAL = "mail local"  # LocalLinks.fd's name in a waiter
NAME_PREFIX = "zcollective-"
NAME_BYTES = 16  # 128 random bits: another job can neither guess a name to squat nor one to reach
FRAGMENT_BYTES = 1 << 16  # a packet's payload at most: far below any send buffer (wmem_default: 208 KiB)
PACKET_MAX = 1 + FRAGMENT_BYTES  # (a MORE packet's kind byte)
SNDBUF_BYTES = 1 << 20  # asked for (the kernel caps it at net.core.wmem_max): fewer waits for EPOLLOUT
MIN_SNDBUF_BYTES = 2 * PACKET_MAX  # a packet above the send buffer can never go (EMSGSIZE): no link then
MAX_IOV = 1000  # pieces of one packet (IOV_MAX is 1024): a message of more frames goes in fragments
MAX_FRAMES = 1 << 20  # frames of one message at most (as _format._wire.DEFAULT_MAX_FRAMES); with
# max_frame_bytes, the bound on what a peer can make this rank allocate: MAX_FRAMES * (8 + max_frame_bytes)
MAX_EVENTS = 64  # epoll events read at a time
MAGIC = b"ZCL1"  # "zcollective local", version 1
AUTH, ONE, WHOLE, FIRST, MORE = b"AOWFM"
ONE_HEAD = bytes((ONE,))
COPY_MAX = 1 << 12  # a one-frame bytes message up to this goes copied behind its kind (cheaper)
AUTH_PACKET = struct.Struct("<B4sI32s")
COUNT = struct.Struct("<BI")
FIRST_PACKET = struct.Struct("<BIQ")
LENGTH = 8  # bytes of a frame's length
PEERCRED = struct.Struct("3i")  # pid, uid, gid
LABEL = b"zcollective-local|%d|%d|%d"  # what a link's HMAC signs: session, source, destination
IN_EVENTS = select.EPOLLIN if hasattr(select, "EPOLLIN") else 1
log = logging.getLogger("zcollective")
_LIVE: weakref.WeakSet[LocalLinks] = weakref.WeakSet()


class Sent:
    """A message handed to :meth:`LocalLinks.send`: ``done`` once every byte went to the kernel. Until
    then the caller's buffers, which the links hold references to (no copy), must not change."""

    __slots__ = ("done",)

    def __init__(self, done: bool) -> None:
        self.done = done


DONE = Sent(True)  # what send() returns for a message sent at once (shared: never changed)


class _Held:
    """A message's packets not yet sent: ``packet`` the next one, then those of ``packets``."""

    __slots__ = ("sent", "packets", "packet")

    def __init__(self, packets: Iterator[list[Any]]) -> None:
        self.sent, self.packets, self.packet = Sent(False), packets, next(packets, None)


class _Out:
    """A link this rank made, to ``rank``; ``sock`` None once broken."""

    __slots__ = ("sock", "rank", "held")

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock: Optional[socket.socket] = sock
        self.rank, self.held = rank, deque[_Held]()


class _In:
    """A link another process made: ``rank`` once its first packet proved it; a message under way."""

    __slots__ = ("sock", "pid", "uid", "rank", "buf", "off", "count")

    def __init__(self, sock: socket.socket, pid: int, uid: int) -> None:
        self.sock: Optional[socket.socket] = sock
        self.pid, self.uid, self.rank = pid, uid, -1
        self.buf: Optional[memoryview] = None  # a fragmented message's bytes, ``off`` of them in
        self.off = self.count = 0


class _Refused(Exception):
    """A link to close: its peer broke the protocol (the reason, logged), or ended (no reason)."""


def _address(name: str) -> bytes:
    return b"\0" + name.encode("ascii")


def _socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


def _peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end (as it was when it connected or listened)."""
    pid, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return pid, uid


def _whole(frames: list[Any], lengths: list[int]) -> Optional[list[Any]]:
    """The one packet of a message that fits in one, else None."""
    if len(frames) == 1 and lengths[0] <= FRAGMENT_BYTES:
        return [ONE_HEAD, frames[0]]
    head = COUNT.size + LENGTH * len(lengths)
    if len(frames) >= MAX_IOV or head + sum(lengths) > FRAGMENT_BYTES:
        return None
    return [struct.pack(f"<BI{len(lengths)}Q", WHOLE, len(lengths), *lengths), *frames]


def _fragments(frames: list[Any], lengths: list[int]) -> Iterator[list[Any]]:
    """A larger message's packets, made as they go: views of the caller's buffers, no copy."""
    table = struct.pack(f"<{len(lengths)}Q", *lengths)
    yield [FIRST_PACKET.pack(FIRST, len(lengths), len(table) + sum(lengths))]
    packet: list[Any] = [bytes((MORE,))]
    room = FRAGMENT_BYTES
    for frame in [table, *frames]:
        piece = memoryview(frame).cast("B")
        while piece.nbytes:
            packet.append(piece[:room])
            room -= packet[-1].nbytes
            piece = piece[packet[-1].nbytes:]
            if room == 0 or len(packet) == MAX_IOV:
                yield packet
                packet, room = [bytes((MORE,))], FRAGMENT_BYTES
    if len(packet) > 1:
        yield packet


def _split(view: memoryview, lengths: Iterable[int], at: int) -> list[Any]:
    frames = []
    for length in lengths:
        frames.append(view[at:at + length])
        at += length
    return frames


class LocalLinks:
    """One rank's links to the ranks on its host (module docstring); used by one thread. Its :attr:`fd`
    is readable when :meth:`recv` or :meth:`progress` has something to do: call both then."""

    def __init__(self, max_frame_bytes: int) -> None:
        """Listen at a fresh abstract name; OSError where that cannot be (not Linux): no local path then.
        Nothing is accepted before :meth:`start` (connections wait in the backlog)."""
        if not hasattr(select, "epoll") or not hasattr(socket, "SO_PEERCRED"):
            raise OSError("local links need Linux (abstract Unix sockets, SO_PEERCRED, epoll)")
        self.name = NAME_PREFIX + secrets.token_hex(NAME_BYTES)
        self._listener = _socket()
        try:
            self._listener.bind(_address(self.name))
            self._listener.listen(socket.SOMAXCONN)
            self._epoll = select.epoll()
        except BaseException:
            self._listener.close()
            raise
        self.fd, self._listen_fd = self._epoll.fileno(), self._listener.fileno()
        self._max_frame, self.rank, self.source = max_frame_bytes, -1, -1  # source: the last message's
        self._key, self._session, self._names = b"", 0, list[Optional[str]]()
        self._out: dict[int, _Out] = {}
        self._by_fd: dict[int, Any] = {}  # an fd in the epoll: its _In or _Out
        self._ready = deque[_In]()  # links the last look found readable, not yet read: one message each
        self._waiting: set[_Out] = set()  # links holding packets
        self._broken = deque[int]()  # ranks whose link broke while sending, not yet said
        self._refused: set[int] = set()
        self._scratch = bytearray(PACKET_MAX + 1)  # (a longer packet fills it: refused)
        self._view, self._kind = memoryview(self._scratch), bytearray(1)
        self._one_max = 1 + min(FRAGMENT_BYTES, max_frame_bytes)  # a ONE packet's bytes at most
        self._closed = False
        _LIVE.add(self)

    def start(self, key: bytes, session: int, rank: int, names: list[Optional[str]]) -> None:
        """The group's key and session, this rank's rank, every rank's listener name (None: none). Once."""
        self._key, self._session, self.rank, self._names = bytes(key), session, rank, list(names)
        self._epoll.register(self._listener, IN_EVENTS)

    def offers(self, dest: int) -> bool:
        """May messages to ``dest`` go over a local link? Never again once one could not be made."""
        return (0 <= dest < len(self._names) and dest != self.rank and self._names[dest] is not None
                and dest not in self._refused)

    def _mac(self, src: int, dest: int) -> bytes:
        return hmac.new(self._key, LABEL % (self._session, src, dest), hashlib.sha256).digest()

    # -- sending ---------------------------------------------------------------------------------------

    def send(self, dest: int, frames: list[Any]) -> Optional[Sent]:
        """Send ``frames`` (bytes-like) to ``dest`` whole, in order, never blocking: what the socket cannot
        take now is held (references, no copy) and goes first when :meth:`progress` can. None: no link
        could be made (``dest`` is never offered again). To a broken link: dropped, never done (the
        break is :meth:`progress`'s to say). ValueError: a frame above max_frame_bytes, or too many."""
        out = self._out.get(dest) or self._connect(dest)
        if out is None:
            return None
        if len(frames) == 1 and type(frames[0]) is bytes and len(frames[0]) <= COPY_MAX and not out.held:
            return self._one(out, frames[0])
        lengths = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
        if len(frames) > MAX_FRAMES or (frames and max(lengths) > self._max_frame):
            raise ValueError(f"a message of {len(frames)} frames, one above {self._max_frame} bytes?")
        if out.sock is None:
            return Sent(False)
        packet = _whole(frames, lengths)
        if packet is not None and not out.held:
            try:
                out.sock.sendmsg(packet)
                return DONE
            except BlockingIOError:
                pass
            except OSError:
                self._break(out)
                return Sent(False)
        return self._hold(out, iter((packet,)) if packet is not None else _fragments(frames, lengths))

    def _one(self, out: _Out, frame: bytes) -> Sent:
        """A small bytes frame: copied behind its kind (cheaper than an iovec at this size)."""
        if len(frame) > self._max_frame:
            raise ValueError(f"a frame above {self._max_frame} bytes")
        if out.sock is not None:
            try:
                out.sock.send(ONE_HEAD + frame)
                return DONE
            except BlockingIOError:
                return self._hold(out, iter(([ONE_HEAD, frame],)))
            except OSError:
                self._break(out)
        return Sent(False)

    def _connect(self, dest: int) -> Optional[_Out]:
        """A link to ``dest``, its first packet (AUTH) on its way; None (and refused) if none can be made."""
        if not self.offers(dest):
            return None
        sock = _socket()
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < SNDBUF_BYTES:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < MIN_SNDBUF_BYTES:
                raise OSError("send buffer too small for a packet")
            sock.connect(_address(str(self._names[dest])))
            pid, uid = _peer(sock)
            if uid != os.getuid():
                log.warning("zcollective: rank %d's local name is held by pid %d of uid %d: not used",
                            dest, pid, uid)
                raise PermissionError("listener of another uid")
            self._epoll.register(sock, IN_EVENTS)  # (readable: its peer closed)
        except OSError:
            sock.close()
            self._refused.add(dest)
            return None
        out = self._out[dest] = self._by_fd[sock.fileno()] = _Out(sock, dest)
        self._hold(out, iter(([AUTH_PACKET.pack(AUTH, MAGIC, self.rank, self._mac(self.rank, dest))],)))
        return out

    def _hold(self, out: _Out, packets: Iterator[list[Any]]) -> Sent:
        held = _Held(packets)
        out.held.append(held)
        if len(out.held) == 1:
            self._push(out)
        return held.sent

    def _push(self, out: _Out) -> None:
        """Send what ``out`` holds while its socket takes it; watch for EPOLLOUT while anything is left."""
        try:
            while out.held:
                held = out.held[0]
                while held.packet is not None:
                    out.sock.sendmsg(held.packet)  # type: ignore[union-attr]
                    held.packet = next(held.packets, None)
                held.sent.done = True
                out.held.popleft()
        except BlockingIOError:
            self._watch(out, True)
            return
        except OSError:
            self._break(out)
            return
        self._watch(out, False)

    def _watch(self, out: _Out, writing: bool) -> None:
        if writing == (out in self._waiting):
            return
        if writing:
            self._waiting.add(out)
        else:
            self._waiting.discard(out)
        if out.sock is not None and self._by_fd.get(out.sock.fileno()) is out:
            self._epoll.modify(out.sock, IN_EVENTS | (select.EPOLLOUT if writing else 0))  # type: ignore

    def _break(self, out: _Out) -> None:
        """``out`` broke while sending (EPIPE, ECONNRESET...): its held packets dropped, its rank said."""
        self._waiting.discard(out)
        out.held.clear()
        self._unwatch(out)
        if out.sock is not None:
            out.sock.close()
            out.sock = None
            self._broken.append(out.rank)

    def _unwatch(self, link: Any) -> None:
        """Out of the epoll, before its socket closes (a forked copy of it would keep it there)."""
        if link.sock is not None and self._by_fd.pop(link.sock.fileno(), None) is not None:
            self._epoll.unregister(link.sock)

    def progress(self) -> Optional[int]:
        """Send what was held where the sockets now take it; a rank whose link broke, else None."""
        for out in list(self._waiting):
            self._push(out)
        return self._broken.popleft() if self._broken else None

    def holding(self) -> bool:
        """Is anything held for any link?"""
        return bool(self._waiting)

    # -- receiving -------------------------------------------------------------------------------------

    def recv(self) -> Optional[list[Any]]:
        """The next whole message from any link (frames: bytes or memoryview; :attr:`source`: its rank),
        or None. Never blocks, never raises for a peer's doing; links take turns, one message each."""
        ready = self._ready
        looked = not ready
        if looked:
            self._look()
        while True:
            while ready:
                link = ready.popleft()
                msg = self._read(link) if link.sock is not None else None
                if msg is not None:
                    self.source = link.rank
                    return msg
            if looked:
                return None
            self._look()  # (the links the last look found had nothing: others may have)
            looked = True

    def _look(self) -> None:
        """Read the epoll: connections to accept, links that may have a message, links closed."""
        for fd, events in self._epoll.poll(0, MAX_EVENTS):
            link = self._by_fd.get(fd)
            if type(link) is _In:
                self._ready.append(link)
            elif fd == self._listen_fd:
                self._accept()
            elif link is not None and events & ~select.EPOLLOUT:  # an _Out's peer closed it
                self._unwatch(link)
                if link.held:
                    self._push(link)  # (EPIPE: broken, said by progress())

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # (EAGAIN: no more; EMFILE...: left in the backlog)
                return
            sock.setblocking(False)
            link = _In(sock, *_peer(sock))
            if link.uid != os.getuid():
                self._drop(link, "another uid")
                continue
            self._by_fd[sock.fileno()] = link
            self._epoll.register(sock, IN_EVENTS)
            self._ready.append(link)  # (its first packet may be there already)

    def _read(self, link: _In) -> Optional[list[Any]]:
        """The next message of ``link``, or None: none whole yet, or the link is closed."""
        try:
            while True:
                if link.buf is None:
                    n = link.sock.recv_into(self._scratch)  # type: ignore[union-attr]
                    if self._scratch[0] == ONE and 0 < n <= self._one_max and link.rank >= 0:
                        return [self._view[1:n].tobytes()]  # (a small value's shape: fewest steps)
                    msg = self._packet(link, n)
                else:
                    msg = self._more(link)
                if msg is not None:
                    return msg
        except BlockingIOError:
            return None
        except _Refused as refused:
            self._drop(link, str(refused))
        except OSError as e:
            self._drop(link, f"reading: {e}")
        return None

    def _packet(self, link: _In, n: int) -> Optional[list[Any]]:
        """One packet of ``n`` bytes, not part of a fragmented message: a whole message, or None."""
        view = self._view
        if n == 0:
            raise _Refused("")  # (EOF: its peer closed it)
        if n > PACKET_MAX:
            raise _Refused(f"a packet above {PACKET_MAX} bytes")
        if link.rank < 0:
            self._authenticate(link, n)
        elif view[0] == WHOLE:
            return self._whole(n)
        elif view[0] == FIRST and n == FIRST_PACKET.size:
            self._first(link)
        else:
            raise _Refused(f"a packet out of place (kind {view[0]}, {n} bytes)")
        return None

    def _authenticate(self, link: _In, n: int) -> None:
        if n != AUTH_PACKET.size:
            raise _Refused(f"a first packet of {n} bytes, not an authentication")
        kind, magic, rank, mac = AUTH_PACKET.unpack_from(self._view)
        if kind != AUTH or magic != MAGIC:
            raise _Refused("a first packet not an authentication (kind, magic)")
        if not 0 <= rank < len(self._names) or rank == self.rank:
            raise _Refused(f"it claims rank {rank}, not another rank of {len(self._names)}")
        if not hmac.compare_digest(mac, self._mac(rank, self.rank)):
            raise _Refused(f"a wrong HMAC for rank {rank} (another key or session)")
        link.rank = rank

    def _whole(self, n: int) -> list[Any]:
        view = self._view
        count = COUNT.unpack_from(view)[1]
        start = COUNT.size + LENGTH * count
        if start > n:
            raise _Refused(f"a message of {count} frames in {n} bytes")
        lengths = struct.unpack_from(f"<{count}Q", view, COUNT.size)
        self._check(lengths, n - start)
        if count == 1:
            return [view[start:n].tobytes()]
        return _split(memoryview(view[start:n].tobytes()), lengths, 0)  # (the scratch is reused)

    def _check(self, lengths: tuple[int, ...], size: int) -> None:
        if sum(lengths) != size or (lengths and max(lengths) > self._max_frame):
            raise _Refused(f"frames' lengths that do not add up to {size} bytes or exceed max_frame_bytes")

    def _first(self, link: _In) -> None:
        """A fragmented message begins: its bytes' room, within the bound (MAX_FRAMES)."""
        _, count, size = FIRST_PACKET.unpack_from(self._view)
        if not 0 < count <= MAX_FRAMES or not LENGTH * count <= size <= count * (LENGTH + self._max_frame):
            raise _Refused(f"a message of {size} bytes in {count} frames: above the bound")
        link.buf, link.off, link.count = memoryview(bytearray(size)), 0, count

    def _more(self, link: _In) -> Optional[list[Any]]:
        """Take one fragment, into its place: the message once whole, else None."""
        view = link.buf
        assert view is not None and link.sock is not None
        n, _, flags, _ = link.sock.recvmsg_into([self._kind, view[link.off:link.off + FRAGMENT_BYTES]])
        if n == 0:
            raise _Refused("")
        if flags & socket.MSG_TRUNC or self._kind[0] != MORE:
            raise _Refused(f"a packet out of place in a fragmented message ({n} bytes)")
        link.off += n - 1
        if link.off < len(view):
            return None
        link.buf, table = None, LENGTH * link.count
        lengths = struct.unpack_from(f"<{link.count}Q", view)
        self._check(lengths, len(view) - table)
        return _split(view, lengths, table)

    def _drop(self, link: _In, why: str) -> None:
        """Close ``link`` (a message under way is lost with it), saying why if its peer was at fault."""
        if why:
            log.warning("zcollective: local link from pid %d uid %d (rank %s) closed: %s", link.pid,
                        link.uid, link.rank if link.rank >= 0 else "unproven", why)
        self._unwatch(link)
        link.buf = None
        if link.sock is not None:
            link.sock.close()
            link.sock = None

    # -- the end ---------------------------------------------------------------------------------------

    def close(self, linger_ms: int = 0, cut_off: Iterable[int] = ()) -> None:
        """Held packets get ``linger_ms`` to go (those to ``cut_off``: dropped); close all. Idempotent."""
        if self._closed:
            return
        deadline, cut = time.monotonic() + linger_ms / 1000, set(cut_off)
        for out in list(self._waiting):
            if out.rank not in cut:
                self._linger(out, deadline)
        self._shut()

    def _linger(self, out: _Out, deadline: float) -> None:
        poller = select.poll()
        poller.register(out.sock, select.POLLOUT)  # type: ignore[arg-type]
        while out in self._waiting and (left := deadline - time.monotonic()) > 0:
            poller.poll(math.ceil(left * 1000))
            self._push(out)

    def _shut(self) -> None:
        """Close every socket and the epoll, nothing else: a forked child's copies do this only (an
        epoll's registrations are shared with the parent, its sockets' ends too)."""
        self._closed = True
        for link in [*self._out.values(), *self._by_fd.values()]:
            if link.sock is not None:
                link.sock.close()
                link.sock = None
        self._listener.close()
        self._epoll.close()
        self._out.clear()
        self._by_fd.clear()
        self._ready.clear()
        self._waiting.clear()
        _LIVE.discard(self)


def _forget_in_child() -> None:
    """A forked child never touches its parent's links: its copies of them closed, the parent's intact."""
    for links in list(_LIVE):
        links._shut()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
