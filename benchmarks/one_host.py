"""Small messages between processes of one host, side by side (issue 47, step 3): what
zcollective costs today against the floors a one-host transport would be built on.

    python benchmarks/one_host.py                     # ~2 min: writes results/issue47-baseline.json
    python benchmarks/one_host.py --quick --rounds 1  # a smoke run

Three measures, in one run, in rounds; each round runs every backend once, in
fresh processes, the order rotating from round to round (A B C D, B C D A, ...)
so that a noisy machine slows them alike:

1. **ping-pong**: rank 0 sends ``{"task": i, "payload": "x" * 32}``, rank 1
   receives it and sends it back, rank 0 receives; rank 0 times each round trip
   and checks what came back outside the timing. Backends: zcollective
   ``send``/``recv`` (with and without a secret), a bare pyzmq PAIR pair over
   TCP loopback (``backends.PairFloor``), a bare Unix ``SOCK_SEQPACKET``
   socketpair, THE FLOOR (``shm_ring.py``: a ring a direction in an anonymous
   shared mapping, an eventfd a direction, written only for a sleeping reader)
   with no spin, with ``shm_ring.SPIN_S`` of spin (``floor+spin``) and with
   that spin yielding the CPU after each empty look (``floor+yield``), and
   mpi4py's lowercase ``comm.send``/``comm.recv`` under mpirun.
2. **idle**: right after the ping-pongs, rank 1 blocks in ``recv`` for
   ``--idle-s`` while rank 0 sleeps; rank 0 reads rank 1's CPU time (every
   thread's ``/proc/<pid>/task/*/schedstat``, in ns) before and after.
3. **work queue**: one master and three workers; the master sends each worker
   ``{"task": i}``, receives replies from any source (zcollective
   ``recv(ANY_SOURCE)``, mpi4py ``comm.recv(source=MPI.ANY_SOURCE)``, the floor
   waiting on its three inbound rings at once) and sends the replying worker
   the next task, for ``--seconds``; tasks per second.

Processes: one launcher process per (backend, round) forks the other ranks after
making what they share (the floor's mapping and eventfds, the socketpair) and
before anything else; mpi4py's run under ``mpirun`` as in ``bench.py``. Prints
markdown tables, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pickle
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench import MPIRUN, SECRET, available, fmt_time, free_port, write_json  # noqa: E402
from shm_ring import SPIN_S, Ring, Waiter, make_eventfd, ring_bytes  # noqa: E402

PINGPONG_BACKENDS = ["zcollective", "zcollective+secret", "zcollective-zmq", "PAIR", "seqpacket", "floor",
                     "floor+spin", "floor+yield", "mpi4py"]
QUEUE_BACKENDS = ["zcollective", "zcollective-zmq", "floor", "floor+spin", "floor+yield", "mpi4py"]
FLOOR, FLOOR_SPIN, FLOOR_YIELD, PAIR, MPI = "floor", "floor+spin", "floor+yield", "PAIR", "mpi4py"
FLOORS = (FLOOR, FLOOR_SPIN, FLOOR_YIELD)
QUEUE_SIZE = 4  # one master, three workers
PINGPONG_WARMUP = 50  # round trips before the timed ones: links made, caches warm
QUEUE_WARMUP = 200  # tasks before the clock starts
SEQPACKET_MAX = 1 << 16  # a small dict's pickle is ~70 bytes
INIT_TIMEOUT_S = 120
RUN_TIMEOUT_S = 300  # one backend, one round
STOP = {"task": -1}
DEFAULT_OUT = os.path.join(HERE, "results", "issue47-baseline.json")


def small(i: int) -> dict[str, Any]:
    return {"task": i, "payload": "x" * 32}


# -- the endpoints: send(value, dest), recv(source), recv_any(), close() -----------------------

class ZEndpoint:
    """zcollective's module API: ``send(value, dest, tag=0)``, ``recv(source)``,
    ``recv(ANY_SOURCE)``; the secret as ``initialize``'s argument."""

    def __init__(self, rank: int, size: int, port: int, secret: str | None, local: bool = True) -> None:
        if not local:  # (this process's alone: each backend runs in processes of its own)
            os.environ["ZCOLLECTIVE_LOCAL_MAIL"] = "0"
        import zcollective

        self.zc = zcollective
        zcollective.initialize("127.0.0.1", port, rank, size, timeout=INIT_TIMEOUT_S, secret=secret)

    def send(self, value: Any, dest: int) -> None:
        self.zc.send(value, dest, 0)

    def recv(self, source: int) -> Any:
        return self.zc.recv(source, 0)

    def recv_any(self) -> Any:
        return self.zc.recv(self.zc.ANY_SOURCE, 0)

    def close(self) -> None:
        self.zc.teardown()


class MpiEndpoint:
    """mpi4py's lowercase (pickle-based) API under Open MPI."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD

    def send(self, value: Any, dest: int) -> None:
        self.comm.send(value, dest=dest, tag=0)

    def recv(self, source: int) -> Any:
        return self.comm.recv(source=source, tag=0)

    def recv_any(self) -> Any:
        return self.comm.recv(source=self.MPI.ANY_SOURCE, tag=0)

    def close(self) -> None:
        self.comm.Barrier()


class SeqpacketEndpoint:
    """One end of a ``socketpair(AF_UNIX, SOCK_SEQPACKET)``: a pickle a packet."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, value: Any, dest: int) -> None:
        self.sock.send(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self, source: int) -> Any:
        return pickle.loads(self.sock.recv(SEQPACKET_MAX))

    def close(self) -> None:
        self.sock.close()


class FloorStar:
    """What the floor's ranks share, made before ``fork``: one anonymous shared
    mapping of two rings a worker (master to worker, worker to master) and an
    eventfd a ring (it wakes that ring's reader)."""

    def __init__(self, size: int) -> None:
        self.count = 2 * (size - 1)
        self.mapping = mmap.mmap(-1, self.count * ring_bytes())  # MAP_SHARED | MAP_ANONYMOUS
        self.fds = [make_eventfd() for _ in range(self.count)]

    def ring(self, i: int) -> Ring:
        return Ring(self.mapping, i * ring_bytes(), self.fds[i])

    def to_worker(self, worker: int) -> Ring:
        return self.ring(2 * (worker - 1))

    def to_master(self, worker: int) -> Ring:
        return self.ring(2 * (worker - 1) + 1)


class FloorEndpoint:
    """A rank's rings of the star: the master's to and from every worker, a
    worker's to and from the master. Pickled values."""

    def __init__(self, star: FloorStar, rank: int, size: int, spin_s: float, yields: bool) -> None:
        workers = range(1, size)
        if rank == 0:
            self.out = {w: star.to_worker(w) for w in workers}
            inbound = {w: star.to_master(w) for w in workers}
        else:
            self.out = {0: star.to_master(rank)}
            inbound = {0: star.to_worker(rank)}
        self.waiters = {src: Waiter([ring], spin_s, yields) for src, ring in inbound.items()}
        self.any = Waiter(list(inbound.values()), spin_s, yields)
        self.star = star

    def send(self, value: Any, dest: int) -> None:
        self.out[dest].publish(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self, source: int) -> Any:
        return pickle.loads(self.waiters[source].wait_any()[1])

    def recv_any(self) -> Any:
        return pickle.loads(self.any.wait_any()[1])

    @property
    def lost_wakeups(self) -> int:
        return self.any.lost_wakeups  # (the rings' counters: every waiter's)

    def close(self) -> None:
        for ring in [*self.out.values(), *self.any.rings]:
            ring.close()


def prepare(backend: str, size: int) -> Any:
    """What the ranks must share, made before the fork."""
    if backend.startswith(FLOOR):
        return FloorStar(size)
    if backend == "seqpacket":
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return None


def endpoint(backend: str, rank: int, size: int, port: int, shared: Any) -> Any:
    if backend.startswith("zcollective"):
        return ZEndpoint(rank, size, port, SECRET if backend.endswith("secret") else None,
                         local=not backend.endswith("-zmq"))
    if backend == PAIR:
        from backends import PairFloor

        return PairFloor(rank, size, port)
    if backend == "seqpacket":
        mine, other = shared[rank], shared[1 - rank]
        other.close()
        return SeqpacketEndpoint(mine)
    if backend.startswith(FLOOR):
        return FloorEndpoint(shared, rank, size, 0.0 if backend == FLOOR else SPIN_S, backend == FLOOR_YIELD)
    if backend == MPI:
        return MpiEndpoint()
    raise SystemExit(f"unknown backend {backend}")


# -- the workloads, run by every rank -------------------------------------------------------------

def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns (schedstat: ns, where
    /proc/<pid>/stat counts 10 ms ticks, too coarse for 1% of a second)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def pingpong(ep: Any, rank: int, iters: int, idle_s: float) -> dict[str, Any]:
    """The timed round trips, then the idle measure (rank 1 blocked in recv)."""
    if rank == 1:
        ep.send({"pid": os.getpid()}, 0)
    else:
        peer = ep.recv(1)["pid"]
    times = []
    c0 = time.process_time()
    for i in range(PINGPONG_WARMUP + iters):
        if i == PINGPONG_WARMUP:
            c0 = time.process_time()
        if rank == 1:
            ep.send(ep.recv(0), 0)
            continue
        value = small(i)
        t0 = time.perf_counter()
        ep.send(value, 1)
        back = ep.recv(1)
        dt = time.perf_counter() - t0
        assert back == value, f"came back changed: {back!r:.200}"
        times.append(dt)
    out: dict[str, Any] = {"cpu_s_per_round_trip": (time.process_time() - c0) / iters}
    if rank == 1:
        usage = self_cpu_s()
        assert ep.recv(0) == STOP
        out["idle_self_cpu_s"] = self_cpu_s() - usage  # (the wake-up and the unpickling too)
        return out
    before, own, t0 = cpu_ns(peer), self_cpu_s(), time.perf_counter()
    time.sleep(idle_s)
    after, own_after, window = cpu_ns(peer), self_cpu_s(), time.perf_counter() - t0
    ep.send(STOP, 1)
    return {**out, "times_s": times, "idle_window_s": window, "idle_peer_cpu_s": (after - before) / 1e9,
            "idle_own_cpu_s": own_after - own}


def queue(ep: Any, rank: int, size: int, seconds: float) -> dict[str, Any]:
    """One master, workers answering each task: tasks per second, measured by the master."""
    c0 = time.process_time()
    if rank != 0:
        while (task := ep.recv(0)) != STOP:
            ep.send({"task": task["task"], "rank": rank}, 0)
        return {"cpu_s": time.process_time() - c0}
    outstanding = {}
    for w in range(1, size):
        outstanding[w] = w
        ep.send({"task": w}, w)
    next_task, done, t0, t1 = size, 0, 0.0, 0.0
    while True:
        reply = ep.recv_any()
        w = reply["rank"]
        assert reply["task"] == outstanding.pop(w), f"worker {w} answered {reply!r} for another task"
        done += 1
        now = time.perf_counter()
        if done == QUEUE_WARMUP:
            t0, c0 = now, time.process_time()
        elif done > QUEUE_WARMUP and now - t0 >= seconds:
            t1 = now
            break
        outstanding[w] = next_task
        ep.send({"task": next_task}, w)
        next_task += 1
    cpu = time.process_time() - c0
    tasks = done - QUEUE_WARMUP
    while outstanding:  # the other workers' last tasks
        outstanding.pop(ep.recv_any()["rank"])
    for w in range(1, size):
        ep.send(STOP, w)
    return {"tasks": tasks, "seconds": t1 - t0, "tasks_per_s": tasks / (t1 - t0),
            "cpu_s_per_task": cpu / tasks}


def pin(how: str, rank: int) -> None:
    """--pin: every rank on the first CPU this process may use ('same'), or each on
    its own in turn ('split'); before any thread starts, so that all inherit it."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0] if how == "same" else cpus[rank % len(cpus)]})


def run_rank(backend: str, rank: int, size: int, args: argparse.Namespace, shared: Any) -> None:
    if args.pin:
        pin(args.pin, rank)
    ep = endpoint(backend, rank, size, args.port, shared)
    if args.bench == "pingpong":
        result = pingpong(ep, rank, args.iters, args.idle_s)
    else:
        result = queue(ep, rank, size, args.seconds)
    if isinstance(ep, FloorEndpoint):
        result["lost_wakeups"] = ep.lost_wakeups
    ep.close()
    with open(args.out.format(rank=rank), "w") as f:
        json.dump({"rank": rank, **result}, f)


def run_forked(args: argparse.Namespace) -> None:
    """Rank 0 in this process, the others forked from it once what they share is made."""
    shared = prepare(args.worker, args.size)
    children = []
    for rank in range(1, args.size):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_rank(args.worker, rank, args.size, args, shared)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    try:
        run_rank(args.worker, 0, args.size, args, shared)
    except BaseException:
        for pid in children:  # (ours: they would wait for rank 0 forever)
            os.kill(pid, signal.SIGKILL)
        raise
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    if any(codes):
        raise SystemExit(f"a forked rank failed: exit codes {codes}")


# -- the launcher: rounds, summaries, tables -----------------------------------------------------------

def launch(backend: str, bench: str, size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One backend's run of one workload in fresh processes: each rank's JSON."""
    me = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as tmp:
        pattern = os.path.join(tmp, "r{rank}.json")
        flags = ["--worker", backend, "--bench", bench, "--size", str(size), "--port", str(free_port()),
                 "--iters", str(args.iters), "--idle-s", str(args.idle_s), "--seconds", str(args.seconds),
                 "--out", pattern, *(["--pin", args.pin] if args.pin else [])]
        cmd = [sys.executable, me, *flags]
        if backend == MPI:
            cmd = [*MPIRUN, "-n", str(size), *cmd]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            log = proc.communicate(timeout=RUN_TIMEOUT_S)[0].decode()
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session it leads: its forked ranks too
            log = proc.communicate()[0].decode() + "\n(killed: timeout)"
        outs = [pattern.format(rank=r) for r in range(size)]
        if proc.returncode != 0 or not all(os.path.exists(o) for o in outs):
            raise RuntimeError(f"{backend} {bench} failed:\n{log[-3000:]}")
        data = []
        for o in outs:
            with open(o) as f:
                data.append(json.load(f))
        return data


def summarize_pingpong(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds of each round's figure (rank 0's round trips; rank 1's idle CPU)."""
    medians = [statistics.median(r[0]["times_s"]) for r in runs]
    pooled = sorted(t for r in runs for t in r[0]["times_s"])
    idle = [r[0]["idle_peer_cpu_s"] / r[0]["idle_window_s"] for r in runs]
    entry = {
        "median_s": statistics.median(medians), "rounds_median_s": medians,
        "p10_s": pooled[len(pooled) // 10], "p90_s": pooled[int(0.9 * (len(pooled) - 1))],
        "cpu_s_per_round_trip": [statistics.median(r[k]["cpu_s_per_round_trip"] for r in runs)
                                 for k in (0, 1)],
        "idle_core_fraction": statistics.median(idle), "rounds_idle_core_fraction": idle,
        "idle_rank0_core_fraction": statistics.median(r[0]["idle_own_cpu_s"] / r[0]["idle_window_s"]
                                                      for r in runs),
        "idle_self_cpu_s": statistics.median(r[1]["idle_self_cpu_s"] for r in runs),
    }
    if "lost_wakeups" in runs[0][0]:
        entry["lost_wakeups"] = sum(rank["lost_wakeups"] for r in runs for rank in r)
    return entry


def summarize_queue(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    rates = [r[0]["tasks_per_s"] for r in runs]
    entry = {"tasks_per_s": statistics.median(rates), "rounds_tasks_per_s": rates,
             "master_cpu_s_per_task": statistics.median(r[0]["cpu_s_per_task"] for r in runs)}
    if "lost_wakeups" in runs[0][0]:
        entry["lost_wakeups"] = sum(rank["lost_wakeups"] for r in runs for rank in r)
    return entry


def ratio(results: dict[str, Any], backend: str, ref: str, key: str) -> str:
    if ref not in results or backend == ref:
        return "—"
    return f"{results[backend][key] / results[ref][key]:.2f}×"


def head(first: list[str], refs: tuple[str, ...], last: str) -> list[str]:
    """A table's header and rule: ``first`` columns, a ratio to each of ``refs``, then ``last``."""
    columns = [*first, *(f"× {ref}" for ref in refs), last]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def pingpong_table(results: dict[str, Any]) -> str:
    refs = (*FLOORS, PAIR)
    lines = head(["backend", "round trip, median", "p10 / p90", "rounds' medians"], refs,
                 "CPU µs a round trip, rank 0 / rank 1")
    for b, e in results.items():
        rounds = ", ".join(f"{t * 1e6:,.0f}" for t in e["rounds_median_s"])
        ratios = " | ".join(ratio(results, b, ref, "median_s") for ref in refs)
        cpu = " / ".join(f"{c * 1e6:,.0f}" for c in e["cpu_s_per_round_trip"])
        lines.append(f"| {b} | {fmt_time(e['median_s'])} | {fmt_time(e['p10_s'])} / {fmt_time(e['p90_s'])} "
                     f"| {rounds} | {ratios} | {cpu} |")
    return "\n".join(lines)


def idle_table(results: dict[str, Any], idle_s: float) -> str:
    lines = [f"| backend | rank 1 blocked in recv {idle_s:g} s: CPU, % of a core | rank 0 asleep meanwhile "
             "| rounds (rank 1) |", "|---|---|---|---|"]
    for b, e in results.items():
        rounds = ", ".join(f"{f * 100:.2f}" for f in e["rounds_idle_core_fraction"])
        lines.append(f"| {b} | {e['idle_core_fraction'] * 100:.2f}% "
                     f"| {e['idle_rank0_core_fraction'] * 100:.2f}% | {rounds} |")
    return "\n".join(lines)


def queue_table(results: dict[str, Any]) -> str:
    refs = (MPI, *FLOORS)
    lines = head(["backend (1 master, 3 workers)", "tasks/s, median", "rounds"], refs,
                 "master's CPU µs a task")
    for b, e in results.items():
        rounds = ", ".join(f"{r:,.0f}" for r in e["rounds_tasks_per_s"])
        ratios = " | ".join(ratio(results, b, ref, "tasks_per_s") for ref in refs)
        lines.append(f"| {b} | {e['tasks_per_s']:,.0f} | {rounds} | {ratios} "
                     f"| {e['master_cpu_s_per_task'] * 1e6:,.0f} |")
    return "\n".join(lines)


def targets(pp: dict[str, Any], q: dict[str, Any]) -> list[str]:
    """Issue 47's 'done when', today's figures against them."""
    lines = []
    z = pp.get("zcollective")
    floors = [f for f in FLOORS if f in pp]
    if z and floors and PAIR in pp:
        against = ", ".join(f"{z['median_s'] / pp[f]['median_s']:.2f}× {f}" for f in floors)
        lines.append(f"- round trip: zcollective {against} (target ≤ 1.5× the floor), "
                     f"{z['median_s'] / pp[PAIR]['median_s']:.2f}× PAIR (target ≤ 0.6×)")
    if "zcollective" in q and MPI in q:
        share = q["zcollective"]["tasks_per_s"] / q[MPI]["tasks_per_s"]
        lines.append(f"- work queue: zcollective {share:.2f}× mpi4py's tasks/s (target ≥ 0.5×)")
    if z:
        lines.append(f"- idle: a zcollective rank blocked in recv used {z['idle_core_fraction'] * 100:.2f}% "
                     "of a core (target < 1%)")
    lost = sum(e.get("lost_wakeups", 0) for e in [*pp.values(), *q.values()])
    lines.append(f"- the floor's lost wake-ups (a safety poll that found a record): {lost}")
    return lines


def rotate(items: list[str], k: int) -> list[str]:
    k %= max(1, len(items))
    return items[k:] + items[:k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=1000, help="timed round trips a backend a round")
    parser.add_argument("--seconds", type=float, default=2.0, help="the work queue's time a backend a round")
    parser.add_argument("--idle-s", type=float, default=1.0, help="how long rank 1 is blocked in recv")
    parser.add_argument("--pingpong", default=",".join(PINGPONG_BACKENDS), help="ping-pong backends")
    parser.add_argument("--queue", default=",".join(QUEUE_BACKENDS), help="work-queue backends ('' for none)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 100 round trips, 0.5 s queues")
    parser.add_argument("--pin", choices=("same", "split"), help="pin the ranks: all to one CPU, or each to "
                        "its own (a wake-up across CPUs costs ~50 µs more on this VM)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--bench", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == MPI:
            from backends import rank_from_mpi

            run_rank(MPI, rank_from_mpi()[0], args.size, args, None)
        else:
            run_forked(args)
        return
    if args.quick:
        args.iters, args.seconds = min(args.iters, 100), min(args.seconds, 0.5)
    plan: dict[str, tuple[list[str], int]] = {
        "pingpong": ([b for b in args.pingpong.split(",") if b], 2),
        "queue": ([b for b in args.queue.split(",") if b], QUEUE_SIZE),
    }
    skipped = {}
    if MPI in args.pingpong.split(",") + args.queue.split(",") and (why := available(MPI)):
        skipped[MPI] = f"{why}: apt-get install -y openmpi-bin libopenmpi-dev && pip install mpi4py"
        plan = {bench: ([b for b in backends if b != MPI], size) for bench, (backends, size) in plan.items()}
    load = os.getloadavg()
    started = time.monotonic()
    runs: dict[str, dict[str, list[Any]]] = {bench: {b: [] for b in bs} for bench, (bs, _) in plan.items()}
    for rnd in range(args.rounds):
        for bench, (backends, size) in plan.items():
            for b in rotate(backends, rnd):
                print(f"round {rnd + 1}/{args.rounds}: {bench} {b}", file=sys.stderr, flush=True)
                runs[bench][b].append(launch(b, bench, size, args))
    pp = {b: summarize_pingpong(r) for b, r in runs["pingpong"].items()}
    q = {b: summarize_queue(r) for b, r in runs["queue"].items()}
    sections = [f"Ping-pong, small dict, N = 2 ({args.iters} round trips a round, {args.rounds} rounds):",
                pingpong_table(pp) if pp else "(none)",
                f"Idle: rank 1 blocked in recv for {args.idle_s:g} s after the ping-pongs:",
                idle_table(pp, args.idle_s) if pp else "(none)",
                f"Work queue, zero-length tasks ({args.seconds:g} s a round):",
                queue_table(q) if q else "(none)",
                "\n".join(targets(pp, q))]
    text = "\n\n".join(sections)
    print(text)
    for b, why in skipped.items():
        print(f"- {b}: skipped, {why}")
    write_json(args.out, args, load_before=load, load_after=os.getloadavg(),
               wall_s=time.monotonic() - started, iters=args.iters, seconds=args.seconds, idle_s=args.idle_s,
               spin_s=SPIN_S, skipped=skipped, pingpong=pp, queue=q, table=text,
               raw={bench: {b: [[{k: v for k, v in rank.items() if k != "times_s"} for rank in r] for r in rs]
                            for b, rs in by.items()} for bench, by in runs.items()})  # (without every time)


if __name__ == "__main__":
    main()
