"""The coordinator's rules, driven directly with messages (no sockets)."""

import logging

import pytest
from pair import FakeClock

from zcollective._format import _serialize
from zcollective._format._wire import (
    FLAG_AUTH,
    FLAG_LAST,
    FLAG_LOCAL_ERROR,
    PROTOCOL_VERSION,
    Kind,
    Message,
    control,
    decode,
    encode,
    join_token,
)
from zcollective._io._combine import applied, run
from zcollective._protocol._coordinator import PYTHON_VERSION, Coordinator, Phase
from zcollective._protocol._ops import SPOKEN, Combine, Disagree, Op, Unreadable

SESSION = 0x5E55


def peer(rank):
    return b"R%d" % rank


def join_msg(rank, n, python=PYTHON_VERSION, ops=SPOKEN):
    return control(Kind.JOIN, {"rank": rank, "num_replicas": n, "python": python, "ops": ops,
                               "protocol": PROTOCOL_VERSION, "pid": 100 + rank, "host": "h"},
                   rank=rank)


def feed(coord, who, msg):
    """Send msg as frames, as the driver would (running a reduction asked for);
    decode what comes back."""
    out = applied(coord.receive(who, encode(msg), address="10.0.0.9"), coord)
    return [(p, decode(encode(m))) for p, m in out]


def joined(n):
    coord = Coordinator(n, SESSION, max_frames=1000)
    for r in range(n):
        out = feed(coord, peer(r), join_msg(r, n))
    assert coord.phase is Phase.RUNNING
    assert sorted(p for p, _ in out) == sorted(peer(r) for r in range(n))
    assert all(m.kind is Kind.WELCOME and m.session == SESSION for _, m in out)
    return coord


def contrib(rank, seq, op=Op.ALLREDUCE, value=None, fn=None, root=0, site="t.py:1", segments=None):
    if segments is None:
        segments = [_serialize.dumps(value)]
    fnb = _serialize.dumps(fn)[0] if fn is not None else None
    return Message(Kind.CONTRIB, op, rank, root, seq, SESSION, site, 0, fnb, segments)


def results(out):
    return {p: m for p, m in out}


def test_join_waits_for_every_rank_then_welcomes_all():
    coord = Coordinator(3, SESSION, 1000)
    assert feed(coord, peer(2), join_msg(2, 3)) == []
    assert feed(coord, peer(0), join_msg(0, 3)) == []
    assert coord.missing_joins() == [1]
    out = feed(coord, peer(1), join_msg(1, 3))
    assert {p for p, _ in out} == {peer(0), peer(1), peer(2)}


def test_allreduce_applies_rank_zeros_function_in_rank_order():
    coord = joined(3)
    concat = lambda a, b: a + b  # noqa: E731  (non-commutative on strings)
    assert feed(coord, peer(2), contrib(2, 0, value="c", fn=lambda a, b: "WRONG")) == []
    assert feed(coord, peer(0), contrib(0, 0, value="a", fn=concat)) == []
    out = results(feed(coord, peer(1), contrib(1, 0, value="b")))
    assert len(out) == 3
    for m in out.values():
        assert m.kind is Kind.RESULT and m.seq == 0
        assert _serialize.loads(m.segments[0]) == "abc"


def test_calls_complete_independently_by_sequence_number():
    coord = joined(2)
    add = lambda a, b: a + b  # noqa: E731
    feed(coord, peer(0), contrib(0, 0, value=1, fn=add))
    feed(coord, peer(0), contrib(0, 1, value=10, fn=add))
    out = feed(coord, peer(1), contrib(1, 0, value=2))
    assert {m.seq for _, m in out} == {0}
    out = feed(coord, peer(1), contrib(1, 1, value=20))
    assert [_serialize.loads(m.segments[0]) for _, m in out] == [30, 30]


def test_broadcast_forwards_roots_frames_without_unpickling():
    coord = joined(3)
    root_segment = [b"not even a pickle"]
    feed(coord, peer(0), contrib(0, 0, Op.BROADCAST, root=1, segments=[]))
    feed(coord, peer(1), contrib(1, 0, Op.BROADCAST, root=1, segments=[root_segment]))
    out = results(feed(coord, peer(2), contrib(2, 0, Op.BROADCAST, root=1, segments=[])))
    assert [bytes(f) for f in out[peer(0)].segments[0]] == root_segment
    assert out[peer(1)].segments == []  # the root keeps its own value


def test_data_for_one_rank_travels_only_to_it():
    coord = joined(3)
    for r in range(3):
        out = results(feed(coord, peer(r), contrib(r, 0, Op.GATHER, root=2, segments=[[b"v%d" % r]])))
    assert [bytes(s[0]) for s in out[peer(2)].segments] == [b"v0", b"v1", b"v2"]
    assert out[peer(0)].segments == [] and out[peer(1)].segments == []
    for r in range(3):
        segs = [[b"%d->%d" % (r, i)] for i in range(3)]
        out = results(feed(coord, peer(r), contrib(r, 1, Op.ALLTOALL, segments=segs)))
    assert [bytes(s[0]) for s in out[peer(1)].segments] == [b"0->1", b"1->1", b"2->1"]


def test_reduce_fn_that_raises_is_an_error_for_that_call_only():
    coord = joined(2)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a / 0))
    out = feed(coord, peer(1), contrib(1, 0, value=2))
    assert len(out) == 2
    body = out[0][1].body()
    assert out[0][1].kind is Kind.ERROR
    assert body["error"] == "RemoteError" and body["remote_type"] == "ZeroDivisionError"
    assert "seq 0 allreduce" in body["message"] and "Traceback" in body["remote_traceback"]
    assert coord.phase is Phase.RUNNING
    feed(coord, peer(0), contrib(0, 1, value=1, fn=lambda a, b: a + b))
    out = feed(coord, peer(1), contrib(1, 1, value=2))
    assert _serialize.loads(out[0][1].segments[0]) == 3


def test_mismatch_names_ranks_operations_and_call_sites_and_is_sticky():
    coord = joined(4)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a, site="train.py:88"))
    feed(coord, peer(2), contrib(2, 0, value=1, site="train.py:88"))
    out = feed(coord, peer(1), contrib(1, 0, Op.BROADCAST, segments=[], site="train.py:95"))
    assert coord.phase is Phase.FAILED
    assert {p for p, _ in out} == {peer(r) for r in range(4)}
    body = out[0][1].body()
    assert body["error"] == "CallMismatchError"
    assert body["message"] == ("seq 0: ranks 0,2 called allreduce at train.py:88; "
                               "rank 1 called broadcast(root=0) at train.py:95; rank 3 had not called yet")
    later = feed(coord, peer(3), contrib(3, 0, value=1))
    assert later[0][1].kind is Kind.FAIL and later[0][1].body() == body


def test_different_roots_are_a_mismatch():
    coord = joined(2)
    feed(coord, peer(0), contrib(0, 0, Op.BROADCAST, root=0, segments=[[b"x"]]))
    out = feed(coord, peer(1), contrib(1, 0, Op.BROADCAST, root=1, segments=[[b"y"]]))
    assert "broadcast(root=0)" in out[0][1].body()["message"]


def test_lost_rank_fails_group_naming_rank_and_calls_in_flight():
    coord = joined(3)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a))
    out = coord.gone(peer(1))  # a probe to rank 1 failed
    assert {p for p, _ in out} == {peer(0), peer(2)}
    body = decode(encode(out[0][1])).body()
    assert body["error"] == "ReplicaLostError" and body["lost"] == [1]
    assert "rank 1 (pid 101 on h) was lost" in body["message"]
    assert "seq 0 allreduce (arrived: rank 0)" in body["message"]
    assert coord.gone(peer(1)) == []  # already failed


def test_unknown_connection_closing_changes_nothing():
    coord = joined(2)
    assert coord.gone(b"stranger") == []
    assert coord.phase is Phase.RUNNING


@pytest.mark.parametrize("problem, msg, text", [
    ("python", join_msg(1, 2, python="2.7"), "runs Python 2.7"),
    ("ops", join_msg(1, 2, ops="allreduce,broadcast"), "knows the operations allreduce,broadcast, the "
     "coordinator (rank 0) knows allreduce,broadcast,allgather,gather,scatter,reduce,alltoall,barrier"),
    ("size", join_msg(1, 3), "disagree on num_replicas: rank 1 (pid 101 on h) says 3"),
    ("range", join_msg(5, 2), "out of range"),
    ("twice", join_msg(0, 2), "rank 0 was claimed twice"),
])
def test_faulty_join_fails_the_group_for_everyone(problem, msg, text):
    coord = Coordinator(2, SESSION, 1000)
    feed(coord, peer(0), join_msg(0, 2))
    out = feed(coord, b"other", msg)
    assert coord.phase is Phase.FAILED
    kinds = {p: m.kind for p, m in out}
    assert kinds[b"other"] is Kind.REJECT and kinds[peer(0)] is Kind.FAIL
    assert text in out[0][1].body()["message"]


def test_join_after_start_is_refused_but_the_group_runs_on():
    coord = joined(2)
    out = feed(coord, b"late", join_msg(1, 2))
    assert [m.kind for _, m in out] == [Kind.REJECT]
    assert out[0][1].body()["error"] == "LateJoinError"
    assert "already started" in out[0][1].body()["message"]
    assert coord.phase is Phase.RUNNING


def test_strangers_forgers_and_replays_are_dropped_and_logged_once(caplog):
    coord = joined(2)
    caplog.set_level(logging.WARNING, logger="zcollective")
    evil = contrib(1, 0, value=1)
    for _ in range(3):
        assert coord.receive(b"stranger", [b"garbage"], address="6.6.6.6") == []
        assert feed(coord, b"stranger", evil) == []
    assert sum("6.6.6.6" in r.message for r in caplog.records) == 1
    # rank 0's connection claiming rank 1, then a wrong session
    assert feed(coord, peer(0), evil) == []
    stale = contrib(0, 0, value=1)
    stale.session = 1234
    assert feed(coord, peer(0), stale) == []
    # a replay of an old sequence number
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a + b))
    feed(coord, peer(1), contrib(1, 0, value=1))
    assert feed(coord, peer(1), contrib(1, 0, value=100)) == []
    assert coord.pending == {} and coord.next_seq == [1, 1]


def test_status_reports_who_has_arrived():
    coord = joined(3)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a))
    out = feed(coord, peer(1), Message(Kind.STATUS, rank=1, seq=0, session=SESSION))
    body = out[0][1].body()
    assert body["arrived"] == [0] and body["missing"] == [1, 2] and body["state"] == "pending"


def test_local_error_contribution_fails_that_call_on_every_rank():
    coord = joined(2)
    note = control(Kind.ERROR, {"message": "scatter needs one value per replica"}).segments
    msg = contrib(0, 0, Op.SCATTER, segments=note)
    msg.flags = FLAG_LOCAL_ERROR
    feed(coord, peer(0), msg)
    out = feed(coord, peer(1), contrib(1, 0, Op.SCATTER, segments=[]))
    assert [m.kind for _, m in out] == [Kind.ERROR, Kind.ERROR]
    assert out[0][1].body()["error"] == "PeerError"
    assert "rank 0 failed: scatter needs one value" in out[0][1].body()["message"]
    assert coord.phase is Phase.RUNNING


def test_teardown_closes_after_everyone_called_it():
    coord = joined(2)
    feed(coord, peer(1), contrib(1, 0, Op.TEARDOWN, segments=[]))
    assert coord.phase is Phase.RUNNING
    out = feed(coord, peer(0), contrib(0, 0, Op.TEARDOWN, segments=[]))
    assert coord.phase is Phase.CLOSED and len(out) == 2
    assert coord.gone(peer(1)) == []  # leaving is not being lost


def test_leaving_before_the_group_starts_reopens_the_slot():
    coord = Coordinator(2, SESSION, 1000)
    feed(coord, peer(1), join_msg(1, 2))
    assert coord.gone(peer(1)) == [] and coord.missing_joins() == [0, 1]
    feed(coord, peer(0), join_msg(0, 2))
    out = feed(coord, b"R1-again", join_msg(1, 2))
    assert coord.phase is Phase.RUNNING and len(out) == 2


def test_a_join_repeated_after_a_reconnect_refreshes_the_member():
    coord = Coordinator(2, SESSION, 1000)
    feed(coord, peer(1), join_msg(1, 2))
    feed(coord, peer(1), join_msg(1, 2))  # same process, new connection
    assert coord.phase is Phase.JOINING and 1 in coord.by_rank
    out = feed(coord, peer(0), join_msg(0, 2))
    assert coord.phase is Phase.RUNNING and len(out) == 2


def test_probes_go_to_every_member_whose_loss_would_matter():
    """Rule 8: a connection closed; the driver probes each member that may
    be affected (never rank 0, which hosts the coordinator; never one that
    said BYE), each bound to its member as every message to it is."""
    coord = Coordinator(3, SESSION, 1000)
    feed(coord, peer(1), join_msg(1, 3))
    joining = coord.probes()
    assert [(p, m.kind, m.rank) for p, m in joining] == [(peer(1), Kind.PROBE, 1)]
    assert joining[0][1].session == join_token(coord.by_rank[1].nonce)  # not welcomed yet: its JOIN's
    feed(coord, peer(0), join_msg(0, 3))
    feed(coord, peer(2), join_msg(2, 3))
    feed(coord, peer(2), bye(2, 0))
    out = [(p, decode(encode(m))) for p, m in coord.probes()]
    assert [(p, m.kind, m.rank, m.session) for p, m in out] == [(peer(1), Kind.PROBE, 1, SESSION)]
    coord.fail("ValueError", "over")
    assert coord.probes() == []  # the group is over: nobody's loss changes anything


def test_a_stranger_gone_changes_nothing_and_a_replica_joining_again_stays():
    coord = Coordinator(2, SESSION, 1000)
    feed(coord, peer(1), join_msg(1, 2))
    assert coord.gone(b"stranger") == [] and 1 in coord.by_rank
    assert coord.gone(peer(1)) == [] and 1 not in coord.by_rank  # its slot opens again
    feed(coord, b"R1-again", join_msg(1, 2))  # it joins again, on a new connection
    assert coord.gone(peer(1)) == [] and 1 in coord.by_rank  # the old connection's: nothing


def test_the_last_byes_of_rank_0_are_answered_or_gone():
    """Rule 7: rank 0 ends; the group is over; each member still running gets
    a last BYE (FLAG_LAST) and answers it in kind, even in a failed group;
    one that is gone owes nothing. A BYE without the flag is no answer."""
    coord = joined(4)
    assert feed(coord, peer(3), bye(3, 0)) == farewell(3, 0)  # ended: owed no last BYE
    feed(coord, peer(0), bye(0, 0))  # rank 0 ends: the group is over
    assert coord.phase is Phase.FAILED
    out = [(p, decode(encode(m))) for p, m in coord.last_byes()]
    assert [(p, m.kind, m.flags & FLAG_LAST, m.session) for p, m in out] == [
        (peer(1), Kind.BYE, FLAG_LAST, SESSION), (peer(2), Kind.BYE, FLAG_LAST, SESSION)]
    assert coord.unanswered == {peer(1), peer(2)}
    assert [m.kind for _, m in feed(coord, peer(1), bye(1, 0))] == [Kind.FAIL]  # its own BYE: no answer
    assert [(p, m.kind) for p, m in coord.probes()] == [(peer(1), Kind.PROBE), (peer(2), Kind.PROBE)]
    answer = bye(1, 0)
    answer.flags = FLAG_LAST
    assert feed(coord, peer(1), answer) == [] and coord.unanswered == {peer(2)}
    assert coord.gone(peer(2)) == [] and not coord.unanswered


def test_no_last_byes_before_the_welcome():
    coord = Coordinator(2, SESSION, 1000)
    feed(coord, peer(1), join_msg(1, 2))
    assert coord.last_byes() == [] and not coord.unanswered


def test_a_member_repeating_its_join_after_the_start_is_welcomed_again():
    coord = joined(2)
    again = join_msg(1, 2)
    again.segments[0][0] = again.segments[0][0].replace(b'"host":"h"', b'"host":"h","nonce":"n2"')
    out = feed(coord, peer(1), again)
    assert [m.kind for _, m in out] == [Kind.WELCOME]
    assert out[0][1].body()["nonce"] == "n2" and out[0][1].session == SESSION
    assert coord.phase is Phase.RUNNING


def test_a_local_error_note_that_is_not_json_fails_the_call_not_the_coordinator():
    coord = joined(2)
    msg = contrib(0, 0, Op.SCATTER, segments=[[b"not json"]])
    msg.flags = FLAG_LOCAL_ERROR
    feed(coord, peer(0), msg)
    out = feed(coord, peer(1), contrib(1, 0, Op.SCATTER, segments=[]))
    assert [m.kind for _, m in out] == [Kind.ERROR, Kind.ERROR]
    assert "rank 0 failed: ?" in out[0][1].body()["message"]
    assert coord.phase is Phase.RUNNING


def bye(rank, calls):
    return Message(Kind.BYE, rank=rank, seq=calls, session=SESSION)


def farewell(rank, calls):
    """The coordinator's answer to a BYE: everything before it was taken."""
    return [(peer(rank), bye(rank, calls))]


def test_a_bye_is_answered_after_every_reply_before_it():
    coord = joined(2)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a + b))
    out = feed(coord, peer(1), contrib(1, 0, value=2))
    assert [(p, m.kind) for p, m in out] == [(peer(0), Kind.RESULT), (peer(1), Kind.RESULT)]
    assert feed(coord, peer(1), bye(1, 1)) == farewell(1, 1)
    assert feed(coord, peer(1), bye(1, 1)) == farewell(1, 1)  # sent again (a reconnect): answered again
    assert coord.phase is Phase.RUNNING


def test_a_rank_that_ended_is_named_when_the_others_reach_a_call_it_never_made():
    coord = joined(4)
    for r in range(4):
        feed(coord, peer(r), contrib(r, 0, value=1, fn=(lambda a, b: a + b) if r == 0 else None))
    assert feed(coord, peer(3), bye(3, 1)) == farewell(3, 1)  # ended after seq 0: nothing waits for it
    assert coord.gone(peer(3)) == []  # its connection closing is not a loss
    assert coord.phase is Phase.RUNNING
    first = feed(coord, peer(1), contrib(1, 1, value=1))  # the first to reach seq 1 ends the wait
    assert coord.phase is Phase.FAILED
    assert {p for p, _ in first} == {peer(0), peer(1), peer(2)}  # not to the rank that ended
    out = feed(coord, peer(2), contrib(2, 1, value=1))
    assert [(p, m.kind) for p, m in out] == [(peer(2), Kind.FAIL)]
    body = out[0][1].body()
    assert body["error"] == "ReplicaLostError" and body["ended"] is True and body["lost"] == [3]
    assert body["message"].startswith("rank 3 ended its program (without teardown) after seq 0 (pid 103")
    assert body["message"].endswith("; seq 1 allreduce was in flight on rank 1")


def test_a_bye_while_others_wait_for_it_fails_at_once():
    coord = joined(3)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a + b))
    out = feed(coord, peer(1), bye(1, 0))
    assert coord.phase is Phase.FAILED
    assert "rank 1 ended its program (without teardown) before its first call" in out[0][1].body()["message"]
    assert out[-1:] == farewell(1, 0)
    assert {p for p, m in out[:-1]} == {peer(0), peer(2)}


def test_everyone_ending_after_the_same_call_fails_nothing():
    coord = joined(3)
    for r in (1, 2, 0):
        feed(coord, peer(r), contrib(r, 0, value=1, fn=lambda a, b: a + b))
    for r in (2, 1):
        assert feed(coord, peer(r), bye(r, 1)) == farewell(r, 1)
    assert feed(coord, peer(0), bye(0, 1)) == farewell(0, 1)
    assert coord.phase is Phase.CLOSED


def test_rank_zero_ending_first_completes_its_calls_then_tells_the_rest():
    coord = joined(3)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a + b))  # e.g. an async call not collected
    assert feed(coord, peer(0), bye(0, 1)) == farewell(0, 1)  # seq 0 still needs ranks 1 and 2: wait
    assert coord.phase is Phase.RUNNING
    feed(coord, peer(1), contrib(1, 0, value=1))
    out = feed(coord, peer(2), contrib(2, 0, value=1))
    kinds = [(p, m.kind) for p, m in out]
    # results first (rank 0's too, which nobody reads), then the notice to those still running
    assert kinds[:3] == [(peer(0), Kind.RESULT), (peer(1), Kind.RESULT), (peer(2), Kind.RESULT)]
    assert kinds[3:] == [(peer(1), Kind.FAIL), (peer(2), Kind.FAIL)]
    assert _serialize.loads(out[1][1].segments[0]) == 3
    message = out[3][1].body()["message"]
    assert message.startswith("rank 0 ended its program (without teardown) after seq 0")
    assert "the coordinator it hosted is gone" in message


def test_rank_zero_gives_up_waiting_with_the_ranks_it_waited_for():
    """Rule 7's bound is the coordinator's timer: EXIT_WAIT_S after rank 0's ending began."""
    from zcollective._limits import EXIT_WAIT_S

    coord, clock = joined(3), FakeClock()
    coord.clock = clock
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a + b))
    feed(coord, peer(1), contrib(1, 0, value=1))
    feed(coord, peer(0), bye(0, 1))
    assert coord.ending_due() is None and coord.give_up_ending() == []  # (not ending yet)
    coord.start_ending()
    assert coord.ending_due() == clock.now + EXIT_WAIT_S
    clock.now += 30
    out = coord.give_up_ending()
    assert coord.phase is Phase.FAILED and {p for p, _ in out} == {peer(1), peer(2)}
    message = decode(encode(out[0][1])).body()["message"]
    assert "it waited 30 s for its last calls, but seq 0 allreduce was in flight on ranks 0,1" in message


def test_rank_zero_interrupted_before_its_bye_still_tells_the_rest_it_ended():
    """Its exit was interrupted before its BYE went (attack review round 3)."""
    coord = joined(3)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a + b))
    coord.start_ending()
    out = coord.give_up_ending()
    assert coord.ending_due() is None  # (the group is over)
    assert coord.phase is Phase.FAILED and {p for p, _ in out} == {peer(1), peer(2)}
    message = decode(encode(out[0][1])).body()["message"]
    assert message.startswith("rank 0 ended its program (without teardown) after seq 0")
    assert "interrupted while ending" in message


def test_a_stranger_cannot_fail_a_running_group_whatever_its_join_says():
    """Every JOIN to a running group, however wrong (a claimed secret, another
    Python, another size, a rank out of range), gets its peer one REJECT
    saying the group has started, and a second JOIN from that peer nothing;
    the group goes on."""
    coord = joined(2)

    def late(rank, pid, host):
        return {"error": "LateJoinError", "message": f"rank {rank} (pid {pid} on {host}) tried to join "
                                                     f"the group at seq 0, but the group of 2 replicas "
                                                     f"has already started (another job on this "
                                                     f"port? give each job its own)"}

    forged = control(Kind.JOIN, {"rank": 1, "num_replicas": 2, "python": "2.7", "protocol": 1,
                                 "pid": 1, "host": "evil"}, rank=1)
    frames = encode(forged)
    frames[0] = bytearray(frames[0])
    frames[0][5] |= FLAG_AUTH  # "I use a secret": the coordinator has none
    frames.append(b"\0" * 32)
    out = coord.receive(b"stranger", frames, address="10.0.0.66")
    assert [(p, m.kind, m.body()) for p, m in out] == [(b"stranger", Kind.REJECT, late(1, 1, "evil"))]
    for i, bad in enumerate((join_msg(0, 2, python="2.7"), join_msg(1, 3), join_msg(5, 2))):
        who = b"stranger%d" % i
        out = [(p, m.kind, m.body()) for p, m in feed(coord, who, bad)]
        assert out == [(who, Kind.REJECT, late(bad.rank, 100 + bad.rank, "h"))]
        assert feed(coord, who, bad) == []  # one answer per peer
        assert coord.phase is Phase.RUNNING
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a + b))
    out = feed(coord, peer(1), contrib(1, 0, value=2))
    assert _serialize.loads(out[0][1].segments[0]) == 3


def test_while_joining_an_unproven_secret_refuses_only_that_peer():
    coord = Coordinator(2, SESSION, 1000)
    feed(coord, peer(0), join_msg(0, 2))
    frames = encode(join_msg(1, 2))
    frames[0] = bytearray(frames[0])
    frames[0][5] |= FLAG_AUTH
    frames.append(b"\0" * 32)
    out = coord.receive(b"other", frames, address="10.0.0.66")
    assert [m.kind for _, m in out] == [Kind.REJECT] and coord.phase is Phase.JOINING
    status = feed(coord, peer(0), Message(Kind.STATUS, rank=0, seq=0))[0][1].body()
    assert "uses a secret, but the coordinator (rank 0) has none" in status["refused"]["1"]
    feed(coord, peer(1), join_msg(1, 2))  # the real rank 1 still joins
    assert coord.phase is Phase.RUNNING


def test_a_refused_peer_gets_one_answer_and_refusals_are_bounded():
    coord = joined(2)
    answers = sum(len(feed(coord, b"flood", join_msg(1, 2))) for _ in range(1000))
    assert answers == 1
    from zcollective._protocol._coordinator import MAX_ANSWERED_PEERS
    answered = sum(len(feed(coord, b"peer%d" % i, join_msg(1, 2))) for i in range(MAX_ANSWERED_PEERS + 500))
    assert answered == MAX_ANSWERED_PEERS - 1  # "flood" took the first place


def test_a_peer_refused_once_the_group_runs_is_not_read_again(monkeypatch):
    """A flood of large JOINs cost rank 0 a parse each (attack review round 3)."""
    from zcollective._format import _bodies

    coord = joined(2)
    parsed = []
    parse = _bodies.parse_join
    monkeypatch.setattr(_bodies, "parse_join", lambda msg: parsed.append(1) or parse(msg))
    assert [m.kind for _, m in feed(coord, b"flood", join_msg(1, 2))] == [Kind.REJECT]
    for _ in range(100):
        assert feed(coord, b"flood", join_msg(1, 2)) == []
    assert len(parsed) == 1 and coord.phase is Phase.RUNNING


def test_with_a_secret_a_join_must_echo_a_fresh_challenge_so_old_joins_claim_nothing():
    from zcollective._format._wire import Signer

    signer = Signer(b"0123456789abcdef-secret")

    def send(coord, who, msg):
        return [(p, decode(encode(m, signer), signer=signer)) for p, m in
                coord.receive(who, encode(msg, signer), address="10.0.0.9")]

    def join(rank, challenge=None):
        body = {"rank": rank, "num_replicas": 2, "python": PYTHON_VERSION, "ops": SPOKEN,
                "protocol": PROTOCOL_VERSION,
                "pid": 1, "host": "h", "nonce": "ab" * 16}
        if challenge is not None:
            body["challenge"] = challenge
        return control(Kind.JOIN, body, rank=rank)

    coord = Coordinator(2, SESSION, 1000, signer)
    for r in range(2):
        [(_, challenge)] = send(coord, peer(r), join(r))
        assert challenge.kind is Kind.CHALLENGE and challenge.rank == r
        assert challenge.session == int("ab" * 8, 16)  # bound to that JOIN's nonce
        answer = join(r, challenge.body()["challenge"])
        out = send(coord, peer(r), answer)
    assert coord.phase is Phase.RUNNING and {m.kind for _, m in out} == {Kind.WELCOME}
    # a later group with the same secret: the captured JOIN, challenge and all, claims nothing
    later = Coordinator(2, SESSION + 1, 1000, signer)
    [(_, fresh)] = send(later, peer(1), answer)
    assert fresh.kind is Kind.CHALLENGE and fresh.body()["challenge"] != answer.body()["challenge"]
    assert later.by_rank == {}
    # nor can it be used twice here, nor answered for another peer
    assert [m.kind for _, m in send(coord, b"other", answer)] == [Kind.REJECT]


# -- rule 6: a JOIN of another job refuses that peer alone ---------------------------------


def job_join(rank, n, job, **fields):
    """A JOIN naming ``job`` (None: naming none), with other body ``fields`` (lineage, newcomer)."""
    body = {**join_msg(rank, n).body(), **fields}
    if job is not None:
        body["job"] = job
    return control(Kind.JOIN, body, rank=rank)


def refusal(out):
    """The one REJECT in ``out``: its recipient, error name and message."""
    [(who, msg)] = out
    assert msg.kind is Kind.REJECT
    return who, msg.body()["error"], msg.body()["message"]


def test_a_join_of_another_job_refuses_that_peer_alone_naming_both_jobs_and_the_right_rank_joins():
    coord = Coordinator(2, SESSION, 1000, job="job-a")
    assert feed(coord, peer(0), job_join(0, 2, "job-a")) == []
    who, error, message = refusal(feed(coord, b"job-b's rank 1", job_join(1, 2, "job-b")))
    assert (who, error) == (b"job-b's rank 1", "JobMismatchError")
    assert message == ("rank 1 (pid 101 on h) is of job 'job-b', but the group at this address is of "
                       "job 'job-a': two jobs on one master address and port? give each its own port "
                       "(or, if it is of this job, set ZCOLLECTIVE_JOB='job-a' on it)")
    assert coord.phase is Phase.JOINING and coord.missing_joins() == [1]  # nobody failed
    status = feed(coord, peer(0), Message(Kind.STATUS, rank=0, seq=0))[0][1].body()
    assert status["refused"] == {"1": message}  # rank 0's join timeout would say why
    out = feed(coord, peer(1), job_join(1, 2, "job-a"))  # the right rank 1 still joins
    assert coord.phase is Phase.RUNNING and {m.kind for _, m in out} == {Kind.WELCOME}


@pytest.mark.parametrize("ours, theirs, said", [
    ("job-a", None, "rank 1 (pid 101 on h) names no job, but the group at this address is of job "
                    "'job-a': two jobs on one master address and port? give each its own port (or, "
                    "if it is of this job, set ZCOLLECTIVE_JOB='job-a' on it)"),
    (None, "job-b", "rank 1 (pid 101 on h) is of job 'job-b', but the group at this address names no "
                    "job: two jobs on one master address and port? give each its own port (or, if it "
                    "is of this job, give every replica the same ZCOLLECTIVE_JOB)"),
])
def test_a_job_named_on_one_side_only_is_another_job(ours, theirs, said):
    coord = Coordinator(2, SESSION, 1000, job=ours)
    feed(coord, peer(0), job_join(0, 2, ours))
    assert refusal(feed(coord, b"other", job_join(1, 2, theirs))) == (b"other", "JobMismatchError", said)
    assert coord.phase is Phase.JOINING


def test_once_running_another_jobs_join_is_told_so_and_changes_nothing():
    coord = Coordinator(2, SESSION, 1000, job="Slurm job 4242")
    for r in range(2):
        feed(coord, peer(r), job_join(r, 2, "Slurm job 4242"))
    _, error, message = refusal(feed(coord, b"late", job_join(1, 2, "Slurm job 14242")))
    assert error == "JobMismatchError" and "is of job 'Slurm job 14242'" in message
    assert coord.phase is Phase.RUNNING and coord.refused == {}  # (a running group reports none)
    _, error, _ = refusal(feed(coord, b"restarted", job_join(1, 2, "Slurm job 4242")))
    assert error == "LateJoinError"  # its own job's, late: as before


def test_a_newcomer_of_another_job_is_refused_not_parked():
    coord = Coordinator(2, SESSION, 1000, job="job-a")
    for r in range(2):
        feed(coord, peer(r), job_join(r, 2, "job-a"))
    _, error, message = refusal(feed(coord, b"N1", job_join(0, 1, "job-b", newcomer=True)))
    assert error == "JobMismatchError"
    assert message.startswith("a newcomer (pid 100 on h) is of job 'job-b', but the group at this "
                              "address is of job 'job-a'")
    assert feed(coord, b"N2", job_join(0, 1, "job-a", newcomer=True)) == []  # its own: parked
    assert list(coord.newcomers) == [b"N2"]


def test_survivors_forming_a_group_must_be_of_its_job():
    from zcollective._protocol._coordinator import Forming
    coord = Coordinator(3, SESSION, 1000, forming=Forming("ab12", frozenset({0, 1}), 3), job="job-a")
    feed(coord, peer(0), job_join(0, 3, "job-a", lineage="ab12"))
    _, error, _ = refusal(feed(coord, b"other", job_join(1, 3, "job-b", lineage="ab12")))
    assert error == "JobMismatchError" and coord.phase is Phase.JOINING
    feed(coord, peer(1), job_join(1, 3, "job-a", lineage="ab12"))
    assert coord.phase is Phase.RUNNING and coord.old_ranks == [0, 1]


def test_a_value_rank_0_cannot_unpickle_is_a_serialization_error_naming_its_sender():
    coord = joined(3)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a + b))
    feed(coord, peer(1), contrib(1, 0, segments=[[b"\x80\x05not a pickle"]]))
    out = feed(coord, peer(2), contrib(2, 0, value=2))
    body = out[0][1].body()
    assert out[0][1].kind is Kind.ERROR and body["error"] == "SerializationError"
    assert body["message"].startswith("seq 0 allreduce: the coordinator (rank 0) cannot deserialize "
                                      "the value of rank 1: ")
    assert coord.phase is Phase.RUNNING  # the group goes on


def test_probe_rounds_go_at_once_then_at_doubling_gaps_until_the_span_ends_and_a_flood_is_coalesced():
    from zcollective._protocol._coordinator import (
        PROBE_FLOOD_GAP_S,
        PROBE_GAP_S,
        PROBE_MAX_GAP_S,
        PROBE_SPAN_S,
        ProbeSchedule,
    )

    schedule = ProbeSchedule()
    assert schedule.due is None and schedule.limit(None, 0.0) is None and schedule.limit(3.0, 0.0) == 3.0
    schedule.closed(10.0)
    assert schedule.due == 10.0  # a round at once
    now, gaps = 10.0, []
    while schedule.due is not None:
        now = schedule.due
        schedule.went(now, probed=True)
        if schedule.due is not None:
            gaps.append(round(schedule.due - now, 6))
    assert gaps[:3] == [PROBE_GAP_S, 2 * PROBE_GAP_S, 4 * PROBE_GAP_S]
    assert max(gaps) == PROBE_MAX_GAP_S and 10.0 + PROBE_SPAN_S <= now < 10.0 + PROBE_SPAN_S + PROBE_MAX_GAP_S
    schedule.closed(20.0)
    schedule.went(20.0, probed=False)  # nobody to probe: the schedule ends at once
    assert schedule.due is None
    schedule.closed(30.0)
    schedule.went(30.0, probed=True)
    for k in range(1, 200):  # a flood of closes: at most a round per flood gap
        schedule.closed(30.0 + k * 1e-4)
    assert schedule.due is not None and schedule.due <= 30.0 + PROBE_FLOOD_GAP_S
    assert schedule.limit(5.0, 30.0) == schedule.due - 30.0  # a poll does not sleep past a round


def test_every_operation_has_a_row_of_rules_and_one_without_fails_its_call_not_the_group():
    from zcollective._protocol._ops import OPERATIONS

    assert set(OPERATIONS) == set(Op) - {Op.NONE}
    coord = joined(2)
    feed(coord, peer(0), contrib(0, 0, op=Op.NONE))
    out = results(feed(coord, peer(1), contrib(1, 0, op=Op.NONE)))
    assert {m.kind for m in out.values()} == {Kind.ERROR}
    assert all("has no rules" in m.body()["message"] for m in out.values())
    feed(coord, peer(0), contrib(0, 1, value=1, fn=lambda a, b: a + b))  # the group goes on
    out = results(feed(coord, peer(1), contrib(1, 1, value=2)))
    assert [_serialize.loads(m.segments[0]) for m in out.values()] == [3, 3]


def test_an_operation_code_nobody_knows_fails_the_group_naming_the_member():
    """The wire carries any op byte; which operations exist is the rules'. A member that
    sends a code no operation has (another release, or altered) cannot pair its calls again
    (its seq was used): the group fails naming it, rather than dropping its calls for ever."""
    coord = joined(2)
    out = feed(coord, peer(0), contrib(0, 0, op=77))
    assert coord.phase is Phase.FAILED and {m.kind for _, m in out} == {Kind.FAIL}
    body = out[0][1].body()
    assert body["error"] == "ProtocolError"
    assert "sent seq 0 with operation code 77, which no operation has here" in body["message"]


def test_arrays_an_elementwise_reduction_cannot_combine_are_a_mismatch_on_the_star_too():
    """np.ones(1) + np.ones(3) broadcasts: the star returned [3, 3, 3] where the data plane,
    torch and MPI refuse; a reduce function of the user's own may still combine anything."""
    np = pytest.importorskip("numpy")
    import operator

    coord = joined(3)
    for r, value in enumerate([np.ones(3), np.ones(1), np.ones(3)]):
        out = results(feed(coord, peer(r), contrib(r, 0, value=value, fn=operator.add if r == 0 else None,
                                                   site=f"train.py:{40 + r}")))
    assert {m.kind for m in out.values()} == {Kind.ERROR}
    body = out[peer(1)].body()
    assert body["error"] == "CallMismatchError"
    assert body["message"] == (
        "seq 0 allreduce: the ranks disagree: rank 0 passed a <f8 array of shape (3,) reduced with add at "
        "train.py:40; rank 1 passed a <f8 array of shape (1,) reduced with add at train.py:41; rank 2 "
        "passed a <f8 array of shape (3,) reduced with add at train.py:42 (this call failed; the group "
        "goes on)")
    for r, value in enumerate([np.ones(2, "f4"), np.ones(2, "f8"), np.ones(2, "f4")]):  # dtypes too
        out = results(feed(coord, peer(r), contrib(r, 1, value=value, fn=operator.add if r == 0 else None)))
    assert "rank 1 passed a <f8 array of shape (2,)" in out[peer(0)].body()["message"]
    def concatenate(a, b):  # the user's own: combining anything is its business
        return np.concatenate([a, b])

    for r, value in enumerate([np.ones(1), np.ones(2), np.ones(3)]):
        out = results(feed(coord, peer(r), contrib(r, 2, value=value, fn=concatenate if r == 0 else None)))
    assert [len(_serialize.loads(m.segments[0])) for m in out.values()] == [6, 6, 6]


def test_a_call_one_rank_gave_up_fails_alike_on_every_rank_and_the_group_goes_on():
    """Issue 26: rank 2 came 4 s late to an allreduce with timeout=2: ranks 0 and 1 raised
    CollectiveTimeoutError and rank 2 got 3. A rank that gives up a call now fails it for all."""
    from zcollective._format import _bodies

    coord = joined(3)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=lambda a, b: a + b))
    feed(coord, peer(1), contrib(1, 0, value=2))
    gave_up = _bodies.abandon("its call timed out (timed out after 2 s)", True, rank=1, seq=0,
                              session=SESSION)
    out = results(feed(coord, peer(1), gave_up))
    assert set(out) == {peer(0), peer(1)} and {m.kind for m in out.values()} == {Kind.ERROR}
    said = out[peer(0)].body()
    assert said["error"] == "CollectiveTimeoutError"
    assert said["message"].startswith("seq 0 allreduce: rank 1 (pid 101 on h) gave it up (its call timed out")
    assert said["message"].endswith("so it failed on every rank (the group goes on)")
    assert feed(coord, peer(0), gave_up) == []  # given up once: nothing more to say
    late = results(feed(coord, peer(2), contrib(2, 0, value=3)))  # the late rank hears the same
    assert list(late) == [peer(2)] and late[peer(2)].body() == said
    assert 0 not in coord.pending
    for r in range(3):  # the group goes on
        fn = (lambda a, b: a + b) if r == 0 else None
        out = results(feed(coord, peer(r), contrib(r, 1, value=r + 1, fn=fn)))
    assert [_serialize.loads(m.segments[0]) for m in out.values()] == [6, 6, 6]
    done = _bodies.abandon("its call was interrupted (KeyboardInterrupt)", False, rank=0, seq=1,
                           session=SESSION)
    assert feed(coord, peer(0), done) == []  # complete already: every rank has its result


def test_a_call_given_up_while_its_data_moves_peer_to_peer_fails_on_every_rank():
    from zcollective._format import _bodies
    from zcollective._format._wire import FLAG_DATA

    coord = joined(3)
    plan = _bodies.plan(dtype="<f4", shape=[1 << 16], fn="add")
    for r in range(3):
        msg = contrib(r, 0, segments=[[plan]], fn=(lambda a, b: a + b) if r == 0 else None)
        msg.flags |= FLAG_DATA
        out = results(feed(coord, peer(r), msg))
    assert {m.kind for m in out.values()} == {Kind.RESULT}  # the plan: the data moves now
    gave_up = _bodies.abandon("its call timed out (…)", True, rank=1, seq=0, session=SESSION)
    out = results(feed(coord, peer(1), gave_up))
    assert set(out) == {peer(0), peer(1), peer(2)} and {m.kind for m in out.values()} == {Kind.ERROR}
    assert "while its data moved peer to peer, so it failed on every rank that had not finished it" in (
        out[peer(0)].body()["message"])


# -- rule 9: a group formed from an earlier one ------------------------------------


def form_join(rank, n, lineage="ab12"):
    msg = join_msg(rank, n)
    body = msg.body()
    body["lineage"] = lineage
    return control(Kind.JOIN, body, rank=rank)


def test_survivors_form_a_group_ranked_densely_in_old_rank_order():
    from zcollective._protocol._coordinator import Forming
    coord = Coordinator(4, SESSION, 1000, forming=Forming("ab12", frozenset({1, 2, 3}), 4),
                        host_address="10.0.0.1")
    assert feed(coord, peer(3), form_join(3, 4)) == []
    assert feed(coord, peer(1), form_join(1, 4)) == []
    assert coord.missing_joins() == [2]
    out = results(feed(coord, peer(2), form_join(2, 4)))
    assert coord.phase is Phase.RUNNING and coord.num_replicas == 3 and coord.old_ranks == [1, 2, 3]
    for old, new in ((1, 0), (2, 1), (3, 2)):
        welcome = out[peer(old)]
        assert welcome.kind is Kind.WELCOME and welcome.rank == old  # bound to the rank its JOIN claimed
        assert welcome.body()["renumber"] == {"rank": new, "old": [1, 2, 3]}
        assert welcome.body()["addresses"] == ["10.0.0.1", "10.0.0.9", "10.0.0.9"]
    # the new ranks from now on: a call of the three completes
    assert feed(coord, peer(1), contrib(0, 0, value=1)) == []
    assert feed(coord, peer(2), contrib(1, 0, value=2)) == []
    assert {m.rank for _, m in feed(coord, peer(3), contrib(2, 0, value=3))} == {0, 1, 2}


def test_at_the_bound_the_host_forms_with_those_that_came_and_the_late_are_left_out():
    from zcollective._protocol._coordinator import Forming
    coord = Coordinator(4, SESSION, 1000, forming=Forming("ab12", frozenset({0, 2, 3}), 4,
                                                          dead=frozenset({1})))
    assert coord.form_now() == []  # not before the host's own member came
    feed(coord, peer(0), form_join(0, 4))
    feed(coord, peer(3), form_join(3, 4))
    out = results(decode(encode(m)) and (p, decode(encode(m))) for p, m in coord.form_now())
    assert set(out) == {peer(0), peer(3)} and coord.num_replicas == 2 and coord.old_ranks == [0, 3]
    late = feed(coord, peer(2), form_join(2, 4))
    assert [(p, m.kind, m.body()["error"]) for p, m in late] == [(peer(2), Kind.REJECT, "LeftOutError")]
    assert "left out" in late[0][1].body()["message"]
    counted_lost = feed(coord, peer(1), form_join(1, 4))  # a rank the host expected no more
    assert counted_lost[0][1].body()["error"] == "LeftOutError"
    assert coord.phase is Phase.RUNNING  # neither changed the group


def test_a_join_of_another_lineage_or_of_none_is_refused_while_forming():
    from zcollective._protocol._coordinator import Forming
    coord = Coordinator(3, SESSION, 1000, forming=Forming("ab12", frozenset({0, 1, 2}), 3))
    for who, msg in ((peer(1), form_join(1, 3, lineage="ffff")), (peer(7), join_msg(1, 3))):
        out = feed(coord, who, msg)
        assert [(m.kind, m.body()["error"]) for _, m in out] == [(Kind.REJECT, "LateJoinError")]
    assert coord.phase is Phase.JOINING and coord.missing_joins() == [0, 1, 2]
    plain = Coordinator(2, SESSION, 1000)  # a group that is not forming refuses a lineage
    out = feed(plain, peer(1), form_join(1, 2))
    assert [(m.kind, m.body()["error"]) for _, m in out] == [(Kind.REJECT, "LateJoinError")]


def test_a_group_tells_its_own_members_forming_the_next_one_that_it_is_not_forming():
    coord = joined(3)
    coord.lost(2, "test")  # failed: the survivors shrink; one reaches this old one first
    out = feed(coord, b"early", form_join(1, 3, lineage=f"{SESSION:x}"))
    # not this group's failure: its host is alive (its program elsewhere), and may form soon
    assert [(m.kind, m.body()["error"]) for _, m in out] == [(Kind.REJECT, "NotFormingHere")]
    stranger = feed(coord, b"other", form_join(1, 3, lineage="ffff"))
    assert [m.kind for _, m in stranger] == [Kind.REJECT]


def test_a_partitions_smaller_side_is_left_out_and_told_so():
    from zcollective._protocol._coordinator import Forming
    coord = Coordinator(4, SESSION, 1000, forming=Forming("ab12", frozenset({0, 1}), 4))
    feed(coord, peer(0), form_join(0, 4))
    out = feed(coord, peer(1), form_join(1, 4))  # every rank it expected: 2 of 4, no majority
    assert sorted((p, m.kind, m.body()["error"]) for p, m in out) == [
        (peer(0), Kind.REJECT, "LeftOutError"), (peer(1), Kind.REJECT, "LeftOutError")]
    assert "fewer than half" in out[0][1].body()["message"] and coord.phase is Phase.FAILED
    again = feed(coord, peer(2), form_join(2, 4))  # later: the same answer
    assert again[0][1].body()["error"] == "LeftOutError"


@pytest.mark.parametrize("dead, majority, forms", [
    (frozenset(), True, False), (frozenset({2, 3}), True, True), (frozenset({3}), True, True),
    (frozenset(), False, True)])
def test_a_side_forms_with_more_than_half_of_those_not_seen_to_die(dead, majority, forms):
    from zcollective._protocol._coordinator import Forming
    coord = Coordinator(4, SESSION, 1000, forming=Forming("ab12", frozenset({0, 1}), 4, dead, majority))
    feed(coord, peer(0), form_join(0, 4))
    out = feed(coord, peer(1), form_join(1, 4))
    assert {m.kind for _, m in out} == ({Kind.WELCOME} if forms else {Kind.REJECT})


def test_a_connection_gone_soon_after_a_message_was_seen_to_die_and_a_silent_one_not():
    coord = Coordinator(3, SESSION, max_frames=1000, liveness_s=10.0)
    for r in range(3):
        feed(coord, peer(r), join_msg(r, 3))
    coord.by_rank[2].heard -= 60  # silent for a minute: heartbeats, or a partition, closed it
    silent = [m.body() for _, m in coord.lost(2, "test")]
    assert silent and all(b["lost"] == [2] and b["dead"] == [] for b in silent)
    coord = Coordinator(3, SESSION, max_frames=1000, liveness_s=10.0)
    for r in range(3):
        feed(coord, peer(r), join_msg(r, 3))  # its JOIN just came: a close now is a death
    died = [m.body() for _, m in coord.lost(1, "test")]
    assert died and all(b["dead"] == [1] for b in died)



def test_stall_warnings_follow_the_coordinators_clock_at_the_bound_then_twice_it():
    clock = FakeClock()
    coord = Coordinator(3, SESSION, 1000, warn_after=10.0, clock=clock)
    assert coord.next_stall() == 1010.0  # the join is timed from the coordinator's start
    for r in range(3):
        feed(coord, peer(r), join_msg(r, 3))
    clock.now = 2000.0
    feed(coord, peer(0), contrib(0, 0, value=1, site="train.py:7"))
    clock.now = 2003.0
    feed(coord, peer(2), contrib(2, 0, value=1))
    assert coord.next_stall() == 2010.0  # the bound after the first rank came, not the last
    assert coord.stalls(2009.9) == []
    clock.now = 2010.0
    [(line, ranks)] = coord.stalls(clock())
    assert ranks == [1]
    assert "seq 0 allreduce at train.py:7 has waited 10 s for rank 1 (arrived: 0,2)" in line
    assert coord.next_stall() == 2020.0  # then at twice the bound
    assert coord.stalls(2019.0) == []
    assert len(coord.stalls(2020.0)) == 1 and coord.next_stall() == 2040.0


def test_a_coordinator_times_a_loss_with_its_clock():
    clock = FakeClock()
    coord = Coordinator(2, SESSION, 1000, liveness_s=10.0, clock=clock)
    for r in range(2):
        feed(coord, peer(r), join_msg(r, 2))
    clock.now += 4.9  # within half the liveness bound of its JOIN: it died
    assert all(m.body()["dead"] == [1] for _, m in coord.lost(1, "test"))
    assert coord.failed_at == clock.now
    coord = Coordinator(2, SESSION, 1000, liveness_s=10.0, clock=clock)
    for r in range(2):
        feed(coord, peer(r), join_msg(r, 2))
    clock.now += 5.1  # silent past it: heartbeats gave up, or a partition
    assert all(m.body()["dead"] == [] for _, m in coord.lost(1, "test"))


def test_a_coordinators_keys_come_from_its_entropy():
    coord = Coordinator(2, SESSION, 1000, entropy=lambda n: b"\x07" * n)
    assert coord._data_key == "07" * len(bytes.fromhex(coord._data_key))
    assert coord._challenge_key == b"\x07" * 32


# -- rule 10: newcomers --------------------------------------------------------------


def newcomer_join(rank=0):
    msg = join_msg(rank, 1)
    body = msg.body()
    body.update(newcomer=True, nonce="ab" * 16)
    return control(Kind.JOIN, body, rank=rank)


def test_newcomers_are_parked_and_a_grow_admits_them_after_the_members_then_closes():
    coord = joined(3)
    assert feed(coord, b"N1", newcomer_join()) == []  # parked, not refused
    assert feed(coord, b"N2", newcomer_join(5)) == []
    assert feed(coord, b"N3", newcomer_join()) == []
    coord.gone(b"N3")  # a newcomer that left is not admitted
    for r in range(2):
        assert feed(coord, peer(r), contrib(r, 0, op=Op.GROW, segments=[])) == []
    out = feed(coord, peer(2), contrib(2, 0, op=Op.GROW, segments=[]))
    told = [m for p, m in out if p in {peer(0), peer(1), peer(2)}]
    assert [(m.kind, _serialize.loads(m.segments[0])) for m in told] == [(Kind.RESULT, 2)] * 3
    admitted = {p: m.body()["admitted"] for p, m in out if m.kind is Kind.WELCOME}
    assert admitted == {b"N1": {"rank": 3, "size": 5, "lineage": f"{SESSION:x}"},
                        b"N2": {"rank": 4, "size": 5, "lineage": f"{SESSION:x}"}}
    assert {m.rank for p, m in out if m.kind is Kind.WELCOME} == {0, 5}  # bound to each one's JOIN
    assert coord.phase is Phase.CLOSED  # members and newcomers form the next group


def test_a_newcomer_of_another_release_is_refused_alone_and_the_group_goes_on():
    """Found by an attack: a newcomer knowing other operations was parked, admitted at the
    next grow, and its JOIN to the group formed next failed that whole group."""
    coord = joined(2)
    body = newcomer_join().body()
    body["ops"] = "allreduce,broadcast"
    _, error, message = refusal(feed(coord, b"N1", control(Kind.JOIN, body, rank=0)))
    assert error == "ProtocolError" and "knows the operations allreduce,broadcast" in message
    assert not coord.newcomers and coord.phase is Phase.RUNNING


def test_a_grow_with_nobody_waiting_changes_nothing_and_an_ending_group_dismisses_newcomers():
    coord = joined(2)
    for r in range(2):
        out = feed(coord, peer(r), contrib(r, 0, op=Op.GROW, segments=[]))
    assert [_serialize.loads(m.segments[0]) for _, m in out] == [0, 0] and coord.phase is Phase.RUNNING
    feed(coord, b"N1", newcomer_join())
    out = [(p, decode(encode(m))) for p, m in coord.dismiss_newcomers()]
    assert [(p, m.kind, m.body()["error"]) for p, m in out] == [(b"N1", Kind.REJECT, "LateJoinError")]
    assert "ended before a grow() admitted it" in out[0][1].body()["message"]


def test_parked_newcomers_are_probed_so_one_that_died_or_gave_up_is_dropped():
    coord = joined(3)
    feed(coord, b"N1", newcomer_join())
    feed(coord, b"N2", newcomer_join(5))
    probed = {p: m for p, m in coord.probes() if p in (b"N1", b"N2")}
    assert {p: (m.kind, m.rank) for p, m in probed.items()} == {b"N1": (Kind.PROBE, 0),
                                                                 b"N2": (Kind.PROBE, 5)}
    assert all(m.session == join_token("ab" * 16) for m in probed.values())  # bound to its JOIN
    coord.gone(b"N1")  # the driver's probe could not be sent: its connection is gone
    for r in range(3):
        out = feed(coord, peer(r), contrib(r, 0, op=Op.GROW, segments=[]))
    assert _serialize.loads(out[0][1].segments[0]) == 1  # only the living one is counted


# -- a reduction is asked for, run by the driver, handed back (issue 33) --------------------------


def asked_for(coord, n, op=Op.ALLREDUCE, fn=lambda a, b: a + b, root=0, seq=0):
    """Every rank contributes rank + 1 to ``seq`` (reduce_scatter: n values each); the last
    one's step is the coordinator's :class:`Combine`, not yet run."""
    for r in range(n):
        values = [r + 1] * n if op is Op.REDUCE_SCATTER else [r + 1]
        step = coord.receive(peer(r), encode(contrib(r, seq, op, fn=fn if r == root else None, root=root,
                                                     segments=[_serialize.dumps(v) for v in values])))
    return step


def test_the_coordinator_asks_for_the_reduction_and_sends_the_results_once_handed_back():
    coord = joined(3)
    step = asked_for(coord, 3)
    assert len(step) == 1 and isinstance(step[0], Combine)  # nothing ran: no value was unpickled
    asked = step[0]
    assert (asked.seq, asked.op, asked.root, asked.count, len(asked.values)) == (0, Op.ALLREDUCE, 0, 1, 3)
    assert coord.reducing is not None and coord.reducing[:2] == (0, Op.ALLREDUCE)  # stall reports say so
    results = run(asked, coord.user_code)  # as the driver runs it: each index's result, pickled
    out = coord.combined(asked, results)
    assert coord.reducing is None
    assert [(p, m.kind, _serialize.loads(m.segments[0])) for p, m in out] == [
        (peer(r), Kind.RESULT, 6) for r in range(3)]
    assert out[0][1].segments is out[2][1].segments  # one payload, hashed once
    assert coord.combined(asked, results) == []  # handed back twice: the call is no longer waiting


def test_a_reduce_scatter_asks_for_every_index_and_a_reduce_answers_its_root_alone():
    coord = joined(3)
    asked = asked_for(coord, 3, Op.REDUCE_SCATTER)[0]
    assert asked.count == 3 and [_serialize.loads(r) for r in run(asked, coord.user_code)] == [6, 6, 6]
    out = coord.combined(asked, [_serialize.dumps(v) for v in "abc"])
    assert [_serialize.loads(m.segments[0]) for _, m in out] == ["a", "b", "c"]
    asked = asked_for(coord, 3, Op.REDUCE, root=2, seq=1)[0]
    assert (asked.seq, asked.root) == (1, 2)
    out = coord.combined(asked, [_serialize.dumps(7)])
    assert [len(m.segments) for _, m in out] == [0, 0, 1] and _serialize.loads(out[2][1].segments[0]) == 7


@pytest.mark.parametrize("exc, error, text", [
    (ZeroDivisionError("boom"), "RemoteError",
     "seq 0 allreduce: the reduction raised on the coordinator (rank 0): ZeroDivisionError: boom"),
    (Unreadable("cannot deserialize the value of rank 1: bad"), "SerializationError",
     "seq 0 allreduce: the coordinator (rank 0) cannot deserialize the value of rank 1: bad"),
    (Disagree(["a", "a", "b"]), "CallMismatchError",
     "seq 0 allreduce: the ranks disagree: ranks 0,1 passed a at t.py:1; rank 2 passed b at t.py:1 "
     "(this call failed; the group goes on)"),
])
def test_a_reduction_that_failed_is_an_error_for_every_rank_and_the_group_goes_on(exc, error, text):
    coord = joined(3)
    asked = asked_for(coord, 3)[0]
    out = coord.combine_failed(asked, exc)
    assert [p for p, _ in out] == [peer(r) for r in range(3)]
    assert all(m.kind is Kind.ERROR and m.body()["error"] == error and m.body()["message"] == text
               for _, m in out), [m.body() for _, m in out]
    assert coord.phase is Phase.RUNNING and coord.reducing is None and coord.interrupted is None


def test_a_signal_in_the_reduce_function_tells_every_rank_then_is_raised_on_rank_0():
    from zcollective.errors import SIGNAL_ATTR
    coord = joined(2)

    def interrupted(a, b):
        exc = KeyboardInterrupt()
        setattr(exc, SIGNAL_ATTR, 2)  # as a wrapped signal handler marks it
        raise exc
    step = asked_for(coord, 2, fn=interrupted)
    out = list(applied(step, coord))  # as a driver: run where it stands, the ERRORs in its place
    assert [m.body()["remote_type"] for _, m in out] == ["KeyboardInterrupt"] * 2
    assert isinstance(coord.interrupted, KeyboardInterrupt)  # the driver raises it once they are sent


def test_a_reduction_handed_back_after_a_loss_sends_nothing():
    coord = joined(3)
    asked = asked_for(coord, 3)[0]
    told = coord.gone(peer(2))  # (a pure test can interleave; a driver runs the reduction first)
    assert [m.kind for _, m in told] == [Kind.FAIL, Kind.FAIL] and coord.phase is Phase.FAILED
    assert coord.combined(asked, run(asked, coord.user_code)) == [] and coord.reducing is None
    assert coord.combine_failed(asked, ZeroDivisionError()) == []


def test_a_result_that_does_not_pickle_is_the_reductions_error_on_every_rank():
    coord = joined(2)
    step = asked_for(coord, 2, fn=lambda a, b: __import__("threading").Lock())
    out = list(applied(step, coord))  # pickling the result is the driver's part too (user code may run)
    assert [m.body()["error"] for _, m in out] == ["RemoteError"] * 2
    assert out[0][1].body()["message"].startswith("seq 0 allreduce: the reduction raised on the coordinator")


def test_a_rank_that_sends_no_more_is_announced_to_every_other_running_rank_with_its_count():
    """Rule 12: FINAL goes on, with how many messages the rank sent each one; the group goes on."""
    from zcollective._format import _bodies

    coord = joined(4)
    assert feed(coord, peer(3), Message(Kind.BYE, rank=3, seq=0, session=SESSION))  # rank 3 ended before
    out = feed(coord, peer(1), _bodies.final([5, 0, 7, 2], True, rank=1, session=SESSION))
    told = {p: (m.kind, m.rank, m.root, m.seq, _bodies.parse_ended(m)) for p, m in out}
    who = "rank 1 called teardown (pid 101 on h)"
    assert told == {peer(0): (Kind.FINAL, 0, 1, 5, who), peer(2): (Kind.FINAL, 2, 1, 7, who)}
    assert coord.phase is Phase.RUNNING
    bad = control(Kind.FINAL, {"sent": [1, 2]}, rank=2, session=SESSION)  # not one count per rank
    assert feed(coord, peer(2), bad) == [] and coord.phase is Phase.RUNNING
