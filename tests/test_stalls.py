"""A stuck job says who and where while it is stuck (issue 32): stall
warnings on rank 0 and on the ranks waiting, the stall's end, a join missing a
rank, the late rank's stack shown by zcollective-run, and status() from a
second thread while the first is blocked. The rules alone first (rule 11 of
the coordinator), without sockets."""

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

from conftest import launched_until_seen, touch, wait_for
from test_coordinator import SESSION, contrib, feed, join_msg, peer

import zcollective as zc
from zcollective._format._bodies import parse_status
from zcollective._protocol._coordinator import Coordinator
from zcollective.testing import Replicas, free_port, report

RUN_S = 60
WARN_S = 1.0  # the tests' warn_after: a second


# -- rule 11, without sockets ------------------------------------------------------------


def running(n, warn_after=WARN_S):
    coord = Coordinator(n, SESSION, max_frames=1000, warn_after=warn_after)
    for r in range(n):
        feed(coord, peer(r), join_msg(r, n))
    return coord


def test_a_stalled_call_is_named_with_each_late_ranks_last_call_then_its_end(caplog):
    coord = running(3)
    for r in range(3):
        feed(coord, peer(r), contrib(r, 0, site="train.py:10"))
    feed(coord, peer(0), contrib(0, 1, site="train.py:88"))
    feed(coord, peer(1), contrib(1, 1, site="train.py:88"))
    start = coord.pending[1].arrived[0]
    assert coord.next_stall() == start + WARN_S
    assert coord.stalls(start + 0.5) == []  # not yet
    [(line, ranks)] = coord.stalls(start + 1.2)
    assert ranks == [2] and "seq 1 allreduce at train.py:88 has waited 1 s for rank 2" in line
    assert "rank 2 (pid 102 on h)'s last call was seq 0 allreduce at train.py:10" in line
    assert coord.stalls(start + 1.5) == [] and coord.next_stall() == start + 2 * WARN_S  # backoff
    assert [len(coord.stalls(start + t)) for t in (2.1, 4.1, 8.1, 100)] == [1, 1, 1, 0]  # four at most
    with caplog.at_level(logging.WARNING, logger="zcollective"):
        feed(coord, peer(2), contrib(2, 1, site="train.py:88"))
    assert any("seq 1 allreduce completed after" in m and "rank 2 was last" in m for m in caplog.messages)
    assert coord.next_stall() is None


def test_no_stall_is_named_when_warnings_are_off_or_nothing_waits():
    coord = running(2, warn_after=None)
    feed(coord, peer(0), contrib(0, 0))
    assert coord.next_stall() is None and coord.stalls(time.monotonic() + 1e6) == []
    coord = running(2)
    assert coord.next_stall() is None  # nothing pending
    for r in range(2):
        feed(coord, peer(r), contrib(r, 0))
    assert coord.next_stall() is None and coord.stalls(time.monotonic() + 1e6) == []


def test_a_join_missing_a_rank_names_who_joined_from_where_and_who_is_missing():
    coord = Coordinator(3, SESSION, max_frames=1000, warn_after=WARN_S)
    feed(coord, peer(0), join_msg(0, 3))
    feed(coord, peer(1), join_msg(1, 3))
    [(line, ranks)] = coord.stalls(coord.started_at + 1.1)
    assert ranks == [2] and "waited 1 s for rank 2 to join" in line
    assert "rank 1 (pid 101 on h) from 10.0.0.9" in line


def test_a_status_reply_and_the_snapshot_say_the_same():
    coord = running(2)
    feed(coord, peer(0), contrib(0, 0, site="a.py:1"))
    out = feed(coord, peer(0), _status_query(0))
    body = parse_status(out[0][1])
    assert "has waited" in body["stall"] and body["missing"] == [1]
    snap = coord.snapshot(time.monotonic())
    assert snap[0]["last_call"]["callsite"] == "a.py:1" and snap[1]["last_call"] is None
    assert [w["seq"] for w in snap[1]["waited_for"]] == [0] and snap[0]["waited_for"] == []


def _status_query(rank):
    from zcollective._format._wire import Kind, Message
    return Message(Kind.STATUS, rank=rank, seq=0, session=SESSION)


# -- between processes ------------------------------------------------------------------


def _capture():
    """The library's warnings in this process, with when they came."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((time.monotonic(), record.getMessage()))
    logging.getLogger("zcollective").addHandler(Keep())
    return records


def one_asleep(sleep_s):
    records = _capture()
    me = zc.get_rank()
    zc.allreduce(1)
    started = time.monotonic()
    if me == 2:
        time.sleep(sleep_s)  # a rank late in its own code
    zc.allreduce(1)
    return [(round(t - started, 2), m) for t, m in records]


def test_a_rank_asleep_is_named_on_rank_0_and_the_waiting_ranks_then_the_end():
    env = {"ZCOLLECTIVE_WARN_AFTER": str(WARN_S)}
    with Replicas(one_asleep, 3, 4.0, env=env) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    for o in outs[:2]:
        lines = o.value
        stalled = [(t, m) for t, m in lines if "has waited" in m]
        assert stalled, report(outs, f"rank {o.rank} said nothing")
        t, m = stalled[0]
        assert t <= WARN_S + 1.0, report(outs, f"rank {o.rank} said it late: {t} s")
        assert "for rank 2" in m and "last call was seq 0 allreduce at test_stalls.py:" in m, m
        assert any("completed after" in m for _, m in lines), report(outs, "no end")
    assert len([m for _, m in outs[1].value if "has waited" in m]) == 1  # a waiting rank: once
    assert any("rank 2 was last" in m for _, m in outs[0].value)
    assert not [m for _, m in outs[2].value if "waited" in m]  # the late one has nothing to say


def joins_late(markers):
    """Rank 2 joins once ranks 0 and 1 have said they wait for it (markers)."""
    records = _capture()
    started = time.monotonic()
    rank = int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
    if rank == 2:
        wait_for(*(os.path.join(markers, f"said{other}") for other in (0, 1)), timeout=30)
    else:
        class SaidIt(logging.Handler):
            def emit(self, record):
                if "to join" in record.getMessage():
                    touch(os.path.join(markers, f"said{rank}"))
        logging.getLogger("zcollective").addHandler(SaidIt())
    zc.initialize()
    zc.allreduce(1)
    return [(round(t - started, 2), m) for t, m in records]


def test_a_join_missing_a_rank_is_warned_about(tmp_path):
    env = {"ZCOLLECTIVE_WARN_AFTER": str(WARN_S)}
    with Replicas(joins_late, 3, str(tmp_path), initialize=False, env=env) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    said0 = [m for _, m in outs[0].value if "to join" in m]
    assert said0 and "for rank 2 to join" in said0[0] and "rank 1 (pid" in said0[0], report(outs, "rank 0")
    said1 = [m for _, m in outs[1].value if "for the others to join" in m]
    assert said1, report(outs, "rank 1 said nothing")


def blocked_and_watched(seen_marker):
    me = zc.get_rank()
    zc.allreduce(1)
    if me == 1:  # late: it comes once rank 0's second thread has seen the status
        wait_for(seen_marker, timeout=30)
        zc.allreduce(1)
        return None
    seen = {}

    def watch():
        time.sleep(1.0)
        try:
            seen.update(zc.status())  # while the main thread is blocked in the call
        finally:
            touch(seen_marker)
    watcher = threading.Thread(target=watch)
    watcher.start()
    zc.allreduce(1)
    watcher.join(10)
    return seen


def test_status_answers_from_a_second_thread_while_the_first_is_blocked(tmp_path):
    with Replicas(blocked_and_watched, 2, str(tmp_path / "seen")) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    seen = outs[0].value
    assert seen["state"] == "running", seen
    [call] = seen["calls"]
    assert call["seq"] == 1 and call["op"] == "allreduce" and call["waiting_s"] >= 0.5, seen
    assert "test_stalls.py:" in call["callsite"], seen
    late = seen["ranks"][1]
    assert late["last_call"]["seq"] == 0 and [w["seq"] for w in late["waited_for"]] == [1], seen


def test_zcollective_run_shows_the_late_ranks_stack_with_its_sleeping_line(tmp_path):
    job, shown = tmp_path / "late.py", tmp_path / "shown"
    job.write_text(textwrap.dedent(f"""\
        import os, time
        import zcollective as zc
        zc.initialize()
        zc.allreduce(1)
        end = time.monotonic() + 30  # (its stack shown: the test says so with {shown})
        while zc.get_rank() == 1 and not os.path.exists({str(shown)!r}) and time.monotonic() < end:
            time.sleep(0.01)  # line 7: where rank 1 is
        zc.allreduce(1)
        zc.teardown()
    """))
    env = {**os.environ, "ZCOLLECTIVE_WARN_AFTER": str(WARN_S)}
    returncode, out = launched_until_seen(
        [sys.executable, "-m", "zcollective.run", "-n", "2", "--master-port", str(free_port()), str(job)],
        lambda line: line.startswith("[1]") and "late.py" in line and "line 7" in line, str(shown),
        RUN_S, env=env)
    assert returncode == 0, out
    assert "rank 1 is late in a call the others wait for" in out, out
    stack = [line for line in out.splitlines() if line.startswith("[1]") and "late.py" in line]
    assert any("line 7" in line for line in stack), out


def test_a_healthy_run_prints_no_warning():
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    proc = subprocess.run([sys.executable, "-m", "zcollective.run", "-n", "4", "--master-port",
                           str(free_port()), os.path.join(examples, "train_linear_regression.py")],
                          capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "waited" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr


def test_a_stall_never_signals_a_rank_that_opted_out_of_stacks(tmp_path):
    """ZCOLLECTIVE_STACKS=0 leaves SIGUSR1 alone: the launcher must not send it
    (its default action would end the rank)."""
    job = tmp_path / "late.py"
    job.write_text(textwrap.dedent("""\
        import time
        import zcollective as zc
        zc.initialize()
        zc.allreduce(1)
        if zc.get_rank() == 1:
            time.sleep(3)
        zc.allreduce(1)
        zc.teardown()
    """))
    env = {**os.environ, "ZCOLLECTIVE_WARN_AFTER": str(WARN_S), "ZCOLLECTIVE_STACKS": "0"}
    proc = subprocess.run([sys.executable, "-m", "zcollective.run", "-n", "2", "--master-port",
                           str(free_port()), str(job)], capture_output=True, text=True, timeout=RUN_S,
                          env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "has waited" in out and "where its threads are" not in out, out


def test_status_of_a_group_closed_to_form_the_next_one_says_so():
    group = zc.Group(size=1, env={})
    try:
        group._life.close_to_form(quick=True)
        assert group.status()["state"] == "forming"
    finally:
        group.teardown()
