"""Which chunk a data port takes, without sockets: the data plane (:mod:`zcollective._io._dataplane`) hands
:meth:`ChunkRules.check` each message that reaches its port and does what the :class:`Verdict` says.

A chunk is three frames: a header (:data:`HEADER`), a tag, the payload. In order, a message is
1. dropped (``SHAPE``) unless it has three frames and a header's length;
2. dropped (``SESSION``) unless its magic, version, session and kind are this group's chunk's;
3. with a secret, fatal (``ALTERED``) unless its tag is the MAC of header and payload (only members pass
   the handshake: the link was altered, or the program changed an array passed to an ``_async`` call);
4. dropped (``ORIGIN``) if a reduce-scatter chunk's origin is not the sender on the job's link (``via``):
   a chunk's MAC does not name its recipient, so a path attacker could move one between the two rings;
5. by its seq: ``NOW`` (the job decides), ``EARLY`` (a later call, at most the next: kept), ``ENDED`` (the
   rest of a failed call), else dropped (``SEQ``). Drops are logged once per reason (:data:`LOGGED`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Optional

from .._format._mac import ChunkMac
from ..errors import AuthenticationError
from ._ring import KIND_NAMES, RING, RS

HEADER = struct.Struct("<2sBBQQiii")  # magic version kind session seq origin step index
MAGIC = b"ZD"
VERSION = 1

NOW, EARLY, ENDED = "now", "early", "ended"  # taken: by this job, a later one, none (the rest of one)
SHAPE, SESSION, ALTERED, ORIGIN, SEQ = "shape", "session", "altered", "origin", "seq"  # refused
LOGGED = (SHAPE, SESSION, ORIGIN, SEQ)  # a warning, once per reason (ALTERED fails the group)


@dataclass(slots=True)
class Verdict:
    """What to do with one message on a data port, and the header's fields (zero if none)."""

    reason: str  # NOW, EARLY or ENDED; else why it is refused
    why: str = ""  # a refusal's words, for the log
    kind: int = 0
    seq: int = 0
    origin: int = 0
    step: int = 0
    index: int = 0


class ChunkRules:
    """One rank's data port: what it takes (see the module docstring)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.prev = (rank - 1) % size
        self.senders: dict[str, int] = {RING: self.prev}  # whose reduce-scatter chunks each link takes
        self.session = 0  # the group's, once welcomed (see :meth:`start`)
        self.mac: Optional[ChunkMac] = None  # with a secret, the group's

    def start(self, session: int, mac: Optional[ChunkMac], rank: int, size: int,
              senders: Optional[dict[str, int]] = None) -> None:
        """Welcomed: the group's session, MAC and this rank's place; ``senders``: by ``via``, the rank
        whose link reaches its port (None: the previous rank's alone)."""
        self.session, self.mac = session, mac
        self.rank, self.size, self.prev = rank, size, (rank - 1) % size
        self.senders = {RING: self.prev, **(senders or {})}

    @property
    def origins(self) -> set[int]:
        """The ranks whose reduce-scatter chunks this port takes (by any link)."""
        return set(self.senders.values())

    def header(self, kind: int, seq: int, step: int, index: int) -> bytes:
        """The header of a chunk this rank makes."""
        return HEADER.pack(MAGIC, VERSION, kind, self.session, seq, self.rank, step, index)

    def check(self, frames: list[Any], seq: int, next_seq: int, via: str = RING) -> Verdict:
        """The verdict on ``frames`` (bytes or buffers) reaching this port while this rank moves call
        ``seq``'s data by the link ``via``, its next call being ``next_seq``."""
        if len(frames) != 3 or len(frames[0]) != HEADER.size:
            return Verdict(SHAPE, f"dropped a message of {len(frames)} frames on the data port: "
                                  f"not a chunk")
        header = bytes(frames[0])
        magic, version, kind, session, chunk_seq, origin, step, index = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION or session != self.session or kind not in KIND_NAMES:
            return Verdict(SESSION, f"dropped a chunk on the data port that is not of this group "
                                    f"(session {session:#x}, kind {kind})")
        verdict = Verdict(NOW, "", kind, chunk_seq, origin, step, index)
        if self.mac is not None and not self.mac.verify(header, memoryview(frames[2]), bytes(frames[1])):
            verdict.reason = ALTERED
        elif kind == RS and origin not in self.origins:
            verdict.reason = ORIGIN
            verdict.why = (f"dropped a reduce-scatter chunk claiming rank {origin} on rank "
                           f"{self.rank}'s data port")
        elif kind == RS and chunk_seq == seq and origin != self.senders.get(via, self.prev):
            verdict.reason = ORIGIN  # (a rank whose link another call goes by)
            verdict.why = (f"dropped a reduce-scatter chunk claiming rank {origin} on rank "
                           f"{self.rank}'s data port, in a call whose chunks come from rank "
                           f"{self.senders.get(via, self.prev)}")
        elif chunk_seq == seq:
            pass
        elif seq < chunk_seq < next_seq:  # the previous rank is ahead: its next call
            verdict.reason = EARLY
        elif chunk_seq < seq:  # the rest of a call that failed (a reduce function raised)
            verdict.reason = ENDED
        else:
            verdict.reason = SEQ
            verdict.why = (f"dropped a chunk of seq {chunk_seq} on rank {self.rank}'s data port "
                           f"(this rank is at seq {seq})")
        return verdict

    def altered(self, verdict: Verdict, op: str) -> AuthenticationError:
        """The group's error for a chunk whose tag failed (``ALTERED``)."""
        prev = verdict.origin if verdict.origin in self.origins else self.prev
        error = AuthenticationError(
            f"seq {verdict.seq} {op}: a {KIND_NAMES[verdict.kind]} chunk on the data link from rank "
            f"{prev} to rank {self.rank} failed authentication: was the link altered in flight, or "
            f"did rank {prev}'s program change the array it had passed to an _async call before "
            f"the call completed?")
        error.lost_rank = prev  # type: ignore[attr-defined]
        return error

    def unexpected(self, verdict: Verdict) -> str:
        """The log's words for a chunk of this job the job did not expect."""
        return (f"dropped a {KIND_NAMES[verdict.kind]} chunk (seq {verdict.seq}, step {verdict.step}, "
                f"index {verdict.index}) this call does not expect")
