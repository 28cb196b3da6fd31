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
GROUPS_FILE_ENV = "ZCOLLECTIVE_GROUPS_FILE"  # set by zcollective-run: each process appends a line
# there when it joins a group, and rank 0 its stats when it closes one (the launcher follows ranks)
COORDINATOR_FILE_ENV = "ZCOLLECTIVE_COORDINATOR_FILE"  # set by zcollective-run --replace-lost: the
# rank 0 of each group (it moves when rank 0 is lost) writes the coordinator's host:port there

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


def _tell_launcher(record: dict[str, Any]) -> None:
    """Append one JSON line to the file zcollective-run named (best effort).
    One ``write`` of a file opened to append: the processes of a job share
    the file, and a line is never split by another's."""
    path = os.environ.get(GROUPS_FILE_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # no O_CREAT: the launcher's file, or none
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except (OSError, TypeError, ValueError):
        pass


def announce_group(rank: int, size: int, session: int, lineage: Optional[str], stacks: bool = False) -> None:
    """A process started by zcollective-run, once it joined a group (the one
    ``session`` names, formed from the group ``lineage`` names, if any): say
    its rank and size there, for the launcher's line prefix and for it to see
    survivors go on after a loss; ``stacks``: it writes its threads' stacks on
    SIGUSR1 (the launcher sends that signal to no other process)."""
    _tell_launcher({"pid": os.getpid(), "group": f"{session:x}", "lineage": lineage,
                    "rank": rank, "size": size, "stacks": stacks})


def write_for_launcher(stats: dict[str, Any], session: int) -> None:
    """Rank 0, at the end of a group (``session``) started by zcollective-run:
    leave the stats where the launcher will read them (best effort)."""
    if session:  # (0: it closed before the group formed)
        _tell_launcher({"pid": os.getpid(), "group": f"{session:x}", "stats": stats})


def announce_stall(session: int, ranks: list[int], line: str) -> None:
    """Rank 0 of a group (``session``) started by zcollective-run warned of a
    stall naming ``ranks``: the launcher shows where their programs are."""
    _tell_launcher({"pid": os.getpid(), "group": f"{session:x}", "stall": ranks, "line": line[:2000]})


def announce_coordinator(address: str) -> None:
    """Rank 0 of a group started by ``zcollective-run --replace-lost``: say
    where the coordinator is (``host:port pid``), for newcomers the launcher
    starts (best effort; replaced whole, so a reader never sees half)."""
    path = os.environ.get(COORDINATOR_FILE_ENV)
    if not path:
        return
    try:
        with open(path + ".new", "w") as f:
            f.write(f"{address} {os.getpid()}")
        os.replace(path + ".new", path)
    except OSError:
        pass
