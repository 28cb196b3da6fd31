"""Side-by-side benchmark of zcollective and the peers users would otherwise pick.

    pip install -e '.[bench]'        # numpy, psutil, adaptdl==0.2.11 (--no-deps, see README)
    pip install -e '.[torch]'        # optional: the torch tensor workloads (CPU wheel: see README)
    python benchmarks/bench.py       # prints a markdown table, writes benchmarks/results/latest.json
    python benchmarks/bench.py --backends zcollective,zcollective-star --trees before=/tmp/old,after=$PWD
                                     # a change measured: each tree's zcollective, in the same rounds
    python benchmarks/bench.py --p2p        # ping-pong between 2 ranks: zcollective, mpi4py, a PAIR floor
    python benchmarks/bench.py --subgroups  # split, allreduce on a sub-group of 4 in 8 against groups of 4

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
                "adaptdl", "torch", "mpi4py", "shm-floor", "mpi4py-buffer", "gloo"]
ARRAYS_ONLY = {"shm-floor", "mpi4py-buffer", "gloo"}  # they run only the float32 array allreduces
MPI_BACKENDS = {"mpi4py", "mpi4py-buffer"}
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
    "allreduce float32 64 KiB": (200, 50, 1 << 16),
    "allreduce float32 1 MiB": (60, 20, 1 << 20),
    "allreduce float32 16 MiB": (12, 5, 16 << 20),
    "allreduce float32 64 MiB": (8, 3, 64 << 20),
    "64 pipelined allreduce_async": (30, 10, None),
    # the array workloads again, as CPU torch tensors; only where torch is installed
    "allreduce torch float32 1 MiB": (60, 20, 1 << 20),
    "allreduce torch float32 16 MiB": (12, 5, 16 << 20),
}
TENSOR_WORKLOADS = ("allreduce torch float32 1 MiB", "allreduce torch float32 16 MiB")
ARRAY_WORKLOADS = tuple(n for n in WORKLOADS if n.startswith("allreduce float32 "))
WARMUP = 5

# --p2p: one round trip = rank 0 sends, rank 1 receives and sends it back, rank 0 receives.
P2P_BACKENDS = ["zcollective", "zcollective+secret", "mpi4py", "floor"]
# name -> (round trips, quick round trips, array bytes or None)
P2P_WORKLOADS: dict[str, tuple[int, int, int | None]] = {
    "ping-pong small dict": (1000, 200, None),
    "ping-pong float32 16 MiB": (40, 10, 16 << 20),
}
P2P_WARMUP = 20

# --subgroups: a setup's "backend" name -> its number of processes
SUBGROUP_SETUPS = {"sub-group of 4 in 8": 8, "two groups of 4 in 8": 8, "group of 4": 4}
# name -> (iterations, quick iterations)
SUBGROUP_WORKLOADS: dict[str, tuple[int, int]] = {
    "split(rank < 4)": (15, 5),
    "sub-group teardown": (15, 5),
    "allreduce int": (400, 100),
    "allreduce int, all 8": (400, 100),
}
SUBGROUP_WARMUP = 20  # allreduces; splits warm up with 2


def run_worker(backend: str, rank: int, size: int, port: int, out: str, quick: bool) -> None:
    import backends
    import numpy as np

    fns: dict[str, Callable[[Any, Any], Any]] = {"add": add, "sum": add, "merge": lambda a, b: merge(a, b)}
    if backend == "floor":
        impl: Any = backends.Floor(rank, size, port, fns)

        def fn(name: str) -> Any:
            return name
    else:
        if backend.startswith("zcollective"):
            if "-star" in backend:  # everything through rank 0, as before the data plane (and
                os.environ["ZCOLLECTIVE_DATA_PLANE"] = "off"  # shared memory)
                os.environ["ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES"] = "off"
            impl = backends.ZCollective(rank, size, port, SECRET if backend.endswith("secret") else None)
            fns["sum"] = impl.zc.default_reduce_fn  # the arrays': the same a += b, as users call it
            # (allreduce(x)); zcollective knows it is elementwise, not the benchmark's own function
        elif backend == "adaptdl":
            impl = backends.AdaptDL(rank, size, port)
        elif backend == "torch":
            impl = backends.Torch(rank, size, port)
        elif backend == "mpi4py":
            impl = backends.MPI4Py(rank, size, port)
        elif backend == "mpi4py-buffer":
            impl = backends.MPI4PyBuffer(rank, size, port)
        elif backend == "gloo":
            impl = backends.Gloo(rank, size, port)
        else:
            raise SystemExit(f"unknown backend {backend}")

        def fn(name: str) -> Any:
            return fns[name]

    tri = size * (size + 1) // 2
    results: dict[str, Any] = {}
    arrays_only = getattr(impl, "arrays_only", False)

    def timed(name: str, one: Callable[[Any], None], prepare: Callable[[], Any] = lambda: None) -> None:
        """``one(prepare())`` timed, ``prepare`` not (an array's fresh copy)."""
        if arrays_only and name not in ARRAY_WORKLOADS:
            return
        iters = WORKLOADS[name][1 if quick else 0]
        for i in range(WARMUP):
            arg = prepare()
            one(arg if arg is not None else i)
        times = []
        for i in range(iters):
            arg = prepare()
            t0 = time.perf_counter()
            one(arg if arg is not None else i)
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

    def arrays(name: str, nbytes: int) -> None:
        """Each allreduce gets a fresh copy of the array, made untimed (a reduction may
        change its input: rank 0's of the star ones, gloo's in place)."""
        base = np.full(nbytes // 4, rank + 1, dtype=np.float32)

        def one(value: Any) -> None:
            out = impl.allreduce(value, fn("sum"))
            assert out.shape == base.shape and out[0] == tri and out[-1] == tri
        timed(name, one, base.copy)

    def pipelined(i: int) -> None:
        futures = [impl.allreduce_async(k, fn("add")) for k in range(64)]
        for k, f in enumerate(futures):
            assert f.result() == k * size

    def tensors(name: str, nbytes: int) -> None:
        import torch

        torch.set_num_threads(1)  # N replicas share the cores: torch's own threads would fight them
        base = torch.full((nbytes // 4,), rank + 1, dtype=torch.float32)

        def one(value: Any) -> None:
            out = impl.allreduce(value, fn("sum"))
            assert out.shape == base.shape and out[0].item() == tri and out[-1].item() == tri
        timed(name, one, base.clone)

    timed("allreduce int", small_int)
    timed("allreduce dict100 (lambda merge)", small_dict)
    timed("broadcast small dict", bcast)
    arrays("allreduce float32 64 KiB", 1 << 16)
    arrays("allreduce float32 1 MiB", 1 << 20)
    rss_before = peak_rss()
    arrays("allreduce float32 16 MiB", 16 << 20)
    rss_after = peak_rss()
    arrays("allreduce float32 64 MiB", 64 << 20)
    timed("64 pipelined allreduce_async", pipelined)
    if tensors_available() and not arrays_only:  # last: importing torch must not count in the RSS
        tensors("allreduce torch float32 1 MiB", 1 << 20)  # figures above
        tensors("allreduce torch float32 16 MiB", 16 << 20)
    impl.close()
    with open(out, "w") as f:
        json.dump({"rank": rank, "times": results, "peak_rss": rss_after,
                   "rss_before_16mib": rss_before}, f)


def run_p2p_worker(backend: str, rank: int, size: int, port: int, out: str, quick: bool,
                   only: str = "") -> None:
    import backends
    import numpy as np

    if backend == "floor":
        impl: Any = backends.PairFloor(rank, size, port)
    elif backend.startswith("zcollective"):
        impl = backends.ZCollective(rank, size, port, SECRET if backend.endswith("secret") else None)
    elif backend == "mpi4py":
        impl = backends.MPI4Py(rank, size, port)
    else:
        raise SystemExit(f"unknown backend {backend}")
    results: dict[str, Any] = {}
    cpu: dict[str, float] = {}

    def timed(name: str, make: Callable[[int], Any], echoed: Callable[[int, Any], bool],
              intact: Callable[[Any, Any], bool]) -> None:
        """Rank 0 times each round trip and checks what came back outside the
        timing; rank 1 echoes (its times are its turns: receive, check, send)."""
        if only not in name:
            return
        full, short, _ = P2P_WORKLOADS[name]
        iters = short if quick else full
        times, spent = [], 0.0
        for i in range(P2P_WARMUP + iters):
            c0, t0 = time.process_time(), time.perf_counter()
            if rank == 0:
                value = make(i)
                t0 = time.perf_counter()
                impl.send(value, 1)
                back = impl.recv(1)
            else:
                got = impl.recv(0)
                assert echoed(i, got), f"{name}: rank 1 got {got!r:.200}"
                impl.send(got, 0)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if rank == 0:
                assert intact(value, back), f"{name}: came back changed: {back!r:.200}"
            if i >= P2P_WARMUP:
                times.append(dt)
                spent += dc
        results[name] = times
        cpu[name] = spent / iters  # this process's CPU, all threads, per round trip

    def small(i: int) -> dict[str, Any]:
        return {"step": i, "lr": 0.1, "name": "run-7"}

    timed("ping-pong small dict", small, lambda i, got: got == small(i), lambda v, back: back == v)
    n = (16 << 20) // 4
    base = np.arange(n, dtype=np.float32)  # exact up to 2**24: any misplaced element shows
    timed("ping-pong float32 16 MiB", lambda i: base,
          lambda i, got: got.shape == (n,) and got[0] == 0 and got[-1] == n - 1,
          lambda v, back: back is not v and back.dtype == v.dtype and np.array_equal(back, v))
    impl.close()
    with open(out, "w") as f:
        json.dump({"rank": rank, "times": results, "cpu_s": cpu}, f)


def run_subgroup_worker(setup: str, rank: int, size: int, port: int, port2: int, out: str,
                        quick: bool) -> None:
    import zcollective as zc

    results: dict[str, Any] = {}

    def iters(name: str) -> int:
        return SUBGROUP_WORKLOADS[name][1 if quick else 0]

    def allreduces(group: Any, name: str) -> None:
        """``allreduce(rank + 1)`` on ``group`` (a Group, or the module for the default group)."""
        me, n = (group.get_rank(), group.get_world_size()) if group is zc else (group.rank, group.size)
        tri = n * (n + 1) // 2
        for _ in range(SUBGROUP_WARMUP):
            group.allreduce(me + 1, add)
        times = []
        for _ in range(iters(name)):
            t0 = time.perf_counter()
            assert group.allreduce(me + 1, add) == tri
            times.append(time.perf_counter() - t0)
        results[name] = times

    def splits() -> None:
        """``split(rank < 4)``, each torn down: two groups of 4 in 8, one of 4 in 4."""
        made, ended = [], []
        for i in range(2 + iters("split(rank < 4)")):
            zc.barrier()
            t0 = time.perf_counter()
            sub = zc.split(rank < 4)
            t1 = time.perf_counter()
            assert sub is not None and sub.size == 4 and sub.rank == rank % 4
            assert sub.parent_ranks == [r + 4 * (rank >= 4) for r in range(4)]
            sub.teardown()
            if i >= 2:
                made.append(t1 - t0)
                ended.append(time.perf_counter() - t1)
        results["split(rank < 4)"], results["sub-group teardown"] = made, ended

    if setup == "two groups of 4 in 8":  # the control: 8 processes, two plain groups at once
        group = zc.Group("127.0.0.1", port if rank < 4 else port2, rank % 4, 4, timeout=120)
        allreduces(group, "allreduce int")
        group.teardown()
    elif setup == "group of 4":
        zc.initialize("127.0.0.1", port, rank, size, timeout=120)
        allreduces(zc, "allreduce int")
        splits()  # (one color: the split of a group of 4, for scale)
        zc.teardown()
    else:
        zc.initialize("127.0.0.1", port, rank, size, timeout=120)
        allreduces(zc, "allreduce int, all 8")
        splits()
        sub = zc.split(rank < 4)
        assert sub is not None
        allreduces(sub, "allreduce int")  # both halves at once: every rank is in one
        sub.teardown()
        zc.teardown()
    with open(out, "w") as f:
        json.dump({"rank": rank, "times": results}, f)


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
        elif backend in ("torch", "gloo"):
            import torch.distributed  # noqa: F401
        elif backend == "shm-floor":
            import numpy  # noqa: F401
        elif backend in MPI_BACKENDS:
            import mpi4py  # noqa: F401

            if shutil.which("mpirun") is None:
                return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    except ImportError as exc:
        return f"not installed ({exc.name})"
    return None


TREES: dict[str, str] = {}  # --trees: name -> a checkout whose zcollective a "zcollective...@name" runs


def run_one(backend: str, size: int, quick: bool, mode: str = "collectives",
            only: str = "") -> list[dict[str, Any]]:
    port = free_port()
    backend, _, tree = backend.partition("@")
    env = dict(os.environ)
    if tree:  # that checkout's zcollective, first on the path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (TREES[tree], env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"r{r}.json") for r in range(size)]
        me = os.path.abspath(__file__)
        flags = ["--mode", mode, "--port2", str(free_port()), "--only", only, *(["--quick"] if quick else [])]
        if backend in MPI_BACKENDS:
            cmd = [*MPIRUN, "-n", str(size), sys.executable, me, "--worker", backend, "--size", str(size),
                   "--port", str(port), "--out", os.path.join(tmp, "r{rank}.json"), *flags]
            procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)]
        elif backend == "shm-floor":  # one process forks the ranks (they share its Barrier)
            workloads = [(n, WORKLOADS[n][2], WORKLOADS[n][1 if quick else 0]) for n in ARRAY_WORKLOADS]
            cmd = [sys.executable, os.path.join(HERE, "shm_floor.py"), "--size", str(size), "--workloads",
                   json.dumps(workloads), "--out", os.path.join(tmp, "r{rank}.json")]
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
    if not any(r["peak_rss"] for r in rank0):
        return summary  # (the shared-memory floor measures none)
    summary["coordinator peak RSS (MiB)"] = statistics.median(r["peak_rss"] for r in rank0) / 2**20
    summary["coordinator RSS growth in 16 MiB allreduce (MiB)"] = statistics.median(
        (r["peak_rss"] - r["rss_before_16mib"]) for r in rank0) / 2**20
    return summary


def summarize_times(runs: list[list[dict[str, Any]]], ranks: slice = slice(None)) -> dict[str, Any]:
    """Per workload: the median over rounds of the slowest rank's median and
    p90 (among ``ranks``); CPU per operation where the workers measured it."""
    summary: dict[str, Any] = {}
    for name in runs[0][0]["times"]:
        medians, p90s = [], []
        for round_ranks in runs:
            per_rank = [sorted(r["times"][name]) for r in round_ranks[ranks]]
            medians.append(max(statistics.median(t) for t in per_rank))
            p90s.append(max(t[int(0.9 * (len(t) - 1))] for t in per_rank))
        entry: dict[str, Any] = {"median_s": statistics.median(medians), "p90_s": statistics.median(p90s),
                                 "rounds_median_s": medians}
        if "cpu_s" in runs[0][0]:
            entry["cpu_s_per_rank"] = [statistics.median(rr[r]["cpu_s"][name] for rr in runs)
                                       for r in range(len(runs[0]))]
        summary[name] = entry
    return summary


def p2p_table(results: dict[str, dict[str, Any]]) -> str:
    ran = list(results)
    lines = ["| workload (N = 2) | " + " | ".join(ran) + " |", "|---|" + "---|" * len(ran)]
    for name, (_, _, nbytes) in P2P_WORKLOADS.items():
        if name not in results[ran[0]]:
            continue  # left out by --only
        floor = results.get("floor", {}).get(name)
        cells = []
        for b in ran:
            e = results[b][name]
            cell = f"{fmt_time(e['median_s'])} (p90 {fmt_time(e['p90_s'])})"
            if nbytes:
                cell += f", {2 * nbytes / e['median_s'] / 1e9:.2f} GB/s"
            if floor and b != "floor":
                cell += f" · {e['median_s'] / floor['median_s']:.2f}×"
            cells.append(cell)
        lines.append(f"| {name}: round trip | " + " | ".join(cells) + " |")
        cpu = [" / ".join(f"{c * 1e6:,.0f}" for c in results[b][name]["cpu_s_per_rank"]) for b in ran]
        lines.append(f"| {name}: CPU µs per round trip, rank 0 / rank 1 | " + " | ".join(cpu) + " |")
    return "\n".join(lines)


def subgroup_table(results: dict[str, dict[str, Any]]) -> str:
    ran = list(results)
    lines = ["| setup | processes | " + " | ".join(SUBGROUP_WORKLOADS) + " |",
             "|---|---|" + "---|" * len(SUBGROUP_WORKLOADS)]
    for setup in ran:
        cells = []
        for name in SUBGROUP_WORKLOADS:
            e = results[setup].get(name)
            if e is None:
                cells.append("—")
                continue
            cell = f"{fmt_time(e['median_s'])} (p90 {fmt_time(e['p90_s'])})"
            for other in ran[ran.index(setup) + 1:] if name == "allreduce int" else ():
                cell += f" · {e['median_s'] / results[other][name]['median_s']:.2f}× {other}"
            cells.append(cell)
        lines.append(f"| {setup} | {SUBGROUP_SETUPS[setup]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
            cells = [f"{results[b][n][key]:.0f}" if key in results[b].get(n, {}) else "—" for b in ran]
            lines.append(f"| {key} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def array_table(results: dict[str, dict[int, dict[str, Any]]], sizes: list[int]) -> str:
    """The float32 allreduces: zcollective against the shared-memory floor, mpi4py's buffer
    Allreduce and gloo's tensor all_reduce (time ratios: below 1, zcollective is faster)."""
    peers = [b for b in ("shm-floor", "mpi4py-buffer", "gloo", "floor") if b in results]
    mine = [b for b in results if b.startswith("zcollective") and "star" not in b and "secret" not in b]
    if not mine or not peers:
        return ""
    us = mine[-1]  # (with --trees, the last checkout: the ratios are its)
    head = " | ".join(mine) + " | " + " | ".join(f"{b} ({us} ×)" for b in peers)
    lines = [f"| workload | N | {head} |", "|---|---|" + "---|" * (len(mine) + len(peers))]
    for name in ARRAY_WORKLOADS:
        for n in sizes:
            ours = results[us].get(n, {}).get(name)
            if ours is None:
                continue
            cells = [fmt_time(results[b][n][name]["median_s"]) if name in results[b].get(n, {}) else "—"
                     for b in mine]
            for b in peers:
                e = results[b].get(n, {}).get(name)
                cells.append("—" if e is None else
                             f"{fmt_time(e['median_s'])} ({ours['median_s'] / e['median_s']:.2f}×)")
            lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", help=f"default: {','.join(ALL_BACKENDS)} "
                        f"(--p2p: {','.join(P2P_BACKENDS)})")
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer iterations, for a smoke run")
    parser.add_argument("--p2p", action="store_true", help="point to point instead: a ping-pong at N=2 of "
                        "zcollective (with and without a secret), mpi4py and a bare PAIR floor")
    parser.add_argument("--subgroups", action="store_true", help="sub-groups instead: split and allreduce "
                        "on a sub-group of 4 in 8 processes, against a group of 4 and two groups of 4 in 8")
    parser.add_argument("--only", default="", help="--p2p: only the workloads whose name has this "
                        "(small, 16 MiB)")
    parser.add_argument("--out", help="JSON written (default: results/latest.json, results/p2p.json or "
                        "results/subgroups.json)")
    parser.add_argument("--trees", default="", help="NAME=PATH,...: run each zcollective backend from "
                        "each checkout, side by side (as zcollective@NAME): before=/tmp/old,after=$PWD")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port2", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="collectives", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, size = args.rank, args.size
        if args.worker in MPI_BACKENDS:
            import backends

            rank, size = backends.rank_from_mpi()
        out = args.out.format(rank=rank)
        if args.mode == "p2p":
            run_p2p_worker(args.worker, rank, size, args.port, out, args.quick, args.only)
        elif args.mode == "subgroups":
            run_subgroup_worker(args.worker, rank, size, args.port, args.port2, out, args.quick)
        else:
            run_worker(args.worker, rank, size, args.port, out, args.quick)
        return
    if args.p2p or args.subgroups:
        run_p2p_or_subgroups(args)
        return
    args.out = args.out or os.path.join(HERE, "results", "latest.json")

    sizes = [int(s) for s in args.sizes.split(",")]
    wanted = [b for b in (args.backends or ",".join(ALL_BACKENDS)).split(",") if b]
    TREES.update(t.split("=", 1) for t in args.trees.split(",") if t)
    if TREES:
        wanted = [f"{b}@{name}" if b.startswith("zcollective") else b for b in wanted
                  for name in (TREES if b.startswith("zcollective") else [""])]
    skipped = {b: why for b in wanted if (why := available(b.partition("@")[0]))}
    order = [b for b in wanted if b not in skipped]
    load = os.getloadavg()  # (the machine is shared: the JSON says how busy it was)
    runs: dict[str, dict[int, list[Any]]] = {b: {n: [] for n in sizes} for b in order}
    for rnd in range(args.rounds):
        shift = rnd % len(order)
        for b in order[shift:] + order[:shift]:  # alternate which backend goes first
            for n in sizes:
                print(f"round {rnd + 1}/{args.rounds}: {b} N={n}", file=sys.stderr, flush=True)
                runs[b][n].append(run_one(b, n, args.quick))
    results = {b: {n: summarize(runs[b][n], n) for n in sizes} for b in order}
    text = table(results, sizes, order)
    arrays = array_table(results, sizes)
    if arrays:
        text += "\n\n" + arrays
    if not tensors_available():
        skipped["torch tensor workloads"] = f"torch not installed ({TORCH_CPU_WHEEL})"
    notes = [f"- {b}: skipped, {why}" for b, why in skipped.items()]
    print(text)
    for note in notes:
        print(note)
    write_json(args.out, args, load_before=load, load_after=os.getloadavg(), skipped=skipped, results=results,
               table=text)
    from plot import draw  # this folder is on sys.path: bench.py runs as a script

    for png in draw(args.out) or ["no pictures: matplotlib is not installed"]:
        print(f"wrote {png}" if png.endswith(".png") else png, file=sys.stderr)


def run_p2p_or_subgroups(args: argparse.Namespace) -> None:
    """--p2p or --subgroups: rounds of fresh processes, alternating the order."""
    mode = "p2p" if args.p2p else "subgroups"
    load = os.getloadavg()
    if args.p2p:
        wanted = [b for b in (args.backends or ",".join(P2P_BACKENDS)).split(",") if b]
        if unknown := set(wanted) - set(P2P_BACKENDS):
            raise SystemExit(f"--p2p runs {', '.join(P2P_BACKENDS)}; not {', '.join(sorted(unknown))}")
        sizes = {b: 2 for b in wanted}
    else:
        sizes = dict(SUBGROUP_SETUPS)
        wanted = list(sizes)
    skipped = {b: why for b in wanted if (why := available(b))}
    order = [b for b in wanted if b not in skipped]
    runs: dict[str, list[Any]] = {b: [] for b in order}
    for rnd in range(args.rounds):
        shift = rnd % len(order)
        for b in order[shift:] + order[:shift]:
            print(f"round {rnd + 1}/{args.rounds}: {b} N={sizes[b]}", file=sys.stderr, flush=True)
            runs[b].append(run_one(b, sizes[b], args.quick, mode, args.only))
    if args.p2p:  # rank 0 times the round trips
        results = {b: summarize_times(runs[b], slice(0, 1)) for b in order}
        text = p2p_table(results)
    else:
        results = {b: summarize_times(runs[b]) for b in order}
        text = subgroup_table(results)
    print(text)
    for b, why in skipped.items():
        print(f"- {b}: skipped, {why}")
    write_json(args.out or os.path.join(HERE, "results", f"{mode}.json"), args, load_before=load,
               load_after=os.getloadavg(), skipped=skipped, results=results, table=text)


def write_json(path: str, args: argparse.Namespace, **fields: Any) -> None:
    """A run's results, with what it ran on and how it was called."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(),
                   "cpus": os.cpu_count(), "python": platform.python_version(),
                   "command": " ".join(sys.argv), "rounds": args.rounds, "quick": args.quick,
                   **fields}, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
