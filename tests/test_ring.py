"""The data plane's schedules, whole rings in memory: no sockets."""

import operator
import random

import numpy as np
import pytest

from zcollective._io._reducing import elementwise, reducer
from zcollective._protocol._ring import RS, ChainBroadcast, RingAllreduce, reduction_name


def _run(jobs, shuffle=None):
    """Deliver every job's outbox to the next rank until nothing moves;
    ``shuffle`` reorders what is in flight (chunks of different steps may
    arrive in any order a real pipeline allows). A chunk made here carries
    this rank as its origin; one forwarded keeps its origin's, as the data
    plane's headers do."""
    n = len(jobs)
    in_flight = [[] for _ in range(n)]  # to rank i: (chunk, origin)
    sent = [0] * n
    for _ in range(100000):
        moved = False
        for r, job in enumerate(jobs):
            sent[r] += len(job.outbox)
            for out in job.outbox:
                origin = out.frames[0][1] if out.frames is not None else r
                in_flight[(r + 1) % n].append((out, origin))
            moved |= bool(job.outbox)
            job.outbox.clear()
        for r, job in enumerate(jobs):
            queue = in_flight[r]
            if shuffle:
                shuffle.shuffle(queue)
            while queue:
                out, origin = queue.pop()
                payload = bytes(memoryview(out.payload).cast("B"))
                assert job.receive(out.kind, out.step, out.index, payload, [("header", origin), b"", payload],
                                   origin)
                moved = True
        if not moved:
            break
    assert sent == [job.to_send for job in jobs]  # what the data plane counts on
    return jobs


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("count", [1, 7, 1000, 4099])
def test_ring_allreduce_sums_and_every_rank_gets_the_same_bits(n, count):
    rng = np.random.default_rng(n * 10000 + count)
    values = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    originals = [v.copy() for v in values]
    add = reducer("add", operator.add)
    jobs = _run([RingAllreduce(r, n, values[r], add, chunk_bytes=64) for r in range(n)],
                random.Random(count))
    assert all(job.done for job in jobs)
    results = [job.result() for job in jobs]
    for res in results:
        assert res.tobytes() == results[0].tobytes()  # bit-identical everywhere
    np.testing.assert_allclose(results[0], np.sum(values, axis=0), rtol=1e-5, atol=1e-5)
    for v, o in zip(values, originals, strict=True):
        assert v.tobytes() == o.tobytes()  # inputs untouched


@pytest.mark.parametrize("n", [2, 3, 5])
def test_ring_reduce_scatter_stops_after_its_half_and_each_rank_holds_the_next_segment(n):
    """gather=False: no allgather chunk is sent or taken, and rank r's result is segment
    (r + 1) % n reduced over every rank (what reduce_scatter rotates its parts for)."""
    rng = np.random.default_rng(n)
    values = [rng.integers(0, 100, 4 * n * 3).astype(np.int64) for _ in range(n)]
    jobs = _run([RingAllreduce(r, n, values[r], reducer("add", operator.add), 16, gather=False)
                 for r in range(n)], random.Random(n))
    total = np.sum(values, axis=0).reshape(n, -1)
    for r, job in enumerate(jobs):
        assert job.done
        assert job.result().tolist() == total[(r + 1) % n].tolist()
    if n > 1:
        from zcollective._protocol._ring import AG
        assert not jobs[0].receive(AG, 0, 0, b"", [], 1)


def test_ring_allreduce_keeps_dtype_shape_and_integer_exactness():
    n = 3
    values = [np.full((4, 5, 6), r + 1, dtype=np.int64) * (10**12) for r in range(n)]
    jobs = _run([RingAllreduce(r, n, values[r], reducer("add", operator.add), 40) for r in range(n)])
    for job in jobs:
        out = job.result()
        assert out.shape == (4, 5, 6) and out.dtype == np.int64
        assert (out == 6 * 10**12).all()


@pytest.mark.parametrize("name,expected", [("maximum", np.maximum.reduce), ("minimum", np.minimum.reduce),
                                           ("multiply", np.multiply.reduce)])
def test_ring_allreduce_named_ufuncs(name, expected):
    n = 4
    values = [np.arange(100, dtype=np.float64) * (r + 1) - 150 for r in range(n)]
    jobs = _run([RingAllreduce(r, n, values[r], reducer(name, None), 128) for r in range(n)])
    for job in jobs:
        np.testing.assert_array_equal(job.result(), expected(np.stack(values)))


def test_ring_allreduce_with_a_marked_function_that_works_in_place():
    @elementwise
    def hypot_in_place(a, b):
        np.hypot(a, b, out=a)
        return a

    n = 3
    values = [np.full(50, 3.0 + r) for r in range(n)]
    fn = reducer(reduction_name(hypot_in_place), hypot_in_place)
    jobs = _run([RingAllreduce(r, n, values[r], fn, 64) for r in range(n)])
    np.testing.assert_allclose(jobs[0].result(), np.sqrt(9 + 16 + 25))


def test_reduction_names():
    from zcollective._group import default_reduce_fn
    assert reduction_name(default_reduce_fn) == "add"
    assert reduction_name(operator.add) == "add" and reduction_name(np.add) == "add"
    assert reduction_name(np.maximum) == "maximum" and reduction_name(operator.mul) == "multiply"
    assert reduction_name(lambda a, b: a + b) is None  # not known to be elementwise
    assert reduction_name(max) is None


def test_a_chunk_is_taken_once_and_out_of_range_chunks_are_refused():
    job = RingAllreduce(1, 2, np.zeros(10, np.float32), reducer("add", operator.add), 16)
    chunk = np.ones(4, np.float32).tobytes()
    assert job.receive(RS, 0, 0, chunk, [])
    assert not job.receive(RS, 0, 0, chunk, [])  # a duplicate
    assert not job.receive(RS, 1, 0, chunk, [])  # no step 1 at n = 2
    assert not job.receive(RS, 0, 9, chunk, [])  # no such chunk
    assert not job.receive(RS, 0, 1, b"\0" * 3, [])  # wrong length


@pytest.mark.parametrize("n,root", [(2, 0), (3, 2), (5, 1), (8, 7)])
def test_chain_broadcast_delivers_every_frame_to_every_rank(n, root):
    frames = [b"pickle-stream", bytes(range(256)) * 40, b"", b"x" * 1000]
    sizes = [len(f) for f in frames]
    jobs = [ChainBroadcast(r, n, root, sizes, frames if r == root else None, chunk_bytes=100)
            for r in range(n)]
    _run(jobs)
    for r, job in enumerate(jobs):
        assert job.done
        assert [bytes(f) for f in job.result()] == frames, r
    last = (root - 1) % n
    assert jobs[last].outbox == []  # the end of the chain forwards nothing


@pytest.mark.parametrize("n", [2, 3, 6])
def test_ring_allgather_delivers_the_large_values_and_leaves_the_small_ones(n):
    from zcollective._protocol._ring import RingAllgather
    values = [[b"p%d" % r, bytes([r]) * (300 * r)] if r % 2 == 0 else None for r in range(n)]
    sizes = [None if v is None else [len(f) for f in v] for v in values]
    jobs = _run([RingAllgather(r, n, sizes, values[r], chunk_bytes=128) for r in range(n)])
    for r, job in enumerate(jobs):
        got = job.result()
        for owner in range(n):
            if values[owner] is None:
                assert got[owner] is None
            else:
                assert [bytes(f) for f in got[owner]] == values[owner], (r, owner)
