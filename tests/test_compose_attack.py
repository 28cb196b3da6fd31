"""The progress rule attacked (attack1's reproducers; docs/protocol.md, *Progress*): teardown
with a large allreduce_async pending (barrier first, results read after), a wait nested in a
done-callback beside a data move held by a rank away from the library, and a single large send
after a small message already received. Real processes on loopback; every wait is bounded by a
short timeout, so a starved wait shows as a timeout or a slow measured wait, not a hang."""

import os
import time

import pytest
from conftest import touch, wait_for

import zcollective as zc
from zcollective._io import _shared
from zcollective.testing import run_replicas

np = pytest.importorskip("numpy")

WAIT_S = 8.0  # every call's timeout: long on a loaded machine for calls that take milliseconds
RUN_S = 40  # a whole test
AWAY_MAX_S = 20.0  # a rank computes, away from the library, until rank 0's callback is done: at most this
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


def _callback_waits(how, markers):
    """Every rank: a small allreduce_async, then a 4 MiB one (held: the last rank computes
    until rank 0's callback is done, at most AWAY_MAX_S s, before it enters the library: a wait
    held by the data move lasts its timeout). Rank 0's done-callback of the small one calls
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
            touch(os.path.join(markers, "called back"))

        small.add_done_callback(callback)
        small.result(WAIT_S)
        took = seen
    if me == 1 and how == "send":
        for i in range(SENDS):
            assert float(zc.recv(0, tag=6, timeout=WAIT_S)[0]) == i
    if me == n - 1:
        wait_for(os.path.join(markers, "called back"), timeout=AWAY_MAX_S)  # computing, away from the library
    return took, float(big.result(WAIT_S + AWAY_MAX_S)[0])


@pytest.mark.parametrize("env", PLANES)
@pytest.mark.parametrize("how", ["recv", "result", "send"])
def test_a_wait_in_a_done_callback_is_not_held_by_a_pending_data_move(tmp_path, env, how):
    """attack1 2: the callback's wait took as long as the last rank was away (3 s): held until
    the data move completed."""
    n = 3
    outs = run_replicas(_callback_waits, n, how, str(tmp_path), env={**env, **WINDOW}, timeout=RUN_S)
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


# -- attack2: an interrupt at an ending is not a loss ---------------------------------------


def _teardown_interrupted_once():
    """Every rank: a 4 MiB allreduce_async; rank 1 calls teardown and gets one SIGINT 0.3 s
    later, catches it and calls teardown again; the others call teardown 1 s later."""
    import os
    import signal
    import threading

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    zc.initialize(timeout=RUN_S)
    me = zc.get_rank()
    zc.barrier(timeout=WAIT_S)
    big = zc.allreduce_async(np.full(ELEMENTS, me + 1.0, dtype=np.float32))
    log = []
    if me == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        for _ in range(3):
            try:
                zc.teardown(timeout=WAIT_S)
                log.append("ok")
                break
            except KeyboardInterrupt:
                log.append("interrupted")
                try:  # (it takes in nothing new: a receive would wait for nothing)
                    zc.recv(0, tag=5, timeout=1)
                except zc.CollectiveError as exc:
                    log.append(type(exc) is zc.CollectiveError and "teardown was interrupted" in str(exc))
    else:
        time.sleep(1.0)
        zc.teardown(timeout=WAIT_S)
        log.append("ok")
    return log, float(big.result(0.5)[0])


@pytest.mark.parametrize("env", PLANES)
def test_a_teardown_interrupted_once_is_called_again_and_nobody_is_lost(env):
    """attack2: one Ctrl-C in teardown closed the group without a word (the others saw rank 1
    'lost', the pending allreduce failed everywhere, the second teardown raised 'not
    initialized'). An interrupted teardown leaves the group open: called again, it finishes."""
    outs = run_replicas(_teardown_interrupted_once, 3, initialize=False, timeout=RUN_S, env=env)
    assert outs == [(["ok"], 6.0), (["interrupted", True, "ok"], 6.0), (["ok"], 6.0)], outs


def _raising_sigterm_handler_at_exit():
    """Rank 1 installs (after initialize) a SIGTERM handler raising RuntimeError, sends rank 2
    two messages (the second waits for credit: rank 2 is away) and its program ends; SIGTERM
    comes in the exit path. Rank 2 receives what came, then learns rank 1 ended."""
    import os
    import signal
    import threading

    zc.initialize(timeout=RUN_S)
    me = zc.get_rank()
    zc.barrier(timeout=WAIT_S)
    if me == 1:
        def handler(signum, frame):
            raise RuntimeError("SIGTERM")
        signal.signal(signal.SIGTERM, handler)
        zc.send_async(np.full(110_000, 0.0), 2, tag=1)
        zc.send_async(np.full(110_000, 1.0), 2, tag=1)
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()
        return "ended"
    if me == 0:  # (rank 0's program hosts the group: it ends once rank 2 has received)
        return zc.recv(2, tag=2, timeout=2 * WAIT_S)
    time.sleep(2.5)
    got = []
    for _ in range(2):
        try:
            got.append(float(zc.recv(1, tag=1, timeout=WAIT_S)[0]))
        except zc.CollectiveError as exc:
            got.append(type(exc).__name__)
            break
    zc.send("received", 0, tag=2)
    return got


def test_a_signal_handlers_exception_at_exit_still_says_goodbye():
    """attack2: a SIGTERM handler raising an ordinary exception in the exit path made the exit
    skip its goodbye (taken for a failed group): rank 2's first recv raised ReplicaLostError
    'rank 1 was lost' instead of returning the message that had gone."""
    outs = run_replicas(_raising_sigterm_handler_at_exit, 3, initialize=False, timeout=RUN_S,
                        env={**SHARED, **WINDOW})
    got = outs[2]
    assert got[0] == 0.0 and got[1] in (1.0, "PeerEndedError"), outs


# -- attack3: a rank joining a sub-group hears of its parent's loss -------------------------


def _split_with_a_rank_killed_after_the_third_round():
    """4 ranks split(rank % 2); world rank 1 (to host the group {1, 3}) kills itself once the
    third round is made, before joining; then the parent's next call fails, and every survivor
    shrinks."""
    import os
    import signal

    from zcollective import _subgroups

    me = zc.get_rank()
    if me == 1:
        made = _subgroups._Rounds.opened

        def opened(self, why):
            made(self, why)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1)
        _subgroups._Rounds.opened = opened
    zc.allreduce(1, timeout=WAIT_S)
    start = time.monotonic()
    try:
        zc.split(me % 2).teardown()
    except zc.ReplicaLostError:
        pass
    took = time.monotonic() - start
    with pytest.raises(zc.ReplicaLostError):
        zc.allreduce(me + 1, timeout=WAIT_S)
    zc.shrink(timeout=WAIT_S)
    return took, zc.get_world_size(), zc.allreduce(me + 1, timeout=WAIT_S), zc.lost_ranks()


def test_a_rank_joining_a_sub_group_hears_of_its_parents_loss_and_shrinks_with_the_others():
    """attack3: rank 3, waiting to join the sub-group whose host (world rank 1) was killed,
    waited out its join bound (6 s) while ranks 0 and 2 shrank without it (lost_ranks [1, 3]),
    then got LeftOutError. Its join now stops at its parent's failure, within a liveness bound."""
    from zcollective.testing import Replicas

    with Replicas(_split_with_a_rank_killed_after_the_third_round, 4,
                  env={**SHARED, "ZCOLLECTIVE_LIVENESS_TIMEOUT": "2"}) as reps:
        outs = reps.wait(RUN_S)
    survivors = [o for o in outs if o.rank != 1]
    assert all(o.ok for o in survivors), [o.describe() for o in outs]
    for o in survivors:
        took, size, total, lost = o.value
        assert (size, total, lost) == (3, 8, [1]) and took < 4.0, [o.value for o in survivors]
