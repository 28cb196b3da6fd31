"""Two mailboxes in one process (real sockets, no group): a link offered before its rank took its
key is refused and held; once that rank is known keyed (a message came from it), the next message
there goes at once, connected again with a fresh token, what was held first, in order (review of
issue 46: an acknowledgement must not wait for the sender's program to see the handshake)."""

import time

import zmq

from zcollective._io._mailbox import MailSockets
from zcollective.config import resolve

BOUND_S = 10.0  # every wait on a socket here
BASE, SESSION = b"k" * 32, 7


def _readable(sock, until):
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    return bool(poller.poll(max(0, int((until - time.monotonic()) * 1000))))


def _take(box, count, until):
    got = []
    while len(got) < count and _readable(box.source, until):
        while (frames := box.recv(False)) is not None:
            got.append([bytes(f.buffer) for f in frames])
    return got


def test_a_refused_link_is_made_again_at_once_once_its_rank_is_keyed():
    ctxs = [zmq.Context(), zmq.Context()]  # (one ZAP handler per context: a process's ranks' own)
    a = MailSockets(ctxs[0], resolve("127.0.0.1", 1, 0, 2, env={}), None)
    b = MailSockets(ctxs[1], resolve("127.0.0.1", 1, 1, 2, env={}), None)
    try:
        endpoints = [a.endpoint, b.endpoint]
        a.start(SESSION, endpoints, BASE, 0)
        until = time.monotonic() + BOUND_S
        assert a.send(1, [b"first"], False, "first") == []  # rank 1 not keyed: held
        assert _readable(a.monitors[1], until)  # its handshake, refused (rank 1 has no key yet)
        b.start(SESSION, endpoints, BASE, 1)
        a.keyed = lambda rank: True  # a message came from rank 1
        went = a.send(1, [b"second"], False, "second")
        assert [handle for _, handle in went] == ["first", "second"], went
        assert _take(b, 2, until) == [[b"first"], [b"second"]]
        assert a.send(1, [b"third"], False, "third") == [(None, "third")]
        assert _take(b, 1, until) == [[b"third"]]
        assert a.progress(time.monotonic(), True)[1] is None  # not broken
    finally:
        a.close()
        b.close()
        for ctx in ctxs:
            ctx.term()
