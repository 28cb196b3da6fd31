"""zcollective-run end to end: environment, prefixed output, exit codes, a
failing rank, Ctrl-C, several hosts by hand, bad arguments."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

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
    for word in ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--grace"):
        assert word in proc.stdout


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "zcollective-run")
    if not os.path.exists(exe):
        pytest.skip("not installed with pip install -e .")
    assert subprocess.run([exe, "--help"], capture_output=True, timeout=30).returncode == 0


def test_examples_run_under_the_launcher():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    examples = sorted(f for f in os.listdir(os.path.join(root, "examples")) if f.endswith(".py"))
    assert len(examples) >= 10
    for name in examples:
        proc = launch(["-n", "3", os.path.join("examples", name)], cwd=root, timeout=120)
        assert proc.returncode == 0, (name, proc.stdout, proc.stderr)
        assert "[2] " in proc.stdout or name in ("gather.py", "reduce.py"), name
