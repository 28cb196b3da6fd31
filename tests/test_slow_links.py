"""A slow link carrying a large message is not a dead peer.

libzmq counts a peer alive (cancels its heartbeat timeout) only when a whole
frame has arrived, so a frame that takes longer than ``liveness_timeout`` to
cross the link used to end the group with ``ReplicaLostError`` on a healthy
network. Frames above ``WIRE_PART_BYTES`` now travel as parts.

Real processes inside a network namespace whose own loopback is shaped with a
token-bucket filter. Needs root, iproute2 and tc; skipped otherwise. The
namespace is always deleted, also on failure.
"""

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from zcollective.testing import Replicas, report

N = 3
LIVENESS_S = 1.0  # the smallest liveness bound: the hardest case
RATE = "64mbit"  # shared by every connection in the namespace: ~8 MB/s
TRANSFER_S = 4.0  # each large message takes at least this long, 4x the liveness bound
SHAPE = ["tbf", "rate", RATE, "burst", "128kb", "latency", "200ms"]  # burst above lo's 64 KiB packets
PROBE_BYTES = 4_000_000  # the point-to-point transfer that measures the shaped rate
MAX_VALUE_BYTES = 48 << 20  # keeps the test under ~30 s even if the shaping is looser than asked
RUN_TIMEOUT_S = 60.0  # with the probe's 20 s, inside pytest's 120 s: the namespace is always deleted


def _run(*cmd, ns=None, timeout=20):
    full = list(cmd) if ns is None else ["ip", "netns", "exec", ns, *cmd]
    return subprocess.run(full, check=True, capture_output=True, timeout=timeout)


@pytest.fixture
def slow_loopback():
    """A network namespace whose loopback carries RATE, all connections together."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces and tc need root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` (iproute2) is not installed")
    ns = f"zcslow{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.decode().strip()}")
    try:
        try:
            _run("ip", "link", "set", "lo", "up", ns=ns)
            _run("tc", "qdisc", "add", "dev", "lo", "root", *SHAPE, ns=ns)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot shape loopback here: {exc.stderr.decode().strip()}")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


PROBE = """
import socket, sys, threading, time
n = int(sys.argv[1])
server = socket.create_server(("127.0.0.1", 0))
done = []
def drain():
    conn, _ = server.accept()
    conn.settimeout(15)
    left = n
    while left > 0:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        left -= len(chunk)
    done.append(time.perf_counter())
reader = threading.Thread(target=drain, daemon=True)
reader.start()
client = socket.create_connection(server.getsockname(), timeout=15)
start = time.perf_counter()
client.sendall(b"x" * n)
reader.join(15)
print(n / (done[0] - start))
"""


def measured_rate(ns):
    """Bytes per second of one TCP connection on the namespace's loopback."""
    out = _run(sys.executable, "-c", PROBE, str(PROBE_BYTES), ns=ns, timeout=20)
    return float(out.stdout)


def xor(a, b):
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


def value_of(rank, size):
    return hashlib.shake_256(f"rank {rank}".encode()).digest(size)


def large_values(size):
    """An allreduce and a broadcast of ``bytes`` (pickled in-band: one large frame each way)."""
    import zcollective as zc

    rank = zc.get_rank()
    total = zc.allreduce(value_of(rank, size), xor)
    got = zc.broadcast(value_of("root", size) if rank == 0 else None)
    return hashlib.sha256(total).hexdigest(), hashlib.sha256(got).hexdigest()


def test_large_values_over_a_slow_link_lose_nobody(slow_loopback):
    rate = measured_rate(slow_loopback)
    # N - 1 replicas share the link: each large message takes (N - 1) * size / rate
    size = min(MAX_VALUE_BYTES, int(TRANSFER_S * rate / (N - 1)) + 1)
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": str(LIVENESS_S)}
    prefix = {rank: ["ip", "netns", "exec", slow_loopback] for rank in range(N)}
    with Replicas(large_values, N, size, env=env, rank_prefix=prefix,
                  init_timeout=RUN_TIMEOUT_S) as replicas:
        outcomes = replicas.wait(RUN_TIMEOUT_S)
    context = f"{size} bytes at a measured {rate / 1e6:.1f} MB/s"
    assert all(o.ok for o in outcomes), report(outcomes, f"a replica failed ({context})")
    total = value_of(0, size)
    for rank in range(1, N):
        total = xor(total, value_of(rank, size))
    want = (hashlib.sha256(total).hexdigest(), hashlib.sha256(value_of("root", size)).hexdigest())
    for outcome in outcomes:
        assert outcome.value == want, report(outcomes, f"rank {outcome.rank} got another value")
