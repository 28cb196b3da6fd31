"""Who is slow: what every rank's calls cost, and on rank 0 how late each
rank's contributions arrive. Always on, so it is cheap: a counter or two and
one float kept per call; percentiles are computed only when asked for, over
the last :data:`SAMPLES` calls. Knows nothing of sockets.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from typing import Any, Optional

SAMPLES = 1024  # recent calls kept per operation (and per rank) for the median and p90
STATS_FILE_ENV = "ZCOLLECTIVE_STATS_FILE"  # set by zcollective-run: rank 0 writes its stats there

calls_log = logging.getLogger("zcollective.calls")


def percentiles(values: Any) -> dict[str, Optional[float]]:
    """The median and 90th percentile of ``values`` (None when empty)."""
    ordered = sorted(values)  # a deque is copied whole, holding the GIL: safe across threads
    if not ordered:
        return {"median": None, "p90": None}
    n = len(ordered)
    return {"median": ordered[n // 2], "p90": ordered[min(n - 1, n * 9 // 10)]}


class OpStats:
    __slots__ = ("calls", "bytes_sent", "bytes_received", "waits")

    def __init__(self) -> None:
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.waits: deque[float] = deque(maxlen=SAMPLES)


class CallStats:
    """One rank's calls, by operation."""

    def __init__(self) -> None:
        self.ops: dict[str, OpStats] = {}

    def record(self, op: str, sent: int, received: int, waited: float) -> None:
        stats = self.ops.get(op)
        if stats is None:
            stats = self.ops[op] = OpStats()
        stats.calls += 1
        stats.bytes_sent += sent
        stats.bytes_received += received
        stats.waits.append(waited)

    def summary(self) -> dict[str, Any]:
        out = {}
        for op, stats in sorted(self.ops.items()):
            wait = percentiles(stats.waits)
            out[op] = {"calls": stats.calls, "bytes_sent": stats.bytes_sent,
                       "bytes_received": stats.bytes_received,
                       "wait_median_s": wait["median"], "wait_p90_s": wait["p90"]}
        return out


class Lateness:
    """At the coordinator: for each completed call, how long after the first
    contribution each rank's arrived, and which rank was last."""

    def __init__(self, size: int) -> None:
        self.calls = 0
        self.late: list[deque[float]] = [deque(maxlen=SAMPLES) for _ in range(size)]
        self.last = [0] * size

    def record(self, arrived: dict[int, float]) -> None:
        if len(arrived) < 2:
            return
        first = min(arrived.values())
        for rank, when in arrived.items():
            self.late[rank].append(when - first)
        self.last[max(arrived, key=arrived.__getitem__)] += 1
        self.calls += 1

    def summary(self) -> dict[int, dict[str, Any]]:
        out = {}
        for rank, late in enumerate(self.late):
            p = percentiles(late)
            out[rank] = {"late_median_s": p["median"], "late_p90_s": p["p90"],
                         "last_share": self.last[rank] / self.calls if self.calls else None}
        return out


def slowest(ranks: dict[Any, dict[str, Any]]) -> Optional[str]:
    """One line naming the rank whose contributions arrive latest, or None
    (no call of two or more ranks was recorded)."""
    known = {int(r): s for r, s in ranks.items() if s.get("late_median_s") is not None}
    if not known:
        return None
    rank, s = max(known.items(), key=lambda item: (item[1]["late_median_s"], item[1]["last_share"] or 0))
    return (f"slowest rank {rank}: its contributions arrived a median {s['late_median_s'] * 1000:.3g} ms "
            f"(p90 {s['late_p90_s'] * 1000:.3g} ms) after the first; last in "
            f"{(s['last_share'] or 0) * 100:.0f}% of calls")


def write_for_launcher(stats: dict[str, Any]) -> None:
    """Rank 0, at the end of a group started by zcollective-run: leave the
    stats where the launcher will read them (best effort)."""
    path = os.environ.get(STATS_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump(stats, f)
    except OSError:
        pass
