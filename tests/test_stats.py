"""Who is slow: the statistics every rank keeps, rank 0's view of how late
each rank arrives, the one-line-per-call log, and the launcher's summary."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from pair import Pair

import zcollective as zc
from zcollective._format import _serialize
from zcollective._protocol._ops import Op
from zcollective._protocol._stats import SAMPLES, CallStats, Lateness, percentiles, slowest


def test_percentiles_take_the_median_and_p90_of_what_was_kept():
    assert percentiles([]) == {"median": None, "p90": None}
    assert percentiles(range(100, 0, -1)) == {"median": 51, "p90": 91}
    stats = CallStats()
    for i in range(SAMPLES + 10):
        stats.record("allreduce", 3, 5, float(i))
    s = stats.summary()["allreduce"]
    assert (s["calls"], s["bytes_sent"], s["bytes_received"]) == (SAMPLES + 10, 3 * (SAMPLES + 10),
                                                                    5 * (SAMPLES + 10))
    assert s["wait_median_s"] == 10 + SAMPLES // 2  # only the last SAMPLES calls are kept


def test_lateness_is_measured_from_the_first_arrival_and_names_who_was_last():
    late = Lateness(3)
    for i in range(10):
        late.record({0: 1.0, 1: 1.0 + 0.001 * i, 2: 1.5})  # rank 2 always last, half a second late
    s = late.summary()
    assert s[2]["late_median_s"] == 0.5 and s[2]["last_share"] == 1.0
    assert s[0]["late_median_s"] == 0.0 and s[0]["last_share"] == 0.0
    assert slowest(s) == ("slowest rank 2: its contributions arrived a median 500 ms (p90 500 ms) "
                          "after the first; last in 100% of calls")
    assert slowest(Lateness(2).summary()) is None  # nothing recorded: nothing to say


def test_a_member_counts_its_calls_and_bytes_and_logs_each_call(caplog):
    pair = Pair(2).joined()
    pair.members[1].log_calls = True
    caplog.set_level(logging.INFO, logger="zcollective.calls")
    for value in (1, 2):
        pair.call_all(Op.ALLREDUCE, [value, value], fn=lambda a, b: a + b)
    ops = pair.members[1].stats.summary()
    assert ops["allreduce"]["calls"] == 2
    sent = len(_serialize.dumps(1)[0]) + len(_serialize.dumps(2)[0])
    assert ops["allreduce"]["bytes_sent"] == sent
    assert ops["allreduce"]["wait_median_s"] >= 0
    lines = [r.getMessage() for r in caplog.records if r.name == "zcollective.calls"]
    assert len(lines) == 2 and lines[0].startswith("zcollective rank 1: seq 0 allreduce at ")
    assert "done, sent" in lines[0] and "waited" in lines[0]
    assert pair.coordinator.lateness.calls == 2


def test_stats_of_a_group_of_one_and_after_teardown():
    group = zc.Group("127.0.0.1", 1, 0, 1)
    group.allreduce(1)
    group.teardown()
    s = group.stats()
    assert s["rank"] == 0 and s["ops"]["allreduce"]["calls"] == 1
    assert s["ranks"] == {0: {"late_median_s": None, "late_p90_s": None, "last_share": None}}


def test_the_launcher_names_the_slowest_rank_and_is_quiet_when_asked(tmp_path):
    job = tmp_path / "slow.py"
    job.write_text(textwrap.dedent("""
        import time, zcollective as zc
        zc.initialize()
        for i in range(20):
            if zc.get_rank() == 2:
                time.sleep(0.02)
            zc.allreduce(i)
        print(zc.stats()["ops"]["allreduce"]["calls"])
    """))  # ends without teardown: rank 0's stats are left at exit all the same
    run = [sys.executable, "-m", "zcollective.run", "-n", "3"]
    proc = subprocess.run([*run, str(job)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0] 20", "[1] 20", "[2] 20"]
    summary = [line for line in proc.stderr.splitlines() if "slowest" in line]
    assert len(summary) == 1 and summary[0].startswith("zcollective-run: slowest rank 2: "), proc.stderr
    quiet = subprocess.run([*run, "--no-straggler-summary", str(job)], capture_output=True, text=True,
                           timeout=60)
    assert quiet.returncode == 0 and "slowest" not in quiet.stderr, quiet.stderr
    json.dumps(zc.__all__)  # stats is public
    assert "stats" in zc.__all__


def test_zcollective_log_calls_prints_one_line_per_call_to_stderr(tmp_path):
    job = tmp_path / "logged.py"
    job.write_text(textwrap.dedent("""
        import zcollective as zc
        zc.initialize()
        zc.allreduce(1)
        zc.broadcast("x")
        zc.teardown()
    """))
    env = {**os.environ, "ZCOLLECTIVE_LOG": "calls"}
    proc = subprocess.run([sys.executable, "-m", "zcollective.run", "-n", "2", str(job)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "waited" in line]
    assert len(lines) == 6, proc.stdout  # 2 ranks x (allreduce, broadcast, teardown)
    assert any(line.startswith("[1] zcollective rank 1: seq 0 allreduce at logged.py:4: done, sent")
               for line in lines), lines
    bad = dict(env, ZCOLLECTIVE_LOG="everything")
    with pytest.raises(ValueError, match="ZCOLLECTIVE_LOG='everything'"):
        zc.config.resolve(env=bad)
