"""A synchronous send's acknowledgement leaves the receiver when its receive takes the message, not
at its next library call (review of issue 46): the receiver takes the message (recv, a receive
future's result, mprobe, improbe), then waits outside the library for a file the sender writes
once its ssend returned. The acknowledgement is the receiver's first message to the sender, so
its link's handshake is not yet made: it must go without waiting for the program to see it."""

import os
import time

import pytest

import zcollective as zc
from zcollective.testing import run_replicas

SECRETS = {"no secret": {}, "secret": {"ZCOLLECTIVE_SECRET": "the acknowledgement tests' secret"}}
SSEND_TIMEOUT_S = 6.0  # the sender's bound: the receiver is back in the library only after WAIT_S
WAIT_S = 10.0  # how long the receiver waits, outside the library, for the sender's file


def taken_then_busy(mode, path):
    rank = zc.get_rank()
    if rank == 0:
        zc.barrier()
        started = time.monotonic()
        try:
            zc.ssend({"x": 1}, 1, tag=1, timeout=SSEND_TIMEOUT_S)
            said = "returned"
        except zc.CollectiveTimeoutError as exc:
            said = f"timed out: {exc}"
        took = time.monotonic() - started
        with open(path, "w"):
            pass
        zc.barrier()
        return said, took
    zc.barrier()
    if mode == "recv":
        value = zc.recv(0, 1, timeout=20)
    elif mode == "result":
        value = zc.recv_async(0, 1).result(20)
    elif mode == "mprobe":
        value = zc.mprobe(0, 1, timeout=20).recv()
    else:
        message = None
        deadline = time.monotonic() + 20
        while not message and time.monotonic() < deadline:
            message = zc.improbe(0, 1)
            time.sleep(0.005)
        value = message.recv() if message else None
    started = time.monotonic()
    while not os.path.exists(path) and time.monotonic() - started < WAIT_S:
        time.sleep(0.01)  # busy in its own code: no library call
    zc.barrier()
    return value, os.path.exists(path)


@pytest.mark.parametrize("mode", ["recv", "result", "mprobe", "improbe"])
def test_an_ssend_returns_while_its_receiver_is_busy_elsewhere(mode, tmp_path):
    sender, receiver = run_replicas(taken_then_busy, 2, mode, str(tmp_path / "sent"), timeout=60)
    assert sender[0] == "returned", sender
    assert sender[1] < SSEND_TIMEOUT_S / 2, sender
    assert receiver == ({"x": 1}, True), receiver


@pytest.mark.parametrize("secret", ["secret"])
def test_an_ssend_returns_while_its_receiver_is_busy_elsewhere_with_a_secret(secret, tmp_path):
    sender, receiver = run_replicas(taken_then_busy, 2, "recv", str(tmp_path / "sent"), timeout=60,
                                    env=SECRETS[secret])
    assert sender[0] == "returned", sender
    assert receiver == ({"x": 1}, True), receiver


def sent_both_ways_first(path):
    """Rank 1 sends rank 0 first (its link to rank 0 may be unmade when the acknowledgement goes:
    held, then sent once the handshake is seen, in order with what waited); rank 0 ssends three."""
    rank = zc.get_rank()
    if rank == 1:
        zc.send("hello", 0, tag=77)
        got = [zc.recv(0, 1, timeout=20) for _ in range(3)]
        started = time.monotonic()
        while not os.path.exists(path) and time.monotonic() - started < WAIT_S:
            time.sleep(0.01)
        zc.barrier()
        return got, os.path.exists(path)
    hello = zc.recv(1, 77, timeout=20)
    for i in range(3):
        zc.ssend(i, 1, tag=1, timeout=SSEND_TIMEOUT_S)
    with open(path, "w"):
        pass
    zc.barrier()
    return hello


def test_ssends_to_a_rank_that_sent_first(tmp_path):
    outs = run_replicas(sent_both_ways_first, 2, str(tmp_path / "sent"), timeout=60)
    assert outs == ["hello", ([0, 1, 2], True)], outs
