"""The progress rule (issue 44; docs/protocol.md, *Progress*): whatever a thread waits on, every
pending call of its group moves meanwhile. Real processes on loopback, a pair of features each:
a shared-memory allreduce beside point to point (defect 1), sends waiting for their receiver's
window beside an allreduce through shared memory or round the ring, a receive beside an
allreduce through the tree.

A rank's waits here sit inside another feature's step when the news comes: a rank is late (it
sleeps, out of the library), or away until the waiting ranks have done what they wait for (a
marker file), so the allreduce beside them cannot complete meanwhile. Every call is bounded by a
short timeout: a wait that starves what it does not wait for shows as a timeout, not a hang."""

import os
import time

import pytest
from conftest import touch, wait_for

import zcollective as zc
from zcollective._protocol import _tree
from zcollective.testing import run_replicas

np = pytest.importorskip("numpy")

WAIT_S = 6.0  # every call's timeout (and every future's wait): long on a loaded machine for
TIMEOUT = str(WAIT_S)  # calls that take milliseconds
AWAY_S = WAIT_S + 4.0  # an away rank waits this long for the others (then the test fails)
RUN_S = 40  # a whole test
LATE_S = 0.5  # a late rank sleeps this long: the others are inside their waits meanwhile
ELEMENTS = 1 << 20  # float32: 4 MiB, through shared memory or round the ring
SENT = 3  # messages of 1.2 MB into a 1 MiB window: the second and third wait for credit
WINDOW = {"ZCOLLECTIVE_MAIL_WINDOW_BYTES": str(1 << 20)}
SHARED = {"ZCOLLECTIVE_TIMEOUT": TIMEOUT}  # one host: large arrays go through shared memory
RING = {"ZCOLLECTIVE_TIMEOUT": TIMEOUT, "ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": "off",
        "ZCOLLECTIVE_DATA_PLANE": "on"}  # large arrays round the ring between the ranks
TREE = {"ZCOLLECTIVE_TIMEOUT": TIMEOUT, "ZCOLLECTIVE_TREE": "on"}  # small calls climb the tree


def _links():
    """Every mailbox link made (a message sent later leaves at once), then a barrier."""
    me, n = zc.get_rank(), zc.get_world_size()
    for step in range(1, n):
        zc.sendrecv(me, (me + step) % n, (me - step) % n, sendtag=99)
    zc.barrier()


def _big(me):
    return zc.allreduce_async(np.full(ELEMENTS, me + 1.0, dtype=np.float32))


def _whole(future):
    total = future.result(WAIT_S)
    return float(total.min()), float(total.max())


def _shared_beside_point_to_point(blocking):
    """Defect 1: each rank makes a 4 MiB allreduce (shared memory), then sends to the next rank
    and receives from the one before. The last rank is late: its message reaches rank 0 while
    rank 0's wait moves the allreduce, at a sync, waiting for the late rank."""
    me, n = zc.get_rank(), zc.get_world_size()
    _links()
    future = _big(me)
    if me == n - 1:
        time.sleep(LATE_S)
    if blocking:
        got = zc.sendrecv(("from", me), (me + 1) % n, (me - 1) % n, sendtag=1, recvtag=1)
    else:
        sent = zc.send_async(("from", me), (me + 1) % n, tag=1)
        got = zc.recv_async((me - 1) % n, tag=1).result(WAIT_S)
        sent.result(WAIT_S)
    return got, _whole(future)


@pytest.mark.parametrize("blocking", [False, True], ids=["send_async-recv_async", "sendrecv"])
def test_a_shared_memory_allreduce_and_point_to_point_both_complete(blocking):
    n = 3
    outs = run_replicas(_shared_beside_point_to_point, n, blocking, env=SHARED, timeout=RUN_S)
    whole = n * (n + 1) / 2
    assert outs == [(("from", (r - 1) % n), (whole, whole)) for r in range(n)]


def _sends_beside_a_stuck_allreduce(sender, receiver, markers):
    """``sender`` sends ``receiver`` :data:`SENT` messages, each but the first waiting for
    credit, while a 4 MiB allreduce is pending that cannot complete: rank 2 is away (out of the
    library) until the receiver has them all. Every wait of the two moves the allreduce, which
    waits for rank 2 (at a sync in shared memory; for chunks round the ring)."""
    me = zc.get_rank()
    _links()
    future = _big(me)
    got = None
    if me == sender:
        for i in range(SENT):
            zc.send(np.full(150_000, float(i)), receiver, tag=2)
    elif me == receiver:
        got = [float(zc.recv(sender, tag=2)[0]) for _ in range(SENT)]
        touch(os.path.join(markers, "received"))
    else:
        wait_for(os.path.join(markers, "received"), timeout=AWAY_S)
    return got, _whole(future)


@pytest.mark.parametrize("plane", ["shared", "ring"])
@pytest.mark.parametrize("sender, receiver", [(0, 1), (1, 0)], ids=["0 to 1", "1 to 0"])
def test_sends_waiting_for_credit_go_while_an_allreduce_waits_for_a_rank_away(plane, sender, receiver,
                                                                               tmp_path):
    n = 3
    env = {**(SHARED if plane == "shared" else RING), **WINDOW}
    outs = run_replicas(_sends_beside_a_stuck_allreduce, n, sender, receiver, str(tmp_path), env=env,
                        timeout=RUN_S)
    whole = n * (n + 1) / 2
    assert [got for got, _ in outs] == [[0.0, 1.0, 2.0] if r == receiver else None for r in range(n)]
    assert [total for _, total in outs] == [(whole, whole)] * n


def _recv_beside_tree(interior, child, away, markers):
    """An interior rank of the tree receives from its child, which sends the result of an
    allreduce pending through the tree: that result comes only if the interior rank's wait in
    ``recv`` passes its child's part up and the result down. With ``away``: a 64 KiB allreduce
    through shared memory is pending too, which cannot complete while rank ``away`` is away."""
    me = zc.get_rank()
    _links()
    stuck = zc.allreduce_async(np.ones(1 << 14, dtype=np.float32)) if away is not None else None
    future = zc.allreduce_async(me + 1)
    got = None
    if me == interior:
        got = zc.recv(child, tag=3)
        touch(os.path.join(markers, "received"))
    elif me == child:
        time.sleep(LATE_S)  # (the interior rank waits in recv meanwhile)
        zc.send(("total", future.result(WAIT_S)), interior, tag=3)
    elif me == away:
        wait_for(os.path.join(markers, "received"), timeout=AWAY_S)
    return got, future.result(WAIT_S), stuck and float(stuck.result(WAIT_S)[0])


@pytest.mark.parametrize("stuck", [False, True], ids=["alone", "beside a shared allreduce stuck"])
def test_a_recv_beside_a_tree_allreduce_completes(stuck, tmp_path):
    n = 6
    shape = _tree.shape(n)
    interior = next(r for r in range(1, n) if shape.children[r])
    child = shape.children[interior][0]
    away = next(r for r in range(1, n) if r not in (interior, child)) if stuck else None
    outs = run_replicas(_recv_beside_tree, n, interior, child, away, str(tmp_path), env=TREE, timeout=RUN_S)
    whole = n * (n + 1) // 2
    assert outs[interior][0] == ("total", whole)
    assert [total for _, total, _ in outs] == [whole] * n
    assert [shared for _, _, shared in outs] == [float(n) if stuck else None] * n
