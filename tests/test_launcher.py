"""zcollective-run end to end: environment, prefixed output, exit codes, a
failing rank, Ctrl-C, several hosts by hand, bad arguments."""

import ast
import collections
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import zcollective
from zcollective.testing import free_port

RUN = [sys.executable, "-m", "zcollective.run"]


def script(tmp_path, body, name="job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def launch(args, timeout=60, **kwargs):
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=timeout, **kwargs)


def test_starts_replicas_with_environment_and_prefixed_output(tmp_path):
    job = script(tmp_path, """
        import os, sys, zcollective
        zcollective.initialize()
        total = zcollective.allreduce(1)
        print("rank", zcollective.get_rank(), "local", os.environ["ZCOLLECTIVE_LOCAL_RANK"],
              "total", total, "secret", len(os.environ["ZCOLLECTIVE_SECRET"]), "args", sys.argv[1:])
        zcollective.teardown()
    """)
    proc = launch(["-n", "3", job, "--flag", "x"])
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert lines == [f"[{r}] rank {r} local {r} total 3 secret 64 args ['--flag', 'x']" for r in range(3)]


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path):
    job = script(tmp_path, """
        import sys, time, zcollective
        zcollective.initialize()
        if zcollective.get_rank() == 1:
            print("giving up: disk full")
            sys.exit(3)
        time.sleep(60)  # would outlive the test without the launcher's grace period
    """)
    start = time.monotonic()
    proc = launch(["-n", "3", "--grace", "1", job])
    assert proc.returncode == 3
    assert ("zcollective-run: rank 1 exited with code 3 (giving up: disk full); stopping the others "
            "in 1 s") in proc.stderr
    assert time.monotonic() - start < 30


def test_the_summary_quotes_the_users_exception_not_what_the_library_said_after_it(tmp_path):
    """Rank 0 dies of a KeyError without teardown: the library's ending notice comes after the
    traceback, and the summary used to quote it instead of the user's exception."""
    job = script(tmp_path, """
        import logging, time, zcollective
        logging.basicConfig(level=logging.INFO)  # the library's notices show, after the traceback
        zcollective.initialize()
        zcollective.allreduce(1)
        if zcollective.get_rank() == 0:
            {}["missing key"]
        time.sleep(60)
    """)
    proc = launch(["-n", "2", "--grace", "1", job])
    assert proc.returncode == 1, proc.stderr
    assert "zcollective-run: rank 0 exited with code 1 (KeyError: 'missing key'); stopping" in proc.stderr, (
        proc.stdout + proc.stderr)


def test_version_needs_no_script():
    proc = launch(["--version"])
    assert proc.returncode == 0 and proc.stdout.strip() == f"zcollective {zcollective.__version__}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_replica_and_leaves_no_process(tmp_path, sig):
    pids = tmp_path / "pids"
    pids.mkdir()
    job = script(tmp_path, f"""
        import os, time, zcollective
        zcollective.initialize()
        open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
        while True:
            zcollective.barrier()
            time.sleep(0.05)
    """)
    proc = subprocess.Popen([*RUN, "-n", "3", job], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while len(os.listdir(pids)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir(pids)) == 3
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert b"interrupted; stopping every replica" in err
    for pid in os.listdir(pids):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


def test_several_hosts_by_hand(tmp_path):
    job = script(tmp_path, """
        import os, zcollective
        zcollective.initialize()
        rank = zcollective.get_rank()
        print(rank, os.environ["ZCOLLECTIVE_LOCAL_RANK"], zcollective.allgather(rank))
        zcollective.teardown()
    """)
    port = str(free_port())
    env = dict(os.environ, ZCOLLECTIVE_SECRET="shared-secret-of-the-whole-job")
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", port]
    nodes = [subprocess.Popen([*RUN, *common, "--node-rank", str(i), job], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (1, 0)]
    outs = [n.communicate(timeout=60) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    node1, node0 = sorted(outs[0][0].splitlines()), sorted(outs[1][0].splitlines())
    assert node0 == ["[0] 0 0 [0, 1, 2, 3]", "[1] 1 1 [0, 1, 2, 3]"]
    assert node1 == ["[2] 2 0 [0, 1, 2, 3]", "[3] 3 1 [0, 1, 2, 3]"]


def test_a_launch_on_one_host_names_its_job_and_one_across_hosts_leaves_it_to_the_user(monkeypatch):
    """Each rank of one launch, and a replacement, gets the same name, which no other launch
    running on the host has (its pid); across hosts each launcher is a process of its own."""
    from zcollective.run import Launcher, parse_args

    monkeypatch.delenv("ZCOLLECTIVE_JOB", raising=False)
    one = Launcher(parse_args(["-n", "2", "--no-straggler-summary", "true"]))
    jobs = {one.env_for(rank, rank, 29457, 2)["ZCOLLECTIVE_JOB"] for rank in (0, 1, 1)}
    assert jobs == {f"zcollective-run {os.getpid()}"}
    across = Launcher(parse_args(["--nnodes", "2", "--master-addr", "h0", "--no-straggler-summary", "true"]))
    assert "ZCOLLECTIVE_JOB" not in across.env_for(0, 0, 29457, 2)
    monkeypatch.setenv("ZCOLLECTIVE_JOB", "train-a")  # the user's name wins, as the secret does
    assert one.env_for(0, 0, 29457, 2)["ZCOLLECTIVE_JOB"] == "train-a"


@pytest.mark.parametrize("args, text", [
    (["-n", "0", "x.py"], "-n/--nproc-per-node must be at least 1"),
    (["--nnodes", "2", "x.py"], "--master-addr is required with --nnodes > 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "x.py"], "--node-rank must be from 0 to 1"),
    (["--master-port", "99999", "x.py"], "--master-port must be from 1 to 65535"),
    (["-n", "2", "missing.py"], "no such script: missing.py"),
    ([], "the following arguments are required: script"),
])
def test_bad_arguments_are_clear_errors(args, text):
    proc = launch(args)
    assert proc.returncode == 2 and text in proc.stderr


def test_help_explains_the_launcher():
    proc = launch(["--help"])
    assert proc.returncode == 0
    for word in ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--grace",
                 "--tolerate-lost", "--replace-lost", "current rank"):
        assert word in proc.stdout


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "zcollective-run")
    if not os.path.exists(exe):
        pytest.skip("not installed with pip install -e .")
    assert subprocess.run([exe, "--help"], capture_output=True, timeout=30).returncode == 0


EXAMPLE_RANKS = 3


def _lines_by_rank(stdout):
    """rank -> the lines it printed, in order (the launcher prefixes each with ``[rank] ``)."""
    ranks = {}
    for line in stdout.splitlines():
        rank, _, text = line.partition("] ")
        assert rank.startswith("[") and rank[1:].isdigit(), f"not a rank's line: {line!r}"
        ranks.setdefault(int(rank[1:]), []).append(text)
    return ranks


def _lines_by_prefix(stdout):
    """prefix (``[2``, ``[newcomer 1``) -> the lines printed under it, in order."""
    lines = {}
    for line in stdout.splitlines():
        lines.setdefault(line.split("]")[0], []).append(line.split("] ", 1)[-1])
    return lines


def _every_rank(*lines):
    return {r: [line.format(r=r) for line in lines] for r in range(EXAMPLE_RANKS)}


def _linear_regression_lines():
    """What examples/train_linear_regression.py must print on each rank:
    its training computed here in one process, the shards' sums added in
    rank order as allreduce adds them."""
    n, steps, rate, target = EXAMPLE_RANKS, 200, 0.1, 1e-3
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=5)
    features = rng.normal(size=(4000, 5))
    targets = features @ true_w + 0.01 * rng.normal(size=4000)
    shards = [(features[r::n], targets[r::n]) for r in range(n)]
    weights = np.random.default_rng(42).normal(size=5)
    lines, stop = [], None
    for step in range(steps):
        errors = [x @ weights - y for x, y in shards]
        grad = (shards[0][0].T @ errors[0]).copy()
        for (x, _), error in zip(shards[1:], errors[1:], strict=True):
            grad += x.T @ error
        count = sum(len(y) for _, y in shards)
        weights -= rate * grad / count
        total = float(errors[0] @ errors[0])
        for error in errors[1:]:
            total += float(error @ error)
        loss = total / count
        if step % 20 == 0:
            lines.append(f"rank {{r}}: step {step:3d} loss {loss:.6f}")
        if stop is not None and stop:
            lines.append(f"rank {{r}}: every replica agreed to stop at step {step}, loss {loss:.6f}")
            break
        stop = loss < target
    lines.append(f"rank {{r}}: weights agree across replicas: True; distance to truth "
                 f"{np.linalg.norm(weights - true_w):.4f}")
    return _every_rank(*lines)


def _through_stages(item, n):
    """examples/pipeline.py: each stage adds its rank and doubles."""
    for stage in range(n):
        item = (item + stage) * 2
    return item


def _example_lines():
    """What each example must print with 3 replicas (rank -> lines), computed
    here from what it does; None for those checked otherwise."""
    n = EXAMPLE_RANKS
    texts = ["the quick brown fox", "jumps over the lazy dog", "the end"]
    metrics = [{"rank": r, "accuracy": round(random.Random(r).uniform(0.8, 0.9), 3)} for r in range(n)]
    words = sum((collections.Counter(t.split()) for t in texts), collections.Counter())
    files = [f"part-{i:03d}.csv" for i in range(10)]
    owned = {r: sorted({k for s in range(n) for k in range(s, s + 6) if k % n == r})  # rank s has
             for r in range(n)}  # keys s..s+5; rank k % n owns key k
    return {
        "allgather.py": None,
        "allreduce.py": _every_rank(f"rank {{r}}: sum of 1..{n} = {n * (n + 1) // 2}",
                                    "rank {r}: merged dict = {{'rank0': 0, 'rank1': 10, 'rank2': 20}}"),
        "allreduce_async.py": _every_rank(
            f"rank {{r}}: results in reverse order {[i * n * (n + 1) // 2 for i in reversed(range(4))]}"),
        "alltoall.py": {r: [f"rank {r}: I own keys {owned[r]}"] for r in range(n)},
        "barrier.py": None,
        "elastic_training.py": None,
        "broadcast.py": _every_rank("rank {r}: config from rank 0 = {{'lr': 0.1, 'seed': 1234}}",
                                    f"rank {{r}}: hello from rank {n - 1}: hi from {n - 1}"),
        "gather.py": {0: [f"rank 0: metrics of all ranks {metrics}; mean accuracy "
                          f"{sum(m['accuracy'] for m in metrics) / n:.3f}"]},
        "reduce.py": {0: [f"rank 0: most common words {words.most_common(3)}"]},
        "pipeline.py": {n - 1: [f"rank {n - 1}: the pipeline of {n} stages made "
                                f"{[_through_stages(i, n) for i in range(5)]}"]},
        "per_host_groups.py": _every_rank(f"rank {{r}}: rank {{r}} of {n} on its host, one of 1 hosts, "
                                          f"total {[n * (n + 1) // 2] * 3}"),
        "scatter.py": {r: [f"rank {r}: my files {files[r::n]}"] for r in range(n)},
        "train_linear_regression.py": _linear_regression_lines(),
    }


def test_replace_lost_starts_newcomers_in_the_place_of_killed_ranks_and_training_sees_every_sample():
    """examples/elastic_training.py under --replace-lost: rank 2 is killed at
    step 40 and rank 0 (the coordinator's host) at step 100; the survivors go
    on, the launcher starts a newcomer for each, the group admits them, and
    the job ends with 4 replicas that saw every sample once."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = launch(["-n", "4", "--replace-lost", "2", os.path.join("examples", "elastic_training.py"),
                   "--kill", "2@40", "--kill", "0@100"], cwd=root, timeout=120)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stderr.count("starting a newcomer in its place") == 2, proc.stderr
    _check_elastic(4)(_lines_by_prefix(proc.stdout))
    assert "lost ranks [2] at step 40" in proc.stdout and "lost ranks [0] at step" in proc.stdout


def test_a_newcomer_waiting_where_rank_0_was_is_started_again_where_the_coordinator_moved():
    """Rank 2 dies at step 3, its newcomer waits at rank 0's coordinator; rank 0
    dies at step 6, before the grow at step 10: the survivors host the next
    group at another port, and the launcher starts the waiting newcomer again
    there (it would wait at the dead port for ever): 4 replicas at the end."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = launch(["-n", "4", "--replace-lost", "2", os.path.join("examples", "elastic_training.py"),
                   "--kill", "2@3", "--kill", "0@6"], cwd=root, timeout=120)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stderr.count("again there (it waited at the old one)") == 1, proc.stderr
    _check_elastic(4)(_lines_by_prefix(proc.stdout))


def test_a_newcomer_the_job_no_longer_needs_is_stopped_when_the_job_ends():
    """Rank 2 dies at step 198 of 200: the launcher starts a newcomer, which no
    grow() admits before the survivors end: it is stopped then (it waited its
    whole join timeout, 300 s), and not counted a loss."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = launch(["-n", "3", "--replace-lost", "1", os.path.join("examples", "elastic_training.py"),
                   "--kill", "2@198"], cwd=root, timeout=60)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "the job ended before a grow() admitted newcomer 1: stopping it" in proc.stderr, proc.stderr
    assert "without 1 lost replica" in proc.stderr, proc.stderr


def _check_allgather(lines):
    everyone = {r: ast.literal_eval(lines[r][0].split(" = ", 1)[1]) for r in lines}
    assert sorted(lines) == list(range(EXAMPLE_RANKS)) and all(len(v) == 1 for v in lines.values()), lines
    assert all(v == everyone[0] for v in everyone.values()), everyone
    assert [host for host, _ in everyone[0]] == [socket.gethostname()] * EXAMPLE_RANKS, everyone
    assert len({pid for _, pid in everyone[0]}) == EXAMPLE_RANKS, everyone  # a process each


def _check_barrier(lines):
    """Rank r sleeps 0.2 r s before the barrier: rank 0 waits for the last, rank 2, about 0.4 s."""
    waited = {}
    for r, said in lines.items():
        prefix, _, rest = said[0].partition(" passed the barrier after waiting ")
        assert prefix == f"rank {r}:" and rest.endswith(" s") and len(said) == 1, said
        waited[r] = float(rest[:-2])
    assert sorted(waited) == list(range(EXAMPLE_RANKS)), lines
    assert waited[0] >= 0.25 and waited[0] > waited[2] and waited[1] > waited[2], waited


def _check_elastic(size, ranks=None):
    """Every rank at the end trained every step on as many samples as an
    undisturbed run, in a group of ``size``, to the same loss."""
    def check(lines):
        finals = [line for said in lines.values() for line in said if " trained " in line]
        assert len(finals) == size, lines
        losses = set()
        for line in finals:
            assert " trained 200 steps on 12800 samples (undisturbed: 12800); " in line, line
            assert f"; {size} replicas at the end; " in line, line
            losses.add(line.rsplit(" ", 1)[1])
        assert len(losses) == 1, finals  # the same weights everywhere
        assert sorted(int(line.split()[1][:-1]) for line in finals) == list(range(size)), finals
    return check


BESIDE_EXAMPLES = ("elastic_training.py",)  # asleep most of the time (200 steps of 20 ms): run beside


def test_examples_run_under_the_launcher(tmp_path):
    """Each example, under the launcher with 3 replicas, prints exactly what
    it must: each line of each rank computed here (or, where it shows process
    ids and times, checked for what they must be)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    examples = sorted(f for f in os.listdir(os.path.join(root, "examples")) if f.endswith(".py"))
    expected = _example_lines()
    assert examples == sorted(expected), "an example this test does not know, or one gone"
    checks = {"allgather.py": _check_allgather, "barrier.py": _check_barrier,
              "elastic_training.py": _check_elastic(EXAMPLE_RANKS)}
    beside = {}  # (its output to files: a pipe read only at its end could fill and stop it)
    for name in BESIDE_EXAMPLES:
        out, err = open(tmp_path / f"{name}.out", "w+"), open(tmp_path / f"{name}.err", "w+")  # noqa: SIM115
        args = [*RUN, "-n", str(EXAMPLE_RANKS), os.path.join("examples", name)]
        beside[name] = (subprocess.Popen(args, cwd=root, stdin=subprocess.DEVNULL, stdout=out, stderr=err),
                        out, err)
    try:
        ran = [(name, launch(["-n", str(EXAMPLE_RANKS), os.path.join("examples", name)], cwd=root,
                             timeout=120)) for name in examples if name not in beside]
        for name, (proc, out, err) in beside.items():
            proc.wait(120)
            out.seek(0)
            err.seek(0)
            ran.append((name, subprocess.CompletedProcess([], proc.returncode, out.read(), err.read())))
    finally:
        for proc, out, err in beside.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()
    for name, proc in ran:
        assert proc.returncode == 0, (name, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr, (name, proc.stderr)
        lines = _lines_by_rank(proc.stdout)
        if expected[name] is None:
            checks[name](lines)
        else:
            assert lines == expected[name], (name, proc.stdout, proc.stderr)


# -- losses without --replace-lost: survivors kept, current ranks, the last group's straggler --------

SHRINKING_JOB = """
    import os, signal, sys, time, zcollective
    KILLED, SLOW, KILL_AT, STEPS = {killed}, {slow}, {kill_at}, {steps}
    SLOW_S = 0.03  # the slow rank's own work each step: it arrives last at every call
    zcollective.initialize()
    launched = zcollective.get_rank()
    print(f"launched as {{launched}}")
    step = 0
    while step < STEPS:
        if launched == KILLED and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        if launched == SLOW:
            time.sleep(SLOW_S)
        try:
            zcollective.allreduce(1)
            step += 1
        except zcollective.ReplicaLostError:
            if not {shrinks}:
                raise
            zcollective.shrink()
            print(f"launched as {{launched}}, now rank {{zcollective.get_rank()}} of "
                  f"{{zcollective.get_world_size()}}")
    zcollective.teardown()
"""


def shrinking_job(tmp_path, killed=1, slow=2, kill_at=10, steps=150, shrinks=True):
    """A job of 3 where the rank launched as ``killed`` SIGKILLs itself at step
    ``kill_at``; the survivors shrink (if ``shrinks``) and run on (the rank
    launched as ``slow`` takes 0.03 s a step, so they outlast a grace of 3 s)."""
    return script(tmp_path, SHRINKING_JOB.format(killed=killed, slow=slow, kill_at=kill_at, steps=steps,
                                                 shrinks=shrinks))


def output(proc):
    """A finished launcher's output, for an assertion's message."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


@pytest.fixture(scope="module")
def survivors_went_on(tmp_path_factory):
    """One run for the tests below: rank 1 of 3 killed at step 10, the
    survivors shrink and run on past the grace, without --replace-lost."""
    job = shrinking_job(tmp_path_factory.mktemp("shrink"))
    return launch(["-n", "3", "--grace", "3", job], timeout=120)


def test_survivors_that_shrink_are_kept_and_the_job_exits_0(survivors_went_on):
    proc = survivors_went_on
    assert proc.returncode == 0, output(proc)
    assert "rank 1 was killed by SIGKILL; stopping the others in 3 s unless they go on" in proc.stderr, (
        output(proc))
    assert "the others went on without rank 1 (it was killed by SIGKILL), in a group of 2" in proc.stderr, (
        output(proc))
    assert "stopping rank" not in proc.stderr and "starting a newcomer" not in proc.stderr, output(proc)
    assert ("the job went on without 1 lost replica (rank 1 was killed by SIGKILL); every other exited 0"
            in proc.stderr), output(proc)


def test_each_line_is_prefixed_with_the_current_rank(survivors_went_on):
    """Launched as 2, the process is rank 1 after the shrink: its lines say [2] before, [1] after."""
    lines = survivors_went_on.stdout.splitlines()
    assert "[2] launched as 2" in lines, output(survivors_went_on)
    assert "[1] launched as 2, now rank 1 of 2" in lines, output(survivors_went_on)
    assert "[0] launched as 0, now rank 0 of 2" in lines, output(survivors_went_on)
    assert not any(line.startswith("[1] launched as 1,") for line in lines), output(survivors_went_on)


def test_the_straggler_line_names_a_rank_of_the_last_group(survivors_went_on):
    """The slow process was rank 2 in the first group and is rank 1 in the last: the summary
    names it by its last rank (rank 2 is no rank of the last group)."""
    summary = [line for line in survivors_went_on.stderr.splitlines() if "slowest" in line]
    assert len(summary) == 1 and summary[0].startswith("zcollective-run: slowest rank 1: "), (
        output(survivors_went_on))


def test_the_straggler_line_never_names_a_killed_rank(tmp_path):
    """The slow rank is killed and the others end with its loss (no shrink): rank 0's figures
    still name it slowest, and the launcher leaves it out."""
    job = shrinking_job(tmp_path, killed=2, slow=2, shrinks=False)
    proc = launch(["-n", "3", job], timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, output(proc)
    assert "rank 2 was killed by SIGKILL" in proc.stderr, output(proc)
    assert "slowest rank 2" not in proc.stderr, output(proc)


def test_tolerate_lost_keeps_the_others_whatever_the_grace_and_replaces_nobody(tmp_path):
    """--tolerate-lost: with no grace at all the survivors are not stopped, and nobody is
    started in the lost one's place; a program that does not shrink still fails the job."""
    proc = launch(["-n", "3", "--tolerate-lost", "--grace", "0", shrinking_job(tmp_path, steps=40)],
                  timeout=120)
    assert proc.returncode == 0, output(proc)
    assert "rank 1 was killed by SIGKILL; the others may go on without it" in proc.stderr, output(proc)
    assert "the others went on without rank 1" in proc.stderr, output(proc)
    assert "starting a newcomer" not in proc.stderr and "stopping" not in proc.stderr, output(proc)
    assert "[1] launched as 2, now rank 1 of 2" in proc.stdout.splitlines(), output(proc)
    rigid = launch(["-n", "3", "--tolerate-lost", shrinking_job(tmp_path, steps=40, shrinks=False)],
                   timeout=120)
    assert rigid.returncode == 128 + signal.SIGKILL, output(rigid)
    assert "went on without" not in rigid.stderr, output(rigid)


def test_a_newcomer_started_by_hand_joins_with_what_the_launcher_prints(tmp_path):
    """The recipe of docs/launching.md: the launcher made the secret; the line it prints
    (address, port, a file holding the secret) is all a newcomer started by hand needs."""
    job = script(tmp_path, """
        import os, time, zcollective
        zcollective.initialize()
        if os.environ.get("ZCOLLECTIVE_JOIN") != "1":
            deadline = time.monotonic() + 60  # bounded: the test fails, not hangs, without a newcomer
            while zcollective.get_world_size() < 3 and time.monotonic() < deadline:
                zcollective.grow()
                time.sleep(0.05)
        print("rank", zcollective.get_rank(), "of", zcollective.get_world_size(),
              "total", zcollective.allreduce(1))
        zcollective.teardown()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZCOLLECTIVE_")}
    launcher = subprocess.Popen([*RUN, "-n", "2", "--tolerate-lost", job], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        hint = launcher.stderr.readline()  # (at its start; EOF if it never says)
        assert "a newcomer started by hand joins this job" in hint, hint
        words = shlex.split(hint.split(" with: ", 1)[1])
        assigned = dict(w.split("=", 1) for w in words if "=" in w and w.startswith("ZCOLLECTIVE_"))
        assert set(assigned) == {"ZCOLLECTIVE_JOIN", "ZCOLLECTIVE_MASTER_ADDR", "ZCOLLECTIVE_MASTER_PORT",
                                 "ZCOLLECTIVE_SECRET_FILE", "ZCOLLECTIVE_JOB"}, hint
        newcomer = subprocess.run(words[len(assigned):], env={**env, **assigned}, capture_output=True,
                                  text=True, timeout=60)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert newcomer.returncode == 0 and newcomer.stdout == "rank 2 of 3 total 3\n", (
        newcomer.stdout, newcomer.stderr)
    assert launcher.returncode == 0, (out, err)
    assert sorted(out.splitlines()) == ["[0] rank 0 of 3 total 3", "[1] rank 1 of 3 total 3"], (out, err)
