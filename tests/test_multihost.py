"""Replicas on three hosts: network namespaces joined through a bridge, each
host with its own address, no loopback (built by tests/netns.py). Needs root
and iproute2; skipped otherwise. Every namespace is removed, also on failure."""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import hosts_or_skip, ring_jobs, ring_loss_forms
from netns import Hosts, NetnsUnavailable
from test_ops import every_operation, expected

import zcollective as zc
from zcollective.testing import Replicas, report

HOSTS = 3
LIVENESS = 2.0
BOUND = LIVENESS + 4.0  # detection bound plus slack for a loaded 2-core machine


@pytest.fixture
def hosts():
    with hosts_or_skip(HOSTS) as built:
        yield built


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


PROBE = """
import socket, sys, time
if sys.argv[1] == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 29458)); s.listen(4); print("ready", flush=True)
    while True:
        c, _ = s.accept(); n = 0
        while b := c.recv(1 << 20):
            n += len(b)
        c.sendall(b"k"); c.close()  # every byte arrived: the sender's clock may stop
else:
    t0 = time.monotonic()
    try:
        s = socket.create_connection((sys.argv[2], 29458), timeout=2)  # a cut host: fails in 2 s
        s.settimeout(20)  # a reachable one: the transfer itself, on a loaded machine
        s.sendall(bytes(int(sys.argv[3]))); s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
    except OSError as exc:
        print("unreachable", exc); sys.exit(1)
    print(time.monotonic() - t0)
"""


def test_netns_helper_shapes_cuts_and_restores_a_link():
    """What the fault tests of the data plane build on: a link shaped to R
    carries about R; a cut host is unreachable; a restored one is back."""
    rate_mbit, nbytes = 40, 2 << 20  # 0.42 s at the rate: long against the 256 KiB burst
    try:
        hosts = Hosts(2, rate_mbit).__enter__()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    server = None
    try:
        server = hosts.popen(0, [sys.executable, "-c", PROBE, "serve"], stdout=subprocess.PIPE)
        assert server.stdout.readline().strip() == b"ready"

        def send(size):
            return hosts.run(1, sys.executable, "-c", PROBE, "send", hosts.addresses[0], str(size),
                             check=False, timeout=30)

        sent = send(nbytes)
        seconds = float(sent.stdout)
        print(f"{nbytes} bytes in {seconds:.3f} s at {rate_mbit} Mbit/s")
        assert nbytes * 8 / (rate_mbit * 1e6) * 0.8 < seconds < 10, seconds  # shaped: not faster than R
        hosts.cut(1)
        assert send(1).returncode != 0
        hosts.restore(1)
        assert send(1).returncode == 0
    finally:
        if server is not None:
            server.kill()
            server.wait()
        hosts.close()


# -- the data plane across hosts (used by default: the replicas span hosts) --------

SLOW_MBIT = 40  # 5 MB/s per host and direction: a ring of 12 MiB takes several liveness bounds


@pytest.fixture
def slow_hosts():
    with hosts_or_skip(HOSTS, SLOW_MBIT) as built:
        yield built


def ring_on_a_slow_link(markers, nbytes):
    import numpy as np

    r = zc.get_rank()
    assert zc._current()._life.driver.data is not None, "the data plane is not in use across hosts"
    a = np.full(nbytes // 4, r + 1, dtype=np.float32)
    zc.barrier()
    open(os.path.join(markers, f"ring{r}"), "w").close()
    endpoints = zc._current()._life.driver.data.endpoints  # every data port, as the WELCOME said
    start = time.monotonic()
    try:
        out = zc.allreduce(a)
    except zc.ReplicaLostError as exc:
        return "lost", (str(exc), os.getpid(), endpoints), time.monotonic() - start
    sent = zc.stats()["ops"]["allreduce"]["bytes_sent"]
    return "ok", (float(out.min()), float(out.max()), sent), time.monotonic() - start


def _run_on(hosts, fn, *args, liveness, markers):
    env = {"ZCOLLECTIVE_MASTER_ADDR": hosts.addresses[0], "ZCOLLECTIVE_LIVENESS_TIMEOUT": str(liveness),
           "ZCOLLECTIVE_SECRET": "a-secret-of-this-test-only-" + "x" * 8}
    prefix = {i: hosts.prefix(i) for i in range(HOSTS)}
    return Replicas(fn, HOSTS, markers, *args, env=env, rank_prefix=prefix, port=29457)


def test_a_ring_slowly_but_steadily_moving_an_array_is_never_declared_lost(slow_hosts, tmp_path):
    """12 MiB at 40 Mbit/s: the ring moves 2/3 of it each way per host, ~3.4 s
    at best, over three times the 1 s liveness bound."""
    nbytes = 12 << 20
    with _run_on(slow_hosts, ring_on_a_slow_link, nbytes, liveness=1.0, markers=str(tmp_path)) as reps:
        outs = reps.wait(90)
    for o in outs:
        assert o.ok, report(outs, f"rank {o.rank} failed")
        state, (low, high, sent), took = o.value
        assert state == "ok" and low == high == 6.0, report(outs, str(o.value))
        assert sent < 10000, report(outs, "the array went through rank 0")  # descriptions only
        assert took > 3.0, report(outs, f"the link was not slow: {took:.2f} s")  # it was a real test


def test_a_data_link_cut_mid_ring_is_named_on_every_other_rank(slow_hosts, tmp_path):
    """Host 2 cut off mid-ring: each other rank is told by the coordinator
    (rank 2's connection went silent) or by its own data plane or its
    neighbour's: exactly one of those messages, naming rank 2, seq 1 and
    the operation. (The whole host goes: its control link too.)"""
    markers, nbytes = str(tmp_path), 12 << 20
    with _run_on(slow_hosts, ring_on_a_slow_link, nbytes, liveness=LIVENESS, markers=markers) as reps:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(markers, f"ring{r}")) for r in range(HOSTS)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in reps.procs), \
                report(reps.wait(5), "the ring did not start")
            time.sleep(0.02)
        time.sleep(1.0)  # mid-ring: about a third of the way
        slow_hosts.cut(2)
        cut_at = time.monotonic()
        reps.join([0, 1], 30)
        detected = time.monotonic() - cut_at
        pid_of_2 = reps.procs[2].pid  # ip netns exec runs the command in its own process
        outs = reps.wait(30)
    for o in outs[:2]:
        assert o.ok and o.value[0] == "lost", report(outs, f"rank {o.rank} failed")
    pids = {o.rank: o.value[1][1] for o in outs[:2]} | {2: pid_of_2}
    jobs = ring_jobs(HOSTS, nbytes // 4, np.float32)
    for o in outs[:2]:
        message, _, endpoints = o.value[1]
        forms = ring_loss_forms(o.rank, 2, 1, "allreduce", pids, socket.gethostname(), endpoints, jobs)
        assert any(f.fullmatch(message) for f in forms), report(outs, f"rank {o.rank}: {message}")
    assert detected < BOUND, report(outs, f"detected {detected:.1f} s after the cut")


def per_host(master):
    """Split by host (each namespace has its own address), a reduction on each host, one rank per
    host across hosts; a sub-group across hosts on the data plane."""
    r = zc.get_rank()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, 1))
        here = probe.getsockname()[0]  # this host's address
    host = zc.split(here)
    local = host.allreduce(r)
    leaders = zc.split(0 if host.rank == 0 else None)
    total = leaders.allreduce(local) if leaders is not None else None
    total = host.broadcast(total)
    odd = zc.split(r % 2)  # ranks 0,2 and 1,3: each across both hosts
    array = odd.allreduce(np.full(1 << 20, r, np.float32))  # 4 MiB: peer to peer
    leaders = leaders and leaders.parent_ranks
    return here, host.parent_ranks, total, leaders, float(array[0]), odd._life.here.data


def test_split_by_host_across_namespaced_hosts():
    with hosts_or_skip(2) as hosts:
        master = hosts.addresses[0]
        env = {"ZCOLLECTIVE_MASTER_ADDR": master}
        prefix = {0: hosts.prefix(0), 1: hosts.prefix(0), 2: hosts.prefix(1), 3: hosts.prefix(1)}
        with Replicas(per_host, 4, master, env=env, rank_prefix=prefix, port=29461) as reps:
            outs = reps.wait(90)
    assert all(o.error is None for o in outs), report(outs, "a rank failed")
    for r, out in enumerate(outs):
        here, members, total, leaders, array, data = out.value
        assert here == hosts.addresses[r // 2], report(outs, "a rank on the wrong host")
        assert members == [2 * (r // 2), 2 * (r // 2) + 1] and total == 6
        assert leaders == ([0, 2] if r % 2 == 0 else None)  # one rank per host
        assert array == (2.0 if r % 2 == 0 else 4.0) and data, report(outs, f"rank {r}")


NO_ROUTE = """
import time, zcollective as zc
start = time.monotonic()
try:
    zc.initialize("10.9.9.9", 29999, 1, 2, timeout=20)  # no route from this host to it
    print("no error")
except zc.CollectiveError as exc:
    print(type(exc).__name__, exc)
print(f"took {time.monotonic() - start:.2f}")
"""


def test_a_replica_with_no_route_to_the_master_is_told_so_at_once_never_hangs():
    """A host whose network is down (here: no route to the master's address): the replica's
    ports cannot be opened on the interface that reaches the master. It used to leave its
    master connection open and wait forever in ZeroMQ's term() (the cut-off side of a
    partition hung the same way in shrink())."""
    with hosts_or_skip(1) as hosts:
        ran = hosts.run(0, sys.executable, "-c", NO_ROUTE, timeout=30, check=False)
    out = ran.stdout.decode()
    assert ran.returncode == 0, out + ran.stderr.decode()
    assert out.startswith("AddressError rank 1 cannot reach the master address 10.9.9.9 from this host"), out
    assert float(out.split("took ")[1]) < 5, out
