"""How long a group takes to form with N real processes (issue 35: ``initialize``
at N = 64 in well under a second on this machine).

    python benchmarks/join.py                        # N = 8 ... 64, zcollective-run and by hand
    python benchmarks/join.py --sizes 64 --runs 3 --launch run --bytecode cached

Each process is a script as users write it: ``import zcollective``,
``initialize()``, one ``allreduce``, exit. Launched with ``zcollective-run``
(the clock starts before the launcher does), by hand from Python (N ``subprocess.Popen`` in turn,
with the ``ZCOLLECTIVE_*`` variables) or by hand from a shell (``bash``: N commands ending in
``&``); ``--launch fork`` measures a prototype of what no launcher does yet: one interpreter
imports zcollective, then forks the N ranks, each running this script as ``__main__``.
Reported, median of ``--runs``:

- ready: wall time from the launch until every rank has returned from ``initialize``;
- last in: until the last rank called ``initialize``; join: from then until the last returned;
- ``initialize`` on rank 0 and on the slowest rank (rank 0 waits for the others to start);
- CPU per process: the interpreter's start-up (to the script's first line), ``import zcollective``,
  and ``initialize`` (median over ranks).

``--bytecode source`` compiles every module of zcollective from source in every process (as this
machine's PYTHONDONTWRITEBYTECODE=1 does with a checkout); ``cached`` compiles them once into a
private PYTHONPYCACHEPREFIX and every process reads that, as with an installed package. Prints a
table, writes JSON.
"""

import os
import sys
import time


def worker(out_dir: str) -> None:
    """One rank: nothing is imported before zcollective but what timing needs."""
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    entered, cpu_entered = time.time(), cpu()
    import zcollective

    imported, cpu_imported = time.time(), cpu()
    zcollective.initialize(timeout=120)
    ready, cpu_ready = time.time(), cpu()
    rank, size = zcollective.get_rank(), zcollective.get_world_size()
    assert zcollective.allreduce(1) == size
    zcollective.teardown()
    import json

    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"rank": rank, "entered": entered, "imported": imported, "ready": ready,
                   "cpu_start": cpu_entered, "cpu_import": cpu_imported - cpu_entered,
                   "cpu_init": cpu_ready - cpu_imported}, f)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2])
    sys.exit(0)

import argparse  # noqa: E402  (the driver's imports: kept out of the workers' start-up)
import json  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_TIMEOUT_S = 300
ZYGOTE = """
import os, runpy, sys, traceback
import zcollective  # once, before the ranks are forked
n, script, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
for rank in range(n):
    if os.fork() == 0:
        os.environ["ZCOLLECTIVE_REPLICA_RANK"] = str(rank)
        sys.argv = [script, "--worker", out_dir]
        code = 1
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code or 0
        except BaseException:
            traceback.print_exc()
        os._exit(code)
failed = [os.wait()[1] for _ in range(n)]
sys.exit(1 if any(failed) else 0)
"""  # (no launcher does this: a measure of what one would gain; see issue 35's report)


def environment(tree: str, bytecode: str, cache: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    if bytecode == "cached":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = cache  # (every module's bytecode goes there, the tree stays clean)
        subprocess.run([sys.executable, "-c", "import zcollective.run"], env=env, check=True)  # writes it
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        if os.path.isdir(os.path.join(tree, "zcollective", "__pycache__")):
            sys.exit(f"{tree}/zcollective/__pycache__ would be read: remove it to measure 'source'")
    return env


def launch(how: str, n: int, env: dict[str, str], out_dir: str) -> float:
    """Start the N ranks; returns when the launch began (``time.time()``), after they all ended."""
    me = [os.path.abspath(__file__), "--worker", out_dir]
    began = time.time()
    if how == "run":
        done = subprocess.run([sys.executable, "-m", "zcollective.run", "--no-straggler-summary",
                               "-n", str(n), *me], env=env, capture_output=True, timeout=RUN_TIMEOUT_S,
                              cwd=out_dir)  # (not where python -m would find another tree)
        if done.returncode:
            raise RuntimeError(f"zcollective-run -n {n} failed:\n{done.stdout[-3000:].decode()}"
                               f"{done.stderr[-3000:].decode()}")
        return began
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    at = {"ZCOLLECTIVE_MASTER_ADDR": "127.0.0.1", "ZCOLLECTIVE_MASTER_PORT": str(port),
          "ZCOLLECTIVE_NUM_REPLICAS": str(n)}
    if how == "fork":  # a prototype of a zygote: one interpreter imports zcollective, then forks
        zygote = [sys.executable, "-c", ZYGOTE, str(n), os.path.abspath(__file__), out_dir]
        subprocess.run(zygote, env={**env, **at}, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
        return began
    if how == "shell":  # a shell does not wait for each command's exec, as Popen does
        each = shlex.join([sys.executable, *me])
        script = f"for r in $(seq 0 {n - 1}); do ZCOLLECTIVE_REPLICA_RANK=$r {each} & done; wait"
        subprocess.run(["bash", "-c", script], env={**env, **at}, check=True, capture_output=True,
                       timeout=RUN_TIMEOUT_S)
        return began
    procs = [subprocess.Popen([sys.executable, *me], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={
        **env, **at, "ZCOLLECTIVE_REPLICA_RANK": str(rank)}) for rank in range(n)]
    logs = [p.communicate(timeout=RUN_TIMEOUT_S)[0].decode() for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"by hand, N={n} failed:\n" + "\n".join(log[-1000:] for log in logs if log))
    return began


def measure(how: str, n: int, env: dict[str, str]) -> dict[str, float]:
    out_dir = tempfile.mkdtemp(prefix="zcollective-join-")
    try:
        began = launch(how, n, env, out_dir)
        ranks = []
        for rank in range(n):
            with open(os.path.join(out_dir, f"{rank}.json")) as f:
                ranks.append(json.load(f))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    last_in = max(r["imported"] for r in ranks)
    ready = max(r["ready"] for r in ranks)
    return {
        "ready_s": ready - began, "last_in_s": last_in - began, "join_s": ready - last_in,
        "first_in_s": min(r["entered"] for r in ranks) - began,
        "init_rank0_s": ranks[0]["ready"] - ranks[0]["imported"],
        "init_slowest_s": max(r["ready"] - r["imported"] for r in ranks),
        "cpu_start_s": statistics.median(r["cpu_start"] for r in ranks),
        "cpu_import_s": statistics.median(r["cpu_import"] for r in ranks),
        "cpu_init_s": statistics.median(r["cpu_init"] for r in ranks),
        "cpu_init_rank0_s": ranks[0]["cpu_init"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=os.path.dirname(HERE), help="the zcollective checkout")
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--launch", default="run,hand,shell",
                        help="run (zcollective-run), hand (Popen), shell (bash), fork (a prototype: "
                             "ranks forked from one interpreter that imported zcollective), comma-separated")
    parser.add_argument("--bytecode", default="source", choices=["source", "cached"])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "join.json"))
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="zcollective-pycache-")
    env = environment(os.path.abspath(args.tree), args.bytecode, cache)
    rows: list[dict[str, Any]] = []
    for n in (int(s) for s in args.sizes.split(",")):
        for how in args.launch.split(","):
            runs = []
            for i in range(args.runs):
                runs.append(measure(how, n, env))
                print(f"N={n} {how} run {i + 1}: ready {runs[-1]['ready_s']:.2f} s", file=sys.stderr,
                      flush=True)
            rows.append({"n": n, "launch": how, "runs": runs,
                         **{k: statistics.median(r[k] for r in runs) for k in runs[0]}})
    shutil.rmtree(cache, ignore_errors=True)
    lines = ["| N | launch | ready | last in | join | initialize: rank 0 / slowest "
             "| CPU per process: start-up / import / initialize (rank 0) |",
             "|---|---|---|---|---|---|---|"]
    names = {"run": "zcollective-run", "hand": "by hand (Popen)", "shell": "by hand (bash &)",
             "fork": "forked (prototype)"}
    lines += [f"| {r['n']} | {names[r['launch']]} "
              f"| {r['ready_s']:.2f} s | {r['last_in_s']:.2f} s | {r['join_s'] * 1e3:.0f} ms "
              f"| {r['init_rank0_s']:.2f} / {r['init_slowest_s']:.2f} s "
              f"| {r['cpu_start_s'] * 1e3:.0f} / {r['cpu_import_s'] * 1e3:.0f} / "
              f"{r['cpu_init_s'] * 1e3:.0f} ({r['cpu_init_rank0_s'] * 1e3:.0f}) ms |" for r in rows]
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                   "bytecode": args.bytecode, "load": os.getloadavg(), "rows": rows, "table": table},
                  f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
