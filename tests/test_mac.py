"""ChunkMac: tags bound to a context, refused on any change, with both backends."""

import pytest

from zcollective._format import _mac
from zcollective._format._mac import HMAC_SHA256, POLY1305, ChunkMac, available_backends

SECRET = b"chunk-mac-test-secret-0123456789"
CONTEXT = b"session|sender 1|seq 7|step 2|chunk 0"


@pytest.fixture(params=[POLY1305, HMAC_SHA256])
def backend(request):
    if request.param not in available_backends():
        pytest.skip("the cryptography package (fast-auth extra) is not installed")
    return request.param


def _data():
    return bytearray(range(256)) * 4099  # not a multiple of Poly1305's 16-byte block


def test_tag_verifies_and_has_the_announced_size(backend):
    mac = ChunkMac(SECRET, backend)
    tag = mac.tag(CONTEXT, _data())
    assert mac.backend == backend and len(tag) == ChunkMac.TAG_BYTES
    assert mac.verify(CONTEXT, _data(), tag)
    assert ChunkMac(SECRET, backend).verify(CONTEXT, memoryview(_data()), bytearray(tag))


def test_a_flipped_bit_anywhere_is_refused(backend):
    mac = ChunkMac(SECRET, backend)
    data = _data()
    tag = mac.tag(CONTEXT, data)
    for at in (0, 17, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x04
        assert not mac.verify(CONTEXT, bad, tag)
    bad_tag = bytearray(tag)
    bad_tag[5] ^= 0x80
    assert not mac.verify(CONTEXT, data, bad_tag)
    assert not mac.verify(CONTEXT, data[:-1], tag)
    assert not mac.verify(CONTEXT, data + b"\0", tag)


def test_another_context_or_key_is_refused(backend):
    mac = ChunkMac(SECRET, backend)
    tag = mac.tag(CONTEXT, _data())
    assert not mac.verify(CONTEXT + b"1", _data(), tag)
    assert not mac.verify(CONTEXT[:-1], _data(), tag)
    assert not ChunkMac(SECRET[:-1] + b"x", backend).verify(CONTEXT, _data(), tag)


def test_empty_data_and_multidimensional_buffers(backend):
    np = pytest.importorskip("numpy")
    mac = ChunkMac(SECRET, backend)
    assert mac.verify(CONTEXT, b"", mac.tag(CONTEXT, b""))
    assert mac.tag(CONTEXT, b"") != mac.tag(CONTEXT, b"\0")
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    tag = mac.tag(CONTEXT, arr)
    assert tag == mac.tag(CONTEXT, arr.tobytes())
    fortran = np.asfortranarray(arr)  # tagged as its memory holds it
    assert mac.tag(CONTEXT, fortran) == mac.tag(CONTEXT, arr.tobytes(order="F"))


def test_backends_do_not_accept_each_others_tags():
    if POLY1305 not in available_backends():
        pytest.skip("the cryptography package (fast-auth extra) is not installed")
    tag = ChunkMac(SECRET, POLY1305).tag(CONTEXT, _data())
    assert not ChunkMac(SECRET, HMAC_SHA256).verify(CONTEXT, _data(), tag)


def test_without_cryptography_the_default_is_hmac(monkeypatch):
    monkeypatch.setattr(_mac, "_Poly1305", None)
    assert available_backends() == (HMAC_SHA256,)
    mac = ChunkMac(SECRET)
    assert mac.backend == HMAC_SHA256 and mac.verify(CONTEXT, b"x", mac.tag(CONTEXT, b"x"))
    with pytest.raises(ValueError, match="cryptography"):
        ChunkMac(SECRET, POLY1305)
    with pytest.raises(ValueError, match="unknown MAC backend"):
        ChunkMac(SECRET, "md5")


def test_default_is_the_fastest_available():
    assert ChunkMac(SECRET).backend == available_backends()[0]
