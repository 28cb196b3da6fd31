"""Fuzzing: no malformed input crashes the coordinator or a replica.

Two layers. Pure (no network): hypothesis feeds random frames and mutated
well-formed messages of every kind to ``_wire.decode``, to a
:class:`Coordinator` in every phase and to a replica's message handling, with
and without a secret; a deterministic sweep adds every header field's extreme
values and wrong JSON types for every body key. Real processes: strangers
flood a running group's master port, and a ZMTP-aware TCP proxy injects
mutated copies of the coordinator's messages into one replica's stream; every
result must stay exact. Everything is bounded: the file runs in seconds.
"""

import contextlib
import functools
import json
import logging
import os
import pickle
import random
import threading
import time
import traceback

import pytest
import zmq
import zmtp
from hypothesis import HealthCheck, given, note, settings
from hypothesis import Phase as HypothesisPhase
from hypothesis import strategies as st
from relay import Relay

import zcollective as zc
from zcollective._format import _serialize
from zcollective._format._wire import (
    CONTROL_KINDS,
    FLAG_AUTH,
    FLAG_LOCAL_ERROR,
    HEADER,
    MAX_JSON_BYTES,
    NO_RANK,
    PROTOCOL_VERSION,
    AuthError,
    Kind,
    Message,
    Signer,
    VersionError,
    WireError,
    control,
    decode,
    encode,
)
from zcollective._io import _zap
from zcollective._io._combine import applied
from zcollective._protocol._coordinator import PYTHON_VERSION, Coordinator, Phase
from zcollective._protocol._member import Call, Member
from zcollective._protocol._ops import SPOKEN, Op, label
from zcollective.errors import AuthenticationError, CollectiveError, ProtocolError
from zcollective.testing import Replicas, free_port, report

N = 3  # replicas in the pure groups
SESSION = 0x5E55_10F0_0D
NONCE = "ab" * 16  # the nonce of the fuzzed replica's JOIN
SECRET = b"fuzz-secret-of-enough-length-32b"
SIGNER = Signer(SECRET)
WRONG = Signer(b"not-the-secret-but-long-enough!!")
MAX_FRAMES = 64  # small, so "too many frames" is cheap to build
FAST = settings(max_examples=80, deadline=None, database=None,
                phases=[HypothesisPhase.explicit, HypothesisPhase.reuse, HypothesisPhase.generate,
                        HypothesisPhase.shrink],  # no "explain": slow, and it needs libcst
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def add(a, b):
    return a + b


# -- well-formed messages of every kind ---------------------------------------------


def join_body(rank, nonce):
    return {"rank": rank, "num_replicas": N, "protocol": PROTOCOL_VERSION, "python": PYTHON_VERSION,
            "pid": 100 + rank, "host": "h", "nonce": nonce, "ops": SPOKEN}


@functools.lru_cache(maxsize=64)
def samples(rank=1, seq=0):
    """A well-formed message of every kind (and a contribution of every shape);
    shared, so never to be changed."""
    value, fn = _serialize.dumps(7), _serialize.dumps_function(add)
    note_ = control(Kind.ERROR, {"message": "bad values"}).segments
    contrib = [
        (Op.ALLREDUCE, 0, 0, fn, [value]), (Op.REDUCE, 1, 0, None, [value]),
        (Op.BROADCAST, 0, 0, None, [[b"p", b"b" * 300]]), (Op.SCATTER, 1, 0, None, [value] * N),
        (Op.ALLTOALL, 0, 0, None, [value] * N), (Op.GATHER, 2, 0, None, [value]),
        (Op.ALLGATHER, 0, FLAG_LOCAL_ERROR, None, note_), (Op.BARRIER, 0, 0, None, []),
    ]
    made = [
        control(Kind.JOIN, join_body(rank, "cd" * 16), rank=rank),
        control(Kind.WELCOME, {"num_replicas": N, "nonce": NONCE}, rank=rank, session=SESSION),
        control(Kind.REJECT, {"error": "CollectiveError", "message": "refused"}, rank=rank),
        *[Message(Kind.CONTRIB, op, rank, root, seq, SESSION, "fuzz.py:1", flags, f, segs)
          for op, root, flags, f, segs in contrib],
        Message(Kind.RESULT, Op.ALLREDUCE, rank, 0, seq, SESSION, segments=[value]),
        control(Kind.ERROR, {"error": "RemoteError", "message": "m", "remote_type": "ZeroDivisionError",
                             "remote_message": "x", "remote_traceback": "tb"},
                op=Op.ALLREDUCE, rank=rank, seq=seq, session=SESSION),
        Message(Kind.STATUS, rank=rank, seq=seq, session=SESSION),
        control(Kind.STATUS_REPLY, {"seq": seq, "state": "pending", "arrived": [0], "missing": [1, 2],
                                    "refused": {"2": "why"}}, rank=rank, seq=seq, session=SESSION),
        control(Kind.FAIL, {"error": "ReplicaLostError", "message": "gone", "lost": [2], "ended": True},
                rank=rank, session=SESSION),
        Message(Kind.BYE, rank=rank, seq=seq, session=SESSION),
    ]
    for kind in set(Kind) - {m.kind for m in made}:  # any other kind, in its plainest form
        if kind in CONTROL_KINDS:
            made.append(control(kind, {"error": "CollectiveError", "message": "m"}, rank=rank, seq=seq,
                                session=SESSION))
        else:
            made.append(Message(kind, rank=rank, seq=seq, session=SESSION))
    return tuple(sorted(made, key=lambda m: (m.kind, m.op)))


def frames_of(msg, signer=None):
    return [bytes(memoryview(f)) for f in encode(msg, signer)]


# -- mutations: primitive edits ---------------------------------------------------

FIELDS = ("magic", "version", "kind", "op", "flags", "rank", "root", "seq", "session", "nseg")
U8 = (0, 1, 2, 3, 4, 6, 7, 11, 12, 127, 128, 255)
I32 = (-2**31, -2, -1, 0, 1, 2, 3, 4, 2**31 - 1)
U64 = (0, 1, 2, SESSION - 1, SESSION + 1, 2**63, 2**64 - 1)
U32 = (0, 1, 2, 3, 4, 255, 2**16, 2**31, 2**32 - 1)
EXTREMES = {"magic": (b"\0\0", b"CZ", b"zc"), "version": U8, "kind": U8, "op": U8, "flags": U8,
            "rank": I32, "root": I32, "seq": U64, "session": U64, "nseg": U32}
CALLSITES = (b"x" * 600, b"\xff\xfe\xfd", b"\0", "\u00e9".encode() * 300)
HEAD_CUTS = (0, 2, 3, 33, 34, 35)
# JSON values of every wrong type, written as text: Python's json cannot write some of them
WEIRD_JSON = (
    "null", "true", "false", "-1", "0", "2147483648", "-9223372036854775809", "18446744073709551616",
    "1.5", "-0.0", "1e400", "NaN", "-Infinity", '""', '"x"', '"\\ud800"', '"' + "y" * 3000 + '"',
    "[]", "{}", "[1,2,3]", '{"a":1}', '["0"]', "[null]", "[-1]", "[1e400]", "[true]", "[[1]]",
    '"' + "z" * (MAX_JSON_BYTES - 100) + '"',  # fits in a body, but not quoted in a longer one
    '{"1":2}', "9" * 5000, "1" + "0" * 4299, "-" + "1" * 4300, "[" * 900 + "]" * 900,
    "[" * 5000 + "]" * 5000, '{"a":' * 900 + "1" + "}" * 900,
)
WHOLE_BODIES = (
    b"", b"null", b"[]", b"[1,2]", b'"text"', b"3", b"{", b"{}", b"\xff\xfe", b"\xef\xbb\xbf{}",
    b'{"a":1,"a":2}', b"[" * 5000 + b"]" * 5000, b'{"x":' + b"9" * 5000 + b"}",
    b" " * (MAX_JSON_BYTES + 1), b'{"a":"' + b"x" * MAX_JSON_BYTES + b'"}',
)
SIGNINGS = ("none", "right", "wrong", "flipped", "zero tag")


def set_field(frames, field, value):
    if not frames or len(frames[0]) < HEADER.size:
        return frames
    head = frames[0]
    values = list(HEADER.unpack_from(head))
    values[FIELDS.index(field)] = value
    return [HEADER.pack(*values) + head[HEADER.size:], *frames[1:]]


def nseg_of(frames):
    return HEADER.unpack_from(frames[0])[-1] if frames and len(frames[0]) >= HEADER.size else 0


def set_count(frames, index, count):
    head = bytearray(frames[0])
    at = HEADER.size + 4 * index
    head[at:at + 4] = count.to_bytes(4, "little")
    return [bytes(head), *frames[1:]]


def cut_layout(frames):
    """The header without its layout, nseg unchanged: the call site is read as layout."""
    head = frames[0]
    return [head[:HEADER.size] + head[HEADER.size + 4 * nseg_of(frames):], *frames[1:]]


def extra_count(frames, count):
    head, end = frames[0], HEADER.size + 4 * nseg_of(frames)
    return [head[:end] + count.to_bytes(4, "little") + head[end:], *frames[1:]]


def body_position(frames):
    """Index of the JSON frame (the first frame of the first segment), or None."""
    try:
        msg = decode(frames, MAX_FRAMES)
    except WireError:
        return None
    if not msg.segments:
        return None
    return 2 if msg.fn is not None else 1


def body_keys(frames):
    pos = body_position(frames)
    if pos is None:
        return []
    try:
        body = json.loads(frames[pos])
    except (ValueError, TypeError, RecursionError):
        return []
    return sorted(body) if isinstance(body, dict) else []


def with_body(frames, text):
    pos = body_position(frames)
    if pos is None:
        return frames
    return [*frames[:pos], text, *frames[pos + 1:]]


def body_with(frames, key, raw):
    """The JSON body with ``key`` set to the raw JSON text ``raw`` (None: left out)."""
    pos = body_position(frames)
    body = json.loads(frames[pos])
    items = [f"{json.dumps(k)}:{json.dumps(v)}" for k, v in body.items() if k != key]
    if raw is not None:
        items.append(f"{json.dumps(key)}:{raw}")
    return with_body(frames, ("{" + ",".join(items) + "}").encode())


def sign(frames, how, signer=SIGNER):
    """Frames as a peer with (or without) the secret would send them."""
    if how == "none" or not frames:
        return frames
    if how == "zero tag":
        return [*announce_tag(frames), b"\0" * 32]
    body = announce_tag(frames)
    tagged = [*body, (WRONG if how == "wrong" else signer).tag(body)]
    if how == "flipped":  # altered in flight after signing
        tagged[-1] = bytes([tagged[-1][0] ^ 1]) + tagged[-1][1:]
    return tagged


def announce_tag(frames):
    if not frames:
        return frames
    head = bytearray(frames[0])
    if len(head) > 5:
        head[5] |= FLAG_AUTH
    return [bytes(head), *frames[1:]]


# -- mutations: chosen by hypothesis or by a seeded Random ------------------------------


class Choices:
    """Where a mutation's choices come from: hypothesis (which shrinks them to a
    minimal example) or a seeded ``random.Random`` (the real-process layer)."""

    def __init__(self, draw=None, rng=None):
        self._draw, self._rng = draw, rng

    def below(self, n):
        if self._draw is not None:
            return self._draw(st.integers(0, n - 1))
        return self._rng.randrange(n)

    def pick(self, options):
        return options[self.below(len(options))]

    def blob(self, max_size):
        if self._draw is not None:
            return self._draw(st.binary(max_size=max_size))
        return self._rng.randbytes(self._rng.randrange(max_size + 1))


def mutate_field(c, frames):
    field = c.pick(FIELDS)
    value = c.pick(EXTREMES[field])
    return f"{field}={value!r}", set_field(frames, field, value)


def mutate_layout(c, frames):
    how, nseg = c.below(4), nseg_of(frames)
    if len(frames[0]) < HEADER.size:
        how = 3
    if how == 0 and nseg:
        index, count = c.below(nseg), c.pick(U32)
        return f"layout[{index}]={count}", set_count(frames, index, count)
    if how == 1:
        return "layout cut", cut_layout(frames)
    if how == 2:
        count = c.pick(U32)
        return f"extra layout count {count}", extra_count(frames, count)
    site = c.pick(CALLSITES)
    return f"call site {site[:8]!r}... ({len(site)} bytes)", [frames[0] + site, *frames[1:]]


def mutate_frames(c, frames):
    how, i = c.below(6), c.below(len(frames))
    if how == 0:
        return f"frame {i} dropped", frames[:i] + frames[i + 1:]
    if how == 1:
        return f"frame {i} twice", frames[:i + 1] + frames[i:]
    if how == 2:
        return f"empty frame at {i + 1}", frames[:i + 1] + [b""] + frames[i + 1:]
    if how == 3:
        cut = c.pick(HEAD_CUTS)
        return f"header cut to {cut} bytes", [frames[0][:cut], *frames[1:]]
    if how == 4:
        return "header only", frames[:1]
    return f"{MAX_FRAMES} frames appended", frames + [b""] * MAX_FRAMES


def mutate_bytes(c, frames):
    i = c.below(len(frames))
    frame = frames[i]
    how = c.below(3)
    if how == 0 and frame:
        bit = c.below(8 * len(frame))
        frame = frame[:bit // 8] + bytes([frame[bit // 8] ^ (1 << bit % 8)]) + frame[bit // 8 + 1:]
        return f"bit {bit} of frame {i} flipped", [*frames[:i], frame, *frames[i + 1:]]
    if how == 1:
        cut = c.below(len(frame) + 1)
        return f"frame {i} cut to {cut} bytes", [*frames[:i], frame[:cut], *frames[i + 1:]]
    blob = c.blob(48)
    return f"frame {i} replaced by {blob!r}", [*frames[:i], blob, *frames[i + 1:]]


def mutate_body(c, frames):
    keys = body_keys(frames)
    if keys and c.below(4):
        key = c.pick(keys)
        if c.below(8) == 0:
            return f"body without {key!r}", body_with(frames, key, None)
        raw = c.pick(WEIRD_JSON)
        return f"body {key!r}={raw[:20]}...({len(raw)} chars)", body_with(frames, key, raw)
    text = c.pick(WHOLE_BODIES)
    return f"body {text[:20]!r}...({len(text)} bytes)", with_body(frames, text)


MUTATIONS = (mutate_field, mutate_layout, mutate_frames, mutate_bytes, mutate_body)


def garbage(c, rank=1, seq=0, signings=("none",), signer=SIGNER, bases=None):
    """One hostile message: (what it is, its frames). Random frames, or a
    well-formed message (a sample, or one of ``bases``) with up to three
    mutations, then signed one of the ``signings`` ways."""
    if c.below(10) == 0:
        frames = [c.pick((b"", b"ZC", b"ZC\x01")) + c.blob(48) for _ in range(c.below(4) + 1)]
        what = "random frames"
    else:
        if bases and c.below(2):
            frames = c.pick(bases)
            what = "copy"
        else:
            msg = c.pick(samples(rank, seq))
            frames, what = frames_of(msg), f"{msg.kind.name} {label(msg.op)}"
        for _ in range(c.below(4)):
            if not frames:
                break
            change, frames = c.pick(MUTATIONS)(c, frames)
            what += f"; {change}"
    how = c.pick(signings)
    return f"{what}; signed: {how}", sign(frames, how, signer)


def show(frames):
    """Frames for a failure report, each cut short."""
    parts = [repr(f[:60]) + (f"+{len(f) - 60} bytes" if len(f) > 60 else "") for f in frames[:6]]
    more = f", ... {len(frames)} frames" if len(frames) > 6 else ""
    return "[" + ", ".join(parts) + more + "]"


# -- driving a coordinator --------------------------------------------------------


def peer(rank):
    return b"R%d" % rank


STRANGERS = (b"S0", b"S1", b"R\0\0\0\1stranger")  # the last one looks like a member's id


def join_msg(rank, challenge=None):
    body = join_body(rank, f"{rank:02d}" * 16)
    if challenge is not None:
        body["challenge"] = challenge
    return control(Kind.JOIN, body, rank=rank)


CHALLENGE = getattr(Kind, "CHALLENGE", None)  # with a secret, a JOIN must echo the coordinator's


def join(coord, rank, signer=None):
    """Rank ``rank`` joins as a replica does (answering a CHALLENGE if it gets one)."""
    out = send(coord, peer(rank), join_msg(rank), signer)
    asked = [m for p, m in out if p == peer(rank) and m.kind is CHALLENGE]
    if asked:
        out = send(coord, peer(rank), join_msg(rank, asked[0].body()["challenge"]), signer)
    return out


def contribution(rank, seq, value, op=Op.ALLREDUCE):
    fn = _serialize.dumps_function(add) if rank == 0 and op is Op.ALLREDUCE else None
    return Message(Kind.CONTRIB, op, rank, 0, seq, SESSION, "fuzz.py:9", 0, fn, [_serialize.dumps(value)])


def readable(out, signer):
    """What the driver would send, decoded as its receiver would. The driver
    encodes outside ``receive``, so a message it cannot encode crashes it too;
    a control body a replica cannot read leaves that replica waiting."""
    assert isinstance(out, list), out
    got = []
    for who, msg in out:
        assert isinstance(who, bytes) and isinstance(msg, Message), (who, msg)
        try:
            back = decode(encode(msg, signer), signer=signer)
            if back.kind in CONTROL_KINDS:
                back.body()
        except WireError as exc:
            raise AssertionError(f"the coordinator sent {msg.kind.name} seq {msg.seq} that its "
                                 f"receiver drops: {exc}") from None
        got.append((who, back))
    return got


def deliver(coord, who, frames, signer=None):
    """As a driver: what the coordinator returns, a reduction it asks for run where it stands."""
    step = coord.receive(who, frames, "10.0.0.9")
    assert isinstance(step, list), step
    return readable(list(applied(step, coord)), signer)


def send(coord, who, msg, signer=None):
    return deliver(coord, who, encode(msg, signer), signer)


PHASES = {"joining": Phase.JOINING, "idle": Phase.RUNNING, "running": Phase.RUNNING,
          "ended": Phase.RUNNING, "failed": Phase.FAILED, "closed": Phase.CLOSED}


def coordinator(phase, signer=None):
    """A coordinator of N replicas in ``phase``: joining (rank 0 joined), idle
    (all joined), running (rank 0's seq 0 allreduce is in), ended (running,
    and rank 2's program ended after 1 call), failed (a mismatch at seq 0),
    closed (a teardown at seq 0)."""
    coord = Coordinator(N, SESSION, MAX_FRAMES, signer)
    for r in range(1 if phase == "joining" else N):
        join(coord, r, signer)
    if phase in ("running", "ended", "failed"):
        send(coord, peer(0), contribution(0, 0, 1), signer)
    if phase == "ended":
        send(coord, peer(2), Message(Kind.BYE, rank=2, seq=1, session=SESSION), signer)
    if phase == "failed":
        send(coord, peer(1), contribution(1, 0, 2, Op.BARRIER), signer)
    if phase == "closed":
        for r in range(N):
            send(coord, peer(r), Message(Kind.CONTRIB, Op.TEARDOWN, r, 0, 0, SESSION), signer)
    assert coord.phase is PHASES[phase]
    return coord


def complete_exactly(coord, signer=None):
    """Finish the group's next allreduce (rank 0 may be in already with its
    value 1) and run an allgather: every member gets exactly the right values."""
    seq = min(coord.next_seq)
    out = []
    for r in range(N):
        if coord.next_seq[r] == seq:
            out += send(coord, peer(r), contribution(r, seq, (r + 1) * (seq + 1)), signer)
    assert sorted(p for p, _ in out) == [peer(r) for r in range(N)], out
    for _, m in out:
        assert (m.kind, m.seq, _serialize.loads(m.segments[0])) == (Kind.RESULT, seq, 6 * (seq + 1))
    out = []
    for r in range(N):
        out += send(coord, peer(r), contribution(r, seq + 1, r * 10, Op.ALLGATHER), signer)
    assert len(out) == N
    for _, m in out:
        assert [_serialize.loads(s) for s in m.segments] == [0, 10, 20]
    assert coord.phase is Phase.RUNNING and coord.next_seq == [seq + 2] * N


ACTING = {Kind.BYE, getattr(Kind, "ABORT", Kind.BYE)}  # a member's kinds that may end the group


def acts_on(frames, rank, coord, signer):
    """Would this message, on rank ``rank``'s connection, legitimately change
    the group: a contribution at its next seq, a BYE, or, with a secret, a
    message that proves it but is bound to another rank or session (it was
    moved or replayed: the group fails)?"""
    try:
        msg = decode(frames, MAX_FRAMES, signer)
    except WireError:
        return False
    if msg.rank != rank or (msg.session != SESSION and msg.kind is not Kind.JOIN):
        return signer is not None
    return msg.kind in ACTING or (msg.kind is Kind.CONTRIB and msg.seq == coord.next_seq[rank])


# -- pure layer: decode ---------------------------------------------------------------


@FAST
@given(data=st.data(), signed=st.booleans())
def test_decode_raises_only_wire_errors(data, signed):
    what, frames = garbage(Choices(data.draw), signings=SIGNINGS)
    note(f"{what}: {show(frames)}")
    try:
        msg = decode(frames, MAX_FRAMES, SIGNER if signed else None)
    except WireError:
        return
    if msg.kind in CONTROL_KINDS:
        try:
            msg.body()
        except WireError:
            pass


# -- pure layer: the coordinator ------------------------------------------------------


@FAST
@given(data=st.data(), phase=st.sampled_from(sorted(PHASES)), signed=st.booleans())
def test_coordinator_in_every_phase_survives_anything(data, phase, signed):
    signer = SIGNER if signed else None
    coord = coordinator(phase, signer)
    c = Choices(data.draw)
    for _ in range(c.below(6) + 1):
        who = c.pick([peer(r) for r in range(N)] + list(STRANGERS))
        rank = int(who[1:]) if who in (peer(0), peer(1), peer(2)) else c.below(N)
        what, frames = garbage(c, rank, coord.next_seq[rank], SIGNINGS)
        note(f"{who!r}: {what}: {show(frames)}")
        deliver(coord, who, frames, signer)
    if phase == "failed":
        assert coord.phase is Phase.FAILED  # sticky
    if coord.phase is Phase.FAILED and peer(0) in coord.members:
        out = send(coord, peer(0), Message(Kind.STATUS, rank=0, session=SESSION), signer)
        assert [m.kind for _, m in out] == [Kind.FAIL]


@FAST
@given(data=st.data(), signed=st.booleans())
def test_strangers_change_nothing_in_a_running_group(data, signed):
    signer = SIGNER if signed else None
    coord = coordinator("running", signer)
    c = Choices(data.draw)
    for i in range(c.below(8) + 1):
        who = c.pick(STRANGERS) + b"%d" % i  # a refused peer is answered once: a new one each time
        what, frames = garbage(c, c.below(N), c.below(3), SIGNINGS)  # even knowing the session
        note(f"{who!r}: {what}: {show(frames)}")
        out = deliver(coord, who, frames, signer)
        assert all(p == who for p, _ in out), out
        assert coord.phase is Phase.RUNNING
    complete_exactly(coord, signer)


@FAST
@given(data=st.data(), signed=st.booleans())
def test_strangers_change_nothing_while_joining(data, signed):
    """With a secret nothing a stranger sends counts; without one, anything
    but a JOIN."""
    signer = SIGNER if signed else None
    coord = coordinator("joining", signer)
    c = Choices(data.draw)
    for i in range(c.below(8) + 1):
        who = c.pick(STRANGERS) + b"%d" % i
        what, frames = garbage(c, c.below(N), 0, ("none", "wrong", "flipped", "zero tag"))
        if not signed and frames and len(frames[0]) > 3 and frames[0][3] == Kind.JOIN:
            continue  # without a secret anyone may join: not noise
        note(f"{who!r}: {what}: {show(frames)}")
        out = deliver(coord, who, frames, signer)
        assert all(p == who for p, _ in out), out
        assert coord.phase is Phase.JOINING and sorted(coord.by_rank) == [0]
    for r in (1, 2):
        join(coord, r, signer)
    complete_exactly(coord, signer)


@FAST
@given(data=st.data(), signed=st.booleans())
def test_malformed_messages_from_members_are_dropped(data, signed):
    """A member's messages that do not form a contribution at its next seq (or
    a BYE) change nothing. With a secret they are signed: a member's bug, not
    an attacker."""
    signer = SIGNER if signed else None
    coord = coordinator("running", signer)
    c = Choices(data.draw)
    for _ in range(c.below(8) + 1):
        rank = c.below(N)
        what, frames = garbage(c, rank, coord.next_seq[rank], ("right",) if signed else ("none",))
        if acts_on(frames, rank, coord, signer):
            continue
        note(f"rank {rank}: {what}: {show(frames)}")
        out = deliver(coord, peer(rank), frames, signer)
        assert all(p == peer(rank) for p, _ in out), out
        assert coord.phase is Phase.RUNNING
    complete_exactly(coord, signer)


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("this exception cannot be printed")


def raise_unprintable(a, b):
    raise Unprintable()


def raise_long(a, b):
    raise ValueError("x" * 100_000)


def exit_(a, b):
    raise SystemExit(3)


def unpicklable(a, b):
    return threading.Lock()


PAYLOADS = (
    [pickle.dumps(5)], [b""], [b"not a pickle"], [pickle.dumps(None)], [pickle.dumps("s")],
    [pickle.dumps(5), b"a spare buffer"],
    [pickle.dumps(pickle.PickleBuffer(b"x" * 10), protocol=5, buffer_callback=lambda b: False)],
)
FNS = (None, b"", b"garbage", *map(_serialize.dumps_function, (add, raise_unprintable, raise_long,
                                                                  exit_, unpicklable)))
ROOTS = (0, 1, 2, -1, -4, 3, 2**31 - 1, -2**31)


def shape(op, rank, root):
    """How many values a well-formed contribution of ``op`` carries."""
    if op in (Op.ALLREDUCE, Op.REDUCE, Op.ALLGATHER, Op.GATHER):
        return 1
    if op is Op.ALLTOALL or (op is Op.SCATTER and rank == root):
        return N
    return 1 if op is Op.BROADCAST and rank == root else 0


def wrong_contribution(c, rank, op, root, tidy):
    """If ``tidy``, the right number of values (so reductions and routing run), else any."""
    count = shape(op, rank, root) if tidy else c.below(N + 2)
    segments = [c.pick(PAYLOADS) for _ in range(count)]
    flags = c.pick((0, 0, 0, 0, 0, FLAG_LOCAL_ERROR))
    if flags and c.below(2):
        segments = [[c.pick(WHOLE_BODIES[:13] + (b'{"message":' + c.pick(WEIRD_JSON).encode() + b"}",))]]
    return Message(Kind.CONTRIB, op, rank, root, 0, SESSION, c.pick(("", "f.py:1", "\udcff")), flags,
                   c.pick(FNS), segments)


@FAST
@given(data=st.data(), signed=st.booleans())
def test_contributions_with_wrong_fields_end_in_results_errors_or_a_failure(data, signed):
    """Every member sends seq 0 with any operation, root, values, function and
    flags: each gets a RESULT or an ERROR (the group runs on), or all get FAIL."""
    signer = SIGNER if signed else None
    coord = coordinator("idle", signer)
    c = Choices(data.draw)
    tidy = c.below(2)
    op, root = c.pick(list(Op)), c.below(N) if tidy else c.pick(ROOTS)
    out = []
    for rank in range(N):
        if c.below(8) == 0:  # a mismatch
            op, root = c.pick(list(Op)), c.pick(ROOTS)
        msg = wrong_contribution(c, rank, op, root, tidy)
        note(f"rank {rank}: {label(msg.op)} root={msg.root} flags={msg.flags} fn={show([msg.fn or b''])} "
             f"segments={[show(s) for s in msg.segments]}")
        out += send(coord, peer(rank), msg, signer)
        if coord.phase is not Phase.RUNNING:
            break
    kinds = {p: m.kind for p, m in out}
    if coord.phase is Phase.FAILED:
        assert set(kinds.values()) == {Kind.FAIL} and len(kinds) == N, out
    elif coord.phase is Phase.RUNNING:
        assert sorted(kinds) == [peer(r) for r in range(N)] and len(out) == N, out
        assert len(set(kinds.values())) == 1 and kinds[peer(0)] in (Kind.RESULT, Kind.ERROR), out
        complete_exactly(coord, signer)
    else:
        assert coord.phase is Phase.CLOSED and op is Op.TEARDOWN


def test_every_reduce_function_and_value_ends_in_a_result_or_an_error_for_every_rank():
    """Deterministic: each reduce function (raising, exiting, unprintable,
    returning the unpicklable) with each kind of value, in an allreduce and a
    reduce; every rank must get a RESULT or ERROR it can read."""
    failures = Failures()
    for op in (Op.ALLREDUCE, Op.REDUCE):
        for fn in FNS:
            for payload in PAYLOADS:
                coord = coordinator("idle")
                what = f"{op.label}, fn {show([fn or b''])}, values {show(payload)}"
                with failures.catch("Coordinator.receive", what, payload):
                    out = []
                    for rank in range(N):
                        msg = Message(Kind.CONTRIB, op, rank, 0, 0, SESSION, "", 0,
                                      fn if rank == 0 else None, [payload])
                        out += send(coord, peer(rank), msg)
                    assert sorted(p for p, _ in out) == [peer(r) for r in range(N)], out
                    assert {m.kind for _, m in out} <= {Kind.RESULT, Kind.ERROR}, out
    failures.check()


def test_every_local_error_note_ends_in_an_error_for_every_rank():
    """Deterministic: a sender's own-error note (FLAG_LOCAL_ERROR) whose body,
    or its "message", is of every wrong type and size."""
    failures = Failures()
    notes = [*WHOLE_BODIES, *(b'{"message":' + raw.encode() + b"}" for raw in WEIRD_JSON)]
    for note_ in notes:
        coord = coordinator("idle")
        with failures.catch("Coordinator.receive", f"note {note_[:30]!r} ({len(note_)} bytes)", [note_]):
            out = []
            for rank in range(N):
                flags, segments = (FLAG_LOCAL_ERROR, [[note_]]) if rank == 1 else (0, [PAYLOADS[0]])
                msg = Message(Kind.CONTRIB, Op.ALLGATHER, rank, 0, 0, SESSION, "", flags, None, segments)
                out += send(coord, peer(rank), msg)
            assert [m.kind for _, m in out] == [Kind.ERROR] * N, out
    failures.check()


# -- pure layer: a replica's message handling ------------------------------------------


class Recorder:
    """Stands in for a call's future: records what the member resolves it with."""

    def __init__(self, seq, delivered):
        self.seq, self.delivered, self._done = seq, delivered, False

    def _set_result(self, msg):
        self._done = True
        self.delivered.append((self.seq, msg))

    def _set_exception(self, error):
        self._done = True
        self.delivered.append((self.seq, error))


@contextlib.contextmanager
def fuzz_replica(secret):
    """Rank 1's member in a running group, with calls 0 and 1 in flight: no
    socket at all, messages are handed to it as its driver would."""
    member = Member(1, N, "tcp://127.0.0.1:1", Signer(secret) if secret else None)
    member.session, member.next_seq = SESSION, 2
    member._nonces.add(NONCE)
    delivered = []
    for seq in (0, 1):
        member.calls[seq] = Call("allreduce", Recorder(seq, delivered), lambda msg: msg)
    yield member, delivered


def allowed_failures(frames, signer):
    """The errors this message may legitimately fail rank 1's group with."""
    try:
        msg = decode(frames, signer=signer)
    except AuthError:
        return (AuthenticationError,)
    except VersionError:
        return (ProtocolError,)
    except WireError:
        return ()
    if msg.kind in (Kind.FAIL, Kind.REJECT):
        return (CollectiveError, ValueError)  # ValueError: a join refused for a wrong value
    if signer is not None and (msg.rank != 1 or msg.session != SESSION):
        return (AuthenticationError,)  # it proves the secret but is not bound here: moved or replayed
    return ()


def check_dispatch(member, delivered, frames):
    """Hand ``frames`` to the member; it must not raise, fail only for a
    message that says so, deliver only its own group's results, and switch
    session only for a WELCOME to its own JOIN."""
    signer = member.signer
    session, count = member.session, len(delivered)
    member.receive(frames)
    if member.failure is not None:
        assert isinstance(member.failure, allowed_failures(frames, signer)), member.failure
        return
    for _, outcome in delivered[count:]:
        if isinstance(outcome, Message):
            assert outcome.kind is Kind.RESULT and outcome.session == session, outcome
        else:  # an ERROR of its own group, rebuilt as the error it names
            assert isinstance(outcome, Exception) and decode(frames, signer=signer).session == session
    if member.session != session:
        msg = decode(frames, signer=signer)
        assert msg.kind is Kind.WELCOME and msg.body()["nonce"] == NONCE


@FAST
@given(data=st.data(), signed=st.booleans())
def test_a_replica_survives_anything_from_its_coordinator(data, signed):
    c = Choices(data.draw)
    with fuzz_replica(SECRET if signed else None) as (replica, delivered):
        for _ in range(c.below(6) + 1):
            what, frames = garbage(c, c.pick((1, NO_RANK)), c.below(3), SIGNINGS)
            note(f"{what}: {show(frames)}")
            check_dispatch(replica, delivered, frames)
            if replica.failure is not None:
                break


# -- pure layer: a deterministic sweep ------------------------------------------------


def sweep(ranks=(1, NO_RANK)):
    """Every sample with every single edit: each header field's extreme values,
    layout and frame-count damage, and each body key of every wrong type."""
    for msg in [m for rank in ranks for m in samples(rank)]:
        base, name = frames_of(msg), f"{msg.kind.name} {label(msg.op)}"
        for field in FIELDS:
            for value in EXTREMES[field]:
                yield f"{name}; {field}={value!r}", set_field(base, field, value)
        for index in range(nseg_of(base)):
            for count in U32:
                yield f"{name}; layout[{index}]={count}", set_count(base, index, count)
        yield f"{name}; layout cut", cut_layout(base)
        yield f"{name}; extra count", extra_count(base, 1)
        for site in CALLSITES:
            yield f"{name}; call site of {len(site)} bytes", [base[0] + site, *base[1:]]
        for cut in HEAD_CUTS:
            yield f"{name}; header cut to {cut}", [base[0][:cut], *base[1:]]
        yield f"{name}; header only", base[:1]
        yield f"{name}; last frame dropped", base[:-1]
        yield f"{name}; empty frame appended", [*base, b""]
        yield f"{name}; too many frames", base + [b""] * MAX_FRAMES
        yield from sweep_body(base, name)


def sweep_body(base, name):
    keys = body_keys(base)
    for key in keys:
        yield f"{name}; body without {key!r}", body_with(base, key, None)
        for raw in WEIRD_JSON:
            yield f"{name}; body {key!r}={raw[:20]} ({len(raw)} chars)", body_with(base, key, raw)
    if body_position(base) is not None:
        for text in WHOLE_BODIES:
            yield f"{name}; body {text[:20]!r} ({len(text)} bytes)", with_body(base, text)


class Failures:
    """Exceptions a sweep met, by the place they were raised: the shortest
    input that raised it there, its traceback, and every target it hit."""

    def __init__(self):
        self.seen = {}

    @contextlib.contextmanager
    def catch(self, target, what, frames):
        try:
            yield
        except Exception as exc:
            frames_ = traceback.extract_tb(exc.__traceback__)
            ours = [f for f in frames_ if f"{os.sep}zcollective{os.sep}" in f.filename]
            where = (ours or frames_)[-1]  # the library's line that let it escape
            key = (type(exc).__name__, f"{os.path.basename(where.filename)}:{where.lineno}")
            example = f"{what}: {show(frames)}"
            tb = "".join(traceback.format_exception(exc))[-3000:]
            old = self.seen.get(key)
            if old is None or len(example) < len(old[0]):
                old = self.seen[key] = (example, tb, old[2] if old else set())
            old[2].add(target)

    def check(self):
        assert not self.seen, "\n\n".join(
            f"{name} raised at {where} by {len(targets)} targets: {', '.join(sorted(targets)[:4])}"
            f"\n  input: {example}\n{tb}"
            for (name, where), (example, tb, targets) in sorted(self.seen.items()))


def test_sweep_decode_and_a_replica_take_every_edit():
    failures = Failures()
    for secret in (None, SECRET):
        signer = Signer(secret) if secret else None
        with fuzz_replica(secret) as (replica, delivered):
            for what, frames in sweep():
                frames = sign(frames, "right") if secret else frames
                with failures.catch("decode", what, frames), contextlib.suppress(WireError):
                    msg = decode(frames, MAX_FRAMES, signer)
                    if msg.kind in CONTROL_KINDS:
                        msg.body()
                with failures.catch(f"replica (secret: {bool(secret)})", what, frames):
                    check_dispatch(replica, delivered, frames)
                replica.failure, replica.session = None, SESSION
                for seq in (0, 1):
                    replica.calls.setdefault(seq, Call("allreduce", Recorder(seq, delivered), lambda m: m))
    failures.check()


def test_sweep_coordinator_in_every_phase_takes_every_edit():
    failures = Failures()
    messages = list(sweep(ranks=(1,)))
    for phase in ("joining", "running", "failed"):  # the others differ little: hypothesis has them
        for signer in (None, SIGNER):
            coord = coordinator(phase, signer)
            for i, (what, frames) in enumerate(messages):
                frames = sign(frames, "right") if signer else frames
                if i % 1000 == 999:  # a refused peer is answered once, and only so many are
                    coord = coordinator(phase, signer)
                for who in (peer(1), b"S%d" % i):
                    target = f"Coordinator.receive ({phase}, secret: {bool(signer)}, from {who!r})"
                    with failures.catch(target, what, frames):
                        deliver(coord, who, frames, signer)
                    if coord.phase is not PHASES[phase]:
                        coord = coordinator(phase, signer)
    failures.check()


# -- real processes -------------------------------------------------------------------

LOOP_LIMIT_S = 20.0  # a backstop: the test stops the loop long before this
JOIN_TIMEOUT_S = 15.0  # joining takes a second; a coordinator that crashed must not cost a minute
WAIT_S = 40.0  # for the replicas to finish once told to stop


def exact_loop(stop, ready, wrong=None):
    """Collective calls with known answers until rank 0 sees the file ``stop``;
    rank 0 creates ``ready`` once the group runs. Returns (steps, wrong answers)."""
    rank, n = zc.get_rank(), zc.get_world_size()
    wrong = [] if wrong is None else wrong
    end = time.monotonic() + LOOP_LIMIT_S
    for step in range(1 << 30):
        got = zc.allreduce(step * (rank + 1))
        if got != step * n * (n + 1) // 2:
            wrong.append(("allreduce", step, got))
        if step == 0 and rank == 0:
            open(ready, "w").close()
        if step % 8 == 0:
            got = zc.allgather((rank, step))
            if got != [(r, step) for r in range(n)]:
                wrong.append(("allgather", step, got))
            if zc.broadcast(os.path.exists(stop) or time.monotonic() > end if rank == 0 else None):
                return step, wrong
    return -1, wrong


def guarded_loop(stop, ready):
    """exact_loop, but a CollectiveError ends it: (error type or "ok", message, wrong answers)."""
    wrong = []
    try:
        exact_loop(stop, ready, wrong)
    except zc.CollectiveError as exc:
        return type(exc).__name__, str(exc), wrong
    return "ok", "", wrong


def wait_for_file(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def no_crash_reported(outs):
    for out in outs:
        assert "the coordinator crashed" not in out.output + str(out.error) + str(out.value), \
            report(outs, f"rank {out.rank} reports a crashed coordinator")


def check_exact(outs, headline):
    no_crash_reported(outs)
    assert all(o.ok for o in outs), report(outs, headline)
    assert all(o.value[0] > 0 and o.value[1] == [] for o in outs), report(outs, "wrong results")


FLOOD_BATCH = 200  # messages per stranger connection at most


def hostile(c, count, signings):
    """What a flood sends: a JOIN with each body key of each wrong type (or
    missing), then ``count`` random and mutated messages."""
    for key in sorted(join_body(0, "")):
        for raw in (*WEIRD_JSON, None):
            yield sign(body_with(frames_of(join_msg(c.below(N))), key, raw), c.pick(signings))
    for _ in range(count):
        _, frames = garbage(c, c.below(N), c.below(4), signings)
        if frames:  # not a message at all
            yield frames


def flood(port, count, seed, running, signer=None, signings=("none", "wrong", "zero tag")):
    """Send hostile messages to the master port from strangers; return once the
    coordinator has taken all of them in, or ``running()`` is False. A refused
    peer gets one answer, to its first answered message: an oracle coordinator
    says which that is, so it ends its stranger's connection (or a JOIN does),
    and its answer proves that all sent before it on that connection was read."""
    c = Choices(rng=random.Random(seed))
    phase = "joining" if signer else "running"
    messages = hostile(c, count, signings)
    ctx = zmq.Context()
    log = logging.getLogger("zcollective")
    level = log.level
    log.setLevel(logging.CRITICAL)  # each oracle would warn anew: only rank 0's log counts
    try:
        waiting, more = [], True
        while more:
            s = ctx.socket(zmq.DEALER)
            ident = b"R" + c.below(N).to_bytes(4, "big") + os.urandom(8) if c.below(2) else os.urandom(6)
            s.setsockopt(zmq.ROUTING_ID, ident)
            s.setsockopt(zmq.SNDHWM, 0)
            if signer is not None:  # past the handshake: what is tested here is the message tags
                _zap.secure_client(s, SECRET, _zap.MASTER_DOMAIN)
            s.connect(f"tcp://127.0.0.1:{port}")
            oracle = coordinator(phase, signer)
            last = frames_of(join_msg(1))  # answered, unless one before it is
            for _ in range(FLOOD_BATCH):
                frames = next(messages, None)
                if frames is None:
                    more = False
                    break
                s.send_multipart(frames)
                if oracle.receive(ident, frames, "oracle"):
                    last = None
                    break
            if last is not None:
                s.send_multipart(last)
            waiting.append(s)
        answered(waiting, running)
    finally:
        log.setLevel(level)
        ctx.destroy(linger=0)


def answered(sockets, running, timeout=20.0):
    """Wait until each stranger's answer is in (each socket is readable)."""
    deadline = time.monotonic() + timeout
    for s in sockets:
        while not s.poll(100):
            assert running(), "a replica ended while the coordinator had strangers to answer"
            assert time.monotonic() < deadline, f"the coordinator did not answer a stranger in {timeout:g} s"


def run_flood(tmp_path, env, *floods):
    """Three replicas in exact_loop while ``floods`` run, in order: "ready"
    waits for the group to run, anything else is called with the master port
    and a ``running()`` check. Every result must be exact."""
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    problem = None
    with Replicas(exact_loop, 3, str(stop), str(ready), env=env, init_timeout=JOIN_TIMEOUT_S) as reps:
        def running():
            return all(p.poll() is None for p in reps.procs)
        try:
            for step in floods:
                if step == "ready":
                    assert wait_for_file(ready, 30), "the group never ran"
                else:
                    step(reps.port, running)
        except AssertionError as exc:
            problem = str(exc)
        finally:
            stop.touch()
        outs = reps.wait(5 if problem else WAIT_S)  # after a problem, what they print is enough
    no_crash_reported(outs)
    assert problem is None, report(outs, problem)
    check_exact(outs, "a replica failed during the flood")


@pytest.mark.timeout(90)
def test_a_flood_from_strangers_changes_no_result(tmp_path):
    run_flood(tmp_path, None, "ready", lambda port, running: flood(port, 2000, 1, running))


@pytest.mark.timeout(90)
def test_a_flood_from_strangers_without_the_secret_changes_no_result(tmp_path):
    """Before, during and after the join."""
    signings = ("none", "wrong", "flipped", "zero tag")
    run_flood(tmp_path, {"ZCOLLECTIVE_SECRET": SECRET.decode()},
              lambda port, running: flood(port, 600, 2, running, SIGNER, signings), "ready",
              lambda port, running: flood(port, 600, 3, running, SIGNER, signings))


# -- real processes: what a replica receives ------------------------------------------------

ZMTP_GREETING = zmtp.GREETING_BYTES  # passed through before frames start
INJECT_IDLE_S = 0.02  # an idle line gets an injected message this often: the budget is spent in seconds


class InjectingProxy(Relay):
    """Forwards TCP between one replica and the coordinator. The replica's bytes
    pass unchanged; the coordinator's are parsed into ZMTP frames, each message
    is shown to ``injector.observe``, and between two messages (and whenever the
    line is idle) ``injector.make`` may add one of its own, up to ``budget``."""

    def __init__(self, upstream_port, injector, budget):
        self.injector, self.budget = injector, budget
        self.injected = 0
        self.done = threading.Event()
        super().__init__(upstream_port, poll_s=INJECT_IDLE_S)

    def pump(self, upward):
        if upward:
            return super().pump(upward)
        buf, message, greeting, handshaken = bytearray(), [], ZMTP_GREETING, False

        def inject(data):
            nonlocal message, greeting, handshaken
            out = bytearray()
            if data and greeting:  # the greeting goes through as it comes: both sides wait on it
                out += data[:greeting]
                data = data[greeting:]
                greeting -= len(out)
            buf.extend(data or b"")
            while (frame := zmtp.next_frame(buf)) is not None:
                flags, body, size = frame
                out += buf[:size]
                del buf[:size]
                if flags & zmtp.COMMAND:  # READY, PING, PONG: not part of a message
                    handshaken = True
                    continue
                message.append(body)
                if not flags & zmtp.MORE:
                    self.injector.observe(message)
                    message = []
                    out += self._add()
            if data is None and handshaken and not message:
                out += self._add()
            return bytes(out)
        return inject

    def _add(self):
        if self.injected >= self.budget:
            self.done.set()
            return b""
        frames = self.injector.make()
        if frames is None:
            return b""
        self.injected += 1
        return zmtp.message(frames)


class Injector:
    """Makes the proxy's messages: mutated copies of what the coordinator sent,
    mutated samples and random frames. With a secret, any altered message. Without
    one, only what a replica must drop: a copy that could be the coordinator's
    (its session, the replica's nonce, a FAIL, another protocol version) may
    legitimately change the outcome."""

    def __init__(self, seed, secret=None):
        self.c = Choices(rng=random.Random(seed))
        self.signer = Signer(secret) if secret else None
        self.real, self.session, self.nonce = [], None, None
        self.made = []

    def observe(self, frames):
        self.real = [*self.real[-15:], list(frames)]
        with contextlib.suppress(WireError):
            msg = decode(frames, signer=self.signer)
            if msg.kind is Kind.WELCOME:
                self.session, self.nonce = msg.session, msg.body().get("nonce")

    def make(self):
        if self.session is None:  # not before the replica joined
            return None
        signings = ("none", "wrong", "flipped", "zero tag") if self.signer else ("none", "wrong")
        for _ in range(20):
            what, frames = garbage(self.c, self.c.pick((1, NO_RANK)), self.c.below(4), signings,
                                   bases=self.real)
            if not frames or frames in self.real or not (self.signer or self.must_drop(frames)):
                continue
            self.made.append(what)
            return frames
        return None

    def must_drop(self, frames):
        try:
            msg = decode(frames)
        except VersionError:
            return False
        except WireError:
            return True
        if msg.kind in (Kind.RESULT, Kind.ERROR):
            return msg.session != self.session
        if msg.kind is Kind.WELCOME:
            try:
                return msg.body().get("nonce") != self.nonce
            except WireError:
                return True
        return msg.kind not in (Kind.FAIL, Kind.REJECT)


def run_behind_proxy(tmp_path, injector, budget, env=None):
    """Three replicas, rank 1 behind an InjectingProxy; stop once the proxy has
    injected ``budget`` messages (or rank 1 failed)."""
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    master = free_port()
    with InjectingProxy(master, injector, budget) as proxy, \
            Replicas(guarded_loop, 3, str(stop), str(ready), port=master, env=env,
                     init_timeout=JOIN_TIMEOUT_S,
                     rank_env={1: {"ZCOLLECTIVE_MASTER_PORT": str(proxy.port)}}) as reps:
        try:
            deadline = time.monotonic() + 20
            while not proxy.done.wait(0.05) and reps.procs[1].poll() is None:
                if time.monotonic() > deadline:
                    break
        finally:
            stop.touch()
        outs = reps.wait(WAIT_S)
    no_crash_reported(outs)
    assert all(o.ok for o in outs), report(outs, f"a replica raised an unexpected exception; "
                                                 f"injected: {injector.made[-5:]}")
    assert all(o.value[2] == [] for o in outs), report(outs, "wrong results")
    return outs, proxy


@pytest.mark.timeout(90)
def test_a_replica_drops_what_is_injected_into_its_stream(tmp_path):
    injector = Injector(seed=4)
    outs, proxy = run_behind_proxy(tmp_path, injector, budget=1000)
    assert [o.value[0] for o in outs] == ["ok"] * 3, report(outs, f"injected: {injector.made[-5:]}")
    assert proxy.injected == 1000, report(outs, f"the proxy injected only {proxy.injected}")


@pytest.mark.timeout(90)
def test_with_a_secret_anything_injected_ends_in_authentication_error(tmp_path):
    injector = Injector(seed=5, secret=SECRET)
    outs, proxy = run_behind_proxy(tmp_path, injector, budget=50,
                                   env={"ZCOLLECTIVE_SECRET": SECRET.decode()})
    assert proxy.injected >= 1, report(outs, "the proxy injected nothing")
    name, message, _ = outs[1].value
    assert name == "AuthenticationError", report(outs, f"injected first: {injector.made[:1]}")
    assert "a message from the coordinator" in message and "failed authentication" in message
    for out in (outs[0], outs[2]):  # a CollectiveError at most: they lose rank 1, or hear why
        assert out.value[0] in ("ok", "ReplicaLostError", "AuthenticationError"), report(outs, "")


# -- driver: rank 0's in-process name cannot be claimed over TCP ----------------------------


def test_a_peer_using_rank_0s_in_process_name_is_dropped():
    """Rank 0's own member has a routing id no DEALER is given; libzmq lets a
    peer announce it anyway, so the server drops it: a JOIN under that name
    for rank 0, sent while the group joins, takes nobody's place."""
    from zcollective._protocol._coordinator import RANK0_PEER

    port = free_port()
    done = {}

    def rank(r):
        try:
            with zc.Group("127.0.0.1", port, r, 2, timeout=20) as group:
                done[r] = group.allreduce(r + 1)
        except Exception as exc:  # reported by the assert below
            done[r] = exc

    ctx = zmq.Context()
    impostor = ctx.socket(zmq.DEALER)
    impostor.setsockopt(zmq.ROUTING_ID, RANK0_PEER)
    impostor.setsockopt(zmq.LINGER, 0)
    try:
        zero = threading.Thread(target=rank, args=(0,))
        zero.start()
        impostor.connect(f"tcp://127.0.0.1:{port}")
        join = control(Kind.JOIN, {"rank": 0, "num_replicas": 2, "python": PYTHON_VERSION, "ops": SPOKEN,
                                   "pid": 1, "host": "impostor", "nonce": "ab" * 16}, rank=0)
        for _ in range(3):
            impostor.send_multipart(encode(join))
            time.sleep(0.1)
        one = threading.Thread(target=rank, args=(1,))
        one.start()
        for thread in (zero, one):
            thread.join(30)
        assert done == {0: 3, 1: 3}, done
    finally:
        impostor.close(linger=0)
        ctx.term()


PEERS_BY_COMMAND = r"""
import os, sys, zmq
from zcollective._protocol._coordinator import PYTHON_VERSION
from zcollective._protocol._ops import SPOKEN
from zcollective._format._wire import PROTOCOL_VERSION, Kind, control, encode
ctx, socks = zmq.Context(), {}
for line in sys.stdin:  # one command a line, done in order; the test waits for its effect
    what, name, *rest = line.split()
    if what == "connect":  # connect NAME [ROUTING_ID]
        socks[name] = ctx.socket(zmq.DEALER)
        if rest:
            socks[name].setsockopt(zmq.ROUTING_ID, rest[0].encode())
        socks[name].connect(f"tcp://127.0.0.1:{sys.argv[1]}")
    elif what == "hello":
        socks[name].send(b"hello")
    elif what == "join":  # join NAME RANK
        socks[name].send_multipart(encode(control(Kind.JOIN, {
            "rank": int(rest[0]), "num_replicas": 3, "python": PYTHON_VERSION, "ops": SPOKEN,
            "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "host": "h"}, rank=int(rest[0]))))
    elif what == "close":
        socks.pop(name).close(linger=1000)
ctx.destroy(linger=0)
"""


class SteppedServer:
    """Rank 0's coordinator server for a group of 3, bound, its background
    thread never started: the test steps it. Peers are sockets of another
    process (``PEERS_BY_COMMAND``), as a real rank 0's are."""

    def __init__(self):
        import subprocess
        import sys

        from zcollective._io._server import Server
        from zcollective.config import resolve

        self.ctx = zmq.Context()
        self.server = Server(self.ctx, resolve("127.0.0.1", free_port(), 0, 3, env={}))
        self.router, self.monitor = self.server._bind()
        self.server._watch(self.router, self.monitor)
        self.peers = subprocess.Popen([sys.executable, "-c", PEERS_BY_COMMAND,
                                       str(self.server.config.master_port)], stdin=subprocess.PIPE,
                                      text=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.peers.stdin.close()
        self.peers.wait(10)
        self.server._close_pipes()
        self.ctx.destroy(linger=0)  # the server's sockets

    def say(self, *lines):
        self.peers.stdin.write("".join(line + "\n" for line in lines))
        self.peers.stdin.flush()

    @staticmethod
    def wait_readable(sock):
        assert sock.poll(10_000), "nothing arrived within 10 s"

    def settle(self):
        """Step the server until its probes have found out whose connection
        closed (the schedule ends), with a bound."""
        from zcollective._protocol._coordinator import PROBE_SPAN_S

        server = self.server
        server._step([])
        deadline = time.monotonic() + PROBE_SPAN_S + 5
        while server._probes.due is not None:
            assert time.monotonic() < deadline, "the probes did not end"
            server._step(server.waiter.wait(server.SERVED, None, server.sleep_s(0.1)))


def test_a_stranger_whose_connection_closed_cannot_take_a_replica_off():
    """A stranger connects and leaves; a replica's JOIN is waiting when rank
    0's thread handles the close (on fd numbers, the replica's connection
    could get the stranger's and be taken off with it, as once in a suite run
    of test_hostile_peers_change_nothing_and_run_nothing): the probes find
    the replica's connection open."""
    with SteppedServer() as s:
        s.say("connect stranger", "hello stranger")
        s.wait_readable(s.router)
        s.router.recv_multipart()
        s.say("close stranger")
        s.wait_readable(s.monitor)  # the stranger's close is reported (not yet handled)
        s.say("connect replica R-rank-1", "join replica 1")
        s.wait_readable(s.router)  # the replica's JOIN is waiting
        s.settle()
        assert 1 in s.server.coordinator.by_rank, "a stranger's close took the replica off"
        assert s.server.coordinator.missing_joins() == [0, 2]


def test_a_replica_joining_again_stays_in_the_group():
    """A replica's connection closes while the group joins; it connects again
    (same routing id) and its second JOIN is waiting when the close is
    handled: it stays."""
    with SteppedServer() as s:
        s.say("connect first R-rank-1", "join first 1")
        s.wait_readable(s.router)
        s.settle()
        assert 1 in s.server.coordinator.by_rank
        s.say("close first")
        s.wait_readable(s.monitor)
        s.say("connect again R-rank-1", "join again 1")
        s.wait_readable(s.router)
        s.settle()
        assert 1 in s.server.coordinator.by_rank, "the close of its first connection dropped it"


def test_a_replica_that_joined_then_closed_before_rank_0_looked_frees_its_slot():
    """A JOIN and the close of the connection it came on are both waiting
    (the program died right after joining): rank 1's slot opens again rather
    than being held by a dead connection."""
    with SteppedServer() as s:
        s.say("connect replica R-rank-1", "join replica 1", "close replica")
        s.wait_readable(s.monitor)  # closed, its JOIN queued before the close
        s.settle()
        assert 1 not in s.server.coordinator.by_rank, "a dead connection holds rank 1's slot"
        assert s.server.coordinator.missing_joins() == [0, 1, 2]


def test_a_flood_of_strangers_costs_a_bounded_number_of_probe_rounds():
    """Each stranger's close would start a schedule of probes: closes during
    one are coalesced, at most a round per PROBE_FLOOD_GAP_S."""
    from zcollective._protocol import _coordinator

    with SteppedServer() as s:
        s.say("connect replica R-rank-1", "join replica 1")
        s.wait_readable(s.router)
        s.settle()
        rounds = []
        probe = s.server._probe
        s.server._probe = lambda: (rounds.append(time.monotonic()), probe())
        start = time.monotonic()
        for i in range(40):
            s.say(f"connect stranger{i}", f"close stranger{i}")
        deadline = time.monotonic() + 10
        while not rounds:  # the monitor also reports handshakes cut short: step until a close came
            assert time.monotonic() < deadline, "no close was reported within 10 s"
            s.server._step(s.server.waiter.wait(s.server.SERVED, None, 0.1))
        s.settle()
        took = time.monotonic() - start
        assert 1 in s.server.coordinator.by_rank
        most = 12 + took / _coordinator.PROBE_FLOOD_GAP_S  # one schedule, plus a round per flood gap
        assert 1 <= len(rounds) <= most, (len(rounds), took)
