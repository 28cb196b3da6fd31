"""Through the tree, a reduction an interior rank asks its driver for keeps its place in line: what
its subtree sends after it goes up after it (real processes, ZCOLLECTIVE_TREE=on at 9 ranks, whose
interior ranks are 1, 3, 5 and 7). A reviewer found the next call's part sent up first, dropped by
rank 0 as out of order, and both calls waiting out their timeout."""

import pytest

import zcollective as zc
from zcollective.testing import Replicas, report

TREE = {"ZCOLLECTIVE_TREE": "on"}
N = 9
RUN_S = 120


def reduced_then_another(second):
    """An allreduce the relays reduce on the way, then at once a call they pass on as it came."""
    me = zc.get_rank()
    zc.barrier()
    first = zc.allreduce_async(me + 1)  # (the default function: reduced at the relays)
    if second == "barrier":
        then = zc.barrier_async()
    elif second == "allgather":
        then = zc.allgather_async(me)
    else:  # a blocking call behind the future
        then = None
        blocked = zc.broadcast(me, root=0)
    out = [first.result(timeout=20), then.result(timeout=20) if then is not None else blocked]
    out.append(zc.allreduce(me + 1))  # and the group goes on
    return out


@pytest.mark.parametrize("second", ["barrier", "allgather", "blocking broadcast"])
def test_a_call_right_after_one_reduced_on_the_way_goes_up_behind_it(second):
    with Replicas(reduced_then_another, N, second, env=TREE) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    total = N * (N + 1) // 2
    then = {"barrier": None, "allgather": list(range(N)), "blocking broadcast": 0}[second]
    assert all(o.value == [total, then, total] for o in outs), report(outs, "wrong values")
