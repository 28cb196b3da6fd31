"""Shared memory with ranks on several hosts: each host's ranks reduce in their
segment, the hosts' leaders take the sums round a ring of their own, and the
others read the result (docs/protocol.md, *Shared memory*). Each host is a
network namespace (tests/netns.py) holding two ranks; what crosses a host's
link is read from the namespace's own counters. Needs root and iproute2;
skipped otherwise."""

import hashlib
import inspect
import os
import signal
import time

import numpy as np
import pytest
from conftest import hosts_or_skip, touch
from test_shared import lost_then_shrunk, segments

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


# -- failures across hosts ------------------------------------------------------

LIVENESS = "2"
BOUND = float(LIVENESS) + 4.0  # detection bound plus slack for a loaded 2-core machine
ELEMENTS = 1 << 20  # 4 MiB of float32: above the data plane's threshold


def in_ring():
    """Is the caller's caller running the ring between hosts (not the host's own reduction)?"""
    return any(frame.function == "receive" for frame in inspect.stack()[2:6])


def killed_across_hosts(victim, where, markers):
    """Rank ``victim`` is killed (SIGKILL) in an allreduce across hosts: in its host's
    reduction (``reducing``) or, a leader, in the ring between hosts (``ring``); the
    others are told who, then shrink and go on."""
    r = zc.get_rank()
    zc.allreduce(np.ones(ELEMENTS, dtype=np.float32))  # (the segments made, their names unlinked)

    @zc.elementwise
    def add_then_die(a, b):
        if r == victim and (where == "reducing" or in_ring()):
            touch(os.path.join(markers, "dying"))
            os.kill(os.getpid(), signal.SIGKILL)
        a += b
        return a
    return lost_then_shrunk(ELEMENTS, add_then_die, shared=False)  # (a host of one rank left)


@pytest.mark.parametrize("victim, where", [(2, "ring"), (3, "reducing")], ids=["leader-in-ring", "in-host"])
def test_a_rank_killed_mid_call_across_hosts_is_named_within_the_bound_and_leaves_no_segment(
        tmp_path, victim, where):
    with hosts_or_skip(2) as hosts:
        env = {"ZCOLLECTIVE_MASTER_ADDR": hosts.addresses[0], "ZCOLLECTIVE_SECRET": SECRET,
               "ZCOLLECTIVE_LIVENESS_TIMEOUT": LIVENESS}
        prefix = {r: hosts.prefix(r // 2) for r in range(4)}
        with Replicas(killed_across_hosts, 4, victim, where, str(tmp_path), env=env, rank_prefix=prefix,
                      port=29457) as reps:
            outs = reps.wait(90)
    assert outs[victim].returncode == -signal.SIGKILL, report(outs, "the victim did not die mid-call")
    survivors = [o for o in outs if o.rank != victim]
    assert all(o.ok for o in survivors), report(outs, "a survivor failed")
    for o in survivors:
        said, took, got, size, sessions = o.value
        assert f"rank {victim} (pid " in said and " was lost " in said, report(outs, said)
        assert took < BOUND, report(outs, f"rank {o.rank} took {took:.1f} s")
        assert (got, size) == (float(sum(range(4)) - victim), 3), report(outs, "the survivors' group")
        for session in sessions:
            assert segments(session) == [], report(outs, f"left in /dev/shm: {segments(session)}")


def fail_alike_across_hosts():
    """A mismatch, a leader's function raising in the ring between hosts, a rank slow in
    its host's reduction past the others' timeout: each call fails alike on every rank;
    then a call whose program ends without teardown while it is in flight."""
    r = zc.get_rank()
    said = []

    @zc.elementwise
    def raising_in_ring(a, b):
        if r == 2 and in_ring():
            raise ArithmeticError("rank 2 refuses")
        a += b
        return a

    def attempt(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
            said.append("no error")
        except zc.CollectiveError as exc:
            said.append(f"{type(exc).__name__}: {exc}")

    attempt(zc.allreduce, np.ones(ELEMENTS + (r == 3), dtype=np.float32))  # shapes disagree
    attempt(zc.allreduce, np.ones(ELEMENTS, dtype=np.float32), raising_in_ring)
    slept = []

    @zc.elementwise
    def slow_once(a, b):  # rank 3 is 1.5 s late in its host's reduction (its first block only)
        if r == 3 and not slept:
            slept.append(time.sleep(1.5))
        a += b
        return a
    attempt(zc.allreduce, np.ones(ELEMENTS, dtype=np.float32), slow_once, timeout=0.5 if r != 3 else None)
    said.append(float(zc.allreduce(np.full(ELEMENTS, 1.0, dtype=np.float32))[-1]))
    f = zc.allreduce_async(np.full(ELEMENTS, r + 1.0, dtype=np.float32))
    if r == 0:
        said.append(float(f.result()[0]))
    zc.teardown = lambda: None  # (the harness's own teardown: this program just ends)
    return said


def test_calls_across_hosts_fail_alike_and_a_program_ending_mid_call_finishes_it_first():
    with hosts_or_skip(2) as hosts:
        env = {"ZCOLLECTIVE_MASTER_ADDR": hosts.addresses[0], "ZCOLLECTIVE_SECRET": SECRET}
        prefix = {r: hosts.prefix(r // 2) for r in range(4)}
        with Replicas(fail_alike_across_hosts, 4, env=env, rank_prefix=prefix, port=29457) as reps:
            outs = reps.wait(90)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    mismatch, raised, timed_out, after = zip(*(o.value[:4] for o in outs), strict=True)
    assert len(set(mismatch)) == 1, mismatch
    assert mismatch[0].startswith("CallMismatchError: seq 0 allreduce: "), mismatch
    assert len(set(raised)) == 1 and raised[0] == (
        "PeerError: seq 1 allreduce: the reduce function raised on rank 2 during the ring: "
        "ArithmeticError: rank 2 refuses"), raised
    assert all(t.startswith("CollectiveTimeoutError: ") for t in timed_out), timed_out
    assert "gave it up (its call timed out" in timed_out[3], timed_out
    assert after == (4.0,) * 4, after
    assert outs[0].value[4] == 10.0, report(outs, "the call in flight at the end")
