"""Large point-to-point messages (issue 46): a 16 MiB array both ways between real processes,
with and without a secret, among small messages from a third rank: received intact, writable (a
view of the received frame, no copy), in order with the others."""

import pytest

from zcollective.testing import run_replicas

np = pytest.importorskip("numpy")

SECRET = b"the large messages' test secret!"
SECRETS = {"no secret": {}, "secret": {"ZCOLLECTIVE_SECRET": SECRET.decode()}}
N = (16 << 20) // 4  # a 16 MiB float32 array


def large_both_ways():
    import zcollective as zc

    r = zc.get_rank()
    out = {}
    if r == 0:
        sent = np.arange(N, dtype=np.float32)
        zc.send(sent, 1, tag=1)
        sent += 1  # send returned: the array is ours to change again
        back = zc.recv(1, tag=2)
        out["back"] = (back.dtype.str, back.shape, back.flags.writeable, bool(np.array_equal(back, sent - 1)))
        back[0] = -1  # writable, as documented
        smalls = [zc.recv(2, tag=3) for _ in range(20)]
        out["smalls"] = smalls == list(range(20))
        out["mixed"] = [zc.recv(1, tag=4).shape for _ in range(3)]
    elif r == 1:
        got = zc.recv(0, tag=1)
        out["got"] = (got.dtype.str, got.shape, got.flags.writeable, int(got[-1]))
        zc.send(got, 0, tag=2)
        for k in range(3):  # large messages interleaved at rank 0 with rank 2's small ones
            zc.send(np.full(N // (k + 1), k, np.float32), 0, tag=4)
    else:
        for i in range(20):
            zc.send(i, 0, tag=3)
    zc.barrier()
    return out


@pytest.mark.parametrize("secret", list(SECRETS))
def test_a_16_mib_array_both_ways_among_small_messages(secret):
    outs = run_replicas(large_both_ways, 3, env=SECRETS[secret], timeout=120)
    assert outs[1]["got"] == ("<f4", (N,), True, N - 1)
    assert outs[0]["back"] == ("<f4", (N,), True, True)
    assert outs[0]["smalls"] is True
    assert outs[0]["mixed"] == [(N,), (N // 2,), (N // 3,)]
