"""How the coordinator's cost per operation grows with the number of replicas.

    python benchmarks/scale.py        # N = 2 ... 64; prints a table, writes results/scale.json

Rank 0 is a real zcollective group (module API). The other N-1 ranks are
simulated by a few processes, each holding many DEALER sockets that speak the
wire protocol directly and do nothing else, so 2 cores suffice and what grows
is the coordinator's work. Reported: rank 0's median time per small allreduce,
and that divided by N (it must stay flat: linear growth, not worse).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
PROCESSES = 2  # simulated-replica processes; one per core
WARMUP = 20


def simulate(ranks: list[int], n: int, port: int, iters: int) -> None:
    from zcollective._format import _bodies, _serialize
    from zcollective._format._wire import Kind, Message, decode, encode
    from zcollective._io._dealer import routing_id
    from zcollective._protocol._coordinator import PYTHON_VERSION
    from zcollective._protocol._ops import SPOKEN, Op

    ctx = zmq.Context()
    dealers = []
    for rank in ranks:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.ROUTING_ID, routing_id(rank))
        d.setsockopt(zmq.LINGER, 1000)
        d.connect(f"tcp://127.0.0.1:{port}")
        join = _bodies.join(rank, n, PYTHON_VERSION, os.urandom(8).hex(), None, None, 0, "off", ops=SPOKEN)
        d.send_multipart(encode(join))  # the library's own JOIN: the simulation cannot drift from it
        dealers.append((rank, d))
    session = 0
    for _, d in dealers:
        session = decode(d.recv_multipart()).session
    segment = _serialize.dumps(1)
    for seq in range(WARMUP + iters + 1):
        op = Op.TEARDOWN if seq == WARMUP + iters else Op.ALLREDUCE
        for rank, d in dealers:
            segs = [] if op is Op.TEARDOWN else [segment]
            d.send_multipart(encode(Message(Kind.CONTRIB, op, rank, 0, seq, session, "sim.py:1",
                                            segments=segs)))
        for _, d in dealers:
            d.recv_multipart()
    ctx.destroy(linger=1000)


def measure(n: int, iters: int) -> dict[str, float]:
    import zcollective

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    others = list(range(1, n))
    chunks = [others[i::PROCESSES] for i in range(PROCESSES)]
    procs = [multiprocessing.Process(target=simulate, args=(c, n, port, iters)) for c in chunks if c]
    for p in procs:
        p.start()
    group = zcollective.Group("127.0.0.1", port, 0, n, timeout=60)
    for _ in range(WARMUP):
        group.allreduce(1)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        assert group.allreduce(1) == n
        times.append(time.perf_counter() - t0)
    group.teardown()
    for p in procs:
        p.join(30)
    median = statistics.median(times)
    return {"n": n, "us_per_op": median * 1e6, "us_per_op_per_rank": median * 1e6 / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,4,8,16,32,64")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "scale.json"))
    args = parser.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        rounds = [measure(n, args.iters) for _ in range(args.rounds)]
        row = {"n": n, "us_per_op": statistics.median(r["us_per_op"] for r in rounds)}
        row["us_per_op_per_rank"] = row["us_per_op"] / n
        rows.append(row)
        print(f"N={n}: {row['us_per_op']:.0f} µs/op", file=sys.stderr, flush=True)
    lines = ["| replicas | µs per op (median) | µs per op per rank |", "|---|---|---|"]
    lines += [f"| {r['n']} | {r['us_per_op']:,.0f} | {r['us_per_op_per_rank']:.1f} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                   "rows": rows, "table": text}, f, indent=1)


if __name__ == "__main__":
    main()
