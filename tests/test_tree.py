"""The tree of small calls: its shape and an interior rank's rules, and the
coordinator fed summaries, without sockets; then real groups of 16 and 32
processes (ZCOLLECTIVE_TREE=on: this machine's two cores make ``auto`` keep the star)."""

import collections
import operator
import os
import signal
import time

import numpy
import pytest
from conftest import touch, wait_for
from pair import FakeClock
from test_coordinator import SESSION, contrib, feed, peer, results

import zcollective as zc
from zcollective._format import _serialize
from zcollective._format._wire import PROTOCOL_VERSION, Kind, control, decode, encode
from zcollective._io._combine import applied
from zcollective._protocol import _tree
from zcollective._protocol._coordinator import PYTHON_VERSION, Coordinator, Phase
from zcollective._protocol._ops import SPOKEN, Op
from zcollective.testing import Replicas, report

TREE = {"ZCOLLECTIVE_TREE": "on"}
RUN_S = 120


# -- shape ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [3, 5, 16, 17, 32, 64, 1024])
def test_every_rank_heads_a_contiguous_range_inside_its_parents(n):
    tree = _tree.shape(n)
    assert tree.parent[0] == -1 and tree.end[0] == n
    for rank in range(1, n):
        up = tree.parent[rank]
        assert up < rank and rank in tree.children[up] and tree.end[rank] <= tree.end[up]
    for rank in range(n):  # its children's ranges tile its own, after itself
        edges = [rank + 1, *(tree.end[c] for c in tree.children[rank])]
        assert list(tree.children[rank]) == edges[:-1] and edges[-1] == tree.end[rank]
        assert len(tree.children[rank]) <= _tree.TREE_FANOUT
    assert _tree.depth(n) <= {3: 1, 5: 1, 16: 2, 17: 2, 32: 3, 64: 3, 1024: 5}[n]


# -- an interior rank's rules -----------------------------------------------------------

def part(rank, value, seq=0, op=Op.ALLREDUCE, site="t.py:1", root=0):
    msg = contrib(rank, seq, op=op, value=value, site=site, root=root)
    if op != Op.ALLREDUCE and not (op == Op.BROADCAST and rank == root):
        msg.segments = []
    return msg


def through(msg):
    """As a child's UP arrives (decoded, flags of its framing included)."""
    return decode(encode(_tree.up(msg) if msg.kind is Kind.CONTRIB else msg))


def climb(relay, values, reduce=operator.add, **kw):
    """Rank relay.rank's part and each child's, one each; what goes up."""
    out = relay.own(part(relay.rank, values[relay.rank], **kw), reduce)
    for child in relay.children:
        out += relay.take(through(part(child, values[child], **kw)))
    return asked(relay, out)


def asked(relay, out):
    """What goes up once the driver ran the reductions ``relay`` asked for."""
    return list(applied(out, relay))


def test_a_range_that_called_alike_goes_up_as_one_summary_reduced_in_rank_order():
    relay = _tree.Relay(1, 16)  # ranks 1..4
    values = {r: str(r) for r in range(16)}
    out = climb(relay, values, zc.default_reduce_fn)  # (a += b: not commutative on strings, order shows)
    assert len(out) == 1 and out[0].flags & _tree.FLAG_RANGE
    assert _tree.span(out[0]) == (1, 5) and _serialize.loads(_tree.parts(out[0])[0]) == "1234"
    parent = _tree.Relay(0, 16)  # (its rules are the coordinator's; the summary passes as one part)
    assert parent.take(through(out[0])) == []


@pytest.mark.parametrize("fn", [lambda a, b: a + b, operator.sub])
def test_a_function_not_known_to_be_associative_leaves_the_fold_to_rank_0(fn):
    out = climb(_tree.Relay(1, 16), dict.fromkeys(range(16), 1), fn)
    assert [m.rank for m in out] == [1, 2, 3, 4] and not any(m.flags & _tree.FLAG_RANGE for m in out)


def test_a_part_taken_twice_counts_once():
    relay = _tree.Relay(1, 16)
    relay.own(part(1, "1"), zc.default_reduce_fn)
    two = through(part(2, "2"))
    assert relay.take(two) == [] and relay.take(two) == [] and relay.take(through(part(3, "3"))) == []
    out = asked(relay, relay.take(through(part(4, "4"))))
    assert _serialize.loads(_tree.parts(out[0])[0]) == "1234"


@pytest.mark.parametrize("odd", ["op", "site", "raises", "root"])
def test_a_range_that_differs_goes_up_part_by_part(odd):
    relay = _tree.Relay(1, 16)
    own = part(1, 1)
    raises = zc.elementwise(lambda a, b: 1 / 0)
    out = relay.own(own, raises if odd == "raises" else operator.add)
    for child in relay.children:
        kw = {}
        if child == 3 and odd == "op":
            kw = {"op": Op.BROADCAST}
        if child == 3 and odd == "site":
            kw = {"site": "other.py:9"}
        if child == 3 and odd == "root":
            kw = {"root": 2}
        out += relay.take(through(part(child, 1, **kw)))
    out = asked(relay, out)
    assert [m.rank for m in out] == [1, 2, 3, 4] and not any(m.flags & _tree.FLAG_RANGE for m in out)


def test_parts_held_past_the_flush_go_up_as_they_came_and_the_rest_follows():
    clock = FakeClock()
    relay = _tree.Relay(1, 16, clock=clock)
    assert relay.own(part(1, 1), operator.add) == []
    assert relay.take(through(part(2, 1))) == []
    assert relay.next_due() == pytest.approx(clock() + _tree.RELAY_FLUSH_S)
    clock.now += _tree.RELAY_FLUSH_S
    assert [m.rank for m in relay.on_timer(clock())] == [1, 2]
    assert [m.rank for m in relay.take(through(part(4, 1)))] == [4]  # (as it comes)
    assert [m.rank for m in relay.take(through(part(3, 1)))] == [3] and relay.calls == {}


def test_an_up_for_ranks_outside_the_subtree_is_dropped():
    relay = _tree.Relay(1, 16)
    assert relay.take(through(part(5, 1))) == [] and relay.take(through(part(1, 1))) == []
    forged = _tree.summary(part(2, 1), 9, [[b"x"]])  # (claims ranks 2..8)
    assert relay.take(through(forged)) == [] and relay.calls == {}


def test_a_result_comes_down_to_each_child_bound_to_it():
    relay = _tree.Relay(5, 16)
    result = decode(encode(contrib(5, 3, value=7)))
    result.kind = Kind.RESULT
    assert [(child, m.rank, m.seq) for child, m in relay.down(result)] == [(6, 6, 3), (7, 7, 3), (8, 8, 3)]


# -- the coordinator fed summaries (rule 14) --------------------------------------------

def tree_joined(n):
    coord = Coordinator(n, SESSION, max_frames=1000, tree="on")
    for r in range(n):
        join = control(Kind.JOIN, {"rank": r, "num_replicas": n, "python": PYTHON_VERSION, "ops": SPOKEN,
                                   "protocol": PROTOCOL_VERSION, "pid": 100 + r, "host": "h",
                                   "mail": f"tcp://10.0.0.1:{4000 + r}"}, rank=r)
        feed(coord, peer(r), join)
    assert coord.phase is Phase.RUNNING and coord.tree is not None
    return coord


def summaries(n, values, reduce=operator.add, seq=0, odd=None):
    """What rank 0's children send up: each range's summary, or (``odd``) rank odd's part alone."""
    tree, out = _tree.shape(n), []
    for child in tree.children[0]:
        relay = _tree.Relay(child, n)
        ups = relay.own(part(child, values[child], seq=seq), reduce)
        for sub in range(child + 1, tree.end[child]):  # (flattened: deeper relays would send the same)
            kw = dict(odd) if odd and sub == odd["_rank"] else {}
            kw.pop("_rank", None), kw.pop("_at", None)
            ups += relay.take(through(part(sub, values[sub], seq=seq, **kw)))
        out += [(child, m) for m in asked(relay, ups)]
    return out


def test_summaries_complete_a_call_whose_result_goes_only_to_rank_0s_children():
    n = 16
    coord = tree_joined(n)
    concat = zc.default_reduce_fn
    values = {r: f"{r}," for r in range(n)}
    assert feed(coord, peer(0), contrib(0, 0, value=values[0], fn=concat)) == []
    out = []
    for child, up in summaries(n, values, concat):
        out += feed(coord, peer(child), up)
    sent = results(out)
    assert sorted(sent) == sorted(peer(r) for r in (0, 1, 5, 9, 13))
    assert {_serialize.loads(m.segments[0]) for m in sent.values()} == {"".join(values.values())}
    assert coord.next_seq == [1] * n


def test_a_mismatch_deep_in_a_range_is_named_rank_by_rank():
    n = 16
    coord = tree_joined(n)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=operator.add))
    out = []
    for child, up in summaries(n, dict.fromkeys(range(n), 1), odd={"_rank": 11, "op": Op.BROADCAST}):
        out += feed(coord, peer(child), up)
    message = decode(encode(out[0][1])).body()["message"]
    assert coord.phase is Phase.FAILED and "rank 11 called broadcast(root=0) at t.py:1" in message
    assert "ranks 0,1,2,3,4,5,6,7,8,9,10 called allreduce at t.py:1" in message  # (as on the star: the
    # others had not come yet)


def test_a_give_up_that_overtakes_its_part_fails_the_call_for_everyone():
    n = 16
    coord = tree_joined(n)
    abort = control(Kind.ABORT, {"error": "CollectiveTimeoutError", "message": "late", "abandoned": True},
                    rank=7, seq=0, session=SESSION)
    assert feed(coord, peer(7), abort) == []  # (its part still climbs)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=operator.add))
    out = []
    for child, up in summaries(n, dict.fromkeys(range(n), 1)):
        out += feed(coord, peer(child), up)
    errors = [m for _, m in out if m.kind is Kind.ERROR]
    assert len(errors) == n and "rank 7" in errors[0].body()["message"]
    assert coord.phase is Phase.RUNNING


def test_an_up_speaking_for_another_subtree_is_dropped():
    coord = tree_joined(16)
    forged = _tree.up(part(7, 1))  # rank 7 is under rank 5, not rank 1
    assert feed(coord, peer(1), forged) == [] and coord.next_seq[7] == 0


# -- real processes ---------------------------------------------------------------------

def busy_tree(markers):
    """Calls a tree must get right, then give up or fail alike; returns what each rank saw."""
    me, n = zc.get_rank(), zc.get_world_size()
    seen = {"concat": zc.allreduce(f"{me},", lambda a, b: a + b),
            "bcast": zc.broadcast(me * 10 if me == n - 2 else None, root=n - 2),
            "interior_root": zc.broadcast(me * 10 if me == 5 else None, root=5),  # (its subtree needs it too)
            "gather": zc.gather(me, root=0)}
    zc.barrier()
    future = zc.allreduce_async(1)  # an interior rank computes: its subtree must not wait for it
    if me == 1:
        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # (busy: never inside the library)
            pass
    seen["async"] = (future.result(timeout=30), time.monotonic())
    deep = n - 5  # a leaf two or three hops down
    try:
        if me == deep:
            zc.broadcast(me)
        else:
            zc.allreduce(1)
        seen["mismatch"] = None
    except zc.CallMismatchError as exc:
        seen["mismatch"] = str(exc)
    return seen


def test_a_tree_of_16_gets_every_call_right_and_names_a_deep_mismatch_exactly(tmp_path):
    n = 16
    with Replicas(busy_tree, n, str(tmp_path), env=TREE) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    values = [o.value for o in outs]
    for seen in values:
        assert seen["concat"] == "".join(f"{r}," for r in range(n)), report(outs, "rank order")
        assert seen["bcast"] == (n - 2) * 10 and seen["interior_root"] == 50
        assert seen["async"][0] == n
        assert f"rank {n - 5} called broadcast(root=0)" in seen["mismatch"], report(outs, "not named")
    assert values[0]["gather"] == list(range(n))
    done = {me: seen["async"][1] for me, seen in enumerate(values)}
    held = [r for r in (2, 3, 4) if done[r] > done[1] - 0.5]  # (rank 1's subtree did not wait for it)
    assert not held, report(outs, f"ranks {held} waited for rank 1's program: {done}")


def late_deep(markers):
    """A deep rank comes late past the others' timeout: all give the call up alike, then go on."""
    me, n = zc.get_rank(), zc.get_world_size()
    zc.barrier()
    if me == n - 3:  # it comes once rank 0 has given the call up
        wait_for(os.path.join(markers, "given up"), timeout=60)
    try:
        zc.allreduce(1, timeout=1.5)
        first = "completed"
    except zc.CollectiveTimeoutError as exc:
        first = str(exc)
    if me == 0:
        touch(os.path.join(markers, "given up"))
    return {"first": first, "then": zc.allreduce(me)}


def test_a_tree_of_32_gives_up_a_call_a_deep_rank_is_late_for_alike_and_goes_on(tmp_path):
    n = 32
    with Replicas(late_deep, n, str(tmp_path), env=TREE) as reps:
        outs = reps.wait(RUN_S)
    assert all(o.ok for o in outs), report(outs, "a rank failed")
    for o in outs:
        assert o.value["first"] != "completed" and o.value["then"] == sum(range(n)), report(outs, "not alike")
    assert any(f"ranks {n - 3}" in o.value["first"] or f"rank {n - 3}" in o.value["first"] for o in outs
               if o.rank != n - 3), report(outs, f"the late rank is not named: {outs[0].value['first']}")


def interior_killed(markers, victim):
    me = zc.get_rank()
    zc.barrier()
    touch(os.path.join(markers, f"ready{me}"))
    if me == victim:
        time.sleep(60)  # (killed meanwhile: every other rank's call waits for its subtree)
    started = time.monotonic()
    try:
        zc.allreduce(1, timeout=60)
        return "no loss"
    except zc.ReplicaLostError as exc:
        told, lost = time.monotonic() - started, getattr(exc, "lost_ranks", ())
    zc.shrink()
    return {"told_s": told, "lost": list(lost), "sum": zc.allreduce(1), "size": zc.get_world_size(),
            "concat": zc.allreduce(f"{zc.get_rank()},", lambda a, b: a + b)}


def test_an_interior_rank_killed_mid_call_is_named_everywhere_and_the_rest_shrink_and_go_on(tmp_path):
    n, victim = 16, 5  # rank 5 heads ranks 5..8
    env = {**TREE, "ZCOLLECTIVE_LIVENESS_TIMEOUT": "3"}
    with Replicas(interior_killed, n, str(tmp_path), victim, env=env) as reps:
        for r in range(n):
            wait_for(str(tmp_path / f"ready{r}"), timeout=60)
        time.sleep(0.3)  # (every rank waits in its call)
        os.kill(reps.procs[victim].pid, signal.SIGKILL)
        outs = reps.wait(RUN_S)
    for o in outs:
        if o.rank == victim:
            continue
        assert o.ok and o.value != "no loss", report(outs, f"rank {o.rank}")
        assert o.value["lost"] == [victim] and o.value["told_s"] < 3 + 1, report(outs, "late or wrong")
        assert (o.value["sum"], o.value["size"]) == (n - 1, n - 1)
        assert o.value["concat"] == "".join(f"{r}," for r in range(n - 1))


def test_an_interior_rank_lost_has_its_subtree_sent_the_latest_results_again_before_the_fail():
    n = 16
    coord = tree_joined(n)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=operator.add))
    for child, up in summaries(n, dict.fromkeys(range(n), 1)):
        feed(coord, peer(child), up)
    out = [(p, decode(encode(m))) for p, m in coord.lost(5, "gone")]
    again = [(p, m.seq, _serialize.loads(m.segments[0])) for p, m in out if m.kind is Kind.RESULT]
    assert again == [(peer(r), 0, n) for r in (6, 7, 8)]
    assert [m.kind for _, m in out[3:]] == [Kind.FAIL] * (n - 1)  # (after them, on the same links)


def test_a_value_rank_0_cannot_read_is_named_by_its_rank_not_its_parts_place():
    from zcollective._io._combine import run
    from zcollective._protocol._ops import Combine, Unreadable

    asked = Combine(0, Op.ALLREDUCE, 0, 1, operator.add, ([_serialize.dumps(1)], [[b"not a pickle"]]), (0, 7))
    with pytest.raises(Unreadable, match="value of rank 7"):
        run(asked, lambda fn: fn)


def deep_member(clock):
    """Rank 2 of 16 (its parent rank 1), welcomed into a group whose small calls climb the tree."""
    from zcollective._format import _bodies
    from zcollective._protocol._member import Member

    member = Member(2, 16, "tcp://127.0.0.1:1", clock=clock)
    member.mail_endpoint = "tcp://127.0.0.1:2"
    nonce = member.join().body()["nonce"]
    mail = [f"tcp://h:{r}" for r in range(16)]
    welcome = _bodies.welcome(16, nonce, None, None, None, 0, "ab" * 32, mail=mail, tree=_tree.TREE_FANOUT,
                              rank=2, session=SESSION)
    member.receive_message(decode(encode(welcome)))
    assert member.parent == 1 and member.relay is None
    member.submit(Op.ALLREDUCE, 0, [_serialize.dumps(1)], future="f0", finish=lambda msg: "value")
    return member


def failing(complete):
    return control(Kind.FAIL, {"error": "CallMismatchError", "message": "seq 1: ranks differ",
                               "complete": complete}, rank=2, session=SESSION)


def test_a_deep_rank_holds_a_fail_until_the_results_it_says_completed_came_down():
    member = deep_member(FakeClock())
    member.receive_message(decode(encode(failing(1))))
    assert member.failure is None and member.deferred is not None  # seq 0's result is on its way
    result = decode(encode(contrib(2, 0, value=16)))
    result.kind = Kind.RESULT
    member.climbed(result)
    assert [o.future for o in member.outcomes] == ["f0"] and member.outcomes[0].error is None
    assert isinstance(member.failure, zc.CallMismatchError) and member.deferred is None


def test_a_held_fail_takes_effect_after_its_grace_and_fails_what_waits():
    clock = FakeClock()
    member = deep_member(clock)
    member.receive_message(decode(encode(failing(1))))
    clock.now += _tree.TREE_GRACE_S
    member.tree_timer(clock())
    assert isinstance(member.failure, zc.CallMismatchError)
    assert [(o.future, type(o.error)) for o in member.outcomes] == [("f0", zc.CallMismatchError)]


def test_a_fail_before_any_call_completed_takes_effect_at_once():
    member = deep_member(FakeClock())
    member.receive_message(decode(encode(failing(0))))
    assert isinstance(member.failure, zc.CallMismatchError) and member.deferred is None


def test_a_call_made_while_a_fail_is_held_raises_it():
    member = deep_member(FakeClock())
    member.receive_message(decode(encode(failing(1))))
    with pytest.raises(zc.CallMismatchError):
        member.reserve(Op.ALLREDUCE, 0, "t.py:2")


@pytest.mark.parametrize("values", [
    {r: collections.Counter({"a": -5 if r == 2 else 1}) for r in range(16)},  # (+= drops counts < 1)
    {r: [r] if r % 2 else numpy.ones(1) for r in range(16)},  # (list += array extends it)
], ids=["counters", "mixed types"])
def test_values_whose_grouping_matters_leave_the_fold_to_rank_0(values):
    out = climb(_tree.Relay(1, 16), values, zc.default_reduce_fn)
    assert [m.rank for m in out] == [1, 2, 3, 4] and not any(m.flags & _tree.FLAG_RANGE for m in out)


def test_a_summary_reduced_with_another_function_than_rank_0s_is_a_mismatch_not_a_wrong_value():
    n = 16
    coord = tree_joined(n)
    feed(coord, peer(0), contrib(0, 0, value=1, fn=operator.add))
    out = []
    for child, up in summaries(n, dict.fromkeys(range(n), 1), max):
        out += feed(coord, peer(child), up)
    errors = [m for _, m in out if m.kind is Kind.ERROR]
    assert len(errors) == n and errors[0].body()["error"] == "CallMismatchError"
    assert "ranks 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 passed a value reduced with max on the way" in \
        errors[0].body()["message"]


def test_a_broadcast_through_the_tree_sends_the_roots_value_whatever_the_others_parts_carry():
    n, root, tree = 16, 6, _tree.shape(16)
    coord = tree_joined(n)

    def sent(rank):  # (a rank of a host sharing memory sends a status segment, not a value)
        msg = contrib(rank, 0, op=Op.BROADCAST, value="the root's" if rank == root else None, root=root)
        if rank != root:
            msg.segments = [[b"a status"]] if rank < root else []
        return msg
    out = feed(coord, peer(0), sent(0))
    for child in tree.children[0]:
        relay = _tree.Relay(child, n)
        ups = relay.own(sent(child), None)
        for sub in range(child + 1, tree.end[child]):
            ups += relay.take(through(sent(sub)))
        for up in ups:
            out += feed(coord, peer(child), up)
    assert {_serialize.loads(m.segments[0]) for _, m in out if m.kind is Kind.RESULT} == {"the root's"}


def test_a_teardown_comes_down_the_tree_behind_the_results_before_it():
    n, tree = 16, _tree.shape(16)
    coord = tree_joined(n)
    out = feed(coord, peer(0), part(0, None, op=Op.TEARDOWN))
    for child in tree.children[0]:
        for rank in range(child, tree.end[child]):
            out += feed(coord, peer(child), _tree.up(part(rank, None, op=Op.TEARDOWN)))
    assert sorted(p for p, m in out if m.kind is Kind.RESULT) == sorted(peer(r) for r in (0, 1, 5, 9, 13))
    assert coord.phase is Phase.CLOSED


def test_rank_0_closing_after_a_teardown_whose_result_still_comes_down_is_no_failure():
    from zcollective._protocol._member import ConnectionEvent

    member = deep_member(FakeClock())
    member.submit(Op.TEARDOWN, 0, [], future="t1", finish=lambda msg: None)
    member.connection(ConnectionEvent.DISCONNECTED)  # (rank 0 closed: the teardown completed)
    assert member.failure is None and member.deferred is not None
    for seq, op in ((0, Op.ALLREDUCE), (1, Op.TEARDOWN)):
        result = decode(encode(contrib(2, seq, value=16, op=op)))
        result.kind = Kind.RESULT
        member.climbed(result)
    assert [o.error for o in member.outcomes] == [None, None] and member.failure is None
