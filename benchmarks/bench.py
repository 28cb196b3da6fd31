"""Side-by-side benchmark of zcollective and the peers users would otherwise pick.

    pip install -e '.[bench]'        # numpy, psutil, adaptdl==0.2.11 (--no-deps, see README)
    pip install -e '.[torch]'        # optional: the torch tensor workloads (CPU wheel: see README)
    python benchmarks/bench.py       # prints a markdown table, writes benchmarks/results/latest.json
    python benchmarks/bench.py --backends zcollective,zcollective-star --trees before=/tmp/old,after=$PWD
                                     # a change measured: each tree's zcollective, in the same rounds

Each (backend, N, round) runs in fresh processes on loopback; rounds alternate the
backends' order; every result is checked on every rank. Reported per workload:
the slowest rank's median (and p90) time per operation, as the median over rounds.
Never run as a test: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ALL_BACKENDS = ["zcollective", "zcollective+secret", "zcollective-star", "zcollective-star+secret", "floor",
                "adaptdl", "torch", "mpi4py"]
SECRET = "benchmark-secret-0123456789abcdef"
RUN_TIMEOUT_S = 600  # one backend at one N, all workloads
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
TORCH_CPU_WHEEL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def add(a: Any, b: Any) -> Any:
    a += b
    return a


def merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a[k] + b[k] for k in a}


# name -> (iterations, quick iterations, payload bytes or None)
WORKLOADS: dict[str, tuple[int, int, int | None]] = {
    "allreduce int": (400, 100, None),
    "allreduce dict100 (lambda merge)": (300, 80, None),
    "broadcast small dict": (400, 100, None),
    "allreduce float32 1 MiB": (60, 20, 1 << 20),
    "allreduce float32 16 MiB": (12, 5, 16 << 20),
    "64 pipelined allreduce_async": (30, 10, None),
    # the array workloads again, as CPU torch tensors; only where torch is installed
    "allreduce torch float32 1 MiB": (60, 20, 1 << 20),
    "allreduce torch float32 16 MiB": (12, 5, 16 << 20),
}
TENSOR_WORKLOADS = ("allreduce torch float32 1 MiB", "allreduce torch float32 16 MiB")
WARMUP = 5


def run_worker(backend: str, rank: int, size: int, port: int, out: str, quick: bool) -> None:
    import backends
    import numpy as np

    fns: dict[str, Callable[[Any, Any], Any]] = {"add": add, "merge": lambda a, b: merge(a, b)}
    if backend == "floor":
        impl: Any = backends.Floor(rank, size, port, fns)

        def fn(name: str) -> Any:
            return name
    else:
        if backend.startswith("zcollective"):
            if "-star" in backend:  # everything through rank 0, as before the data plane
                os.environ["ZCOLLECTIVE_DATA_PLANE"] = "off"
            impl = backends.ZCollective(rank, size, port, SECRET if backend.endswith("secret") else None)
        elif backend == "adaptdl":
            impl = backends.AdaptDL(rank, size, port)
        elif backend == "torch":
            impl = backends.Torch(rank, size, port)
        elif backend == "mpi4py":
            impl = backends.MPI4Py(rank, size, port)
        else:
            raise SystemExit(f"unknown backend {backend}")

        def fn(name: str) -> Any:
            return fns[name]

    tri = size * (size + 1) // 2
    results: dict[str, Any] = {}

    def timed(name: str, one: Callable[[int], None]) -> None:
        iters = WORKLOADS[name][1 if quick else 0]
        for i in range(WARMUP):
            one(i)
        times = []
        for i in range(iters):
            t0 = time.perf_counter()
            one(i)
            times.append(time.perf_counter() - t0)
        results[name] = times

    def small_int(i: int) -> None:
        assert impl.allreduce(rank + 1, fn("add")) == tri

    dict_value = {f"key{k:03d}": float(rank) for k in range(100)}

    def small_dict(i: int) -> None:
        out = impl.allreduce(dict(dict_value), fn("merge"))
        assert len(out) == 100 and out["key042"] == float(size * (size - 1) // 2)

    def bcast(i: int) -> None:
        value = {"step": i, "lr": 0.1, "name": "run-7"} if rank == 0 else None
        assert impl.broadcast(value) == {"step": i, "lr": 0.1, "name": "run-7"}

    def arrays(nbytes: int) -> Callable[[int], None]:
        base = np.full(nbytes // 4, rank + 1, dtype=np.float32)

        def one(i: int) -> None:
            out = impl.allreduce(base.copy(), fn("add"))
            assert out.shape == base.shape and out[0] == tri and out[-1] == tri
        return one

    def pipelined(i: int) -> None:
        futures = [impl.allreduce_async(k, fn("add")) for k in range(64)]
        for k, f in enumerate(futures):
            assert f.result() == k * size

    def tensors(nbytes: int) -> Callable[[int], None]:
        import torch

        torch.set_num_threads(1)  # N replicas share the cores: torch's own threads would fight them
        base = torch.full((nbytes // 4,), rank + 1, dtype=torch.float32)

        def one(i: int) -> None:
            out = impl.allreduce(base.clone(), fn("add"))
            assert out.shape == base.shape and out[0].item() == tri and out[-1].item() == tri
        return one

    timed("allreduce int", small_int)
    timed("allreduce dict100 (lambda merge)", small_dict)
    timed("broadcast small dict", bcast)
    timed("allreduce float32 1 MiB", arrays(1 << 20))
    rss_before = peak_rss()
    timed("allreduce float32 16 MiB", arrays(16 << 20))
    rss_after = peak_rss()
    timed("64 pipelined allreduce_async", pipelined)
    if tensors_available():  # last: importing torch must not count in the RSS figures above
        timed("allreduce torch float32 1 MiB", tensors(1 << 20))
        timed("allreduce torch float32 16 MiB", tensors(16 << 20))
    impl.close()
    with open(out, "w") as f:
        json.dump({"rank": rank, "times": results, "peak_rss": rss_after,
                   "rss_before_16mib": rss_before}, f)


def peak_rss() -> int:
    """This process's peak resident set (VmHWM; ru_maxrss survives exec and
    would report the parent's)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def tensors_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def available(backend: str) -> str | None:
    """None if the backend can run here, else why not."""
    try:
        if backend == "adaptdl":
            import adaptdl.reducer  # noqa: F401
        elif backend == "torch":
            import torch.distributed  # noqa: F401
        elif backend == "mpi4py":
            import mpi4py  # noqa: F401

            if shutil.which("mpirun") is None:
                return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    except ImportError as exc:
        return f"not installed ({exc.name})"
    return None


TREES: dict[str, str] = {}  # --trees: name -> a checkout whose zcollective a "zcollective...@name" runs


def run_one(backend: str, size: int, quick: bool) -> list[dict[str, Any]]:
    port = free_port()
    backend, _, tree = backend.partition("@")
    env = dict(os.environ)
    if tree:  # that checkout's zcollective, first on the path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (TREES[tree], env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"r{r}.json") for r in range(size)]
        me = os.path.abspath(__file__)
        flags = ["--quick"] if quick else []
        if backend == "mpi4py":
            cmd = [*MPIRUN, "-n", str(size), sys.executable, me, "--worker", backend, "--size", str(size),
                   "--port", str(port), "--out", os.path.join(tmp, "r{rank}.json"), *flags]
            procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)]
        else:
            procs = [subprocess.Popen([sys.executable, me, "--worker", backend, "--rank", str(r),
                                       "--size", str(size), "--port", str(port), "--out", outs[r], *flags],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
                     for r in range(size)]
        logs = []
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0].decode())
            except subprocess.TimeoutExpired:
                p.kill()
                logs.append(p.communicate()[0].decode() + "\n(killed: timeout)")
        if any(p.returncode != 0 for p in procs) or not all(os.path.exists(o) for o in outs):
            raise RuntimeError(f"{backend} at N={size} failed:\n" + "\n".join(log[-3000:] for log in logs))
        data = []
        for o in outs:
            with open(o) as f:
                data.append(json.load(f))
        return data


def summarize(runs: list[list[dict[str, Any]]], size: int) -> dict[str, Any]:
    """Median over rounds of the slowest rank's median and p90."""
    summary: dict[str, Any] = {}
    for name, (_, _, nbytes) in WORKLOADS.items():
        if any(name not in r["times"] for ranks in runs for r in ranks):
            continue  # not run (torch tensors without torch)
        medians, p90s = [], []
        for ranks in runs:
            per_rank = [sorted(r["times"][name]) for r in ranks]
            medians.append(max(statistics.median(t) for t in per_rank))
            p90s.append(max(t[int(0.9 * (len(t) - 1))] for t in per_rank))
        entry = {"median_s": statistics.median(medians), "p90_s": statistics.median(p90s),
                 "rounds_median_s": medians}
        if nbytes:
            entry["gb_per_s"] = nbytes / entry["median_s"] / 1e9
        if name.startswith("64 pipelined"):
            entry["ops_per_s"] = 64 / entry["median_s"]
        summary[name] = entry
    rank0 = [ranks[0] for ranks in runs]
    summary["coordinator peak RSS (MiB)"] = statistics.median(r["peak_rss"] for r in rank0) / 2**20
    summary["coordinator RSS growth in 16 MiB allreduce (MiB)"] = statistics.median(
        (r["peak_rss"] - r["rss_before_16mib"]) for r in rank0) / 2**20
    return summary


def fmt_time(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:,.0f} µs" if us < 10_000 else f"{us / 1000:,.1f} ms"


def table(results: dict[str, dict[int, dict[str, Any]]], sizes: list[int], backends: list[str]) -> str:
    ran = [b for b in backends if b in results]
    lines = ["| workload | N | " + " | ".join(ran) + " |", "|---|---|" + "---|" * len(ran)]
    for name, (_, _, nbytes) in WORKLOADS.items():
        if not any(name in results[b].get(n, {}) for b in ran for n in sizes):
            continue
        for n in sizes:
            floor = results.get("floor", {}).get(n, {}).get(name)
            cells = []
            for b in ran:
                e = results[b].get(n, {}).get(name)
                if e is None:
                    cells.append("—")
                    continue
                if "ops_per_s" in e:
                    cell = f"{e['ops_per_s']:,.0f} ops/s"
                    ratio = e["ops_per_s"] / floor["ops_per_s"] if floor else None
                else:
                    cell = f"{fmt_time(e['median_s'])} (p90 {fmt_time(e['p90_s'])})"
                    if nbytes:
                        cell += f", {e['gb_per_s']:.2f} GB/s"
                    ratio = e["median_s"] / floor["median_s"] if floor else None
                if ratio is not None and b != "floor":
                    cell += f" · {ratio:.2f}×"
                cells.append(cell)
            lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    for key in ("coordinator peak RSS (MiB)", "coordinator RSS growth in 16 MiB allreduce (MiB)"):
        for n in sizes:
            cells = [f"{results[b][n][key]:.0f}" if n in results[b] else "—" for b in ran]
            lines.append(f"| {key} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=",".join(ALL_BACKENDS))
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer iterations, for a smoke run")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "latest.json"))
    parser.add_argument("--trees", default="", help="NAME=PATH,...: run each zcollective backend from "
                        "each checkout, side by side (as zcollective@NAME): before=/tmp/old,after=$PWD")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, size = args.rank, args.size
        if args.worker == "mpi4py":
            import backends

            rank, size = backends.rank_from_mpi()
        run_worker(args.worker, rank, size, args.port, args.out.format(rank=rank), args.quick)
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    wanted = [b for b in args.backends.split(",") if b]
    TREES.update(t.split("=", 1) for t in args.trees.split(",") if t)
    if TREES:
        wanted = [f"{b}@{name}" if b.startswith("zcollective") else b for b in wanted
                  for name in (TREES if b.startswith("zcollective") else [""])]
    skipped = {b: why for b in wanted if (why := available(b.partition("@")[0]))}
    order = [b for b in wanted if b not in skipped]
    runs: dict[str, dict[int, list[Any]]] = {b: {n: [] for n in sizes} for b in order}
    for rnd in range(args.rounds):
        shift = rnd % len(order)
        for b in order[shift:] + order[:shift]:  # alternate which backend goes first
            for n in sizes:
                print(f"round {rnd + 1}/{args.rounds}: {b} N={n}", file=sys.stderr, flush=True)
                runs[b][n].append(run_one(b, n, args.quick))
    results = {b: {n: summarize(runs[b][n], n) for n in sizes} for b in order}
    text = table(results, sizes, order)
    if not tensors_available():
        skipped["torch tensor workloads"] = f"torch not installed ({TORCH_CPU_WHEEL})"
    notes = [f"- {b}: skipped, {why}" for b, why in skipped.items()]
    print(text)
    for note in notes:
        print(note)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(),
                   "cpus": os.cpu_count(), "python": platform.python_version(),
                   "command": " ".join(sys.argv), "rounds": args.rounds, "quick": args.quick,
                   "skipped": skipped, "results": results, "table": text}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    from plot import draw  # this folder is on sys.path: bench.py runs as a script

    for png in draw(args.out) or ["no pictures: matplotlib is not installed"]:
        print(f"wrote {png}" if png.endswith(".png") else png, file=sys.stderr)


if __name__ == "__main__":
    main()
