"""What a process started by zcollective-run tells the launcher in files it named (best effort), and the
launcher's reader of them (:class:`Groups`): both sides of one format."""

from __future__ import annotations

import json
import os
import threading
from typing import Any, NamedTuple, Optional

GROUPS_FILE_ENV = "ZCOLLECTIVE_GROUPS_FILE"  # a line per group joined; rank 0's stats at its close
COORDINATOR_FILE_ENV = "ZCOLLECTIVE_COORDINATOR_FILE"  # --replace-lost: each rank 0 writes host:port here
STACKS_DIR_ENV = "ZCOLLECTIVE_STACKS_DIR"  # a file named by a pid here asks that process for its stacks
READ_BYTES = 1 << 16  # the launcher reads the groups file in chunks of this size
MAX_STACKS = 64  # a stall names at most this many ranks whose stacks are shown


def _tell_launcher(session: int, **fields: Any) -> None:
    """Append one JSON line to the launcher's file in one ``write`` (no other process splits it)."""
    path = os.environ.get(GROUPS_FILE_ENV)
    if not path:
        return
    record = {"pid": os.getpid(), "group": f"{session:x}", **fields}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # no O_CREAT: the launcher's file, or none
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except (OSError, TypeError, ValueError):
        pass


def announce_group(rank: int, size: int, session: int, lineage: Optional[str], stacks: bool = False) -> None:
    """Joined ``session`` (formed from ``lineage``) as ``rank`` of ``size``; ``stacks``: it answers."""
    _tell_launcher(session, lineage=lineage, rank=rank, size=size, stacks=stacks)


def write_for_launcher(stats: dict[str, Any], session: int) -> None:
    """Rank 0, at the end of a group: leave its stats for the launcher's slowest-rank line."""
    if session:  # (0: it closed before the group formed)
        _tell_launcher(session, stats=stats)


def announce_stall(session: int, ranks: list[int], line: str) -> None:
    """Rank 0 warned of a stall naming ``ranks``: the launcher shows where their programs are."""
    _tell_launcher(session, stall=ranks, line=line[:2000])


def announce_coordinator(address: str) -> None:
    """Rank 0 under ``--replace-lost``: where the coordinator is (``host:port pid``), replaced whole."""
    path = os.environ.get(COORDINATOR_FILE_ENV)
    if not path:
        return
    try:
        with open(path + ".new", "w") as f:
            f.write(f"{address} {os.getpid()}")
        os.replace(path + ".new", path)
    except OSError:
        pass


# -- the launcher's side: reading what the processes wrote --


class Place(NamedTuple):
    """A process's place in a group, as it said when it joined."""

    group: str  # the group's id (its session, in hex)
    rank: int
    size: int
    stacks: bool = False  # it answers requests for its stacks (ZCOLLECTIVE_STACKS was not 0)


class Groups:
    """The groups file as the launcher reads it: each process's group, lineage, rank 0's stats, stalls."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.lock = threading.Lock()
        self.partial = b""  # a line being written
        self.of_pid: dict[int, Place] = {}
        self.lineage: dict[str, Optional[str]] = {}  # group -> the group it was formed from
        self.size: dict[str, int] = {}
        self.formed: list[str] = []  # the groups, in the order they were first announced
        self.stats: dict[str, dict[str, Any]] = {}
        self.stalls: list[tuple[str, list[int]]] = []  # (group, ranks) a stall warning named, not yet shown

    def refresh(self) -> None:
        """Take in the lines written since the last call."""
        with self.lock:
            while chunk := os.read(self.fd, READ_BYTES):
                self.partial += chunk
            *lines, self.partial = self.partial.split(b"\n")
            for line in lines:
                self._take(line)

    def _take(self, line: bytes) -> None:
        try:
            record = json.loads(line)
            pid, group = int(record["pid"]), str(record["group"])
            if "stats" in record:
                self.stats[group] = dict(record["stats"])
                return
            if "stall" in record:
                self.stalls.append((group, [int(r) for r in record["stall"]][:MAX_STACKS]))
                return
            joined = Place(group, int(record["rank"]), int(record["size"]), record.get("stacks") is True)
            lineage = record["lineage"]
        except (ValueError, KeyError, TypeError):
            return  # not a line of the library's (written by hand?)
        self.of_pid[pid] = joined
        if group not in self.lineage:
            self.lineage[group], self.size[group] = lineage, joined.size
            self.formed.append(group)

    def current(self, pid: int) -> Optional[Place]:
        """The group ``pid`` joined last, and its rank there (None: none yet)."""
        self.refresh()
        return self.of_pid.get(pid)

    def take_stalls(self) -> list[tuple[str, list[int]]]:
        """The stalls named since the last call: (group, ranks)."""
        with self.lock:
            stalls, self.stalls = self.stalls, []
        return stalls

    def forget(self, pid: int) -> None:
        """A new process has this pid: what a dead one of the same pid said is not its."""
        with self.lock:
            self.of_pid.pop(pid, None)

    def formed_from(self, group: str) -> Optional[str]:
        """The newest group formed from ``group`` (by shrinks and grows), or None."""
        with self.lock:
            for newer in reversed(self.formed):
                seen, parent = set(), self.lineage[newer]
                while parent is not None and parent not in seen:
                    if parent == group:
                        return newer
                    seen.add(parent)
                    parent = self.lineage.get(parent)
        return None

    def close(self) -> None:
        os.close(self.fd)
