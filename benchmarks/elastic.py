"""Elastic groups: how long a loss costs the survivors, and a newcomer's admission.

    python benchmarks/elastic.py                          # N = 4 and 8, 5 trials each
    python benchmarks/elastic.py --sizes 4 --trials 3 --out results/elastic.json
    python benchmarks/elastic.py --hosts --rate 1000      # one host (namespace) per rank

Each trial starts N fresh processes on loopback (zcollective.testing.Replicas).
They make 50 allreduces, then every rank but the victim calls one more, which
waits for it; the victim writes down ``time.monotonic()`` (one clock for every
process on a Linux host) and then

- ``killed``: SIGKILLs itself (its connections close): rank 0, a middle rank
  (N/2) or the last;
- ``stopped``: SIGSTOPs itself (silent, as a host cut off is: heartbeats go
  unanswered), the middle rank, with ``liveness_timeout`` of 2 s;
- ``cut`` (with ``--hosts``): its host's link is cut (tests/netns.py), the
  middle rank, ``liveness_timeout`` 2 s: a silent host, as a pulled cable is.

With ``--hosts`` every rank runs in a network namespace of its own (the
shaped hosts of ``multihost.py``, ``--rate`` Mbit/s each way), so a host that
takes over the coordinator is another address.

Each survivor catches the ReplicaLostError, calls ``shrink()`` and makes one
allreduce in the new group; the figure is the time from the victim's moment to
the last survivor's first result. ``admit``: N members make allreduce + grow()
in a loop; a newcomer's ``initialize(join=True)`` is timed to its return (the
members' next grow, then forming the group of N + 1).

Prints a markdown table of medians (and min–max), writes JSON. Horovod Elastic's
re-initialisation alone, as its issue 3556 reports it (not measured here: Horovod
is not installed), is 0.4 s at 2 ranks, 1.2 s at 4, 7.1 s at 8 and 15.8 s at 16.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # netns.py, shared with the tests

import zcollective as zc  # noqa: E402
from zcollective.testing import Replicas  # noqa: E402

HOROVOD_REINIT_S = {2: 0.4, 4: 1.2, 8: 7.1, 16: 15.8}  # horovod/horovod issue 3556
RUN_S = 120
STOPPED_LIVENESS_S = 2.0


def lose(victim: int, how: str, moment: str) -> Optional[float]:
    """One rank's part of a loss trial (see the module docstring)."""
    rank = zc.get_rank()
    if rank == victim:
        for _ in range(50):
            zc.allreduce(1)
        with open(moment + ("-ready" if how == "cut" else ""), "w") as f:
            f.write(repr(time.monotonic()))
        if how != "cut":  # (cut: the trial cuts its host off, and writes the moment)
            os.kill(os.getpid(), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        time.sleep(60)  # (stopped, cut: the trial ends it)
        return None
    try:
        for _ in range(51):  # the last waits for the victim (a rank 0 that dies may not have sent
            zc.allreduce(1, timeout=60)  # the 50th's result either)
        raise AssertionError("no loss")
    except zc.ReplicaLostError:
        pass
    zc.shrink()
    zc.allreduce(1)
    return time.monotonic()


def admit_members(target: int) -> Optional[float]:
    deadline = time.monotonic() + 60
    while zc.get_world_size() < target and time.monotonic() < deadline:
        zc.allreduce(1)
        zc.grow()
    zc.allreduce(1)  # the newcomer's first call
    return None


def admit_newcomer() -> float:
    started = time.monotonic()
    zc.initialize(join=True)
    took = time.monotonic() - started
    zc.allreduce(1)
    return took


def _where(hosts: Any, size: int) -> dict[str, Any]:
    """Replicas' placement: loopback, or a namespace (host) per rank."""
    if hosts is None:
        return {}
    return {"rank_prefix": {r: hosts.prefix(r) for r in range(size)},
            "env": {"ZCOLLECTIVE_MASTER_ADDR": hosts.addresses[0]}}


def trial_loss(size: int, victim: int, how: str, hosts: Any = None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        moment = os.path.join(tmp, "moment")
        where: dict[str, Any] = _where(hosts, size)
        env = dict(where.pop("env", {}))
        if how != "killed":
            env["ZCOLLECTIVE_LIVENESS_TIMEOUT"] = str(STOPPED_LIVENESS_S)
        with Replicas(lose, size, victim, how, moment, env=env, **where) as reps:
            if how == "cut":
                deadline = time.monotonic() + RUN_S
                while not os.path.exists(moment + "-ready") and time.monotonic() < deadline:
                    time.sleep(0.001)
                hosts.cut(victim)
                with open(moment, "w") as f:
                    f.write(repr(time.monotonic()))
                try:
                    reps.join([r for r in range(size) if r != victim], RUN_S)
                finally:
                    reps.kill(victim, signal.SIGKILL)
                    hosts.restore(victim)
            if how == "stopped":
                deadline = time.monotonic() + RUN_S
                while not os.path.exists(moment) and time.monotonic() < deadline:
                    time.sleep(0.01)
                survivors = [r for r in range(size) if r != victim]
                reps.join(survivors, RUN_S)
                reps.kill(victim, signal.SIGKILL)
            outs = reps.wait(RUN_S)
        with open(moment) as f:
            t0 = float(f.read())
    done = [o.value for o in outs if o.rank != victim]
    if not all(o.ok for o in outs if o.rank != victim) or None in done:
        raise RuntimeError("a survivor failed:\n" + "".join(o.describe() for o in outs))
    return max(done) - t0


def trial_admit(size: int, hosts: Any = None) -> float:
    where: dict[str, Any] = _where(hosts, size)
    env = dict(where.pop("env", {}))
    with Replicas(admit_members, size, size + 1, env=env, **where) as members:
        time.sleep(0.5)
        elsewhere: dict[str, Any] = {} if hosts is None else {"rank_prefix": {0: hosts.prefix(size)}}
        with Replicas(admit_newcomer, 1, initialize=False, port=members.port,
                      env={**env, "ZCOLLECTIVE_NUM_REPLICAS": ""}, **elsewhere) as newcomer:
            new = newcomer.wait(RUN_S)
        old = members.wait(RUN_S)
    if not all(o.ok for o in old + new):
        raise RuntimeError("a rank failed:\n" + "".join(o.describe() for o in old + new))
    return float(new[0].value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,8")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "elastic.json"))
    parser.add_argument("--hosts", action="store_true", help="a network namespace per rank")
    parser.add_argument("--rate", type=float, default=1000.0, help="with --hosts: Mbit/s per link")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.hosts:
        from netns import Hosts

        with Hosts(max(sizes) + 1, args.rate, prefix="zce") as hosts:
            run(args, sizes, hosts)
    else:
        run(args, sizes, None)


def run(args: argparse.Namespace, sizes: list[int], hosts: Any) -> None:
    cases: list[tuple[str, int, Any]] = []
    for size in sizes:
        cases += [("killed rank 0", size, (0, "killed")),
                  (f"killed rank {size // 2}", size, (size // 2, "killed")),
                  (f"killed rank {size - 1}", size, (size - 1, "killed")),
                  (f"{'cut off' if hosts else 'stopped'} rank {size // 2} (L = {STOPPED_LIVENESS_S:g} s)",
                   size, (size // 2, "cut" if hosts else "stopped")),
                  ("newcomer admitted", size, None)]
    results: list[dict[str, Any]] = []
    for name, size, loss in cases:
        times = []
        for i in range(args.trials):
            print(f"N={size} {name}: trial {i + 1}/{args.trials}", file=sys.stderr, flush=True)
            times.append(trial_loss(size, loss[0], loss[1], hosts) if loss is not None
                         else trial_admit(size, hosts))
        results.append({"case": name, "size": size, "seconds": times, "median": statistics.median(times)})
    lines = ["| N | case | median (s) | min–max (s) | Horovod's re-init alone (s) |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['size']} | {r['case']} | {r['median']:.3f} | {min(r['seconds']):.3f}–"
                     f"{max(r['seconds']):.3f} | {HOROVOD_REINIT_S.get(r['size'], '—')} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                   "placement": f"a namespace per rank, {args.rate:g} Mbit/s" if hosts else "loopback",
                   "horovod_reinit_s": HOROVOD_REINIT_S, "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
