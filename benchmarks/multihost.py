"""Large-array collectives between hosts, not over loopback: each replica in a
network namespace of its own, every host's link shaped to a rate R in both
directions (tests/netns.py), the backends side by side in one run.

    PYTHONPATH=$PWD python benchmarks/multihost.py      # as root; ~16 min
    PYTHONPATH=$PWD python benchmarks/multihost.py --n 2,4 --sizes 16 --rounds 1   # ~1.5 min

Backends: ``zcollective`` (``ZCOLLECTIVE_DATA_PLANE=auto``: the peer-to-peer
data plane for large arrays once the tree under test has it), ``zcollective-star``
(``ZCOLLECTIVE_DATA_PLANE=off``: every byte through rank 0), both with a secret
as a real multi-host job would have; ``gloo`` (``torch.distributed``
``all_reduce``/``broadcast`` on ``torch.from_numpy`` tensors) and ``mpi4py``
(``Allreduce``/``Bcast`` under Open MPI's TCP transport, one daemon per host
started through an rsh agent that enters the host's namespace), each skipped
with a note when missing.

``--per-host K`` puts K ranks on each host (rank r on host r // K): ``zcollective``
then reduces in each host's shared memory and takes the hosts' sums round a ring
of one rank per host, ``zcollective-ring`` (shared memory off) keeps the ring of
all ranks, and Open MPI may use its shared-memory transport (``vader``) within a
host. N counts hosts, the bound is the hosts' (2(H-1)/H * S/B).

Each (backend, N) runs in fresh processes, rank r on host r // K; per operation,
``--warmup`` untimed calls then ``--rounds`` timed ones, a barrier before each.
A figure is the slowest rank's median, reported as a ratio to the bound
2(N-1)/N * S/B for allreduce and S/B for broadcast, B = R/8 bytes per second.
TCP/IP headers alone make 1514/1448 = 1.046x the best ratio any backend can show.
Needs root, iproute2 and tc. Never run as a test: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # netns.py, shared with the tests

ALL_BACKENDS = ["zcollective", "zcollective-star", "gloo", "mpi4py"]
DATA_PLANE = {"zcollective": "auto", "zcollective-star": "off", "zcollective-ring": "auto"}
NO_SHARED_MEMORY = {"zcollective-ring"}  # (with --per-host: the ring of all ranks, for comparison)
SECRET = "multihost-benchmark-secret-0123456789"  # any 16+ bytes: the cost of authentication is the point
DEFAULT_RATE_MBIT = 200.0  # slow enough that 2 cores move it with room to spare (the p2p check says)
DEFAULT_SIZES_MIB = "16,64"
DEFAULT_NS = "2,4,8"
DEFAULT_ROUNDS = 3  # per (backend, N, operation); the 64 MiB star at N=8 takes ~19 s each
DEFAULT_WARMUP = 1  # first call pays connections and page faults
BROADCAST_MIB = 64  # the broadcast row: this size from rank 0 at BROADCAST_N
BROADCAST_N = 8
P2P_MIB = 32  # the point-to-point check: long enough that the token bucket's burst is noise
STAR_LIVENESS_S = None  # the library's default (10 s): since frames cross hosts in 256 KiB parts,
# the star passes with it even at N=8, 64 MiB (~19 s per upload); it needed 60 s before
PORT = 29457  # every host set is private: a fixed port cannot collide with anyone
INIT_TIMEOUT_S = 120.0  # N interpreters importing torch on 2 cores
RUN_SLACK_S = 180.0  # on top of the expected time of one (backend, N) run
KILL_GRACE_S = 5.0  # mpirun gets this long to take its daemons down before SIGKILL


def mib(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB"


# -- one replica: runs inside a host's namespace --------------------------------
#
# Each backend offers what a worker needs: barrier(), allreduce(a) and
# broadcast(a or None, nbytes) on float32 numpy arrays, returning the result,
# and close().


class ZCollective:
    def __init__(self, rank: int, spec: dict[str, Any]) -> None:
        import zcollective

        self.zc = zcollective
        zcollective.initialize(timeout=INIT_TIMEOUT_S)  # everything else from ZCOLLECTIVE_* variables
        self.barrier = zcollective.barrier

    def allreduce(self, a: Any) -> Any:
        return self.zc.allreduce(a)

    def broadcast(self, a: Any, nbytes: int) -> Any:
        return self.zc.broadcast(a)

    def close(self) -> None:
        self.zc.teardown()


class Gloo:
    def __init__(self, rank: int, spec: dict[str, Any]) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N replicas share 2 cores
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}:{spec['port']}", rank=rank,
                                world_size=spec["n"], timeout=datetime.timedelta(seconds=1800))
        self.barrier = dist.barrier

    def allreduce(self, a: Any) -> Any:
        t = self.torch.from_numpy(a)
        self.dist.all_reduce(t)
        return a

    def broadcast(self, a: Any, nbytes: int) -> Any:
        import numpy as np

        if a is None:
            a = np.empty(nbytes // 4, dtype=np.float32)
        self.dist.broadcast(self.torch.from_numpy(a), src=0)
        return a

    def close(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()


class MPI4Py:
    def __init__(self, rank: int, spec: dict[str, Any]) -> None:
        from mpi4py import MPI

        self.mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.barrier = self.comm.Barrier

    def allreduce(self, a: Any) -> Any:
        self.comm.Allreduce(self.mpi.IN_PLACE, a, op=self.mpi.SUM)
        return a

    def broadcast(self, a: Any, nbytes: int) -> Any:
        import numpy as np

        if a is None:
            a = np.empty(nbytes // 4, dtype=np.float32)
        self.comm.Bcast(a, root=0)
        return a

    def close(self) -> None:
        self.comm.Barrier()


def worker(spec_path: str) -> None:
    import numpy as np

    with open(spec_path) as f:
        spec = json.load(f)
    backend = spec["backend"]
    if backend == "mpi4py":
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    else:
        rank = int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
    n = spec["n"]
    impl = {"gloo": Gloo, "mpi4py": MPI4Py}.get(backend, ZCollective)(rank, spec)
    tri = n * (n + 1) // 2
    times: dict[str, list[float]] = {}
    for op, nbytes in spec["ops"]:
        base = np.full(nbytes // 4, rank + 1, dtype=np.float32)
        got = times[f"{op} {mib(nbytes)}"] = []
        for i in range(spec["warmup"] + spec["rounds"]):
            value = base.copy() if op == "allreduce" or rank == 0 else None
            impl.barrier()
            t0 = time.perf_counter()
            out = impl.allreduce(value) if op == "allreduce" else impl.broadcast(value, nbytes)
            elapsed = time.perf_counter() - t0
            want = tri if op == "allreduce" else 1
            if not (out.shape == base.shape and out[0] == want and out[-1] == want):
                raise AssertionError(f"rank {rank}: {op} {mib(nbytes)} gave {out[0]}..{out[-1]}, not {want}")
            if i >= spec["warmup"]:
                got.append(elapsed)
            del value, out
        with open(spec["out"].format(rank=rank), "w") as f:  # after each operation: a later failure
            json.dump({"rank": rank, "times": times}, f)   # keeps what was measured
    impl.close()


# -- the driver: builds the hosts, starts the replicas, writes the table -------


def expected_s(n: int, ops: list[tuple[str, int]], rounds: int, rate_mbit: float) -> float:
    """Twice the star's time: rank 0's link takes N-1 contributions in, then
    sends N-1 results out, so 2(N-1) S/B; the other backends are faster."""
    per_byte = 8 / (rate_mbit * 1e6)
    return sum(2 * 2 * (n - 1) * nbytes * per_byte * rounds for _, nbytes in ops)


def child_env(backend: str, n: int, master: str, secret: bool, liveness: Optional[float]) -> dict[str, str]:
    """The replica's environment: ours without any ZCOLLECTIVE_* variable, plus the run's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZCOLLECTIVE_")}
    env["PYTHONUNBUFFERED"] = "1"
    if backend in DATA_PLANE:
        env.update({"ZCOLLECTIVE_MASTER_ADDR": master, "ZCOLLECTIVE_MASTER_PORT": str(PORT),
                    "ZCOLLECTIVE_NUM_REPLICAS": str(n), "ZCOLLECTIVE_DATA_PLANE": DATA_PLANE[backend]})
        if secret:
            env["ZCOLLECTIVE_SECRET"] = SECRET
        if liveness is not None:
            env["ZCOLLECTIVE_LIVENESS_TIMEOUT"] = str(liveness)
        if backend in NO_SHARED_MEMORY:
            env["ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES"] = "off"
    if backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = "eth0"  # else gloo binds whatever the hostname resolves to
    return env


def mpi_launch(hosts: Any, n: int, tmp: str, per_host: int = 1) -> list[str]:
    """mpirun in host 0's namespace; an rsh agent starts Open MPI's daemon for
    host i inside host i's namespace, so every byte between hosts crosses the
    shaped links (TCP between hosts; with ``per_host`` > 1, shared memory within one)."""
    agent = os.path.join(tmp, "agent.sh")
    cases = "".join(f"  {hosts.addresses[i]}) ns={hosts.names[i]} ;;\n" for i in range(n))
    with open(agent, "w") as f:
        f.write(f'#!/bin/sh\nhost="$1"; shift\ncase "$host" in\n{cases}'
                '  *) echo "agent: unknown host $host" >&2; exit 1 ;;\nesac\n'
                'exec ip netns exec "$ns" sh -c "$*"\n')
    os.chmod(agent, 0o755)
    hostfile = os.path.join(tmp, "hostfile")
    with open(hostfile, "w") as f:
        f.write("".join(f"{a} slots={per_host}\n" for a in hosts.addresses[:n]))
    return ["mpirun", "--allow-run-as-root", "-np", str(n * per_host), "--hostfile", hostfile,
            "--mca", "plm_rsh_agent", agent, "--mca", "btl", "tcp,self" + (",vader" if per_host > 1 else ""),
            "--mca", "btl_tcp_if_include", hosts.link, "--mca", "oob_tcp_if_include", hosts.link,
            "--mca", "mpi_yield_when_idle", "1", "-x", "PYTHONPATH"]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """End what this run started, politely first. Each was started in a
    session of its own, so what it started in turn (mpirun's daemons and
    ranks, which Open MPI puts in process groups of their own) is found by
    session id, and nothing else is touched."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # mpirun takes its job down on SIGTERM
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + KILL_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    sessions = {proc.pid for proc in procs}
    for pid in session_members(sessions):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()


def session_members(sessions: set[int]) -> list[int]:
    """Processes whose session id is in ``sessions`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) in sessions:  # state, ppid, pgrp, session
            found.append(int(entry))
    return found


def run_group(hosts: Any, backend: str, n_hosts: int, ops: list[tuple[str, int]], args: argparse.Namespace,
              secret: bool = True) -> dict[str, Any]:
    """One (backend, N hosts): start the replicas, wait with a bound, collect times."""
    per_host = args.per_host
    n = n_hosts * per_host
    record: dict[str, Any] = {"backend": backend, "n": n, "hosts": n_hosts, "per_host": per_host,
                              "secret": secret and backend in DATA_PLANE,
                              "ops": [[op, nbytes] for op, nbytes in ops]}
    liveness = args.star_liveness if backend == "zcollective-star" else args.liveness
    record["liveness_s"] = liveness
    env = child_env(backend, n, hosts.addresses[0], secret, liveness)
    timeout = expected_s(n, ops, args.rounds + args.warmup, args.rate) + RUN_SLACK_S
    with tempfile.TemporaryDirectory(prefix="zc-multihost-") as tmp:
        spec = {"backend": backend, "n": n, "ops": ops, "rounds": args.rounds, "warmup": args.warmup,
                "master": hosts.addresses[0], "port": PORT, "out": os.path.join(tmp, "r{rank}.json")}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        me = [sys.executable, os.path.abspath(__file__), "--worker", spec_path]
        logs = [open(os.path.join(tmp, f"log{r}.txt"), "w+b") for r in range(n)]  # noqa: SIM115
        procs: list[subprocess.Popen[bytes]] = []
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        try:
            if backend == "mpi4py":
                procs.append(hosts.popen(0, [*mpi_launch(hosts, n_hosts, tmp, per_host), *me], env=env,
                                         stdout=logs[0],
                                         stderr=subprocess.STDOUT, start_new_session=True))
            else:
                for r in range(n):
                    rank_env = {**env, "ZCOLLECTIVE_REPLICA_RANK": str(r)}
                    procs.append(hosts.popen(r // per_host, me, env=rank_env, stdout=logs[r],
                                             stderr=subprocess.STDOUT, start_new_session=True))
            deadline = start + timeout
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        finally:
            stop(procs)
        record["wall_s"] = round(time.monotonic() - start, 2)
        record["loadavg_end"] = os.getloadavg()  # the machine is shared: how busy it was
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        record["cpu_s"] = round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2)
        ranks = {}
        for r in range(n):
            path = spec["out"].format(rank=r)
            if os.path.exists(path):
                with open(path) as f:
                    ranks[r] = json.load(f)["times"]
        codes = [p.returncode for p in procs]
        if len(ranks) != n or any(codes):
            tails = []
            for r, log in enumerate(logs):
                log.seek(0)
                text = log.read().decode("utf-8", "replace")[-1500:]
                if text.strip():
                    who = "mpirun, every rank" if backend == "mpi4py" else f"rank {r}"
                    tails.append(f"--- {who}:\n{text}")
            record["error"] = (f"exit codes {codes}, {len(ranks)} of {n} ranks reported "
                               f"(bound {timeout:.0f} s)\n" + "".join(tails))
        for log in logs:
            log.close()
    record["times"] = ranks
    return record


def slowest_median(record: dict[str, Any], key: str, rounds: int) -> Optional[float]:
    """The slowest rank's median; None unless every rank timed every round."""
    per_rank = [statistics.median(t[key]) for t in record["times"].values() if len(t.get(key, ())) == rounds]
    return max(per_rank) if len(per_rank) == record["n"] else None


def p2p(hosts: Any, nbytes: int) -> dict[str, float]:
    """Plain TCP, host 1 to host 0: payload rate against the shaped link."""
    server = ("import socket, time\n"
              "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              f"s.bind(('0.0.0.0', {PORT})); s.listen(1); print('ready', flush=True)\n"
              "c, _ = s.accept(); n = 0; t0 = None\n"
              "while True:\n"
              "    b = c.recv(1 << 20)\n"
              "    t0 = t0 or time.perf_counter()\n"
              "    if not b: break\n"
              "    n += len(b)\n"
              "print(n, time.perf_counter() - t0, flush=True)\n")
    client = ("import socket, sys\n"
              f"s = socket.create_connection((sys.argv[1], {PORT})); b = bytes(1 << 20)\n"
              f"for _ in range({nbytes >> 20}): s.sendall(b)\n"
              "s.close()\n")
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    srv = hosts.popen(0, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    try:
        srv.stdout.readline()
        hosts.run(1, sys.executable, "-c", client, hosts.addresses[0], timeout=120)
        got, seconds = srv.stdout.readline().split()
        srv.wait(30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    return {"bytes": int(got), "seconds": float(seconds), "mbit_s": int(got) * 8 / float(seconds) / 1e6,
            "cpu_s": round(cpu, 3)}


def available(backend: str) -> Optional[str]:
    """None if the backend can run here, else why not."""
    try:
        if backend == "gloo":
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_gloo_available():
                return "this torch build has no gloo"
        elif backend == "mpi4py":
            import mpi4py  # noqa: F401

            if shutil.which("mpirun") is None:
                return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    except ImportError as exc:
        how = {"gloo": "pip install torch (the CPU wheel will do)",
               "mpi4py": "apt-get install openmpi-bin libopenmpi-dev && pip install mpi4py"}[backend]
        return f"{exc.name} is not installed ({how})"
    return None


def cell(record: Optional[dict[str, Any]], key: str, bound: float, rounds: int) -> str:
    if record is None:
        return "–"
    t = slowest_median(record, key, rounds)
    return "failed" if t is None else f"{t / bound:.2f}× ({t:.2f} s)"


def table(runs: list[dict[str, Any]], backends: list[str], rows: list[tuple[str, int, int, bool]],
          rate_mbit: float, rounds: int) -> str:
    rate = rate_mbit * 1e6 / 8
    head = ["operation", "hosts", "bound (s)", *backends]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op, nbytes, n, secret in rows:
        bound = (2 * (n - 1) / n if op == "allreduce" else 1.0) * nbytes / rate
        label = f"{op} {mib(nbytes)}" + ("" if secret else ", no secret")
        cells = []
        for b in backends:
            match = [r for r in runs if r["backend"] == b and r.get("hosts", r["n"]) == n
                     and r["secret"] == (secret and b in DATA_PLANE) and [op, nbytes] in r["ops"]]
            if not secret and b not in DATA_PLANE:
                match = []
            cells.append(cell(match[0] if match else None, f"{op} {mib(nbytes)}", bound, rounds))
        lines.append(f"| {label} | {n} | {bound:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment(rate_mbit: float, hosts: Any) -> dict[str, Any]:
    env: dict[str, Any] = {"rate_mbit": rate_mbit, "tbf_burst_bytes": hosts.burst_bytes,
                           "tbf_latency_ms": hosts.latency_ms, "kernel": platform.release(),
                           "cpus": os.cpu_count(), "python": platform.python_version(),
                           "loadavg_start": os.getloadavg()}
    import zmq

    import zcollective

    tree = os.path.dirname(os.path.dirname(os.path.abspath(zcollective.__file__)))
    env.update({"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "zcollective_tree": tree})
    commit = subprocess.run(["git", "-C", tree, "describe", "--always", "--dirty"], capture_output=True,
                            text=True)
    env["zcollective_commit"] = commit.stdout.strip() or "unknown"
    mpirun = subprocess.run(["mpirun", "--version"], capture_output=True, text=True) \
        if shutil.which("mpirun") else None
    env["mpirun"] = mpirun.stdout.splitlines()[0] if mpirun and mpirun.stdout else None
    for name in ("numpy", "torch", "mpi4py"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    return env


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=DEFAULT_RATE_MBIT, help="link rate R, Mbit/s")
    p.add_argument("--sizes", default=DEFAULT_SIZES_MIB, help="allreduce sizes, MiB (comma-separated)")
    p.add_argument("--n", default=DEFAULT_NS, help="numbers of hosts (comma-separated)")
    p.add_argument("--per-host", type=int, default=1, help="ranks on each host")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    p.add_argument("--backends", default=",".join(ALL_BACKENDS))
    p.add_argument("--broadcast-mib", type=int, default=BROADCAST_MIB,
                   help=f"broadcast size from rank 0 at N={BROADCAST_N} (when 8 is in --n); 0: none")
    p.add_argument("--no-secret-row", action=argparse.BooleanOptionalAction, default=True,
                   help="also run zcollective without a secret at the largest N, smallest size")
    p.add_argument("--liveness", type=float, default=None,
                   help="ZCOLLECTIVE_LIVENESS_TIMEOUT for zcollective (default: the library's)")
    p.add_argument("--star-liveness", type=float, default=STAR_LIVENESS_S,
                   help="ZCOLLECTIVE_LIVENESS_TIMEOUT for zcollective-star (default: %(default)s)")
    p.add_argument("--out", default=os.path.join(HERE, "results",
                                                 f"multihost-{time.strftime('%Y-%m-%d')}.json"))
    return p.parse_args()


def main() -> None:
    args = parse()
    if args.worker:
        worker(args.worker)
        return
    from netns import Hosts, NetnsUnavailable

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the cleanup below
    sizes = [int(s) << 20 for s in args.sizes.split(",")]
    ns = sorted(int(n) for n in args.n.split(","))
    skipped = {b: why for b in args.backends.split(",") if (why := available(b))}
    backends = [b for b in args.backends.split(",") if b not in skipped]
    rows: list[tuple[str, int, int, bool]] = [("allreduce", s, n, True) for s in sizes for n in ns]
    if args.broadcast_mib and BROADCAST_N in ns:
        rows.append(("broadcast", args.broadcast_mib << 20, BROADCAST_N, True))
    if args.no_secret_row and any(b in DATA_PLANE for b in backends):
        rows.append(("allreduce", min(sizes), max(ns), False))
    began = time.monotonic()
    runs: list[dict[str, Any]] = []
    try:
        with Hosts(max(ns), args.rate, prefix="zcb") as hosts:
            env = environment(args.rate, hosts)
            check = p2p(hosts, P2P_MIB << 20)
            print(f"point to point, {P2P_MIB} MiB over TCP at R = {args.rate:g} Mbit/s: "
                  f"{check['mbit_s']:.1f} Mbit/s of payload ({100 * check['mbit_s'] / args.rate:.1f}% of R; "
                  f"headers cap it at {100 * 1448 / 1514:.1f}%), {check['cpu_s']:.2f} s CPU in "
                  f"{check['seconds']:.2f} s", flush=True)
            for i, n in enumerate(ns):
                order = backends[i % len(backends):] + backends[:i % len(backends)]  # rotate who goes first
                for b in order:
                    ops = [(op, s) for op, s, rn, sec in rows if rn == n and sec]
                    runs.append(run_group(hosts, b, n, ops, args))
                    report_run(runs[-1])
                    if b in DATA_PLANE:
                        ops = [(op, s) for op, s, rn, sec in rows if rn == n and not sec]
                        if ops:
                            runs.append(run_group(hosts, b, n, ops, args, secret=False))
                            report_run(runs[-1])
    except NetnsUnavailable as exc:
        raise SystemExit(f"multihost.py: {exc}") from exc
    text = table(runs, backends, rows, args.rate, args.rounds)
    print("\n" + text)
    for r in runs:
        if r.get("error"):
            print(f"- {r['backend']} N={r['n']} failed: {first_error(r['error'])}")
    for b, why in skipped.items():
        print(f"- {b}: skipped, {why}")
    env["loadavg_end"] = os.getloadavg()
    env["p2p"] = check
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                   "environment": env, "rounds": args.rounds, "warmup": args.warmup,
                   "duration_s": round(time.monotonic() - began, 1), "skipped": skipped,
                   "runs": runs, "table": text}, f, indent=1)
    print(f"wrote {args.out} after {time.monotonic() - began:.0f} s", file=sys.stderr)


def first_error(text: str) -> str:
    """The first line that names an exception, for the notes under the table."""
    for line in text.splitlines():
        if "Error" in line and not line.startswith(" "):
            return line.strip()
    return text.splitlines()[0]


def report_run(record: dict[str, Any]) -> None:
    plain = record["backend"] in DATA_PLANE and not record["secret"]
    label = record["backend"] + (" (no secret)" if plain else "")
    cores = record["cpu_s"] / record["wall_s"] if record["wall_s"] else 0.0
    print(f"{label} N={record['n']}: {record['wall_s']:.0f} s, {record['cpu_s']:.0f} s CPU "
          f"({cores:.2f} cores busy on average)", flush=True)
    if record.get("error"):
        print("  FAILED: " + record["error"], flush=True)


if __name__ == "__main__":
    main()
