"""User mistakes get a specific error, and the group keeps working where it should."""

import socket
import sys
import threading

import pytest

import zcollective as zc
from zcollective.testing import Replicas, ReplicasFailed, free_port, run_replicas


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


def group_survives_user_errors():
    r = zc.get_rank()
    seen = []
    try:
        zc.allreduce(r, lambda a, b: {}[b])
    except zc.RemoteError as exc:
        seen.append((exc.remote_type, exc.remote_message, "KeyError" in exc.remote_traceback,
                     "seq 0 allreduce" in str(exc)))
    if r == 1:  # only this rank has a bad value: it raises before sending anything
        try:
            zc.allreduce(threading.Lock())
        except zc.SerializationError as exc:
            seen.append(("serialization", "lock" in str(exc).lower(), isinstance(exc, TypeError)))
        try:
            zc.allreduce(socket.socket())
        except TypeError as exc:
            seen.append(("serialization", "socket" in str(exc)))
    try:
        zc.allreduce(1, lambda a, b: sys.exit(3))  # must not take the coordinator down
    except zc.RemoteError as exc:
        seen.append(("exit", exc.remote_type))
    try:
        zc.allreduce(1, lambda a, b: threading.Lock())  # result cannot be pickled
    except zc.RemoteError as exc:
        seen.append(("result", "reduction result" in str(exc)))
    seen.append(zc.allreduce(r + 1))  # same sequence on every rank: nothing was consumed
    return seen


def test_errors_in_user_code_leave_the_group_usable():
    outs = run_replicas(group_survives_user_errors, 3)
    for r, seen in enumerate(outs):
        assert seen[0] == ("KeyError", "1", True, True)
        assert seen[-1] == 6
        assert ("result", True) in seen and ("exit", "SystemExit") in seen
        if r == 1:
            assert ("serialization", True, True) in seen and ("serialization", True) in seen


def scatter_wrong_length():
    r = zc.get_rank()
    try:
        zc.scatter([1, 2] if r == 0 else None)
    except (ValueError, zc.CollectiveError) as exc:
        result = (type(exc).__name__, str(exc))
    return result, zc.allreduce(1)


def test_scatter_with_wrong_length_fails_on_every_rank_without_a_hang():
    outs = run_replicas(scatter_wrong_length, 3)
    assert outs[0][0] == ("ValueError", "rank 0: scatter needs one value per replica: got 2 values "
                                        "for 3 replicas")
    for (name, text), _ in outs[1:]:
        assert name == "CollectiveError" and "seq 0 scatter: rank 0 failed" in text
    assert all(out[1] == 3 for out in outs)


def join_and_report(fake_python=None, fake_protocol=None):
    import os

    if os.environ["ZCOLLECTIVE_REPLICA_RANK"] == "1":  # an impostor from another installation
        import zcollective._member
        import zcollective._wire

        if fake_python:
            zcollective._member.PYTHON_VERSION = fake_python
        if fake_protocol:
            zcollective._wire.PROTOCOL_VERSION = fake_protocol
    try:
        zc.initialize(timeout=20)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    zc.teardown()
    return "ok", ""


def outcomes(n, *args, **kwargs):
    with Replicas(join_and_report, n, *args, initialize=False, **kwargs) as replicas:
        return [o.value for o in replicas.wait(40)]


def test_replicas_disagreeing_on_num_replicas_all_fail_clearly():
    res = outcomes(3, rank_env={2: {"ZCOLLECTIVE_NUM_REPLICAS": "4"}})
    texts = [t for _, t in res]
    assert all(name == "ValueError" for name, _ in res), res
    assert all("disagree on num_replicas: rank 2" in t and "says 4" in t for t in texts), res


def test_rank_claimed_twice_fails_clearly_everywhere():
    res = outcomes(3, rank_env={2: {"ZCOLLECTIVE_REPLICA_RANK": "1"}})
    assert all(name == "ValueError" and "rank 1 was claimed twice" in t for name, t in res), res


def test_other_python_version_is_refused_on_both_sides():
    res = outcomes(2, "3.99")
    assert all(name == "ProtocolError" for name, _ in res), res
    assert all("runs Python 3.99" in t and "identical Python versions" in t for _, t in res), res


def test_other_protocol_version_is_refused_on_both_sides():
    res = outcomes(2, None, 99)
    assert all(name == "ProtocolError" for name, _ in res), res
    ours = zc._wire.PROTOCOL_VERSION
    assert f"speaks zcollective protocol version 99, the coordinator (rank 0) speaks {ours}" in res[0][1]
    assert f"speaks protocol version {ours}, this replica speaks 99" in res[1][1]


def test_port_in_use_by_another_program_is_a_clear_error():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(zc.CollectiveError, match=f"port {port} on 127.0.0.1 is already in use"):
            zc.Group("127.0.0.1", port, 0, 2, timeout=5)


def test_group_joined_late_is_refused_while_it_keeps_running():
    port = free_port()

    def late_join():
        import os
        import time

        rank = int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
        if rank < 2:
            zc.initialize(replica_rank=rank, num_replicas=2, timeout=20)
            zc.barrier()
            time.sleep(1.5)  # rank 2 knocks meanwhile
            total = zc.allreduce(1)
            zc.teardown()
            return total
        time.sleep(0.5)
        try:
            zc.initialize(replica_rank=1, num_replicas=2, timeout=10)
        except zc.CollectiveError as exc:
            return str(exc)

    outs = run_replicas(late_join, 3, initialize=False, env={"ZCOLLECTIVE_MASTER_PORT": str(port)})
    assert outs[:2] == [2, 2]
    assert "tried to join the group" in outs[2] and "already started" in outs[2]


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
