"""Every operation between real processes over TCP on loopback."""

import collections

import pytest

import zcollective as zc
from zcollective.testing import free_port, run_replicas

np = pytest.importorskip("numpy")


def every_operation():
    r, n = zc.get_rank(), zc.get_world_size()
    ranks = list(range(n))
    out = {}
    out["int"] = zc.allreduce(r + 1)
    out["dict"] = zc.allreduce({f"k{r}": r, "shared": 1.0},
                               lambda a, b: {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()})
    out["set"] = zc.allreduce({r}, lambda a, b: a | b)
    out["counter"] = zc.allreduce(collections.Counter({"x": 1, f"r{r}": 2}))
    arr = zc.allreduce(np.full(1000, r, dtype=np.float32))
    assert arr.dtype == np.float32 and arr.flags.writeable
    arr += 1  # results are the caller's to mutate
    out["array"] = float(arr[0])
    out["nested"] = zc.allreduce([{"r": (r, [r])}])
    out["none"] = zc.allreduce(None, lambda a, b: a)
    out["concat"] = zc.allreduce(str(r), lambda a, b: a + b)  # rank order, left to right
    out["bcast"] = zc.broadcast({"from": r, "list": [r] * 3})
    out["bcast_root"] = zc.broadcast(r * 10, root=n - 1)
    out["allgather"] = zc.allgather((r, "x" * r))
    out["gather"] = zc.gather(r, root=n - 1)
    out["scatter"] = zc.scatter([f"to{i}" for i in ranks] if r == n // 2 else None, root=n // 2)
    out["reduce"] = zc.reduce(r + 1, root=n - 1)
    out["alltoall"] = zc.alltoall([(r, i) for i in ranks])
    zc.barrier()
    # several in flight, collected out of order
    futures = [zc.allreduce_async(i * (r + 1)) for i in range(5)]
    b = zc.broadcast_async("b")
    out["async"] = [futures[i].result(timeout=30) for i in (4, 1, 3, 0, 2)] + [b.result(30)]
    return out


def expected(n):
    ranks = list(range(n))
    tri = n * (n + 1) // 2
    return {
        "int": tri,
        "dict": {**{f"k{r}": r for r in ranks}, "shared": float(n)},
        "set": set(ranks),
        "counter": collections.Counter({"x": n, **{f"r{r}": 2 for r in ranks}}),
        "array": float(sum(ranks) + 1),
        "nested": [{"r": (r, [r])} for r in ranks],
        "none": None,
        "concat": "".join(map(str, ranks)),
        "bcast": {"from": 0, "list": [0] * 3},
        "bcast_root": (n - 1) * 10,
        "allgather": [(r, "x" * r) for r in ranks],
        "scatter": None,  # per rank, below
        "reduce": None,
        "gather": None,
        "alltoall": None,
        "async": [4 * tri, tri, 3 * tri, 0, 2 * tri, "b"],
    }


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_every_operation(n):
    outs = run_replicas(every_operation, n)
    want = expected(n)
    for r, out in enumerate(outs):
        for key, value in want.items():
            if value is not None or key == "none":
                assert out[key] == value, (r, key)
        assert out["scatter"] == f"to{r}"
        assert out["gather"] == (list(range(n)) if r == n - 1 else None)
        assert out["reduce"] == (n * (n + 1) // 2 if r == n - 1 else None)
        assert out["alltoall"] == [(j, r) for j in range(n)]


LARGE_ELEMENTS = 16 << 20  # float32: 64 MiB


def large_objects():
    """Every element of a 64 MiB allreduce and every byte of a 64 MiB
    broadcast, each different from its neighbours (a chunk moved, lost or
    sent twice shows), compared here with what they must be."""
    r = zc.get_rank()
    pattern = (np.arange(LARGE_ELEMENTS, dtype=np.int32) % 65521).astype(np.float32)  # sums stay exact
    total = zc.allreduce(pattern * (r + 1))
    want = pattern * 6  # 1 + 2 + 3
    wrong = np.flatnonzero(total != want)
    sent = bytes(range(251)) * ((64 << 20) // 251 + 1)  # 64 MiB and a little
    blob = zc.broadcast(sent if r == 0 else None)
    return total.dtype.name, total.shape, wrong.size, wrong[:3].tolist(), len(blob), blob == sent


@pytest.mark.timeout(180)  # the replicas get 120 s
def test_large_objects():
    n = 3
    for r, out in enumerate(run_replicas(large_objects, n, timeout=120)):
        assert out == ("float32", (LARGE_ELEMENTS,), 0, [], 251 * ((64 << 20) // 251 + 1), True), (r, out)


def training_loop(steps):
    r, n = zc.get_rank(), zc.get_world_size()
    weights = zc.broadcast(np.random.default_rng(r).normal(size=8))
    pending = None
    history = []
    for step in range(steps):
        grad = zc.allreduce(np.full(8, float(r + step)))
        weights = weights - 0.01 * grad / n
        if pending is not None:  # the previous step's metric, collected one step late
            history.append(pending.result(timeout=30))
        pending = zc.allreduce_async({"step": step, "loss": float(r)},
                                     lambda a, b: {"step": a["step"], "loss": a["loss"] + b["loss"]})
        if step % 10 == 0:
            assert zc.broadcast(step) == step
    history.append(pending.result(timeout=30))
    return weights.tolist(), history


def test_simulated_training_loop_mixes_async_and_blocking_calls():
    n, steps = 3, 120
    outs = run_replicas(training_loop, n, steps)
    weights = np.random.default_rng(0).normal(size=8)  # rank 0's, broadcast
    for step in range(steps):  # the same steps in one process: the gradients summed by hand
        weights = weights - 0.01 * np.full(8, float(sum(r + step for r in range(n)))) / n
    for r, (got, history) in enumerate(outs):
        assert got == weights.tolist(), r  # exact: the same operations on the same values
        assert history == [{"step": s, "loss": 3.0} for s in range(steps)], r


def regroup(ports):
    import os

    rank = int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
    results = []
    zc.initialize(master_port=ports[0], replica_rank=rank, num_replicas=3)
    results.append(zc.allreduce(1))
    zc.teardown()
    try:
        zc.allreduce(1)
    except RuntimeError as exc:
        results.append(str(exc))
    if rank < 2:
        zc.initialize(master_port=ports[1], replica_rank=rank, num_replicas=2)
        results.append(zc.allreduce(1))
        zc.teardown()
    zc.initialize(master_port=ports[2], replica_rank=rank, num_replicas=3)
    results.append(zc.allgather(rank))
    zc.teardown()
    return results


def test_teardown_then_initialize_with_another_size_in_the_same_processes():
    ports = [free_port() for _ in range(3)]
    outs = run_replicas(regroup, 3, ports, initialize=False)
    uninit = "zcollective is not initialized: call zcollective.initialize() first"
    assert outs[0] == [3, uninit, 2, [0, 1, 2]]
    assert outs[1] == [3, uninit, 2, [0, 1, 2]]
    assert outs[2] == [3, uninit, [0, 1, 2]]


def mutate_what_you_got():
    r = zc.get_rank()
    big = np.arange(1 << 22, dtype=np.float32)  # 16 MiB, sent without copies
    got = zc.broadcast(big if r == 1 else None, root=1)
    if r == 0:
        got[:] = -1  # rank 0 shares its process with the coordinator; others must not see this
    gathered = zc.allgather(np.full(1 << 20, r, dtype=np.float32))
    if r == 0:
        for a in gathered:
            a[:] = -1
    zc.barrier()
    ok_bcast = bool((got == big).all()) if r != 0 else True
    ok_gather = all(bool((a == i).all()) for i, a in enumerate(gathered)) if r != 0 else True
    return ok_bcast, ok_gather


def test_a_result_mutated_on_rank_0_does_not_change_what_others_receive():
    assert run_replicas(mutate_what_you_got, 3, timeout=90) == [(True, True)] * 3


def reduce_fn_with_captured_array():
    weights = np.arange(100_000, dtype=np.float64)  # large: pickled with the function

    def weighted(a, b):
        return a + b * weights[1]

    return zc.allreduce(1.0, weighted)


def test_reduce_function_may_capture_large_arrays():
    assert run_replicas(reduce_fn_with_captured_array, 3) == [3.0] * 3


class Index:
    """Not an int, but usable as one (``__index__``), as mpi4py's tests pass roots."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


def identity_rule():
    """One rule, any group size: a result (or a list slot) that is this
    replica's own value is that very object; anything built from other
    replicas' values is a new object."""
    r, n = zc.get_rank(), zc.get_world_size()
    mine = [r]
    values = [[i] for i in range(n)]
    bcast = zc.broadcast(mine, root=np.int64(0))
    scattered = zc.scatter(values if r == 0 else None, root=Index(0))
    gathered = zc.gather(mine, root=np.int32(0))
    return {
        "broadcast_root": bcast is mine if r == 0 else bcast == [0],
        "scatter_root": scattered is values[0] if r == 0 else scattered == [r],
        "gather_slot": gathered[0] is mine if r == 0 else gathered is None,
        "allgather_slot": zc.allgather(mine)[r] is mine,
        "alltoall_slot": zc.alltoall(values)[r] is values[r],
        "allreduce": zc.allreduce(mine) is mine,
    }


@pytest.mark.parametrize("n", [1, 2])
def test_identity_rule_and_integer_roots(n):
    outs = run_replicas(identity_rule, n)
    for own in outs:
        allreduce = own.pop("allreduce")
        assert all(own.values()), own
        assert allreduce is (n == 1)  # with one replica nothing was combined


def test_adaptdl_standalone_port_zero_with_one_replica():
    zc.initialize("0.0.0.0", 0, 0, 1)  # what adaptdl.torch does when no ADAPTDL_* is set
    try:
        assert zc.allreduce(5) == 5
    finally:
        zc.teardown()
    with pytest.raises(ValueError, match="master_port=0 cannot be used with num_replicas=2"):
        zc.initialize("127.0.0.1", 0, 0, 2)
