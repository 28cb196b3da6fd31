"""The shared-memory floor of an allreduce on one host (issue 36): the bare
sketch, nothing checked, no sockets.

    python benchmarks/shm_floor.py --size 4 --nbytes 16777216 --iters 12

N processes (forked by multiprocessing) share one segment of N input slots
and one result (``multiprocessing.shared_memory``) and a
``multiprocessing.Barrier``. One allreduce of a float32 array:

1. each rank copies its input into its slot;
2. barrier;
3. each rank sums its 1/N slice of every slot into the result's slice
   (numpy, slots in rank order);
4. barrier;
5. each rank copies the whole result out into a new array (an allreduce
   returns one, as zcollective's does).

No third barrier: a rank's next input goes into its own slot, which nobody
reads after step 4, and the next step 3 waits for every rank's next step 1.
``bench.py`` runs this as its ``shm-floor`` backend, in the same rounds as
the others, and reads the JSON each rank writes (``--out``, with ``{rank}``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from multiprocessing import shared_memory
from typing import Any

WARMUP = 5


def worker(rank: int, size: int, name: str, barrier: Any, workloads: list[tuple[str, int, int]],
           out: str) -> None:
    import numpy as np

    segment = shared_memory.SharedMemory(name=name)  # (the parent's resource tracker, forked)
    results: dict[str, list[float]] = {}
    for label, nbytes, iters in workloads:
        n = nbytes // 4
        slots = np.ndarray((size + 1, n), dtype=np.float32, buffer=segment.buf)
        result = slots[size]
        start, end = rank * n // size, (rank + 1) * n // size
        base = np.full(n, rank + 1, dtype=np.float32)
        tri = size * (size + 1) // 2
        times = []
        barrier.wait()  # every rank is done with the last workload's layout
        for i in range(WARMUP + iters):
            x = base.copy()  # (untimed, as for every backend)
            t0 = time.perf_counter()
            slots[rank] = x
            barrier.wait()
            mine = result[start:end]
            np.add(slots[0, start:end], slots[1, start:end], out=mine) if size > 1 else np.copyto(
                mine, slots[0, start:end])
            for k in range(2, size):
                np.add(mine, slots[k, start:end], out=mine)
            barrier.wait()
            got = result.copy()
            dt = time.perf_counter() - t0
            assert got[0] == tri and got[-1] == tri, (label, got[0], got[-1])
            if i >= WARMUP:
                times.append(dt)
        results[label] = times
        del slots, result, mine
    segment.close()
    with open(out.format(rank=rank), "w") as f:
        json.dump({"rank": rank, "times": results, "peak_rss": 0, "rss_before_16mib": 0}, f)


def run(size: int, workloads: list[tuple[str, int, int]], out: str) -> None:
    """Every workload (label, bytes, iterations) in one set of ``size`` processes."""
    ctx = multiprocessing.get_context("fork")
    largest = max(nbytes for _, nbytes, _ in workloads)
    segment = shared_memory.SharedMemory(create=True, size=(size + 1) * largest)
    try:
        barrier = ctx.Barrier(size)
        procs = [ctx.Process(target=worker, args=(r, size, segment.name, barrier, workloads, out))
                 for r in range(size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    finally:
        segment.close()
        segment.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--nbytes", type=int, action="append", help="array bytes (again for more)")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--workloads", help="JSON [[label, bytes, iterations], ...] (bench.py's)")
    parser.add_argument("--out", default="", help="each rank's JSON; {rank} is replaced (default: print)")
    args = parser.parse_args()
    if args.workloads:
        workloads = [tuple(w) for w in json.loads(args.workloads)]
    else:
        workloads = [(f"{n} bytes", n, args.iters) for n in (args.nbytes or [16 << 20])]
    out = args.out or os.path.join("/tmp", f"shm_floor_{os.getpid()}_r{{rank}}.json")
    run(args.size, workloads, out)  # type: ignore[arg-type]
    if not args.out:
        import statistics
        per_rank = []
        for r in range(args.size):
            with open(out.format(rank=r)) as f:
                per_rank.append(json.load(f)["times"])
            os.unlink(out.format(rank=r))
        for label, _, _ in workloads:
            slowest = max(statistics.median(t[label]) for t in per_rank)
            print(f"N={args.size} {label}: {slowest * 1e3:.2f} ms (slowest rank's median)", file=sys.stdout)


if __name__ == "__main__":
    main()
