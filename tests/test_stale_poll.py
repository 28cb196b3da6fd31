"""A poll's verdict can go stale before the read it allowed: a signal handler's call, run in between,
read the message. The read then finds nothing and says so (a reviewer found the coordinator crashed
on ``zmq.Again``, the whole group with it)."""

import zmq

from zcollective._io._zmq import Hub, Link


def test_a_read_a_stale_poll_allowed_finds_nothing_and_says_so():
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.linger = dealer.linger = 0
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        hub, link = object.__new__(Hub), object.__new__(Link)
        hub.router, link.dealer = router, dealer  # (only the socket: what recv reads)
        assert hub.recv(waiting=True) is None  # a poll said readable; nothing is there any more
        assert link.recv(waiting=True) is None
        dealer.send(b"x")
        assert router.poll(5000)
        frames = hub.recv(waiting=True)
        assert frames is not None and bytes(frames[-1].buffer) == b"x"
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()
