"""reduce_scatter, the operation added in three files (issue 33): on the star and the data
plane, between real processes; its mismatches, timeouts and losses; its rules without sockets."""

import operator
import os
import signal
import time

import pytest
from conftest import raising_on, touch, wait_for

import zcollective as zc
from zcollective._format import _serialize
from zcollective._protocol._ops import Op
from zcollective.testing import Replicas, report, run_replicas

np = pytest.importorskip("numpy")

PLANES = {"star": {"ZCOLLECTIVE_DATA_PLANE": "off", "ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": "off"},
          "data": {"ZCOLLECTIVE_DATA_PLANE": "on", "ZCOLLECTIVE_DATA_PLANE_MIN_BYTES": "1024",
                   "ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": "off"}}


def scatter_everything():
    r, n = zc.get_rank(), zc.get_world_size()
    out = {}
    out["ints"] = zc.reduce_scatter([10 * r + i for i in range(n)])
    out["order"] = zc.reduce_scatter([f"{r}>{i} " for i in range(n)], operator.add)  # rank order
    out["lists"] = zc.reduce_scatter([[r]] * n, lambda a, b: a + b)
    parts = [np.full((40, 50), r * 100 + i, np.float64) for i in range(n)]  # 16 KB each
    kept = [p.copy() for p in parts]
    array = zc.reduce_scatter(parts)
    assert all((p == k).all() for p, k in zip(parts, kept, strict=True)), "an input was changed"
    out["array"] = (array.shape, array.dtype.str, float(array[0, 0]), float(array[-1, -1]))
    out["max"] = float(zc.reduce_scatter([np.arange(4096, dtype=np.int32) * (r + 1) + i for i in range(n)],
                                         np.maximum)[-1])
    future = zc.reduce_scatter_async([i for i in range(n)])
    out["async"] = future.result(timeout=30)
    out["data"] = zc._current()._life.here.data
    out["group"] = zc._current().reduce_scatter([1] * n)
    return out


@pytest.mark.parametrize("plane", ["star", "data"])
def test_every_rank_gets_its_part_reduced_in_rank_order(plane):
    n = 3
    outs = run_replicas(scatter_everything, n, env=PLANES[plane])
    total = sum(range(n))
    for i, out in enumerate(outs):
        assert out["ints"] == 10 * total + n * i
        assert out["order"] == "".join(f"{r}>{i} " for r in range(n))
        assert out["lists"] == list(range(n))
        assert out["array"] == ((40, 50), "<f8", float(100 * total + n * i), float(100 * total + n * i))
        assert out["max"] == 4095.0 * n + i
        assert out["async"] == n * i
        assert out["data"] is (plane == "data")
        assert out["group"] == n


def test_a_group_of_one_gets_its_own_value_back():
    with zc.Group(rank=0, size=1) as group:
        value = {"x": [1]}
        assert group.reduce_scatter([value]) is value
        with pytest.raises(ValueError, match="one value per replica: got 2 values for 1 replicas"):
            group.reduce_scatter([1, 2])


def wrong_counts_then_go_on():
    r, n = zc.get_rank(), zc.get_world_size()
    try:
        zc.reduce_scatter([1] * (n + 1 if r == 1 else n))
    except (ValueError, zc.PeerError) as exc:
        said = (type(exc).__name__, str(exc))
    else:
        said = None
    try:
        zc.reduce_scatter([np.ones(2048 if r != 2 else 1024, np.float32)] * n)
    except zc.CallMismatchError as exc:
        arrays = str(exc)
    else:
        arrays = None
    after = zc.reduce_scatter([r] * n)  # the group goes on
    try:  # another operation at the same seq: a mismatch, which fails the group
        zc.reduce_scatter([1] * n) if r == 0 else zc.allreduce(1)
    except zc.CallMismatchError as exc:
        calls = str(exc)
    else:
        calls = None
    return said, arrays, calls, after


@pytest.mark.parametrize("plane", ["star", "data"])
def test_wrong_counts_and_arrays_fail_the_call_on_every_rank_and_name_them(plane):
    n = 3
    outs = run_replicas(wrong_counts_then_go_on, n, env=PLANES[plane])
    for r, (said, arrays, calls, after) in enumerate(outs):
        if r == 1:
            assert said == ("ValueError", "rank 1: reduce_scatter needs one value per replica: "
                                          "got 4 values for 3 replicas")
        else:
            assert said[0] == "PeerError"
            assert said[1].startswith("seq 0 reduce_scatter: rank 1 failed: reduce_scatter needs one")
        assert arrays is not None and arrays.startswith("seq 1 reduce_scatter: the ranks disagree: ranks 0,1")
        named = "3 values, each a <f4 array" if plane == "data" else "a <f4 array"
        assert f"rank 2 passed {named} of shape (1024,) reduced with add" in arrays, arrays
        assert calls is not None and "seq 3: rank 0 called reduce_scatter at " in calls
        assert "called allreduce at test_reduce_scatter.py:" in calls
        assert after == sum(range(n))


def one_rank_never_calls(markers):
    if zc.get_rank() == 2:  # it comes once the others have given the call up
        wait_for(*(os.path.join(markers, f"gave up{r}") for r in (0, 1)), timeout=30)
        try:
            zc.barrier(timeout=20)
        except zc.CollectiveError as exc:
            return type(exc).__name__, str(exc)
        return None
    try:
        zc.reduce_scatter([1, 2, 3], timeout=1)
    except zc.CollectiveTimeoutError as exc:
        return type(exc).__name__, str(exc)
    finally:
        touch(os.path.join(markers, f"gave up{zc.get_rank()}"))
    return None


def test_a_timeout_gives_the_call_up_alike_on_every_rank(tmp_path):
    outs = run_replicas(one_rank_never_calls, 3, str(tmp_path), timeout=60)
    for r in (0, 1):
        kind, message = outs[r]
        assert kind == "CollectiveTimeoutError" and "seq 0 reduce_scatter" in message, outs
    kind, message = outs[2]
    assert kind in ("CollectiveTimeoutError", "CallMismatchError") and "seq 0" in message, outs


def lose_one(victim):
    r = zc.get_rank()
    zc.barrier()
    if r == victim:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        zc.reduce_scatter([np.ones(4096, np.float32)] * zc.get_world_size(), timeout=30)
    except zc.ReplicaLostError as exc:
        return str(exc), time.monotonic() - start
    return "no error"


@pytest.mark.parametrize("plane", ["star", "data"])
def test_a_killed_rank_is_named_on_every_survivor(plane):
    with Replicas(lose_one, 3, 1, env={**PLANES[plane], "ZCOLLECTIVE_LIVENESS_TIMEOUT": "3"}) as reps:
        outs = reps.wait(60)
    assert outs[1].returncode == -signal.SIGKILL, report(outs, "rank 1 was not killed")
    for out in (outs[0], outs[2]):
        assert out.error is None and out.value != "no error", report(outs, "a survivor failed")
        message, elapsed = out.value
        assert message.startswith("rank 1 (pid") and "was lost" in message, report(outs, message)
        assert "reduce_scatter" in message, report(outs, message)
        assert elapsed < 10, report(outs, f"took {elapsed} s")


def raising_on_rank_1():
    n = zc.get_world_size()
    try:
        zc.reduce_scatter([np.ones(2000)] * n, raising_on(1, RuntimeError, "boom on rank 1"), timeout=20)
        return "ok"
    except zc.CollectiveError as exc:
        return type(exc).__name__


def test_a_reduce_function_that_raises_fails_the_call_on_every_rank_with_a_data_plane():
    """Found by an attack: on the ring's reduce-scatter half alone, rank 0 finished before
    rank 1's function raised, and returned a value while the others failed. A function of the
    program's own is reduced on the star (where it runs once, on rank 0: it does not raise)."""
    assert run_replicas(raising_on_rank_1, 3, env=PLANES["data"], timeout=60) == ["ok"] * 3


def result_memory():
    n = zc.get_world_size()
    value = zc.reduce_scatter([np.ones(100_000)] * n)  # 800 KB each
    held = value.base if value.base is not None else value
    return value.nbytes, held.nbytes, zc._current()._life.here.data


def test_a_data_plane_result_holds_only_its_own_share():
    """Found by an attack: the result was a view of the ring's buffer of every share."""
    for own, held, data in run_replicas(result_memory, 3, env=PLANES["data"], timeout=60):
        assert data and held == own == 800_000


# -- the rules, without sockets ------------------------------------------------


def test_the_coordinator_routes_each_rank_its_reduced_part():
    from test_coordinator import contrib, feed, joined, peer, results

    coord = joined(3)
    for r in range(3):
        segments = [_serialize.dumps(f"{r}{i}") for i in range(3)]
        out = feed(coord, peer(r), contrib(r, 0, op=Op.REDUCE_SCATTER, segments=segments,
                                           fn=operator.add if r == 0 else None))
    got = {p: _serialize.loads(m.segments[0]) for p, m in results(out).items()}
    assert got == {peer(i): f"0{i}1{i}2{i}" for i in range(3)}
    for r in range(3):  # a rank with a part short is a ProtocolError (no working replica sends it)
        out = feed(coord, peer(r), contrib(r, 1, op=Op.REDUCE_SCATTER, segments=[_serialize.dumps(1)] * (
            3 if r != 2 else 2), fn=operator.add if r == 0 else None))
    assert {m.body()["error"] for m in results(out).values()} == {"ProtocolError"}
    assert "rank 2 did not send exactly 3 values" in results(out)[peer(0)].body()["message"]
