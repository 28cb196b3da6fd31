"""The one-host links' packets (zcollective/_format/_packets.py), without sockets: a message cut into
packets comes back whole and in its frames; a first packet proves its rank only under the group's key
and session; a FIRST packet beyond the bound a frame is refused before anything is allocated."""

import pytest

from zcollective._format import _packets as p

KEY, SESSION, MAX_FRAME = b"k" * 32, 11, 1 << 24


def _reassembled(frames):
    """What a receiver holds once every packet of ``frames`` came: the data after the FIRST header."""
    lengths = p.lengths_of(frames, MAX_FRAME)
    one = p.whole(frames, lengths)
    packets = [one] if one is not None else list(p.packets(frames, lengths))
    raw = [b"".join(bytes(piece) for piece in packet) for packet in packets]
    if raw[0][0] == p.ONE:
        return [raw[0][1:]], raw
    count, size = p.first(raw[0], len(raw[0]), MAX_FRAME)
    data = raw[0][p.HEAD.size:] + b"".join(r[1:] for r in raw[1:])
    assert len(data) == size and all(r[0] == p.MORE for r in raw[1:])
    return [bytes(f) for f in p.frames_of(memoryview(data), count, MAX_FRAME)], raw


@pytest.mark.parametrize("sizes", [[5], [0], [p.FRAGMENT_BYTES], [p.FRAGMENT_BYTES + 1], [3, 0, 7],
                                   [1 << 20, 17, 3 << 18]], ids=str)
def test_a_message_cut_into_packets_comes_back_whole(sizes):
    frames = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    got, raw = _reassembled(frames)
    assert got == frames
    assert all(len(r) <= p.PACKET_MAX for r in raw)


def test_a_first_packet_proves_its_rank_only_under_the_key_and_session():
    packet = p.auth(KEY, SESSION, 2, 0)
    assert p.proven(packet, KEY, SESSION, 0, 4) == 2
    for key, session, me, size in ((b"x" * 32, SESSION, 0, 4), (KEY, SESSION + 1, 0, 4), (KEY, SESSION, 1, 4),
                                   (KEY, SESSION, 0, 2), (KEY, SESSION, 2, 4)):
        with pytest.raises(p.PacketError):
            p.proven(packet, key, session, me, size)
    with pytest.raises(p.PacketError, match="not an authentication"):
        p.proven(b"O" + packet[1:], KEY, SESSION, 0, 4)


def test_a_first_packet_beyond_the_bound_is_refused():
    head = p.HEAD.pack(p.FIRST, 1, MAX_FRAME + 9)
    with pytest.raises(p.PacketError, match="above the bound"):
        p.first(head, len(head), MAX_FRAME)
    head = p.HEAD.pack(p.FIRST, p.MAX_FRAMES + 1, 8 * (p.MAX_FRAMES + 1))
    with pytest.raises(p.PacketError, match="above the bound"):
        p.first(head, len(head), MAX_FRAME)
    with pytest.raises(p.PacketError, match="out of place"):
        p.first(b"M" + head[1:], len(head), MAX_FRAME)


def test_a_message_no_peer_would_take_is_refused_before_anything_goes():
    with pytest.raises(ValueError):
        p.lengths_of([b"x" * (MAX_FRAME + 1)], MAX_FRAME)
    with pytest.raises(ValueError):
        p.lengths_of([], MAX_FRAME)
    with pytest.raises(ValueError, match="contiguous"):
        p.lengths_of([memoryview(bytes(8))[::2]], MAX_FRAME)
