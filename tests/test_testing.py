"""zcollective.testing's replicas, forked from a warm zygote process: each is
a process of its own that behaves, to the code it runs, like a fresh
interpreter (environment, signals, exit with atexit handlers, exit codes),
and the harness falls back to fresh interpreters where a fork cannot do."""

import os
import signal
import subprocess
import sys

import _zygote
import pytest

from zcollective.testing import Replicas, run_replicas

RANK_ENV = "ZCOLLECTIVE_REPLICA_RANK"
pytestmark = pytest.mark.skipif(os.environ.get(_zygote.DISABLE_ENV, "") not in ("", "0"),
                                reason=f"{_zygote.DISABLE_ENV} asks for fresh interpreters only")


def _who_am_i():
    import os
    import sys

    return {"ppid": os.getppid(), "pid": os.getpid(), "rank": os.environ[RANK_ENV],
            "extra": os.environ.get("ZC_TEST_EXTRA"), "argv": sys.argv[1:], "cwd": os.getcwd(),
            "stdin": sys.stdin.read()}


def test_a_forked_replica_has_the_environment_it_asked_for_and_a_process_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outs = run_replicas(_who_am_i, 2, initialize=False, env={"ZC_TEST_EXTRA": "x"})
    assert [o["rank"] for o in outs] == ["0", "1"]
    assert all(o["extra"] == "x" and o["cwd"] == str(tmp_path) and o["stdin"] == "" for o in outs)
    assert len({o["pid"] for o in outs} | {os.getpid()}) == 3
    assert all(o["ppid"] != os.getpid() for o in outs), "expected forks of the zygote"
    assert all(o["argv"][0].endswith("payload.pkl") for o in outs)


def test_fresh_interpreters_when_asked_or_when_the_interpreter_must_start_differently(monkeypatch):
    fresh = run_replicas(_who_am_i, 1, initialize=False, env={"PYTHONHASHSEED": "123"})
    assert fresh[0]["ppid"] == os.getpid()
    monkeypatch.setenv(_zygote.DISABLE_ENV, "1")
    assert run_replicas(_who_am_i, 1, initialize=False)[0]["ppid"] == os.getpid()


def _ends_with_atexit_and_a_code(path):
    import atexit
    import sys

    def last_words():
        with open(path, "w") as f:
            f.write("atexit ran")
        print("printed at exit")

    atexit.register(last_words)
    print("hello from the replica")
    sys.exit(3)


def test_a_forked_replica_exits_through_the_interpreter(tmp_path):
    """Its atexit handlers run (a program ending without teardown depends on
    them), its output is captured unbuffered, and its exit code is reported."""
    marker = tmp_path / "atexit"
    with Replicas(_ends_with_atexit_and_a_code, 1, str(marker), initialize=False) as reps:
        (outcome,) = reps.wait(30)
    assert outcome.returncode == 1  # _child reports the SystemExit as the function's error
    assert isinstance(outcome.error, SystemExit) and outcome.error.code == 3
    assert marker.read_text() == "atexit ran"
    assert "hello from the replica" in outcome.output and "printed at exit" in outcome.output


def _wait_for_ctrl_c(ready):
    import time

    try:  # (the file made first, the test's SIGINT could land before the try)
        open(ready, "w").close()
        time.sleep(60)
    except KeyboardInterrupt:
        return "interrupted"
    return "slept"


def _sleep_long():
    import time

    time.sleep(60)


def test_signals_reach_a_forked_replica_as_they_reach_a_fresh_one(tmp_path):
    from conftest import wait_for

    ready = tmp_path / "ready"
    with Replicas(_wait_for_ctrl_c, 1, str(ready), initialize=False) as reps:
        wait_for(ready, watch=reps)
        reps.kill(0, signal.SIGINT)
        (outcome,) = reps.wait(30)
    assert outcome.ok and outcome.value == "interrupted", outcome.describe()
    with Replicas(_sleep_long, 2, initialize=False) as reps:
        reps.kill(1)
        assert reps.join([1], 30)
        proc = reps.procs[1]
        assert proc.poll() == -signal.SIGKILL
        proc.send_signal(signal.SIGKILL)  # after its exit: nothing is sent (its pid may be another's now)
        with pytest.raises(subprocess.TimeoutExpired):
            reps.procs[0].wait(0.2)
        outcomes = reps.wait(0.5)
    assert outcomes[0].timed_out and outcomes[1].returncode == -signal.SIGKILL


def test_a_zygote_that_died_is_replaced():
    zygote = _zygote.zygote(0)
    assert zygote is not None
    first = run_replicas(_who_am_i, 1, initialize=False)[0]["ppid"]
    zygote._proc.kill()
    zygote._proc.wait(10)
    second = run_replicas(_who_am_i, 1, initialize=False)[0]["ppid"]
    assert second not in (first, os.getpid())


def test_requests_and_replies_keep_their_bounds():
    """Messages are length-prefixed and read exactly, however the pipe splits them."""
    r, w = os.pipe()
    try:
        messages = [("spawn", "x" * 70000), ("exited", 12, -9), ("signal", 1, 2)]
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the writer)
            os.close(r)
            for m in messages:
                _zygote._write(w, m)
            os._exit(0)
        os.close(w)
        w = -1
        got = [_zygote._read(r) for _ in range(len(messages) + 1)]
        os.waitpid(pid, 0)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert got == [*messages, None]


def test_the_zygote_kills_its_children_when_the_test_process_goes():
    """A killed test run leaves no replica behind: the zygote sees its
    requests end and kills what it forked."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]);"
            "import zcollective.testing as zt, _zygote; zt.spawner = _zygote.forked;"
            "from zcollective.testing import Replicas; import test_testing as t;"
            "r = Replicas(t._sleep_long, 1, initialize=False); print(r.procs[0].pid, flush=True);"
            "time.sleep(60)")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-c", code, here], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        os.kill(child, 0)  # running
    finally:
        proc.kill()
        proc.wait(10)
    for _ in range(500):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        __import__("time").sleep(0.01)
    pytest.fail(f"replica {child} outlived its test process by 5 s")


def _hash_of_a_string():
    return hash("the same string on every rank")


def test_the_ranks_of_a_group_do_not_share_a_hash_seed():
    """As fresh interpreters: code iterating a set of strings on every rank
    must be caught disagreeing (one zygote per rank index)."""
    if os.environ.get("PYTHONHASHSEED"):
        pytest.skip("PYTHONHASHSEED is set: every interpreter shares it")
    outs = run_replicas(_hash_of_a_string, 3, initialize=False)
    assert len(set(outs)) == 3, outs


def _module_at(directory, name, source):
    path = os.path.join(directory, f"{name}.py")
    with open(path, "w") as f:
        f.write(source)
    sys.path.insert(0, str(directory))
    return __import__(name)


def test_a_module_that_prints_or_stalls_when_imported_changes_nothing(tmp_path, monkeypatch):
    """The zygote imports the function's module: what it prints goes to
    stderr, not into the zygote's replies; one too slow to import is given
    up (with its zygote), and every replica starts once, fresh."""
    ran = tmp_path / "ran"
    loud = _module_at(tmp_path, "zc_loud_module", (
        "print('modules may print when imported')\n"
        "def where():\n    import os\n    return os.getppid()\n"))
    try:
        assert all(ppid != os.getpid() for ppid in run_replicas(loud.where, 2, initialize=False))
        slow = _module_at(tmp_path, "zc_slow_module", (
            "import os, time\n"
            "if os.environ.get('ZC_TEST_FRESH') != 'yes':  # in a zygote\n    time.sleep(2)\n"
            f"def count():\n    open({str(ran)!r}, 'a').write('x')\n    return os.getppid()\n"))
        monkeypatch.setattr(_zygote, "START_TIMEOUT_S", 0.5)
        fresh = run_replicas(slow.count, 2, initialize=False, env={"ZC_TEST_FRESH": "yes"})
        assert fresh == [os.getpid()] * 2
        assert ran.read_text() == "xx"
        monkeypatch.undo()  # new zygotes start within the usual bound, not 0.5 s
        assert all(p != os.getpid() for p in run_replicas(loud.where, 2, initialize=False))  # new zygotes
    finally:
        sys.path.remove(str(tmp_path))


def test_signals_sent_while_replicas_are_forked_reach_them(tmp_path):
    """Requests (a spawn is larger than a pipe writes at once) never interleave."""
    import threading

    big = {"ZC_TEST_BIG": "x" * 200_000}
    with Replicas(_sleep_long, 1, initialize=False) as target:
        stop = threading.Event()

        def pester():
            while not stop.is_set():
                target.procs[0].send_signal(signal.SIGCONT)

        thread = threading.Thread(target=pester)
        thread.start()
        try:
            outs = [run_replicas(_who_am_i, 1, initialize=False, env=big)[0] for _ in range(5)]
        finally:
            stop.set()
            thread.join()
        assert target.procs[0].poll() is None and not _zygote.zygote(0).gone
    assert all(o["ppid"] != os.getpid() for o in outs)


def test_a_forked_test_process_does_not_use_its_parents_zygotes():
    run_replicas(_who_am_i, 1, initialize=False)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os._exit(0 if not _zygote._zygotes else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert run_replicas(_who_am_i, 1, initialize=False)[0]["ppid"] != os.getpid()


def test_free_ports_differ_avoid_the_ephemeral_range_and_each_worker_has_its_own(monkeypatch):
    import zcollective.testing as testing

    try:
        with open(testing.EPHEMERAL_RANGE_FILE) as f:
            ephemeral = int(f.read().split()[0])
    except OSError:
        pytest.skip("no ephemeral port range to stay under on this system")
    seen = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        monkeypatch.setattr(testing, "_next_port", [])
        seen[worker] = [testing.free_port() for _ in range(200)]
        assert len(set(seen[worker])) == 200  # a test asking for many gets different ones
        assert all(ephemeral - testing.PORTS_BELOW_EPHEMERAL <= p < ephemeral for p in seen[worker])
    assert max(seen["gw0"]) < min(seen["gw1"])  # the workers' slices do not overlap


def test_free_port_never_hands_out_a_port_a_launcher_uses_by_default(monkeypatch):
    """CI once gave a test's group port 29457, zcollective's default, while the mpirun test's
    job (no port set) ran on the other worker: the two jobs joined each other and both hung."""
    import zcollective.testing as testing

    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    for reserved in sorted(testing.LAUNCHER_PORTS):
        monkeypatch.setattr(testing, "_next_port", [reserved - 1])
        ports = [testing.free_port() for _ in range(3)]
        if ports[0] != reserved - 1:
            continue  # (that port is outside this system's range, or was busy)
        assert reserved not in ports, (reserved, ports)
    from zcollective.config import DEFAULT_MASTER_PORT

    assert DEFAULT_MASTER_PORT in testing.LAUNCHER_PORTS
