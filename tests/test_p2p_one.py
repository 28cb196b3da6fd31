"""Point to point in a group of one (issue 46, defects 1-3), each made three ways: a script run
on its own (a subprocess with no group in its environment), an explicit ``Group(rank=0,
size=1)``, and a sub-group of one (``split`` of a group of two): its window is the setting's, not
0 bytes (1); its recv, probe, send and a receive future's ``result(timeout)`` wait, and another
thread's send ends the wait (2); a point-to-point future that times out says so as a blocking
recv does and takes its receive back, in every group size (3)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import zcollective as zc
from zcollective.testing import run_replicas

WINDOW = 1000  # ZCOLLECTIVE_MAIL_WINDOW_BYTES of every group here
LATE_S = 0.4  # another thread sends (or receives) this late
ENV = {"ZCOLLECTIVE_MAIL_WINDOW_BYTES": str(WINDOW)}
HOW = ["script", "group", "subgroup"]
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def window(g):
    """Defect 1: three small sends to oneself are done at once, a blocking one returns; a second
    message past the window waits (so the window is WINDOW bytes, neither 0 nor unbounded)."""
    me = g.rank if hasattr(g, "rank") else g.get_rank()
    small = [g.send_async(i, me, tag=1) for i in range(3)]
    out = {"small done": [f.done() for f in small]}
    try:
        g.send("blocking", me, tag=1, timeout=5)
        out["blocking"] = "sent"
    except zc.CollectiveError as exc:
        out["blocking"] = str(exc)
    out["received"] = [g.recv(me, 1, timeout=5) for _ in range(4)]
    first = g.send_async(b"a" * 600, me, tag=2)
    second = g.send_async(b"b" * 600, me, tag=2)  # 1,200 bytes unreceived: past the window
    out["past the window"] = [first.done(), second.done()]
    g.recv(me, 2, timeout=5)
    out["once received"] = second.done()
    g.recv(me, 2, timeout=5)
    return out


def _later(fn, *args, **kwargs):
    thread = threading.Timer(LATE_S, fn, args, kwargs)
    thread.start()
    return thread


def _timed(fn):
    start = time.monotonic()
    try:
        value = fn()
    except zc.CollectiveError as exc:
        value = f"{type(exc).__name__}: {exc}"
    return value, round(time.monotonic() - start, 2)


def waits(g):
    """Defect 2: each wait ends when another thread of the process acts, LATE_S later."""
    me = g.rank if hasattr(g, "rank") else g.get_rank()
    out = {}
    t = _later(g.send, "to recv", me, tag=5)
    out["recv"] = _timed(lambda: g.recv(me, 5, timeout=10))
    t.join()
    t = _later(g.send, "to probe", me, tag=6)
    out["probe"] = _timed(lambda: g.probe(me, 6, timeout=10).tag)
    t.join()
    _timed(lambda: g.recv(me, 6, timeout=5))  # (each wait's outcome said: none raises here)
    future = g.recv_async(me, 7)
    t = _later(g.send, "to a future", me, tag=7)
    out["future"] = _timed(lambda: future.result(timeout=10))
    t.join()
    g.send_async(b"a" * 600, me, tag=8)  # the window is full: the next send waits for a receive
    t = _later(g.recv, me, 8, timeout=10)
    out["send"] = _timed(lambda: g.send(b"b" * 600, me, tag=8, timeout=10))
    t.join()
    _timed(lambda: g.recv(me, 8, timeout=5))
    out["nobody"] = _timed(lambda: g.recv(me, 9, timeout=1))[1]  # nobody sends: its whole timeout
    return out


def future_timeout(g, source):
    """Defect 3: a receive future's timeout says what a blocking recv's says and takes the
    receive back; the message that comes after goes to the next receive. ``source`` sends tag 9
    once told (``tell``)."""
    future = g.recv_async(source, 9)
    try:
        future.result(timeout=0.5)
        said = "no timeout"
    except zc.CollectiveTimeoutError as exc:
        said = str(exc)
    return said, future


def _state(future):
    return repr(future.exception(0)) if future.done() else "pending"


def _checks(g, which):
    me = g.rank if hasattr(g, "rank") else g.get_rank()
    if which == "window":
        return window(g)
    if which == "waits":
        return waits(g)
    said, future = future_timeout(g, me)
    g.send("after", me, tag=9, timeout=5)
    return {"said": said, "next recv": _timed(lambda: g.recv(me, 9, timeout=2))[0], "future": _state(future)}


SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import zcollective as zc
import test_p2p_one as t
zc.initialize()
print("RESULT" + json.dumps(t._checks(zc, {which!r})))
zc.teardown()
"""


def _alone(which):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ZCOLLECTIVE_", "ADAPTDL_", "MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(ENV, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=TESTS_DIR, which=which)], env=env,
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[0][len("RESULT"):])


def _explicit(which):
    with zc.Group(rank=0, size=1, env=ENV) as g:
        return json.loads(json.dumps(_checks(g, which)))


def _in_subgroup(which):
    sub = zc.split(zc.get_rank())
    try:
        return json.loads(json.dumps(_checks(sub, which)))
    finally:
        sub.teardown()


def _run(how, which):
    """What each group of one made ``how`` said (two sub-groups of one: two)."""
    if how == "script":
        return [_alone(which)]
    if how == "group":
        return run_replicas(_explicit, 1, which, initialize=False, timeout=60)
    return run_replicas(_in_subgroup, 2, which, env=ENV, timeout=60)


@pytest.mark.parametrize("how", HOW)
def test_a_group_of_one_has_the_window_its_setting_says(how):
    """Before: its window was 0 bytes (the second send_async stayed pending, the blocking send
    raised at once '... fill its window (0 bytes: ZCOLLECTIVE_MAIL_WINDOW_BYTES)')."""
    for out in _run(how, "window"):
        _window_said(out)


def _window_said(out):
    assert out["small done"] == [True, True, True], out
    assert out["blocking"] == "sent", out
    assert out["received"] == [0, 1, 2, "blocking"], out
    assert out["past the window"] == [True, False] and out["once received"], out


@pytest.mark.parametrize("how", HOW)
def test_a_group_of_one_waits_for_another_thread(how):
    """Before: recv, probe, a receive future's result and a send short of credit raised at once
    (after 0.000 s) though another thread sent (or received) LATE_S later."""
    for out in _run(how, "waits"):
        _waits_said(out)


def _waits_said(out):
    assert out["recv"][0] == "to recv", out
    assert out["probe"][0] == 6, out
    assert out["future"][0] == "to a future", out
    assert out["send"][0] is None, out
    for name in ("recv", "probe", "future", "send"):
        assert LATE_S * 0.5 <= out[name][1] < 8, (name, out)
    assert 0.9 <= out["nobody"] < 5, out


@pytest.mark.parametrize("how", HOW)
def test_a_point_to_point_future_that_times_out_says_so_and_takes_its_receive_back(how):
    """Before: 'seq -1 call timed out after 0.5 s on rank 0: every rank arrived and the coordinator
    (rank 0) sent the result, ...', and the receive stayed posted (it took the next message)."""
    for out in _run(how, "future"):
        _future_said(out)


def _future_said(out):
    assert out["said"].startswith("rank 0: recv(source=0, tag=9) timed out after 0.5 s: no matching "
                                  "message came"), out
    assert out["next recv"] == "after", out
    assert "CollectiveTimeoutError" in out["future"], out


def _between_two():
    me = zc.get_rank()
    if me == 1:
        zc.barrier()
        zc.send("after", 0, tag=9)
        zc.barrier()
        return None
    said, future = future_timeout(zc, 1)
    zc.barrier()
    got = _timed(lambda: zc.recv(1, 9, timeout=10))[0]
    zc.barrier()
    return {"said": said, "next recv": got, "future": _state(future)}


def test_a_future_that_times_out_between_two_ranks_says_so_and_takes_its_receive_back():
    """Defect 3 in a group of two (its rank 0's receive future)."""
    out = run_replicas(_between_two, 2, timeout=60)[0]
    assert out["said"].startswith("rank 0: recv(source=1, tag=9) timed out after 0.5 s: no matching "
                                  "message came"), out
    assert out["next recv"] == "after", out
    assert "CollectiveTimeoutError" in out["future"], out
