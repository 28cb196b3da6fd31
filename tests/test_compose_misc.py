"""Issue 44, odds and ends: promises no test guarded (a result the tree passes
down twice, a shared-memory segment of another mode, a stall timed from its
first arrival and naming every late rank), a waiting rank's "completed after"
counted from its call, and the README's promises about itself (every example
listed, the quickstart's imports installed by the first command).

The rules alone first (no sockets), then real processes."""

import ast
import logging
import os
import re
import shlex
import stat
import sys
import time

import pytest
from pair import FakeClock
from test_coordinator import SESSION, contrib, feed, join_msg, peer

import zcollective as zc
from zcollective._format._bodies import parse_status
from zcollective._format._wire import Kind, Message, decode, encode
from zcollective._io import _shared
from zcollective._io._combine import applied
from zcollective._protocol import _tree
from zcollective._protocol._coordinator import Coordinator
from zcollective.testing import Replicas, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_S = 60


# -- the tree: a result comes down once (promise 5) ------------------------------------------


def _result(rank, seq, value=7):
    msg = decode(encode(contrib(rank, seq, value=value)))
    msg.kind = Kind.RESULT
    return msg


def test_a_result_passed_down_twice_goes_to_the_children_once():
    relay = _tree.Relay(5, 16)  # ranks 5..8: children 6, 7, 8
    for rank in (5, 6, 7, 8):  # the call went up first, as every call that comes down did
        msg = contrib(rank, 3, value=rank)
        up = decode(encode(_tree.up(msg)))
        sent = relay.own(msg, zc.default_reduce_fn) if rank == 5 else relay.take(up)
    sent = list(applied(sent, relay))  # (the reduction it asked for, run as a driver runs it)
    assert len(sent) == 1 and sent[0].flags & _tree.FLAG_RANGE  # (one summary up)
    result = _result(5, 3)
    assert [(child, m.seq) for child, m in relay.down(result)] == [(6, 3), (7, 3), (8, 3)]
    assert relay.down(result) == []  # the same again: nothing
    assert relay.down(_result(5, 3, value=8)) == []  # (a replayed copy, or one altered: nothing either)
    assert [child for child, _ in relay.down(_result(5, 4))] == [6, 7, 8]  # the next call's: once
    assert relay.down(_result(5, 4)) == []


# -- shared memory: a segment not the user's alone is refused (promise 6) ---------------------


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_same_size_segment_others_may_read_is_refused(mode):
    if not _shared.available():
        pytest.skip("no POSIX shared memory here")
    import _posixshmem

    name = _shared.segment_name(int.from_bytes(os.urandom(8), "little"), 0, 1)
    capacity, size = 1 << 16, 2
    fd = _posixshmem.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=mode)  # as a stranger would,
    try:  # at the very size the group expects
        os.fchmod(fd, mode)  # (shm_open's mode passes through the umask)
        os.ftruncate(fd, 2 * size * capacity)
        assert stat.S_IMODE(os.fstat(fd).st_mode) == mode
        said = f"is not this group's .*mode {mode:o}, {2 * size * capacity} bytes"
        with pytest.raises(PermissionError, match=said):
            _shared.Segment(name, 1, capacity, size, create=False)
        os.fchmod(fd, 0o600)  # the same segment, the user's alone: attached
        _shared.Segment(name, 1, capacity, size, create=False).close()
    finally:
        os.close(fd)
        _shared.unlink(name)


# -- stalls: timed from the first arrival, every late rank named (promises 7, 8) --------------


def _running(n, clock, warn_after):
    coord = Coordinator(n, SESSION, max_frames=1000, warn_after=warn_after, clock=clock)
    for r in range(n):
        feed(coord, peer(r), join_msg(r, n))
    return coord


def _arrive(coord, clock, at, rank, seq, site):
    clock.now = at
    return feed(coord, peer(rank), contrib(rank, seq, site=site))


def test_a_stall_is_timed_from_its_first_arrival_and_names_the_last_call_of_each_late_rank(caplog):
    clock = FakeClock(1000.0)
    coord = _running(4, clock, warn_after=5.0)
    for at, rank in ((1000, 2), (1002, 3), (1003, 0), (1004, 1)):  # seq 0: each at its own moment
        _arrive(coord, clock, at, rank, 0, "train.py:10")
    _arrive(coord, clock, 1010, 0, 1, "train.py:88")  # seq 1: rank 0 first, rank 1 four seconds later,
    _arrive(coord, clock, 1014, 1, 1, "train.py:88")  # ranks 2 and 3 late
    assert coord.next_stall() == 1015.0  # warn_after from the first arrival, not the latest (1019)
    assert coord.stalls(1014.9) == []
    [(line, ranks)] = coord.stalls(1016.0)
    assert ranks == [2, 3]
    assert "seq 1 allreduce at train.py:88 has waited 6 s for ranks 2,3 (arrived: 0,1)" in line, line
    assert "rank 2 (pid 102 on h)'s last call was seq 0 allreduce at train.py:10, 16 s ago" in line, line
    assert "rank 3 (pid 103 on h)'s last call was seq 0 allreduce at train.py:10, 14 s ago" in line, line
    assert coord.next_stall() == 1020.0  # (then at twice the bound, from the same first arrival)

    clock.now = 1017.0  # what a waiting rank is told, and status(), say the same
    [(_, reply)] = feed(coord, peer(1), Message(Kind.STATUS, rank=1, seq=1, session=SESSION))
    said = parse_status(reply)["stall"]
    assert "has waited 7 s for ranks 2,3" in said and "rank 2 (pid 102" in said and "rank 3 (pid 103" in said
    snap = coord.snapshot(1017.0)
    assert [w["waiting_s"] for r in (2, 3) for w in snap[r]["waited_for"]] == [7.0, 7.0]

    _arrive(coord, clock, 1020, 2, 1, "train.py:88")
    with caplog.at_level(logging.WARNING, logger="zcollective"):
        _arrive(coord, clock, 1030, 3, 1, "train.py:88")
    assert "zcollective coordinator: seq 1 allreduce completed after 20 s; rank 3 was last" in caplog.messages


# -- a waiting rank's "completed after" counts from its call (item 16b) -----------------------

WARN_S = 1.0  # the test's warn_after


def rank_0_late():
    """Rank 0 comes late to a blocking call (2 s), then to an async one (3.5 s) that rank 1
    made at once but waits for only from 1.5 s on: rank 1's "completed after" of each (each
    arrival 1 s past rank 1's warning; counted from the warning, each figure would be 1 s or
    more short)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("zcollective").addHandler(Keep())
    me = zc.get_rank()
    zc.allreduce(1)
    took = []
    for late, waits_from in ((2.0, 0.0), (3.5, 1.5)):
        started = time.monotonic()
        if me == 0:
            time.sleep(late)
        future = zc.allreduce_async(1)
        if me == 1:
            time.sleep(waits_from)  # (the program's own work: the call is made, not yet waited for)
        future.result(timeout=30)
        took.append(time.monotonic() - started)
    return took, [m for m in records if "completed after" in m]


def test_a_waiting_ranks_completed_after_counts_from_its_call_not_its_warning():
    with Replicas(rank_0_late, 2, env={"ZCOLLECTIVE_WARN_AFTER": str(WARN_S)}) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    took, said = outs[1].value
    assert len(said) == 2, report(outs, f"rank 1 said {said}")
    for seq, waited, line in zip((1, 2), took, said, strict=True):
        assert f"rank 1: seq {seq} allreduce completed after" in line, line
        figure = float(line.rsplit("after ", 1)[1].split(" s")[0])  # (rounded to a second: 0.5 of the 0.7)
        assert abs(figure - waited) <= 0.7, report(outs, f"seq {seq} waited {waited:.2f} s: {line}")


# -- the README keeps its promises about itself ---------------------------------------------

README = os.path.join(ROOT, "README.md")
EXAMPLES = os.path.join(ROOT, "examples")
MODULE_OF = {"pyzmq": "zmq"}  # a distribution's importable name, where the two differ


def _section(title):
    with open(README, encoding="utf-8") as f:
        return f.read().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(text, language):
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def test_every_example_is_in_the_readmes_examples_table_and_every_row_is_an_example():
    listed = re.findall(r"^\| `([^`]+\.py)` \|", _section("Examples"), re.M)
    assert sorted(listed) == sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))


def _installed_by_the_first_command():
    """The modules the README's first command makes importable: the project's dependencies
    (pyproject.toml: no tomllib on Python 3.10) and whatever else it names."""
    first = _blocks(_section("Two commands"), "bash")[0].splitlines()[0]
    words = shlex.split(first.split("&&")[0], comments=True)
    assert words[:3] == ["pip", "install", "-e"] and words[3] == ".", first
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        deps = re.search(r"^dependencies = \[(.*?)\]", f.read(), re.M | re.S).group(1)
    names = re.findall(r'"([A-Za-z0-9_.-]+)', deps) + words[4:]
    return {"zcollective"} | {MODULE_OF.get(n, n).lower().replace("-", "_") for n in names}


def _imports(source):
    tops = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            tops.add(node.module.split(".")[0])
    return tops - set(sys.stdlib_module_names)


def test_the_quickstart_and_the_examples_import_only_what_the_first_command_installs():
    installed = _installed_by_the_first_command()
    quickstart = _blocks(_section("Quickstart"), "python")[0]
    assert _imports(quickstart) <= installed, (_imports(quickstart), installed)
    for name in sorted(os.listdir(EXAMPLES)):
        if name.endswith(".py"):
            with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
                needs = _imports(f.read())
            assert needs <= installed, (name, needs - installed)
