"""Shared memory on one host (issue 36): large arrays between the ranks of a
host through a segment they all map, synced by the coordinator.

The schedules and the coordinator's part first, without sockets (a host's
jobs run in one process, over a numpy array standing for the segment); then
real processes on loopback: results, faults, endings, forks and shrinks,
and that no segment outlives a group however its processes end."""

import functools
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import raising_on, touch, wait_for
from test_coordinator import SESSION, feed, join_msg, peer

import zcollective as zc
from zcollective._format import _bodies
from zcollective._format._wire import FLAG_DATA, Kind, Message, control, encode
from zcollective._io import _shared
from zcollective._io._reducing import reducer
from zcollective._protocol import _shm
from zcollective._protocol._coordinator import Coordinator, Phase
from zcollective._protocol._ops import Op
from zcollective.testing import Replicas, report, run_replicas

LIVENESS = "2"
BOUND = float(LIVENESS) + 4.0  # detection bound plus slack for a loaded 2-core machine
SLICED = (_shm.SYMMETRIC_MAX_BYTES // 4) + 1001  # float32 elements: with 2 ranks or more on the
# host, each rank reduces a slice
PREFIX = "zcollective-"  # what the group's segments are called in /dev/shm


# -- the schedules, without processes ------------------------------------------------


def test_a_call_syncs_only_where_some_rank_may_still_read_what_another_writes():
    place, grown = _shm.Place(0, 1 << 16, 1, False), _shm.Place(1, 1 << 20, 2, True)
    tail = [_shm.REDUCE]
    assert _shm.schedule(place, _shm.HostPlan(staged=True, free=True), True, False, tail) == tail
    assert _shm.schedule(place, _shm.HostPlan(False, True), True, False, tail) == ["sync", "reduce"]
    assert _shm.schedule(place, _shm.HostPlan(False, True), False, False, tail) == ["stage", "sync", "reduce"]
    assert _shm.schedule(place, _shm.HostPlan(False, False), False, True, tail) == [
        "sync", "stage", "sync", "reduce"]  # nobody knows the set free: a sync before any write
    assert _shm.schedule(grown, _shm.HostPlan(True, True), True, True, tail) == [
        "sync", "create", "sync", "stage", "sync", "unlink", "reduce"]
    assert _shm.schedule(grown, _shm.HostPlan(True, True), True, False, tail) == [
        "sync", "sync", "attach", "stage", "sync", "unlink", "reduce"]


def run_host(jobs, segment, seed):
    """Run a host's jobs in one process: each goes as far as it can, the ranks
    in a random order each time, until all wait at the same sync, which then
    passes for all. A race (a rank reading what another writes between the
    same two syncs) shows as a result that depends on the order."""
    rng = random.Random(seed)
    while any(job.step is not None for job in jobs):
        for job in rng.sample(jobs, len(jobs)):
            while job.step not in (None, _shm.SYNC):
                if job.step not in (_shm.CREATE, _shm.ATTACH, _shm.UNLINK):
                    job.memory(job.step, segment[job.place.set])
                job.advance()
        waiting = [job for job in jobs if job.step == _shm.SYNC]
        assert len(waiting) in (0, len(jobs)) and len({job.syncs for job in waiting}) <= 1
        for job in waiting:
            job.asked = True
            assert job.synced(job.syncs)
    return [job.result() for job in jobs]


@pytest.mark.parametrize("elements", [10007, SLICED], ids=["whole", "sliced"])
@pytest.mark.parametrize("fn", ["add", "maximum", "multiply"])
def test_every_rank_of_a_host_gets_the_stars_bits_whatever_the_order_of_its_steps(elements, fn):
    size = 3
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(elements).astype(np.float32) for _ in range(size)]
    star = functools.reduce(getattr(np, fn), inputs)  # rank order, left to right
    capacity = _shm.aligned(inputs[0].nbytes)
    segment = np.zeros((2, size, capacity), dtype=np.uint8)
    place = _shm.Place(1, capacity, 1, False)
    for staged, free, seed in ((True, True, 1), (False, True, 2), (False, False, 3)):
        whole = _shm.symmetric(inputs[0].nbytes, size, True)
        jobs = [_shm.SharedAllreduce(5, r, size, inputs[r], reducer(fn, None), place,
                                     _shm.HostPlan(staged, free), staged, r == 0, whole) for r in range(size)]
        if staged:  # written when the call was made
            for r in range(size):
                _shm.stage(segment[1, r], inputs[r], r, size, whole)
        for got in run_host(jobs, segment, seed):
            assert got.tobytes() == star.tobytes(), (staged, free)
        segment[...] = 0xFF  # (the next round's stale bytes must not show)


def test_a_rank_knows_its_set_free_only_once_the_last_call_planned_completed_there():
    from collections import deque
    from types import SimpleNamespace

    member = SimpleNamespace(rank=1, calls={}, transfers=deque())
    plane = _shared.SharedPlane(member, 5, 0, [0, 1, 2], 1 << 30)
    assert plane.knows_free()  # (nothing placed yet)
    first = plane.place(1000)
    member.transfers.append((0, SimpleNamespace(place=first)))  # its job, queued as the member does
    second = plane.place(1000)
    assert (first.set, second.set, first.grow, second.grow) == (0, 1, True, False)
    assert not plane.knows_free()  # a call in flight: nothing is known
    member.transfers.clear()
    plane.completed = first.index + 1  # the first completed, the second was dropped (an ERROR):
    assert not plane.knows_free()  # another rank may still read the first's set
    plane.completed = second.index + 1
    assert plane.knows_free() and plane.free_slot(1000) is None  # (no segment mapped here)


def test_a_call_that_was_to_make_the_segment_gone_unfinished_makes_the_next_make_it_anew():
    """The call placed to make a new segment was dropped (failed, or given up: alike on every
    rank) before it completed: the next placement makes a new generation, whatever its size."""
    from collections import deque
    from types import SimpleNamespace

    member = SimpleNamespace(rank=1, calls={}, transfers=deque())
    plane = _shared.SharedPlane(member, 5, 0, [0, 1, 2], 1 << 30)
    first = plane.place(1000)
    member.transfers.append((0, SimpleNamespace(place=first)))
    kept = plane.place(500)  # placed while the first is still queued: the same segment
    member.transfers.clear()  # both dropped unfinished (an ERROR)
    anew = plane.place(500)
    assert (first.grow, kept.grow, anew.grow) == (True, False, True)
    assert anew.gen == first.gen + 1 and plane.linked == {_shared.segment_name(5, 0, anew.gen)}


# -- the coordinator's part, without sockets -------------------------------------------


def _join(rank, n, host="h", room=1 << 30, least=65536):
    msg = join_msg(rank, n)
    body = json.loads(msg.segments[0][0])
    body["host"] = host
    if room is not None:
        body["shm"] = {"min": least, "room": room}
    return control(Kind.JOIN, body, rank=rank)


def _welcomed(n, addresses, hosts=None, rooms=None):
    """A coordinator every rank joined, rank r from ``addresses[r]``; the WELCOMEs' shm."""
    coord = Coordinator(n, SESSION, 1000, host_address="10.0.0.1")
    out = []
    for r in range(n):
        join = _join(r, n, (hosts or ["h"] * n)[r], (rooms or [1 << 30] * n)[r])
        out = list(coord.receive(peer(r), encode(join), address=addresses[r]))
    assert coord.phase is Phase.RUNNING
    return coord, [json.loads(m.segments[0][0]).get("shm") for _, m in out]


def test_the_welcome_puts_ranks_on_one_host_by_address_and_host_name():
    # ranks 1 and 2 reach rank 0 over loopback and at its master address: its host
    _, bodies = _welcomed(3, ["?", "127.0.0.1", "10.0.0.1"], rooms=[1000, 1 << 30, 600])
    assert bodies[0] == {"min": 65536, "hosts": [0, 0, 0], "room": [300]}
    _, bodies = _welcomed(3, ["?", "127.0.0.1", "10.0.0.1"], rooms=[1000, None, 600])
    assert bodies[0] is None  # one rank offers none: its host keeps the star
    # rank 2 has rank 0's address but another host name (two machines behind one address); a
    # group on two hosts (ranks 2 and 3) keeps the data plane between and within them
    for addresses, names in ((["?", "127.0.0.1", "10.0.0.1"], ["a", "a", "z"]),
                             (["?", "127.0.0.1", "10.0.0.7", "10.0.0.7"], ["a", "a", "b", "b"])):
        assert _welcomed(len(names), addresses, names)[1][0] is None


def _shared_contrib(rank, seq, staged=True, free=True, shape=(1000,)):
    description = _bodies.plan(dtype="<f4", shape=list(shape), fn="add", shm=True)
    return Message(Kind.CONTRIB, Op.ALLREDUCE, rank, 0, seq, SESSION, "t.py:3", FLAG_DATA, None,
                   [[description, _bodies.shared_status(staged, free)]])


def _sync(rank, seq, phase):
    return Message(Kind.SYNC, Op.ALLREDUCE, rank, phase, seq, SESSION)


def test_a_hosts_syncs_are_answered_once_all_its_ranks_came_and_a_call_given_up_forgets_them():
    coord, _ = _welcomed(3, ["?", "127.0.0.1", "127.0.0.1"])
    out = []
    for r, staged in enumerate((True, False, True)):
        out = feed(coord, peer(r), _shared_contrib(r, 0, staged=staged, free=r != 1))
    plans = {p: m for p, m in out}
    assert len(plans) == 3 and all(m.flags & FLAG_DATA for m in plans.values())
    assert _bodies.parse_shared_call(plans[peer(2)], 0) == (False, True)  # rank 1 did not stage
    for r in range(3):
        feed(coord, peer(r), _shared_contrib(r, 1, staged=False, free=False))
    assert feed(coord, peer(0), _sync(0, 0, 0)) == []
    assert feed(coord, peer(2), _sync(2, 1, 0)) == []  # another call's: its own count
    out = feed(coord, peer(1), _sync(1, 0, 0))
    assert out == [] and feed(coord, peer(1), _sync(1, 0, 0)) == []  # (twice is once)
    out = feed(coord, peer(2), _sync(2, 0, 0))
    assert [(p, m.kind, m.seq, m.root) for p, m in out] == [(peer(r), Kind.SYNC, 0, 0) for r in range(3)]
    assert feed(coord, peer(0), _sync(0, 9, 0)) == []  # no such call: dropped
    abandon = _bodies.abandon("its call timed out", True, rank=1, seq=1, session=SESSION)
    out = feed(coord, peer(1), abandon)
    assert {m.kind for _, m in out} == {Kind.ERROR} and len(out) == 3
    said = json.loads(out[0][1].segments[0][0])["message"]
    assert "gave it up" in said and "while its data moved through shared memory" in said, said
    assert feed(coord, peer(0), _sync(0, 1, 0)) == []  # forgotten: nobody waits for it now
    assert feed(coord, peer(1), _sync(1, 1, 0)) == [] and coord.phase is Phase.RUNNING


def test_shared_descriptions_that_differ_are_a_mismatch_named_as_on_the_data_plane():
    coord, _ = _welcomed(2, ["?", "127.0.0.1"])
    feed(coord, peer(0), _shared_contrib(0, 0))
    out = feed(coord, peer(1), _shared_contrib(1, 0, shape=(999,)))
    body = json.loads(out[0][1].segments[0][0])
    assert body["error"] == "CallMismatchError"
    assert body["message"] == ("seq 0 allreduce: the ranks disagree: rank 0 passed a <f4 array of shape "
                               "(1000,) reduced with add at t.py:3; rank 1 passed a <f4 array of shape "
                               "(999,) reduced with add at t.py:3 (this call failed; the group goes on)")


def test_a_segment_is_the_users_alone_and_its_name_goes_at_the_unlink():
    if not _shared.available():
        pytest.skip("no POSIX shared memory here")
    name = _shared.segment_name(int.from_bytes(os.urandom(8), "little"), 0, 1)
    made = _shared.Segment(name, 1, 1 << 16, 2, create=True)
    try:
        path = "/dev/shm" + name
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert st.st_size == 2 * 2 * (1 << 16)
        seen = _shared.Segment(name, 1, 1 << 16, 2, create=False)
        made.slots[1, 1, :3] = [1, 2, 3]
        assert seen.slots[1, 1, :3].tolist() == [1, 2, 3]
        with pytest.raises(PermissionError):  # another size: not this group's
            _shared.Segment(name, 1, 1 << 17, 2, create=False)
        _shared.unlink(name)
        assert not os.path.exists(path)
        assert seen.slots[1, 1, :3].tolist() == [1, 2, 3]  # mapped, the memory stays
        seen.close()
    finally:
        made.close()
        _shared.unlink(name)


# -- real processes ---------------------------------------------------------------------


def segments(session=None):
    """This group's segments in /dev/shm (its names are hashes: those of its first hosts and
    generations; every group's: ``session`` None)."""
    here = sorted(f for f in os.listdir("/dev/shm") if f.startswith(PREFIX))
    if session is None:
        return here
    names = {_shared.segment_name(session, host, gen).lstrip("/") for host in range(4) for gen in range(64)}
    return [f for f in here if f in names]


def _session():
    return zc._current()._life.member.session


def arrays_through_shared_memory():
    r = zc.get_rank()
    assert zc._current()._life.shared is not None, "no shared memory on one host"
    out = {}
    for dtype in (np.float32, np.float64, np.int64, np.uint8, np.complex64, np.bool_):
        a = (np.arange(70001) % 7 * (r + 1)).astype(dtype)
        keep = a.copy()
        res = zc.allreduce(a)
        assert (a == keep).all(), "the input was changed"
        out[np.dtype(dtype).name] = res.tobytes()
    rng = np.random.default_rng(r)
    big = rng.standard_normal(SLICED).astype(np.float32)  # each rank reduces a slice
    out["sliced"] = zc.allreduce(big).tobytes()
    out["max"] = zc.allreduce(np.arange(50000.0) * (r + 1), np.maximum)[-1]

    @zc.elementwise
    def biggest_magnitude(a, b):
        return np.where(np.abs(a) >= np.abs(b), a, b)

    out["marked"] = zc.allreduce(np.full(50000, (-1.0) ** r * (r + 1)), biggest_magnitude)[0]
    out["shape"] = zc.allreduce(np.full((3, 50, 400), r, dtype=np.float32))[2, 49, 399]
    # in flight together (the later ones sync before they write), a star call between them
    futures = [zc.allreduce_async(np.full(30000 + 70000 * (k % 2), float(k + r))) for k in range(5)]
    futures.insert(2, zc.allreduce_async(r))
    out["async"] = [float(np.asarray(f.result()).flat[-1]) for f in reversed(futures)]
    out["small"] = zc.allreduce(np.ones(10)).tolist()  # below the threshold: the star
    value = {"w": np.arange(100000.0), "name": "weights"} if r == 1 else None
    got = zc.broadcast(value, root=1)  # the root writes, the others read
    assert got is value if r == 1 else got["w"].flags.writeable and got["w"].base is not None
    out["bcast"] = (got["name"], float(got["w"].sum()))
    mine = np.full(20000 * r, r) if r != 1 else {"small": r}  # rank 1's comes with the plan
    gathered = zc.allgather(mine)
    assert gathered[r] is mine  # this rank's own object, as always
    out["gather"] = [(type(g).__name__, len(g), int(np.sum(g["small"] if isinstance(g, dict) else g)))
                     for g in gathered]
    futures = [zc.broadcast_async(np.full(30000, float(k)) if r == 0 else None) for k in range(3)]
    out["bcast async"] = [float(f.result()[-1]) for f in futures[::-1]]
    got = zc.gather(mine, root=2)
    out["gather to 2"] = None if got is None else [type(g).__name__ for g in got]
    out["scatter"] = zc.scatter([np.full(9000 * k, k) for k in range(3)] if r == 1 else None, root=1).sum()
    parts = [np.full(5000 * (r + 1) + k, 10 * r + k) for k in range(3)] if r != 0 else [0, 1, 2]
    out["alltoall"] = [(int(v[-1]), len(v)) if isinstance(v, np.ndarray) else v for v in zc.alltoall(parts)]
    out["sent"] = zc.stats()["ops"]["allreduce"]["bytes_sent"] + zc.stats()["ops"]["broadcast"]["bytes_sent"]
    out["left"] = segments(_session())  # every name unlinked once all had attached
    return out


def test_arrays_go_through_shared_memory_with_the_stars_bits_and_leave_no_segment():
    n = 3
    outs = run_replicas(arrays_through_shared_memory, n, timeout=120)
    for key in outs[0]:
        if key not in ("sent", "gather to 2", "scatter", "alltoall"):
            assert all(o[key] == outs[0][key] for o in outs), key  # the same bits on every rank
    inputs = [(np.arange(70001) % 7 * (r + 1)).astype(np.float32) for r in range(n)]
    assert outs[0]["float32"] == functools.reduce(np.add, inputs).tobytes()
    big = [np.random.default_rng(r).standard_normal(SLICED).astype(np.float32) for r in range(n)]
    assert outs[0]["sliced"] == functools.reduce(np.add, big).tobytes()  # rank order, as the star
    assert outs[0]["max"] == 49999.0 * n
    assert outs[0]["marked"] == 3.0  # rank 2's +3 has the largest magnitude
    assert outs[0]["shape"] == 3.0
    assert outs[0]["async"] == [15.0, 12.0, 9.0, 3.0, 6.0, 3.0]  # (each k: 3k + 3; the star's: 3)
    assert outs[0]["small"] == [3.0] * 10
    assert outs[0]["bcast"] == ("weights", 4999950000.0)
    assert outs[0]["gather"] == [("ndarray", 0, 0), ("dict", 1, 1), ("ndarray", 40000, 80000)]
    assert outs[0]["bcast async"] == [2.0, 1.0, 0.0]
    assert [o["gather to 2"] for o in outs] == [None, None, ["ndarray", "dict", "ndarray"]]
    assert [o["scatter"] for o in outs] == [0, 9000, 36000]
    assert [o["alltoall"] for o in outs] == [[r, (10 + r, 10000 + r), (20 + r, 15000 + r)] for r in range(3)]
    assert outs[0]["left"] == []
    assert all(o["sent"] < 30000 for o in outs), [o["sent"] for o in outs]  # descriptions, not arrays


def slow_on(rank, seconds):
    """A sum that takes ``seconds`` on ``rank`` (the others wait for it at a sync)."""
    me = zc.get_rank()

    @zc.elementwise
    def add(a, b):
        if me == rank:
            time.sleep(seconds)
        a += b
        return a
    return add


def calls_that_fail_alike():
    """Each call fails on every rank with the same error; the group goes on."""
    r = zc.get_rank()
    said = []

    def attempt(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
            said.append("no error")
        except (zc.CollectiveError, KeyboardInterrupt) as exc:
            said.append(f"{type(exc).__name__}: {exc}")

    attempt(zc.allreduce, np.ones(20000 + (r == 2), dtype=np.float32))  # shapes disagree

    attempt(zc.allreduce, np.ones(30000), raising_on(1, ArithmeticError, "rank 1 refuses"))
    attempt(zc.allreduce, np.ones(30000), slow_on(2, 1.2), timeout=0.4 if r < 2 else None)
    if r == 1:  # Ctrl-C while it waits for rank 2 at a sync
        signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
        signal.setitimer(signal.ITIMER_REAL, 0.4)
    attempt(zc.allreduce, np.ones(30000), slow_on(2, 1.2))
    said.append(float(zc.allreduce(np.full(SLICED, 1.0, dtype=np.float32))[-1]))
    return said


def test_a_mismatch_a_raising_function_a_timeout_and_ctrl_c_fail_the_call_alike_on_every_rank():
    outs = run_replicas(calls_that_fail_alike, 3, timeout=90)
    mismatch, raised, timed_out, interrupted, after = zip(*outs, strict=True)
    assert len(set(mismatch)) == 1 and mismatch[0].startswith(
        "CallMismatchError: seq 0 allreduce: the ranks disagree: ranks 0,1 passed a <f4 array of shape "
        "(20000,) reduced with add at test_shared.py:"), mismatch
    assert "rank 2 passed a <f4 array of shape (20001,)" in mismatch[0]
    assert len(set(raised)) == 1 and raised[0] == (
        "PeerError: seq 1 allreduce: the reduce function raised on rank 1 (through shared memory): "
        "ArithmeticError: rank 1 refuses"), raised
    assert all(t.startswith("CollectiveTimeoutError: ") for t in timed_out), timed_out
    assert "gave it up (its call timed out" in timed_out[2], timed_out
    assert interrupted[1] == "KeyboardInterrupt: ", interrupted
    assert all(i.startswith("PeerError: seq 3 allreduce: rank 1 (pid ") for i in interrupted[::2]), \
        interrupted
    assert "gave it up (its call was interrupted (KeyboardInterrupt))" in interrupted[0]
    assert after == (3.0, 3.0, 3.0)


def killed_mid_call(victim, when, markers):
    """Rank ``victim`` is killed (SIGKILL) in a call: while it maps the segment the leader
    made (``attaching``: its name still linked), or in a later call's reduction; the others
    are told who, then shrink and go on through the survivors' own segment."""
    from zcollective._io import _shared as shared

    r = zc.get_rank()
    if r == victim and when == "attaching":
        made = shared.Segment.__init__

        def die_attaching(self, *args, create, **kwargs):
            if not create:
                touch(os.path.join(markers, "dying"))
                os.kill(os.getpid(), signal.SIGKILL)
            made(self, *args, create=create, **kwargs)
        shared.Segment.__init__ = die_attaching
    elif when == "reducing":
        zc.allreduce(np.ones(SLICED, dtype=np.float32))  # the segment made, its name unlinked
    return lost_then_shrunk(SLICED, signal_on(victim, os.path.join(markers, "dying")), shared=True)


def lost_then_shrunk(elements, fn, shared):
    """An allreduce with ``fn``, which kills a rank: what the others were told, and how soon;
    then the survivors shrink and sum their ranks (``shared``: through shared memory)."""
    sessions = [_session()]
    start = time.monotonic()
    try:
        zc.allreduce(np.ones(elements, dtype=np.float32), fn)
        return "no error"
    except zc.ReplicaLostError as exc:
        said, took = str(exc), time.monotonic() - start
    r = zc.get_rank()
    zc.shrink()
    sessions.append(_session())
    assert (zc._current()._life.shared is not None) == shared, "the survivors' shared memory"
    got = zc.allreduce(np.full(elements, r, dtype=np.float32))[-1]
    return said, took, float(got), zc.get_world_size(), sessions


def signal_on(victim, marker):
    me = zc.get_rank()

    @zc.elementwise
    def add_then_die(a, b):
        if me == victim:
            touch(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        a += b
        return a
    return add_then_die


@pytest.mark.parametrize("when", ["attaching", "reducing"])
def test_a_rank_killed_mid_call_is_named_within_the_bound_and_no_segment_outlives_the_group(tmp_path, when):
    n, victim = 3, 1
    with Replicas(killed_mid_call, n, victim, when, str(tmp_path),
                  env={"ZCOLLECTIVE_LIVENESS_TIMEOUT": LIVENESS}) as reps:
        outs = reps.wait(90)
    assert outs[victim].returncode == -signal.SIGKILL, report(outs, "the victim did not die mid-call")
    assert os.path.exists(tmp_path / "dying")
    survivors = [o for o in outs if o.rank != victim]
    assert all(o.ok for o in survivors), report(outs, "a survivor failed")
    for o in survivors:
        said, took, got, size, sessions = o.value
        assert f"rank {victim} (pid {reps.procs[victim].pid} on " in said and " was lost " in said, \
            report(outs, said)
        assert took < BOUND, report(outs, f"rank {o.rank} took {took:.1f} s")
        assert (got, size) == (2.0, 2), report(outs, "the survivors' group")  # (ranks 0 and 2 -> 0, 1)
        for session in sessions:
            assert segments(session) == [], report(outs, f"left in /dev/shm: {segments(session)}")


ENDING = """
import os
import numpy as np, zcollective as zc
zc.initialize()
r = zc.get_rank()
big = np.full({elements}, r + 1, dtype=np.float32)  # each rank reduces a slice: syncs after the writes
f = zc.allreduce_async(big)
g = zc.allreduce_async(big * 2)  # (in flight behind f: it syncs before it writes)
if r == 0:
    print("result", float(f.result()[-1]), float(g.result()[0]), zc._current()._life.member.session)
# ranks 1 and 2 end here: no teardown, their calls' results never taken
"""


def test_ranks_that_end_without_teardown_finish_their_shared_memory_calls_first(tmp_path):
    script = tmp_path / "ending.py"
    script.write_text(ENDING.format(elements=SLICED))
    proc = subprocess.run([sys.executable, "-m", "zcollective.run", "-n", "3", str(script)],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next((x for x in proc.stdout.splitlines() if x.startswith("[0] result ")), None)
    assert line is not None, proc.stdout + proc.stderr
    assert line.split()[2:4] == ["6.0", "12.0"], proc.stdout + proc.stderr
    assert segments(int(line.split()[4])) == []


def forked_children():
    """A forked child refuses the parent's group and leaves its segment alone, however it
    ends (os._exit, or multiprocessing's finalizers); the parent's calls go on."""
    import multiprocessing

    r = zc.get_rank()
    first = zc.allreduce(np.full(40000, r + 1.0))[0]
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # (a library that let it use the group would leave it waiting for ever)
        try:
            zc.allreduce(np.ones(40000))
            code = 1
        except zc.ForkedProcessError:
            code = 0
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    child = multiprocessing.get_context("fork").Process(target=zc.get_rank)
    child.start()
    child.join(30)
    if child.exitcode is None:
        child.kill()
    later = [zc.allreduce(np.full(n, r + 1.0))[-1] for n in (40000, SLICED, 40000)]  # one larger:
    return os.waitstatus_to_exitcode(status), child.exitcode, first, later, segments(_session())  # made anew


def test_forked_children_never_touch_the_parents_segment():
    for code, mp_code, first, later, left in run_replicas(forked_children, 2, timeout=60):
        assert (code, mp_code, first, later, left) == (0, 0, 3.0, [3.0, 3.0, 3.0], [])


def growing(target):
    """Members (and, once admitted, newcomers) call shared-memory allreduces between grows."""
    sessions = []
    deadline = time.monotonic() + 60
    while True:
        sessions.append(_session())
        n = zc.get_world_size()
        assert n == 1 or zc._current()._life.shared is not None, "no shared memory"
        got = zc.allreduce(np.full(SLICED, 1.0, dtype=np.float32))[-1]
        assert got == n, (got, n)
        if n >= target:
            return n, sessions
        assert time.monotonic() < deadline, "the newcomer never came"
        time.sleep(0.05)
        zc.grow()


def newcomer(target):
    zc.initialize(join=True)  # returns once a grow() admitted it
    return growing(target)


def test_a_grown_group_shares_a_new_segment_with_its_newcomers():
    with Replicas(growing, 2, 3) as members, Replicas(newcomer, 1, 3, initialize=False, port=members.port,
                                                      env={"ZCOLLECTIVE_NUM_REPLICAS": ""}) as newcomers:
        outs = newcomers.wait(60) + members.wait(60)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    for o in outs:
        size, sessions = o.value
        assert size == 3 and all(segments(s) == [] for s in sessions), report(outs, "a segment is left")


def test_a_segments_name_tells_neither_its_session_nor_the_next_name():
    """Anyone may list /dev/shm: a name seen there must not let another user make the next
    generation's first (that call would fail on every rank) or learn the group's session."""
    session = int.from_bytes(os.urandom(8), "little")
    names = [_shared.segment_name(session, 0, gen) for gen in (1, 2)] + [_shared.segment_name(session, 1, 1)]
    assert len({n[len("/" + PREFIX):] for n in names}) == 3
    assert all(f"{session:016x}" not in n and not n.endswith(("-g1", "-g2")) for n in names)


def test_a_name_this_user_may_not_unlink_does_not_stop_closing(monkeypatch):
    """A name another user made first is theirs: unlinking it is refused (PermissionError in a
    sticky /dev/shm), and closing goes on (it raised out of teardown, leaving sockets open)."""

    class Refusing:
        @staticmethod
        def shm_unlink(name):
            raise PermissionError(1, "Operation not permitted", name)

    monkeypatch.setattr(_shared, "_posixshmem", Refusing)
    _shared.unlink("/zcollective-not-ours")  # no error


def given_up_while_the_segment_is_made(markers):
    """Rank 2 makes the first large call async and stays in its own code until the others have
    timed out: the leader has made the segment and the others wait at its sync, where they time
    out. The calls after it must work (the segment made anew), and no name stays in /dev/shm
    meanwhile."""
    r = zc.get_rank()
    x = np.full(300_000, 1.0, dtype=np.float32)  # 1.2 MB: through the segment
    try:
        if r == 2:
            f = zc.allreduce_async(x)
            wait_for(*(os.path.join(markers, f"gave up{other}") for other in (0, 1)), timeout=30)
            f.result(timeout=10)
        else:
            try:
                zc.allreduce(x, timeout=0.7)
            finally:
                touch(os.path.join(markers, f"gave up{r}"))
        first = "no error"
    except zc.CollectiveError as exc:
        first = type(exc).__name__
    zc.barrier(timeout=20)
    left_then = segments(_session())  # the name of the segment that was never used: unlinked
    later = [float(zc.allreduce(x, timeout=20)[-1]) for _ in range(3)]
    return first, left_then, later, segments(_session())


def test_a_call_given_up_while_its_segment_is_made_leaves_no_name_and_the_next_makes_it_anew(tmp_path):
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": "5"}
    with Replicas(given_up_while_the_segment_is_made, 3, str(tmp_path), env=env) as reps:
        outs = reps.wait(60)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    for o in outs:
        first, left_then, later, left = o.value
        assert first == "CollectiveTimeoutError" if o.rank < 2 else first != "no error", report(outs, first)
        assert left_then == [] and left == [], report(outs, f"rank {o.rank}: left {left_then} {left}")
        assert later == [3.0, 3.0, 3.0], report(outs, f"rank {o.rank}: {later}")


def _welcomed_with_data(names, addresses, rooms):
    """A coordinator every rank joined with a data port, rank r from ``addresses[r]`` with host
    name ``names[r]``; the first WELCOME's shm."""
    n = len(names)
    coord = Coordinator(n, SESSION, 1000, host_address="10.0.0.1")
    out = []
    for r in range(n):
        join = _join(r, n, names[r], rooms[r])
        body = json.loads(join.segments[0][0])
        body.update(data=f"tcp://{addresses[r] if r else '10.0.0.1'}:{7000 + r}", data_min=1 << 20,
                    data_mode="auto")
        out = list(coord.receive(peer(r), encode(control(Kind.JOIN, body, rank=r)), address=addresses[r]))
    assert coord.phase is Phase.RUNNING
    return json.loads(out[0][1].segments[0][0]).get("shm")


def test_ranks_on_several_hosts_share_memory_only_if_every_host_has_two_and_alike_room_per_rank():
    """Every host holds two or more ranks that offered it, and the group has a data plane: the
    WELCOME puts every rank on its host, each host's room the same per rank (the least), so an
    array fits every host's segment or none (an attack's finding: a 3-rank host and a 2-rank
    one, or two /dev/shm sizes, sent one allreduce two ways, a CallMismatchError)."""
    far = "10.0.0.7"
    shm = _welcomed_with_data(["a", "a", "b", "b", "b"], ["?", "127.0.0.1", far, far, far], [1 << 30] * 5)
    assert shm["hosts"] == [0, 0, 1, 1, 1]
    assert shm["room"] == [(1 << 29) // 3 * 2, (1 << 29) // 3 * 3]  # (half the least room, per rank)
    shm = _welcomed_with_data(["a", "a", "b", "b"], ["?", "127.0.0.1", far, far], [4000, 4000, 800, 4000])
    assert shm["hosts"] == [0, 0, 1, 1] and shm["room"] == [400, 400]
    # a host holding one rank, or one rank offering none: no rank shares memory
    assert _welcomed_with_data(["a", "a", "b"], ["?", "127.0.0.1", far], [1 << 30] * 3) is None
    assert _welcomed_with_data(["a", "a", "b", "b"], ["?", "127.0.0.1", far, far],
                               [1 << 30, 1 << 30, 1 << 30, None]) is None
