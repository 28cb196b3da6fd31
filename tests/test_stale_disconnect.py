"""A connection closed before a member joined is not a coordinator lost after it (real sockets, one
process): a member whose first connection was taken by a ROUTER on its way out (an earlier group's,
closing as its host binds the next one at the same port) reconnects, and its WELCOME comes over the
new connection. When both wait, the events are read before the WELCOME: before, the WELCOME was taken
in first, and the old connection's DISCONNECTED, read next, failed a member that had just joined
('lost the coordinator ... no call was in flight'; rank 0 then lost it in turn: CI, a grow() test)."""

import json
import time

import zmq

from zcollective._format._wire import Kind, Message, decode, encode
from zcollective._io._dealer import DealerDriver
from zcollective._protocol._member import Member
from zcollective.config import resolve
from zcollective.errors import ReplicaLostError

BIND_TRIES_S = 10.0  # the port is free once the closed ROUTER's listener is gone
RECONNECT_S = 30.0  # a DEALER refused meanwhile tries again later and later (RECONNECT_IVL_MAX)


def _router(ctx, port=None):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 10_000)  # a test fails rather than hangs
    if port is None:
        return router, router.bind_to_random_port("tcp://127.0.0.1")
    deadline = time.monotonic() + BIND_TRIES_S
    while True:
        try:
            router.bind(f"tcp://127.0.0.1:{port}")
            return router, port
        except zmq.ZMQError:
            assert time.monotonic() < deadline, f"port {port} stayed taken"
            time.sleep(0.01)


def _reconnected(router):
    """Wait, reading nothing of the member's, until its DEALER made its connection to ``router`` again."""
    monitor = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        assert monitor.poll(RECONNECT_S * 1000), f"the member did not connect again within {RECONNECT_S} s"
        monitor.recv_multipart()
    finally:
        router.disable_monitor()
        monitor.close(linger=0)


def _join(router):
    frames = router.recv_multipart(copy=False)
    msg = decode(frames[1:])
    assert msg.kind is Kind.JOIN
    return frames[0].bytes, msg


def test_a_welcome_over_a_new_connection_outweighs_the_old_connections_close():
    ctx = zmq.Context()
    try:
        old, port = _router(ctx)
        config = resolve("127.0.0.1", port, 1, 2, env={})
        member = Member(1, 2, config.endpoint)
        driver, new = DealerDriver(ctx, config, member), None
        try:
            driver.send([member.join()])
            _join(old)  # taken by the closing ROUTER: lost with it
            old.close()
            new, _ = _router(ctx, port)
            _reconnected(new)  # (the driver is not asked: that connection's events wait unread)
            driver.send([member.join()])  # (its resend timer's), over the new connection
            peer, join = _join(new)
            new.send_multipart([peer, *encode(Message(
                Kind.WELCOME, rank=1, session=0x5E55_12,
                segments=[[json.dumps({"nonce": join.body()["nonce"]}).encode()]]))])
            time.sleep(0.3)  # the WELCOME and both connections' events all wait when the member looks
            try:
                assert driver.wait_for(lambda: member.joined, time.monotonic() + 10)
                driver.wait_for(lambda: False, time.monotonic() + 0.3)  # whatever else waits, read
            except ReplicaLostError as exc:
                raise AssertionError(f"a member that joined was failed: {exc}") from None
            assert member.failure is None, f"a member that joined was failed: {member.failure}"
            assert member.joined and not member.coordinator_lost
        finally:
            driver.close()
            if new is not None:
                new.close()
    finally:
        ctx.destroy(linger=0)
