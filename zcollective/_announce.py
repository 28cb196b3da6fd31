"""What a process started by zcollective-run tells the launcher, in files
the launcher named in its environment (best effort: a process started
otherwise writes nothing), and where the launcher asks it for its stacks.
The launcher (:mod:`zcollective.run`) reads them: the format is its, line
for line.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

GROUPS_FILE_ENV = "ZCOLLECTIVE_GROUPS_FILE"  # set by zcollective-run: each process appends a line
# there when it joins a group, and rank 0 its stats when it closes one (the launcher follows ranks)
COORDINATOR_FILE_ENV = "ZCOLLECTIVE_COORDINATOR_FILE"  # set by zcollective-run --replace-lost: the
# rank 0 of each group (it moves when rank 0 is lost) writes the coordinator's host:port there
STACKS_DIR_ENV = "ZCOLLECTIVE_STACKS_DIR"  # set by zcollective-run: it asks a process for its threads'
# stacks by making a file there named by its pid (zcollective._io._stacks answers, and removes it)


def _tell_launcher(session: int, **fields: Any) -> None:
    """Append one JSON line about this process and the group ``session`` names to the file
    zcollective-run named (best effort). One ``write`` of a file opened to append: the
    processes of a job share the file, and a line is never split by another's."""
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
    """Joined the group ``session`` (formed from ``lineage``, if any): its rank and size
    there, for the launcher's line prefix and to see survivors go on after a loss;
    ``stacks``: it answers the launcher's requests for its threads' stacks."""
    _tell_launcher(session, lineage=lineage, rank=rank, size=size, stacks=stacks)


def write_for_launcher(stats: dict[str, Any], session: int) -> None:
    """Rank 0, at the end of a group: leave its stats for the launcher's slowest-rank line."""
    if session:  # (0: it closed before the group formed)
        _tell_launcher(session, stats=stats)


def announce_stall(session: int, ranks: list[int], line: str) -> None:
    """Rank 0 warned of a stall naming ``ranks``: the launcher shows where their programs are."""
    _tell_launcher(session, stall=ranks, line=line[:2000])


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
