"""Small operations, interleaved: the floor and one or more checkouts of
zcollective, run in turn, several times, so that a noisy machine slows them
alike. For judging a change to the hot path (issue 11).

    python benchmarks/small_ops.py                              # this tree against the floor
    python benchmarks/small_ops.py --trees before=/tmp/old,after=. --sizes 2,4 --reps 5

Each run starts N fresh processes on loopback. Per process: ``--iters``
``allreduce(rank + 1)`` with a ``__main__`` function (as users write them),
half as many ``broadcast`` of a small dict, and rounds of 64 pipelined
``allreduce_async``; its CPU time per allreduce (``getrusage``, all
threads). Reported: for each tree and N, the median over ``--reps`` of the
slowest rank's median, its ratio to the floor's median, and rank 0's and
rank 1's CPU per allreduce. Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 50
RUN_TIMEOUT_S = 300


def add(a: Any, b: Any) -> Any:
    a += b
    return a


def worker(backend: str, rank: int, size: int, port: int, iters: int, out: str) -> None:
    sys.path.insert(0, HERE)
    import backends

    if backend == "floor":
        impl: Any = backends.Floor(rank, size, port, {"add": add})
        fn: Any = "add"
    else:
        impl, fn = backends.ZCollective(rank, size, port), add
    tri = size * (size + 1) // 2
    for _ in range(WARMUP):
        impl.allreduce(rank + 1, fn)
    before = resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        assert impl.allreduce(rank + 1, fn) == tri
        times.append(time.perf_counter() - t0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / iters
    bcast = []
    for i in range(iters // 2):
        t0 = time.perf_counter()
        assert impl.broadcast({"step": i} if rank == 0 else None) == {"step": i}
        bcast.append(time.perf_counter() - t0)
    pipelined = []
    for _ in range(max(3, iters // 100)):
        t0 = time.perf_counter()
        futures = [impl.allreduce_async(k, fn) for k in range(64)]
        for k, f in enumerate(futures):
            assert f.result() == k * size
        pipelined.append(time.perf_counter() - t0)
    impl.close()
    with open(out, "w") as f:
        json.dump({"allreduce": statistics.median(times), "broadcast": statistics.median(bcast),
                   "pipelined": statistics.median(pipelined), "cpu": cpu}, f)


def run(backend: str, tree: str, size: int, iters: int, tmp: str) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    if backend != "floor":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    outs = [os.path.join(tmp, f"{backend}-{r}.json") for r in range(size)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", backend, "--rank",
                               str(r), "--size", str(size), "--port", str(port), "--iters", str(iters),
                               "--out", outs[r]], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(size)]
    logs = [p.communicate(timeout=RUN_TIMEOUT_S)[0].decode() for p in procs]
    if any(p.returncode for p in procs):
        tails = "\n".join(log[-2000:] for log in logs)
        raise RuntimeError(f"{backend} ({tree}) at N={size} failed:\n{tails}")
    ranks = []
    for o in outs:
        with open(o) as f:
            ranks.append(json.load(f))
    return {"allreduce_s": max(r["allreduce"] for r in ranks),
            "broadcast_s": max(r["broadcast"] for r in ranks),
            "pipelined_ops_s": 64 / max(r["pipelined"] for r in ranks),
            "cpu_rank0_s": ranks[0]["cpu"], "cpu_rank1_s": ranks[1]["cpu"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default=f"this={os.path.dirname(HERE)}",
                        help="name=path of a zcollective checkout, comma-separated")
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "small_ops.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rank, args.size, args.port, args.iters, args.out)
        return
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    entries = [("floor", "")] + [(name, os.path.abspath(path)) for name, path in trees.items()]
    sizes = [int(n) for n in args.sizes.split(",")]
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {n: [] for n in sizes} for name, _ in entries}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            iters = max(200, args.iters * 2 // n)  # fewer at larger N: each costs more
            for rep in range(args.reps):
                for name, path in entries:  # in turn: the machine's mood falls on all alike
                    print(f"N={n} rep {rep + 1}/{args.reps}: {name}", file=sys.stderr, flush=True)
                    backend = "floor" if name == "floor" else "zcollective"
                    runs[name][n].append(run(backend, path, n, iters, tmp))
    summary = {name: {n: {k: statistics.median(r[k] for r in runs[name][n]) for k in runs[name][n][0]}
                      for n in sizes} for name in runs}
    lines = ["| N | version | allreduce | broadcast | 64 pipelined | CPU per allreduce, rank 0 / rank 1 |",
             "|---|---|---|---|---|---|"]
    for n in sizes:
        floor = summary["floor"][n]
        for name in runs:
            m = summary[name][n]
            ratio = {k: "" if name == "floor" else f" · {m[k] / floor[k]:.2f}×" for k in m}
            lines.append(
                f"| {n} | {name} | {m['allreduce_s'] * 1e6:,.0f} µs{ratio['allreduce_s']}"
                f" | {m['broadcast_s'] * 1e6:,.0f} µs{ratio['broadcast_s']}"
                f" | {m['pipelined_ops_s']:,.0f} ops/s{ratio['pipelined_ops_s']}"
                f" | {m['cpu_rank0_s'] * 1e6:,.0f} / {m['cpu_rank1_s'] * 1e6:,.0f} µs |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "trees": trees,
                   "reps": args.reps, "runs": runs, "summary": summary, "table": table}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
