"""The body of every control message, and the plans of calls whose data goes
peer to peer: one schema each, built and checked here, so each field is
named in one place.

A control body is one JSON object (:func:`~zcollective._wire.control`). A
builder makes what its sender puts on the wire; a parser checks what
arrived and raises :class:`~zcollective._wire.WireError` on what no working
replica sends, except where an optional field reads as absent when it is
malformed (each parser says which). The bounds here keep every body a
replica parses under :data:`~zcollective._wire.MAX_JSON_BYTES`. Pure, as
:mod:`zcollective._wire`: knows nothing of sockets, threads, pickle or the
rules that act on a body.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Optional

from ._mac import KEY_LABELS
from ._wire import MAX_JSON_BYTES, WIRE_PART_BYTES, Kind, Message, WireError, control, parse_json
from .errors import WIRE_ERRORS, CollectiveError, RemoteError

MAX_MESSAGE_BYTES = 12000  # an error text sent to replicas, as JSON; an ERROR's two texts, type
MAX_TRACEBACK_BYTES = 32000  # and traceback stay under the 64 KiB a replica parses (MAX_JSON_BYTES)
MAX_ENDPOINT_CHARS = 300  # a data port's "tcp://host:port", as a JOIN states it
MAX_PLAN_FRAMES = 256  # a value of more buffers keeps the star: its plan stays small
DATA_KEY_BYTES = 32  # the key of the data ports' handshake tokens when there is no secret


# -- JOIN, CHALLENGE, WELCOME ---------------------------------------------------


@dataclass(frozen=True)
class Join:
    """JOIN: who a replica is, what it runs, a fresh nonce (what the answers
    are bound to) and, if it has one, its data port."""

    rank: int
    num_replicas: int
    python: str
    protocol: int
    pid: int
    host: str
    nonce: str
    challenge: Optional[str] = None  # the coordinator's CHALLENGE, echoed (with a secret)
    macs: tuple[str, ...] = ()  # the chunk MAC backends it can use
    data: Optional[str] = None  # its data port, "tcp://host:port"
    data_min: int = 0  # the smallest array it would send peer to peer
    data_mode: str = "auto"  # "on": even if every rank is on one host

    def to_message(self) -> Message:
        body: dict[str, Any] = {"rank": self.rank, "num_replicas": self.num_replicas,
                                "protocol": self.protocol, "python": self.python, "pid": self.pid,
                                "host": self.host, "nonce": self.nonce}
        if self.challenge is not None:
            body["challenge"] = self.challenge
        body["macs"] = list(self.macs)
        if self.data is not None:
            body.update(data=self.data, data_min=self.data_min, data_mode=self.data_mode)
        return control(Kind.JOIN, body, rank=self.rank)

    @classmethod
    def parse(cls, msg: Message) -> Join:
        """The JOIN in ``msg``. A malformed data port reads as none (the group
        keeps the star); unknown MAC backends are left out.

        Raises
        ------
        WireError
            No rank, num_replicas or pid that is an integer, or no python string.
        """
        info = msg.body()
        rank: Any = info.get("rank")
        n: Any = info.get("num_replicas")
        python, pid = info.get("python"), info.get("pid", 0)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (rank, n, pid)):
            raise WireError("rank, num_replicas and pid must be integers")
        if not isinstance(python, str):
            raise WireError("python must be a string")
        data, data_min, mode = info.get("data"), info.get("data_min", 0), info.get("data_mode")
        if not (isinstance(data, str) and data.startswith("tcp://") and len(data) <= MAX_ENDPOINT_CHARS
                and type(data_min) is int):
            data, data_min = None, 0
        macs = info.get("macs")
        protocol = info.get("protocol")
        return cls(rank, n, python, protocol if type(protocol) is int else 0, pid,
                   printable(str(info.get("host", "?"))[:256]), join_nonce(msg), challenge_of(msg),
                   tuple(m for m in macs[:8] if m in KEY_LABELS) if isinstance(macs, list) else (),
                   data, data_min, "on" if mode == "on" else "auto")


def join_nonce(msg: Message) -> str:
    """The nonce a JOIN states, as far as it can be read: the answers to a
    JOIN are bound to it, even to one refused as malformed."""
    return str(msg.body().get("nonce", ""))[:64]


def challenge_message(text: str, **header: Any) -> Message:
    """CHALLENGE: with a secret, the text a JOIN must echo."""
    return control(Kind.CHALLENGE, {"challenge": text}, **header)


def challenge_of(msg: Message) -> Optional[str]:
    """The challenge a CHALLENGE gives or a JOIN echoes; None if it has none."""
    text = msg.body().get("challenge")
    return text if isinstance(text, str) else None


@dataclass(frozen=True)
class Welcome:
    """WELCOME: the nonce of the JOIN it answers, how the group frames and
    authenticates, and every rank's data port when it uses the data plane."""

    num_replicas: int
    nonce: str
    parts: Optional[int]  # frames above this travel in parts
    mac: Optional[str]  # the chunk MAC backend every rank can use
    data: Optional[list[str]] = None  # every rank's data port, by rank
    data_min: int = 0  # the smallest array that goes peer to peer (rank 0's)
    data_key: Optional[str] = None  # the data ports' token key, hex of DATA_KEY_BYTES

    def to_message(self, **header: Any) -> Message:
        body: dict[str, Any] = {"num_replicas": self.num_replicas, "nonce": self.nonce,
                                "parts": self.parts, "mac": self.mac}
        if self.data is not None:
            body.update(data=self.data, data_min=self.data_min, data_key=self.data_key)
        return control(Kind.WELCOME, body, **header)

    @classmethod
    def parse(cls, msg: Message) -> Welcome:
        """The WELCOME in ``msg``; a malformed field reads as absent (a part
        size below :data:`~zcollective._wire.WIRE_PART_BYTES` too), and the
        data plane only as a whole (ports, threshold and key)."""
        body = msg.body()
        n, nonce, parts, mac = body.get("num_replicas"), body.get("nonce"), body.get("parts"), body.get("mac")
        data, least, key = body.get("data"), body.get("data_min"), body.get("data_key")
        if not (isinstance(data, list) and all(isinstance(e, str) for e in data)
                and type(least) is int and is_data_key(key)):
            data, least, key = None, 0, None
        return cls(n if type(n) is int else 0, nonce if isinstance(nonce, str) else "",
                   parts if type(parts) is int and parts >= WIRE_PART_BYTES else None,
                   mac if isinstance(mac, str) else None, data, least, key)


def is_data_key(key: Any) -> bool:
    """A data key as the WELCOME gives it: hex of :data:`DATA_KEY_BYTES` bytes."""
    if not isinstance(key, str) or len(key) != 2 * DATA_KEY_BYTES:
        return False
    try:
        return len(bytes.fromhex(key)) == DATA_KEY_BYTES  # (fromhex skips whitespace)
    except ValueError:
        return False


# -- ERROR, FAIL, REJECT, ABORT, STATUS_REPLY -------------------------------------


def error_body(error: str, message: str, limit: int = MAX_MESSAGE_BYTES, **extra: Any) -> dict[str, Any]:
    """The body of an ERROR, FAIL or REJECT: the error's name (one of
    :data:`zcollective.errors.WIRE_ERRORS`), its text cut to ``limit``
    bytes, and what else it says (a FAIL's ``lost`` or ``bad`` ranks,
    ``ended``, ``seq``)."""
    return {"error": error, "message": cap(message, limit), **extra}


def remote_error_body(message: str, remote_type: str, remote_message: str, trace: str) -> dict[str, Any]:
    """The body of an ERROR for a reduce function that raised on rank 0."""
    return {"error": "RemoteError", "message": cap(message), "remote_type": cap(remote_type, 1000),
            "remote_message": cap(remote_message),
            "remote_traceback": cap(trace, MAX_TRACEBACK_BYTES, tail=True)}


def parse_error(msg: Message) -> tuple[Exception, bool]:
    """The exception an ERROR, FAIL or REJECT describes, and whether it says
    a rank's program ended (``ended``). An unknown name is a CollectiveError."""
    body = msg.body()
    name, message = str(body.get("error")), str(body.get("message", "?"))
    if name == "RemoteError":
        error: Exception = RemoteError(message, str(body.get("remote_type", "")),
                                       str(body.get("remote_message", "")),
                                       str(body.get("remote_traceback", "")))
    else:
        error = WIRE_ERRORS.get(name, CollectiveError)(message)
    return error, body.get("ended") is True


@dataclass(frozen=True)
class Abort:
    """ABORT: a replica found the group broken (a message to it altered or
    moved, or, on the data plane, a link lost or altered, or a reduce
    function that raised there) and asks the coordinator to fail it."""

    error: str  # the name of the error, as in error_body
    message: str
    lost: Optional[int] = None  # on the data plane: the rank at the link's other end
    plane: Optional[str] = None  # "data": found on the data plane

    def to_message(self, **header: Any) -> Message:
        body: dict[str, Any] = {"error": self.error, "message": self.message}
        if self.plane is not None:
            body.update(lost=self.lost, plane=self.plane)
        return control(Kind.ABORT, body, **header)

    @classmethod
    def parse(cls, msg: Message, num_replicas: int) -> Abort:
        """The ABORT in ``msg``, its text made printable and cut; a ``lost``
        that is not a rank of a group of ``num_replicas`` reads as None."""
        body = msg.body()
        error, lost, plane = body.get("error"), body.get("lost"), body.get("plane")
        return cls(error if isinstance(error, str) else "",
                   printable(str(body.get("message", "?"))[:2000]),
                   lost if type(lost) is int and 0 <= lost < num_replicas else None,
                   plane if isinstance(plane, str) else None)


def joining_status(seq: int, missing: list[int], arrived: list[int], refused: dict[int, str],
                   rank: int, session: int) -> Message:
    """STATUS_REPLY to ``rank`` while the group joins: who has joined, and
    why a rank's JOIN was refused."""
    body = {"seq": seq, "state": "joining", "missing": missing, "arrived": arrived,
            "refused": {str(r): m for r, m in refused.items()}}
    return control(Kind.STATUS_REPLY, body, seq=seq, rank=rank, session=session)


def call_status(seq: int, state: str, arrived: list[int], missing: list[int], op: Optional[str],
                rank: int, session: int) -> Message:
    """STATUS_REPLY to ``rank`` for call ``seq``: ``state`` is pending,
    computing or done."""
    body: dict[str, Any] = {"seq": seq, "state": state, "arrived": arrived, "missing": missing}
    if op is not None:
        body["op"] = op
    return control(Kind.STATUS_REPLY, body, seq=seq, rank=rank, session=session)


def parse_status(msg: Message) -> dict[str, Any]:
    """A STATUS_REPLY's body, with its rank lists checked (they end up in messages).

    Raises
    ------
    WireError
        ``missing`` or ``arrived`` is not a list of ranks.
    """
    body = msg.body()
    for key in ("missing", "arrived"):
        ranks = body.get(key, [])
        if not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
            raise WireError(f"status reply field {key!r} is not a list of ranks")
    return body


# -- plans of the data plane -------------------------------------------------------


def sizes_plan(sizes: list[int]) -> bytes:
    """The plan of a value whose frames go peer to peer: their sizes."""
    return _dumps({"sizes": sizes})


def parse_sizes(msg: Message, max_frame_bytes: Optional[int] = None) -> list[int]:
    """The frame sizes of the plan that is ``msg``'s first frame.

    Raises
    ------
    WireError
        Not a list of at most :data:`MAX_PLAN_FRAMES` sizes, or more bytes
        than that many frames of ``max_frame_bytes`` hold.
    """
    sizes: Any = _plan(msg, MAX_JSON_BYTES).get("sizes")
    if not _sizes(sizes) or sum(sizes) > (max_frame_bytes or sys.maxsize) * max(1, len(sizes)):
        raise WireError(f"malformed frame sizes {str(sizes)[:100]}")
    return sizes


def gather_plan(sizes: list[Optional[list[int]]]) -> bytes:
    """The plan of an allgather: by rank, its frames' sizes, or None for a
    value that comes with the plan."""
    return _dumps({"sizes": sizes})


def parse_gather_plan(msg: Message, num_replicas: int) -> list[Optional[list[int]]]:
    """The sizes by rank of the allgather plan that is ``msg``'s first frame.

    Raises
    ------
    WireError
        Not ``num_replicas`` entries, each None or a list of sizes.
    """
    told: Any = _plan(msg, MAX_JSON_BYTES * num_replicas).get("sizes")
    if not (isinstance(told, list) and len(told) == num_replicas
            and all(s is None or _sizes(s) for s in told)):
        raise WireError(f"malformed allgather plan {str(told)[:100]}")
    return told


def array_plan(dtype: str, shape: list[int], fn: str) -> bytes:
    """The plan of an allreduce that goes peer to peer: the array's dtype
    (numpy's ``dtype.str``) and shape and the reduction's name; every rank
    must send the same."""
    return _dumps({"dtype": dtype, "shape": shape, "fn": fn})


def parse_array_plan(msg: Message) -> tuple[str, tuple[int, ...], str]:
    """``(dtype, shape, reduction)`` of the array plan that is ``msg``'s first frame.

    Raises
    ------
    WireError
        Anything else, or a plan of more than :data:`MAX_MESSAGE_BYTES`.
    """
    plan = _plan(msg, MAX_MESSAGE_BYTES)
    dtype, shape, fn = plan.get("dtype"), plan.get("shape"), plan.get("fn")
    if not (isinstance(dtype, str) and isinstance(fn, str) and isinstance(shape, list)
            and all(type(n) is int for n in shape)):
        raise WireError("malformed array description")
    return dtype, tuple(shape), fn


def _plan(msg: Message, limit: int) -> dict[str, Any]:
    if not msg.segments:
        raise WireError("no plan")
    return parse_json(msg.segments[0][0], limit)


def _sizes(sizes: Any) -> bool:
    return (isinstance(sizes, list) and len(sizes) <= MAX_PLAN_FRAMES
            and all(type(n) is int and n >= 0 for n in sizes))


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


# -- texts ------------------------------------------------------------------------


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate a peer sent
    in JSON) escaped: it ends up in logs and messages."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def cap(text: str, limit: int = MAX_MESSAGE_BYTES, tail: bool = False) -> str:
    """``text`` cut until it takes at most ``limit`` bytes as JSON, saying so
    (the end of a traceback matters most, the start of a message)."""
    def part(keep: int) -> str:
        return text[len(text) - keep:] if tail else text[:keep]

    keep, size = len(text), len(json.dumps(text))
    while keep > 0 and size > limit:
        keep = max(0, keep * limit // size - 40)
        size = len(json.dumps(part(keep)))
    if keep == len(text):
        return text
    cut = len(text) - keep
    return f"[{cut} characters cut] {part(keep)}" if tail else f"{part(keep)} [{cut} characters cut]"
