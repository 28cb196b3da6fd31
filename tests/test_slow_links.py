"""A slow link carrying a large message is not a dead peer.

libzmq counts a peer alive (cancels its heartbeat timeout) only when a whole
frame has arrived, so a frame that takes longer than ``liveness_timeout`` to
cross the link used to end the group with ``ReplicaLostError`` on a healthy
network. Frames above ``WIRE_PART_BYTES`` now travel as parts.

Real processes on three hosts (network namespaces on a bridge, tests/netns.py)
whose links are shaped with a token-bucket filter: frames are sent in parts
only when a group spans hosts (on one host, loopback is never that slow).
Needs root, iproute2 and tc; skipped otherwise. The namespaces are always
deleted, also on failure.
"""

import hashlib
import time

import pytest
from conftest import hosts_or_skip

from zcollective.testing import Replicas, report

N = 3
LIVENESS_S = 1.0  # the smallest liveness bound: the hardest case
RATE_MBIT = 64  # per host and direction: ~7.6 MB/s of payload
TRANSFER_S = 3.0  # each large message takes at least this long, 3x the liveness bound
RUN_TIMEOUT_S = 60.0  # inside pytest's 120 s: the namespaces are always deleted


@pytest.fixture
def slow_hosts():
    with hosts_or_skip(N, RATE_MBIT) as hosts:
        yield hosts


def xor(a, b):
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


def value_of(rank, size):
    return hashlib.shake_256(f"rank {rank}".encode()).digest(size)


def large_values(size):
    """An allreduce and a broadcast of ``bytes`` (pickled in-band: one large frame each way)."""
    import zcollective as zc

    rank = zc.get_rank()
    start = time.monotonic()
    total = zc.allreduce(value_of(rank, size), xor)
    got = zc.broadcast(value_of("root", size) if rank == 0 else None)
    took = time.monotonic() - start
    return hashlib.sha256(total).hexdigest(), hashlib.sha256(got).hexdigest(), took


def test_large_values_over_a_slow_link_lose_nobody(slow_hosts):
    rate = RATE_MBIT * 1e6 / 8 * 0.95  # payload over TCP (tests/test_multihost.py measures it)
    # rank 0's link carries N - 1 copies of each large message
    size = int(TRANSFER_S * rate / (N - 1)) + 1
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": str(LIVENESS_S),
           "ZCOLLECTIVE_MASTER_ADDR": slow_hosts.addresses[0]}
    prefix = {rank: slow_hosts.prefix(rank) for rank in range(N)}
    with Replicas(large_values, N, size, env=env, rank_prefix=prefix,
                  init_timeout=RUN_TIMEOUT_S) as replicas:
        outcomes = replicas.wait(RUN_TIMEOUT_S)
    context = f"{size} bytes at {RATE_MBIT} Mbit/s"
    assert all(o.ok for o in outcomes), report(outcomes, f"a replica failed ({context})")
    total = value_of(0, size)
    for rank in range(1, N):
        total = xor(total, value_of(rank, size))
    want = (hashlib.sha256(total).hexdigest(), hashlib.sha256(value_of("root", size)).hexdigest())
    for outcome in outcomes:
        assert outcome.value[:2] == want, report(outcomes, f"rank {outcome.rank} got another value")
        # a real test: the transfers took several liveness bounds
        assert outcome.value[2] > 2 * TRANSFER_S, report(outcomes, f"took {outcome.value[2]:.1f} s")


ENDING_BYTES = 8_000_000  # a second on the link: still in the kernel's queues when the program ends
LATE_S = 1.0  # how much later the other ranks make the call


def end_right_after(size, who):
    """Rank ``who`` makes a call with a large value and its program ends at
    once, without teardown; the others make the same call a second later."""
    import zcollective as zc

    zc.initialize()
    rank = zc.get_rank()
    if rank == who:
        if who == 0:
            zc.broadcast_async(value_of("root", size))
        else:
            zc.allreduce_async(value_of(rank, size), xor)
        return "ended"
    time.sleep(LATE_S)
    got = zc.broadcast(None) if who == 0 else zc.allreduce(value_of(rank, size), xor)
    return hashlib.sha256(got).hexdigest()


@pytest.mark.parametrize("who", [0, 2], ids=["rank 0 ends first", "a replica ends first"])
def test_a_program_ending_over_a_slow_link_loses_nothing_it_sent(slow_hosts, who):
    """What an ending program sent is still in its kernel's queue when it
    closes: a close with unread data (the other side's heartbeat) resets the
    connection and drops it, unless the program waits for every byte to be
    acknowledged (rank 0) or for the coordinator's answer to its BYE (a
    replica). Both lost the value here before."""
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": str(LIVENESS_S), "ZCOLLECTIVE_DATA_PLANE": "off",
           "ZCOLLECTIVE_MASTER_ADDR": slow_hosts.addresses[0]}
    prefix = {rank: slow_hosts.prefix(rank) for rank in range(N)}
    with Replicas(end_right_after, N, ENDING_BYTES, who, initialize=False, env=env, rank_prefix=prefix,
                  init_timeout=RUN_TIMEOUT_S) as replicas:
        outcomes = replicas.wait(RUN_TIMEOUT_S)
    assert all(o.ok for o in outcomes), report(outcomes, f"rank {who} ended right after its call")
    if who == 0:
        want = value_of("root", ENDING_BYTES)
    else:
        want = value_of(0, ENDING_BYTES)
        for rank in range(1, N):
            want = xor(want, value_of(rank, ENDING_BYTES))
    for outcome in outcomes:
        if outcome.rank != who:
            assert outcome.value == hashlib.sha256(want).hexdigest(), report(outcomes, "another value")


def forward_then_end(size):
    """A chain broadcast 0 -> 1 -> 2 over the data plane: rank 1 takes its
    value and its program ends at once, its forwarded chunks to rank 2 still
    in the kernel's queue; rank 2 is busy in its own code for a while."""
    import numpy as np

    import zcollective as zc

    zc.initialize()
    rank = zc.get_rank()
    value = np.frombuffer(value_of("root", size), dtype=np.uint8) if rank == 0 else None
    future = zc.broadcast_async(value)
    if rank == 1:
        future.result()
        return "ended"
    if rank == 2:
        time.sleep(LATE_S)
    return hashlib.sha256(future.result().tobytes()).hexdigest()


def test_a_rank_ending_right_after_it_forwarded_chunks_over_a_slow_link_loses_none(slow_hosts):
    """Rank 1's chunks for rank 2 are still in its kernel's queue when its
    program ends: closing then (rank 2's heartbeat unread) would reset the
    link and drop them. Its BYE's answer waits until rank 2 says TAKEN."""
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": str(LIVENESS_S), "ZCOLLECTIVE_DATA_PLANE": "on",
           "ZCOLLECTIVE_MASTER_ADDR": slow_hosts.addresses[0]}
    prefix = {rank: slow_hosts.prefix(rank) for rank in range(N)}
    with Replicas(forward_then_end, N, ENDING_BYTES, initialize=False, env=env, rank_prefix=prefix,
                  init_timeout=RUN_TIMEOUT_S) as replicas:
        outcomes = replicas.wait(RUN_TIMEOUT_S)
    assert all(o.ok for o in outcomes), report(outcomes, "rank 1 ended right after forwarding")
    want = hashlib.sha256(value_of("root", ENDING_BYTES)).hexdigest()
    assert outcomes[2].value == want, report(outcomes, "rank 2 got another value")
