"""The hot path: rank 0's own reduce function is not pickled when a pickle
could not differ from it, and is when it could; importing the library costs
no asyncio; resolving a future runs every callback."""

import threading

import pytest

from zcollective.testing import run_replicas


def _lambdas_made_in_a_loop():
    import time

    import zcollective

    futures = [zcollective.allreduce_async(1, lambda a, b: a + b + 10 * i) for i in range(3)]  # noqa: B023
    if zcollective.get_rank() == 1:
        time.sleep(0.3)  # every reduction runs after rank 0's loop has ended
    return [f.result(30) for f in futures]


def test_rank_0s_reduce_function_computes_as_it_was_at_its_call():
    """A lambda made in a loop is called after the loop moved on: it must
    compute with the value it had at its call (the snapshot a pickle makes),
    not the loop's last one."""
    assert run_replicas(_lambdas_made_in_a_loop, 2) == [[2, 12, 22], [2, 12, 22]]


def _add(a, b):
    a += b
    return a


def _merge(a, b):
    return {k: a[k] + b[k] for k in a}


class Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __call__(self, a, b):
        return a + b


def test_only_functions_a_pickle_could_not_change_are_handed_over_as_they_are():
    import operator

    from zcollective import _serialize

    offset = 10

    def closure(a, b):
        return a + b + offset

    def uses_a_global(a, b):
        return _add(a, b)

    def with_a_default(a, b, c=[]):  # noqa: B006 (state of its own, on purpose)
        return a + b

    def with_an_attribute(a, b):
        return a + b
    with_an_attribute.calls = 0

    _serialize.dumps_function(operator.add)  # importable: its pickle names this very object
    stateless = [_add, _merge, lambda a, b: a + b, operator.add]
    stateful = [closure, uses_a_global, with_a_default, with_an_attribute, lambda a, b: len(a) + b,
                lambda a, b: a.union(b), threading.Lock, Unhashable()]
    assert [_serialize.as_is(f) for f in stateless] == [True] * len(stateless)
    assert [_serialize.as_is(f) for f in stateful] == [False] * len(stateful)


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
