"""Small calls through the tree against the star, interleaved, with real
processes under ``zcollective-run`` (issue 35).

    python benchmarks/tree.py --sizes 8,16,32,64 --reps 3

For each N and each way (``ZCOLLECTIVE_TREE=on`` and ``off``), in turn, ``--reps``
times: every rank makes ``--iters`` ``allreduce`` of an int (the default
``a += b``, which the tree reduces on the way) and half as many ``broadcast``
of a small dict, timed, with its CPU per call (``time.process_time``, all its
threads). Reported per N and way, medians over the reps: time per allreduce
and per broadcast, rank 0's CPU per allreduce, the busiest other rank's, and
all ranks' together. On this 2-core machine N ranks share 2 cores, so total
CPU decides the time; the tree's gain is rank 0's share (a cluster with a core
per rank: see ``scale_model.py``). Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 30
RUN_TIMEOUT_S = 600
WAYS = ("off", "on")


def worker(iters: int) -> None:
    import zcollective as zc

    zc.initialize()
    me = zc.get_rank()
    for _ in range(WARMUP):
        zc.allreduce(1)
    zc.barrier()
    cpu, start = time.process_time(), time.perf_counter()
    for _ in range(iters):
        zc.allreduce(me + 1)
    allreduce_s, allreduce_cpu = (time.perf_counter() - start) / iters, (time.process_time() - cpu) / iters
    zc.barrier()
    start = time.perf_counter()
    for _ in range(iters // 2):
        zc.broadcast({"step": 1, "lr": 0.1} if me == 0 else None)
    broadcast_s = (time.perf_counter() - start) / (iters // 2)
    cpus = zc.gather(allreduce_cpu, root=0)
    if me == 0:
        print("RESULT " + json.dumps({"allreduce_us": allreduce_s * 1e6, "broadcast_us": broadcast_s * 1e6,
                                      "rank0_cpu_us": cpus[0] * 1e6, "other_max_cpu_us": max(cpus[1:]) * 1e6,
                                      "total_cpu_us": sum(cpus) * 1e6}), flush=True)
    zc.teardown()


def run(n: int, way: str, iters: int) -> dict[str, float]:
    env = {**os.environ, "ZCOLLECTIVE_TREE": way}
    out = subprocess.run(["zcollective-run", "-n", str(n), "--no-straggler-summary", sys.executable,
                          os.path.abspath(__file__), "--worker", "--iters", str(iters)],
                         env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])  # type: ignore[no-any-return]
    raise RuntimeError(f"N={n} tree={way} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "tree.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.iters)
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[str, list[dict[str, float]]] = {}
    for rep in range(args.reps):
        for n in sizes:
            for way in WAYS:
                iters = max(60, args.iters * 8 // n)  # (a run of 64 ranks takes as long as one of 8)
                got = run(n, way, iters)
                runs.setdefault(f"{n}/{way}", []).append(got)
                print(f"rep {rep + 1} N={n} tree={way}: " + ", ".join(f"{k} {v:.0f}" for k, v in got.items()),
                      file=sys.stderr, flush=True)
    table: dict[str, dict[str, Any]] = {}
    print("| N | tree | allreduce | broadcast | rank 0 CPU / allreduce | busiest other rank | all ranks |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        for way in WAYS:
            got = runs[f"{n}/{way}"]
            med = {k: statistics.median(g[k] for g in got) for k in got[0]}
            table[f"{n}/{way}"] = med
            print(f"| {n} | {way} | {med['allreduce_us'] / 1000:.2f} ms | "
                  f"{med['broadcast_us'] / 1000:.2f} ms | "
                  f"{med['rank0_cpu_us']:.0f} us | {med['other_max_cpu_us']:.0f} us | "
                  f"{med['total_cpu_us'] / 1000:.1f} ms |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"sizes": sizes, "reps": args.reps, "iters": args.iters, "medians": table, "runs": runs,
                   "load": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
