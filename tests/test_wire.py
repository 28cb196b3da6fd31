"""The wire format, without sockets: round trips and rejection of bad frames."""

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zcollective as zc
from zcollective._format import _bodies, _mac, _serialize, _wire
from zcollective._format._wire import (
    FAST_TAG_BYTES,
    FLAG_FN,
    FLAG_PARTS,
    HEADER,
    MAGIC,
    MAX_CALLSITE_BYTES,
    PART,
    PROTOCOL_VERSION,
    TAG_BYTES,
    WIRE_PART_BYTES,
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
from zcollective._limits import MAX_JOB_CHARS
from zcollective._protocol._ops import Op


def test_contribution_round_trip_keeps_every_field():
    segs = [[b"pickle", b"buf1", b"buf2"], [b"second"]]
    msg = Message(Kind.CONTRIB, Op.SCATTER, rank=3, root=2, seq=2**40, session=0xDEADBEEF,
                  callsite="train.py:88", fn=b"fn-bytes", segments=segs)
    back = decode(encode(msg))
    assert (back.kind, back.op, back.rank, back.root, back.seq, back.session) == (
        Kind.CONTRIB, Op.SCATTER, 3, 2, 2**40, 0xDEADBEEF)
    assert back.callsite == "train.py:88"
    assert back.flags & FLAG_FN and bytes(back.fn) == b"fn-bytes"
    assert [[bytes(f) for f in s] for s in back.segments] == segs


def test_control_message_carries_json():
    msg = control(Kind.JOIN, {"rank": 1, "num_replicas": 4}, rank=1)
    back = decode(encode(msg))
    assert back.kind is Kind.JOIN and back.body() == {"rank": 1, "num_replicas": 4}


def test_small_message_is_two_frames_header_and_pickle():
    frames = encode(Message(Kind.CONTRIB, Op.ALLREDUCE, callsite="a.py:1", segments=[[b"pickle"]]))
    assert len(frames) == 2 and decode(frames).callsite == "a.py:1"


def test_message_without_segments_is_one_frame():
    frames = encode(Message(Kind.RESULT, Op.BARRIER, seq=7))
    assert len(frames) == 1
    assert decode(frames).segments == []


def test_segments_pass_buffers_through_uncopied():
    big = bytearray(1 << 20)
    frames = encode(Message(Kind.RESULT, segments=[[b"p", memoryview(big)]]))
    assert any(f.obj is big for f in frames if isinstance(f, memoryview))


def test_long_callsite_is_truncated_not_rejected():
    back = decode(encode(Message(Kind.CONTRIB, callsite="x" * 5000)))
    assert len(back.callsite) == MAX_CALLSITE_BYTES


def _header(**overrides):
    fields = dict(magic=MAGIC, version=PROTOCOL_VERSION, kind=Kind.CONTRIB, op=Op.ALLREDUCE,
                  flags=0, rank=0, root=0, seq=0, session=1, nseg=0)
    fields.update(overrides)
    return HEADER.pack(*fields.values())


@pytest.mark.parametrize("frames, reason", [
    ([], "empty"),
    ([b"garbage"], "magic"),
    ([b"\x00" * 100], "magic"),
    ([b"ZC"], "magic"),
    ([_header()[:-3]], "header of"),
    ([_header() + b"x" * (MAX_CALLSITE_BYTES + 1)], "header of"),
    ([_header(nseg=2) + b"\x01\x00"], "header of 36 bytes for 2 segments"),
    ([_header(nseg=2**31)], "for 2147483648 segments"),
    ([_header(kind=99)], "Kind"),
    ([_header(flags=FLAG_FN)], "no frame follows"),
    ([_header(nseg=1) + struct.pack("<I", 3), b"a"], "does not match"),
    ([_header(nseg=1) + struct.pack("<I", 0)], "does not match"),
    ([_header(), b"stray"], "no segments"),
    ([_header(kind=Kind.JOIN)], "exactly one JSON"),
])
def test_malformed_frames_are_rejected(frames, reason):
    with pytest.raises(WireError, match=reason):
        decode(frames)


def test_frame_count_is_bounded():
    frames = encode(Message(Kind.CONTRIB, segments=[[b"x"] * 50]))
    with pytest.raises(WireError, match="exceed"):
        decode(frames, max_frames=10)


def test_other_protocol_version_is_reported_with_its_number():
    with pytest.raises(VersionError) as info:
        decode([_header(version=PROTOCOL_VERSION + 1)])
    assert info.value.version == PROTOCOL_VERSION + 1


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"\xff\xfe", b"{" * 70000])
def test_bad_control_bodies_are_rejected(body):
    msg = decode([_header(kind=Kind.JOIN, nseg=1) + struct.pack("<I", 1), body])
    with pytest.raises(WireError):
        msg.body()


def test_serialize_round_trips_lambdas_and_large_buffers():
    np = pytest.importorskip("numpy")
    arr = np.arange(100_000, dtype=np.float64)
    segment = _serialize.dumps({"a": arr, "f": lambda x: x + 1, "small": np.ones(3)})
    assert len(segment) == 2  # the pickle and one out-of-band buffer; the small array is in-band
    value = _serialize.loads(segment)
    assert value["f"](1) == 2 and (value["a"] == arr).all()


def test_small_containers_of_builtins_take_the_plain_pickler_and_anything_else_cloudpickle(monkeypatch):
    class Mine(dict):
        pass

    clouded = []  # what went to cloudpickle (its own dumps, or the tensor-aware pickler once torch
    real = _serialize._pickle  # was imported, by an earlier test in this process)
    monkeypatch.setattr(_serialize, "_pickle", lambda value, keep: clouded.append(value) or real(value, keep))
    plain = [{"step": 1, "lr": 0.1, "name": "run-7"}, [1, (2.0, None), {"a": b"x"}], ((1, 2), {(3, 4): True})]
    other = [{"f": len}, [Mine()], {1: {2: [3, {lambda: 0}]}}, list(range(_serialize.PLAIN_MAX_ITEMS + 1))]
    for value in plain + other:
        assert _serialize.loads(_serialize.dumps(value)) == value or value is other[2]
    assert clouded == other  # (a long list too: looking through it would cost more than it saves)


def test_unserializable_value_names_its_type():
    import threading

    from zcollective import SerializationError

    with pytest.raises(SerializationError, match="threading.Lock|_thread.lock") as info:
        _serialize.dumps(threading.Lock())
    assert isinstance(info.value, TypeError)


def test_signed_messages_verify_and_any_change_is_refused():
    from zcollective._format._wire import FLAG_AUTH, AuthError, Signer

    signer = Signer(b"s" * 32)
    msg = Message(Kind.CONTRIB, Op.ALLREDUCE, rank=1, seq=9, session=7, segments=[[b"ab", b"cd"]])
    frames = encode(msg, signer)
    back = decode(frames, signer=signer)
    assert back.flags & FLAG_AUTH and [bytes(f) for f in back.segments[0]] == [b"ab", b"cd"]
    tampered = [bytes(f) for f in frames]
    tampered[-2] = b"ce"
    shifted = frames[:-3] + [b"a", b"bcd"] + frames[-1:]  # same bytes, other frame boundaries
    for bad in (tampered, shifted, frames[:-1], encode(msg, Signer(b"t" * 32))):
        with pytest.raises(AuthError):
            decode(bad, signer=signer)
    with pytest.raises(AuthError, match="no authentication tag") as info:
        decode(encode(msg), signer=signer)
    assert info.value.missing
    # a receiver without the secret can still see that the sender has one
    assert decode(frames).flags & FLAG_AUTH


# -- frames above WIRE_PART_BYTES travel as parts --------------------------------------


def _parts_message(size=WIRE_PART_BYTES * 3 + 5, fn=None):
    big = bytearray(range(256)) * (size // 256) + bytearray(size % 256)
    return big, Message(Kind.CONTRIB, Op.ALLREDUCE, rank=1, seq=4, session=9, fn=fn,
                        segments=[[b"pickle", memoryview(big)], [b"second"]])


def test_large_frame_travels_as_uncopied_parts_and_is_joined_writable():
    big, msg = _parts_message()
    frames = encode(msg)
    assert [memoryview(f).nbytes for f in frames[2:6]] == [WIRE_PART_BYTES] * 3 + [5]
    assert all(f.obj is big for f in frames[2:6])  # slices of the caller's buffer
    back = decode([bytes(f) for f in frames])
    assert back.flags & FLAG_PARTS
    assert [bytes(f) for f in back.segments[0]] == [b"pickle", bytes(big)]
    assert not memoryview(back.segments[0][1]).readonly  # as a received frame is
    assert bytes(back.segments[1][0]) == b"second"


def test_frames_up_to_the_part_size_are_not_split():
    frames = encode(Message(Kind.RESULT, segments=[[b"p", bytes(WIRE_PART_BYTES)]]))
    assert len(frames) == 3 and not HEADER.unpack_from(frames[0])[4] & FLAG_PARTS


def test_reduce_function_and_multidimensional_arrays_are_split_too():
    np = pytest.importorskip("numpy")
    arr = np.arange(300_000, dtype=np.float64).reshape(1000, 300)
    fn = b"f" * (WIRE_PART_BYTES + 1)
    msg = Message(Kind.CONTRIB, Op.ALLREDUCE, fn=fn, segments=[_serialize.dumps(arr)])
    back = decode(encode(msg))
    assert bytes(back.fn) == fn
    assert (_serialize.loads(back.segments[0]) == arr).all()


def test_joined_size_is_bounded_by_max_frame_bytes():
    _, msg = _parts_message()
    with pytest.raises(WireError, match="exceeds max_frame_bytes"):
        decode(encode(msg), max_frame_bytes=WIRE_PART_BYTES * 3)
    assert decode(encode(msg), max_frame_bytes=WIRE_PART_BYTES * 3 + 5).segments


def test_shared_payload_is_split_once_for_every_recipient():
    signer = Signer(b"s" * 32)
    big, msg = _parts_message()
    cache = {}
    for rank in (1, 2):
        msg.rank = rank
        back = decode(encode(msg, signer, cache), signer=signer)
        assert back.rank == rank and bytes(back.segments[0][1]) == bytes(big)
    assert len(cache) == 1


def _table(frames):
    head = frames[0]
    nseg = HEADER.unpack_from(head)[-1]
    at = HEADER.size + 4 * nseg
    return head, at


def _with_table(frames, rows, nsplit=None):
    head, at = _table(frames)
    old = int.from_bytes(head[at:at + 4], "little")
    table = (len(rows) if nsplit is None else nsplit).to_bytes(4, "little")
    table += b"".join(PART.pack(*row) for row in rows)
    return [head[:at] + table + head[at + 4 + PART.size * old:], *frames[1:]]


@pytest.mark.parametrize("rows, nsplit, reason", [
    ([(1, 4, WIRE_PART_BYTES * 3 + 5)], 0, "parts table"),
    ([(1, 4, WIRE_PART_BYTES * 3 + 5)], 2, "parts table"),
    ([(1, 4, WIRE_PART_BYTES * 3 + 5)], 2**31, "parts table"),
    ([(1, 4, WIRE_PART_BYTES * 3 + 6)], None, "the header says"),
    ([(1, 1, WIRE_PART_BYTES * 3 + 5)], None, "does not match"),
    ([(9, 4, WIRE_PART_BYTES * 3 + 5)], None, "does not match"),
    ([(1, 6, WIRE_PART_BYTES * 3 + 5)], None, "does not match"),
    ([(1, 2, WIRE_PART_BYTES * 2), (1, 2, WIRE_PART_BYTES + 5)], None, "does not match"),
    ([(1, 3, WIRE_PART_BYTES * 3)], None, "layout"),
])
def test_parts_tables_that_do_not_match_the_frames_are_rejected(rows, nsplit, reason):
    _, msg = _parts_message()
    frames = [bytes(f) for f in encode(msg)]
    with pytest.raises(WireError, match=reason):
        decode(_with_table(frames, rows, nsplit))


def test_empty_part_is_rejected():
    _, msg = _parts_message()
    frames = [bytes(f) for f in encode(msg)]
    frames = [*frames[:6], b"", *frames[6:]]
    frames = _with_table(frames, [(1, 5, WIRE_PART_BYTES * 3 + 5)])
    with pytest.raises(WireError, match="empty"):
        decode(frames)


def test_signed_parts_keep_their_boundaries_and_table_authenticated():
    signer = Signer(b"s" * 32)
    _, msg = _parts_message()
    frames = [bytes(f) for f in encode(msg, signer)]
    assert decode(frames, signer=signer).segments
    # the same bytes cut at another place between two parts
    moved = [*frames[:2], frames[2][:-1], frames[2][-1:] + frames[3], *frames[4:]]
    for bad in (moved, _with_table(frames, [(1, 4, WIRE_PART_BYTES * 3 + 5)], 1) + [b""]):
        with pytest.raises(AuthError):
            decode(bad, signer=signer)


# -- the fast tag: Poly1305 for large frames, when the group has cryptography -------------


def _fast_signer(secret=b"s" * 32):
    signer = Signer(secret, fast=True)
    if not signer.fast:
        pytest.skip("the cryptography package (fast-auth extra) is not installed")
    return signer


def test_fast_tag_only_for_payloads_with_large_frames_and_both_tags_verify():
    signer, plain = _fast_signer(), Signer(b"s" * 32)
    big, msg = _parts_message()
    small = Message(Kind.CONTRIB, Op.ALLREDUCE, rank=1, seq=4, session=9, segments=[[b"x"]])
    assert len(encode(small, signer)[-1]) == TAG_BYTES
    frames = encode(msg, signer)
    assert len(frames[-1]) == FAST_TAG_BYTES
    for receiver in (signer, plain):  # a receiver verifies either, whatever its own `fast`
        assert bytes(decode(frames, signer=receiver).segments[0][1]) == bytes(big)
        assert decode(encode(small, signer), signer=receiver).segments == [[b"x"]]


def test_fast_tag_refuses_any_change():
    signer = _fast_signer()
    _, msg = _parts_message()
    frames = [bytes(f) for f in encode(msg, signer)]

    def changed(index, at):
        out = list(frames)
        frame = bytearray(out[index])
        frame[at] ^= 0x01
        out[index] = bytes(frame)
        return out

    moved = [*frames[:2], frames[2][:-1], frames[2][-1:] + frames[3], *frames[4:]]
    bads = [changed(3, 1000), changed(5, 0), changed(1, 0), changed(0, 20), changed(-1, 0),
            changed(-1, FAST_TAG_BYTES - 1), moved, encode(msg, Signer(b"t" * 32, fast=True))]
    for bad in bads:
        with pytest.raises(AuthError, match="does not match"):
            decode(bad, signer=signer)


def test_shared_payload_gets_one_fast_tag_per_recipient():
    signer = _fast_signer()
    _, msg = _parts_message()
    cache = {}
    tags = []
    for rank in (1, 2):
        msg.rank = rank
        frames = encode(msg, signer, cache)
        assert decode(frames, signer=signer).rank == rank
        tags.append(frames[-1])
    assert tags[0][:16] == tags[1][:16] and tags[0] != tags[1]  # one nonce, headers of their own


def test_without_cryptography_fast_is_off_and_fast_tags_are_refused_plainly(monkeypatch):
    fast = _fast_signer()
    _, msg = _parts_message()
    frames = encode(msg, fast)
    monkeypatch.setattr(_mac, "_Poly1305", None)
    signer = Signer(b"s" * 32, fast=True)
    assert not signer.fast and len(encode(msg, signer)[-1]) == TAG_BYTES
    with pytest.raises(AuthError, match="cryptography"):
        decode(frames, signer=signer)


# -- the fast way of decode: the same answer as the whole way -------------------------------------

def _often(common, *others):
    """``common`` seven times in eight, else one of ``others``."""
    return st.sampled_from([common] * 7 * len(others) + list(others))


_FIELDS = st.fixed_dictionaries({  # mostly a small reply's shape, each field sometimes not
    "magic": _often(MAGIC, b"ZD", b"\0\0"),
    "version": _often(PROTOCOL_VERSION, PROTOCOL_VERSION - 1, 255),
    "kind": st.one_of(st.sampled_from([Kind.RESULT, Kind.ERROR]), st.integers(0, 15)),
    "op": st.one_of(st.just(Op.ALLREDUCE), st.integers(0, 12)),
    "flags": st.one_of(st.sampled_from([0, 0x02, 0x04, 0x08, 0x0C]), st.integers(0, 255)),
    "rank": st.sampled_from([0, 1, 7, -1, -2**31, 2**31 - 1]),
    "root": st.sampled_from([0, 3, -1]),
    "seq": st.sampled_from([0, 1, 2**40, 2**64 - 1]),
    "session": st.sampled_from([0, 1, 0xDEADBEEF, 2**64 - 1]),
    "counts": _often(None, [], [0], [1, 1], [5], [2, 0, 1]),  # None: one segment of every frame
    "tail": _often(b"", b"a.py:1", b"\x01\x00\x00\x00", b"\xe9" * 512, b"x" * 513),  # call sites
    "cut": _often(0, 1, 4, 5),  # bytes cut off the header's end
    "bodies": st.lists(st.binary(max_size=4), max_size=4),
})


def _frames(f):
    counts = [len(f["bodies"])] if f["counts"] is None else f["counts"]
    nseg = len(counts)
    head = HEADER.pack(f["magic"], f["version"], f["kind"], f["op"], f["flags"], f["rank"], f["root"],
                       f["seq"], f["session"], nseg) + struct.pack(f"<{nseg}I", *counts) + f["tail"]
    return [head[:len(head) - f["cut"]], *f["bodies"]]


def _outcome(decoder, frames):
    try:
        return decoder(frames)
    except WireError as exc:
        return (type(exc), str(exc))


@settings(max_examples=400, deadline=None, database=None)  # 3 ms each here
@given(fields=_FIELDS, signed=st.booleans())
def test_fast_decode_accepts_only_what_the_whole_way_accepts_and_agrees(fields, signed):
    """The common shape (one segment, maybe a call site, no fn or parts) is decoded
    by a shortcut: whatever it accepts, every rule in turn accepts too, into
    an equal message; whatever those rules refuse, it leaves to them."""
    frames = _frames(fields)
    fast = _wire._decode_simple(frames, signed)
    whole = _outcome(lambda f: _wire._decode_whole(f, _wire.DEFAULT_MAX_FRAMES, signed, None), frames)
    if fast is not None:
        assert fast == whole
    if signed:
        return
    assert _outcome(decode, frames) == whole  # decode answers as the whole way would


@settings(max_examples=400, deadline=None, database=None)  # 3 ms each here
@given(seq=st.integers(0, 2**64 - 1), at=st.integers(0, 37), byte=st.integers(0, 255),
       bodies=st.integers(-1, 1), signed=st.booleans())
def test_fast_decode_agrees_on_a_small_reply_with_one_byte_changed(seq, at, byte, bodies, signed):
    """The near misses: a reply as sent, one header byte changed and a body
    frame added or dropped."""
    msg = Message(Kind.RESULT, Op.ALLREDUCE, rank=1, seq=seq, session=5,
                  flags=_wire.FLAG_AUTH if signed else 0, segments=[[b"pickle"]])
    frames = encode(msg)
    head = bytearray(frames[0])
    head[at] = byte
    frames = [bytes(head), *frames[1:]] + [b"more"] * bodies
    fast = _wire._decode_simple(frames, signed)
    whole = _outcome(lambda f: _wire._decode_whole(f, _wire.DEFAULT_MAX_FRAMES, signed, None), frames)
    if fast is not None:
        assert fast == whole


def test_every_small_result_takes_the_fast_way_signed_or_not():
    signer = Signer(b"k" * 32)
    for kind, op, segments, site in [(Kind.RESULT, Op.ALLREDUCE, [[b"pickle"]], ""),
                                     (Kind.RESULT, Op.BROADCAST, [[b"pickle", b"buffer"]], ""),
                                     (Kind.ERROR, Op.ALLREDUCE, [[b"{}"]], ""),
                                     (Kind.CONTRIB, Op.ALLREDUCE, [[b"p"]], "a.py:1"),
                                     (Kind.CONTRIB, Op.BROADCAST, [[b"p"]], "\u00e9.py:1" * 100)]:
        msg = Message(kind, op, rank=2, root=0, seq=9, session=77, segments=segments, callsite=site)
        if len(site.encode()) > _wire.MAX_CALLSITE_BYTES:  # cut by encode, as the whole way reads it
            msg.callsite = site.encode()[:_wire.MAX_CALLSITE_BYTES].decode("utf-8", "replace")
        plain = encode(msg)
        assert _wire._decode_simple(plain, False) == decode(plain) == msg
        signed = signer.verify(encode(msg, signer))
        assert _wire._decode_simple(signed, True) is not None
        assert decode(encode(msg, signer), signer=signer).segments == segments
    # not the common shape: the whole way
    for msg in [Message(Kind.CONTRIB, Op.ALLREDUCE, fn=b"fn", segments=[[b"p"]]),
                Message(Kind.RESULT, Op.BARRIER),
                Message(Kind.RESULT, Op.ALLGATHER, segments=[[b"a"], [b"b"]])]:
        assert _wire._decode_simple(encode(msg), False) is None


# -- bodies: one schema per kind (zcollective._format._bodies) ---------------------------------


def _through_the_wire(msg):
    return decode(encode(msg))


def test_a_join_reads_back_as_it_was_built_and_its_bytes_keep_their_order():
    msg = _bodies.join(3, 4, "3.11", "ab" * 16, "c" * 32, "tcp://10.0.0.3:4000", 1 << 20, "on")
    assert msg.kind is Kind.JOIN and msg.rank == 3
    assert bytes(msg.segments[0][0]).startswith(b'{"rank":3,"num_replicas":4,"protocol":')
    info = _bodies.parse_join(_through_the_wire(msg))
    assert info == {"rank": 3, "num_replicas": 4, "python": "3.11", "ops": "", "pid": info["pid"],
                    "nonce": "ab" * 16,
                    "host": info["host"], "data": "tcp://10.0.0.3:4000", "data_min": 1 << 20,
                    "data_mode": "on", "macs": _mac.available_backends(), "lineage": None,
                    "newcomer": False, "job": None, "mail": None, "mail_window": 0, "shm": None,
                    "cores": info["cores"], "local": None}
    assert info["cores"] >= 1
    assert _bodies.challenge_of(msg) == "c" * 32
    name = "zcollective-" + "0f" * 16
    mailing = _bodies.join(1, 2, "3.11", "00" * 16, None, None, 0, "auto", mail="tcp://10.0.0.3:4001",
                           local=name)
    assert _bodies.parse_join(_through_the_wire(mailing))["mail"] == "tcp://10.0.0.3:4001"
    assert _bodies.parse_join(_through_the_wire(mailing))["local"] == name
    for wrong in ("zcollective-0G", "other-00", 7, "zcollective-" + "0" * 60):  # a link's name, or none
        body = {"rank": 1, "num_replicas": 2, "python": "3.11", "mail": "tcp://10.0.0.3:4001", "local": wrong}
        assert _bodies.parse_join(control(Kind.JOIN, body))["local"] is None
    not_tcp = control(Kind.JOIN, {"rank": 1, "num_replicas": 2, "python": "3.11", "mail": "ipc:///x"})
    assert _bodies.parse_join(not_tcp)["mail"] is None
    bare = _bodies.join(1, 2, "3.11", "00" * 16, None, None, 0, "auto")
    assert b'"data' not in bytes(bare.segments[0][0]) and b'"challenge' not in bytes(bare.segments[0][0])
    assert _bodies.parse_join(bare)["data"] is None and _bodies.challenge_of(bare) is None


@pytest.mark.parametrize("body", [
    {"num_replicas": 2, "python": "3.11"},
    {"rank": "1", "num_replicas": 2, "python": "3.11"},
    {"rank": True, "num_replicas": 2, "python": "3.11"},
    {"rank": 1, "num_replicas": 2, "python": 3.11},
    {"rank": 1, "num_replicas": 2, "python": "3.11", "pid": None},
])
def test_a_join_without_its_rank_count_or_python_is_malformed(body):
    with pytest.raises(WireError):
        _bodies.parse_join(control(Kind.JOIN, body))


def test_a_joins_optional_fields_read_as_absent_when_malformed():
    join = _bodies.parse_join(control(Kind.JOIN, {
        "rank": 1, "num_replicas": 2, "python": "3.11", "host": "\udcff" * 300, "nonce": 7,
        "challenge": 5, "macs": ["nope", "hmac-sha256"], "data": "udp://x:1", "data_min": 5,
        "data_mode": "maybe"}))
    assert (join["data"], join["data_min"], join["data_mode"]) == (None, 0, "auto")
    assert join["macs"] == ("hmac-sha256",)
    assert (join["nonce"], len(join["host"])) == ("7", 256 * 6)  # "\\udcff": escaped


def test_a_joins_job_reads_back_whole_and_is_left_out_when_it_has_none():
    name = "Slurm job 4242 \u00e9" + "x" * (MAX_JOB_CHARS - 16)  # the longest config allows
    named = _bodies.join(1, 2, "3.11", "ab" * 16, None, None, 0, "auto", newcomer=True, job=name)
    assert _bodies.parse_join(_through_the_wire(named))["job"] == name
    bare = _bodies.join(1, 2, "3.11", "ab" * 16, None, None, 0, "auto")
    assert b'"job"' not in bytes(bare.segments[0][0]) and _bodies.parse_join(bare)["job"] is None


@pytest.mark.parametrize("job", [7, ["a"], "x" * (MAX_JOB_CHARS + 1)])
def test_a_join_whose_job_is_not_a_name_config_allows_is_malformed(job):
    """A job is compared whole: one cut to fit, or of another type, would be taken for another's."""
    with pytest.raises(WireError, match="job must be a string"):
        _bodies.parse_join(control(Kind.JOIN, {"rank": 1, "num_replicas": 2, "python": "3.11", "job": job}))


def test_a_welcome_reads_back_and_hands_out_the_data_plane_only_whole():
    key = "00" * _bodies.DATA_KEY_BYTES
    ports = ["tcp://a:1", "tcp://b:2", "tcp://c:3"]
    msg = _bodies.welcome(3, "ab" * 16, 1 << 20, "hmac-sha256", ports, 1 << 16, key, rank=1, session=5)
    assert _bodies.parse_welcome(_through_the_wire(msg), 3) == {
        "nonce": "ab" * 16, "parts": 1 << 20, "mac": "hmac-sha256", "data": ports, "data_min": 1 << 16,
        "data_key": key, "renumber": None, "addresses": None, "admitted": None, "mail": None,
        "mail_key": None, "mail_windows": None, "shm": None, "tree": None, "local": None}
    assert _bodies.parse_welcome(msg, 2)["data"] is None  # not one port per rank
    treed = _bodies.welcome(3, "ab" * 16, None, None, None, 0, key, tree=4, rank=1, session=5)
    assert _bodies.parse_welcome(_through_the_wire(treed), 3)["tree"] == 4
    for odd in (1, 65, "4", 4.0, True):  # (a fan-out no release sends: no tree)
        odd_msg = control(Kind.WELCOME, {**treed.body(), "tree": odd}, rank=1, session=5)
        assert _bodies.parse_welcome(odd_msg, 3)["tree"] is None
    boxes = ["tcp://a:7", "tcp://b:8", "tcp://c:9"]
    mailing = _bodies.welcome(3, "ab" * 16, None, None, None, 0, key, mail=boxes, rank=1, session=5)
    read = _bodies.parse_welcome(_through_the_wire(mailing), 3)
    assert (read["mail"], read["mail_key"], read["data"], read["local"]) == (boxes, key, None, None)
    assert _bodies.parse_welcome(mailing, 2)["mail"] is None  # not one mailbox per rank
    names = ["zcollective-" + "0a" * 16, None, "zcollective-" + "0b" * 16]
    linked = _bodies.welcome(3, "ab" * 16, None, None, None, 0, key, mail=boxes, local=names, rank=1,
                             session=5)
    assert _bodies.parse_welcome(_through_the_wire(linked), 3)["local"] == names
    odd_names = control(Kind.WELCOME, {**linked.body(), "local": [names[0], "x", 3]}, rank=1, session=5)
    assert _bodies.parse_welcome(odd_names, 3)["local"] == [names[0], None, None]  # (each read alone)
    assert _bodies.parse_welcome(control(Kind.WELCOME, {**linked.body(), "local": names[:2]}, rank=1,
                                         session=5), 3)["local"] is None  # (not one a rank)
    for broken in ({"data_key": "xy"}, {"data_min": "1"}, {"data": "tcp://a:1"}, {"data_key": " " * 64}):
        body = {"num_replicas": 1, "nonce": "n", "parts": 10, "mac": 1, "data": ["tcp://a:1"],
                "data_min": 1, "data_key": key, **broken}
        got = _bodies.parse_welcome(control(Kind.WELCOME, body), 1)
        assert (got["data"], got["data_min"], got["data_key"]) == (None, 0, None)
        assert (got["parts"], got["mac"]) == (None, None)


def test_shared_memory_reads_back_from_a_join_and_a_welcome_only_whole():
    join = _bodies.join(1, 2, "3.11", "ab" * 16, None, None, 0, "auto", shm=(65536, 1 << 30))
    assert _bodies.parse_join(_through_the_wire(join))["shm"] == (65536, 1 << 30)
    plan = _bodies.shared_plan(65536, [0, 0, None, 1, 1], [100, 200])
    msg = _bodies.welcome(5, "n", None, None, None, 0, None, shm=plan, rank=1, session=5)
    assert _bodies.parse_welcome(_through_the_wire(msg), 5)["shm"] == plan
    assert _bodies.parse_welcome(msg, 4)["shm"] is None  # not one host per rank
    for broken in ({"min": -1}, {"hosts": [0, 0, None, 2, 1]}, {"room": [100, "200"]}, {"hosts": "0"}):
        assert _bodies.parse_shared({**plan, **broken}, 5) is None
    for offer in ({"min": 1}, {"min": "1", "room": 2}, [1, 2], {"min": -1, "room": 2}):
        bad = control(Kind.JOIN, {"rank": 0, "num_replicas": 1, "python": "3", "pid": 1, "shm": offer})
        assert _bodies.parse_join(bad)["shm"] is None


def test_a_formed_groups_join_and_welcome_carry_lineage_renumbering_and_addresses():
    join = _bodies.join(2, 4, "3.11", "ab" * 16, None, None, 0, "auto", lineage="5f" * 8)
    assert _bodies.parse_join(_through_the_wire(join))["lineage"] == "5f" * 8
    msg = _bodies.welcome(3, "n", None, None, None, 0, None, ["h0", "h1", "h2"],
                          {"rank": 1, "old": [0, 2, 3]}, rank=2, session=5)
    got = _bodies.parse_welcome(_through_the_wire(msg), 4)  # (the member's old size)
    assert got["renumber"] == {"rank": 1, "old": [0, 2, 3]} and got["addresses"] == ["h0", "h1", "h2"]
    for bad in ({"rank": 3, "old": [0, 2, 3]}, {"rank": 0, "old": [0, 2]}, {"rank": 0}, {"old": [1, "2", 3]}):
        with pytest.raises(WireError):
            _bodies.parse_welcome(control(Kind.WELCOME, {"num_replicas": 3, "renumber": bad}), 4)


def test_an_abort_from_the_data_plane_names_its_lost_rank_only_if_it_is_one():
    msg = _bodies.abort(zc.ReplicaLostError("gone"), True, 2, rank=1, session=9)
    assert bytes(msg.segments[0][0]) == (b'{"error":"ReplicaLostError","message":"gone","lost":2,'
                                         b'"plane":"data"}')
    assert _bodies.parse_abort(msg, 3) == ("ReplicaLostError", "gone", [2], True, False)
    assert _bodies.parse_abort(msg, 2)[2] == []
    plain = _bodies.abort(zc.AuthenticationError("x" * 5000), rank=1, session=9)
    assert bytes(plain.segments[0][0]).count(b'"') == 8  # error and message only
    error, said, lost, data_plane, abandoned = _bodies.parse_abort(plain, 3)
    assert (error, len(said), lost, data_plane, abandoned) == ("AuthenticationError", 2000, [], False, False)


def test_error_bodies_are_cut_to_their_bound_and_read_back_as_their_exceptions():
    body = _bodies.error_body("ReplicaLostError", "x" * 100_000, lost=[1], ended=True)
    assert len(json.dumps(body)) < _wire.MAX_JSON_BYTES and body["lost"] == [1]
    error, ended = _bodies.parse_error(control(Kind.FAIL, body))
    assert isinstance(error, zc.ReplicaLostError) and ended
    try:
        raise KeyError("k" * 100_000)
    except KeyError as exc:
        remote = _bodies.remote_error_body("seq 1 allreduce: raised", exc)
    assert len(json.dumps(remote)) < _wire.MAX_JSON_BYTES
    assert remote["message"].startswith("seq 1 allreduce: raised: KeyError: 'kkk")
    error, ended = _bodies.parse_error(control(Kind.ERROR, remote))
    assert isinstance(error, zc.RemoteError) and error.remote_type == "KeyError" and not ended
    error, _ = _bodies.parse_error(control(Kind.REJECT, {"error": "NoSuchError", "message": 5}))
    assert type(error) is zc.CollectiveError and str(error) == "5"


def test_a_status_reply_must_list_ranks():
    msg = _bodies.status(4, "pending", {"arrived": [0], "missing": [1, 2], "op": "allreduce"}, rank=2,
                         session=9)
    assert (msg.seq, msg.rank) == (4, 2)
    assert bytes(msg.segments[0][0]) == (b'{"seq":4,"state":"pending","arrived":[0],"missing":[1,2],'
                                         b'"op":"allreduce"}')
    assert _bodies.parse_status(msg) == {"seq": 4, "state": "pending", "arrived": [0], "missing": [1, 2],
                                         "op": "allreduce"}
    with pytest.raises(WireError):
        _bodies.parse_status(control(Kind.STATUS_REPLY, {"missing": ["1"]}))


def _plan(frame):
    return Message(Kind.RESULT, Op.BROADCAST, segments=[[frame]])


def test_plans_read_back_as_they_were_built():
    assert _bodies.parse_sizes(_plan(_bodies.plan(sizes=[3, 0, 5])), 8) == [3, 0, 5]
    told = [[1, 2], None, [3]]
    assert _bodies.parse_gather_plan(_plan(_bodies.plan(sizes=told)), 3) == told
    frame = _bodies.plan(dtype="<f4", shape=[1024, 1024], fn="add")
    assert frame == b'{"dtype":"<f4","shape":[1024,1024],"fn":"add"}'
    assert _bodies.parse_array_plan(_plan(frame)) == ("<f4", (1024, 1024), "add")


@pytest.mark.parametrize("frame", [
    b'{"sizes":[1,-1]}', b'{"sizes":[1.5]}', b'{"sizes":"12"}', b'{"size":[1]}', b"[]", b"not json",
    b'{"sizes":[20,20]}', b"[" * 100_000, b'{"sizes":[' + b",".join([b"1"] * 257) + b"]}",
])
def test_malformed_sizes_plans_are_wire_errors(frame):
    with pytest.raises(WireError):
        _bodies.parse_sizes(_plan(frame), 8)


@pytest.mark.parametrize("frame", [
    b'{"sizes":[[1],null]}', b'{"sizes":[[1],5,null]}', b'{"sizes":[[-1],null,null]}', b"{}",
])
def test_malformed_allgather_plans_are_wire_errors(frame):
    with pytest.raises(WireError):
        _bodies.parse_gather_plan(_plan(frame), 3)


@pytest.mark.parametrize("frame", [
    b'{"dtype":"<f4","shape":"ab","fn":"add"}', b'{"dtype":1,"shape":[1],"fn":"add"}',
    b'{"dtype":"<f4","shape":[1]}', b'{"dtype":"' + b"x" * 20000 + b'","shape":[1],"fn":"add"}',
])
def test_malformed_array_plans_are_wire_errors(frame):
    with pytest.raises(WireError):
        _bodies.parse_array_plan(_plan(frame))


def test_the_bounds_keep_the_relations_written_beside_them():
    """zcollective/_limits.py: what travels in one piece arrives well within the smallest
    liveness bound on a slow link; waits are shorter than what they wait for."""
    from zcollective import _limits as lim

    smallest_timeout_s = (lim.heartbeats(lim.MIN_LIVENESS_S)[1]) / 1000  # a PING unanswered this long
    part_s = lim.WIRE_PART_BYTES / lim.SLOW_LINK_BYTES_S  # one part on the slowest link
    assert part_s < smallest_timeout_s / 2
    assert lim.CHUNK_BYTES * 8 / 10e6 < lim.MIN_LIVENESS_S / 2  # one data link at 10 Mbit/s
    assert lim.MIN_CHUNK_BYTES <= lim.CHUNK_BYTES <= lim.WIRE_PART_BYTES * 2
    assert lim.POLL_SLICE_S < lim.MIN_LIVENESS_S and lim.HANDSHAKE_MIN_MS == lim.MIN_LIVENESS_S * 1000
    assert lim.STOP_TIMEOUT_S > lim.CLOSE_LINGER_MS / 1000
    for liveness in (lim.MIN_LIVENESS_S, lim.DEFAULT_LIVENESS_S, lim.MAX_LIVENESS_S):
        ivl, timeout, ttl = lim.heartbeats(liveness)
        assert ivl >= lim.HEARTBEAT_MIN_IVL_MS and ivl + timeout == ttl == int(liveness * 1000)


def test_a_small_point_to_point_value_travels_in_the_header_frame_signed_or_not():
    """FLAG_INLINE: one frame (each frame costs a libzmq call at both ends); the shortcut and
    the whole way agree; anything else of that flag is refused or left to the whole way."""
    signer = Signer(b"k" * 32)
    value = _serialize.dumps({"step": 1})[0]
    msg = Message(Kind.SEND, 0, rank=1, root=7, seq=3, session=77, segments=[[value]])
    plain = encode(msg)
    assert len(plain) == 1 and plain[0][5] & _wire.FLAG_INLINE
    for frames, signed in ((plain, False), (signer.verify(encode(msg, signer)), True)):
        fast = _wire._decode_simple(frames, signed)
        whole = _wire._decode_whole(frames, _wire.DEFAULT_MAX_FRAMES, signed, None)
        assert fast == whole and bytes(fast.segments[0][0]) == value and fast.root == 7
    assert len(encode(msg, signer)) == 2 and decode(encode(msg, signer), signer=signer) == whole
    big = Message(Kind.SEND, 0, 1, 7, 3, 77, segments=[[bytes(_wire.INLINE_MAX_BYTES + 1)]])
    assert len(encode(big)) == 2  # a larger value keeps its own frame, as every other kind does
    assert len(encode(Message(Kind.RESULT, Op.ALLREDUCE, segments=[[value]]))) == 2
    for frames in ([plain[0], b"more"], [plain[0][:HEADER.size + 4]]):  # a frame too many; none inline
        assert _wire._decode_simple(frames, False) is None
        with pytest.raises(WireError, match="inline frame"):
            decode(frames)
    for other in (Kind.FAIL, Kind.RESULT, Kind.CONTRIB, Kind.CREDIT):  # SEND alone goes inline
        other_kind = bytearray(plain[0])
        other_kind[3] = other
        assert _wire._decode_simple([bytes(other_kind)], False) is None
        with pytest.raises(WireError, match="may carry an inline frame"):
            decode([bytes(other_kind)])
    oversized = plain[0] + bytes(_wire.INLINE_MAX_BYTES)  # more than INLINE_MAX_BYTES after the layout
    assert _wire._decode_simple([oversized], False) is None
    with pytest.raises(WireError, match="at most"):
        decode([oversized])
