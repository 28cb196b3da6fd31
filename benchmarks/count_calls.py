"""Python calls inside zcollective per operation, per rank: the weight of the
common call, counted, not timed (a count does not depend on the machine's load).

    python benchmarks/count_calls.py                 # N = 2, prints a table, writes JSON
    python benchmarks/count_calls.py --size 4 --json results/calls.json

Each rank warms up, then counts with ``sys.setprofile`` the ``call`` events of
Python functions whose code lives in the package, over ``--iters`` calls of
each operation made by the rank's main thread (the thread that calls the
library; rank 0 serves its coordinator in that thread while it waits):

- ``allreduce(int)``: ``allreduce(rank + 1)`` with the default function;
- ``broadcast(dict)``: a small dict from rank 0;
- ``send+recv``: a ping-pong between ranks 0 and 1, one ``send`` and one
  ``recv`` per rank per round (other ranks idle at a barrier).

Reported: calls per operation per rank (mean over the iterations), and for
rank 0 the package's modules the allreduce entered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ITERS = 200  # enough to average out the periodic work (timers, stats)
WARMUP = 50  # past first-call caches (call sites, pickled functions, links made)
RUN_TIMEOUT_S = 120.0


def _count(fn: Any, iters: int, package: str) -> tuple[float, list[str], dict[str, float]]:
    """Mean package calls of ``fn()`` over ``iters`` calls, the modules entered,
    and the mean calls per function (``module:function``)."""
    calls = 0
    modules: set[str] = set()
    functions: dict[str, int] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            code = frame.f_code
            name = code.co_filename
            if name.startswith(package):
                calls += 1
                module = name[len(package):]
                modules.add(module)
                key = f"{module}:{code.co_name}"
                functions[key] = functions.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        for _ in range(iters):
            fn()
    finally:
        sys.setprofile(None)
    per_function = {k: round(v / iters, 2) for k, v in sorted(functions.items(), key=lambda kv: -kv[1])}
    return calls / iters, sorted(modules), per_function


def replica(iters: int) -> dict[str, Any]:
    """One rank's counts (run by :func:`zcollective.testing.run_replicas`)."""
    import zcollective

    package = os.path.dirname(os.path.abspath(zcollective.__file__)) + os.sep
    rank, size = zcollective.get_rank(), zcollective.get_world_size()
    value = {"step": 1, "lr": 0.1, "tag": "x"}
    ops = {
        "allreduce(int)": lambda: zcollective.allreduce(rank + 1),
        "broadcast(dict)": lambda: zcollective.broadcast(value),
    }

    def ping_pong() -> None:
        if rank == 0:
            zcollective.send(value, dest=1, tag=7)
            zcollective.recv(source=1, tag=7)
        elif rank == 1:
            zcollective.recv(source=0, tag=7)
            zcollective.send(value, dest=0, tag=7)

    out: dict[str, Any] = {}
    for name, fn in [*ops.items(), ("send+recv", ping_pong)]:
        for _ in range(WARMUP):
            fn()
        zcollective.barrier()
        if name == "send+recv" and rank > 1:
            out[name] = None
            zcollective.barrier()
            continue
        calls, modules, functions = _count(fn, iters, package)
        zcollective.barrier()
        out[name] = {"calls": round(calls, 1), "modules": modules, "functions": functions}
    out["rank"], out["size"] = rank, size
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2, help="replicas (default 2)")
    parser.add_argument("--iters", type=int, default=DEFAULT_ITERS)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "calls.json"))
    parser.add_argument("--by-function", action="store_true",
                        help="also print each rank's calls per function, per operation")
    args = parser.parse_args()
    from zcollective.testing import run_replicas

    ranks = run_replicas(replica, args.size, args.iters, timeout=RUN_TIMEOUT_S)
    names = [k for k in ranks[0] if k not in ("rank", "size")]
    print(f"Python calls inside zcollective per operation, N = {args.size}, "
          f"mean of {args.iters} after {WARMUP} warm-up\n")
    print("| operation | " + " | ".join(f"rank {r['rank']}" for r in ranks) + " |")
    print("|---|" + "---|" * len(ranks))
    for name in names:
        cells = ["–" if r[name] is None else f"{r[name]['calls']:g}" for r in ranks]
        print(f"| {name} | " + " | ".join(cells) + " |")
    entered = ranks[0][names[0]]["modules"]
    if args.by_function:
        for name in names:
            for r in ranks:
                if r[name] is None:
                    continue
                print(f"\n{name}, rank {r['rank']}:")
                for function, n in r[name]["functions"].items():
                    print(f"  {n:6g}  {function}")
    print(f"\nrank 0's {names[0]} entered {len(entered)} modules: {', '.join(entered)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"size": args.size, "iters": args.iters, "warmup": WARMUP, "ranks": ranks}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
