"""One host's point-to-point links: Unix ``SOCK_SEQPACKET`` sockets between the ranks of one host.

Why (issue 47): a ZeroMQ message crosses libzmq's I/O thread on both sides; a Unix socket round trip
between two processes costs a fifth of it (benchmarks/README.md, *One host: small messages*). Each rank
listens at an abstract name of 128 random bits (Linux: nothing on any filesystem, nothing left by a kill)
and connects to a rank the first time it sends there. A link carries one direction only, so a pair's two
directions never wait on each other; SEQPACKET keeps packets whole and in order.

Who may connect: the abstract namespace has no permissions, so the peer's uid (``SO_PEERCRED``) must be
this process's, and a link's first packet must prove, under the group's key, the rank it claims in this
session (HMAC-SHA256). A sender checks its listener's uid likewise. The packets: :mod:`.._format._packets`.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

from .._format import _packets
from .._format._packets import ONE, ONE_HEAD, PACKET_MAX, PacketError
from . import _interrupts

__all__ = ["LOCAL", "LocalLinks", "Sent"]

LOCAL = "mail local"  # LocalLinks.fd's name in a waiter
NAME_BYTES = 16  # 128 random bits after _packets.NAME_PREFIX: no other job guesses a name to squat or reach
SNDBUF_BYTES = 1 << 20  # asked for (the kernel caps it at net.core.wmem_max): fewer waits for EPOLLOUT
MIN_SNDBUF_BYTES = 2 * PACKET_MAX  # below, a packet could never go (EMSGSIZE): no link then
MAX_EVENTS = 64  # epoll events read at a time
ACCEPT_BATCH = 16  # connections accepted a look at most (a flood of strangers never holds a rank's wait)
MAX_UNPROVEN = 32  # links not yet proven held at most: a newer one closes the oldest (no AUTH comes late)
FIRST_REFUSALS = 8  # refusals logged one by one; later ones only counted, in one line at each power of 2
DROPPED = b"X"  # what a receiver writes back on a proven link it closes for cause (a loss, not an end)
WRITABLE = 2  # POLLOUT, as zmq_poll takes it for a file descriptor
PEERCRED = struct.Struct("3i")
IN_EVENTS = getattr(select, "EPOLLIN", 1)  # (the module imports everywhere; LocalLinks needs Linux)
log = logging.getLogger("zcollective")
_LIVE: weakref.WeakSet[LocalLinks] = weakref.WeakSet()  # every LocalLinks open: a forked child's to close


class Sent:
    """A message handed to :meth:`LocalLinks.send`: ``done`` once every byte went to the kernel. Until
    then the links hold references to the caller's buffers (no copy), which must not change."""

    __slots__ = ("done",)

    def __init__(self, done: bool) -> None:
        self.done = done


DONE = Sent(True)  # what send() returns for a message that went at once (shared: never changed)


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
    """A link another process made: ``rank`` once its first packet proved it; ``buf``: a message under
    way, ``off`` bytes of it in."""

    __slots__ = ("sock", "pid", "uid", "rank", "buf", "off", "count")

    def __init__(self, sock: socket.socket, pid: int, uid: int) -> None:
        self.sock: Optional[socket.socket] = sock
        self.pid, self.uid, self.rank, self.off, self.count = pid, uid, -1, 0, 0
        self.buf: Optional[memoryview] = None


_Refused = PacketError  # a link to close: its peer broke the protocol (the reason, logged) or ended (none)


def _address(name: str) -> bytes:
    return b"\0" + name.encode("ascii")


def _socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


def _said_dropped(sock: socket.socket) -> bool:
    """Did the receiver of a link this rank made close it for cause (:data:`DROPPED` waits to be read)?
    A receiver closing with packets unread resets the link first (ECONNRESET, said once): read again."""
    for _ in range(2):
        try:
            return sock.recv(len(DROPPED)) == DROPPED
        except BlockingIOError:
            return False
        except OSError:
            continue
    return False


def _peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end (when it connected or listened)."""
    pid, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return pid, uid


class LocalLinks:
    """One rank's links to the ranks on its host (module docstring), used by one thread with signals
    deferred (an exception between a packet's send and its bookkeeping would send it twice). Its
    :attr:`fd` is readable when :meth:`recv` or :meth:`progress` has something to do: call both then."""

    def __init__(self, max_frame_bytes: int) -> None:
        """Listen at a fresh abstract name; OSError where that cannot be (not Linux): no local path then.
        Nothing is accepted before :meth:`start` (connections wait in the backlog)."""
        if not hasattr(select, "epoll") or not hasattr(socket, "SO_PEERCRED"):
            raise OSError("local links need Linux (abstract Unix sockets, SO_PEERCRED, epoll)")
        self.name = _packets.NAME_PREFIX + secrets.token_hex(NAME_BYTES)
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
        self._copy_max = min(_packets.COPY_MAX, max_frame_bytes)
        self._one_max = 1 + min(_packets.FRAGMENT_BYTES, max_frame_bytes)  # a ONE packet's bytes at most
        self._key, self._session, self._names = b"", 0, list[Optional[str]]()
        self._out: dict[int, _Out] = {}
        self._by_fd: dict[int, Any] = {}  # each fd in the epoll but the listener's: its _In or _Out
        self._ready = deque[_In]()  # links the last look found readable, not yet read: one message each
        self._waiting: set[_Out] = set()  # links holding packets (their EPOLLOUT watched)
        self._broken = deque[int]()  # ranks whose link broke while sending, not yet said
        self._refused: set[int] = set()
        self._unproven = deque[_In]()  # links accepted, not yet proven, oldest first (MAX_UNPROVEN)
        self._refusals = 0  # connections refused or closed (their log: _refusal)
        self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # let go to refuse one when out of fds
        self.free: dict[int, Callable[[bytes], int]] = {}  # by rank, the send of a link holding nothing (a
        # one-packet message of at most COPY_MAX bytes, ONE_HEAD first, may go there directly)
        self.then: Optional[Callable[[bool], Optional[list[Any]]]] = None  # recv()'s next source, if any
        self.on_break: Optional[Callable[[], None]] = None  # told when a link breaks (progress() says which)
        self._scratch = bytearray(PACKET_MAX + 1)  # (a longer packet fills it: refused)
        self._view, self._kind, self._closed = memoryview(self._scratch), bytearray(1), False
        _LIVE.add(self)

    def start(self, key: bytes, session: int, rank: int, names: list[Optional[str]]) -> None:
        """The group's key and session, this rank's rank, every rank's listener name (None: none). Once."""
        self._key, self._session, self.rank, self._names = bytes(key), session, rank, list(names)
        self._epoll.register(self._listener, IN_EVENTS)

    def connect(self, dest: int) -> bool:
        """Make the link to ``dest`` now (its first packet on its way): False if none can be made."""
        return dest in self._out or self._connect(dest) is not None

    def offers(self, dest: int) -> bool:
        """May messages to ``dest`` go over a local link? Never again once one could not be made."""
        return (0 <= dest < len(self._names) and dest != self.rank and self._names[dest] is not None
                and dest not in self._refused)

    def send(self, dest: int, frames: list[Any]) -> Optional[Sent]:
        """Send ``frames`` (bytes-like) to ``dest`` whole, in order, never blocking: what the socket cannot
        take now is held and goes before anything later (:meth:`progress`). None: no link could be made
        (``dest`` is never offered again). To a broken link: dropped, never done (:meth:`progress` says
        the break). ValueError: a frame above max_frame_bytes, not contiguous, or too many (or none)."""
        out = self._out.get(dest) or self._connect(dest)
        if out is None:
            return None
        if out.sock is None:
            return Sent(False)
        frame = frames[0] if len(frames) == 1 else None
        if type(frame) is bytes and len(frame) <= self._copy_max:
            packet: Any = ONE_HEAD + frame  # (a small value's shape: copied, cheaper than an iovec)
        else:
            lengths = _packets.lengths_of(frames, self._max_frame)
            packet = _packets.whole(frames, lengths)
            if packet is None:
                return self._hold(out, _packets.packets(frames, lengths))
        sent = None if out.held else self._now(out, packet)
        return sent or self._hold(out, iter((packet if type(packet) is list else [packet],)))

    def _now(self, out: _Out, packet: Any) -> Optional[Sent]:
        """``packet`` (bytes, or a list of buffers) sent at once: DONE; dropped, its link broken: not
        done; or None: the socket cannot take it now."""
        try:
            if type(packet) is bytes:
                out.sock.send(packet)  # type: ignore[union-attr]
            else:
                out.sock.sendmsg(packet)  # type: ignore[union-attr]
            return DONE
        except BlockingIOError:
            return None
        except OSError:
            self._break(out)
            return Sent(False)

    def _connect(self, dest: int) -> Optional[_Out]:
        """A link to ``dest``, its first packet (AUTH) on its way; None (refused) if none can be made."""
        if not self.offers(dest):
            return None
        sock = _socket()
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < SNDBUF_BYTES:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < MIN_SNDBUF_BYTES:
                raise OSError("a send buffer too small for a packet")
            sock.connect(_address(str(self._names[dest])))  # (EAGAIN: its backlog is full)
            pid, uid = _peer(sock)
            if uid != os.getuid():
                log.warning("zcollective: rank %d's local name is held by pid %d of uid %d: not used",
                            dest, pid, uid)
                raise PermissionError("a listener of another uid")
            self._epoll.register(sock, IN_EVENTS)  # (readable: its peer closed it)
        except OSError:
            sock.close()
            self._refused.add(dest)
            return None
        out = self._out[dest] = self._by_fd[sock.fileno()] = _Out(sock, dest)
        self._hold(out, iter(([_packets.auth(self._key, self._session, self.rank, dest)],)))
        return out

    def _hold(self, out: _Out, packets: Iterator[list[Any]]) -> Sent:
        held = _Held(packets)
        out.held.append(held)
        self.free.pop(out.rank, None)  # (what comes next goes behind it)
        if len(out.held) == 1:
            self._push(out)
        return DONE if held.sent.done else held.sent

    def _push(self, out: _Out) -> None:
        """Send what ``out`` holds while its socket takes it; watch its EPOLLOUT while anything is left."""
        try:
            while out.held:
                held = out.held[0]
                while held.packet is not None:
                    out.sock.sendmsg(held.packet)  # type: ignore[union-attr]
                    held.packet = next(held.packets, None)
                held.sent.done = True
                out.held.popleft()
        except BlockingIOError:
            return self._watch(out, True)
        except OSError:
            return self._break(out)
        self._watch(out, False)
        if out.sock is not None:
            self.free[out.rank] = out.sock.send

    def _watch(self, out: _Out, writing: bool) -> None:
        if writing != (out in self._waiting):
            (self._waiting.add if writing else self._waiting.discard)(out)
            if out.sock is not None and self._by_fd.get(out.sock.fileno()) is out:
                self._epoll.modify(out.sock, IN_EVENTS | (select.EPOLLOUT if writing else 0))

    def _break(self, out: _Out, dropped: bool = False) -> None:
        """``out`` broke (EPIPE, ECONNRESET...): what it held dropped, never done; its rank said by
        :meth:`progress` if its receiver closed it for cause (``dropped``: a loss), not if it ended (its
        FINAL, or its loss, comes from the coordinator and decides what was sent)."""
        if not dropped and out.sock is not None:  # (a send found the break first: was it closed for cause?)
            dropped = _said_dropped(out.sock)
        self._waiting.discard(out)
        out.held.clear()
        self._forget(out)
        if dropped:
            self._broken.append(out.rank)
            if self.on_break is not None:
                self.on_break()

    def _forget(self, link: Any) -> None:
        """Out of the epoll, then closed (unregistered first: a forked copy would keep it there)."""
        if type(link) is _Out and self._out.get(link.rank) is link:
            self.free.pop(link.rank, None)
        if link.sock is not None:
            if self._by_fd.pop(link.sock.fileno(), None) is not None:
                self._epoll.unregister(link.sock)
            link.sock.close()
            link.sock = None

    def progress(self) -> Optional[int]:
        """Send what was held where the sockets now take it; a rank whose link broke (one a call), else
        None."""
        for out in list(self._waiting):
            self._push(out)
        return self._broken.popleft() if self._broken else None

    def holding(self) -> bool:
        """Is anything held for any link?"""
        return bool(self._waiting)

    def recv(self, waiting: bool = False) -> Optional[list[Any]]:
        """The next whole message from any link (frames: bytes or memoryview; :attr:`source`: its rank),
        else what :attr:`then` gives (``waiting`` passed on), or None. Never blocks, never raises for a
        peer's doing; links take turns, one message each. The common case (a proven link's small
        message, the epoll's read) is written inline: this is on every message's path."""
        ready, scratch = self._ready, self._scratch
        looked = False
        while True:
            while ready:
                link = ready.popleft()
                if link.sock is None:
                    continue
                if link.buf is None and link.rank >= 0:  # (_read's first step, inline)
                    try:
                        n = link.sock.recv_into(scratch)
                    except BlockingIOError:
                        continue
                    except OSError as e:
                        self._drop(link, f"reading: {e}")
                        continue
                    if scratch[0] == ONE and 0 < n <= self._one_max:
                        self.source = link.rank
                        return [self._view[1:n].tobytes()]
                    msg = self._read(link, n)
                else:
                    msg = self._read(link)
                if msg is not None:
                    self.source = link.rank
                    return msg
            if looked:
                if self.then is None:
                    return None
                self.source = -1  # (what comes is not a link's: the next source's)
                return self.then(waiting)
            looked = True
            for fd, events in self._epoll.poll(timeout=0, maxevents=MAX_EVENTS):  # (links that may have a
                found = self._by_fd.get(fd)  # message; connections to accept; links closed)
                if type(found) is _In:
                    ready.append(found)
                else:
                    self._event(fd, found, events)

    def _event(self, fd: int, link: Any, events: int) -> None:
        """The epoll's news of the listener (connections to accept) or of a link this rank made."""
        if fd == self._listen_fd:
            self._accept()
        elif link is not None and events & ~select.EPOLLOUT:  # (an _Out: its peer closed it)
            if _said_dropped(link.sock):  # (closed for cause, or ended: EOF)
                return self._break(link, dropped=True)
            self._epoll.unregister(fd)  # (a send to it finds the break)
            del self._by_fd[fd]
            if link.held:
                self._push(link)  # (EPIPE: broken)

    def _accept(self) -> None:
        """Take in at most :data:`ACCEPT_BATCH` connections (the rest wait for the next look). Out of
        descriptors, one is refused with the one kept spare, so the listener never stays readable."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
                sock.setblocking(False)
                link = _In(sock, *_peer(sock))
            except BlockingIOError:
                return
            except OSError as exc:  # (EMFILE, ENFILE: out of descriptors)
                return self._refuse_one(exc)
            if link.uid != os.getuid():
                self._drop(link, "another uid")
                continue
            self._by_fd[sock.fileno()] = link
            self._epoll.register(sock, IN_EVENTS)
            self._unproven.append(link)
            if len(self._unproven) > MAX_UNPROVEN:
                self._drop(self._unproven.popleft(), f"no proof among the {MAX_UNPROVEN} latest connections")
            self._ready.append(link)  # (its first packet may be there already)

    def _refuse_one(self, exc: OSError) -> None:
        """Out of descriptors: the spare one let go, the connection waiting taken and closed (told it
        was dropped: its rank fails loudly), the spare taken again."""
        if self._spare < 0:
            return
        os.close(self._spare)
        try:
            sock, _ = self._listener.accept()
            with contextlib.suppress(OSError):
                sock.send(DROPPED)
            sock.close()
            self._refusal(f"a connection refused: this rank is out of file descriptors ({exc.strerror})")
        except OSError:
            pass
        finally:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def _refusal(self, why: str) -> None:
        """Log a refused or closed connection: the first few alone, then a count now and then."""
        self._refusals += 1
        n = self._refusals
        if n <= FIRST_REFUSALS:
            log.warning("zcollective: %s%s", why, "; later ones only counted" if n == FIRST_REFUSALS else "")
        elif n & (n - 1) == 0:
            log.warning("zcollective: %d connections to this rank's one-host links refused or closed", n)

    def _read(self, link: _In, n: Optional[int] = None) -> Optional[list[Any]]:
        """The next message of ``link`` (``n``: the bytes of its first packet, read already), or None:
        none whole yet, or the link closed."""
        try:
            while True:
                if link.buf is None:
                    if n is None:
                        n = link.sock.recv_into(self._scratch)  # type: ignore[union-attr]
                        if self._scratch[0] == ONE and 0 < n <= self._one_max and link.rank >= 0:
                            return [self._view[1:n].tobytes()]  # (a small value's shape: fewest steps)
                    msg, n = self._packet(link, n), None
                else:
                    msg = self._more(link)
                if msg is not None:
                    return msg
        except BlockingIOError:
            return None
        except _Refused as refused:
            self._drop(link, str(refused))
        except MemoryError:  # (within the bound, more than this host can give)
            self._drop(link, "a message too large to hold")
        except OSError as e:
            self._drop(link, f"reading: {e}")
        return None

    def _packet(self, link: _In, n: int) -> Optional[list[Any]]:
        """A packet of ``n`` bytes that begins something: the link, or a message (None: not whole yet)."""
        if n == 0:
            raise _Refused("")  # (EOF: its peer closed it)
        if n > PACKET_MAX:
            raise _Refused(f"a packet above {PACKET_MAX} bytes")
        if link.rank < 0:
            self._authenticate(link, n)
            return None
        count, size = _packets.first(self._view, n, self._max_frame)
        data = n - _packets.HEAD.size
        if data == size:  # (whole in this packet: one copy out of the scratch buffer)
            whole = memoryview(self._view[_packets.HEAD.size:n].tobytes())
            return _packets.frames_of(whole, count, self._max_frame)
        link.buf, link.off, link.count = memoryview(bytearray(size)), data, count
        link.buf[:data] = self._view[_packets.HEAD.size:n]
        return None

    def _authenticate(self, link: _In, n: int) -> None:
        link.rank = _packets.proven(self._view[:n], self._key, self._session, self.rank, len(self._names))
        self._unproven.remove(link)

    def _more(self, link: _In) -> Optional[list[Any]]:
        """Take one MORE packet, into its place: the message once whole, else None."""
        view = link.buf
        assert view is not None and link.sock is not None
        piece = view[link.off:link.off + _packets.FRAGMENT_BYTES]
        n, _, flags, _ = link.sock.recvmsg_into([self._kind, piece])
        if n == 0:
            raise _Refused("")
        if flags & socket.MSG_TRUNC or self._kind[0] != _packets.MORE:
            raise _Refused(f"a packet out of place in a message ({n} bytes)")
        link.off += n - 1
        if link.off < len(view):
            return None
        link.buf = None
        return _packets.frames_of(view, link.count, self._max_frame)

    def _drop(self, link: _In, why: str) -> None:
        """Close ``link`` (a message under way is lost with it), saying why if its peer was at fault; a
        proven peer closed for cause is told (:data:`DROPPED`): its rank fails the group, loudly."""
        if why:
            self._refusal(f"local link from pid {link.pid} uid {link.uid} (rank "
                          f"{link.rank if link.rank >= 0 else 'unproven'}) closed: {why}")
            if link.rank >= 0 and link.sock is not None:
                with contextlib.suppress(OSError):
                    link.sock.send(DROPPED)
        if link in self._unproven:
            self._unproven.remove(link)
        self._forget(link)
        link.buf = None

    def close(self, linger_ms: int = 0, cut_off: Iterable[int] = ()) -> None:
        """Held packets get ``linger_ms`` to go (those to ``cut_off``: dropped); close all. Idempotent."""
        deadline, cut = time.monotonic() + linger_ms / 1000, set(cut_off)
        try:
            for out in [out for out in self._waiting if out.rank not in cut]:
                while out in self._waiting and out.sock and (left := deadline - time.monotonic()) > 0:
                    _interrupts.wait([(out.sock.fileno(), WRITABLE)], math.ceil(left * 1000))
                    self._push(out)
        finally:  # (an interrupt in the wait: closed all the same)
            self._shut()

    def _shut(self) -> None:
        """Close every socket and the epoll, nothing else: all a forked child does with its copies (the
        epoll's registrations and the sockets' ends are its parent's too)."""
        if not self._closed:
            for link in [*self._out.values(), *self._by_fd.values()]:
                if link.sock is not None:
                    link.sock.close()
                    link.sock = None
            self._listener.close()
            self._epoll.close()
            if self._spare >= 0:
                os.close(self._spare)
                self._spare = -1
            self._out, self._by_fd, self._ready, self._waiting = {}, {}, deque(), set()
            self.free, self.then, self.on_break = {}, None, None
            self._closed = True
            _LIVE.discard(self)


def _forget_in_child() -> None:
    """A forked child never touches its parent's links: its copies closed, the parent's intact."""
    for links in list(_LIVE):
        links._shut()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
