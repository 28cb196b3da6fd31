"""The progress rule attacked (attack1's reproducers; docs/protocol.md, *Progress*): teardown
with a large allreduce_async pending (barrier first, results read after), a wait nested in a
done-callback beside a data move held by a rank away from the library, and a single large send
after a small message already received. Real processes on loopback; every wait is bounded by a
short timeout, so a starved wait shows as a timeout or a slow measured wait, not a hang."""

import time

import pytest

import zcollective as zc
from zcollective._io import _shared
from zcollective.testing import run_replicas

np = pytest.importorskip("numpy")

WAIT_S = 8.0  # every call's timeout: long on a loaded machine for calls that take milliseconds
RUN_S = 40  # a whole test
AWAY_S = 3.0  # a rank computes this long, away from the library
QUICK_S = 1.5  # a wait that needs nothing of the away rank returns well within this
ELEMENTS = 1 << 20  # float32: 4 MiB, through shared memory or round the ring
WINDOW = {"ZCOLLECTIVE_MAIL_WINDOW_BYTES": str(1 << 20)}  # 1 MiB
SENDS = 3  # messages of 1.2 MB into a 1 MiB window: the second and third wait for credit
SHARED = {"ZCOLLECTIVE_TIMEOUT": str(WAIT_S)}
RING = {"ZCOLLECTIVE_TIMEOUT": str(WAIT_S), "ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": "off",
        "ZCOLLECTIVE_DATA_PLANE": "on"}
PLANES = [pytest.param(SHARED, id="shared", marks=pytest.mark.skipif(
    not _shared.available(), reason="no POSIX shared memory here")), pytest.param(RING, id="ring")]


# -- 1. teardown finishes a large allreduce_async made before it --------------------------


def _teardown_with_pending_allreduce(late):
    """A barrier, then a 4 MiB allreduce_async on every rank, not waited for; the last rank
    computes ``late`` s first; teardown(timeout=WAIT_S); the future read after."""
    me, n = zc.get_rank(), zc.get_world_size()
    zc.barrier()
    big = zc.allreduce_async(np.full(ELEMENTS, me + 1.0, dtype=np.float32))
    if me == n - 1:
        time.sleep(late)
    zc.teardown(timeout=WAIT_S)
    return float(big.result(0)[0]), big.done()


@pytest.mark.parametrize("env", PLANES)
@pytest.mark.parametrize("late", [0.0, 1.0], ids=["at-once", "late"])
def test_teardown_finishes_a_pending_large_allreduce_after_a_barrier(env, late):
    """attack1 1: 'the group was torn down before the call finished', or 'lost the coordinator'."""
    outs = run_replicas(_teardown_with_pending_allreduce, 3, late, env=env, timeout=RUN_S)
    assert outs == [(6.0, True)] * 3, outs


# -- 2. a wait nested in a done-callback is not held by a data move ------------------------


def _callback_waits(how):
    """Every rank: a small allreduce_async, then a 4 MiB one (held: the last rank computes
    AWAY_S s before it enters the library). Rank 0's done-callback of the small one calls
    ``how``: recv (rank 1 sent before), a recv_async's result (the same), or three 1.2 MB sends
    into rank 1's 1 MiB window (rank 1 receives them: the later ones wait for its credit). None
    needs anything of the away rank: each returns at once."""
    me, n = zc.get_rank(), zc.get_world_size()
    for step in range(1, n):  # every mailbox link made
        zc.sendrecv(me, (me + step) % n, (me - step) % n, sendtag=99)
    zc.barrier()
    small = zc.allreduce_async(me)
    big = zc.allreduce_async(np.full(ELEMENTS, me + 1.0, dtype=np.float32))
    if me == 1:
        zc.send("hello", 0, tag=5)
    took = None
    if me == 0:
        seen = []

        def callback(_):
            t0 = time.monotonic()
            if how == "recv":
                seen.append(zc.recv(1, tag=5, timeout=WAIT_S))
            elif how == "result":
                seen.append(zc.recv_async(1, tag=5).result(WAIT_S))
            else:
                for i in range(SENDS):
                    zc.send(np.full(150_000, float(i)), 1, tag=6, timeout=WAIT_S)
                seen.append(zc.recv(1, tag=5, timeout=WAIT_S))
            seen.append(time.monotonic() - t0)

        small.add_done_callback(callback)
        small.result(WAIT_S)
        took = seen
    if me == 1 and how == "send":
        for i in range(SENDS):
            assert float(zc.recv(0, tag=6, timeout=WAIT_S)[0]) == i
    if me == n - 1:
        time.sleep(AWAY_S)  # computing, away from the library
    return took, float(big.result(WAIT_S + AWAY_S)[0])


@pytest.mark.parametrize("env", PLANES)
@pytest.mark.parametrize("how", ["recv", "result", "send"])
def test_a_wait_in_a_done_callback_is_not_held_by_a_pending_data_move(env, how):
    """attack1 2: the callback's wait took AWAY_S (3 s): held until the data move completed."""
    n = 3
    outs = run_replicas(_callback_waits, n, how, env={**env, **WINDOW}, timeout=RUN_S)
    got, took = outs[0][0]
    assert got == "hello", outs
    assert took < QUICK_S, f"rank 0's {how} in the callback took {took:.2f} s (expected at once)"
    assert [o[1] for o in outs] == [6.0] * n, outs


# -- 4. (a limit, documented) crossed waits on two groups time out, saying what they waited for --

CROSSED_S = 3.0


def _crossed_groups():
    """Two groups of the same ranks (the default one and its dup()), each with a 4 MiB
    allreduce_async pending (through shared memory), waited in crossed order."""
    me = zc.get_rank()
    other = zc.dup()
    zc.barrier()
    other.barrier()
    a = zc.allreduce_async(np.full(ELEMENTS, me + 1.0, dtype=np.float32))
    b = other.allreduce_async(np.full(ELEMENTS, 10 * (me + 1.0), dtype=np.float32))
    first = b if me == 0 else a
    try:
        first.result(CROSSED_S)
        said = None
    except zc.CollectiveTimeoutError as exc:
        said = str(exc)
    for future in (a, b):
        future.exception(2 * WAIT_S)  # (each ends: completed, or failed alike)
    other.teardown(timeout=WAIT_S)
    return said


@pytest.mark.skipif(not _shared.available(), reason="no POSIX shared memory here")
def test_crossed_waits_on_two_groups_time_out_naming_the_rank_the_call_and_its_seq():
    """The progress rule is per group (docs/protocol.md, Progress): not a fix, a bounded limit."""
    outs = run_replicas(_crossed_groups, 2, env={"ZCOLLECTIVE_TIMEOUT": str(WAIT_S)}, timeout=RUN_S)
    for rank, said in enumerate(outs):
        if said is None:  # (the other rank's timeout freed this one's data move)
            continue
        assert f"on rank {rank}" in said and "allreduce" in said and "seq " in said, outs
        assert "shared-memory allreduce" in said, outs
    assert any(said is not None for said in outs), outs
