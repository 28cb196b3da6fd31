"""Point-to-point ping-pong, side by side in one run: zcollective ``send``/``recv``
(without and with a secret) against a bare pyzmq PAIR pair sending the same value
out of band (pickle protocol 5, ``send_multipart(copy=False)``), over TCP loopback
(issue 46: a 16 MiB array no slower than the bare pair).

    python benchmarks/pingpong.py                          # this tree
    python benchmarks/pingpong.py --tree /tmp/before --out benchmarks/results/pingpong-before.json

Two processes hold all three pairs at once (a PAIR pair and two groups), and
take them in turn, ``--rounds`` times, ``--iters`` round trips each (the order
rotating), so that a noisy machine slows them alike. One round trip: rank 0
sends, rank 1 receives and sends back what it received, rank 0 receives; rank 0
times it and checks, outside the timing, what came back. Reported per value: the
median round trip of each pair and its ratio to the bare pair's, and the
fastest tenth's (p10: what a quiet machine gives). Prints a markdown table,
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from backends import PairFloor  # this folder is on sys.path: pingpong.py runs as a script

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = "pingpong-benchmark-secret"
PAIRS = ("bare PAIR", "zcollective", "zcollective, secret")
WARMUP = 3  # round trips per pair and value before the rounds: links made, buffers allocated
RUN_TIMEOUT_S = 600
ARRAY_BYTES = 16 << 20
Check = tuple[Callable[[int], Any], Callable[[Any, Any], bool]]  # how to make a value; is it intact


def small(i: int) -> Any:
    return {"step": i, "lr": 0.1, "name": "run-7"}


def values() -> dict[str, Check]:
    """Each value's name: how rank 0 makes its i-th, and whether what came back is intact."""
    import numpy as np

    n = ARRAY_BYTES // 4
    base = np.arange(n, dtype=np.float32)  # exact up to 2**24: any misplaced element shows

    def array_back(sent: Any, back: Any) -> bool:
        return (back is not sent and back.dtype == sent.dtype and back.shape == sent.shape
                and bool(np.array_equal(back, sent)))
    return {"small dict": (small, lambda sent, back: back == sent),
            "float32 16 MiB": (lambda i: base, array_back)}


def trip(impl: Any, rank: int, i: int, check: Check) -> float:
    """One round trip, timed on rank 0 (0.0 on rank 1, which echoes)."""
    if rank == 1:
        impl.send(impl.recv(0), 0)
        return 0.0
    make, intact = check
    value = make(i)
    t0 = time.perf_counter()
    impl.send(value, 1)
    back = impl.recv(1)
    dt = time.perf_counter() - t0
    assert intact(value, back), f"came back changed: {back!r:.200}"
    return dt


def worker(rank: int, ports: list[int], rounds: int, iters: int, out: str) -> None:
    import zcollective

    pairs: dict[str, Any] = {
        "bare PAIR": PairFloor(rank, 2, ports[0]),
        "zcollective": zcollective.Group("127.0.0.1", ports[1], rank, 2, timeout=120),
        "zcollective, secret": zcollective.Group("127.0.0.1", ports[2], rank, 2, timeout=120, secret=SECRET),
    }
    times: dict[str, dict[str, list[float]]] = {v: {p: [] for p in PAIRS} for v in values()}
    for value_name, check in values().items():
        for name in PAIRS:
            for i in range(WARMUP):
                trip(pairs[name], rank, i, check)
        for r in range(rounds):
            for k in range(len(PAIRS)):  # the order rotates: none always follows another
                name = PAIRS[(r + k) % len(PAIRS)]
                times[value_name][name] += [trip(pairs[name], rank, i, check) for i in range(iters)]
    for impl in pairs.values():
        impl.close() if isinstance(impl, PairFloor) else impl.teardown()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=os.path.dirname(HERE), help="the zcollective checkout to time")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=10, help="round trips of one pair in a round")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "pingpong.json"))
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, [int(p) for p in args.ports.split(",")], args.rounds, args.iters, args.out)
        return
    tree = os.path.abspath(args.tree)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p))
    ports = ",".join(str(free_port()) for _ in PAIRS)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "times.json")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r),
                                   "--ports", ports, "--rounds", str(args.rounds), "--iters", str(args.iters),
                                   "--out", raw],
                                  cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(2)]
        logs = [p.communicate(timeout=RUN_TIMEOUT_S)[0].decode() for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit("a rank failed:\n" + "\n".join(f"rank {r}:\n{log[-3000:]}"
                                                              for r, log in enumerate(logs)))
        with open(raw) as f:
            times = json.load(f)
    summary = {v: {p: statistics.median(ts) for p, ts in by.items()} for v, by in times.items()}
    tenth = {v: {p: sorted(ts)[len(ts) // 10] for p, ts in by.items()} for v, by in times.items()}
    lines = ["| value | pair | median round trip | ratio to bare PAIR | fastest tenth (ratio) |",
             "|---|---|---|---|---|"]
    for v, by in summary.items():
        for p, t in by.items():
            fast = tenth[v][p]
            lines.append(f"| {v} | {p} | {t * 1e3:,.2f} ms | {t / by['bare PAIR']:.2f}× "
                         f"| {fast * 1e3:,.2f} ms ({fast / tenth[v]['bare PAIR']:.2f}×) |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "tree": tree,
                   "rounds": args.rounds, "iters": args.iters, "summary_s": summary, "p10_s": tenth,
                   "times_s": times, "table": table}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
