"""scan and exscan (issue 45's proof: an operation added as one row): rank r gets the fold of
ranks 0..r (exscan: 0..r-1, None on rank 0) in rank order; its rule without sockets, then
between real processes, in the world and in sub-groups."""

import operator

import pytest
from pair import Pair, outcome

import zcollective as zc
from zcollective._calls import finisher
from zcollective._format import _serialize
from zcollective._future import CollectiveFuture
from zcollective._protocol._ops import OPERATIONS, Here, Op
from zcollective.testing import run_replicas


def called(pair, op, values, fns):
    """Every rank's part made by the operation's row, as a group makes it."""
    futures = []
    for rank, member in enumerate(pair.members):
        part = OPERATIONS[op].contribute(Here(rank, pair.n), values[rank], fns[rank])
        seq = member.reserve(op, part.root, "t.py:1")
        segments, fn = part.build()
        if callable(fn):  # (rank 0's own function, as it is: the pair's links pickle everything)
            fn = _serialize.dumps_function(fn)
        future = CollectiveFuture(None, seq, op.name.lower())
        member.submit(op, part.root, segments, fn, "t.py:1", part.flags, future, finisher(part, rank))
        futures.append(future)
    for rank in range(pair.n):
        pair.flush(rank)
    return [outcome(f) for f in futures]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_each_rank_gets_the_fold_of_the_ranks_before_it_in_rank_order(n):
    pair = Pair(n).joined()
    values = [[r] for r in range(n)]
    add = [operator.add] * n
    assert called(pair, Op.SCAN, values, add) == [list(range(r + 1)) for r in range(n)]
    assert called(pair, Op.EXSCAN, values, add) == [None] + [list(range(r)) for r in range(1, n)]
    strings = [f"{r}." for r in range(n)]  # rank 0's function is the one used
    assert called(pair, Op.SCAN, strings, [operator.add] + [operator.mul] * (n - 1)) == [
        "".join(strings[:r + 1]) for r in range(n)]


def test_a_scan_beside_an_exscan_is_a_mismatch():
    pair = Pair(2).joined()
    futures = [pair.call(0, Op.SCAN, 1, fn=operator.add), pair.call(1, Op.EXSCAN, 2, fn=operator.add)]
    assert all(isinstance(outcome(f), zc.CallMismatchError) for f in futures)
    assert "rank 0 called scan at train.py:10; rank 1 called exscan" in str(outcome(futures[1]))


def test_a_function_that_raises_fails_the_call_alike_and_the_group_goes_on():
    pair = Pair(2).joined()
    failed = called(pair, Op.SCAN, [1, "a"], [operator.add] * 2)
    assert all(isinstance(f, zc.RemoteError) for f in failed)
    assert called(pair, Op.SCAN, [1, 2], [operator.add] * 2) == [1, 3]  # the group stays usable


def scans():
    r = zc.get_rank()
    out = {"scan": zc.scan([r], operator.add), "exscan": zc.exscan([r], operator.add),
           "ints": zc.scan(r + 1), "async": zc.scan_async(f"{r}.", operator.add).result(timeout=30),
           "exasync": zc.exscan_async(f"{r}.", operator.add).result(timeout=30)}
    sub = zc.split(r % 2)  # ranks 0, 2 and 1, 3: each sub-group's own order
    out["sub"] = sub.scan([zc.get_rank()], operator.add)
    out["subex"] = sub.exscan([zc.get_rank()], operator.add)
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_scans_between_processes_in_the_world_and_in_sub_groups(n):
    outs = run_replicas(scans, n, timeout=60)
    for r, out in enumerate(outs):
        assert out["scan"] == list(range(r + 1)) and out["ints"] == sum(range(1, r + 2))
        assert out["exscan"] == (list(range(r)) if r else None)
        assert out["async"] == "".join(f"{i}." for i in range(r + 1))
        assert out["exasync"] == ("".join(f"{i}." for i in range(r)) or None)
        mates = [w for w in range(n) if w % 2 == r % 2]
        assert out["sub"] == mates[:mates.index(r) + 1]
        assert out["subex"] == (mates[:mates.index(r)] or None)


def test_a_group_of_one_gets_its_own_value_back():
    with zc.Group(rank=0, size=1) as group:
        value = {"x": [1]}
        assert group.scan(value) is value and group.exscan(value) is None
        with pytest.raises(TypeError, match="reduce_fn must be callable"):
            group.scan(1, 2)


def test_a_fold_in_place_leaves_each_earlier_rank_its_own_prefix():
    """The default ``a += b`` changes its left value: each rank's result is still its prefix,
    small values and large arrays (their buffers outside the pickle) alike (a reviewer found
    every rank but 0 given the total)."""
    np = pytest.importorskip("numpy")
    n = 4
    pair = Pair(n).joined()
    fns = [zc.default_reduce_fn] * n
    assert called(pair, Op.SCAN, [[r] for r in range(n)], fns) == [list(range(r + 1)) for r in range(n)]
    assert called(pair, Op.EXSCAN, [[r] for r in range(n)], fns) == [None] + [
        list(range(r)) for r in range(1, n)]
    big = [np.full(1 << 16, float(r + 1)) for r in range(n)]  # 512 KiB each
    got = called(pair, Op.SCAN, big, fns)
    assert [float(a[0]) for a in got] == [1.0, 3.0, 6.0, 10.0] and all(a.shape == (1 << 16,) for a in got)


def test_exscan_never_folds_the_last_ranks_value():
    """No rank's result holds the last rank's value, so it is never combined (as in MPI): a value
    the function cannot take there fails nothing."""
    pair = Pair(3).joined()
    assert called(pair, Op.EXSCAN, [0, 1, "not a number"], [operator.add] * 3) == [None, 0, 1]
