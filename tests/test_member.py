"""A member's rules, and members with their coordinator over an in-memory link
(tests/pair.py): no sockets, no processes, no threads. What a user reads
(errors, timeout texts) is asserted word for word here; tests with real
processes keep what needs them (kills, signals, heartbeats, the network)."""

import logging
import os
import socket

import pytest
from pair import ENDPOINT, SESSION, FakeClock, Pair, outcome

import zcollective as zc
from zcollective._format import _serialize
from zcollective._format._wire import (
    FLAG_DATA,
    FLAG_LAST,
    FLAG_LOCAL_ERROR,
    PROTOCOL_VERSION,
    Kind,
    Message,
    encode,
    error_note,
)
from zcollective._future import settle
from zcollective._limits import DATA_LOSS_GRACE_S, JOIN_RESEND_S
from zcollective._protocol._coordinator import PYTHON_VERSION, Phase
from zcollective._protocol._member import FOREIGN_PEER_S, FOREIGN_PEER_TRIES, Call, ConnectionEvent, Member
from zcollective._protocol._ops import Op

SECRET = b"0123456789abcdef-the-job-secret"
OTHER_SECRET = b"a-different-secret-of-enough-length"
WHO = f"(pid {os.getpid()} on {socket.gethostname()})"  # how a JOIN from this process is named


def add(a, b):
    return a + b


# -- joining ------------------------------------------------------------------------


def test_members_join_then_every_operation_resolves_their_futures():
    pair = Pair(3).joined()
    assert [outcome(f) for f in pair.call_all(Op.ALLREDUCE, [1, 2, 3], fn=add)] == [6, 6, 6]
    gathered = pair.call_all(Op.ALLGATHER, ["a", "b", "c"])
    assert [outcome(f) for f in gathered] == [["a", "b", "c"]] * 3
    scattered = [pair.call(0, Op.SCATTER, segments=[_serialize.dumps(v) for v in "xyz"]),
                 pair.call(1, Op.SCATTER), pair.call(2, Op.SCATTER)]
    assert [outcome(f) for f in scattered[1:]] == ["y", "z"]
    assert pair.coordinator.pending == {} and all(m.calls == {} for m in pair.members)


def test_the_rules_say_what_a_call_came_to_and_run_none_of_the_programs_code():
    """A RESULT taken in by the member queues an outcome: its value is unpickled and the
    future's done-callbacks run only when the call runner applies it (settle), never inside
    the rules (a callback that calls into the group there would find it halfway through)."""
    pair = Pair(2).joined()
    pair.hold(1, Kind.RESULT)
    futures = pair.call_all(Op.ALLREDUCE, [1, 2], fn=add)
    ran = []
    futures[1].add_done_callback(lambda f: ran.append(f.result(0)))
    member = pair.members[1]
    for frames in pair.held.pop((1, Kind.RESULT)):  # taken in by the member alone
        member.receive(frames)
    assert [o.future for o in member.outcomes] == [futures[1]] and member.calls == {}
    assert not ran and not futures[1]._done
    settle(member.outcomes)
    assert ran == [3] and not member.outcomes


def test_a_welcome_counts_only_if_it_echoes_a_join_of_this_member():
    member = Member(1, 2, ENDPOINT)
    member.join()
    forged = Message(Kind.WELCOME, rank=1, session=SESSION,
                     segments=[[b'{"num_replicas":2,"nonce":"00ff00ff00ff00ff"}']])
    assert member.receive(encode(forged)) == []
    assert not member.joined


def test_a_member_whose_join_was_lost_with_its_connection_joins_again():
    pair = Pair(2)
    pair.join(0)
    pair.members[1].join()  # the JOIN goes down with the connection: the coordinator never sees it
    pair.connection(1, ConnectionEvent.DISCONNECTED)
    assert pair.failure(1) is None and not pair.members[1].joined
    pair.connection(1, ConnectionEvent.HANDSHAKE_SUCCEEDED)  # reconnected: the member joins again
    assert [m.joined for m in pair.members] == [True, True]
    assert len(pair.sent("up", Kind.JOIN, rank=1)) == 1
    pair.connection(1, ConnectionEvent.HANDSHAKE_SUCCEEDED)  # joined: a later handshake sends nothing
    assert len(pair.sent("up", Kind.JOIN, rank=1)) == 1


def test_a_join_that_arrives_late_after_a_reconnect_is_welcomed_again_harmlessly():
    pair = Pair(2)
    pair.join(0)
    first = pair.members[1].join()
    pair.connection(1, ConnectionEvent.DISCONNECTED)
    pair.connection(1, ConnectionEvent.HANDSHAKE_SUCCEEDED)
    pair.post(1, first)  # the first JOIN was only delayed
    assert [m.joined for m in pair.members] == [True, True]
    assert [outcome(f) for f in pair.call_all(Op.ALLREDUCE, [1, 2], fn=add)] == [3, 3]


def test_losing_the_coordinator_after_the_welcome_fails_the_group_naming_calls_in_flight():
    pair = Pair(2).joined()
    future = pair.call(1, Op.ALLREDUCE, 1)
    pair.connection(1, ConnectionEvent.DISCONNECTED)
    error = outcome(future)
    assert isinstance(error, zc.ReplicaLostError)
    assert str(error) == (f"rank 1 lost the coordinator (rank 0) at {ENDPOINT}: connection closed or "
                          f"heartbeats unanswered; in flight: seq 0 allreduce")


def test_a_late_join_is_refused_while_the_group_runs_on():
    pair = Pair(2).joined()
    pair.call_all(Op.ALLREDUCE, [1, 2], fn=add)
    late = Member(1, 2, ENDPOINT)  # a restarted replica, or another job on the same port
    out = pair.coordinator.receive(b"late", encode(late.join()), "10.0.0.99:1")
    [(_, reject)] = out
    late.receive(encode(reject))
    assert isinstance(late.failure, zc.LateJoinError)
    assert str(late.failure) == (f"rank 1 {WHO} tried to join the group at seq 1, but the group of "
                                 f"2 replicas has already started (another job on this port? give "
                                 f"each job its own)")
    assert [outcome(f) for f in pair.call_all(Op.ALLREDUCE, [1, 2], fn=add)] == [3, 3]


# -- refusals: versions, sizes, secrets ------------------------------------------------


def test_other_python_version_is_refused_on_both_sides():
    pair = Pair(2, installs={1: {"PYTHON_VERSION": "3.99"}})
    pair.join()
    text = (f"rank 1 {WHO} runs Python 3.99, the coordinator (rank 0) runs Python {PYTHON_VERSION}; "
            f"pickles are only compatible between identical Python versions")
    for rank in (0, 1):
        assert type(pair.failure(rank)) is zc.ProtocolError
        assert str(pair.failure(rank)) == text


def test_other_protocol_version_is_refused_on_both_sides():
    pair = Pair(2, installs={1: {"PROTOCOL_VERSION": 99}})
    pair.join()
    assert type(pair.failure(0)) is zc.ProtocolError
    assert str(pair.failure(0)) == (f"a replica at 10.0.0.11:50001 speaks zcollective protocol version 99, "
                                    f"the coordinator (rank 0) speaks {PROTOCOL_VERSION}: install the "
                                    f"same zcollective version on every host")
    assert type(pair.failure(1)) is zc.ProtocolError
    assert str(pair.failure(1)) == (f"rank 1: the coordinator at {ENDPOINT} speaks protocol version "
                                    f"{PROTOCOL_VERSION}, this replica speaks 99: install the same "
                                    f"zcollective everywhere")


def test_rank_claimed_twice_fails_clearly_everywhere():
    pair = Pair(3)
    pair.members[2] = Member(1, 3, ENDPOINT)  # a second process says it is rank 1
    pair.join()
    for rank in range(3):
        assert type(pair.failure(rank)) is ValueError
        assert str(pair.failure(rank)) == f"rank 1 was claimed twice: by rank 1 {WHO} and by {WHO[1:-1]}"


@pytest.mark.parametrize("member_secret, why", [
    (OTHER_SECRET, f"a reply of the coordinator at {ENDPOINT} failed authentication (authentication "
                   f"tag does not match): rank 0 has a different secret; set the same "
                   f"ZCOLLECTIVE_SECRET everywhere"),
    (None, "the coordinator (rank 0) refused this replica: its messages do not carry the job's "
           "secret (set the same ZCOLLECTIVE_SECRET everywhere)"),
])
def test_member_without_the_right_secret_gets_authentication_error(member_secret, why):
    pair = Pair(2, secret=SECRET, secrets={1: member_secret})
    pair.join()
    error = pair.failure(1)
    assert type(error) is zc.AuthenticationError
    assert str(error) == why if member_secret is None else str(error) == f"rank 1: {why}"
    # rank 0 is not failed: it says who never joined when its join times out
    assert pair.failure(0) is None and not pair.members[0].joined
    status = pair.status(0, 0)
    assert pair.members[0].join_timeout_message(4, status) == (
        f"rank 0 timed out after 4 s joining the group at {ENDPOINT}: connected, but ranks 1 had not joined")


def test_member_with_a_secret_refuses_a_coordinator_without_one():
    pair = Pair(2, secrets={1: SECRET})
    pair.join()
    error = pair.failure(1)
    assert type(error) is zc.AuthenticationError
    assert str(error) == (f"rank 1: a reply of the coordinator at {ENDPOINT} failed authentication "
                          f"(message carries no authentication tag): rank 0 has no secret; set the "
                          f"same ZCOLLECTIVE_SECRET everywhere")
    assert pair.failure(0) is None
    status = pair.status(0, 0)
    assert pair.members[0].join_timeout_message(4, status) == (
        f"rank 0 timed out after 4 s joining the group at {ENDPOINT}: connected, but ranks 1 had not "
        f"joined (rank 1 was refused: rank 1 {WHO} uses a secret, but the coordinator (rank 0) has "
        f"none: set the same ZCOLLECTIVE_SECRET on every replica)")


def test_join_timeout_names_the_address_when_nothing_answered():
    member = Member(1, 2, ENDPOINT)
    assert member.join_timeout_message(1, None) == (
        f"rank 1 timed out after 1 s joining the group at {ENDPOINT}: could not reach the coordinator "
        f"(rank 0) at that address (is rank 0 running, with the same num_replicas (a rank 0 told "
        f"none, or 1, runs alone and listens on nothing), and is the address and port right?)")


def test_join_timeout_names_the_missing_ranks():
    pair = Pair(3)
    pair.join(0)
    assert pair.members[0].join_timeout_message(1, pair.status(0, 0)) == (
        f"rank 0 timed out after 1 s joining the group at {ENDPOINT}: connected, but ranks 1,2 had "
        f"not joined")


# -- calls ----------------------------------------------------------------------------


def test_call_mismatch_names_ranks_operations_and_call_sites_on_every_member():
    pair = Pair(3).joined()
    pair.call_all(Op.ALLREDUCE, [1, 1, 1], fn=add)
    futures = [pair.call(2, Op.ALLREDUCE, 2, site="train.py:10"),
               pair.call(0, Op.ALLREDUCE, 0, fn=add, site="train.py:10"),
               pair.call(1, Op.BROADCAST, 1, site="train.py:20")]
    text = "seq 1: ranks 0,2 called allreduce at train.py:10; rank 1 called broadcast(root=0) at train.py:20"
    for future in futures:
        error = outcome(future)
        assert type(error) is zc.CallMismatchError and str(error) == text


def test_call_mismatch_names_the_ranks_that_had_not_called_yet():
    pair = Pair(3).joined()
    first = pair.call(0, Op.ALLREDUCE, 0, fn=add, site="a.py:1")
    pair.call(1, Op.GATHER, 1, root=2, site="b.py:2")
    text = ("seq 0: rank 0 called allreduce at a.py:1; rank 1 called gather(root=2) at b.py:2; "
            "rank 2 had not called yet")
    assert str(outcome(first)) == text
    assert [str(pair.failure(r)) for r in range(3)] == [text] * 3  # rank 2 learns it too


def test_a_failed_group_is_sticky_every_later_call_raises_the_same_error():
    pair = Pair(2).joined()
    pair.call(0, Op.ALLREDUCE, 0, fn=add)
    pair.call(1, Op.BARRIER)
    first = pair.failure(1)
    assert isinstance(first, zc.CallMismatchError)
    for rank in (0, 1):
        with pytest.raises(zc.CallMismatchError) as again:
            pair.call(rank, Op.ALLREDUCE, 1)
        assert str(again.value) == str(first) and again.value is not first  # a fresh instance
    assert not pair.members[1].owed and pair.members[1].bye() is None


def test_a_reply_handled_twice_changes_nothing():
    pair = Pair(2).joined()
    pair.hold(1, Kind.RESULT)
    futures = pair.call_all(Op.ALLREDUCE, [1, 2], fn=add)
    [frames] = pair.release(1, Kind.RESULT)
    assert outcome(futures[1]) == 3
    assert pair.members[1].receive(frames) == []  # a driver interrupted while handling it hands it in again
    assert outcome(futures[1]) == 3 and pair.failure(1) is None


def test_a_contribution_sent_twice_is_dropped_and_later_calls_pair_correctly(caplog):
    """Rule 4: an interrupt after the send but before the owed part left the
    queue sends it again; the coordinator drops the copy (its rule 2)."""
    pair = Pair(2).joined()
    first = pair.call(1, Op.ALLREDUCE, 10, send=False)
    pair.post(1, pair.members[1].owed[0])  # sent whole, then interrupted: still owed
    pair.flush(1)  # the next step sends it again
    assert len(pair.sent("up", Kind.CONTRIB, rank=1)) == 2
    assert outcome(pair.call(0, Op.ALLREDUCE, 1, fn=add)) == 11 and outcome(first) == 11
    assert [outcome(f) for f in pair.call_all(Op.ALLREDUCE, [2, 3], fn=add)] == [5, 5]
    assert pair.coordinator.phase is Phase.RUNNING


# -- timeouts -----------------------------------------------------------------------


def test_timeout_names_the_ranks_that_had_not_arrived_and_the_call_stays_in_flight():
    pair = Pair(3).joined()
    futures = [pair.call(0, Op.ALLREDUCE, 0, fn=add), pair.call(1, Op.ALLREDUCE, 1)]
    for rank in (0, 1):
        status = pair.status(rank, 0)
        assert pair.members[rank].timeout_message(0, 1.0, status) == (
            f"seq 0 allreduce timed out after 1 s on rank {rank}: waiting for ranks 2 (arrived: 0,1)")
    futures.append(pair.call(2, Op.ALLREDUCE, 2))  # the late rank arrives: the same futures finish
    assert [outcome(f) for f in futures] == [3, 3, 3]
    late = pair.call(0, Op.ALLREDUCE, 5, fn=add)
    assert pair.members[0].timeout_message(1, 0.5, pair.status(0, 1)) == (
        "seq 1 allreduce timed out after 0.5 s on rank 0: waiting for ranks 1,2 (arrived: 0)")
    pair.call(1, Op.ALLREDUCE, 0), pair.call(2, Op.ALLREDUCE, 0)
    assert outcome(late) == 5


def test_timeout_after_every_rank_arrived_says_the_result_is_on_its_way():
    pair = Pair(3).joined()
    pair.hold(2, Kind.RESULT)  # rank 2's result is on its way
    futures = pair.call_all(Op.ALLREDUCE, [1, 2, 3], fn=add)
    assert pair.members[2].timeout_message(0, 2, pair.status(2, 0)) == (
        "seq 0 allreduce timed out after 2 s on rank 2: every rank arrived and the coordinator "
        "(rank 0) sent the result, which had not arrived here yet")
    pair.release(2, Kind.RESULT)
    assert outcome(futures[2]) == 6


def test_timeout_while_the_coordinator_computes_says_so():
    pair = Pair(2).joined()
    computing = {"seq": 0, "state": "computing", "arrived": [0, 1], "missing": []}
    assert pair.members[1].timeout_message(0, 2, computing) == (
        "seq 0 call timed out after 2 s on rank 1: every rank arrived; the coordinator (rank 0) "
        "is still computing it")


def test_timeout_without_a_status_answer_asks_whether_a_reduce_function_is_stuck():
    pair = Pair(2).joined()
    pair.lost.add((1, Kind.STATUS_REPLY))
    pair.call(1, Op.ALLREDUCE, 1)
    status = pair.status(1, 0)
    assert status is None
    assert pair.members[1].timeout_message(0, 2, status) == (
        "seq 0 allreduce timed out after 2 s on rank 1; the coordinator (rank 0) did not answer a "
        "status query within 1 s (is a reduce function stuck?)")
    # rank 0 says what its own coordinator thread is stuck in
    pair.call(0, Op.ALLREDUCE, 1, fn=add, send=False)
    busy = "every rank arrived; the reduce function of seq 0 allreduce has been running"
    assert pair.members[0].timeout_message(0, 2, None, busy) == (
        f"seq 0 allreduce timed out after 2 s on rank 0: {busy}")


# -- errors of one call ------------------------------------------------------------


@pytest.mark.parametrize("op, rank, values", [(Op.SCATTER, 0, 2), (Op.ALLTOALL, 1, 2)])
def test_a_wrong_number_of_values_fails_that_call_on_every_rank_then_the_group_goes_on(op, rank, values):
    """The sender raises ValueError itself and sends an error note instead
    (``Refused``, :mod:`zcollective._protocol._ops`); every other rank's call fails with its words."""
    pair = Pair(3).joined()
    said = f"{op.label} needs one value per replica: got {values} values for 3 replicas"
    futures = {}
    for r in range(3):
        if r == rank:
            pair.call(r, op, segments=error_note(said), flags=FLAG_LOCAL_ERROR)
        elif op is Op.SCATTER:
            futures[r] = pair.call(r, op)
        else:
            futures[r] = pair.call(r, op, segments=[_serialize.dumps(i) for i in range(3)])
    for future in futures.values():
        error = outcome(future)
        assert type(error) is zc.PeerError
        assert str(error) == f"seq 0 {op.label}: rank {rank} failed: {said}"
    assert [outcome(f) for f in pair.call_all(Op.ALLREDUCE, [1, 1, 1], fn=add)] == [3, 3, 3]


@pytest.mark.parametrize("op, text", [
    (Op.SCATTER, "seq 0 scatter: root 0 sent 2 values for 3 replicas"),
    (Op.ALLTOALL, "seq 0 alltoall: rank 0 did not send exactly 3 values"),
])
def test_a_part_of_the_wrong_shape_without_a_note_is_a_protocol_error_for_that_call(op, text):
    """Only a broken or altered replica sends this: the Group checks first."""
    pair = Pair(3).joined()
    futures = [pair.call(0, op, segments=[_serialize.dumps(i) for i in range(2)])]
    for r in (1, 2):
        segments = [] if op is Op.SCATTER else [_serialize.dumps(i) for i in range(3)]
        futures.append(pair.call(r, op, segments=segments))
    for future in futures:
        error = outcome(future)
        assert type(error) is zc.ProtocolError and str(error) == text
    assert pair.coordinator.phase is Phase.RUNNING


def raise_key_error(a, b):
    return {}[b]


def raise_system_exit(a, b):
    raise SystemExit(3)


def return_a_lock(a, b):
    import threading

    return threading.Lock()


@pytest.mark.parametrize("fn, remote_type, remote_message, text", [
    (raise_key_error, "KeyError", "1", "seq 0 allreduce: the reduction raised on the coordinator "
                                       "(rank 0): KeyError: 1"),
    (raise_system_exit, "SystemExit", "3", "seq 0 allreduce: the reduction raised on the coordinator "
                                           "(rank 0): SystemExit: 3"),
    (return_a_lock, "zcollective.errors.SerializationError", "cannot serialize the reduction result",
     "seq 0 allreduce: the reduction raised on the coordinator (rank 0): "
     "zcollective.errors.SerializationError: cannot serialize the reduction result"),
])
def test_a_reduce_function_that_raises_is_a_remote_error_on_every_rank(fn, remote_type, remote_message, text):
    pair = Pair(3).joined()
    futures = [pair.call(0, Op.ALLREDUCE, 0, fn=fn)] + [pair.call(r, Op.ALLREDUCE, r) for r in (1, 2)]
    for future in futures:
        error = outcome(future)
        assert type(error) is zc.RemoteError
        assert error.remote_type == remote_type and error.remote_message.startswith(remote_message)
        assert str(error).startswith(text)
        assert error.remote_traceback.startswith("Traceback")
        assert remote_type.split(".")[-1] in error.remote_traceback
    # the group is still usable, at the next seq on every rank
    assert [outcome(f) for f in pair.call_all(Op.ALLREDUCE, [1, 2, 3], fn=add)] == [6, 6, 6]


def test_a_value_rank_0_cannot_unpickle_is_a_serialization_error_naming_the_sender():
    pair = Pair(3).joined()
    futures = [pair.call(0, Op.ALLREDUCE, 0, fn=add),
               pair.call(1, Op.ALLREDUCE, segments=[[b"\x80\x05not a pickle"]]),
               pair.call(2, Op.ALLREDUCE, 2)]
    for future in futures:
        error = outcome(future)
        assert type(error) is zc.SerializationError
        assert str(error).startswith("seq 0 allreduce: the coordinator (rank 0) cannot deserialize the "
                                     "value of rank 1: ")
    assert [outcome(f) for f in pair.call_all(Op.ALLREDUCE, [1, 2, 3], fn=add)] == [6, 6, 6]


def test_a_buffer_above_max_frame_bytes_is_refused_before_anything_is_owed():
    member = Member(1, 2, ENDPOINT, max_frame_bytes=10)
    with pytest.raises(ValueError, match=r"rank 1: a allreduce value holds a buffer of 11 bytes, "
                                         r"above max_frame_bytes=10"):
        member.submit(Op.ALLREDUCE, 0, [[b"x" * 11]])
    assert not member.owed and member.next_seq == 0


# -- binding: stale and moved messages --------------------------------------------------


def test_a_result_of_an_earlier_group_on_the_same_port_is_dropped_quietly(caplog):
    pair = Pair(2).joined()
    pair.hold(1, Kind.RESULT)
    futures = pair.call_all(Op.ALLREDUCE, [1, 2], fn=add)
    caplog.set_level(logging.WARNING, logger="zcollective")
    stale = Message(Kind.RESULT, Op.ALLREDUCE, rank=1, seq=0, session=SESSION - 1,
                    segments=[_serialize.dumps(99)])
    assert pair.members[1].receive(encode(stale)) == []
    assert not futures[1]._done and pair.failure(1) is None
    assert caplog.records == []  # routine: a RESULT of an earlier group is not worth a warning
    pair.release(1, Kind.RESULT)
    assert outcome(futures[1]) == 3


def test_a_result_resolves_a_call_only_bound_to_this_rank_and_session():
    """A RESULT is handled by a shortcut when bound here; every other one
    goes the whole way (rule 2): another rank's, another session's, or one
    with session 0 (a member not yet welcomed has session 0 itself)."""
    pair = Pair(2).joined()
    pair.hold(1, Kind.RESULT)
    futures = pair.call_all(Op.ALLREDUCE, [1, 2], fn=add)
    member = pair.members[1]
    for rank, session in [(0, SESSION), (2, SESSION), (1, 0), (1, SESSION + 1)]:
        moved = Message(Kind.RESULT, Op.ALLREDUCE, rank=rank, seq=0, session=session,
                        segments=[_serialize.dumps(99)])
        assert member.receive(encode(moved)) == []
        assert not futures[1]._done and pair.failure(1) is None
    unwelcomed = Member(1, 2, ENDPOINT)
    unwelcomed.calls = dict(member.calls)
    stale = Message(Kind.RESULT, Op.ALLREDUCE, rank=1, seq=0, session=0, segments=[_serialize.dumps(99)])
    assert unwelcomed.receive(encode(stale)) == [] and not futures[1]._done
    pair.release(1, Kind.RESULT)
    assert outcome(futures[1]) == 3


def test_without_a_secret_other_misbound_messages_are_dropped_with_a_warning(caplog):
    pair = Pair(2).joined()
    caplog.set_level(logging.WARNING, logger="zcollective")
    fail = Message(Kind.FAIL, rank=0, session=SESSION, segments=[[b'{"error":"CollectiveError"}']])
    assert pair.members[1].receive(encode(fail)) == []  # bound to rank 0
    assert pair.failure(1) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"zcollective rank 1: dropped a FAIL message from the coordinator at {ENDPOINT} was bound to "
        f"rank 0, session {SESSION:#x}, not to this replica"]


def test_with_a_secret_a_message_moved_between_ranks_fails_the_group_everywhere():
    """A RESULT handed to the wrong rank (by someone on the path who cannot
    forge a tag) is never returned: that rank fails and tells the
    coordinator (ABORT), which fails the group for everyone."""
    pair = Pair(3, secret=SECRET).joined()
    pair.hold(1, Kind.RESULT)
    pair.hold(2, Kind.RESULT)
    futures = [pair.call(0, Op.SCATTER, segments=[_serialize.dumps(f"for rank {i}") for i in range(3)]),
               pair.call(1, Op.SCATTER), pair.call(2, Op.SCATTER)]
    assert outcome(futures[0]) is None  # the root keeps its own part (the group returns it)
    [to_1], [to_2] = pair.held.pop((1, Kind.RESULT)), pair.held.pop((2, Kind.RESULT))
    pair.in_flight.extend([("member", 1, to_2), ("member", 2, to_1)])  # swapped
    pair.settle()
    for rank in (1, 2):
        error = outcome(futures[rank])
        assert type(error) is zc.AuthenticationError
        assert str(error) == (f"rank {rank}: a RESULT message from the coordinator at {ENDPOINT} was "
                              f"bound to rank {3 - rank}, session {SESSION:#x}, not to this replica: "
                              f"was it moved between ranks or replayed? in flight: seq 0 scatter")
    assert [m.rank for m in pair.sent("up", Kind.ABORT)] == [1, 2]  # each found it: each tells
    assert pair.coordinator.phase is Phase.FAILED
    error = pair.failure(0)
    assert type(error) is zc.AuthenticationError
    assert str(error).startswith(f"rank 1 {WHO} found its link to the coordinator tampered with: "
                                 f"rank 1: a RESULT message")
    with pytest.raises(zc.AuthenticationError):
        pair.call(0, Op.BARRIER)


def test_with_a_secret_a_message_altered_in_flight_fails_the_group_everywhere():
    pair = Pair(2, secret=SECRET).joined()
    pair.hold(1, Kind.RESULT)
    futures = pair.call_all(Op.ALLREDUCE, [1, 2], fn=add)
    [frames] = pair.held.pop((1, Kind.RESULT))
    frames[1] = bytes(frames[1][:-1]) + bytes([frames[1][-1] ^ 1])
    pair.in_flight.append(("member", 1, frames))
    pair.settle()
    assert str(outcome(futures[1])) == (f"rank 1: a message from the coordinator at {ENDPOINT} failed "
                                        f"authentication (authentication tag does not match); was it "
                                        f"altered in flight, or did rank 0's program change a buffer "
                                        f"it had passed to an _async call before the call completed? "
                                        f"in flight: seq 0 allreduce")
    assert type(pair.failure(0)) is zc.AuthenticationError


# -- ending ---------------------------------------------------------------------------


def test_a_member_that_ends_says_bye_and_the_others_learn_it_ended_not_that_it_was_lost():
    pair = Pair(3).joined()
    done = pair.call_all(Op.ALLREDUCE, [1, 2, 3], fn=add)
    assert not pair.members[2].farewell
    pair.send(2, pair.members[2].bye())
    assert [m.seq for m in pair.sent("up", Kind.BYE)] == [1]  # it made one call
    assert [m.seq for m in pair.sent("down", Kind.BYE)] == [1]  # answered: it may close now
    assert pair.members[2].farewell and not pair.members[1].farewell
    pair.disconnect(2)  # its program ended: the connection closes, nobody is lost
    assert pair.coordinator.phase is Phase.RUNNING and [outcome(f) for f in done] == [6, 6, 6]
    waiting = pair.call(1, Op.BARRIER)
    text = (f"rank 2 ended its program (without teardown) after seq 0 {WHO}; seq 1 barrier was in "
            f"flight on rank 1")
    error = outcome(waiting)
    assert type(error) is zc.ReplicaLostError and str(error) == text
    assert str(pair.failure(0)) == text


def test_bye_is_sent_only_by_a_member_of_a_running_group():
    member = Member(1, 2, ENDPOINT)
    assert member.bye() is None  # never joined: nobody to tell
    pair = Pair(2).joined()
    pair.connection(1, ConnectionEvent.DISCONNECTED)
    assert pair.members[1].bye() is None  # failed: nobody listens


# -- a foreign program at the master address ------------------------------------------------


def test_a_protocol_violation_in_the_handshake_is_a_foreign_program_at_once():
    member = Member(1, 2, ENDPOINT)
    member.connection(ConnectionEvent.CONNECTED)
    member.connection(ConnectionEvent.PROTOCOL_VIOLATION)
    assert type(member.failure) is zc.ProtocolError
    assert str(member.failure) == (f"rank 1: the program listening at {ENDPOINT} is not a zcollective "
                                   f"coordinator (1 ZeroMQ handshakes failed); is the master port used "
                                   f"by another program?")


def test_failed_handshakes_mean_a_foreign_program_only_after_three_over_five_seconds():
    member = Member(1, 2, ENDPOINT)
    assert (FOREIGN_PEER_TRIES, FOREIGN_PEER_S) == (3, 5.0)
    for now in (100.0, 101.0, 102.0, 104.9):  # a proxy, or a coordinator still starting
        member.connection(ConnectionEvent.HANDSHAKE_FAILED, now=now)
    assert member.failure is None
    member.connection(ConnectionEvent.HANDSHAKE_SUCCEEDED)  # a good handshake starts the count again
    for now in (200.0, 205.0):
        member.connection(ConnectionEvent.HANDSHAKE_FAILED, now=now)
    assert member.failure is None  # 5 s, but only two tries
    member.connection(ConnectionEvent.HANDSHAKE_FAILED, now=205.1)
    assert type(member.failure) is zc.ProtocolError
    assert "(3 ZeroMQ handshakes failed)" in str(member.failure)


def test_failed_handshakes_after_the_welcome_are_not_a_foreign_program():
    pair = Pair(2).joined()
    for now in (0.0, 10.0, 20.0):
        pair.connection(1, ConnectionEvent.HANDSHAKE_FAILED, now=now)
    pair.connection(1, ConnectionEvent.PROTOCOL_VIOLATION, now=30.0)
    assert pair.failure(1) is None


def test_nothing_is_sent_for_a_call_that_could_not_be_built():
    pair = Pair(2).joined()
    member = pair.members[1]
    member.reserve(Op.ALLREDUCE, 0, "train.py:1")
    member.unreserve()  # its value could not be pickled
    assert member.next_seq == 0 and not member.owed
    member.reserve(Op.ALLREDUCE, 0, "train.py:2")
    member.abandon("rank 1 was interrupted (KeyboardInterrupt) before its part was sent")
    pair.flush(1)
    future = pair.call(0, Op.ALLREDUCE, 1, fn=add)
    error = outcome(future)
    assert type(error) is zc.PeerError and str(error) == (
        "seq 0 allreduce: rank 1 failed: rank 1 was interrupted (KeyboardInterrupt) before its part was sent")
    assert [outcome(f) for f in pair.call_all(Op.ALLREDUCE, [1, 2], fn=add)] == [3, 3]


def test_a_data_key_is_taken_only_as_the_welcome_writes_it():
    from zcollective._protocol._member import _is_key

    assert _is_key("ab" * 32)
    for bad in (" " * 64, "AB" * 31 + " " * 2, "ab" * 31, "zz" * 32, None, 7, b"ab" * 32):
        assert not _is_key(bad), bad


def test_a_probe_asks_for_nothing():
    """Rule 7: a PROBE bound to this member is ignored, whatever the phase."""
    pair = Pair(2, secret=b"s").joined()
    member = pair.members[1]
    probe = Message(Kind.PROBE, rank=1, session=member.session)
    assert member.receive(encode(probe, member.signer)) == [] and member.failure is None
    member.fail(zc.ReplicaLostError("over"))
    assert member.receive(encode(probe, member.signer)) == []


def test_a_probe_bound_elsewhere_is_refused_as_any_message_is():
    """Rule 2: a PROBE replayed from an earlier group (another session) that
    proves the secret fails the group here; without a secret it is dropped."""
    for secret in (b"s", None):
        pair = Pair(2, secret=secret).joined()
        member = pair.members[1]
        replayed = Message(Kind.PROBE, rank=1, session=member.session ^ 1)
        member.receive(encode(replayed, member.signer))
        assert isinstance(member.failure, zc.AuthenticationError) == (secret is not None)


def test_the_last_bye_is_answered_in_kind_even_in_a_failed_group():
    """Rule 7: rank 0 ends; its last BYE (FLAG_LAST) is answered, so rank 0
    knows all before it was read; the answer to this member's own BYE is not."""
    pair = Pair(2).joined()
    member = pair.members[1]
    member.fail(zc.ReplicaLostError("rank 0 ended its program"))
    last = Message(Kind.BYE, rank=1, session=member.session, flags=FLAG_LAST)
    [answer] = member.receive(encode(last))
    assert (answer.kind, answer.flags & FLAG_LAST, answer.rank, answer.session) == (
        Kind.BYE, FLAG_LAST, 1, member.session)
    assert member.farewell
    assert member.receive(encode(Message(Kind.BYE, rank=1, session=member.session))) == []


def test_a_taken_is_answered_once_no_data_through_its_seq_is_left():
    """Rule 7: the rank before this one ends; the coordinator asks (TAKEN,
    seq 0) for word once this member has taken its chunks. Owed once the
    job is done (the driver flushes it), at once if none is left."""
    pair = Pair(2).joined()
    member = pair.members[1]
    member.transfers.append((0, "a job of seq 0"))
    ask = Message(Kind.TAKEN, rank=1, seq=0, session=member.session)
    assert member.receive(encode(ask)) == []
    member.data_done()
    [taken] = member.owed
    assert (taken.kind, taken.seq, taken.rank, taken.session) == (Kind.TAKEN, 0, 1, member.session)
    [again] = member.receive(encode(ask))
    assert again.kind is Kind.TAKEN


def test_a_bye_says_when_data_to_move_is_left():
    """Left: a plan came and its data is not moved, or this rank described
    data of its own. A call whose plan did not come (a small broadcast or
    allgather may need no data plane) is the coordinator's to judge: flagged,
    it failed a group whose others would have completed it (attack review
    round 3)."""
    pair = Pair(2).joined()
    member = pair.members[1]
    assert not member.bye().flags & FLAG_DATA
    member.calls[0] = Call("broadcast", transfer=lambda plan: None)
    assert not member.bye().flags & FLAG_DATA
    member.calls[0] = Call("allreduce", transfer=lambda plan: None, described=True)
    assert member.bye().flags & FLAG_DATA
    member.calls[0] = Call("broadcast", transfer=lambda plan: None)
    member.transfers.append((0, "its job"))
    assert member.bye().flags & FLAG_DATA


# -- timers (rules 8 and 9): the driver asks when, and sends what on_timer returns ----------------


def test_a_join_is_sent_again_at_its_timer_until_the_welcome():
    pair, clock = Pair(2), FakeClock()
    pair.join(0)
    member = pair.members[1]
    member.clock = clock
    pair.connection(1, ConnectionEvent.CONNECTED)
    pair.connection(1, ConnectionEvent.HANDSHAKE_SUCCEEDED)
    [first] = member.start_join()  # lost (a connection made twice): the coordinator never sees it
    assert first.kind is Kind.JOIN and member.next_deadline() == 1000.0 + JOIN_RESEND_S
    assert member.on_timer(1000.0 + JOIN_RESEND_S - 0.01) == []
    [again] = member.on_timer(1000.0 + JOIN_RESEND_S)
    assert again.kind is Kind.JOIN and again.body()["nonce"] != first.body()["nonce"]
    assert member.next_deadline() == 1000.0 + 2 * JOIN_RESEND_S  # from when it was sent
    pair.send(1, again)
    assert member.joined and member.next_deadline() is None and member.on_timer(2000.0) == []


def test_a_join_timer_stops_when_the_driver_stops_waiting_or_a_newcomer_is_admitted():
    member = Member(1, 2, ENDPOINT, clock=FakeClock())
    member.start_join()
    member.stop_join()
    assert member.next_deadline() is None and member.on_timer(2000.0) == []
    member.start_join()
    member.admitted = {"rank": 2, "size": 3}
    assert member.next_deadline() is None and member.on_timer(2000.0) == []


def test_a_join_that_waits_says_so_at_the_bound_then_twice_and_four_times_it(caplog):
    member = Member(1, 2, ENDPOINT, clock=FakeClock())
    member.start_join(warn_after=2.0)
    with caplog.at_level(logging.WARNING, logger="zcollective"):
        for now in range(1001, 1011):
            member.on_timer(float(now))
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"zcollective rank 1 has waited {w} s at {ENDPOINT} for the coordinator (rank 0), "
                    f"which it cannot reach there (is rank 0 running, and the address right?)"
                    for w in (2, 4, 8)]


@pytest.mark.parametrize("newcomer, warn_after", [(True, 2.0), (False, None)],
                         ids=["newcomer", "not-over-a-connection"])
def test_some_joins_never_say_they_wait(caplog, newcomer, warn_after):
    member = Member(1, 2, ENDPOINT, clock=FakeClock())
    member.newcomer = newcomer
    member.start_join(warn_after=warn_after)
    with caplog.at_level(logging.WARNING, logger="zcollective"):
        sent = [member.on_timer(float(now)) for now in range(1001, 1020)]
    assert caplog.records == [] and all(m.kind is Kind.JOIN for [m] in sent)  # still sent again


def lost_link(rank=0):
    error = zc.ReplicaLostError(f"rank 1 lost its data link from rank {rank}")
    error.lost_rank = rank
    return error


def test_a_lost_data_link_waits_its_grace_for_rank_0_then_fails_the_group_and_tells_it():
    pair, clock = Pair(2).joined(), FakeClock()
    member = pair.members[1]
    member.clock = clock
    future = pair.call(1, Op.ALLREDUCE, 1, send=False)
    error = lost_link()
    assert member.data_lost(error) == [] and member.losing_data
    assert member.next_deadline() == 1000.0 + DATA_LOSS_GRACE_S
    assert member.on_timer(1000.0 + DATA_LOSS_GRACE_S - 0.01) == [] and member.failure is None
    [abort] = member.on_timer(1000.0 + DATA_LOSS_GRACE_S)
    assert (abort.kind, abort.rank, abort.session) == (Kind.ABORT, 1, member.session)
    assert abort.body() == {"error": "ReplicaLostError", "message": str(error), "lost": 0, "plane": "data"}
    [said] = member.outcomes  # the rules say what the call came to; the runner applies it
    assert said.future is future and said.error.args == error.args and not future._done
    assert member.failure is error and not member.losing_data
    assert member.next_deadline() is None


def test_a_failure_within_the_grace_says_why_and_no_abort_is_sent():
    pair, clock = Pair(2).joined(), FakeClock()
    member = pair.members[1]
    member.clock = clock
    member.calls[0] = Call("allreduce")
    member.transfers.append((0, "its job"))
    assert member.data_lost(lost_link()) == []
    clock.now += 0.1
    why = zc.ReplicaLostError("rank 0's program ended")  # rank 0's FAIL came meanwhile
    member.fail(why, keep_data=True)
    assert member.next_deadline() <= clock.now  # due at once
    assert member.on_timer(clock.now) == []
    assert member.failure is why and not member.transfers and not member.losing_data


def test_a_reduce_function_that_raised_fails_only_its_call_at_once_and_tells_rank_0():
    pair = Pair(2).joined()
    member = pair.members[1]
    future = pair.call(1, Op.ALLREDUCE, 1, send=False)
    member.transfers.append((0, "its job"))
    error = zc.PeerError("seq 0 allreduce: the reduce function raised on rank 1")
    error.seq = 0
    [abort] = member.data_lost(error)
    assert (abort.kind, abort.seq, abort.body()["lost"]) == (Kind.ABORT, 0, None)
    [said] = member.outcomes
    assert member.failure is None and said.future is future and said.error is error and not member.transfers
    assert member.next_deadline() is None
