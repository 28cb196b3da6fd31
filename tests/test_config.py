"""Arguments, environment variables and their precedence; malformed values."""

import pytest

from zcollective.config import DEFAULT_MASTER_PORT, resolve


def test_defaults_are_one_replica_on_loopback():
    c = resolve(env={})
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == (
        "127.0.0.1", DEFAULT_MASTER_PORT, 0, 1)


def test_precedence_argument_then_zcollective_then_adaptdl_then_torchrun():
    env = {"MASTER_ADDR": "torch", "MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2"}
    c = resolve(env=env)
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == ("torch", 1, 1, 2)
    env.update(ADAPTDL_MASTER_ADDR="adaptdl", ADAPTDL_MASTER_PORT="2",
               ADAPTDL_REPLICA_RANK="2", ADAPTDL_NUM_REPLICAS="3")
    c = resolve(env=env)
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == ("adaptdl", 2, 2, 3)
    env.update(ZCOLLECTIVE_MASTER_ADDR="zc", ZCOLLECTIVE_MASTER_PORT="3",
               ZCOLLECTIVE_REPLICA_RANK="3", ZCOLLECTIVE_NUM_REPLICAS="4")
    c = resolve(env=env)
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == ("zc", 3, 3, 4)
    c = resolve("arg", 4, 0, 5, env=env)
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == ("arg", 4, 0, 5)


def test_empty_variables_count_as_unset():
    c = resolve(env={"ZCOLLECTIVE_NUM_REPLICAS": "", "WORLD_SIZE": "3", "RANK": "2"})
    assert c.num_replicas == 3


@pytest.mark.parametrize("kwargs, env, text", [
    ({}, {"ZCOLLECTIVE_REPLICA_RANK": "abc", "ZCOLLECTIVE_NUM_REPLICAS": "2"},
     "environment variable ZCOLLECTIVE_REPLICA_RANK='abc' is not an integer"),
    ({}, {"RANK": "4", "WORLD_SIZE": "4"},
     "environment variable RANK='4' is out of range: ranks run from 0 to 3 for num_replicas=4 "
     "(from environment variable WORLD_SIZE)"),
    ({"replica_rank": -1, "num_replicas": 2}, {}, "argument replica_rank=-1 is out of range"),
    ({"num_replicas": 0}, {}, "argument num_replicas=0 must be at least 1"),
    ({"master_port": 70000}, {}, "argument master_port=70000 is not a TCP port"),
    ({}, {"ADAPTDL_MASTER_PORT": "http"}, "ADAPTDL_MASTER_PORT='http' is not an integer"),
    ({"master_addr": "a b"}, {}, "not a host name"),
    ({"master_addr": "-foo"}, {}, "not a host name"),
    ({"replica_rank": True}, {}, "not an integer"),
    ({}, {"ZCOLLECTIVE_TIMEOUT": "soon"}, "ZCOLLECTIVE_TIMEOUT='soon' is not a number"),
    ({"liveness_timeout": 0.2}, {}, "below the minimum"),
    ({"timeout": -1}, {}, "argument timeout=-1 must be a positive"),
])
def test_malformed_values_name_their_source(kwargs, env, text):
    with pytest.raises(ValueError) as info:
        resolve(env=env, **kwargs)
    assert text in str(info.value)


def test_timeouts_accept_none_and_inf():
    c = resolve(op_timeout=None, timeout=None, env={"ZCOLLECTIVE_TIMEOUT": "inf"})
    assert c.op_timeout is None and c.init_timeout is None
    assert resolve(op_timeout=5, env={}).op_timeout == 5.0
