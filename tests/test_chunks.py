"""Which chunk a data port takes (zcollective._protocol._chunks), without sockets:
each reason a chunk is taken or refused, from frames made by hand."""

import pytest

from zcollective._format._mac import HMAC_SHA256, ChunkMac
from zcollective._protocol import _chunks
from zcollective._protocol._chunks import HEADER, MAGIC, VERSION, ChunkRules
from zcollective._protocol._ring import AG, RS

SESSION = 0x5E55
SECRET = b"k" * 32


def rules(rank=1, size=3, mac=None):
    """Rank ``rank`` of ``size``'s port, welcomed to SESSION."""
    r = ChunkRules(rank, size)
    r.start(SESSION, mac, rank, size)
    return r


def chunk(kind=AG, seq=4, origin=0, step=0, index=0, session=SESSION, payload=b"p" * 16, mac=None,
          magic=MAGIC, version=VERSION):
    header = HEADER.pack(magic, version, kind, session, seq, origin, step, index)
    tag = mac.tag(header, payload) if mac is not None else b""
    return [header, tag, payload]


def test_a_chunk_of_this_call_from_the_previous_rank_is_taken_with_its_fields():
    verdict = rules().check(chunk(RS, seq=4, origin=0, step=1, index=2), seq=4, next_seq=5)
    assert (verdict.reason, verdict.kind, verdict.seq, verdict.origin, verdict.step, verdict.index) == (
        _chunks.NOW, RS, 4, 0, 1, 2)
    # an allgather chunk is forwarded unchanged: it keeps its origin's header
    assert rules().check(chunk(AG, origin=2), 4, 5).reason == _chunks.NOW


def test_a_chunk_this_rank_makes_is_one_its_next_rank_takes():
    maker, taker = rules(rank=0), rules(rank=1)
    header = maker.header(RS, 4, 0, 3)
    assert taker.check([header, b"", b"x"], 4, 5).reason == _chunks.NOW
    assert HEADER.unpack(header)[5] == 0  # its origin is the maker


@pytest.mark.parametrize("frames", [
    chunk()[:2],  # two frames
    [*chunk(), b"more"],  # four
    [chunk()[0][:-1], b"", b"p"],  # a short header
    [chunk()[0] + b"\0", b"", b"p"],  # a long one
], ids=["two-frames", "four-frames", "short-header", "long-header"])
def test_a_message_not_shaped_as_a_chunk_is_dropped(frames):
    verdict = rules().check(frames, 4, 5)
    assert verdict.reason == _chunks.SHAPE and "not a chunk" in verdict.why
    assert _chunks.SHAPE in _chunks.LOGGED


@pytest.mark.parametrize("frames", [
    chunk(session=SESSION + 1),  # another group's (a later one on the same port)
    chunk(magic=b"XX"),
    chunk(version=VERSION + 1),
    chunk(kind=99),  # not a chunk's kind
], ids=["session", "magic", "version", "kind"])
def test_a_chunk_not_of_this_group_is_dropped(frames):
    verdict = rules().check(frames, 4, 5)
    assert verdict.reason == _chunks.SESSION and "not of this group" in verdict.why


def test_before_the_welcome_no_chunk_is_of_this_group():
    assert ChunkRules(1, 3).check(chunk(), 4, 5).reason == _chunks.SESSION


def test_with_a_secret_a_chunk_whose_tag_fails_fails_the_group_naming_the_previous_rank():
    mac = ChunkMac(SECRET, HMAC_SHA256)
    port = rules(mac=mac)
    assert port.check(chunk(mac=mac), 4, 5).reason == _chunks.NOW
    altered = chunk(mac=mac)
    altered[2] = b"q" * 16  # the payload changed on the way
    verdict = port.check(altered, 4, 5)
    assert verdict.reason == _chunks.ALTERED
    assert _chunks.ALTERED not in _chunks.LOGGED  # not a drop: the group fails
    error = port.altered(verdict, "allreduce")
    assert error.lost_rank == 0 and "from rank 0 to rank 1 failed authentication" in str(error)
    assert port.check(chunk(mac=ChunkMac(b"other" * 8, HMAC_SHA256)), 4, 5).reason == _chunks.ALTERED
    assert port.check(chunk(), 4, 5).reason == _chunks.ALTERED  # no tag at all
    # the header is what the tag binds: the same payload and tag under another step fail
    moved = chunk(mac=mac)
    moved[0] = HEADER.pack(MAGIC, VERSION, AG, SESSION, 4, 0, 1, 0)
    assert port.check(moved, 4, 5).reason == _chunks.ALTERED


def test_without_a_secret_no_tag_is_checked():
    assert rules().check(chunk()[:2] + [b"q" * 16], 4, 5).reason == _chunks.NOW


def test_a_reduce_scatter_chunk_claiming_another_origin_than_the_previous_rank_is_dropped():
    verdict = rules(rank=1).check(chunk(RS, origin=2), 4, 5)
    assert verdict.reason == _chunks.ORIGIN and "claiming rank 2" in verdict.why
    assert rules(rank=0).check(chunk(RS, origin=2), 4, 5).reason == _chunks.NOW  # rank 0's previous


def test_chunks_are_sorted_by_seq_this_call_a_later_one_an_ended_one_or_refused():
    port = rules()
    assert port.check(chunk(seq=4), 4, 7).reason == _chunks.NOW
    assert port.check(chunk(seq=5), 4, 7).reason == _chunks.EARLY  # the previous rank is ahead
    assert port.check(chunk(seq=6), 4, 7).reason == _chunks.EARLY
    assert port.check(chunk(seq=3), 4, 7).reason == _chunks.ENDED  # the rest of a failed call
    verdict = port.check(chunk(seq=7), 4, 7)  # a call this rank has not made
    assert verdict.reason == _chunks.SEQ and "seq 7" in verdict.why and "at seq 4" in verdict.why
    assert port.check(chunk(seq=5), 4, 5).reason == _chunks.SEQ


def test_a_chunk_the_job_does_not_expect_is_named_for_the_log():
    verdict = rules().check(chunk(AG, seq=4, step=1, index=2), 4, 5)
    assert rules().unexpected(verdict) == ("dropped a allgather chunk (seq 4, step 1, index 2) this "
                                           "call does not expect")


def test_a_port_of_a_group_formed_again_takes_chunks_by_its_new_rank():
    """A shrink renumbers the survivors: old rank 3 of 4 is rank 2 of 3, its previous rank 1,
    not 2 (a port that kept its old place refused the ring's chunks, and the call timed out)."""
    r = ChunkRules(3, 4)
    r.start(SESSION, None, 2, 3)
    assert r.check(chunk(RS, origin=1), 4, 5).reason == _chunks.NOW
    assert r.check(chunk(RS, origin=2), 4, 5).reason == _chunks.ORIGIN
    assert _chunks.HEADER.unpack(r.header(RS, 4, 0, 0))[5] == 2  # the chunks it makes name it rank 2
