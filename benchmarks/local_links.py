"""The round trip of a 100-byte message between two processes through ``zcollective._io._local.LocalLinks``
(each side waiting in ``select.poll`` on its ``fd``), beside a bare ``socketpair(AF_UNIX, SOCK_SEQPACKET)``
(waiting in ``select.poll`` on the socket): what the local links cost above the socket they are built on.

    PYTHONPATH=$PWD python benchmarks/local_links.py                # 4 rounds, each backend once a round
    PYTHONPATH=$PWD python benchmarks/local_links.py --pin same     # both processes on one CPU

Each round forks a fresh pair of processes a backend, the order alternating from round to round; rank 0
times ``--iters`` round trips after ``WARMUP``; printed: each round's median (µs) and the median of those.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import time
from typing import Any, Callable

from zcollective._io._local import LocalLinks

WARMUP = 200
MESSAGE = b"x" * 100
WAIT_MS = 10_000  # a round trip never takes this long: a lost message fails the run, not hangs it
KEY, SESSION = b"k" * 32, 1


def pin(how: str, rank: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0] if how == "same" else cpus[rank % len(cpus)]})


def rounds_of(rank: int, iters: int, send: Callable[[], None], take: Callable[[], Any]) -> list[float]:
    """Rank 0 sends and times the answer; rank 1 answers."""
    times = []
    for _ in range(WARMUP + iters):
        if rank == 0:
            start = time.perf_counter()
            send()
            take()
            times.append(time.perf_counter() - start)
        else:
            take()
            send()
    return times[WARMUP:]


def local_side(rank: int, iters: int, rfd: int, wfd: int) -> list[float]:
    links = LocalLinks(1 << 30)
    os.write(wfd, links.name.encode() + b"\n")
    other = os.read(rfd, 100).decode().strip()
    links.start(KEY, SESSION, rank, [links.name, other] if rank == 0 else [other, links.name])
    poller = select.poll()
    poller.register(links.fd, select.POLLIN)

    def take() -> Any:
        while True:
            assert poller.poll(WAIT_MS), "no answer"
            msg = links.recv()
            if msg is not None:
                return msg

    try:
        return rounds_of(rank, iters, lambda: links.send(1 - rank, [MESSAGE]) and None, take)
    finally:
        links.close(linger_ms=1000)


def pair_side(rank: int, iters: int, sock: socket.socket) -> list[float]:
    poller = select.poll()
    poller.register(sock, select.POLLIN)

    def take() -> bytes:
        assert poller.poll(WAIT_MS), "no answer"
        return sock.recv(65536)

    return rounds_of(rank, iters, lambda: sock.send(MESSAGE) and None, take)


def run(backend: str, iters: int, how: str) -> float:
    """One round of ``backend``: rank 1 forked, rank 0 here; rank 0's median round trip (µs)."""
    if backend == "socketpair":
        ends = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    else:
        (r0, w1), (r1, w0) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if how:
                pin(how, 1)
            if backend == "socketpair":
                pair_side(1, iters, ends[1])
            else:
                local_side(1, iters, r1, w1)
            code = 0
        finally:
            os._exit(code)
    if how:
        pin(how, 0)
    times = pair_side(0, iters, ends[0]) if backend == "socketpair" else local_side(0, iters, r0, w0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, f"rank 1 of {backend} failed"
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--pin", choices=["same", "split"], default="")
    args = parser.parse_args()
    medians: dict[str, list[float]] = {"socketpair": [], "LocalLinks": []}
    for r in range(args.rounds):
        for backend in list(medians)[:: 1 if r % 2 == 0 else -1]:
            medians[backend].append(run(backend, args.iters, args.pin))
    print(f"100-byte round trip, median of {args.iters} a round; load {os.getloadavg()[0]:.2f}; "
          f"pin: {args.pin or 'none'}")
    for backend, values in medians.items():
        print(f"{backend:11s} {statistics.median(values):6.1f} µs  (rounds: "
              + ", ".join(f"{v:.1f}" for v in values) + ")")


if __name__ == "__main__":
    main()
