"""The wire format, without sockets: round trips and rejection of bad frames."""

import struct

import pytest

from zcollective import _serialize
from zcollective._wire import (
    FLAG_FN,
    HEADER,
    MAGIC,
    MAX_CALLSITE_BYTES,
    PROTOCOL_VERSION,
    Kind,
    Message,
    Op,
    VersionError,
    WireError,
    control,
    decode,
    encode,
)


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
    ([_header(op=77)], "Op"),
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


def test_unserializable_value_names_its_type():
    import threading

    from zcollective import SerializationError

    with pytest.raises(SerializationError, match="threading.Lock|_thread.lock") as info:
        _serialize.dumps(threading.Lock())
    assert isinstance(info.value, TypeError)


def test_signed_messages_verify_and_any_change_is_refused():
    from zcollective._wire import FLAG_AUTH, AuthError, Signer

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
