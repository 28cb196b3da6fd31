"""The message format: kinds, header layout, encode to and decode from frames.

Pure functions over byte buffers; knows nothing of sockets, threads or pickle.
The frames, the header's fields, parts, tags and what :func:`decode` checks:
see docs/protocol.md, *Frames* and *Kinds*.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .._limits import WIRE_PART_BYTES
from ._mac import POLY1305, ChunkMac, available_backends, byte_view

PROTOCOL_VERSION = 16  # bump on any change to the layout below; what each version added: CHANGELOG.md
MAGIC = b"ZC"
HEADER = struct.Struct("<2sBBBBiiQQI")  # magic version kind op flags rank root seq session nseg
MAX_CALLSITE_BYTES = 512  # "file.py:123" with room for long paths; bounds the header
MAX_JSON_BYTES = 1 << 16  # control bodies are small; bounds what a stranger can make us parse
DEFAULT_MAX_FRAMES = 1 << 20  # alltoall at 64 ranks with many arrays stays far below

FLAG_FN = 0x01  # a pickled reduce function follows the header
FLAG_LOCAL_ERROR = 0x02  # the contribution is a JSON error raised on its sender
FLAG_AUTH = 0x04  # the last frame is an HMAC-SHA256 tag over all the others
FLAG_DATA = 0x08  # the segment describes data that travels on the data plane, not the data
FLAG_PARTS = 0x10  # some frames travel as several parts; the header's parts table says which
FLAG_LAST = 0x20  # a BYE: the coordinator's last message to a running replica, or its answer
FLAG_INLINE = 0x40  # a SEND's one frame ends the header frame, after the layout (no call site)
INLINE_MAX_BYTES = 1 << 13  # a SEND's frame this small goes inline: a frame of its own costs each
# end a libzmq call (~3.5 us of CPU to send here), more than copying 8 KiB

PART = struct.Struct("<IIQ")  # a parts-table row: frame index after the header, parts, bytes

TAG_BYTES = 32
KEY_LABEL = b"zcollective-v1-hmac-sha256"  # binds derived keys to this protocol
FAST_KEY_LABEL = b"zcollective-v3-fast-tag"  # the fast tag's keys: apart from every other key
MAILBOX_KEY_LABEL = b"zcollective-v11-mailbox-of-rank-"  # and the rank: each mailbox's own key
NONCE_BYTES = 16  # every fresh random nonce (a payload's fast tag, a handshake token, a sub-group's
# name): 2^64 draws before two are likely to share one, and a token fits PLAIN's 255-byte fields
FAST_TAG_BYTES = NONCE_BYTES + 32  # the nonce, then HMAC-SHA256
# Frames from this size are tagged by Poly1305 in a fast tag: HMAC-SHA256 costs
# ~1 us per KiB, a one-time key ~2 us, Poly1305 ~0.2 us per KiB.
FAST_MAC_MIN_BYTES = 1 << 14

NO_RANK = -1  # "not a rank": a message to a peer that claimed none


class Kind(enum.IntEnum):
    JOIN = 1  # replica -> coordinator: rank, num_replicas, versions (JSON)
    WELCOME = 2  # coordinator -> replica: every replica joined (JSON)
    REJECT = 3  # coordinator -> replica: join refused (JSON)
    CONTRIB = 4  # replica -> coordinator: one rank's part of call `seq`
    RESULT = 5  # coordinator -> replica: the outcome of call `seq`
    ERROR = 6  # coordinator -> replica: call `seq` failed, group still usable (JSON)
    STATUS = 7  # replica -> coordinator: who has arrived at call `seq`?
    STATUS_REPLY = 8  # coordinator -> replica: the answer (JSON)
    FAIL = 9  # coordinator -> replica: the group failed for good (JSON)
    # 10 was PING in version 1: liveness is ZeroMQ's own heartbeats
    BYE = 11  # replica -> coordinator: its program is ending; `seq` = how many calls it made;
    # coordinator -> replica: the answer (everything it sent before its BYE was taken)
    ABORT = 12  # replica -> coordinator: a message to it was altered or moved; fail the group (JSON)
    CHALLENGE = 13  # coordinator -> replica: with a secret, a JOIN must echo this (JSON)
    PROBE = 14  # coordinator -> replica: is its connection still there? (a send fails if not)
    TAKEN = 15  # coordinator -> replica: say when you have taken the data of every call through
    # `seq` (a rank before you ends); replica -> coordinator: it has
    SEND = 16  # replica -> replica's mailbox: a point-to-point message; rank: its sender, root: its
    # tag, seq: its number among the sender's messages to that replica
    CREDIT = 17  # replica -> replica's mailbox: I received your messages through `seq`
    ASK = 18  # replica -> replica's mailbox: I wait for credit from you
    FINAL = 19  # replica -> coordinator: I send no more point-to-point messages (teardown, or my
    # program ends), JSON: how many I sent each rank; coordinator -> replica: rank `root` sent its
    # last, `seq` of them to you (JSON: who it is, how it ended)
    SYNC = 20  # replica -> coordinator: it reached sync `root` of call `seq` through its host's
    # shared memory; coordinator -> replica: every rank of its host did
    UP = 21  # replica -> its parent in the tree (rank 0's children: the coordinator): a CONTRIB of
    # rank `rank`, or with FLAG_RANGE a summary of ranks `rank` up to the end its first segment holds


KINDS = {int(k): k for k in Kind}  # a dict lookup costs a tenth of Kind(value)
CONTROL_KINDS = frozenset(
    {Kind.JOIN, Kind.WELCOME, Kind.REJECT, Kind.ERROR, Kind.STATUS_REPLY, Kind.FAIL, Kind.ABORT,
     Kind.CHALLENGE, Kind.FINAL}
)


class WireError(ValueError):
    """Frames that do not form a valid message; ``reason`` says why."""


class AuthError(WireError):
    """A message whose tag is missing or wrong: not from a holder of the secret,
    or altered in flight. ``missing`` tells the two apart."""

    def __init__(self, reason: str, missing: bool = False) -> None:
        super().__init__(reason)
        self.missing = missing


class Signer:
    """HMAC-SHA256 over every frame and its length, keyed from the job's secret: the payload
    hashed once (:meth:`payload`), then bound to each recipient's header (:meth:`bind`). With
    ``fast``, a frame of :data:`FAST_MAC_MIN_BYTES` or more is tagged by Poly1305 under a one-time
    key inside the HMAC (the fast tag); either tag verifies. Why it is secure: docs/protocol.md, *Frames*.
    """

    def __init__(self, secret: bytes, fast: bool = False) -> None:
        self._secret = secret
        self._to: dict[tuple[int, bool], Signer] = {}  # (rank, fast) -> the signer of its mailbox
        key = hmac.new(secret, KEY_LABEL, hashlib.sha256).digest()
        self._base = hmac.new(key, digestmod=hashlib.sha256)
        self._chunks: Optional[ChunkMac] = None
        if POLY1305 in available_backends():
            chunk_key = hmac.new(secret, FAST_KEY_LABEL + b" chunks", hashlib.sha256).digest()
            self._chunks = ChunkMac(chunk_key, POLY1305)
            fast_key = hmac.new(secret, FAST_KEY_LABEL + b" hmac", hashlib.sha256).digest()
            self._fast_base = hmac.new(fast_key, digestmod=hashlib.sha256)
        self.fast = fast and self._chunks is not None

    def to(self, rank: int) -> Signer:
        """The signer of what goes to ``rank``'s mailbox, keyed by that rank too: a message moved
        to another mailbox does not verify (a header names the sender, not the recipient)."""
        signer = self._to.get((rank, self.fast))
        if signer is None:
            mailbox = hmac.new(self._secret, MAILBOX_KEY_LABEL + str(rank).encode(), hashlib.sha256).digest()
            signer = self._to[(rank, self.fast)] = Signer(mailbox, self.fast)
        return signer

    def payload(self, frames: Sequence[Any]) -> Any:
        """The MAC state after the frames that follow the header."""
        if self.fast and self._chunks is not None:
            sizes = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
            if sizes and max(sizes) >= FAST_MAC_MIN_BYTES:
                return self._fast_payload(os.urandom(NONCE_BYTES), frames, sizes, self._chunks)
        return self._plain_payload(frames)

    def _plain_payload(self, frames: Sequence[Any]) -> tuple[bytes, Any]:
        h = self._base.copy()
        for frame in frames:
            view = memoryview(frame)
            h.update(view.nbytes.to_bytes(8, "little"))
            h.update(view)
        return b"", h

    def _fast_payload(self, nonce: bytes, frames: Sequence[Any], sizes: list[int],
                      chunks: ChunkMac) -> tuple[bytes, Any]:
        h = self._fast_base.copy()
        h.update(nonce)
        for index, (frame, size) in enumerate(zip(frames, sizes, strict=True)):
            h.update(size.to_bytes(8, "little"))  # the size says which of the two follows
            if size >= FAST_MAC_MIN_BYTES:
                h.update(chunks.tag(nonce + index.to_bytes(4, "little"), frame))
            else:
                h.update(frame)
        return nonce, h

    @staticmethod
    def bind(payload: Any, header: Any) -> bytes:
        """The tag of ``header`` followed by the payload hashed into ``payload``."""
        prefix, h = payload
        h = h.copy()
        view = memoryview(header)
        h.update(view.nbytes.to_bytes(8, "little"))
        h.update(view)
        return prefix + h.digest()

    def tag(self, frames: Sequence[Any]) -> bytes:
        return self.bind(self.payload(frames[1:]), frames[0])

    def verify(self, frames: Sequence[Any]) -> Sequence[Any]:
        """The frames without their tag, if the tag is right.

        Raises
        ------
        AuthError
            No tag, or a wrong one.
        """
        size = memoryview(frames[-1]).nbytes if len(frames) >= 2 else 0
        if size not in (TAG_BYTES, FAST_TAG_BYTES):
            raise AuthError("message carries no authentication tag", missing=True)
        body = frames[:-1]
        got = bytes(memoryview(frames[-1]))
        if size == TAG_BYTES:
            want = self.bind(self._plain_payload(body[1:]), body[0])
        elif self._chunks is None:
            raise AuthError("tag made with Poly1305, which needs the cryptography package here "
                            "(pip install zcollective[fast-auth])")
        else:
            sizes = [memoryview(f).nbytes for f in body[1:]]
            want = self.bind(self._fast_payload(got[:NONCE_BYTES], body[1:], sizes, self._chunks),
                             body[0])
        if not hmac.compare_digest(want, got):
            raise AuthError("authentication tag does not match")
        return body


class VersionError(WireError):
    """A well-formed header of another protocol version."""

    def __init__(self, version: int) -> None:
        super().__init__(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
        self.version = version


@dataclass(slots=True)
class Message:
    kind: Kind
    op: int = 0  # an operation's code (see zcollective._protocol._ops.Op); 0: none
    rank: int = NO_RANK
    root: int = 0
    seq: int = 0
    session: int = 0
    callsite: str = ""
    flags: int = 0
    fn: Any = None  # a buffer, when flags & FLAG_FN (rank 0's own function, in its own process)
    segments: list[list[Any]] = field(default_factory=list)

    def body(self, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
        """The JSON body of a control message (an empty dict if there is none)."""
        if not self.segments:
            return {}
        return parse_json(self.segments[0][0], limit)


def join_token(nonce: str) -> int:
    """The 64-bit token of a JOIN's nonce (hex): the session of messages to it until welcomed."""
    head = nonce[:16]
    if len(head) < 16 or not all(c in "0123456789abcdefABCDEF" for c in head):
        return 0  # int(x, 16) would also take signs, spaces and underscores
    return int(head, 16)


def error_note(message: str) -> list[list[Any]]:
    """The segments of a contribution flagged ``FLAG_LOCAL_ERROR``: its sender's own error."""
    return control(Kind.ERROR, {"message": message}).segments


def control(kind: Kind, body: dict[str, Any], **header: Any) -> Message:
    """A message whose single segment is a JSON object."""
    data = json.dumps(body, separators=(",", ":")).encode()
    return Message(kind, segments=[[data]], **header)


def parse_json(frame: Any, limit: int) -> dict[str, Any]:
    """The JSON object in ``frame``; WireError if it is longer than ``limit`` bytes or not one."""
    raw = memoryview(frame)
    if raw.nbytes > limit:
        raise WireError(f"control body of {raw.nbytes} bytes exceeds {limit}")
    try:
        body = json.loads(raw.tobytes())
    except RecursionError:
        raise WireError("control body nests too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer past Python's digit limit
        raise WireError(f"control body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise WireError("control body is not a JSON object")
    return body


def encode(msg: Message, signer: Optional[Signer] = None,
           cache: Optional[dict[tuple[int, int, str], Any]] = None,
           part_bytes: int = WIRE_PART_BYTES) -> list[Any]:
    """The frames of ``msg``, tagged when there is a ``signer``; buffers pass uncopied, those
    above ``part_bytes`` as slices (docs/protocol.md, *Frames*). ``cache`` keeps the payload
    (layout, parts table, call site, frames, MAC state) by the identity of ``msg.segments`` and
    ``msg.fn``, built and hashed once for the messages that share it; the caller keeps them alive."""
    segments = msg.segments
    key: Any = None
    payload = None
    if cache is not None:
        key = (id(segments), id(msg.fn), msg.callsite)
        payload = cache.get(key)
    if payload is None:
        site = msg.callsite.encode("utf-8", "replace")[:MAX_CALLSITE_BYTES] if msg.callsite else b""
        parts = 0
        if len(segments) == 1 and msg.fn is None:  # a small call's shape: no list to build
            tail = segments[0]
            suffix = _ONE_COUNT.pack(len(tail))
            if (msg.kind in _INLINE_KINDS and len(tail) == 1 and type(tail[0]) is bytes and not site
                    and len(tail[0]) <= INLINE_MAX_BYTES):  # a small point-to-point value: one frame
                suffix, tail, parts = suffix + tail[0], [], FLAG_INLINE
        else:
            suffix = struct.pack(f"<{len(segments)}I", *map(len, segments)) if segments else b""
            tail = [] if msg.fn is None else [msg.fn]
            for seg in segments:
                tail.extend(seg)
        if not parts and not (len(tail) == 1 and type(tail[0]) is bytes and len(tail[0]) <= part_bytes):
            tail, table = split_parts(tail, part_bytes)
            if table:
                suffix, parts = suffix + table, FLAG_PARTS
        suffix += site
        mac = signer.payload(tail) if signer is not None else None
        if cache is not None:
            cache[key] = (suffix, tail, mac, parts)
    else:
        suffix, tail, mac, parts = payload
    flags = msg.flags | parts | (FLAG_FN if msg.fn is not None else 0) | (FLAG_AUTH if signer else 0)
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, msg.kind, msg.op, flags,
                         msg.rank, msg.root, msg.seq, msg.session, len(segments)) + suffix
    if signer is None:
        return [header, *tail]
    return [header, *tail, signer.bind(mac, header)]


_ONE_COUNT = struct.Struct("<I")
_INLINE_KINDS = frozenset((Kind.SEND,))  # the kinds whose one small frame may go inline


def split_parts(frames: list[Any], part_bytes: int = WIRE_PART_BYTES) -> tuple[list[Any], bytes]:
    """``frames`` with each above ``part_bytes`` replaced by its parts (slices), and the parts
    table that undoes it (``b""``, and ``frames`` itself, when nothing was split)."""
    rows: list[bytes] = []
    out: list[Any] = frames
    for index, frame in enumerate(frames):
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        if size <= part_bytes:
            if rows:
                out.append(frame)
            continue
        if not rows:
            out = frames[:index]
        view = byte_view(frame)
        parts = [view[at:at + part_bytes] for at in range(0, size, part_bytes)]
        out.extend(parts)
        rows.append(PART.pack(index, len(parts), size))
    if not rows:
        return frames, b""
    return out, len(rows).to_bytes(4, "little") + b"".join(rows)


def join_parts(frames: Sequence[Any], table: Sequence[tuple[int, int, int]],
               max_frame_bytes: Optional[int] = None) -> list[Any]:
    """The frames after the header, each split frame's parts joined back into one buffer as
    ``table`` says; WireError, before any copy, if a row does not match or exceeds ``max_frame_bytes``."""
    out: list[Any] = []
    pos = 0  # in frames
    nxt = 0  # the index of the next frame of the message
    for index, nparts, nbytes in table:
        if index < nxt or nparts < 2 or pos + (index - nxt) + nparts > len(frames):
            raise WireError(f"parts table row ({index}, {nparts}, {nbytes}) does not match "
                            f"{len(frames)} frames")
        out.extend(frames[pos:pos + index - nxt])
        pos += index - nxt
        parts = frames[pos:pos + nparts]
        sizes = [memoryview(p).nbytes for p in parts]
        if sum(sizes) != nbytes or 0 in sizes:
            raise WireError(f"frame {index}: {nparts} parts of {sum(sizes)} bytes, "
                            f"the header says {nbytes} (or a part is empty)")
        if max_frame_bytes is not None and nbytes > max_frame_bytes:
            raise WireError(f"frame {index} of {nbytes} bytes exceeds max_frame_bytes={max_frame_bytes}")
        out.append(bytearray().join(parts))  # writable, as a received frame is
        pos += nparts
        nxt = index + 1
    out.extend(frames[pos:])
    return out


def decode(frames: Sequence[Any], max_frames: int = DEFAULT_MAX_FRAMES,
           signer: Optional[Signer] = None, max_frame_bytes: Optional[int] = None,
           *, whole: Optional[Callable[..., Any]] = None) -> Message:
    """Parse frames into a :class:`Message`, validating shape before unpacking
    (what is checked, in which order: see docs/protocol.md, *Frames*).

    The common shape (one segment, no reduce function, no parts, ``FLAG_AUTH`` set when
    signed) is decoded here; anything else goes to ``whole`` (:func:`_decode_whole`, which
    accepts all this accepts, into the same message: ``tests/test_wire.py`` compares them).

    Raises
    ------
    AuthError
        With a ``signer``: the tag is missing or wrong.
    VersionError
        The header is of another protocol version.
    WireError
        Anything else malformed.
    """
    if not frames:
        raise WireError("empty message")
    if len(frames) > max_frames:
        raise WireError(f"{len(frames)} frames exceed the bound of {max_frames}")
    if signer is not None:
        frames = signer.verify(frames)
    signed = signer is not None
    if whole is None:
        whole = _decode_whole
    head = memoryview(frames[0])
    size = head.nbytes
    if size < _HEADER_ONE_SEGMENT.size:
        return whole(frames, max_frames, signed, max_frame_bytes)
    magic, version, kind, op, flags, rank, root, seq, session, nseg, count = \
        _HEADER_ONE_SEGMENT.unpack_from(head)
    if (magic != MAGIC or version != PROTOCOL_VERSION or nseg != 1 or flags & _NOT_SIMPLE
            or bool(flags & FLAG_AUTH) is not signed):
        return whole(frames, max_frames, signed, max_frame_bytes)
    kind_ = KINDS.get(kind)
    if flags & FLAG_INLINE:  # a small point-to-point value
        if (count != 1 or len(frames) != 1 or kind_ not in _INLINE_KINDS
                or size > _HEADER_ONE_SEGMENT.size + INLINE_MAX_BYTES or size == _HEADER_ONE_SEGMENT.size):
            return whole(frames, max_frames, signed, max_frame_bytes)
        return Message(kind_, op, rank, root, seq, session, "", flags, None,  # type: ignore[arg-type]
                       [[head[_HEADER_ONE_SEGMENT.size:]]])
    if (size > _SIMPLE_MAX_BYTES or count != len(frames) - 1 or not count or kind_ is None
            or (count != 1 and kind_ in CONTROL_KINDS)):
        return whole(frames, max_frames, signed, max_frame_bytes)
    callsite = head[_HEADER_ONE_SEGMENT.size:].tobytes().decode("utf-8", "replace") if (
        size > _HEADER_ONE_SEGMENT.size) else ""  # (a replica's contribution)
    return Message(kind_, op, rank, root, seq, session, callsite, flags, None, [list(frames[1:])])


class _Verified:
    """A signer whose frames were verified already (for :func:`_decode_simple`)."""

    @staticmethod
    def verify(frames: Sequence[Any]) -> Sequence[Any]:
        return frames


def _decode_simple(frames: Sequence[Any], signed: bool) -> Optional[Message]:
    """:func:`decode`'s answer for the common shape alone, or None where it takes the whole way."""
    return decode(frames, signer=_Verified() if signed else None,  # type: ignore[arg-type]
                  whole=lambda *_: None)


def _decode_whole(frames: Sequence[Any], max_frames: int, signed: bool,
                  max_frame_bytes: Optional[int]) -> Message:
    """:func:`decode` after the frame bound and the tag (``signed``: stripped): every rule in turn."""
    head = memoryview(frames[0])
    if head.nbytes < 3 or head[:2].tobytes() != MAGIC:
        raise WireError("no zcollective header (bad magic)")
    if head[2] != PROTOCOL_VERSION:
        raise VersionError(head[2])
    if head.nbytes < HEADER.size:
        raise WireError(f"header of {head.nbytes} bytes, expected at least {HEADER.size}")
    _, _, kind, op, flags, rank, root, seq, session, nseg = HEADER.unpack_from(head)
    end = HEADER.size + 4 * nseg
    if nseg > max_frames or head.nbytes < end:
        raise WireError(f"header of {head.nbytes} bytes for {nseg} segments")
    table: Sequence[tuple[int, int, int]] = ()
    if flags & FLAG_PARTS:
        nsplit = int.from_bytes(head[end:end + 4], "little") if head.nbytes >= end + 4 else -1
        if not 0 < nsplit <= max_frames or head.nbytes < end + 4 + PART.size * nsplit:
            raise WireError(f"header of {head.nbytes} bytes for {nseg} segments and its parts table")
        table = list(PART.iter_unpack(head[end + 4:end + 4 + PART.size * nsplit]))
        end += 4 + PART.size * nsplit
    if flags & FLAG_INLINE:
        return _decode_inline(head, frames, end, signed, (kind, op, flags, rank, root, seq, session, nseg))
    if head.nbytes > end + MAX_CALLSITE_BYTES:
        raise WireError(f"header of {head.nbytes} bytes for {nseg} segments")
    if signed and not flags & FLAG_AUTH:
        raise AuthError("tag present but the header does not announce it")
    if not signed and flags & FLAG_AUTH:
        frames = frames[:-1]  # a tag this side cannot check
    kind_ = KINDS.get(kind)  # (the op byte is the rules' to check: zcollective._protocol._ops)
    if kind_ is None:
        raise WireError(f"{kind} is not a valid Kind")
    callsite = head[end:].tobytes().decode("utf-8", "replace") if head.nbytes > end else ""
    if table:
        frames = [frames[0], *join_parts(frames[1:], table, max_frame_bytes)]
    pos = 1
    fn = None
    if flags & FLAG_FN:
        if len(frames) < 2:
            raise WireError("reduce-function flag set but no frame follows")
        fn = frames[1]
        pos = 2
    segments: list[list[Any]] = []
    if nseg:
        counts = struct.unpack_from(f"<{nseg}I", head, HEADER.size)
        if pos + sum(counts) != len(frames) or 0 in counts:
            raise WireError(f"layout {list(counts)} does not match {len(frames) - pos} frames")
        for count in counts:
            segments.append(list(frames[pos:pos + count]))
            pos += count
    elif len(frames) != pos:
        raise WireError(f"{len(frames) - pos} frames follow a message with no segments")
    if kind_ in CONTROL_KINDS and (len(segments) != 1 or len(segments[0]) != 1):
        raise WireError(f"{kind_.name} must carry exactly one JSON frame")
    return Message(kind_, op, rank, root, seq, session, callsite, flags, fn, segments)


def _decode_inline(head: memoryview, frames: Sequence[Any], end: int, signed: bool,
                   fields: tuple[int, ...]) -> Message:
    """:func:`_decode_whole` for ``FLAG_INLINE``: the value follows the layout in the header frame."""
    kind, op, flags, rank, root, seq, session, nseg = fields
    if not signed and flags & FLAG_AUTH:
        frames = frames[:-1]  # a tag this side cannot check
    counts = struct.unpack_from(f"<{nseg}I", head, HEADER.size)
    if (flags & (FLAG_PARTS | FLAG_FN) or counts != (1,) or len(frames) != 1 or head.nbytes <= end
            or head.nbytes - end > INLINE_MAX_BYTES):
        raise WireError(f"an inline frame needs one segment of one non-empty frame of at most "
                        f"{INLINE_MAX_BYTES} bytes, in the header alone (layout {list(counts)}, "
                        f"{len(frames)} frames, {head.nbytes - end} bytes after the layout)")
    if signed and not flags & FLAG_AUTH:
        raise AuthError("tag present but the header does not announce it")
    kind_ = KINDS.get(kind)
    if kind_ not in _INLINE_KINDS:
        raise WireError(f"{kind} is not a kind that may carry an inline frame (only SEND)")
    return Message(kind_, op, rank, root, seq, session, "", flags, None, [[head[end:]]])


_HEADER_ONE_SEGMENT = struct.Struct(HEADER.format + "I")  # and a one-segment layout: every small call
_SIMPLE_MAX_BYTES = _HEADER_ONE_SEGMENT.size + MAX_CALLSITE_BYTES
_NOT_SIMPLE = FLAG_FN | FLAG_PARTS


def owned(msg: Message) -> Message:
    """``msg`` with every buffer its own copy, as a socket would make (docs/protocol.md, *Drivers*)."""
    segments = msg.segments
    if not segments or (len(segments) == 1 and len(segments[0]) == 1 and type(segments[0][0]) is bytes):
        return msg  # (a small call's: one immutable frame, nothing to copy)
    msg.segments = [[frame if isinstance(frame, bytes) else bytearray(memoryview(frame))
                     for frame in segment] for segment in msg.segments]
    return msg
