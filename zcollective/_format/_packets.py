"""The packets of one host's links (:mod:`zcollective._io._local`): pure, no sockets. A link is a Unix
``SOCK_SEQPACKET`` socket, which keeps packets whole and in order; a message (the mailbox's frames, see
:mod:`._wire`) goes in one packet or several. Little-endian::

    AUTH  'A' MAGIC rank:u32 hmac:32B   a link's first packet: the rank it claims in this session, proved
    ONE   'O' frame                     a message of one frame of at most FRAGMENT_BYTES
    FIRST 'F' count:u32 size:u64 data   any other message: its ``size`` bytes of data (each frame's length
    MORE  'M' data                      as u64, then the frames) begin here and go on in MORE packets
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterator
from typing import Any, Optional

__all__ = ["COPY_MAX", "FRAGMENT_BYTES", "HEAD", "MAX_FRAMES", "MORE", "NAME_PREFIX", "ONE", "ONE_HEAD",
           "PACKET_MAX", "PacketError", "auth", "first", "frames_of", "lengths_of", "packets", "proven",
           "whole"]

FRAGMENT_BYTES = 1 << 16  # a packet's data at most: far below any send buffer (wmem_default: 208 KiB)
PACKET_MAX = 1 + FRAGMENT_BYTES  # (a ONE or MORE packet's kind, then its data)
MAX_IOV = 1000  # pieces of one packet (IOV_MAX is 1024)
MAX_FRAMES = 1 << 20  # frames of one message at most (as _wire.DEFAULT_MAX_FRAMES). The bound on what a
# peer can make a rank allocate for one message: MAX_FRAMES * (LENGTH + max_frame_bytes)
COPY_MAX = 1 << 12  # a bytes frame up to this goes copied behind its kind (cheaper than an iovec)
MAGIC = b"ZCL1"  # "zcollective local", version 1
AUTH, ONE, FIRST, MORE = b"AOFM"
ONE_HEAD, MORE_HEAD = bytes((ONE,)), bytes((MORE,))
AUTH_PACKET, HEAD = struct.Struct("<B4sI32s"), struct.Struct("<BIQ")
LENGTH = 8  # bytes of a frame's length
LABEL = b"zcollective-local|%d|%d|%d"  # what a link's HMAC signs: session, source, destination
NAME_PREFIX = "zcollective-"  # a rank's listener name: this, then lowercase hex (its JOIN names it)


class PacketError(Exception):
    """A packet no peer of this group sends (the reason; empty: the link ended)."""


def _mac(key: bytes, session: int, src: int, dest: int) -> bytes:
    return hmac.new(key, LABEL % (session, src, dest), hashlib.sha256).digest()


def auth(key: bytes, session: int, src: int, dest: int) -> bytes:
    """The AUTH packet of ``src``'s link to ``dest`` in ``session``, under the group's ``key``."""
    return AUTH_PACKET.pack(AUTH, MAGIC, src, _mac(key, session, src, dest))


def proven(packet: Any, key: bytes, session: int, me: int, size: int) -> int:
    """The rank a link's first packet proves it is, to ``me`` of a group of ``size``; PacketError if none."""
    n = len(packet)
    kind, magic, rank, mac = AUTH_PACKET.unpack_from(packet) if n == AUTH_PACKET.size else (0,) * 4
    if kind != AUTH or magic != MAGIC:
        raise PacketError(f"a first packet of {n} bytes, not an authentication")
    if not 0 <= rank < size or rank == me:
        raise PacketError(f"it claims rank {rank}, not another rank of {size}")
    if not hmac.compare_digest(mac, _mac(key, session, rank, me)):
        raise PacketError(f"a wrong HMAC for rank {rank} (another key or session)")
    return int(rank)


def first(packet: Any, n: int, max_frame: int) -> tuple[int, int]:
    """A FIRST packet's (frame count, data size), bounded by ``max_frame`` a frame; PacketError if not one."""
    if packet[0] != FIRST or n < HEAD.size:
        raise PacketError(f"a packet out of place (kind {packet[0]}, {n} bytes)")
    _, count, size = HEAD.unpack_from(packet)
    if not 0 < count <= MAX_FRAMES or not max(n - HEAD.size, LENGTH * count) <= size <= count * (
            LENGTH + max_frame):
        raise PacketError(f"a message of {size} bytes in {count} frames: above the bound")
    return count, size


def lengths_of(frames: list[Any], max_frame: int) -> list[int]:
    """Each frame's bytes; ValueError before anything goes if the message is one no peer would take."""
    lengths = []
    for frame in frames:
        view = memoryview(frame) if type(frame) is not bytes else None
        if view is not None and not view.c_contiguous:
            raise ValueError("a frame not contiguous")
        lengths.append(len(frame) if view is None else view.nbytes)
    if not 0 < len(frames) <= MAX_FRAMES or max(lengths) > max_frame:
        raise ValueError(f"a message of {len(frames)} frames (1..{MAX_FRAMES}), each {max_frame} B at most")
    return lengths


def whole(frames: list[Any], lengths: list[int]) -> Optional[list[Any]]:
    """The one packet of a message that fits in one (the caller's buffers, no copy), else None."""
    if len(frames) == 1 and lengths[0] <= FRAGMENT_BYTES:
        return [ONE_HEAD, frames[0]]
    size = LENGTH * len(lengths) + sum(lengths)
    if size > PACKET_MAX - HEAD.size or len(frames) >= MAX_IOV:
        return None
    return [HEAD.pack(FIRST, len(lengths), size), struct.pack(f"<{len(lengths)}Q", *lengths), *frames]


def packets(frames: list[Any], lengths: list[int]) -> Iterator[list[Any]]:
    """A larger message's packets, made as they go: views of the caller's buffers, no copy."""
    table = struct.pack(f"<{len(lengths)}Q", *lengths)
    packet: list[Any] = [HEAD.pack(FIRST, len(lengths), len(table) + sum(lengths))]
    room = PACKET_MAX - HEAD.size
    for frame in [table, *frames]:
        piece = memoryview(frame).cast("B")
        while piece.nbytes:
            packet.append(piece[:room])
            room -= packet[-1].nbytes
            piece = piece[packet[-1].nbytes:]
            if room == 0 or len(packet) == MAX_IOV:
                yield packet
                packet, room = [MORE_HEAD], FRAGMENT_BYTES
    if len(packet) > 1:
        yield packet


def frames_of(view: memoryview, count: int, max_frame: int) -> list[Any]:
    """A whole message's frames: views of its one buffer (``count`` lengths, then the frames)."""
    at = LENGTH * count
    lengths = struct.unpack_from(f"<{count}Q", view)
    if sum(lengths) != len(view) - at or max(lengths) > max_frame:
        raise PacketError(f"frames' lengths that do not add up to {len(view) - at} bytes or are too large")
    frames = []
    for length in lengths:
        frames.append(view[at:at + length])
        at += length
    return frames
