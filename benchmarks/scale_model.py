"""A model of a small allreduce's time at sizes this machine cannot hold
(issue 35): the star today against a tree of fan-out K, from costs measured
here, checked against real processes at N = 8, 16, 32.

    python benchmarks/scale_model.py             # ~3 min: measures, predicts, prints, writes JSON and a PNG
    python benchmarks/scale_model.py --fanout 4 --hop-us 25   # a cluster's network latency per hop

What is measured on this machine (medians of ``--reps``):

- **a0, a1**: rank 0's time per small allreduce with simulated replicas
  (``scale.py``'s rig: rank 0 busy all the time, so warm) fitted as
  ``a0 + a1 * N``. a1 is what one rank's contribution costs the rank that
  combines it: receive, decode, check, combine, answer.
- **hop**: half the round trip of a bare pyzmq DEALER/ROUTER ping-pong
  between two processes on loopback (``--hop-us`` replaces it with a network's).
- **cpu_r(w)**: a replica's CPU per allreduce when it waits ``w`` for its
  result (rank 0 of a 2-rank group sleeps ``w`` before each call). A process
  that waits longer wakes with colder caches on a shared machine and spends
  more: this is why replicas' CPU grows with N here. A bare pyzmq replica
  (a DEALER sending one pickled dict and receiving one answer per call) is
  measured the same way beside it: it shows the same growth.

The model, one core per rank (a cluster):

- star: ``T = a0 + a1 * (N - 1) + 2 * hop``: rank 0 takes in every contribution
  and answers every rank, in series;
- tree: ``T = a0 + D * (2 * hop + K * a1)``, ``D = ceil(log_K N)`` levels, each
  rank combining at most K children's contributions on the way up and
  answering them on the way down (subtrees are contiguous ranges of ranks).

This machine, N processes on ``P`` cores: a call cannot take less than the
CPU all ranks spend on it divided by P, so ``T_here = max(T, CPU(T) / P)``
with ``CPU = rank 0's + each replica's cpu_r(T) + K * a1 per interior rank``,
solved by iteration (T and the replicas' CPU depend on each other). The
measured points (real processes, ``small_ops.py``'s worker) are compared with
``T_here`` for the star, and ``--tree tree.json`` (``benchmarks/tree.py``, the tree built by
issue 35) with ``T_here`` for the tree.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import scale  # noqa: E402  (the rig: rank 0 real, the replicas simulated)
import small_ops  # noqa: E402  (the worker: real processes, CPU per allreduce)

CLUSTER_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
CHECKED_SIZES = (8, 16, 32)
HERE_MAX = 64  # the largest group drawn "on this machine"
WAITS_MS = (0.0, 2.0, 5.0, 10.0, 20.0)
PING_PONGS = 2000


def _echo(port: int, n: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    s.connect(f"tcp://127.0.0.1:{port}")
    for _ in range(n):
        s.send(s.recv())
    ctx.destroy(linger=0)


def hop_us() -> float:
    """Half a bare PAIR round trip of 32 bytes between two processes on loopback, median."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    p = multiprocessing.Process(target=_echo, args=(port, PING_PONGS))
    p.start()
    times = []
    for _ in range(PING_PONGS):
        t0 = time.perf_counter()
        s.send(b"x" * 32)
        s.recv()
        times.append(time.perf_counter() - t0)
    p.join(30)
    ctx.destroy(linger=0)
    return statistics.median(times[PING_PONGS // 10:]) / 2 * 1e6


def delay_worker(rank: int, port: int, wait_ms: float, iters: int, out: str) -> None:
    """Rank 0 sleeps ``wait_ms`` before each allreduce; rank 1 records its CPU per call."""
    import zcollective

    zcollective.initialize("127.0.0.1", port, rank, 2, timeout=120)
    for _ in range(small_ops.WARMUP):
        zcollective.allreduce(1)
    c0 = time.process_time()
    for _ in range(iters):
        if rank == 0 and wait_ms:
            time.sleep(wait_ms / 1e3)
        zcollective.allreduce(1)
    cpu = (time.process_time() - c0) / iters
    zcollective.teardown()
    with open(out, "w") as f:
        json.dump({"cpu_us": cpu * 1e6}, f)


def replica_cpu(wait_ms: float, iters: int, tmp: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = [os.path.join(tmp, f"delay-{r}.json") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--delay-worker", str(r), str(port),
                               str(wait_ms), str(iters), outs[r]]) for r in range(2)]
    for p in procs:
        if p.wait(timeout=small_ops.RUN_TIMEOUT_S):
            raise RuntimeError(f"the delay worker failed (wait {wait_ms} ms)")
    with open(outs[1]) as f:
        return float(json.load(f)["cpu_us"])


def _bare_replica(port: int, n: int, conn: Any) -> None:
    import pickle

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{port}")
    for i in range(small_ops.WARMUP + n):
        if i == small_ops.WARMUP:
            c0 = time.process_time()
        s.send(pickle.dumps({"op": 1, "seq": i, "value": 1}))
        pickle.loads(s.recv())
    conn.send((time.process_time() - c0) / n * 1e6)
    ctx.destroy(linger=0)


def bare_replica_cpu(wait_ms: float, iters: int) -> float:
    """A bare pyzmq replica's CPU per call when its ROUTER answers ``wait_ms`` late."""
    import pickle

    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    mine, theirs = multiprocessing.Pipe()
    p = multiprocessing.Process(target=_bare_replica, args=(port, iters, theirs))
    p.start()
    for i in range(small_ops.WARMUP + iters):
        peer, frame = r.recv_multipart()
        pickle.loads(frame)
        if i >= small_ops.WARMUP and wait_ms:
            time.sleep(wait_ms / 1e3)
        r.send_multipart([peer, pickle.dumps(2)])
    cpu = float(mine.recv())
    p.join(30)
    ctx.destroy(linger=0)
    return cpu


def cpu_r(table: list[tuple[float, float]], wait_us: float) -> float:
    """A replica's CPU per call after waiting ``wait_us``: interpolated, flat beyond the ends."""
    w = wait_us / 1e3
    if w <= table[0][0]:
        return table[0][1]
    for (w0, c0), (w1, c1) in zip(table, table[1:], strict=False):
        if w <= w1:
            return c0 + (c1 - c0) * (w - w0) / (w1 - w0)
    return table[-1][1]


def levels(n: int, k: int) -> int:
    """Levels of a K-ary tree over n ranks (rank 0 at the top)."""
    d, reach = 0, 1
    while reach < n:
        reach *= k
        d += 1
    return d


def star_us(n: int, c: dict[str, Any]) -> float:
    return c["a0"] + c["a1"] * (n - 1) + 2 * c["hop"]


def tree_us(n: int, k: int, c: dict[str, Any]) -> float:
    return c["a0"] + levels(n, k) * (2 * c["hop"] + min(k, n - 1) * c["a1"])


def here_us(n: int, path_us: float, interior_us: float, c: dict[str, Any], cores: int) -> float:
    """This machine: at least all ranks' CPU over its cores; the replicas' CPU grows with the wait."""
    t = path_us
    for _ in range(50):
        cpu = path_us + interior_us + (n - 1) * cpu_r(c["cpu_r"], t)
        t_next = max(path_us, cpu / cores)
        if abs(t_next - t) < 0.5:
            return t_next
        t = t_next
    return t


def interior_work_us(n: int, k: int, c: dict[str, Any]) -> float:
    interior = max(0, math.ceil((n - 1) / k) - 1)  # ranks other than 0 with children
    return interior * k * c["a1"]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    c: dict[str, Any] = {"hop": hop_us()}
    print(f"hop {c['hop']:.1f} µs", file=sys.stderr, flush=True)
    fit_n = (8, 16, 32, 64)
    rank0 = {n: statistics.median(scale.measure(n, args.iters)["us_per_op"] for _ in range(args.reps))
             for n in fit_n}
    xs, ys = list(rank0), list(rank0.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    c["a1"] = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    c["a0"] = my - c["a1"] * mx
    c["rank0_us"] = rank0
    print(f"rank 0: a0 {c['a0']:.0f} µs + a1 {c['a1']:.1f} µs per rank", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        c["cpu_r"] = [(w, statistics.median(replica_cpu(w, args.iters, tmp) for _ in range(args.reps)))
                      for w in WAITS_MS]
        c["bare_cpu_r"] = [(w, statistics.median(bare_replica_cpu(w, args.iters) for _ in range(args.reps)))
                           for w in WAITS_MS]
        for name in ("cpu_r", "bare_cpu_r"):
            print(f"{name}, CPU per call by wait (ms, µs): {c[name]}", file=sys.stderr, flush=True)
        measured = {}
        for n in CHECKED_SIZES:
            runs = [small_ops.run("zcollective", os.path.dirname(HERE), n, max(200, 4000 // n), tmp)
                    for _ in range(args.reps)]
            measured[n] = {k: statistics.median(r[k] for r in runs) * 1e6
                           for k in ("allreduce_s", "cpu_rank0_s", "cpu_rank1_s")}
            print(f"N={n}: {measured[n]}", file=sys.stderr, flush=True)
    c["measured"] = measured
    return c


def predict(c: dict[str, Any], k: int, cores: int, tree_measured: dict[int, float]) -> dict[str, Any]:
    rows = []
    for n in sorted(set(CLUSTER_SIZES) | set(CHECKED_SIZES) | set(tree_measured)):
        star, tree = star_us(n, c), tree_us(n, k, c)
        rows.append({"n": n, "star_us": star, "tree_us": tree,
                     "star_here_us": here_us(n, star, 0.0, c, cores),
                     "tree_here_us": here_us(n, tree, interior_work_us(n, k, c), c, cores),
                     "measured_us": c["measured"].get(n, {}).get("allreduce_s"),
                     "tree_measured_us": tree_measured.get(n)})
    return {"fanout": k, "cores": cores, "rows": rows}


def tree_points(path: Optional[str]) -> dict[int, float]:
    """The tree measured here with real processes: ``benchmarks/tree.py``'s medians (tree on)."""
    if not path:
        return {}
    with open(path) as f:
        medians = json.load(f)["medians"]
    return {int(key.split("/")[0]): m["allreduce_us"] for key, m in medians.items() if key.endswith("/on")}


def table(model: dict[str, Any]) -> str:
    k, cores = model["fanout"], model["cores"]
    lines = [f"| N | star, a core per rank | tree (K={k}), a core per rank | star here ({cores} cores) "
             "| tree here | measured here (star) | model/measured | tree measured here | model/measured |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in model["rows"]:
        m, t = r["measured_us"], r.get("tree_measured_us")
        measured = "" if m is None else f"{m:,.0f} µs"
        ratio = "" if m is None else f"{r['star_here_us'] / m:.2f}"
        tree = "" if t is None else f"{t:,.0f} µs"
        tree_ratio = "" if t is None else f"{r['tree_here_us'] / t:.2f}"
        lines.append(f"| {r['n']} | {r['star_us']:,.0f} µs | {r['tree_us']:,.0f} µs"
                     f" | {r['star_here_us']:,.0f} µs | {r['tree_here_us']:,.0f} µs | {measured} | {ratio}"
                     f" | {tree} | {tree_ratio} |")
    return "\n".join(lines)


def waits(c: dict[str, Any]) -> str:
    lines = ["| a replica waits for its result | zcollective replica's CPU per call | bare pyzmq replica's |",
             "|---|---|---|"]
    for (w, z), (_, b) in zip(c["cpu_r"], c.get("bare_cpu_r") or [(w, float("nan")) for w, _ in c["cpu_r"]],
                              strict=True):
        lines.append(f"| {w:g} ms | {z:,.0f} µs | {b:,.0f} µs |")
    return "\n".join(lines)


def draw(model: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture", file=sys.stderr)
        return
    rows = model["rows"]
    ns = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [r["star_us"] / 1e3 for r in rows], "-", color="C0", label="star, a core per rank (model)")
    ax.plot(ns, [r["tree_us"] / 1e3 for r in rows], "-", color="C1",
            label=f"tree K={model['fanout']}, a core per rank (model)")
    here = [r for r in rows if r["n"] <= HERE_MAX]  # beyond it, more processes than this machine starts
    ax.plot([r["n"] for r in here], [r["star_here_us"] / 1e3 for r in here], "--", color="C0",
            label=f"star on this machine, {model['cores']} cores (model)")
    ax.plot([r["n"] for r in here], [r["tree_here_us"] / 1e3 for r in here], "--", color="C1",
            label=f"tree on this machine, {model['cores']} cores (model)")
    pts = [(r["n"], r["measured_us"] / 1e3) for r in rows if r["measured_us"] is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color="C0", label="star measured here")
    pts = [(r["n"], r["tree_measured_us"] / 1e3) for r in rows if r.get("tree_measured_us") is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s", color="C1",
                label="tree measured here (tree.py)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (N)")
    ax.set_ylabel("ms per small allreduce")
    ax.set_title("A small allreduce: star against tree")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--delay-worker":
        rank, port, wait, iters, out = sys.argv[2:7]
        delay_worker(int(rank), int(port), float(wait), int(iters), out)
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fanout", type=int, default=4, help="K, children per rank in the tree")
    parser.add_argument("--hop-us", type=float, help="one hop's latency (default: measured on loopback)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--costs", help="a JSON this script wrote: its measured costs, not measured again")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "scale_model.json"))
    parser.add_argument("--tree", help="benchmarks/tree.py's JSON: the tree measured here, beside the model")
    args = parser.parse_args()
    if args.costs:
        with open(args.costs) as f:
            costs = json.load(f)["costs"]
        costs["measured"] = {int(n): m for n, m in costs["measured"].items()}
    else:
        costs = measure(args)
    if args.hop_us is not None:
        costs["hop"] = args.hop_us
    model = predict(costs, args.fanout, args.cores, tree_points(args.tree))
    text = table(model) + "\n\n" + waits(costs)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "costs": costs,
                   "model": model, "table": text}, f, indent=1, default=str)
    draw(model, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
