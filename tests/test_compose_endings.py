"""Endings beside the other features (issue 44): a teardown finishes what was
called before it (shared memory, the data plane, point to point left
uncollected), a job killed while one rank is away from the library leaves no
shared-memory segment, and rank 0 ending a point-to-point program says what it
did. The rules first, without sockets; then real processes, real signals."""

import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import touch, wait_for

import zcollective as zc
from zcollective._format import _bodies
from zcollective._format._wire import Kind, Message
from zcollective._io import _shared
from zcollective._protocol import _shm
from zcollective._protocol._coordinator import Joined
from zcollective._protocol._p2p import ANY_SOURCE, ANY_TAG, Mail
from zcollective.testing import Replicas, report, run_replicas

SESSION = 0x5EED
WINDOW = 1000
MIB = 1 << 20
PREFIX = "zcollective-"  # what a group's segments are called in /dev/shm


# -- the rules, without sockets ------------------------------------------------------------


def _mail(rank, size=2):
    from collections import deque

    return Mail(rank, size, WINDOW, SESSION, deque())


def _send_msg(source, tag, seq, payload=b"v"):
    return Message(Kind.SEND, 0, source, tag, seq, SESSION, segments=[[payload]])


def _errors(mail):
    out = [(o.future, str(o.error)) for o in mail.outcomes if o.error is not None]
    mail.outcomes.clear()
    return out


def test_a_rank_in_teardown_drops_what_no_posted_receive_matches_and_credits_it():
    mail = _mail(1)
    mail.take(_send_msg(0, 3, 0, bytes(600)))  # came before teardown, never received
    mail.receive(0, 5, "posted")
    mail.closing()
    assert not mail.box.arrived
    assert [(m.kind, m.seq) for _, m, _ in mail.out] == [(Kind.CREDIT, 0)]  # (600 B: past a quarter)
    mail.out.clear()
    mail.take(_send_msg(0, 4, 1))  # no receive for it: dropped as it comes
    mail.take(_send_msg(0, 5, 2, b"mine"))  # the posted one's
    assert not mail.box.arrived
    assert [(o.future, o.error) for o in mail.outcomes] == [("posted", None)]


def test_a_send_waiting_for_the_credit_of_a_rank_in_teardown_keeps_waiting_for_it():
    """A rank that called teardown still takes in until the group closes: its FINAL fails
    a send waiting for its credit only when its program ended (then nothing receives)."""
    for teardown, failed in ((True, []), (False, ["waits"])):
        mail = _mail(0)
        mail.send(1, 0, [bytes(WINDOW)], "fills the window")
        mail.send(1, 0, [b"x"], "waits")
        mail.ended(1, 0, "rank 1 called teardown (pid 8 on h)", teardown, posted=[])  # (no receive posted)
        assert [f for f, _ in _errors(mail)] == failed
        assert mail.sending() is teardown
        assert mail.gone() == (set() if teardown else {1})
        if teardown:  # its credit comes: the send goes
            mail.take(Message(Kind.CREDIT, 0, 1, 0, 0, SESSION))
            assert not mail.sending() and [h for _, m, h in mail.out if m.kind is Kind.SEND] == [
                "fills the window", "waits"]
        mail.send(1, 2, [b"y"], "after")  # a send made once told fails at once, either way (no receive
        # there waits for it: test_p2p_teardown_posted)
        assert [f for f, _ in _errors(mail)] == ["after"]


def test_an_exit_after_an_interrupted_teardown_decides_what_waits_for_that_rank():
    """A review of the merges: a rank whose teardown was interrupted, then whose program ended,
    says FINAL twice (teardown, then exit); the second was dropped, so a send waiting for its
    credit waited for ever (its teardown takes in nothing more once its program ended)."""
    mail = _mail(0)
    mail.send(1, 0, [bytes(WINDOW)], "fills the window")
    mail.send(1, 0, [b"x"], "waits")
    mail.ended(1, 0, "rank 1 called teardown (pid 8 on h)", True)
    assert _errors(mail) == [] and mail.gone() == set()
    mail.ended(1, 0, "rank 1 ended its program (without teardown) (pid 8 on h)", False, received=1)
    assert [f for f, _ in _errors(mail)] == ["waits"] and mail.gone() == {1}
    mail.ended(1, 0, "rank 1 called teardown (pid 8 on h)", True)  # (said again: nothing more)
    assert _errors(mail) == [] and mail.gone() == {1}


def test_a_receive_left_for_a_rank_whose_last_message_matched_another_fails_at_once():
    mail = _mail(1)
    mail.receive(0, 5, "matched")
    mail.receive(0, 6, "left")
    mail.ended(0, 1, "rank 0 called teardown (pid 7 on h)", True)
    assert _errors(mail) == []  # its one message is still on its way
    mail.take(_send_msg(0, 5, 0))  # its last, taken by the first receive
    assert _errors(mail) == [("left", "rank 1: recv(source=0, tag=6) cannot complete: rank 0 called "
                                      "teardown (pid 7 on h), after sending this rank 1 message(s), all "
                                      "taken in; none here matches")]


def test_a_receive_only_this_rank_could_answer_fails_at_teardown_naming_it():
    mail = _mail(1)
    mail.receive(1, 4, "from itself")
    mail.receive(ANY_SOURCE, ANY_TAG, "anyone")
    mail.ended(0, 0, "rank 0 called teardown (pid 7 on h)", True)
    assert [f for f, _ in _errors(mail)] == ["anyone"]  # (no other rank can send)
    mail.torn_down()
    assert _errors(mail) == [("from itself", "rank 1: recv(source=1, tag=4) cannot complete: this rank "
                                             "called teardown, so it sends itself nothing more, and no "
                                             "message here matches")]


def test_what_a_teardown_waits_for_is_said():
    mail = _mail(0, size=3)
    mail.send(1, 0, [bytes(WINDOW)], "a")
    mail.send(1, 0, [b"x"], "waits")
    mail.ended(2, 3, "rank 2 called teardown (pid 8 on h)", True)
    assert mail.unfinished() == ["sends waiting for the credit of ranks 1",
                                 "ranks 1 had not called teardown (nor ended)",
                                 "3 message(s) rank 2 sent this rank had not come"]


def test_the_coordinator_says_which_ranks_called_teardown():
    for how in ("teardown", "exit"):
        final = _bodies.final([0, 2], how == "teardown", rank=0, session=SESSION)
        told = _bodies.ended("rank 0 ...", teardown=_bodies.parse_final(final, 2)["teardown"], rank=1,
                             root=0, seq=2, session=SESSION)
        assert _bodies.ended_by_teardown(told) is (how == "teardown")


def test_a_new_segment_is_made_only_once_every_rank_of_the_host_is_at_its_first_step():
    """Issue 44, defect 5: a segment made before every rank came to the call stayed linked
    while one rank was away (busy in its own code); a kill of the job then left it in
    /dev/shm. The leader makes it only after a sync every rank reached."""
    grown, tail = _shm.Place(1, 1 << 20, 2, True), [_shm.REDUCE]
    leader = _shm.schedule(grown, _shm.HostPlan(True, True), True, True, tail)
    other = _shm.schedule(grown, _shm.HostPlan(True, True), True, False, tail)
    assert leader == ["sync", "create", "sync", "stage", "sync", "unlink", "reduce"]
    assert other == ["sync", "sync", "attach", "stage", "sync", "unlink", "reduce"]


def test_an_ended_rank_is_described_by_its_collective_calls_and_its_sends():
    """Issue 44, item 16d: rank 0 ending after 201 sends and no collective call was said
    to end "before its first call"."""
    member = Joined(rank=0, peer=b"p", pid=7, host="h")
    member.ended = 0
    ended = "rank 0 ended its program (without teardown)"
    assert member.describe_end() == f"{ended} before its first call (pid 7 on h)"
    member.sent = 201
    assert member.describe_end() == (f"{ended} before its first collective call, after 201 point-to-point "
                                     f"sends (pid 7 on h)")
    member.ended = 5
    assert member.describe_end() == ("rank 0 ended its program (without teardown) after seq 4 and 201 "
                                     "point-to-point sends (pid 7 on h)")


# -- real processes: teardown finishes what was called ------------------------------------


def shared_allreduce_left_uncollected():
    r = zc.get_rank()
    f = zc.allreduce_async(np.full(MIB, r + 1, dtype=np.float32))  # 4 MiB: through shared memory
    g = zc.allreduce_async(np.full(2 * MIB, r + 2, dtype=np.float32))  # 8 MiB: a new segment
    zc.teardown()
    return float(f.result()[0]), float(g.result()[-1]), f.done(), g.done()


@pytest.mark.skipif(not _shared.available(), reason="no POSIX shared memory here")
def test_teardown_finishes_shared_memory_allreduces_left_uncollected():
    """Defect 4: `RuntimeError: seq 0 allreduce: the group was torn down before the call
    finished` (or a hang at a sync the coordinator no longer answered)."""
    outs = run_replicas(shared_allreduce_left_uncollected, 3, timeout=60)
    assert outs == [(6.0, 9.0, True, True)] * 3, outs


def _sent(send):
    """A send's outcome: None, or the words of a PeerEndedError (the receiver's teardown known first)."""
    error = send.exception()
    return None if error is None else (type(error).__name__, str(error))


def point_to_point_left_uncollected():
    """Four 256 KiB sends to the next rank through a 1 MiB window (the last waits for its
    credit), receives for three of them posted, one for a message never sent, one for a
    message of its own never sent; all left uncollected at teardown."""
    r, n = zc.get_rank(), zc.get_world_size()
    sends = [zc.send_async(np.full(MIB // 4, 10 * r + k, dtype=np.float32), (r + 1) % n, tag=k)
             for k in range(4)]
    gets = [zc.recv_async((r - 1) % n, tag=k) for k in (0, 2, 3)]  # tag 1's is never received
    never = zc.recv_async((r - 1) % n, tag=7)
    mine = zc.recv_async(r, tag=8)
    zc.teardown()
    out = [[_sent(s) for s in sends], [float(g.result()[0]) for g in gets]]
    for future in (never, mine):
        error = future.exception()
        out.append((isinstance(error, zc.CollectiveError), str(error)))
    return out


@pytest.mark.parametrize("plane", ["mailbox", "data plane"])
def test_teardown_finishes_point_to_point_calls_left_uncollected(plane):
    """Defect 4: `... it was not sent` (a send waiting for credit or for its link) and
    `the group was closed before the point-to-point call finished` (a receive whose message
    was on its way). With the data plane, an allreduce moving peer to peer beside them."""
    env = {"ZCOLLECTIVE_MAIL_WINDOW_BYTES": str(MIB)}
    if plane == "data plane":
        env.update(ZCOLLECTIVE_DATA_PLANE="on", ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES="off")

    def run():
        r = zc.get_rank()
        f = zc.allreduce_async(np.full(MIB, r + 1, dtype=np.float32)) if plane != "mailbox" else None
        out = point_to_point_left_uncollected()
        return out + ([float(f.result()[0])] if f is not None else [])
    n = 3
    outs = run_replicas(run, n, timeout=60, env=env)
    for r, out in enumerate(outs):
        sent, got, (never_is, never), (mine_is, mine), *summed = out
        before = (r - 1) % n
        after = (r + 1) % n
        # tag 1's send, which no receive waits for, fails if the receiver's teardown was known first
        # (else it goes, and its teardown drops it); the others go either way (test_p2p_teardown_posted)
        assert sent[1] is None or (sent[1][0] == "PeerEndedError" and sent[1][1].startswith(
            f"rank {r}: send(dest={after}, tag=1) cannot go: rank {after} called teardown")), outs
        assert [sent[0], sent[2], sent[3]] == [None] * 3, outs
        assert got == [10.0 * before, 10.0 * before + 2, 10.0 * before + 3], outs
        assert never_is and never.startswith(
            f"rank {r}: recv(source={before}, tag=7) cannot complete: rank {before} called teardown"), never
        assert mine_is and mine.startswith(f"rank {r}: recv(source={r}, tag=8) cannot complete: this rank "
                                           f"called teardown"), mine
        assert summed == ([] if plane == "mailbox" else [6.0]), outs


def teardown_timing_out_waiting_for_a_rank(markers):
    r = zc.get_rank()
    if r == 1:  # in its own code, past rank 0's teardown timeout
        wait_for(os.path.join(markers, "timed out"), timeout=30)
        return "late"
    start = time.monotonic()
    try:
        zc.teardown(timeout=1.5)
    except zc.CollectiveTimeoutError as exc:
        return str(exc), time.monotonic() - start
    finally:
        touch(os.path.join(markers, "timed out"))
    return "returned"


def test_a_teardown_that_cannot_finish_says_for_whom_it_waited_within_its_timeout(tmp_path):
    with Replicas(teardown_timing_out_waiting_for_a_rank, 2, str(tmp_path)) as reps:
        outs = reps.wait(60)
    said, took = outs[0].value
    assert said.startswith("rank 0: teardown timed out after 1.5 s finishing the calls made before it: "
                           "ranks 1 had not called teardown (nor ended)"), report(outs, said)
    assert took < 3.5, report(outs, f"took {took:.1f} s")


# -- real processes: a job killed while one rank is away leaves no segment ------------------


def _segments(session):
    """The group's segments in /dev/shm (their names are hashes of the session, host and
    generation): only those this test's job could have made."""
    names = {_shared.segment_name(session, host, gen).lstrip("/") for host in range(4) for gen in range(16)}
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(PREFIX) and f in names)


def away_after_an_allreduce(markers, away):
    """Every rank makes an allreduce through shared memory (its segment made then); rank
    ``away`` goes on in pure Python, the others wait for the result (a marker once each
    waits at a sync of the call's job), until the test kills them all."""
    life = zc._current()._life
    r = zc.get_rank()
    with open(os.path.join(markers, f"session{r}"), "w") as f:
        f.write(str(life.member.session))
    future = zc.allreduce_async(np.ones(2 * MIB, dtype=np.float32))  # 8 MiB: 48 MiB of segment
    if r == away:
        touch(os.path.join(markers, "away"))
        while True:  # busy in its own code, never in the library again
            sum(range(1000))

    def watch():  # (reads the job without the turn: a test's look only)
        while True:
            transfers = list(life.member.transfers)
            if transfers and getattr(transfers[0][1], "asked", False):
                touch(os.path.join(markers, f"at sync {r}"))
                return
            time.sleep(0.005)
    threading.Thread(target=watch, daemon=True).start()
    future.result()


@pytest.mark.skipif(not _shared.available(), reason="no POSIX shared memory here")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_job_killed_while_a_rank_is_away_after_an_allreduce_leaves_no_segment(sig, tmp_path):
    """Defect 5: the leader made the segment at once and waited for the rank away to attach;
    killed then (every rank; SIGTERM left to its default), the job left it in /dev/shm."""
    n, away = 3, 1
    markers = str(tmp_path)
    with Replicas(away_after_an_allreduce, n, markers, away) as reps:
        wait_for(*(os.path.join(markers, m) for m in ("away", "at sync 0", "at sync 2")), watch=reps)
        for rank in range(n):
            reps.kill(rank, sig)
        reps.join(list(range(n)), 20)
        outs = reps.wait(5)
    assert all(o.returncode == -sig for o in outs), report(outs, "a rank did not die of the signal")
    with open(os.path.join(markers, "session0")) as f:
        session = int(f.read())
    left = _segments(session)
    for name in left:  # (the test's own mess: not left for the next run)
        _shared.unlink("/" + name)
    assert left == [], report(outs, f"left in /dev/shm: {left}")


# -- real processes: rank 0 ending a point-to-point program -----------------------------------


def sends_then_ends(markers):
    zc.initialize()
    r = zc.get_rank()
    if r == 0:
        for i in range(201):
            zc.send(i, 1, tag=3)
        wait_for(os.path.join(markers, "received"))
        return "ended"  # without teardown: the group ends with it
    got = [zc.recv(0, tag=3, timeout=30) for _ in range(201)]
    touch(os.path.join(markers, "received"))
    try:
        zc.recv(0, tag=4, timeout=30)  # (fails once rank 0's end is known: its FINAL, or the group's)
    except zc.CollectiveError:
        pass
    try:
        zc.barrier(timeout=30)  # the group is over: what its failure says
    except zc.CollectiveError as exc:
        return got == list(range(201)), str(exc)
    return "no error"


def test_rank_0_ending_a_point_to_point_program_counts_its_sends(tmp_path):
    """Item 16d: `rank 0 ended its program (without teardown) before its first call` after
    201 sends."""
    with Replicas(sends_then_ends, 2, str(tmp_path), initialize=False) as reps:
        outs = reps.wait(60)
    assert outs[0].ok and outs[1].ok, report(outs, "a rank failed")
    complete, said = outs[1].value
    assert complete, report(outs, "rank 1 did not receive every message")
    assert "rank 0 ended its program (without teardown) before its first collective call, after 201 " \
           "point-to-point sends (pid" in said, report(outs, said)


# -- real processes: a program ending without teardown ----------------------------------------


def ends_with_a_send_waiting_for_credit(markers):
    """Rank 1 sends rank 0 two 1 MiB messages through a 1 MiB window (the second waits for
    rank 0's credit) and its program ends at once; rank 0 receives them only then."""
    zc.initialize()
    r, ending = zc.get_rank(), os.path.join(markers, "ending")
    if r == 1:
        first = zc.send_async(np.zeros(MIB // 4, dtype=np.float32), 0, tag=1)
        second = zc.send_async(np.ones(MIB // 4, dtype=np.float32), 0, tag=1)
        touch(ending)
        return first.done(), second.done()  # (then the program ends, without teardown)
    wait_for(ending)
    got = [float(zc.recv(1, tag=1, timeout=30)[0]) for _ in range(2)]
    zc.teardown()  # (rank 1 ended without it: it closes, and says so)
    return got


def test_a_program_ending_without_teardown_sends_what_waits_for_credit_first(tmp_path):
    """The exit path finishes what it can within its linger: the second send used to fail
    as the program ended (`... waited for rank 0's window when this rank stopped sending ...:
    it was not sent`), and rank 0's second receive with it."""
    with Replicas(ends_with_a_send_waiting_for_credit, 2, str(tmp_path), initialize=False,
                  env={"ZCOLLECTIVE_MAIL_WINDOW_BYTES": str(MIB)}) as reps:
        outs = reps.wait(60)
    assert outs[1].ok and outs[1].value[1] is False, report(outs, "rank 1's second send did not wait")
    assert outs[0].value == [0.0, 1.0], report(outs, "rank 0 did not receive both")
