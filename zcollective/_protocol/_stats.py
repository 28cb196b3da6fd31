"""Who is slow: what every rank's calls cost, and on rank 0 how late each
rank's contributions arrive. Always on, so it is cheap: a counter or two and
one float kept per call; percentiles are computed only when asked for, over
the last :data:`SAMPLES` calls. Knows nothing of sockets or files (what the
launcher is told is written by :mod:`zcollective._announce`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Optional

SAMPLES = 1024  # recent calls kept per operation (and per rank) for the median and p90
calls_log = logging.getLogger("zcollective.calls")


def percentiles(values: Any) -> dict[str, Optional[float]]:
    """The median and 90th percentile of ``values`` (None when empty)."""
    ordered = sorted(values)  # a deque is copied whole, holding the GIL: safe across threads
    if not ordered:
        return {"median": None, "p90": None}
    n = len(ordered)
    return {"median": ordered[n // 2], "p90": ordered[min(n - 1, n * 9 // 10)]}


class CallStats:
    """One rank's calls, by operation: running totals, and the waits of the
    last :data:`SAMPLES` calls of each."""

    def __init__(self) -> None:
        self.totals: dict[str, list[int]] = {}  # op -> [calls, bytes sent, bytes received]
        self.waits: dict[str, deque[float]] = {}

    def record(self, op: str, sent: int, received: int, waited: float) -> None:
        try:
            totals = self.totals[op]
        except KeyError:
            totals = self.totals[op] = [0, 0, 0]
            self.waits[op] = deque(maxlen=SAMPLES)
        totals[0] += 1
        totals[1] += sent
        totals[2] += received
        self.waits[op].append(waited)

    def summary(self) -> dict[str, Any]:
        out = {}
        for op, (calls, sent, received) in sorted(self.totals.items()):
            wait = percentiles(self.waits[op])
            out[op] = {"calls": calls, "bytes_sent": sent, "bytes_received": received,
                       "wait_median_s": wait["median"], "wait_p90_s": wait["p90"]}
        return out


class Lateness:
    """At the coordinator: the arrival times of each of the last
    :data:`SAMPLES` completed calls, by rank; how late each rank was after
    the first, and who was last, are worked out when asked for."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = 0
        self.recent: deque[dict[int, float]] = deque(maxlen=SAMPLES)

    def record(self, arrived: dict[int, float]) -> None:
        self.calls += 1
        self.recent.append(arrived)

    def summary(self) -> dict[int, dict[str, Any]]:
        late: list[list[float]] = [[] for _ in range(self.size)]
        last = [0] * self.size
        recent = [a for a in list(self.recent) if len(a) > 1]  # copied whole, holding the GIL
        for arrived in recent:
            first = min(arrived.values())
            for rank, when in arrived.items():
                late[rank].append(when - first)
            last[max(arrived, key=arrived.__getitem__)] += 1
        out = {}
        for rank in range(self.size):
            p = percentiles(late[rank])
            out[rank] = {"late_median_s": p["median"], "late_p90_s": p["p90"],
                         "last_share": last[rank] / len(recent) if recent else None}
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
