"""Issue 46's mpi4py features between real processes, with and without a secret, on the default
group (module level) and on a sub-group: PROC_NULL, ssend (done only once the receiver's program
took the message; a timeout says so; PeerEndedError when the receiver ends without taking it),
mprobe/improbe (two threads probing one source never get each other's message), and cancel() of
an unmatched receive (nothing lost)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import touch, wait_for

import zcollective as zc
from zcollective.testing import Replicas, report, run_replicas

SECRETS = {"no secret": {}, "secret": {"ZCOLLECTIVE_SECRET": "the mpi4py features' secret"}}
LATE_S = 0.6  # the receiver takes an ssend's message this late
MESSAGES = 60  # per thread, in the matched-probe race


def _timed(fn):
    start = time.monotonic()
    value = fn()
    return value, time.monotonic() - start


def proc_null(g):
    st = zc.Status()
    out = {"recv": g.recv(zc.PROC_NULL, 3, status=st), "status": (st.source, st.tag, st.nbytes)}
    g.send("x", zc.PROC_NULL)
    g.ssend("x", zc.PROC_NULL, 4)
    out["futures"] = [f.done() for f in (g.send_async(1, zc.PROC_NULL), g.ssend_async(1, zc.PROC_NULL),
                                         g.recv_async(zc.PROC_NULL))]
    out["probe"] = g.probe(zc.PROC_NULL).source, g.iprobe(zc.PROC_NULL).source
    m = g.mprobe(zc.PROC_NULL)
    out["mprobe"] = (m.source, bool(m), m.recv(), m.recv(), bool(m), g.improbe(zc.PROC_NULL) is m)
    out["sendrecv"] = g.sendrecv("x", zc.PROC_NULL, zc.PROC_NULL)
    return out


def ssend(g):
    """Rank 0 ssends rank 1 a message that rank 1 receives LATE_S after a barrier: done only then."""
    r, out = g.rank if isinstance(g, zc.Group) else g.get_rank(), {}
    if r == 0:
        g.barrier()
        out["plain send"] = _timed(lambda: g.send("plain", 1, tag=1))[1]
        out["ssend"] = _timed(lambda: g.ssend("sync", 1, tag=2, timeout=20))[1]
        future = g.ssend_async("async", 1, tag=3)
        g.barrier()  # rank 1 has not received it
        out["pending before"] = future.done()
        g.barrier()  # rank 1 received it
        future.result(20)
        out["done after"] = future.done()
        try:
            g.ssend("unreceived", 1, tag=4, timeout=0.5)
            out["timeout"] = "no timeout"
        except zc.CollectiveTimeoutError as exc:
            out["timeout"] = str(exc)
        g.barrier()
    elif r == 1:
        g.barrier()
        time.sleep(LATE_S)
        out["got"] = [g.recv(0, 1, timeout=20), g.recv(0, 2, timeout=20)]
        g.barrier()
        g.barrier()
        out["got"].append(g.recv(0, 3, timeout=20))
        g.barrier()
        out["got"].append(g.recv(0, 4, timeout=20))  # (the timed-out one: sent, still received)
    else:
        for _ in range(4):
            g.barrier()
    return out


def matched(g):
    """Rank 1 sends rank 0 2 * MESSAGES messages of two tags, then ssends a last one; once that
    one is here, two threads of rank 0 each take MESSAGES with mprobe(1, ANY_TAG) and receive them
    later: each gets the message it probed, and no message twice."""
    r = g.rank if isinstance(g, zc.Group) else g.get_rank()
    if r == 1:
        for i in range(2 * MESSAGES):
            g.send((i, i % 2 + 5, "x" * (i % 7)), 0, tag=i % 2 + 5)
        g.ssend("last", 0, tag=9)
        return None
    if r != 0:
        return None
    got, mismatched = [], []
    deadline = time.monotonic() + 20
    while g.iprobe(1, 9) is None and time.monotonic() < deadline:  # all here: each probe finds its
        time.sleep(0.01)  # message among those arrived (none arrives to a probe posted before)

    def take():
        for _ in range(MESSAGES):
            m = g.mprobe(1, zc.ANY_TAG, timeout=30)
            tag, size = m.tag, m.nbytes
            value = m.recv() if len(got) % 2 else m.recv_async().result(5)
            if value[1] != tag or bool(m):
                mismatched.append((tag, size, value))
            got.append(value[0])

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    deadline, m = time.monotonic() + 20, None
    while not m and time.monotonic() < deadline:
        m = g.improbe(1, 9)
    status = zc.Status()
    last = m.recv(status)
    try:
        m.recv()
        again = "received twice"
    except zc.CollectiveError as exc:
        again = str(exc)
    return {"unique": sorted(got) == list(range(2 * MESSAGES)), "mismatched": mismatched, "last": last,
            "status": (status.source, status.tag), "again": again}


def cancel(g):
    r = g.rank if isinstance(g, zc.Group) else g.get_rank()
    out = {}
    if r == 0:
        future = g.recv_async(1, 8)
        out["cancel"] = (future.cancel(), future.cancelled(), future.cancel(), future.done())
        try:
            future.result(1)
        except Exception as exc:  # noqa: BLE001
            out["result"] = type(exc).__name__
        g.barrier()  # now rank 1 sends
        out["next recv"] = g.recv(1, 8, timeout=20)
        matched_future = g.recv_async(1, 9)
        g.barrier()
        matched_future.result(20)
        out["matched"] = matched_future.cancel(), matched_future.cancelled()
        out["send"] = g.send_async("s", 1, tag=10).cancel()
        out["collective"] = (b := g.barrier_async()).cancel()
        b.result(20)
    elif r == 1:
        g.barrier()
        g.send("not lost", 0, tag=8)
        g.send("matched", 0, tag=9)
        g.barrier()
        g.recv(0, 10, timeout=20)
        g.barrier()
    else:
        for _ in range(3):
            g.barrier()
    return out


CHECKS = {"proc_null": proc_null, "ssend": ssend, "matched": matched, "cancel": cancel}


def _run(which, where):
    if where == "module":
        return zc.get_rank(), CHECKS[which](zc)
    sub = zc.split(0, key=-zc.get_rank())  # ranks reversed: the sub-group's rank 0 is world rank 2
    try:
        return sub.rank, CHECKS[which](sub)
    finally:
        sub.teardown()


def _outs(which, where, secret):
    """Each rank's out, in the order of its rank in the group the checks ran on."""
    return [out for _, out in sorted(run_replicas(_run, 3, which, where, env=SECRETS[secret], timeout=120))]


@pytest.mark.parametrize("where", ["module", "subgroup"])
@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_proc_null_completes_at_once_doing_nothing(secret, where):
    for out in _outs("proc_null", where, secret):
        assert out["recv"] is None and out["status"] == (zc.PROC_NULL, zc.ANY_TAG, 0), out
        assert out["futures"] == [True, True, True], out
        assert out["probe"] == (zc.PROC_NULL, zc.PROC_NULL), out
        assert out["mprobe"] == (zc.PROC_NULL, True, None, None, True, True), out
        assert out["sendrecv"] is None, out


@pytest.mark.parametrize("where", ["module", "subgroup"])
@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_ssend_is_done_only_once_the_receiver_took_its_message(secret, where):
    outs = _outs("ssend", where, secret)
    sender, receiver = outs[0], outs[1]
    assert receiver["got"] == ["plain", "sync", "async", "unreceived"], outs
    assert sender["plain send"] < LATE_S / 2 <= sender["ssend"], outs
    assert sender["pending before"] is False and sender["done after"] is True, outs
    assert sender["timeout"].startswith("rank 0: ssend(dest=1, tag=4) timed out after 0.5 s: rank 1's "
                                        "program has not received its message yet"), outs


@pytest.mark.parametrize("where", ["module", "subgroup"])
@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_two_threads_matched_probing_one_source_each_get_the_message_they_probed(secret, where):
    out = _outs("matched", where, secret)[0]
    assert out["unique"] and out["mismatched"] == [], out
    assert out["last"] == "last" and out["status"] == (1, 9), out
    assert "was received already" in out["again"], out


@pytest.mark.parametrize("where", ["module", "subgroup"])
@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_a_cancelled_receive_loses_no_message_and_only_an_unmatched_one_cancels(secret, where):
    out = _outs("cancel", where, secret)[0]
    assert out["cancel"] == (True, True, True, True) and out["result"] == "CancelledError", out
    assert out["next recv"] == "not lost", out
    assert out["matched"] == (False, False) and out["send"] is False and out["collective"] is False, out


def ends_with_an_ssend_unreceived(markers):
    zc.initialize()
    r = zc.get_rank()
    if r == 1:
        deadline = time.monotonic() + 20
        while zc.iprobe(0, 1) is None and time.monotonic() < deadline:  # (arrived, never received)
            time.sleep(0.01)
        return "ended"
    if r == 0:
        start = time.monotonic()
        try:
            zc.ssend("never received", 1, tag=1, timeout=30)
            said = "done"
        except zc.CollectiveError as exc:
            said = f"{type(exc).__name__}: {exc}"
        touch(os.path.join(markers, "done"))
        return said, time.monotonic() - start
    wait_for(os.path.join(markers, "done"), timeout=60)
    return None


def test_an_ssend_whose_receiver_ends_without_taking_it_raises_peer_ended(tmp_path):
    with Replicas(ends_with_an_ssend_unreceived, 3, str(tmp_path), initialize=False) as reps:
        outs = reps.wait(60)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    said, took = outs[0].value
    assert said.startswith("PeerEndedError: rank 0: ssend(dest=1, tag=1) cannot complete: rank 1 ended its "
                           "program"), report(outs, said)
    assert took < 20, report(outs, f"took {took:.1f} s")


def on_oneself(g):
    """mpi4py's sequences on one rank (its COMM_SELF tests): ssends to oneself done as received,
    a probe's status, improbe with nothing here, a matched probe received as a future."""
    me, out = g.rank if isinstance(g, zc.Group) else g.get_rank(), {}
    receives = [g.recv_async(me, tag) for tag in (1, 2, 3)]
    for tag in (3, 2, 1):
        g.ssend(f"tag {tag}", me, tag, timeout=10)
    out["received"] = [r.result(5) for r in receives]
    sends = [g.ssend_async(i, me, 0) for i in range(6)]
    out["none done"] = not any(s.done() for s in sends)
    out["first three"] = [g.recv(me, 0, timeout=5) for _ in range(3)], [s.done() for s in sends]
    out["last three"] = [g.recv(me, 0, timeout=5) for _ in range(3)], all(s.done() for s in sends)
    status = zc.Status()
    out["iprobe empty"] = g.iprobe(zc.ANY_SOURCE, zc.ANY_TAG, status), (status.source, status.tag)
    out["improbe empty"] = g.improbe(zc.ANY_SOURCE, zc.ANY_TAG, status), (status.source, status.tag)
    request = g.ssend_async("probed", me, 123)
    out["probe"] = g.probe(zc.ANY_SOURCE, zc.ANY_TAG, status).tag, (status.source, status.tag)
    out["iprobe"] = g.iprobe(zc.ANY_SOURCE, zc.ANY_TAG, status).tag, request.done()
    m = g.mprobe(me, 123)
    out["mprobe"] = bool(m), request.done()  # matched: counts as received
    future = m.recv_async()
    out["matched received"] = bool(m), future.result(5), (future.status.source, future.status.tag)
    pending = g.recv_async(me, 4)
    out["cancelled"] = pending.cancel()
    g.send("for the next", me, 4)
    out["next"] = g.recv(me, 4, timeout=5)
    return out


SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import zcollective as zc
import test_p2p_mpi as t
zc.initialize()
print("RESULT" + json.dumps(t.on_oneself(zc)))
zc.teardown()
"""


def _alone():
    """on_oneself in a script run on its own (no group in its environment): the module API."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ZCOLLECTIVE_", "ADAPTDL_", "MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests)], env=env, capture_output=True,
                          text=True, timeout=60)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return [json.loads(lines[0][len("RESULT"):])]


def _oneself(how):
    if how == "group":
        with zc.Group(rank=0, size=1) as g:
            return on_oneself(g)
    sub = zc.split(zc.get_rank())
    try:
        return on_oneself(sub)
    finally:
        sub.teardown()


@pytest.mark.parametrize("how", ["script", "group", "subgroup"])
def test_mpi4py_sequences_on_a_group_of_one(how):
    outs = (_alone() if how == "script" else run_replicas(_oneself, 1, how, initialize=False, timeout=60)
            if how == "group" else run_replicas(_oneself, 2, how, timeout=60))
    for out in json.loads(json.dumps(outs)):  # (as the script's, through JSON: tuples as lists)
        assert out["received"] == ["tag 1", "tag 2", "tag 3"], out
        assert out["none done"], out
        assert out["first three"] == [[0, 1, 2], [True] * 3 + [False] * 3], out
        assert out["last three"] == [[3, 4, 5], True], out
        assert out["iprobe empty"] == [None, [zc.ANY_SOURCE, zc.ANY_TAG]], out
        assert out["improbe empty"] == [None, [zc.ANY_SOURCE, zc.ANY_TAG]], out
        assert out["probe"] == [123, [0, 123]] and out["iprobe"] == [123, False], out
        assert out["mprobe"] == [True, True], out
        assert out["matched received"] == [False, "probed", [0, 123]], out
        assert out["cancelled"] and out["next"] == "for the next", out


def tears_down_with_an_ssend_unreceived():
    r = zc.get_rank()
    if r == 0:
        future = zc.ssend_async("never received", 1, tag=1)
        zc.barrier()
        try:
            future.result(20)
            return "done"
        except zc.CollectiveError as exc:
            return f"{type(exc).__name__}: {exc}"
    zc.barrier()
    deadline = time.monotonic() + 20
    while zc.iprobe(0, 1) is None and time.monotonic() < deadline:  # (here, never received)
        time.sleep(0.01)
    zc.teardown()
    return "torn down"


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_an_ssend_whose_receiver_tears_down_without_taking_it_raises_peer_ended(secret):
    """Teardown drops what no receive takes: a plain send is done once sent, an ssend is told."""
    outs = run_replicas(tears_down_with_an_ssend_unreceived, 2, env=SECRETS[secret], timeout=60)
    assert outs[0].startswith("PeerEndedError: rank 0: ssend(dest=1, tag=1) cannot complete: rank 1 called "
                              "teardown without receiving its message"), outs
