"""Faults of one data link only, the control plane staying up: a relay sits
in front of one rank's data port (in that rank's process, which announces
the relay's port as its own; rank 0's handshakes are answered at once by its
coordinator thread, another rank's only while it moves data) and resets the TCP connection at rest
or mid-call, or alters a chunk's bytes. The data plane's own detection must
name the link on every rank within the bound, with or without a secret; the
coordinator sees nothing wrong with anyone, so no other message can.

The relay is a thread of rank 2's process: rank 2 decides when it acts
(after a call, or after so many bytes of the next), so nothing is timed
from outside."""

import os
import signal
import socket
import struct
import time

import numpy as np
import pytest
import zmq
from conftest import touch, wait_for
from relay import Relay
from test_dataplane import signalled_mid_ring
from test_zap import hello, rss_kib
from zmq.utils.monitor import parse_monitor_message
from zmtp import greeting, ready

import zcollective as zc
from zcollective._io import _dataplane, _zap
from zcollective._protocol import _chunks, _tokens
from zcollective.testing import Replicas, report

ON = {"ZCOLLECTIVE_DATA_PLANE": "on", "ZCOLLECTIVE_DATA_PLANE_MIN_BYTES": "4096",
      "ZCOLLECTIVE_LIVENESS_TIMEOUT": "2", "ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": "off"}
OP_TIMEOUT = 20.0  # the issue's: a rank stuck past it would show as a timeout, not an error
REMADE_S = 2.0  # libzmq re-makes a connection within 100 ms (RECONNECT_IVL_MS)
ANSWER_S = 0.5  # a refusal takes milliseconds
BOUND = 2.0 + 6.0  # liveness bound plus slack for a loaded 2-core machine
SECRET = "s" * 32
ALTERED = ("chunk on the data link from rank {prev} to rank {front} failed authentication: "
           "was the link altered")


def lost_forms(front):
    prev = (front - 1) % 3
    return (f"rank {prev} lost its data link to rank {front}",)


class LinkRelay(Relay):
    """Carries the previous rank's data link; :meth:`reset` sends both ends a
    TCP reset; ``arm(n, action)`` does ``action`` once ``n`` more bytes went
    upstream."""

    def __init__(self, upstream):
        self.upward = 0  # bytes carried upstream
        self.armed = None  # (byte count, "reset" | "alter")
        self.done = False
        self.ended = 0  # directions of connections that ended (two per connection)
        self.at_reset = (0, 0)  # connections made and ended when reset() reset them
        super().__init__(upstream)

    def _carry(self, *args):
        super()._carry(*args)
        self.ended += 1

    def settled(self):
        """Wait (bounded) until libzmq has re-made the reset connection and
        the data port had time to refuse its handshake (a spent token) and
        close it: rank 0's coordinator thread answers at once; another rank,
        or rank 0 without a secret, only once it moves data again."""
        made, ended = self.at_reset  # (counted from the reset: once, under the full suite's load,
        # the relay had seen two connections before it, so "2 in all" came at once)
        for until, done in ((REMADE_S, lambda: self.connections >= made + 1),
                            (ANSWER_S, lambda: self.ended >= ended + 4)):
            deadline = time.monotonic() + until
            while time.monotonic() < deadline and not done():
                time.sleep(0.01)

    def arm(self, nbytes, action):
        self.armed = (self.upward + nbytes, action)

    def pump(self, upward):
        def carry(data):
            if not data or not upward:
                return data or b""
            self.upward += len(data)
            if self.armed and self.upward >= self.armed[0] and not self.done:
                self.done = True
                if self.armed[1] == "reset":
                    self.reset()
                    return b""
                data = bytearray(data)
                data[len(data) // 2] ^= 0xFF  # a byte in the middle of whatever frame this is
                return bytes(data)
            return data
        return carry

    def reset(self):
        self.at_reset = (self.connections, self.ended)
        for s in list(self._sockets):
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()  # with linger 0: a RST, as a middlebox or NAT timeout sends
            except OSError:
                pass


def _through_relay():
    """This rank announces a relay in front of its data port (before its JOIN)."""
    original = _dataplane.DataPlane.__init__

    def patched(self, *args, **kwargs):
        original(self, *args, **kwargs)
        port = int(self.endpoint.rsplit(":", 1)[1])
        self.relay = LinkRelay(port)
        self.endpoint = f"tcp://127.0.0.1:{self.relay.port}"

    _dataplane.DataPlane.__init__ = patched


def link_fault(front, when, secret):
    rank = int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
    if rank == front:
        _through_relay()
    zc.initialize(op_timeout=OP_TIMEOUT, secret=secret, timeout=60)
    relay = zc._current()._life.data.relay if rank == front else None
    x = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: many chunks on every link
    first = zc.allreduce(x)
    assert np.array_equal(first, 3 * x)
    if when == "at rest":
        if relay is not None:
            assert relay.connections >= 1  # the link was made (more than once under load, at times)
            relay.reset()
            relay.settled()
        zc.barrier()  # (the control plane only)
    elif relay is not None:
        relay.arm(2 << 20, when)  # mid-call: a quarter into the next allreduce's ring
    if rank == (front - 1) % 3:
        time.sleep(0.25)  # a busy replica, a little late to the call
    return timed_call(x)


def timed_call(value):
    """An allreduce of ``value`` that should fail: (error type, message, seconds taken)."""
    start = time.monotonic()
    try:
        zc.allreduce_async(value).result(timeout=OP_TIMEOUT)
    except zc.CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
@pytest.mark.parametrize("when", ["at rest", "reset"], ids=["at-rest", "mid-call"])
@pytest.mark.parametrize("front", [0, 2], ids=["into-rank-0", "into-rank-2"])
def test_a_reset_data_link_is_named_on_every_rank_within_the_bound(front, when, secret):
    with Replicas(link_fault, 3, front, when, secret, initialize=False, env=ON) as reps:
        outs = reps.wait(60)
    for o in outs:
        assert o.ok, report(outs, f"rank {o.rank} failed")
        kind, message, took = o.value
        assert kind == "ReplicaLostError", report(outs, f"rank {o.rank}: {kind}: {message}")
        assert any(form in message for form in lost_forms(front)), report(outs, f"rank {o.rank}: {message}")
        seq = 2 if when == "at rest" else 1  # (at rest, a barrier came between)
        assert f"seq {seq} allreduce" in message, report(outs, message)
        assert took < BOUND, report(outs, f"rank {o.rank} took {took:.1f} s")


@pytest.mark.parametrize("front", [0, 2], ids=["into-rank-0", "into-rank-2"])
def test_a_data_link_altered_in_flight_fails_the_call_on_every_rank(front):
    with Replicas(link_fault, 3, front, "alter", SECRET, initialize=False, env=ON) as reps:
        outs = reps.wait(60)
    for o in outs:
        assert o.ok, report(outs, f"rank {o.rank} failed")
        kind, message, took = o.value
        altered = ALTERED.format(prev=(front - 1) % 3, front=front)
        assert kind == "AuthenticationError" and altered in message, report(outs, message)
        assert took < BOUND, report(outs, f"rank {o.rank} took {took:.1f} s")


# -- a stranger on a replica's data port, no secret -----------------------------------------

FRAME = 256 << 10  # under the data port's frame bound (CHUNK_BYTES): accepted as a frame
ATTACK_BYTES = 100 << 20  # what each stranger pushes, as frames flagged "more", never ending
RSS_GROWTH_MAX_KIB = 32 << 10  # rank 1 may grow this much (allocator noise)
STALL_S = 3.0  # a stranger whose bytes nobody reads for this long gives up
MORE = bytes([0x03]) + FRAME.to_bytes(8, "big")  # a long frame, "more" to follow


def endless(address, opening):
    """A raw TCP stranger: ``opening``, then 256 KiB frames flagged "more"
    for ever; return how many bytes left before the connection closed."""
    host, port = address
    chunk, sent = MORE + b"\0" * FRAME, 0
    with socket.create_connection((host, port), timeout=STALL_S) as s:
        try:
            s.sendall(opening)
            while sent < ATTACK_BYTES:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # closed by the replica, or stalled (nothing read) for STALL_S
            pass
    return sent


def idle_under_attack(markers):
    """Rank 1 says where its data port is, then idles in user code while the
    test attacks it; every rank then checks the group still computes."""
    rank = zc.get_rank()
    x = np.arange(1 << 16, dtype=np.float64) * (rank + 1)
    assert np.array_equal(zc.allreduce(x), np.arange(1 << 16, dtype=np.float64) * 6)
    if rank == 1:
        with open(os.path.join(markers, "port.tmp"), "w") as f:
            f.write(zc._current()._life.data.endpoint)
        os.rename(os.path.join(markers, "port.tmp"), os.path.join(markers, "port"))
        wait_for(os.path.join(markers, "attacked"), timeout=60)  # idle, in user code
    zc.barrier()
    y = zc.allreduce(np.full(1 << 16, rank + 1.0))
    assert np.array_equal(y, np.full(1 << 16, 6.0)), y[:4]
    return True


def test_a_stranger_on_a_replicas_data_port_gets_nothing_in_without_a_secret(tmp_path):
    """The issue's attack: NULL (or a made-up PLAIN token), then endless
    frames flagged "more". Before data ports checked tokens without a secret,
    rank 1 held about as much as was sent (101 MiB for 100 MiB)."""
    markers = str(tmp_path)
    env = {k: v for k, v in ON.items() if k != "ZCOLLECTIVE_LIVENESS_TIMEOUT"}
    sent, growth = {}, 0
    with Replicas(idle_under_attack, 3, markers, env=env) as reps:
        try:
            wait_for(os.path.join(markers, "port"), timeout=60, watch=reps)
            with open(os.path.join(markers, "port")) as f:
                endpoint = f.read()
            host, port = endpoint[len("tcp://"):].rsplit(":", 1)
            pid = reps.procs[1].pid
            before = rss_kib(pid)
            ctx = zmq.Context()
            try:  # a pyzmq PUSH with no credentials queues its part, too
                stranger = ctx.socket(zmq.PUSH)
                stranger.linger = 0
                stranger.sndhwm = 0
                stranger.connect(endpoint)
                for _ in range(ATTACK_BYTES // FRAME):
                    stranger.send(b"\0" * FRAME, zmq.SNDMORE)
                sent["pyzmq, NULL"] = ATTACK_BYTES
                sent["raw, NULL"] = endless((host, int(port)), greeting(b"NULL") + ready(b"PUSH"))
                sent["raw, PLAIN"] = endless((host, int(port)), greeting(b"PLAIN") + hello(
                    b"zc1." + b"1" * 32, b"1" * 64))
                time.sleep(1.0)  # what the PUSH queued has left by now, if anything lets it
                growth = rss_kib(pid, "VmHWM") - before  # its peak under attack
            finally:
                ctx.destroy(linger=0)
        finally:
            touch(os.path.join(markers, "attacked"))
        outs = reps.wait(60)
    said = report(outs, f"rank 1 grew by {growth} KiB; the strangers sent {sent}")
    assert all(o.ok for o in outs), said
    assert growth < RSS_GROWTH_MAX_KIB, said
    assert sent["raw, NULL"] < ATTACK_BYTES and sent["raw, PLAIN"] < ATTACK_BYTES, said


# -- the data port's gate and session check, reached with real PLAIN handshakes ------------------

SEGMENT = 1024  # float64 elements per rank's segment: one chunk each (under MIN_CHUNK_BYTES)
HANDSHAKE_S = 10.0  # a handshake on loopback takes milliseconds; a loaded machine, far less than this
FORGED = 1e6  # what the forged chunks carry: a result holding it took one in


def handshake(ctx, endpoint, credentials):
    """A PUSH offering ``credentials`` (PLAIN) to ``endpoint``: the socket,
    and how its handshake ended ("HANDSHAKE_SUCCEEDED", "HANDSHAKE_FAILED_AUTH", ...)."""
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.plain_username, push.plain_password = credentials
    monitor = push.get_monitor_socket()
    push.connect(endpoint)
    deadline = time.monotonic() + HANDSHAKE_S
    try:
        while time.monotonic() < deadline:
            if monitor.poll(10):
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED or event in _dataplane.HANDSHAKE_FAILED:
                    return push, zmq.Event(event).name
        return push, "no outcome"
    finally:
        push.disable_monitor()
        monitor.close(0)


def tried_by_strangers(markers):
    """Each rank says where its data port is and what its link key is made
    from, then idles in user code while the test offers that port tokens;
    rank 1 waits until what the test pushed is queued on its port. Then one
    more allreduce: (was it right, its first element)."""
    import json

    rank, group = zc.get_rank(), zc._current()
    x = np.arange(3 * SEGMENT, dtype=np.float64)
    assert np.array_equal(zc.allreduce(x * (rank + 1)), x * 6)  # the data links are made
    member, data = group._life.member, group._life.data
    base = group.config.secret or bytes.fromhex(member.data_key)  # what link keys derive from
    said = {"endpoint": data.endpoint, "session": member.session, "base": base.hex(), "seq": member.next_seq}
    with open(os.path.join(markers, f"port{rank}.tmp"), "w") as f:
        json.dump(said, f)
    os.rename(os.path.join(markers, f"port{rank}.tmp"), os.path.join(markers, f"port{rank}"))
    wait_for(os.path.join(markers, "tried"), timeout=60)
    if rank == 1:  # the test's chunks are here before any of the call's (a PULL takes its pipes in turn)
        assert data._pull.poll(int(HANDSHAKE_S * 1000), zmq.POLLIN), "the forged chunks never came"
    y = zc.allreduce(x * (rank + 1))
    return bool(np.array_equal(y, x * 6)), float(y[:SEGMENT].max())


def forged_chunks(session, seq):
    """Every chunk rank 1 of 3 receives in a ring allreduce of 3 * SEGMENT
    float64 (from rank 0), with the wrong session, carrying FORGED."""
    from zcollective._protocol._ring import AG, RS

    payload = np.full(SEGMENT, FORGED).tobytes()
    for kind, step in ((RS, 0), (RS, 1), (AG, 0), (AG, 1)):
        header = _chunks.HEADER.pack(_chunks.MAGIC, _chunks.VERSION, kind, session ^ 1, seq, 0,
                                     step, 0)
        yield [header, b"\0" * 32, payload]


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_a_data_port_admits_only_its_own_link_key_and_drops_another_groups_chunks(tmp_path, secret):
    """Real PLAIN handshakes with each rank's data port (rank 0's answered by
    its coordinator's gatekeeper with a secret, the others' by their own
    gate thread): a token under the port's own link key passes; a token
    under another rank's, another group's, the plain secret or data key, the
    master port's, or a stranger's key is refused. Through the one that
    passed, chunks of another session reach rank 1's data port: dropped (and
    said), the allreduce is right on every rank."""
    import json

    markers = str(tmp_path)
    env = {k: v for k, v in ON.items() if k != "ZCOLLECTIVE_LIVENESS_TIMEOUT"}
    env.update({"ZCOLLECTIVE_SECRET": secret} if secret else {})
    seen = {}
    with Replicas(tried_by_strangers, 3, markers, env=env) as reps:
        ctx = zmq.Context()
        try:
            wait_for(*(os.path.join(markers, f"port{r}") for r in range(3)), timeout=60, watch=reps)
            ports = []
            for r in range(3):
                with open(os.path.join(markers, f"port{r}")) as f:
                    ports.append(json.load(f))
            session, base = ports[0]["session"], bytes.fromhex(ports[0]["base"])
            domain = _zap.DATA_DOMAIN
            for r, port in enumerate(ports):
                offers = {f"rank {q}'s key": _tokens.port_key(base, session, q) for q in range(3)}
                offers["another group's key"] = _tokens.port_key(base, session ^ 1, r)
                offers["the base key itself"] = base
                offers["a stranger's key"] = os.urandom(32)
                for what, key in offers.items():
                    credentials = _tokens.client_credentials(key, domain)
                    push, seen[r, what] = handshake(ctx, port["endpoint"], credentials)
                    if (r, what) == (1, "rank 1's key") and seen[r, what] == "HANDSHAKE_SUCCEEDED":
                        for chunk in forged_chunks(session, ports[1]["seq"]):
                            push.send_multipart(chunk)
                master = _tokens.client_credentials(base, _zap.MASTER_DOMAIN)  # the master port's token
                _, seen[r, "a master port's token"] = handshake(ctx, port["endpoint"], master)
        finally:
            touch(os.path.join(markers, "tried"))
            ctx.destroy(linger=1000)  # (the forged chunks leave first)
        outs = reps.wait(60)
    said = report(outs, f"handshakes: {seen}")
    expected = {(r, what): "HANDSHAKE_SUCCEEDED" if what == f"rank {r}'s key" else "HANDSHAKE_FAILED_AUTH"
                for r, what in seen}
    assert seen == expected, said
    assert all(o.ok for o in outs), said
    assert [o.value for o in outs] == [(True, 6 * (SEGMENT - 1))] * 3, said
    assert "dropped a chunk on the data port that is not of this group" in outs[1].output, said


# -- the control link reset: the same promise on the master port ----------------------------


def control_reset(markers, secret):
    """Rank 1's connection to rank 0 goes through a relay the test resets
    between two calls; rank 1 then calls first (its contribution is sent
    before anything is read: the send must not block on a dropped pipe)."""
    rank = zc.get_rank()
    assert zc.allreduce(rank) == 3
    zc.barrier()
    if rank == 1:
        touch(os.path.join(markers, "reset-me"))
        wait_for(os.path.join(markers, "reset"))
    return timed_call(rank)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_a_reset_control_link_is_named_on_every_rank_within_the_bound(tmp_path, secret):
    markers = str(tmp_path)
    port = zc.testing.free_port()
    env = {"ZCOLLECTIVE_LIVENESS_TIMEOUT": "2", **({"ZCOLLECTIVE_SECRET": secret} if secret else {})}
    with LinkRelay(port) as relay, \
            Replicas(control_reset, 3, markers, secret, port=port, env=env,
                     rank_env={1: {"ZCOLLECTIVE_MASTER_PORT": str(relay.port)}}) as reps:
        try:
            wait_for(os.path.join(markers, "reset-me"), timeout=60, watch=reps)
            assert relay.connections == 1
            relay.reset()
            relay.settled()  # re-made; with a secret, refused (rank 0's thread answers at once)
        finally:
            touch(os.path.join(markers, "reset"))
        outs = reps.wait(60)
    for o in outs:
        assert o.ok, report(outs, f"rank {o.rank} failed")
        kind, message, took = o.value
        assert kind == "ReplicaLostError", report(outs, f"rank {o.rank}: {kind}: {message}")
        expected = "rank 1 lost the coordinator (rank 0)" if o.rank == 1 else "rank 1 (pid"
        assert expected in message and "lost" in message, report(outs, f"rank {o.rank}: {message}")
        assert took < BOUND, report(outs, f"rank {o.rank} took {took:.1f} s")


# -- Ctrl-C on a rank waiting on a silent data link -----------------------------------------


def interrupted_on_a_silent_link(markers):
    rank = zc.get_rank()
    # silent mid-ring: no close, no answer
    add_then_stop = signalled_mid_ring(2, os.path.join(markers, "stopping"), signal.SIGSTOP)
    zc.barrier()
    if rank == 1:
        touch(os.path.join(markers, "waiting"))
    try:
        zc.allreduce(np.ones(4 << 20, dtype=np.float32), add_then_stop)
    except KeyboardInterrupt:
        with open(os.path.join(markers, "interrupted.tmp"), "w") as f:
            f.write(repr(time.monotonic()))  # (CLOCK_MONOTONIC: one clock for every process)
        os.rename(os.path.join(markers, "interrupted.tmp"), os.path.join(markers, "interrupted"))
        return "interrupted"
    except zc.CollectiveError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_ctrl_c_ends_a_call_waiting_on_a_silent_data_link(tmp_path):
    """The stopped rank would be found lost only after the liveness bound
    (30 s here); Ctrl-C on its neighbour ends that neighbour's call at once."""
    markers = str(tmp_path)
    env = {**ON, "ZCOLLECTIVE_LIVENESS_TIMEOUT": "30"}
    with Replicas(interrupted_on_a_silent_link, 3, markers, env=env) as reps:
        try:
            wait_for(os.path.join(markers, "stopping"), os.path.join(markers, "waiting"), timeout=60,
                     watch=reps)
            time.sleep(0.5)  # rank 1 is inside the ring, waiting on rank 2's chunks
            sent = time.monotonic()
            reps.kill(1, signal.SIGINT)
            wait_for(os.path.join(markers, "interrupted"), timeout=10, watch=reps)
            with open(os.path.join(markers, "interrupted")) as f:
                took = float(f.read()) - sent
        finally:
            reps.kill(2, signal.SIGKILL)  # the others end (without teardown) at once
        outs = reps.wait(60)
    said = report(outs, f"Ctrl-C on rank 1: interrupted after {took:.2f} s")
    assert outs[1].ok and outs[1].value == "interrupted", said
    assert took < 2.0, said
