"""Elastic groups at their edges (issue 31), between real processes: forked
workers holding the master port, a busy or stopped rank 0, dead and timed-out
newcomers, a group of one growing, late, lone and interrupted shrink() calls,
a group failed by a program's bug. The promise under test: every survivor ends
in the one next group or is told it is not in it."""

import os
import signal
import time

import pytest
from conftest import touch, wait_for

import zcollective as zc
from zcollective.testing import Replicas, report

RUN_S = 90  # every run is bounded by this


def _outcome(fn):
    """``fn()``'s value, or ``"left out: ..."`` / ``"ErrorName: ..."``."""
    try:
        return fn()
    except zc.LeftOutError as exc:
        return f"left out: {exc}"
    except zc.CollectiveError as exc:
        return f"{type(exc).__name__}: {exc}"


def _groups(values):
    """The groups the survivors report, as sets of (old rank, new rank, size)."""
    return {tuple(v["members"]) for v in values if isinstance(v, dict)}


# -- forked workers -------------------------------------------------------------------


WORKER_S = 15  # a forked worker lives this long, or 3 s past its parent (torch's notice a dead
# parent only every 5 s): past the others' loss and shrink, whoever dies


def _worker():
    """A data loader's worker: never touches the group, ends without a word."""
    parent, deadline = os.getppid(), time.monotonic() + WORKER_S
    while time.monotonic() < deadline and os.getppid() == parent:
        time.sleep(0.05)
    time.sleep(3 if os.getppid() != parent else 0)
    os._exit(0)


def forks_then_loses(victim, markers):
    """Rank 0 forks a worker that never touches the group (a data loader's)
    and outlives the loss; ``victim`` dies mid-call; the survivors shrink."""
    me = zc.get_rank()
    if me == 0 and os.fork() == 0:
        _worker()
    zc.allreduce(1)
    if me == victim:
        zc.allgather_async(me)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    return _past_the_loss(me, victim)


def _past_the_loss(me, victim):
    """Calls until ``victim`` is no longer a member (shrinking at the loss: a
    call or two may still complete, with the victim's part in)."""
    while True:
        try:
            members = tuple(zc.allgather(me, timeout=30))
        except zc.ReplicaLostError:
            zc.shrink()
            continue
        if victim not in members:
            return {"members": members, "size": zc.get_world_size()}


@pytest.mark.parametrize("victim", [0, 3], ids=["rank-0", "last"])
def test_a_forked_worker_of_rank_0_does_not_hold_the_port_a_shrink_needs(tmp_path, victim):
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": "2"}  # its worker holds rank 0's connections open: the
    # others learn of its death from heartbeats
    with Replicas(forks_then_loses, 4, victim, str(tmp_path), env=env) as reps:
        outs = reps.wait(RUN_S)
    survivors = [o for o in outs if o.rank != victim]
    assert all(o.ok for o in survivors), report(outs, "a survivor failed")
    expected = tuple(r for r in range(4) if r != victim)
    assert all(o.value == {"members": expected, "size": 3} for o in survivors), report(outs, "split")


def forks_then_grows():
    """Rank 0 forks a worker, then the members admit a newcomer: the group
    forms again at rank 0's port while the worker lives."""
    if zc.get_rank() == 0 and os.fork() == 0:
        _worker()
    deadline = time.monotonic() + 30
    while zc.get_world_size() < 3:
        assert time.monotonic() < deadline, "the newcomer never came"
        zc.allreduce(1)
        time.sleep(0.05)
        zc.grow()
    return zc.allgather(zc.get_rank())


def newcomer():
    zc.initialize(join=True)
    return zc.allgather(zc.get_rank())


def _members_and_a_newcomer(members_fn, n):
    """``n`` members running ``members_fn`` (which grows), and a newcomer
    started a moment later at their port: every process's outcome."""
    with Replicas(members_fn, n) as members:
        time.sleep(0.3)
        with Replicas(newcomer, 1, initialize=False, port=members.port,
                      env={"ZCOLLECTIVE_NUM_REPLICAS": ""}) as new:
            outs = new.wait(RUN_S)
        return members.wait(RUN_S) + outs


def test_a_forked_worker_of_rank_0_does_not_stop_a_grow():
    outs = _members_and_a_newcomer(forks_then_grows, 2)
    assert all(o.ok and o.value == [0, 1, 2] for o in outs), report(outs, "the grow failed")


# -- newcomers that died or gave up ---------------------------------------------------


def grows_after(markers):
    zc.allreduce(1)
    wait_for(os.path.join(markers, "gone"), timeout=60)
    started = time.monotonic()
    admitted = zc.grow()
    return admitted, zc.get_world_size(), round(time.monotonic() - started, 3)


def parks(markers, timeout):
    touch(os.path.join(markers, f"parking{os.getpid()}"))
    try:
        zc.initialize(join=True, timeout=timeout)
    except zc.CollectiveTimeoutError:
        return "gave up"
    return "admitted"


def test_newcomers_that_died_or_gave_up_are_not_counted(tmp_path):
    alone = {"ZCOLLECTIVE_NUM_REPLICAS": ""}
    port = {"initialize": False, "env": alone}
    with Replicas(grows_after, 3, str(tmp_path)) as members, \
            Replicas(parks, 1, str(tmp_path), 60, port=members.port, **port) as doomed, \
            Replicas(parks, 1, str(tmp_path), 1.5, port=members.port, **port) as impatient:
        time.sleep(1.0)  # both parked (a newcomer parks within milliseconds of its start)
        doomed.kill(0)
        gave_up = impatient.wait(RUN_S)
        time.sleep(1.5)  # the probes after their connections closed (PROBE_SPAN_S)
        touch(tmp_path / "gone")
        outs = members.wait(RUN_S)
    assert gave_up[0].ok and gave_up[0].value == "gave up", report(gave_up, "the impatient one")
    assert all(o.ok for o in outs), report(outs, "a member failed")
    assert [o.value[:2] for o in outs] == [(0, 3)] * 3, report(outs, "a dead newcomer was counted")
    assert max(o.value[2] for o in outs) < 1.0, report(outs, "the grow waited for a dead newcomer")


# -- a busy or stopped rank 0 -------------------------------------------------------


def busy_rank_0(busy_s):
    """Rank 0 is ``busy_s`` in its own code (a checkpoint) when rank 1 dies
    mid-call; every survivor shrinks when it learns of the loss."""
    me = zc.get_rank()
    zc.allreduce(1)
    if me == 0:
        time.sleep(busy_s)
    elif me == 1:
        zc.allgather_async(me)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    return _outcome(lambda: _past_the_loss(me, 1))


@pytest.mark.parametrize("busy_s", [3, 5, 8])
def test_a_busy_rank_0_never_strands_the_prompt_survivors(busy_s):
    with Replicas(busy_rank_0, 4, busy_s) as reps:
        outs = reps.wait(RUN_S)
    values = [o.value for o in outs if o.rank != 1]
    assert all(o.ok for o in outs if o.rank != 1), report(outs, "a survivor failed")
    groups = _groups(values)
    assert len(groups) == 1, report(outs, f"not one group: {values}")
    members = next(iter(groups))
    assert {2, 3} <= set(members), report(outs, "the prompt survivors were stranded")
    for o in outs:
        if o.rank != 1 and o.rank not in members:
            assert str(o.value).startswith("left out: "), report(outs, f"rank {o.rank} not told")


def stopped_rank_0(markers):
    me = zc.get_rank()
    touch(os.path.join(markers, f"ready{me}"))

    def go_on():
        while True:
            try:
                zc.allgather(me, timeout=60)
            except zc.ReplicaLostError:
                zc.shrink()
                members = tuple(zc.allgather(me, timeout=30))
                touch(os.path.join(markers, f"shrunk{me}"))
                return {"members": members, "size": zc.get_world_size()}
            time.sleep(0.01)
    return _outcome(go_on)


def test_a_stopped_rank_0_on_the_same_host_neither_blocks_the_others_nor_goes_on_alone(tmp_path):
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": "1"}
    with Replicas(stopped_rank_0, 4, str(tmp_path), env=env) as reps:
        wait_for(*(tmp_path / f"ready{r}" for r in range(4)), watch=reps)
        time.sleep(0.3)
        reps.kill(0, signal.SIGSTOP)
        wait_for(*(tmp_path / f"shrunk{r}" for r in range(1, 4)), watch=reps)  # past the liveness
        reps.kill(0, signal.SIGCONT)  # bound and the others' shrink
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    assert [o.value for o in outs[1:]] == [{"members": (1, 2, 3), "size": 3}] * 3, report(outs, "split")
    assert isinstance(outs[0].value, str), report(outs, "rank 0 went on alone")


# -- late, lone and interrupted shrink() ---------------------------------------------


def late_shrink(markers):
    me = zc.get_rank()
    zc.allreduce(1)
    if me == 2:
        zc.allgather_async(me)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        zc.allgather(me, timeout=30)
    except zc.ReplicaLostError:
        pass
    if me == 1:  # late: the others formed their group, worked, and ended it
        wait_for(os.path.join(markers, "done"), timeout=60)
        time.sleep(0.5)
    return _outcome(lambda: _work_after_shrink(me, markers))


def _work_after_shrink(me, markers):
    zc.shrink()
    members = tuple(zc.allgather(me))
    if zc.get_rank() == 0:
        touch(os.path.join(markers, "done"))
    return {"members": members}


def test_a_late_shrink_is_told_it_was_left_out_even_after_the_others_ended(tmp_path):
    with Replicas(late_shrink, 4, str(tmp_path)) as reps:
        outs = reps.wait(RUN_S)
    assert outs[0].ok and outs[0].value == {"members": (0, 3)}, report(outs, "rank 0")
    assert outs[1].ok and str(outs[1].value).startswith("left out: "), report(outs, "a group of one")


def lone_shrink():
    me = zc.get_rank()
    if me == 1:
        return _outcome(lambda: zc.shrink(timeout=30))
    return _outcome(lambda: zc.allreduce(me, timeout=30))


def test_a_lone_shrink_in_a_healthy_group_is_a_mismatch_named_on_every_rank():
    with Replicas(lone_shrink, 3) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    assert all(str(o.value).startswith("CallMismatchError: ") and "shrink" in o.value for o in outs), \
        report(outs, "not a mismatch on every rank")


def everyone_shrinks_a_healthy_group():
    zc.shrink()
    return zc.get_world_size(), zc.old_ranks(), zc.lost_ranks(), zc.allreduce(1)


def test_a_shrink_by_every_rank_of_a_healthy_group_changes_nothing():
    with Replicas(everyone_shrinks_a_healthy_group, 3) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok and o.value == (3, None, [], 3) for o in outs), report(outs, "changed")


def shrinks_after_a_mismatch():
    me = zc.get_rank()
    try:
        if me == 0:
            zc.broadcast(me)
        else:
            zc.allreduce(me)
    except zc.CallMismatchError:
        pass
    return _outcome(zc.shrink)


def test_shrink_does_not_revive_a_group_failed_by_a_program_bug():
    with Replicas(shrinks_after_a_mismatch, 3) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok and str(o.value).startswith("CallMismatchError: ") for o in outs), \
        report(outs, "revived")


def interrupted_shrink(markers):
    """Rank 1's first shrink() is interrupted (a signal handler's exception)
    while it waits for rank 0, busy a moment: then the group says so, and a
    second shrink() ends it in the survivors' group or tells it is not."""
    me = zc.get_rank()
    zc.allreduce(1)
    if me == 2:
        zc.allgather_async(me)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        zc.allgather(me, timeout=30)
    except zc.ReplicaLostError:
        pass
    if me == 0:
        time.sleep(0.8)
        zc.shrink()
        return {"members": tuple(zc.allgather(me, timeout=30))}

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        zc.shrink()
        return "not interrupted"
    except KeyboardInterrupt:
        pass
    try:
        zc.get_rank()
        said = "no error"
    except RuntimeError as exc:
        said = str(exc)
    got = _outcome(lambda: (zc.shrink(), {"members": tuple(zc.allgather(me, timeout=30))})[1])
    return said, got


def test_an_interrupted_shrink_says_so_and_can_be_called_again(tmp_path):
    with Replicas(interrupted_shrink, 3, str(tmp_path)) as reps:
        outs = reps.wait(RUN_S)
    assert outs[0].ok and outs[1].ok, report(outs, "a survivor failed")
    said, got = outs[1].value
    assert "call shrink() again" in said, report(outs, said)
    assert got == outs[0].value == {"members": (0, 1)} or (
        str(got).startswith("left out: ") and outs[0].value == {"members": (0,)}), report(outs, "split")


# -- a group of one ---------------------------------------------------------------------


def alone_then_grows():
    deadline = time.monotonic() + 30
    while zc.grow() == 0:
        assert time.monotonic() < deadline, "the newcomer never came"
        time.sleep(0.05)
    return zc.allgather(zc.get_rank())


def test_a_group_of_one_grows():
    outs = _members_and_a_newcomer(alone_then_grows, 1)
    assert all(o.ok and o.value == [0, 1] for o in outs), report(outs, "no grow")


# -- what an attack on the first version found -------------------------------------------


def busy_low_ranks(busy_s):
    """Rank 0 dies while ranks 1 and 2 are busy in their own code; rank 3 is
    prompt: it must not take the busy ranks' silent ports for deaths."""
    me = zc.get_rank()
    zc.allreduce(1)
    if me == 0:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if me in (1, 2):
        time.sleep(busy_s)
    return _outcome(lambda: _past_the_loss(me, 0))


def test_busy_low_ranks_and_a_prompt_high_one_end_in_one_group():
    with Replicas(busy_low_ranks, 4, 3.0) as reps:
        outs = reps.wait(RUN_S)
    values = [o.value for o in outs[1:]]
    assert all(o.ok for o in outs[1:]), report(outs, "a survivor failed")
    groups = _groups(values)
    assert len(groups) <= 1, report(outs, f"two groups: {values}")
    assert all(isinstance(v, dict) or v.startswith("left out: ") for v in values), report(outs, "stranded")


def idle_then_killed(victim):
    me = zc.get_rank()
    zc.allreduce(1)
    if me == victim:
        time.sleep(1.5)  # idle past half the liveness bound: its close is no sign of death
        os.kill(os.getpid(), signal.SIGKILL)
    return _outcome(lambda: _past_the_loss(me, victim))


@pytest.mark.parametrize("victim", [0, 1], ids=["rank-0", "rank-1"])
def test_a_rank_killed_after_being_idle_leaves_its_one_survivor_going_on(victim):
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": "2"}
    with Replicas(idle_then_killed, 2, victim, env=env) as reps:
        outs = reps.wait(RUN_S)
    survivor = outs[1 - victim]
    assert survivor.ok and survivor.value == {"members": (1 - victim,), "size": 1}, report(outs, "stopped")


def shrinks_past_another_programs_port():
    me = zc.get_rank()
    zc.allreduce(1)
    if me == 0:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    return _outcome(lambda: _past_the_loss(me, 0))


def test_a_would_be_host_whose_port_another_program_holds_lets_the_next_host():
    import socket

    port = zc.testing.free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port + 1))  # old rank 1's form port: another program's
    squatter.listen()
    try:
        with Replicas(shrinks_past_another_programs_port, 3, port=port) as reps:
            outs = reps.wait(RUN_S)
    finally:
        squatter.close()
    assert outs[1].ok and outs[2].ok, report(outs, "a survivor failed")
    assert outs[1].value == outs[2].value == {"members": (2, 1), "size": 2}, report(outs, "no group")


def grows_while_newcomers_vanish(markers):
    zc.allreduce(1)
    wait_for(os.path.join(markers, "parked"), timeout=60)
    admitted = _outcome(zc.grow)
    return admitted, zc.get_world_size(), zc.allreduce(1)


def parks_then_stops(markers):
    touch(os.path.join(markers, f"parking{os.getpid()}"))
    zc.initialize(join=True, timeout=60)
    return "admitted"


def test_newcomers_stopped_as_they_are_admitted_never_cost_the_members_their_group(tmp_path):
    alone = {"ZCOLLECTIVE_NUM_REPLICAS": ""}
    with Replicas(grows_while_newcomers_vanish, 2, str(tmp_path)) as members, \
            Replicas(parks_then_stops, 2, str(tmp_path), initialize=False, port=members.port,
                     env=alone) as newcomers:
        time.sleep(1.0)  # parked
        newcomers.kill(0, signal.SIGSTOP)
        newcomers.kill(1, signal.SIGSTOP)
        touch(tmp_path / "parked")
        outs = members.wait(RUN_S)
        newcomers.kill_all()
    assert all(o.ok for o in outs), report(outs, "a member failed")
    assert [o.value[1:] for o in outs] == [(2, 2)] * 2, report(outs, "the members lost their group")


def grows_and_one_is_interrupted(markers):
    """Rank 2's grow() is interrupted (a signal handler's exception) as it starts joining the grown
    group, before its JOIN went: its group says so, shrink() tells it it was left out, and the
    others go on with the newcomer. (Interrupted later, its JOIN gone: see
    test_a_grow_interrupted_after_its_join_went_costs_no_rank_its_group.)"""
    from zcollective._lifecycle import Lifecycle

    me = zc.get_rank()
    if me == 2:
        join = Lifecycle._join_forming

        def interrupted(self, form):
            Lifecycle._join_forming = join
            raise KeyboardInterrupt  # as a signal handler's exception would
        Lifecycle._join_forming = interrupted
    zc.allreduce(1)
    wait_for(os.path.join(markers, "parked"), timeout=60)
    deadline = time.monotonic() + 30
    try:
        while not zc.grow():  # (until the newcomer has parked: it said so as it started)
            assert time.monotonic() < deadline, "the newcomer never came"
            zc.allreduce(1)
            time.sleep(0.05)
    except KeyboardInterrupt:
        try:
            zc.get_rank()
            said = "no error"
        except RuntimeError as exc:
            said = str(exc)
        return said, _outcome(zc.shrink)
    return zc.get_world_size(), zc.allreduce(1)


def parks_and_goes_on(markers):
    touch(os.path.join(markers, "parked"))
    zc.initialize(join=True, timeout=60)
    return zc.get_world_size(), zc.allreduce(1)


def test_an_interrupted_grow_says_so_and_the_others_go_on_with_the_newcomer(tmp_path):
    with Replicas(grows_and_one_is_interrupted, 3, str(tmp_path)) as members, \
            Replicas(parks_and_goes_on, 1, str(tmp_path), initialize=False, port=members.port,
                     env={"ZCOLLECTIVE_NUM_REPLICAS": ""}) as newcomer:
        outs = members.wait(RUN_S) + newcomer.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, f"a rank failed: {[o.value for o in outs]}")
    assert [outs[0].value, outs[1].value, outs[3].value] == [(3, 3)] * 3, report(outs, "no group")
    said, shrunk = outs[2].value
    assert "closed for grow()" in said and "grown group formed without it" in said, said
    assert shrunk.startswith("left out: "), shrunk


def steps_then_reports(markers):
    """Calls with pauses between them (a step's work), shrinking at a loss."""
    me = zc.get_rank()
    touch(os.path.join(markers, f"up{me}"))

    def go_on():
        for _ in range(300):
            try:
                zc.allreduce(1, timeout=30)
            except zc.ReplicaLostError:
                zc.shrink(timeout=30)
            time.sleep(0.01)  # the step's own work: where a pause mostly lands
        return {"size": zc.get_world_size()}
    return _outcome(go_on)


def test_a_rank_paused_past_the_bound_outside_the_library_never_goes_on_alone_later(tmp_path):
    """N = 2, rank 1 paused (SIGSTOP) in its own code: rank 0 counts it dead and
    finishes alone; rank 1, resumed after that, finds nobody at rank 0's port, and
    must not take that for rank 0's death: it was stopped (it is told LeftOutError)."""
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": "1"}
    with Replicas(steps_then_reports, 2, str(tmp_path), env=env) as reps:
        wait_for(tmp_path / "up0", tmp_path / "up1", watch=reps)
        time.sleep(0.3)
        reps.kill(1, signal.SIGSTOP)
        ended = reps.join([0], RUN_S)
        reps.kill(1, signal.SIGCONT)
        outs = reps.wait(RUN_S)
    assert ended and outs[0].ok and outs[0].value == {"size": 1}, report(outs, "rank 0")
    assert outs[1].ok and str(outs[1].value).startswith("left out: "), report(outs, "a second group")


# -- a grow interrupted after its JOIN went ---------------------------------------------


def _at_the_wait_for_the_host(then, settle_s=0.0):
    """Have this process's next wait for the host of a group it forms (its JOIN queued) first wait
    until its connection is up (the JOIN on the wire) and ``settle_s`` more (the host takes the JOIN
    in), and then call ``then()``."""
    from zcollective._lifecycle import Lifecycle

    reach = Lifecycle._reach_host

    def hooked(self, form, who):
        Lifecycle._reach_host = reach
        member = self.member
        deadline = time.monotonic() + 30
        while not (member.greeted or member.joined) and time.monotonic() < deadline:
            self.driver.wait_for(lambda: member.greeted or member.joined, time.monotonic() + 0.005)
        time.sleep(settle_s)  # (not a wait of the library: a WELCOME that came stays unread)
        then()
        return reach(self, form, who)
    Lifecycle._reach_host = hooked


def _interrupt():
    """What a signal handler's exception at a wait of the library is: a KeyboardInterrupt marked
    with the signal (so the library may let it come again), raised at that wait."""
    from zcollective.errors import SIGNAL_ATTR

    exc = KeyboardInterrupt()
    setattr(exc, SIGNAL_ATTR, signal.SIGINT)
    raise exc


def _before_the_join(then):
    """Have this process's next join of a group it forms call ``then()`` before its JOIN goes."""
    from zcollective._lifecycle import Lifecycle

    join = Lifecycle._join_forming

    def hooked(self, form):
        Lifecycle._join_forming = join
        then()
        return join(self, form)
    Lifecycle._join_forming = hooked


def _forming_steps(me, victim, markers, last):
    """Old rank (or newcomer) ``me``'s part in forming the grown group (old ranks 0-2, newcomer 3):
    ``victim`` is interrupted at its wait for the host, its JOIN on the wire. ``last``: its JOIN
    completes the group (the others' are in first, so the host forms with it at once); else one
    other joins only after the victim gave up (the host forms without the victim)."""
    joiners = {1, 2, 3} - {victim}  # (0 hosts)
    if me == victim:
        if last:
            _before_the_join(lambda: wait_for(*(os.path.join(markers, f"in{r}") for r in joiners),
                                               timeout=60))
        _at_the_wait_for_the_host(_interrupt, 0.2)
    elif me in joiners and last:
        _at_the_wait_for_the_host(lambda: touch(os.path.join(markers, f"in{me}")))
    elif me == max(joiners):
        _before_the_join(lambda: wait_for(os.path.join(markers, "out"), timeout=60))


def grows_and_one_is_interrupted_after_its_join(markers, victim, last):
    """Old ranks 0-2 grow; see :func:`_forming_steps`. Either way no rank of the grown group finds a
    rank lost; an interrupted one that is in it is interrupted again once grow() returned."""
    me = zc.get_rank()
    _forming_steps(me, victim, markers, last)
    zc.allreduce(1)
    wait_for(os.path.join(markers, "parked"), timeout=60)
    deadline = time.monotonic() + 30
    try:  # (until the newcomer has parked, or the grown group formed without it)
        while not zc.grow() and not os.path.exists(os.path.join(markers, "out")):
            assert time.monotonic() < deadline, "the newcomer never came"
            zc.allreduce(1)
            time.sleep(0.05)
        if me == victim:
            time.sleep(5)  # its interrupt comes again, now that grow() returned
        interrupted = "not interrupted"
    except KeyboardInterrupt:
        touch(os.path.join(markers, "out"))
        try:
            zc.get_world_size()
        except RuntimeError as exc:  # its grow() did not finish: left out
            return str(exc), _outcome(zc.shrink)
        interrupted = "interrupted after it joined"
    return interrupted, zc.get_world_size(), _outcome(lambda: zc.allreduce(1, timeout=30))


def parks_and_goes_on_after(markers, victim, last):
    touch(os.path.join(markers, "parked"))
    _forming_steps(3, victim, markers, last)
    try:
        zc.initialize(join=True, timeout=60)
        if victim == 3:
            time.sleep(5)  # its interrupt comes again, now that initialize() returned
        interrupted = "not interrupted"
    except KeyboardInterrupt:
        touch(os.path.join(markers, "out"))
        if not zc.is_initialized():
            return "interrupted joining"
        interrupted = "interrupted after it joined"
    return interrupted, zc.get_world_size(), _outcome(lambda: zc.allreduce(1, timeout=30))


@pytest.mark.parametrize("victim", [2, 3], ids=["member", "newcomer"])
@pytest.mark.parametrize("last", [True, False], ids=["completing", "early"])
def test_a_grow_interrupted_after_its_join_went_costs_no_rank_its_group(tmp_path, last, victim):
    with Replicas(grows_and_one_is_interrupted_after_its_join, 3, str(tmp_path), victim, last) as members, \
            Replicas(parks_and_goes_on_after, 1, str(tmp_path), victim, last, initialize=False,
                     port=members.port, env={"ZCOLLECTIVE_NUM_REPLICAS": ""}) as newcomer:
        outs = members.wait(RUN_S) + newcomer.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, f"a rank failed: {[o.value for o in outs]}")
    values = [o.value for o in outs]
    others = [v for i, v in enumerate(values) if i != victim]
    if last:  # the host formed with it before its withdrawal came: a member, interrupted after
        assert others == [("not interrupted", 4, 4)] * 3, report(outs, f"a rank failed: {values}")
        assert values[victim] == ("interrupted after it joined", 4, 4), report(outs, "the victim")
    else:  # it withdrew before the group formed: the others formed without it
        assert others == [("not interrupted", 3, 3)] * 3, report(outs, f"a rank failed: {values}")
        if victim == 3:
            assert values[victim] == "interrupted joining", report(outs, "the newcomer")
        else:
            said, shrunk = values[victim]
            assert "closed for grow()" in said and shrunk.startswith("left out: "), report(outs, "rank 2")
