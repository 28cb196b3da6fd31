"""An interior rank of the tree whose child is killed shrinks with the others, at once: its closing
waited for nothing it could deliver (a mailbox linger kept it ~12 s, past the survivors' forming
bound, and they went on without it: LeftOutError on a live rank). Real processes, ZCOLLECTIVE_TREE=on
at 6 ranks (rank 1 heads ranks 1..2). Before the fix it failed in 2 runs of 3 (the kill must land
while the relay has results queued for its child)."""

import os
import signal
import time

from conftest import touch, wait_for

import zcollective as zc
from zcollective.testing import Replicas, report

ENV = {"ZCOLLECTIVE_TREE": "on", "ZCOLLECTIVE_LIVENESS_TIMEOUT": "3"}
N, VICTIM, RUN_S = 6, 2, 120


def slow_sums(markers):
    """Every rank loops on an allreduce whose function the relay runs (a slow lambda), until the loss."""
    me = zc.get_rank()
    zc.barrier()
    touch(os.path.join(markers, f"ready{me}"))
    try:
        while True:
            zc.allreduce(me, lambda a, b: (time.sleep(0.05), a + b)[1], timeout=30)
    except zc.ReplicaLostError:
        pass
    started = time.monotonic()
    zc.shrink(timeout=30)
    return {"shrink_s": time.monotonic() - started, "lost": zc.lost_ranks(), "size": zc.get_world_size(),
            "sum": zc.allreduce(1)}


def test_a_relay_whose_child_is_killed_shrinks_with_the_others(tmp_path):
    with Replicas(slow_sums, N, str(tmp_path), env=ENV) as reps:
        for r in range(N):
            wait_for(str(tmp_path / f"ready{r}"), timeout=60)
        time.sleep(0.5)
        os.kill(reps.procs[VICTIM].pid, signal.SIGKILL)
        outs = reps.wait(RUN_S)
    for o in outs:
        if o.rank == VICTIM:
            continue
        assert o.ok, report(outs, f"rank {o.rank} failed")
        assert o.value["lost"] == [VICTIM] and o.value["size"] == N - 1, report(outs, "a live rank left out")
        assert o.value["sum"] == N - 1
