"""Shared memory with ranks on several hosts: each host's ranks reduce in their
segment, the hosts' leaders take the sums round a ring of their own, and the
others read the result (docs/protocol.md, *Shared memory*). Each host is a
network namespace (tests/netns.py) holding two ranks; what crosses a host's
link is read from the namespace's own counters. Needs root and iproute2;
skipped otherwise."""

import hashlib

import numpy as np
import pytest
from conftest import hosts_or_skip

import zcollective as zc
from zcollective.testing import Replicas, report

LINK = "eth0"  # every namespaced host's interface (tests/netns.py)
MIB = 1 << 20
SECRET = "a-secret-of-this-test-only-" + "x" * 8


def link_bytes():
    """Bytes this host's link has taken in and sent out so far (its namespace's counters)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == LINK:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise AssertionError(f"no {LINK} here")


def maximum(a, b):
    np.maximum(a, b, out=a)
    return a


def across_hosts(nbytes):
    r, n = zc.get_rank(), zc.get_world_size()
    plane = zc._current()._life.shared
    leaders = None if plane is None else plane.leaders
    a = np.arange(nbytes // 4, dtype=np.float32) + r  # elementwise: every rank's differ
    zc.barrier()
    before = link_bytes()
    out = zc.allreduce(a)
    zc.barrier()
    after = link_bytes()
    want = np.arange(nbytes // 4, dtype=np.float32) * n + n * (n - 1) / 2
    ok_sum = bool(np.array_equal(out, want))
    digest = hashlib.sha256(out.tobytes()).hexdigest()  # every rank the same bits
    mine = zc.elementwise(maximum)  # a function of the program's own, marked elementwise
    highest = zc.allreduce(np.full(nbytes // 4, float(r), dtype=np.float32), mine)
    value = zc.broadcast(np.full(nbytes // 4, 7.0, dtype=np.float32) if r == 0 else None)  # (the ring)
    small = zc.allreduce(np.ones(16, dtype=np.float32))  # (the star)
    gathered = zc.allgather(r)
    return {"leaders": leaders, "ok_sum": ok_sum, "digest": digest, "rx": after[0] - before[0],
            "tx": after[1] - before[1], "max": (float(highest.min()), float(highest.max())),
            "bcast": float(value.sum()), "small": float(small[0]), "gathered": gathered}


@pytest.mark.parametrize("placement", ["contiguous", "interleaved"])
def test_an_allreduce_across_hosts_crosses_each_hosts_link_once_per_host(placement, tmp_path):
    """Two ranks on each of three hosts: the allreduce's result is every rank's sum, the
    same bits everywhere, and each host's link carries about 2 (H - 1) / H of the array
    each way, as for one rank per host; a ring of all six ranks would carry 2 (N - 1) / N,
    1.25x as much. A function of the program's own, a broadcast, a small allreduce and
    an allgather come right beside it."""
    hosts_n, per_host, nbytes = 3, 2, 8 * MIB
    n = hosts_n * per_host
    host_of = (lambda r: r // per_host) if placement == "contiguous" else (lambda r: r % hosts_n)
    with hosts_or_skip(hosts_n) as hosts:
        env = {"ZCOLLECTIVE_MASTER_ADDR": hosts.addresses[0], "ZCOLLECTIVE_SECRET": SECRET}
        prefix = {r: hosts.prefix(host_of(r)) for r in range(n)}
        with Replicas(across_hosts, n, nbytes, env=env, rank_prefix=prefix, port=29457) as reps:
            outs = reps.wait(120)
    for o in outs:
        assert o.ok, report(outs, f"rank {o.rank} failed")
    values = [o.value for o in outs]
    leaders = sorted({min(r for r in range(n) if host_of(r) == h) for h in range(hosts_n)})
    bound = 2 * (hosts_n - 1) / hosts_n * nbytes
    for r, v in enumerate(values):
        assert v["leaders"] == leaders, report(outs, f"rank {r}: leaders {v['leaders']}, not {leaders}")
        assert v["ok_sum"] and v["digest"] == values[0]["digest"], report(outs, f"rank {r}: wrong sum")
        assert v["max"] == (n - 1.0, n - 1.0), report(outs, f"rank {r}: maximum {v['max']}")
        assert v["bcast"] == 7.0 * nbytes // 4 and v["small"] == n, report(outs, str(v))
        assert v["gathered"] == list(range(n)), report(outs, str(v))
        # TCP/IP headers and the control plane add a few percent; a ring of all ranks 25%
        assert 0.9 * bound < v["rx"] < 1.12 * bound, report(outs, f"rank {r}'s host took in {v['rx']} "
                                                                  f"bytes, {v['rx'] / bound:.2f}x the bound")
        assert v["tx"] < 1.12 * bound, report(outs, f"rank {r}'s host sent {v['tx']} bytes")
