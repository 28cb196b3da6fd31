"""Sub-groups and elastic groups with other features, untidily (issue 44): a rank out of file
descriptors while it dups; a rank killed, and another's program ended by that loss, while the
parent's coordinator is slow to hear of it; split on some ranks beside dup or subgroup on
others; a sub-group's errors naming world ranks; a stranger of the parent's job at a forming
sub-group's port; old_ranks() after a grow; what is one color. Each test says which defect or
promise it holds, and the pure ones need no sockets."""

import os
import re
import resource
import signal
import time

import pytest
from conftest import touch, wait_for

import zcollective as zc
from zcollective import _subgroups
from zcollective._protocol._coordinator import Joined
from zcollective.testing import Replicas, report

RUN_S = 60  # every run here takes a few seconds; this bounds one that hangs


def _outcome(fn):
    """``fn()``'s repr, or its error's type and text (a rank's result to compare across ranks)."""
    try:
        return "ok", repr(fn())
    except zc.CollectiveError as exc:
        return type(exc).__name__, str(exc)


# -- defect 10: a rank out of file descriptors while it dups -------------------------------


def dups_short_of_descriptors(short, spare, liveness):
    """Rank ``short`` may open only ``spare`` more files: its part of the dup fails. Then,
    with its limit back, the group goes on and dups again."""
    r = zc.get_rank()
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    if r == short:
        held = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (held + spare, limits[1]))
    started = time.monotonic()
    failed = _outcome(lambda: zc.dup(timeout=4 * liveness))
    took = time.monotonic() - started
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    again = zc.dup(timeout=30)
    return failed, took, zc.allreduce(1, timeout=30), again.allreduce(1, timeout=30)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts its descriptors in /proc")
@pytest.mark.parametrize(("short", "spare"), [(0, 4), (2, 4), (2, 12)],
                         ids=["its-rank-0", "a-member", "a-member-with-a-context"])
def test_a_rank_out_of_descriptors_fails_dup_alike_at_once_on_every_rank_naming_it(short, spare):
    """Defect 10: that rank failed at once, the others waited three liveness bounds and timed out
    joining "tcp://127.0.0.1:0". Now the rounds of the parent say why on every rank."""
    liveness = 5.0
    with Replicas(dups_short_of_descriptors, 3, short, spare, liveness,
                  env={"ZCOLLECTIVE_LIVENESS_TIMEOUT": str(liveness)}) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    failed = [o.value[0] for o in outs]
    assert failed[0] == failed[1] == failed[2], report(outs, f"not alike: {failed}")
    kind, message = failed[0]
    assert kind == "CollectiveError" and message.startswith(f"dup: rank {short} could not open "), \
        report(outs, message)
    assert "Too many open files" in message and "the group goes on" in message, report(outs, message)
    took = max(o.value[1] for o in outs)
    assert took < liveness / 2, report(outs, f"took {took:.1f} s")
    assert all(o.value[2:] == (3, 3) for o in outs), report(outs, "the group did not go on")


# -- defect 11: the rank killed is named, not the rank its loss ended -----------------------


def ends_on_its_sub_groups_loss(ready):
    r = zc.get_rank()
    odd = zc.split(r % 2)  # rank 1 hosts ranks 1 and 3
    odd.barrier()
    zc.barrier()
    if r == 0:
        touch(ready)
    if r == 1:
        time.sleep(RUN_S)  # killed
    if r == 3:
        odd.allreduce(1, timeout=30)  # raises at once, and its program ends on it (no teardown)
    return _outcome(lambda: zc.allreduce(1, timeout=30))


def test_a_rank_killed_is_named_not_the_rank_whose_program_its_loss_ended(tmp_path):
    """Defect 11: rank 1 killed; rank 3 lost it in their sub-group at once and its program
    ended, before the parent's coordinator (rank 0, held up here for a second: busy, or a
    loaded host) heard of rank 1, so the others were told "rank 3 ended its program". A rank
    ending after a sub-group lost ranks of its parent waits for the parent's word on them."""
    ready = str(tmp_path / "ready")
    with Replicas(ends_on_its_sub_groups_loss, 4, ready, env={"ZCOLLECTIVE_LIVENESS_TIMEOUT": "4"}) as reps:
        wait_for(ready, timeout=RUN_S, watch=reps)
        time.sleep(0.2)
        reps.kill(0, signal.SIGSTOP)
        try:
            reps.kill(1)
            time.sleep(1.0)  # rank 3 has lost rank 1, and its program has ended
        finally:
            reps.kill(0, signal.SIGCONT)
        outs = reps.wait(RUN_S)
    assert outs[1].returncode == -signal.SIGKILL, report(outs, "rank 1 was to be killed")
    for r in (0, 2):
        kind, message = outs[r].value
        assert kind == "ReplicaLostError" and message.startswith("rank 1 (pid "), report(outs, message)
    assert "world rank 1" in str(outs[3].error), report(outs, "rank 3's own error")  # (its sub-group's)


# -- defect 13: split on some ranks, dup or subgroup on others -------------------------------


def splits_or(other):
    r = zc.get_rank()
    if r == 1:
        first = _outcome(lambda: zc.dup(timeout=30) if other == "dup" else zc.subgroup([0, 1], timeout=30))
    else:
        first = _outcome(lambda: zc.split(0, timeout=30))
    return first, _outcome(lambda: zc.allreduce(1, timeout=30))


@pytest.mark.parametrize("other", ["dup", "subgroup"])
def test_split_beside_dup_or_subgroup_is_a_mismatch_named_on_every_rank(other):
    """Defect 13: one side crashed (TypeError in _subgroups._check), the other got
    ReplicaLostError, and the next call was misnamed."""
    with Replicas(splits_or, 3, other) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    first, then = outs[0].value
    assert all(o.value == (first, then) for o in outs), report(outs, "not alike")
    kind, message = first
    assert kind == "CallMismatchError", report(outs, message)
    assert re.search(r"ranks? [02](,2)? called split at test_compose_subgroups.py:", message), \
        report(outs, message)  # (one of ranks 0 and 2 may not have called yet)
    assert f"rank 1 called {other} at test_compose_subgroups.py:" in message, report(outs, message)
    assert then == first, report(outs, "the next call says something else")  # (the parent failed)


# -- defect 15: a sub-group's errors name world ranks --------------------------------------


def mismatches_in_a_nested_sub_group():
    listed = zc.subgroup([3, 1])  # its rank 0 is world rank 3
    out = {}
    if listed is not None:
        twin = listed.dup()  # nested: its ranks' world ranks are its parent's
        out["mismatch"] = _outcome(lambda: twin.allreduce(1, timeout=30) if twin.rank == 0
                                   else twin.broadcast(1, timeout=30))
        if listed.rank == 1:
            out["timeout"] = _outcome(lambda: listed.allreduce(1, timeout=1))  # alone: it times out
    zc.barrier()
    return out


def test_a_sub_groups_errors_name_it_and_its_ranks_world_ranks():
    """Defect 15: "rank 0 called allreduce; rank 1 called broadcast" in a sub-group of world
    ranks 3 and 1, whose lines the launcher prefixes [3] and [1]."""
    with Replicas(mismatches_in_a_nested_sub_group, 4) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    kind, message = outs[3].value["mismatch"]
    assert outs[1].value["mismatch"] == (kind, message), report(outs, "not alike")
    assert kind == "CallMismatchError" and message.startswith(
        "the sub-group of world ranks 3,1: seq 0: rank 0 (world rank 3) called allreduce at "), message
    assert "; rank 1 (world rank 1) called broadcast(root=0) at " in message, message
    kind, message = outs[1].value["timeout"]
    assert kind == "CollectiveTimeoutError", message
    assert " allreduce timed out after 1 s on rank 1 (world rank 1) of the sub-group of world ranks 3,1: " \
           "waiting for ranks 0 (world rank 3) " in message, message


def test_the_world_names_its_ranks_as_before_and_a_sub_group_with_world_ranks():
    """Defect 15, the pure part: the helpers the coordinator and members name ranks with."""
    from zcollective._protocol._ops import group_name, rank_list

    assert rank_list([2, 0]) == "ranks 0,2" and rank_list([1]) == "rank 1"
    assert rank_list([1, 0], [5, 3]) == "ranks 0,1 (world ranks 5,3)"
    assert rank_list([0], [5, 3]) == "rank 0 (world rank 5)"
    assert group_name(None) == "" and group_name([5, 3]) == "the sub-group of world ranks 5,3"
    assert group_name(list(range(40))).endswith(",14,15,...")
    member = Joined(rank=1, peer=b"p", pid=7, host="h")
    assert member.describe() == "rank 1 (pid 7 on h)"
    member.world = 3
    assert member.describe() == "rank 1 (world rank 3, pid 7 on h)"


def sub_group_coordinator(world):
    """A running coordinator of ``len(world)`` ranks whose world ranks are ``world``."""
    from test_coordinator import SESSION, feed, join_msg, peer

    from zcollective._protocol._coordinator import Coordinator

    coord = Coordinator(len(world), SESSION, max_frames=1000, world=world)
    for r in range(len(world)):
        feed(coord, peer(r), join_msg(r, len(world)))
    return coord


def test_a_sub_groups_coordinator_names_it_and_world_ranks_in_a_mismatch_and_a_loss():
    """Defect 15, the coordinator's texts, without sockets (the world's: test_coordinator's)."""
    from test_coordinator import contrib, feed, peer

    from zcollective._protocol._ops import Op

    coord = sub_group_coordinator([3, 1, 5])
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a, site="a.py:8"))
    out = feed(coord, peer(1), contrib(1, 0, Op.BARRIER, segments=[], site="a.py:9"))
    assert out[0][1].body()["message"] == (
        "the sub-group of world ranks 3,1,5: seq 0: rank 0 (world rank 3) called allreduce at a.py:8; "
        "rank 1 (world rank 1) called barrier at a.py:9; rank 2 (world rank 5) had not called yet")
    coord = sub_group_coordinator([3, 1])
    out = coord.gone(peer(1))
    assert out[0][1].body()["message"].startswith(
        "the sub-group of world ranks 3,1: rank 1 (world rank 1, pid 101 on h) was lost ")


def test_a_rounds_root_is_the_call_that_made_it_so_split_beside_dup_is_a_mismatch():
    """Defect 13, without sockets: a split round's root is its kind (0 split, 1 subgroup, 2 dup),
    which the coordinator checks against the kinds, not the ranks (a dup of two ranks is root 2)."""
    from test_coordinator import contrib, feed, peer

    from zcollective._format._wire import Kind
    from zcollective._protocol._ops import Op

    coord = sub_group_coordinator([0, 1])
    feed(coord, peer(0), contrib(0, 0, Op.SPLIT, value="x", root=0, site="a.py:8"))
    out = feed(coord, peer(1), contrib(1, 0, Op.SPLIT, value="x", root=2, site="a.py:9"))
    assert "rank 0 (world rank 0) called split at a.py:8; rank 1 (world rank 1) called dup at a.py:9" in \
        out[0][1].body()["message"]
    coord = sub_group_coordinator([0, 1])
    feed(coord, peer(0), contrib(0, 0, Op.SPLIT, value="x", root=2))
    out = feed(coord, peer(1), contrib(1, 0, Op.SPLIT, value="y", root=2))
    assert [m.kind for _, m in out] == [Kind.RESULT, Kind.RESULT], out


# -- promise 3: subgroup lists are compared in order ---------------------------------------


def test_subgroup_lists_in_another_order_are_a_mismatch():
    """Promise 3: the order defines the new ranks; fails on a copy that compares them sorted."""
    said = [(None, 0, [1, 3], None), (None, 0, [3, 1], None), (None, 0, [1, 3], None)]
    with pytest.raises(zc.CallMismatchError) as mismatch:
        _subgroups._check(said, "subgroup", True)
    message = str(mismatch.value)
    assert "rank 1 passed [3, 1]" in message and "ranks 0,2 passed [1, 3]" in message, message


# -- promise 4: a sub-group's job is its own -----------------------------------------------


def holds_a_sub_group_forming(address_file, go_file):
    """Rank 0 hosts a dup; rank 1 opens its part but joins only once ``go_file`` exists."""
    r = zc.get_rank()
    if r == 0:
        told = _subgroups._Rounds.tell

        def tell(self, where):
            if where is not None:
                with open(address_file + ".tmp", "w") as f:
                    f.write(where[0])
                os.rename(address_file + ".tmp", address_file)
            return told(self, where)
        _subgroups._Rounds.tell = tell
    else:
        from zcollective._io._dealer import DealerDriver

        def join(self, timeout, *rest):
            wait_for(go_file, timeout=RUN_S)
            return super(DealerDriver, self).join(timeout, *rest)
        DealerDriver.join = join  # (the parent's joined already)
    return zc.dup(timeout=RUN_S).allreduce(1)


def test_a_join_of_the_parents_job_at_a_forming_sub_groups_port_is_refused_as_another_job(tmp_path):
    """Promise 4: a sub-group's job is the parent's name and a nonce, so a JOIN naming the
    parent's job is another job's there (fails on a copy whose sub-group keeps the parent's)."""
    address_file, go_file = str(tmp_path / "address"), str(tmp_path / "go")
    with Replicas(holds_a_sub_group_forming, 2, address_file, go_file,
                  env={"ZCOLLECTIVE_JOB": "job-a"}) as reps:
        wait_for(address_file, timeout=RUN_S, watch=reps)
        with open(address_file) as f:
            host, _, port = f.read().rpartition(":")
        stranger = None
        try:
            with pytest.raises(zc.JobMismatchError) as refused:
                stranger = zc.Group(host.strip("[]"), int(port), 1, 2, timeout=10, job="job-a", env={})
        finally:
            if stranger is not None:
                stranger.teardown()
            touch(go_file)
        outs = reps.wait(RUN_S)
    assert [o.value for o in outs] == [2, 2], report(outs, "the sub-group did not form after")
    assert "'job-a/sub-" in str(refused.value), refused.value


# -- item 16c: old_ranks() after a grow -----------------------------------------------------


def grows_once():
    deadline = time.monotonic() + 30
    admitted = 0
    while zc.get_world_size() < 3:
        assert time.monotonic() < deadline, "the newcomer never came"
        zc.allreduce(1)
        time.sleep(0.05)
        admitted = zc.grow()
    return zc.old_ranks(), zc.lost_ranks(), admitted


def comes_as_a_newcomer():
    zc.initialize(join=True)
    return zc.old_ranks(), zc.lost_ranks()


def test_old_ranks_after_a_grow_map_each_rank_to_its_rank_before_newcomers_after_the_old_size():
    """Item 16c: the docs said None after a grow, the code gave [0, 1, 2]: the docs now say
    what the code does (a grow that lost a member renumbers, and old_ranks says how)."""
    with Replicas(grows_once, 2) as members:
        time.sleep(0.3)
        with Replicas(comes_as_a_newcomer, 1, initialize=False, port=members.port,
                      env={"ZCOLLECTIVE_NUM_REPLICAS": ""}) as new:
            newcomer = new.wait(RUN_S)
        outs = members.wait(RUN_S) + newcomer
    assert all(o.ok for o in outs), report(outs, "the grow failed")
    assert [o.value for o in outs[:2]] == [([0, 1, 2], [], 1)] * 2, report(outs, "members")
    assert outs[2].value == ([0, 1, 2], []), report(outs, "the newcomer")


# -- docs: what is one color -----------------------------------------------------------------


def test_colors_are_one_when_equal_as_dict_keys_are():
    """split compares colors with ==, as a dict does its keys (the README says so): 1, 1.0 and
    True are one color; "1" is another."""
    said = [(1, 0, None, None), (1.0, 0, None, None), (True, 0, None, None), ("1", 0, None, None)]
    assert _subgroups._members(said, 0) == [0, 1, 2]
    assert _subgroups._members(said, 3) == [3]
