"""Replicas on three hosts: network namespaces joined through a bridge, each
host with its own address, no loopback (built by tests/netns.py). Needs root
and iproute2; skipped otherwise. Every namespace is removed, also on failure."""

import os
import time

import pytest
from netns import Hosts, NetnsUnavailable
from test_ops import every_operation, expected

import zcollective as zc
from zcollective.testing import Replicas, report

HOSTS = 3
LIVENESS = 2.0
BOUND = LIVENESS + 4.0  # detection bound plus slack for a loaded 2-core machine


@pytest.fixture
def hosts():
    try:
        with Hosts(HOSTS) as built:
            yield built
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))


def job_across_hosts(phase2, go):
    out = every_operation()
    r = zc.get_rank()
    zc.barrier()
    if r == 0:
        open(phase2, "w").close()  # the test may cut host 2's link now
    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    if r == 2:
        time.sleep(60)  # its link goes down; it never calls
    start = time.monotonic()
    try:
        zc.allreduce(1)
    except zc.ReplicaLostError as exc:
        return out, str(exc), time.monotonic() - start
    return out, "no error", 0.0


def test_every_operation_across_namespaced_hosts_then_a_link_goes_down(hosts, tmp_path):
    phase2, go = str(tmp_path / "phase2"), str(tmp_path / "go")
    master = hosts.addresses[0]
    env = {"ZCOLLECTIVE_MASTER_ADDR": master, "ZCOLLECTIVE_LIVENESS_TIMEOUT": str(LIVENESS)}
    prefix = {i: hosts.prefix(i) for i in range(HOSTS)}
    with Replicas(job_across_hosts, HOSTS, phase2, go, env=env, rank_prefix=prefix, port=29457) as reps:
        deadline = time.monotonic() + 60
        while not os.path.exists(phase2) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in reps.procs):
                break
            time.sleep(0.05)
        assert os.path.exists(phase2), report(reps.wait(5), "the job did not reach phase 2")
        hosts.cut(2)
        open(go, "w").close()
        reps.join([0, 1], 30)
        outs = reps.wait(5)
    want = expected(HOSTS)
    for out in outs[:2]:
        assert out.error is None and out.value is not None, report(outs, "survivor failed")
        result, message, elapsed = out.value
        for key, value in want.items():
            if value is not None or key == "none":
                assert result[key] == value, (out.rank, key)
        assert "rank 2" in message and "was lost" in message, report(outs, message)
        assert elapsed < BOUND, report(outs, f"detected after {elapsed:.1f} s")
    assert master not in ("127.0.0.1", "localhost")
