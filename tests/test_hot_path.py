"""The hot path: rank 0's own reduce function is not pickled when a pickle
could not differ from it, and is when it could; importing the library costs
no asyncio; resolving a future runs every callback; a replica's wait takes
in what it must, and no more."""

import json
import os
import threading
import time

import pytest
import zmq
from conftest import interrupted_at_line, touch, wait_for

from zcollective._format import _serialize
from zcollective._format._wire import Kind, Message, decode, encode
from zcollective._future import CollectiveFuture, settle
from zcollective._io._dealer import DealerDriver
from zcollective._protocol._member import Member
from zcollective._protocol._ops import Op
from zcollective.config import resolve
from zcollective.errors import CallMismatchError
from zcollective.testing import run_replicas


def _lambdas_made_in_a_loop(markers):
    import zcollective

    if zcollective.get_rank() == 1:  # its parts come once rank 0's loop has ended: every
        wait_for(os.path.join(markers, "looped"))  # reduction runs after `i` moved on to 2
    futures = [zcollective.allreduce_async(1, lambda a, b: a + b + 10 * i) for i in range(3)]  # noqa: B023
    if zcollective.get_rank() == 0:
        touch(os.path.join(markers, "looped"))
    return [f.result(30) for f in futures]


def test_rank_0s_reduce_function_computes_as_it_was_at_its_call(tmp_path):
    """A lambda made in a loop is called after the loop moved on: it must
    compute with the value it had at its call (the snapshot a pickle makes),
    not the loop's last one."""
    assert run_replicas(_lambdas_made_in_a_loop, 2, str(tmp_path)) == [[2, 12, 22], [2, 12, 22]]


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

    from zcollective._format import _serialize

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


def test_importing_zcollective_leaves_out_what_a_replica_may_not_need():
    """Every replica process pays its imports: asyncio (60-80 ms here) only when
    the program uses it, numpy only when the program does, rank 0's coordinator
    (15-18 ms compiled from source) only when the process serves one."""
    import subprocess
    import sys

    left_out = ["asyncio", "zmq.asyncio", "numpy", "zcollective._protocol._coordinator",
                "zcollective._io._server"]
    code = f"import sys, zcollective; print([m for m in {left_out!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


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


# -- a replica's reply path: a hand-driven ROUTER plays the coordinator, in this process -----------

class _Coordinator:
    """A ROUTER on loopback, and a real DealerDriver driver (rank 1 of 2) joined to it."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVTIMEO, 10_000)  # a test fails rather than hangs
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        config = resolve("127.0.0.1", port, 1, 2, env={})
        self.member = Member(1, 2, config.endpoint)
        self.replica = DealerDriver(self.ctx, config, self.member)
        self.replica.send([self.member.join()])
        self.peer, join = self.receive()
        self.session = 0x5E55_11
        self.reply(Message(Kind.WELCOME, rank=1, session=self.session,
                           segments=[[json.dumps({"nonce": join.body()["nonce"]}).encode()]]))
        assert self.replica.wait_for(lambda: self.member.joined, time.monotonic() + 10)

    def receive(self):
        frames = self.router.recv_multipart(copy=False)
        return frames[0].bytes, decode(frames[1:])

    def reply(self, msg):
        self.router.send_multipart([self.peer, *encode(msg)])

    def result(self, seq, value):
        return Message(Kind.RESULT, Op.ALLREDUCE, rank=1, seq=seq, session=self.session,
                       segments=[_serialize.dumps(value)])

    def call(self):
        seq = self.member.next_seq
        future = CollectiveFuture(None, seq, "allreduce")
        self.member.submit(Op.ALLREDUCE, 0, [_serialize.dumps(seq)], future=future,
                           finish=lambda m: _serialize.loads(m.segments[0]))
        self.replica.flush()
        assert self.receive()[1].seq == seq
        return future

    def queued(self, count):
        """Wait until ``count`` messages are queued at the DEALER (none taken in)."""
        deadline = time.monotonic() + 10
        while self.replica.dealer.get(zmq.EVENTS) & zmq.POLLIN == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the rest of them, sent right after the first

    def close(self):
        self.replica.close()
        self.router.close(linger=0)
        self.ctx.term()


def settled(member, future):
    """A wait's predicate, as the call runner writes it: apply what the rules said, then look."""
    settle(member.outcomes)
    return future._done


def test_a_wait_whose_call_was_the_last_in_flight_leaves_the_rest_for_the_next():
    """Once the awaited call is done and none is left in flight, what came
    behind its reply (a FAIL here) is not taken in by that wait (a poll
    saved per call), but at once by the next: that call fails with it."""
    c = _Coordinator()
    try:
        first = c.call()
        c.reply(c.result(first.seq, "one"))
        c.reply(Message(Kind.FAIL, rank=1, session=c.session, segments=[[json.dumps(
            {"error": "CallMismatchError", "message": "rank 2 called broadcast"}).encode()]]))
        c.queued(2)
        assert c.replica.wait_for(lambda: settled(c.member, first), time.monotonic() + 10)
        assert first.result(0) == "one" and c.member.failure is None  # the FAIL still queued
        c.replica.progress()
        assert isinstance(c.member.failure, CallMismatchError)
        with pytest.raises(CallMismatchError, match="rank 2 called broadcast"):
            c.call()
    finally:
        c.close()


def test_a_wait_with_other_calls_in_flight_takes_in_every_reply_that_came():
    """With calls in flight the drain goes on: their replies are taken in by
    the same wait (a coroutine awaiting one sleeps on the socket's fd, which
    would not fire again for a reply already queued)."""
    c = _Coordinator()
    try:
        futures = [c.call() for _ in range(3)]
        for f in futures:
            c.reply(c.result(f.seq, f.seq * 10))
        c.queued(3)
        assert c.replica.wait_for(lambda: settled(c.member, futures[0]), time.monotonic() + 10)
        assert [f._done for f in futures] == [True, True, True]
        assert [f.result(0) for f in futures] == [0, 10, 20] and c.member.calls == {}
    finally:
        c.close()


def test_a_ctrl_c_at_any_line_of_a_send_still_sends_the_message_whole_once():
    """A SIGINT at any line of send_frames (a trace hook sends it at its k-th
    line, for every k) comes out only once the message is whole, sent once."""

    from zcollective._io import _sockets

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://send-whole")
    b.connect("inproc://send-whole")
    frames = [b"head", bytearray(1 << 17), b"middle", b"tail"]  # small, zero-copy, small, small
    try:
        hits = 0
        for k in range(1, 200):
            hit = interrupted_at_line(k, _sockets.__file__, _sockets.send_frames, a, frames)
            got = []
            while b.poll(20):  # (inproc: a message sent is there at once)
                got.append([len(f) for f in b.recv_multipart()])
            # none (interrupted before the first frame: nothing to undo) or one, whole: never half
            # a message (the next would complete it), nor a frame twice
            assert got == [[4, 1 << 17, 6, 4]] or (hit and got == []), (k, got)
            hits += hit
            if not hit:
                break
        assert hits > 10, hits
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
