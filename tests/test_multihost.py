"""Replicas on three hosts: network namespaces joined through a bridge, each
host with its own address, no loopback. Needs root and iproute2; skipped
otherwise. Every namespace and link is removed, also on failure."""

import os
import shutil
import subprocess
import time

import pytest
from test_ops import every_operation, expected

import zcollective as zc
from zcollective.testing import Replicas, report

HOSTS = 3
SUBNET = "198.18.{}"  # RFC 2544 benchmarking range: never routed, never anybody's address
LIVENESS = 2.0
BOUND = LIVENESS + 4.0  # detection bound plus slack for a loaded 2-core machine


def _ip(*args, ns=None):
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


@pytest.fixture
def hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = f"zc{os.getpid() % 100000}"
    switch = f"{tag}-sw"
    names = [f"{tag}-h{i}" for i in range(HOSTS)]
    subnet = SUBNET.format(os.getpid() % 250)
    made = []
    try:
        for ns in (switch, *names):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", "br0", "type", "bridge", ns=switch)
        _ip("link", "set", "br0", "up", ns=switch)
        addresses = []
        for i, ns in enumerate(names):
            host_end, switch_end = f"{tag}v{i}", f"{tag}p{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _ip("link", "set", host_end, "netns", ns)
            _ip("link", "set", switch_end, "netns", switch)
            _ip("link", "set", switch_end, "master", "br0", ns=switch)
            _ip("link", "set", switch_end, "up", ns=switch)
            address = f"{subnet}.{i + 1}"
            _ip("addr", "add", f"{address}/24", "dev", host_end, ns=ns)
            _ip("link", "set", host_end, "up", ns=ns)
            addresses.append((ns, address, host_end))
    except subprocess.CalledProcessError as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        pytest.skip(f"cannot build network namespaces here: {exc.stderr.decode().strip()}")
    try:
        yield addresses
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


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
    master = hosts[0][1]
    env = {"ZCOLLECTIVE_MASTER_ADDR": master, "ZCOLLECTIVE_LIVENESS_TIMEOUT": str(LIVENESS)}
    prefix = {i: ["ip", "netns", "exec", ns] for i, (ns, _, _) in enumerate(hosts)}
    with Replicas(job_across_hosts, HOSTS, phase2, go, env=env, rank_prefix=prefix, port=29457) as reps:
        deadline = time.monotonic() + 60
        while not os.path.exists(phase2) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in reps.procs):
                break
            time.sleep(0.05)
        assert os.path.exists(phase2), report(reps.wait(5), "the job did not reach phase 2")
        ns2, _, link2 = hosts[2]
        _ip("link", "set", link2, "down", ns=ns2)
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
