"""User mistakes get a specific error, and the group keeps working where it should."""

import socket
import threading

import pytest
from conftest import touch, wait_for

import zcollective as zc
from zcollective.testing import Replicas, ReplicasFailed, free_port, report, run_replicas


@pytest.mark.parametrize("call", [
    lambda: zc.allreduce(1), lambda: zc.allreduce_async(1), lambda: zc.broadcast(1),
    lambda: zc.allgather(1), lambda: zc.barrier(), lambda: zc.teardown(), lambda: zc.get_rank(),
])
def test_calls_before_initialize_say_to_initialize(call):
    with pytest.raises(RuntimeError, match=r"call zcollective.initialize\(\) first"):
        call()


def test_single_replica_needs_no_network_and_rejects_double_initialize():
    zc.initialize(num_replicas=1, master_port=1)  # port 1 is never bound
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            zc.initialize()
        assert zc.allreduce(5) == 5
        assert zc.allreduce_async([1]).result() == [1]
        assert zc.broadcast("x") == "x"
        assert zc.allgather(3) == [3] and zc.gather(3) == [3] and zc.scatter([7]) == 7
        assert zc.alltoall(["a"]) == ["a"] and zc.reduce(2) == 2
        zc.barrier()
        with pytest.raises(ValueError, match="root=1 is not a rank"):
            zc.broadcast(1, root=1)
        with pytest.raises(ValueError, match="one value per replica: got 2 values for 1"):
            zc.scatter([1, 2])
    finally:
        zc.teardown()
    assert not zc.is_initialized()


def test_bad_configuration_is_a_value_error_naming_its_source(monkeypatch):
    monkeypatch.setenv("ZCOLLECTIVE_NUM_REPLICAS", "2")
    monkeypatch.setenv("ZCOLLECTIVE_REPLICA_RANK", "two")
    with pytest.raises(ValueError, match="ZCOLLECTIVE_REPLICA_RANK='two' is not an integer"):
        zc.initialize()
    assert not zc.is_initialized()


def test_a_value_that_cannot_be_pickled_raises_on_its_sender_and_uses_no_seq():
    """Errors of a reduce function are RemoteErrors on every rank
    (test_member.py); a value that cannot be pickled never leaves its sender,
    so the next call still pairs with the other ranks' next call."""
    with zc.Group(size=1) as group:
        with pytest.raises(zc.SerializationError, match="_thread.lock") as info:
            group.allreduce(threading.Lock())
        assert isinstance(info.value, TypeError)
        with socket.socket() as sock, pytest.raises(TypeError, match="socket"):
            group.allreduce(sock)
        assert group.allreduce(5) == 5
        assert group.allreduce_async(6).seq == 1  # the calls that raised used no seq


def scatter_wrong_length():
    r = zc.get_rank()
    try:
        zc.scatter([1, 2] if r == 0 else None)
    except ValueError as exc:  # the root, whose list is wrong
        result = (r, type(exc).__name__, str(exc))
    except zc.PeerError as exc:  # everyone else, told by the root
        result = (r, type(exc).__name__, str(exc))
    return result, zc.allreduce(1)


def test_scatter_with_wrong_length_fails_on_every_rank_without_a_hang():
    outs = run_replicas(scatter_wrong_length, 3)
    said = "scatter needs one value per replica: got 2 values for 3 replicas"
    assert [out for out, _ in outs] == [(0, "ValueError", f"rank 0: {said}"),
                                        (1, "PeerError", f"seq 0 scatter: rank 0 failed: {said}"),
                                        (2, "PeerError", f"seq 0 scatter: rank 0 failed: {said}")]
    assert all(total == 3 for _, total in outs)


def join_and_report():
    try:
        zc.initialize(timeout=20)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    zc.teardown()
    return "ok", ""


def test_replicas_disagreeing_on_num_replicas_all_fail_clearly():
    """A faulty join fails the group everywhere; the other kinds (another
    Python or protocol version, a rank claimed twice) are in test_member.py."""
    with Replicas(join_and_report, 3, initialize=False,
                  rank_env={2: {"ZCOLLECTIVE_NUM_REPLICAS": "4"}}) as replicas:
        outs = replicas.wait(40)
    for out in outs:
        name, message = out.value or (None, "")
        assert name == "ValueError", report(outs, "a rank did not fail clearly")
        assert message.startswith("replicas disagree on num_replicas: rank 2 (pid "), message
        assert message.endswith(") says 4, the coordinator (rank 0) says 3"), message


def test_port_in_use_by_another_program_is_a_clear_error():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(zc.AddressError) as info:
            zc.Group("127.0.0.1", port, 0, 2, timeout=5)
    assert str(info.value) == (f"rank 0 cannot host the coordinator: port {port} on 127.0.0.1 is "
                               f"already in use by another program")


def late_join(started, refused):
    import os

    rank = int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
    if rank < 2:
        zc.initialize(replica_rank=rank, num_replicas=2, timeout=20)
        zc.barrier()
        if rank == 0:
            touch(started)
        wait_for(refused)  # rank 2 knocks meanwhile
        total = zc.allreduce(1)
        zc.teardown()
        return total
    wait_for(started)
    try:
        zc.initialize(replica_rank=1, num_replicas=2, timeout=10)
    except zc.LateJoinError as exc:
        return str(exc)
    finally:
        touch(refused)


def test_group_joined_late_is_refused_while_it_keeps_running(tmp_path):
    started, refused = str(tmp_path / "started"), str(tmp_path / "refused")
    outs = run_replicas(late_join, 3, started, refused, initialize=False,
                        env={"ZCOLLECTIVE_MASTER_PORT": str(free_port())})
    assert outs[:2] == [2, 2]
    assert outs[2].startswith("rank 1 (pid ")
    assert outs[2].endswith(" tried to join the group at seq 1, but the group of 2 replicas has already "
                            "started (another job on this port? give each job its own)")


def hand_started(refused):
    """One replica of two jobs started by hand on one port: job A's rank 0 and job B's rank 1
    first, then, once B's rank 1 was refused by A's coordinator, B's rank 0 and A's rank 1."""
    import os

    job, rank = os.environ["ZCOLLECTIVE_JOB"], int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
    if job == "job-b":
        if rank == 0:
            wait_for(refused)
        try:
            zc.initialize(timeout=30)
        except (zc.JobMismatchError, zc.AddressError) as exc:
            return type(exc).__name__, str(exc)
        finally:
            touch(refused if rank == 1 else refused + "-b0")
        return "joined job A's group", zc.allreduce(1)
    if rank == 1:
        wait_for(refused)
    zc.initialize(timeout=30)
    total = zc.allreduce(1)
    wait_for(refused + "-b0")  # job A holds its port until B's rank 0 tried it
    zc.teardown()
    return total


@pytest.mark.parametrize("secret", [None, "the-secret-file-every-job-reads"], ids=["no secret", "one secret"])
def test_two_hand_started_jobs_on_one_port_refuse_each_others_ranks_naming_both_jobs(tmp_path, secret):
    """Issue 31: a rank of job B joined job A's group, and every process printed a result and
    exited 0. Now A's coordinator refuses B's rank 1 alone, naming both jobs; A's own rank 1 joins
    after it (B's rank 0 finds the port taken)."""
    refused = str(tmp_path / "refused")
    started = {0: ("job-a", 0), 1: ("job-a", 1), 2: ("job-b", 0), 3: ("job-b", 1)}
    rank_env = {i: {"ZCOLLECTIVE_JOB": job, "ZCOLLECTIVE_REPLICA_RANK": str(rank)}
                for i, (job, rank) in started.items()}
    env = {"ZCOLLECTIVE_NUM_REPLICAS": "2", **({"ZCOLLECTIVE_SECRET": secret} if secret else {})}
    with Replicas(hand_started, 4, refused, initialize=False, env=env, rank_env=rank_env) as replicas:
        outs = replicas.wait(60)
    assert all(o.ok for o in outs), report(outs, "a replica failed")
    a0, a1, b0, b1 = (o.value for o in outs)
    assert (a0, a1) == (2, 2), report(outs, "job A did not complete alone")
    assert b1[0] == "JobMismatchError", report(outs, "job B's rank 1 was not refused")
    assert b1[1].startswith(f"rank 1 (pid {replicas.procs[3].pid} on {socket.gethostname()}) is of job "
                            f"'job-b', but the group at this address is of job 'job-a': "), b1[1]
    assert b0[0] == "AddressError" and "already in use by another program" in b0[1], b0


def test_failing_replica_reports_every_ranks_output():
    def fail_on_one():
        print("hello from", zc.get_rank())
        if zc.get_rank() == 1:
            raise KeyError("boom")
        return zc.get_rank()

    with pytest.raises(ReplicasFailed) as info:
        run_replicas(fail_on_one, 2, timeout=30)
    text = str(info.value)
    assert "rank 1 raised KeyError" in text and "hello from 1" in text and "hello from 0" in text
