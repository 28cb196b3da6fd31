"""Every control body and data plan, built and checked here: one schema each. A parser raises
WireError on what no working replica sends, or reads a malformed optional field as absent."""

from __future__ import annotations

import json
import os
import socket
import string
import sys
import traceback
from typing import Any, Optional, Union

from .._limits import MAX_JOB_CHARS, MAX_TAG, WIRE_PART_BYTES
from ..errors import WIRE_ERRORS, CollectiveError, RemoteError
from . import _wire
from ._mac import KEY_LABELS, available_backends
from ._packets import NAME_PREFIX
from ._wire import Kind, Message, WireError, control

PYTHON_VERSION = "{}.{}".format(*sys.version_info[:2])
NOT_FORMING = "NotFormingHere"  # a REJECT's error: came to form at a coordinator still open (rule 9)
MAX_MESSAGE_BYTES = 12000  # an error text sent to replicas, as JSON; an ERROR's two texts, type
MAX_TRACEBACK_BYTES = 32000  # and traceback stay under the 64 KiB a replica parses (MAX_JSON_BYTES)
MAX_ENDPOINT_CHARS = 300  # a data port's "tcp://host:port", as a JOIN states it
MAX_PLAN_FRAMES = 256  # a value of more buffers keeps the star: its plan stays small
LOCAL_CHARS = frozenset("0123456789abcdef")
MAX_LOCAL_CHARS = 64
DATA_KEY_BYTES = 32  # the key of the data ports' handshake tokens when there is no secret


def join(rank: int, num_replicas: int, python: str, nonce: str, challenge: Optional[str],
         data: Optional[str], data_min: int, data_mode: str, lineage: Optional[str] = None,
         newcomer: bool = False, job: Optional[str] = None, ops: str = "", mail: Optional[str] = None,
         shm: Optional[tuple[int, int]] = None, mail_window: int = 0, local: Optional[str] = None) -> Message:
    """JOIN: who this replica is and what it runs, answers bound to ``nonce``; ``shm``: (threshold, free
    bytes); ``lineage``: the session it forms the next of (old rank, size); ``newcomer``: to be admitted;
    ``local``: the name of its one-host mailbox (ranks on its host reach it there, see _io/_local)."""
    body: dict[str, Any] = {"rank": rank, "num_replicas": num_replicas, "protocol": _wire.PROTOCOL_VERSION,
                            "python": python, "pid": os.getpid(), "host": socket.gethostname(),
                            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                            else os.cpu_count() or 1,
                            "nonce": nonce, "ops": ops}
    if challenge is not None:
        body["challenge"] = challenge
    if lineage is not None:
        body["lineage"] = lineage
    if newcomer:
        body["newcomer"] = True
    if job is not None:
        body["job"] = job
    body["macs"] = list(available_backends())
    if data is not None:
        body.update(data=data, data_min=data_min, data_mode=data_mode)
    if mail is not None:  # its mailbox port (point to point), and its window
        body.update(mail=mail, mail_window=mail_window)
        if local is not None:
            body["local"] = local
    if shm is not None:
        body["shm"] = {"min": shm[0], "room": shm[1]}
    return control(Kind.JOIN, body, rank=rank)


def parse_join(msg: Message) -> dict[str, Any]:
    """A JOIN's fields; WireError without integer rank, num_replicas, pid, a python string, a valid job."""
    body = msg.body()
    rank, n, python, pid = body.get("rank"), body.get("num_replicas"), body.get("python"), body.get("pid", 0)
    if not (all(type(x) is int for x in (rank, n, pid)) and isinstance(python, str)):
        raise WireError("rank, num_replicas and pid must be integers, python a string")
    job = body.get("job")
    if not (job is None or isinstance(job, str) and len(job) <= MAX_JOB_CHARS):
        raise WireError(f"job must be a string of at most {MAX_JOB_CHARS} characters")
    python = printable(python[:64])
    data, data_min, macs = body.get("data"), body.get("data_min", 0), body.get("macs")
    if not (isinstance(data, str) and data.startswith("tcp://") and len(data) <= MAX_ENDPOINT_CHARS
            and type(data_min) is int):
        data, data_min = None, 0  # no data port: the group keeps the star
    mail = body.get("mail")
    if not (isinstance(mail, str) and mail.startswith("tcp://") and len(mail) <= MAX_ENDPOINT_CHARS):
        mail = None  # no mailbox: the group has no point to point
    window = body.get("mail_window")
    if not (type(window) is int and 0 < window < 1 << 63):
        window = 0  # (a replica of an older release: each sender's own window)
    lineage, shm = body.get("lineage"), body.get("shm")
    return {"rank": rank, "num_replicas": n, "python": python, "ops": printable(str(body.get("ops"))[:1024]),
            "pid": pid, "nonce": join_nonce(msg),
            "lineage": lineage[:64] if isinstance(lineage, str) else None,
            "newcomer": body.get("newcomer") is True, "job": None if job is None else printable(job),
            "host": printable(str(body.get("host", "?"))[:256]), "data": data, "data_min": data_min,
            "data_mode": "on" if body.get("data_mode") == "on" else "auto",
            "mail": mail, "mail_window": window, "local": local_name(body.get("local")) if mail else None,
            "macs": tuple(m for m in macs[:8] if m in KEY_LABELS) if isinstance(macs, list) else (),
            "shm": _shm_offer(shm),
            "cores": body["cores"] if type(body.get("cores")) is int and body["cores"] > 0 else 1}


def local_name(name: Any) -> Optional[str]:
    """A one-host mailbox's name as a JOIN or WELCOME gives it, or None (not one: no such mailbox)."""
    ok = (isinstance(name, str) and len(name) <= MAX_LOCAL_CHARS and name.startswith(NAME_PREFIX)
          and all(c in LOCAL_CHARS for c in name[len(NAME_PREFIX):]))
    return name if ok else None


def _shm_offer(body: Any) -> Optional[tuple[int, int]]:
    """A JOIN's shared memory (threshold, room), or None."""
    if not isinstance(body, dict):
        return None
    least, room = body.get("min"), body.get("room")
    return (least, room) if type(least) is int and type(room) is int and least >= 0 and room >= 0 else None


def join_nonce(msg: Message) -> str:
    """A JOIN's nonce as far as it reads: even a refused one's answer is bound to it."""
    return str(msg.body().get("nonce", ""))[:64]


def challenge(text: str, **header: Any) -> Message:
    """CHALLENGE: with a secret, the text a JOIN must echo."""
    return control(Kind.CHALLENGE, {"challenge": text}, **header)


def challenge_of(msg: Message) -> Optional[str]:
    """The text a CHALLENGE gives and a JOIN echoes, or None."""
    text = msg.body().get("challenge")
    return text if isinstance(text, str) else None


def welcome(num_replicas: int, nonce: str, parts: Optional[int], mac: Optional[str],
            data: Optional[list[str]], data_min: int, data_key: Optional[str],
            addresses: Optional[list[str]] = None, renumber: Optional[dict[str, Any]] = None,
            admitted: Optional[dict[str, Any]] = None, mail: Optional[list[str]] = None,
            shm: Optional[dict[str, Any]] = None, tree: Optional[int] = None,
            mail_windows: Optional[list[int]] = None, local: Optional[list[Optional[str]]] = None,
            **header: Any) -> Message:
    """WELCOME: the JOIN it answers, how the group frames and signs, its ports and addresses; ``renumber``:
    this member's ``rank`` and every ``old`` one; ``shm``: :func:`shared_plan`; ``tree``: the fan-out."""
    body: dict[str, Any] = {"num_replicas": num_replicas, "nonce": nonce, "parts": parts, "mac": mac}
    if data is not None:
        body.update(data=data, data_min=data_min, data_key=data_key)
    if addresses is not None:
        body["addresses"] = addresses
    if mail is not None:  # every rank's mailbox, whose tokens are made under the data key too
        body.update(mail=mail, data_key=data_key, mail_windows=mail_windows)
        if local is not None and any(local):  # the one-host mailboxes' names (None: that rank has none)
            body["local"] = local
    if renumber is not None:
        body["renumber"] = renumber
    if admitted is not None:  # a newcomer: its rank and size in the group formed next, the lineage
        body["admitted"] = admitted
    if shm is not None:
        body["shm"] = shm
    if tree is not None:
        body["tree"] = tree
    return control(Kind.WELCOME, body, **header)


def shared_plan(least: int, hosts: list[Optional[int]], room: list[int]) -> dict[str, Any]:
    """A WELCOME's shared memory: from ``least`` bytes; ``hosts``: each rank's host number (None: none);
    ``room``: by host, the most bytes its segment may take."""
    return {"min": least, "hosts": hosts, "room": room}


def parse_shared(body: Any, num_replicas: int) -> Optional[dict[str, Any]]:
    """A WELCOME's shared memory, whole, or None."""
    if not isinstance(body, dict):
        return None
    least, hosts, room = body.get("min"), body.get("hosts"), body.get("room")
    if not (type(least) is int and least >= 0 and isinstance(hosts, list) and len(hosts) == num_replicas
            and isinstance(room, list) and all(type(b) is int and b >= 0 for b in room)
            and all(h is None or type(h) is int and 0 <= h < len(room) for h in hosts)):
        return None
    return {"min": least, "hosts": hosts, "room": room}


def parse_welcome(msg: Message, num_replicas: int) -> dict[str, Any]:
    """A WELCOME's fields, a malformed one (or a MAC not here) as None; the data plane only whole."""
    body = msg.body()
    renumber = body.get("renumber")
    if isinstance(renumber, dict):
        n, rank, old = body.get("num_replicas"), renumber.get("rank"), renumber.get("old")
        if not (type(n) is int and type(rank) is int and 0 <= rank < n and isinstance(old, list)
                and len(old) == n and all(type(r) is int for r in old)):
            raise WireError("a WELCOME's renumbering must give a rank and every rank's old one")
        num_replicas, renumber = n, {"rank": rank, "old": old}
    else:
        renumber = None
    admitted = body.get("admitted")
    if isinstance(admitted, dict):
        rank, size, lineage = admitted.get("rank"), admitted.get("size"), admitted.get("lineage")
        if not (type(rank) is int and type(size) is int and 0 <= rank < size
                and isinstance(lineage, str) and 0 < len(lineage) <= 64):
            raise WireError("a WELCOME's admission must give a rank, a size and a lineage")
        admitted = {"rank": rank, "size": size, "lineage": lineage}
    else:
        admitted = None
    addresses = body.get("addresses")
    if not (isinstance(addresses, list) and len(addresses) == num_replicas
            and all(isinstance(a, str) and len(a) <= MAX_ENDPOINT_CHARS for a in addresses)):
        addresses = None
    nonce, parts, mac, data = body.get("nonce"), body.get("parts"), body.get("mac"), body.get("data")
    least, key, mail = body.get("data_min"), body.get("data_key"), body.get("mail")
    whole = (isinstance(data, list) and len(data) == num_replicas and all(isinstance(e, str) for e in data)
             and type(least) is int and is_data_key(key))
    mail_whole = (isinstance(mail, list) and len(mail) == num_replicas and is_data_key(key)
                  and all(isinstance(e, str) and len(e) <= MAX_ENDPOINT_CHARS for e in mail))
    local = body.get("local")
    local = ([local_name(n) for n in local] if mail_whole and isinstance(local, list)
             and len(local) == num_replicas else None)
    windows = body.get("mail_windows")
    if not (isinstance(windows, list) and len(windows) == num_replicas
            and all(type(w) is int and 0 <= w < 1 << 63 for w in windows)):
        windows = None
    return {"nonce": nonce if isinstance(nonce, str) else None,
            "parts": parts if type(parts) is int and parts >= WIRE_PART_BYTES else None,
            "mac": mac if mac in available_backends() else None, "data": data if whole else None,
            "data_min": least if whole else 0, "data_key": key if whole else None,
            "renumber": renumber, "addresses": addresses, "admitted": admitted,
            "mail": mail if mail_whole else None, "mail_key": key if mail_whole else None,
            "mail_windows": windows if mail_whole else None, "local": local,
            "shm": parse_shared(body.get("shm"), num_replicas), "tree": _fanout(body.get("tree"))}


MAX_FANOUT = 64  # a WELCOME's tree fan-out beyond this is no release's (it sends 4): read as no tree


def _fanout(tree: Any) -> Optional[int]:
    return tree if type(tree) is int and 2 <= tree <= MAX_FANOUT else None


def is_data_key(key: Any) -> bool:
    """Hex of DATA_KEY_BYTES bytes, as a WELCOME gives the data ports' key."""
    return isinstance(key, str) and len(key) == 2 * DATA_KEY_BYTES and all(c in string.hexdigits for c in key)


def error_body(error: str, message: str, limit: int = MAX_MESSAGE_BYTES, **extra: Any) -> dict[str, Any]:
    """An ERROR, FAIL or REJECT: a name of errors.WIRE_ERRORS, its text cut, what else it says."""
    return {"error": error, "message": cap(message, limit), **extra}


def remote_error_body(head: str, exc: BaseException) -> dict[str, Any]:
    """The ERROR for a reduce function that raised ``exc`` on rank 0 (which may fail to print)."""
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    try:
        said = str(exc)
    except Exception as inner:
        said = f"<str() of the exception raised {type(inner).__name__}>"
    try:
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:
        trace = ""
    return {"error": "RemoteError", "message": cap(f"{head}: {kind}: {said}"), "remote_type": cap(kind, 1000),
            "remote_message": cap(said), "remote_traceback": cap(trace, MAX_TRACEBACK_BYTES, tail=True)}


def parse_error(msg: Message) -> tuple[Exception, bool]:
    """The exception an ERROR, FAIL or REJECT describes, and whether a rank's program ``ended``."""
    body = msg.body()
    name, message = str(body.get("error")), str(body.get("message", "?"))
    if name == "RemoteError":
        error: Exception = RemoteError(message, str(body.get("remote_type", "")),
                                       str(body.get("remote_message", "")),
                                       str(body.get("remote_traceback", "")))
    else:
        error = WIRE_ERRORS.get(name, CollectiveError)(message)
    for key, attr in (("lost", "lost_ranks"), ("dead", "dead_ranks")):  # shrink's lead, and its majority
        ranks = body.get(key)
        if isinstance(ranks, list) and all(type(r) is int for r in ranks[:4096]):
            setattr(error, attr, tuple(ranks[:4096]))
    ended = body.get("ended") is True
    if ended:  # (lost because their programs ended: they did not die)
        error.ended_ranks = getattr(error, "lost_ranks", ())  # type: ignore[attr-defined]
    return error, ended


def complete_of(msg: Message) -> int:
    """A FAIL's calls before this seq completed, their results on their way (0: none said)."""
    complete = msg.body().get("complete")
    return complete if type(complete) is int and complete > 0 else 0


MAX_ENDED_CHARS = 1000  # how a rank ended, as FINAL forwards it ("rank 2 (pid 7 on host) called teardown")


MAX_RECEIVED_RANGES = 512  # a FINAL's ranges of messages received out of order, all ranks together: a
# program that left more holes is said to have received fewer (a send then fails: never a loss unsaid)


Received = Union[int, list[int]]  # which of a rank's messages were received: n (every number below n), or
# [n, a1, b1, a2, b2, ...]: also from each a up to (not with) its b

MAX_POSTED_TAGS = 512  # a teardown FINAL's tags of the receives still posted, all ranks together: past
# this a rank's are unsaid (None), and every send to the rank in teardown goes (it is dropped if unmatched)


def final(sent: list[int], teardown: bool, received: Optional[list[Received]] = None,
          lost: Optional[list[int]] = None, calls: Optional[int] = None,
          posted: Optional[list[Optional[list[int]]]] = None, **header: Any) -> Message:
    """FINAL to the coordinator: this rank sends no more, having sent ``sent[r]`` to rank r (``lost[r]``
    never left), received ``received[r]`` (a :data:`Received`), made ``calls`` collective calls; by
    ``teardown`` or not; ``posted[r]``: the tags (-1: any) of its receives still posted that rank r's
    messages could match, in posting order (None: unsaid)."""
    body: dict[str, Any] = {"sent": sent, "how": "teardown" if teardown else "exit"}
    if posted is not None:
        body["posted"] = _within_posted_budget(posted)
    if received is not None:
        room, said = MAX_RECEIVED_RANGES, list[Received]()
        for ranges in received:
            if isinstance(ranges, int):
                said.append(ranges)
                continue
            kept = min(room, (len(ranges) - 1) // 2)
            room -= kept
            said.append(ranges[0] if kept == 0 else ranges[:1 + 2 * kept])
        body["received"] = said
    for key, value in (("lost", lost), ("calls", calls)):
        if value is not None:
            body[key] = value
    return control(Kind.FINAL, body, **header)


def _counts(value: Any, num_replicas: int) -> bool:
    return (isinstance(value, list) and len(value) == num_replicas
            and all(type(n) is int and 0 <= n < 1 << 63 for n in value))


def _received(value: Any) -> Optional[Received]:
    """A FINAL's :data:`Received` from one rank; None: malformed (numbers out of order, or too many)."""
    if type(value) is int:
        return value if 0 <= value < 1 << 63 else None
    if (not isinstance(value, list) or len(value) % 2 != 1 or len(value) > 1 + 2 * MAX_RECEIVED_RANGES
            or not all(type(n) is int for n in value)):
        return None
    ordered = value[0] >= 0 and all(a < b for a, b in zip(value[1:], value[2:], strict=False)) and (
        len(value) == 1 or value[0] < value[1]) and (value[-1] < 1 << 63)
    return value if ordered else None


def parse_final(msg: Message, num_replicas: int) -> dict[str, Any]:
    """A member's FINAL: ``sent``, ``lost``, ``received`` by rank, ``calls`` (None: unsaid), ``teardown``."""
    body = msg.body(max(_wire.MAX_JSON_BYTES, 72 * num_replicas) + 42 * MAX_RECEIVED_RANGES)  # (a count
    sent = body.get("sent")  # is at most 19 digits)
    if not _counts(sent, num_replicas):
        raise WireError("FINAL must count the messages sent to each rank")
    received, lost, calls = body.get("received"), body.get("lost"), body.get("calls")
    if isinstance(received, list) and len(received) == num_replicas:
        received = [_received(r) for r in received]
        ranges = sum(len(r) // 2 for r in received if isinstance(r, list))
        received = None if None in received or ranges > MAX_RECEIVED_RANGES else received
    else:
        received = None
    posted = body.get("posted")
    posted = (_within_posted_budget([_posted(tags) for tags in posted])
              if isinstance(posted, list) and len(posted) == num_replicas else [None] * num_replicas)
    return {"sent": sent, "teardown": body.get("how") == "teardown", "received": received,
            "lost": lost if _counts(lost, num_replicas) else [0] * num_replicas,
            "calls": calls if type(calls) is int and 0 <= calls < 1 << 63 else None, "posted": posted}


def _within_posted_budget(posted: list[Optional[list[int]]]) -> list[Optional[list[int]]]:
    """Each rank's posted tags while :data:`MAX_POSTED_TAGS` in all allow, in rank order; past them, None
    (unsaid)."""
    room, said = MAX_POSTED_TAGS, list[Optional[list[int]]]()
    for tags in posted:
        fits = tags is not None and len(tags) <= room
        said.append(tags if fits else None)
        room -= len(tags) if fits and tags is not None else 0
    return said


def _posted(value: Any) -> Optional[list[int]]:
    """A FINAL's tags of receives posted for one rank; None: unsaid or malformed."""
    if (isinstance(value, list) and len(value) <= MAX_POSTED_TAGS
            and all(type(t) is int and -1 <= t <= MAX_TAG for t in value)):
        return value
    return None


def ended(who: str, received: Optional[Received] = None, lost: int = 0, *, teardown: bool = False,
          posted: Optional[list[int]] = None, **header: Any) -> Message:
    """FINAL to member ``rank``: ``root`` sent ``seq`` (``lost`` never left), received ``received`` (as
    :func:`final` says it); ``posted``: the tags of its receives still posted that this rank's messages
    could match (None: unsaid)."""
    body: dict[str, Any] = {"ended": cap(who, MAX_ENDED_CHARS), "how": "teardown" if teardown else "exit",
                            "lost": lost}
    if received is not None:
        body["received"] = received
    if posted is not None:
        body["posted"] = posted
    return control(Kind.FINAL, body, **header)


def parse_ended(msg: Message) -> str:
    return cap(printable(str(msg.body().get("ended", "?"))), MAX_ENDED_CHARS)


def ended_by_teardown(msg: Message) -> bool:
    """Did the rank a coordinator's FINAL names call teardown (else its program ended)?"""
    return msg.body().get("how") == "teardown"


def ended_counts(msg: Message) -> tuple[Optional[Received], int]:
    """A FINAL's counts for its recipient: which of its messages were received (as :func:`final` says it;
    None: not said), how many of those to it were lost."""
    body = msg.body()
    received, lost = body.get("received"), body.get("lost", 0)
    return (None if received is None else _received(received),
            lost if type(lost) is int and 0 <= lost < 1 << 63 else 0)


def ended_posted(msg: Message) -> Optional[list[int]]:
    """A FINAL's tags of the receives still posted that its recipient's messages could match (None:
    not said)."""
    return _posted(msg.body().get("posted"))


def abort(error: BaseException, data_plane: bool = False, lost: Optional[int] = None,
          **header: Any) -> Message:
    """ABORT: a replica found the group broken (on its data plane: ``lost`` is the far end)."""
    body: dict[str, Any] = {"error": type(error).__name__, "message": str(error)}
    if data_plane:
        body.update(lost=lost, plane="data")
    return control(Kind.ABORT, body, **header)


def abandon(why: str, timed_out: bool, **header: Any) -> Message:
    """ABORT of call ``seq`` alone: this rank gave it up (``why``), so it fails on every rank alike."""
    error = "CollectiveTimeoutError" if timed_out else "PeerError"
    return control(Kind.ABORT, {"error": error, "message": why, "abandoned": True}, **header)


def parse_abort(msg: Message, num_replicas: int) -> tuple[str, str, list[int], bool, bool]:
    """An ABORT's error name, text, the rank its data plane lost, and if it gives up one call."""
    body = msg.body()
    error, lost = body.get("error"), body.get("lost")
    return (error if isinstance(error, str) else "", printable(str(body.get("message", "?"))[:2000]),
            [lost] if type(lost) is int and 0 <= lost < num_replicas else [], body.get("plane") == "data",
            body.get("abandoned") is True)


def status(seq: int, state: str, fields: dict[str, Any], **header: Any) -> Message:
    """STATUS_REPLY: joining (missing, arrived, refused) or a call's (arrived, missing, op)."""
    return control(Kind.STATUS_REPLY, {"seq": seq, "state": state, **fields}, seq=seq, **header)


def parse_status(msg: Message) -> dict[str, Any]:
    """A STATUS_REPLY's body; WireError unless its rank lists are (they end up in messages)."""
    body = msg.body()
    for key in ("missing", "arrived"):
        ranks = body.get(key, [])
        if not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
            raise WireError(f"status reply field {key!r} is not a list of ranks")
    return body


def plan(**fields: Any) -> bytes:
    """A data plan: ``sizes`` of frames (by rank in an allgather), or an array's dtype, shape, fn."""
    return json.dumps(fields, separators=(",", ":")).encode()


def sizes_plan(segment: list[Any], data_min: int) -> Optional[bytes]:
    """The plan of a serialized value, or None if it keeps the star (small, or of many buffers)."""
    sizes = [memoryview(f).nbytes for f in segment]
    return None if sum(sizes) < data_min or len(sizes) > MAX_PLAN_FRAMES else plan(sizes=sizes)


def parse_sizes(msg: Message, max_frame_bytes: Optional[int] = None) -> list[int]:
    """The sizes of a value's frames, at most MAX_PLAN_FRAMES of max_frame_bytes, or WireError."""
    sizes: Any = msg.body().get("sizes")
    if not _sizes(sizes) or sum(sizes) > (max_frame_bytes or sys.maxsize) * max(1, len(sizes)):
        raise WireError(f"malformed frame sizes {str(sizes)[:100]}")
    return sizes


def parse_gather_plan(msg: Message, num_replicas: int) -> list[Optional[list[int]]]:
    """By rank, the sizes of a value's frames, or None for one inline; or WireError."""
    told: Any = msg.body(_wire.MAX_JSON_BYTES * num_replicas).get("sizes")
    if not (isinstance(told, list) and len(told) == num_replicas
            and all(s is None or _sizes(s) for s in told)):
        raise WireError(f"malformed allgather plan {str(told)[:100]}")
    return told


def shared_status(staged: bool, free: bool) -> bytes:
    """A rank's word on a shared-memory call: input written at the call (``staged``), the set ``free``."""
    return _STATUSES[staged, free]


_STATUSES = {(s, f): plan(staged=s, free=f) for s in (False, True) for f in (False, True)}  # sent per call


def parse_shared_status(frame: Any) -> tuple[bool, bool]:
    """``(staged, free)`` of :func:`shared_status`, or WireError."""
    got = _wire.parse_json(frame, 256)
    staged, free = got.get("staged"), got.get("free")
    if not (isinstance(staged, bool) and isinstance(free, bool)):
        raise WireError("malformed shared-memory status")
    return staged, free


def shared_call(staged: list[bool], free: list[bool]) -> bytes:
    """A shared-memory call's plan by host: every rank staged its input; some rank knows the set free."""
    return plan(staged=staged, free=free)


def parse_shared_call(msg: Message, host: int) -> tuple[bool, bool]:
    """``(staged, free)`` of host ``host`` in a plan's :func:`shared_call`, or WireError."""
    frames = msg.segments[0] if msg.segments else []
    got = _wire.parse_json(frames[1], MAX_MESSAGE_BYTES) if len(frames) == 2 else {}
    staged, free = got.get("staged"), got.get("free")
    if not (isinstance(staged, list) and isinstance(free, list) and 0 <= host < min(len(staged), len(free))
            and isinstance(staged[host], bool) and isinstance(free[host], bool)):
        raise WireError("malformed shared-memory plan")
    return staged[host], free[host]


def parts_plan(parts: list[list[int]]) -> bytes:
    """A rank's parts written into its host's shared memory: each value's frame sizes."""
    return plan(shm=True, parts=parts)


def parse_parts(frame: Any) -> list[list[int]]:
    """The parts of a :func:`parts_plan`, at most MAX_PLAN_FRAMES frames in all, or WireError."""
    parts = _wire.parse_json(frame, MAX_MESSAGE_BYTES).get("parts")
    if not (isinstance(parts, list) and all(_sizes(p) for p in parts)
            and sum(len(p) for p in parts) <= MAX_PLAN_FRAMES):
        raise WireError(f"malformed shared-memory parts {str(parts)[:100]}")
    return parts


def exchange_plan(parts: list[Optional[list[list[int]]]]) -> bytes:
    """A shared-memory exchange's plan: by rank, the parts it wrote (None: none, or inline)."""
    return plan(shm=True, parts=parts)


def parse_exchange_plan(msg: Message, num_replicas: int) -> list[Optional[list[list[int]]]]:
    """By rank, the parts of :func:`exchange_plan`, or WireError."""
    told: Any = msg.body(MAX_MESSAGE_BYTES * num_replicas).get("parts")
    if not (isinstance(told, list) and len(told) == num_replicas and all(
            p is None or isinstance(p, list) and all(_sizes(s) for s in p)
            and sum(len(s) for s in p) <= MAX_PLAN_FRAMES for p in told)):
        raise WireError(f"malformed shared-memory plan {str(told)[:100]}")
    return told


def is_shared(msg: Message) -> bool:
    """Is ``msg`` (a contribution or a plan) a shared-memory one (a status or host flags beside it)?"""
    return len(msg.segments) >= 1 and len(msg.segments[0]) == 2


def parse_array_plan(msg: Message) -> tuple[str, tuple[int, ...], str]:
    """``(dtype, shape, fn)`` of an array plan of at most MAX_MESSAGE_BYTES, or WireError."""
    got = msg.body(MAX_MESSAGE_BYTES)
    dtype, shape, fn = got.get("dtype"), got.get("shape"), got.get("fn")
    if not (isinstance(dtype, str) and isinstance(fn, str) and isinstance(shape, list)
            and all(type(n) is int for n in shape)):
        raise WireError("malformed array description")
    return dtype, tuple(shape), fn


def _sizes(sizes: Any) -> bool:
    return (isinstance(sizes, list) and len(sizes) <= MAX_PLAN_FRAMES
            and all(type(n) is int and n >= 0 for n in sizes))


def printable(text: str) -> str:
    """``text`` with a lone surrogate a peer sent escaped: it ends up in logs and messages."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def cap(text: str, limit: int = MAX_MESSAGE_BYTES, tail: bool = False) -> str:
    """``text`` cut to ``limit`` bytes as JSON, saying so (a traceback keeps its end)."""
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
