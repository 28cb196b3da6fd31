"""The window's credit when a receiver takes one sender's messages out of the order sent (by tag,
or a matched probe): the sender frees exactly the bytes received, neither fewer (later sends would
wait for credit that never comes: found by attacking issue 46's work) nor more (the receiver would
hold more than its window)."""

import random

from zcollective._protocol._p2p import Mailbox, Receive
from zcollective.testing import run_replicas

WINDOW = 1000
SIZE = 200


def _pair():
    return Mailbox(0, 2, WINDOW), Mailbox(1, 2, WINDOW)  # rank 0 sends, rank 1 receives


def _deliver(sender, credits):
    for c in credits:
        assert c.to == 0
        sender.credited(1, c.seq, c.exact)


def _send_all(sender, receiver, tags):
    for tag in tags:
        seq = sender.send(1, SIZE, tag=tag)
        done, credits = receiver.arrive(0, tag, seq, SIZE, f"m{tag}")
        assert done is None and credits == []


def test_messages_received_out_of_order_free_the_senders_window_exactly():
    sender, receiver = _pair()
    _send_all(sender, receiver, range(5))
    for tag in (4, 3):  # the last two first: three earlier ones still held here
        came, credits = receiver.post(Receive(0, tag, None))
        assert came.tag == tag
        _deliver(sender, credits)
    assert sender.peers[1].held == 3 * SIZE  # exactly what rank 1 still holds
    for tag in (0, 1, 2):
        _deliver(sender, receiver.post(Receive(0, tag, None))[1])
    receiver_peer = receiver.peers[0]
    assert receiver_peer.taken == 4 and receiver_peer.loose == []
    _deliver(sender, receiver.asked(0))  # (a sender short of credit asks; batched credit covers the rest)
    assert sender.peers[1].held == 0 and list(sender.peers[1].unreceived) == []
    assert sender.may_send(1, 900)  # all received: the window is free again


def test_any_order_of_receives_leaves_the_sender_holding_exactly_the_unreceived():
    rng = random.Random(46)
    for _ in range(200):
        sender, receiver = _pair()
        n = rng.randint(1, 12)
        _send_all(sender, receiver, range(n))
        order = list(range(n))
        rng.shuffle(order)
        received = set()
        for tag in order[:rng.randint(0, n)]:
            _deliver(sender, receiver.post(Receive(0, tag, None))[1])
            received.add(tag)
            _deliver(sender, receiver.asked(0))  # (what a waiting sender would get)
            assert sender.peers[1].held == SIZE * (n - len(received)), (order, received)


def out_of_order_then_large():
    import zcollective as zc

    if zc.get_rank() == 0:
        for tag in range(5):
            zc.send(b"x" * 150, 1, tag=tag)
        zc.send(b"y" * 900, 1, tag=9, timeout=20)  # needs all five credited
        return zc.recv(1, tag=10, timeout=20)
    got = [len(zc.recv(0, tag=t, timeout=20)) for t in (4, 3, 0, 1, 2)]
    got.append(len(zc.recv(0, tag=9, timeout=20)))
    zc.send("done", 0, tag=10)
    return got


def test_a_sender_whose_messages_were_received_out_of_order_is_not_held_up():
    env = {"ZCOLLECTIVE_MAIL_WINDOW_BYTES": str(WINDOW)}
    assert run_replicas(out_of_order_then_large, 2, env=env, timeout=90) == ["done", [150] * 5 + [900]]
