"""The hot path: rank 0's own reduce function never leaves its process, so
it is called as it is (not a copy) and need not pickle; importing the
library costs no asyncio; resolving a future runs every callback."""

import threading

import pytest

from zcollective.testing import run_replicas


def _allreduce_with_an_unpicklable_function(values):
    import zcollective

    guard = threading.Lock()  # captured: this function cannot be pickled
    calls = []

    def add(a, b):
        with guard:
            calls.append((a, b))
        return a + b

    rank = zcollective.get_rank()
    result = zcollective.allreduce(values[rank], add)
    # rank 0's function ran on rank 0 (in its coordinator thread), as itself: its calls are
    # seen here; no other rank ran anything
    return result, len(calls)


def test_rank_0s_reduce_function_is_called_as_itself_never_pickled():
    out = run_replicas(_allreduce_with_an_unpicklable_function, 3, [1, 10, 100])
    assert out == [(111, 2), (111, 0), (111, 0)]


def _reduce_to_rank_1_with_an_unpicklable_function():
    import zcollective

    guard = threading.Lock()

    def add(a, b):
        with guard:
            return a + b

    if zcollective.get_rank() != 1:
        return zcollective.reduce(1, add, root=1)  # only the root's function is used
    with pytest.raises(zcollective.SerializationError, match="reduce function"):
        zcollective.reduce(1, add, root=1)
    return zcollective.reduce(1, lambda a, b: a + b, root=1)  # the call is retried, picklable


def test_another_roots_function_must_be_picklable_and_says_so():
    assert run_replicas(_reduce_to_rank_1_with_an_unpicklable_function, 3) == [None, 3, None]


def test_importing_zcollective_does_not_import_asyncio():
    """Every replica process pays its imports: asyncio (60-80 ms here) only
    when the program uses it."""
    import subprocess
    import sys

    code = "import sys, zcollective; print('asyncio' in sys.modules, 'zmq.asyncio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_a_callback_raising_keyboard_interrupt_does_not_starve_the_others():
    from zcollective._future import CollectiveFuture

    future = CollectiveFuture(None, 1, "allreduce")
    seen = []

    def interrupted(f):
        seen.append("first")
        raise KeyboardInterrupt

    future.add_done_callback(interrupted)
    future.add_done_callback(lambda f: seen.append("second"))
    future.add_done_callback(lambda f: seen.append("third"))
    with pytest.raises(KeyboardInterrupt):
        future._set_result(7)
    assert seen == ["first", "second", "third"]
    assert future.result(0) == 7
