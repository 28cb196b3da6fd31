"""A rank that withdrew its JOIN said so itself (rule 9 of the coordinator), without sockets: it is not
partitioned away and forms nowhere else, so the host counts it as one seen to die for the majority and
does not wait for it; a refusal for too few names it as withdrawn. The earlier group's coordinator (a
grow's, closing) records a withdrawal that reached it, for the host forming next in its process."""

from pair import ENDPOINT, SESSION
from test_coordinator import contrib, feed, joined, newcomer_join
from test_withdrawn_join import Forming4, peer

from zcollective._format._wire import Kind, encode
from zcollective._protocol._coordinator import Coordinator, Forming, Phase
from zcollective._protocol._member import Member
from zcollective._protocol._ops import Op


def _welcomed(downs):
    return {to for to, m in downs if m.kind is Kind.WELCOME}


def test_two_of_three_members_withdrawing_from_a_grow_leave_the_host_and_the_newcomer_a_group():
    """The reviewer's M2: before, 'old ranks 0,3 could not form a group: fewer than half ... (a partition?)'
    though every process lived and ranks 1 and 2 had said they were gone."""
    f = Forming4()
    f.join(0, 1, 2)
    for r in (1, 2):
        assert [(to, m.kind) for to, m in f.up(r, [f.members[r].joining.withdraw()])] == [(r, Kind.BYE)]
    assert f.host.phase is Phase.JOINING and f.host.missing_joins() == [3]  # not waited for
    downs = f.up(3, f.members[3].start_join())  # the newcomer: everyone expected came or withdrew
    assert _welcomed(downs) == {0, 3} and f.host.phase is Phase.RUNNING
    assert f.host.old_ranks == [0, 3] and f.host.num_replicas == 2
    assert all(m.joined for m in (f.members[0], f.members[3]))
    assert not any(m.kind is Kind.REJECT for _, m in downs)


def test_a_withdrawal_whose_join_never_came_counts_too():
    """Interrupted before its connection was up: its JOIN never reached the host, its withdrawal does
    (sent on the first connection made): counted gone all the same."""
    f = Forming4()
    f.join(0, 3)
    f.members[1].start_join()  # (the JOIN queued, never delivered)
    assert [(to, m.kind) for to, m in f.up(1, [f.members[1].joining.withdraw()])] == [(1, Kind.BYE)]
    f.members[2].start_join()
    downs = f.up(2, [f.members[2].joining.withdraw()])
    assert (2, Kind.BYE) in [(to, m.kind) for to, m in downs] and _welcomed(downs) == {0, 3}
    assert f.host.phase is Phase.RUNNING and f.host.old_ranks == [0, 3]


def test_withdrawn_ranks_count_as_dead_at_the_forming_bound():
    """Of 5: ranks 0 and 1 came, 2 and 3 withdrew, 4 is silent (maybe partitioned): two of the three
    not gone is a majority, so at its bound the host forms with those that came (before: 2 of 5, none)."""
    host, members = _five()
    for r in (0, 1):
        host.receive(peer(r), encode(members[r].start_join()[0]))
    for r in (2, 3):
        members[r].start_join()
        host.receive(peer(r), encode(members[r].joining.withdraw()))
    assert host.phase is Phase.JOINING and host.missing_joins() == [4]
    assert _welcomed(_downs(host.form_now())) == {0, 1} and host.old_ranks == [0, 1]


def test_short_of_a_majority_the_host_asked_for_a_quorate_forming_waits_on():
    """A grow's host at its 2 s bound forms only if enough came (``form_now(quorate=True)``), else waits
    on for the others to come or withdraw; a withdrawal then completes the count."""
    host, members = _five()
    for r in (0, 1):
        host.receive(peer(r), encode(members[r].start_join()[0]))
    host.receive(peer(2), encode(members[2].start_join()[0]))  # (3 of 5: a majority, formed at once)
    assert _welcomed(_downs(host.form_now(quorate=True))) == {0, 1, 2}
    host, members = _five()
    host.receive(peer(0), encode(members[0].start_join()[0]))
    members[1].start_join()
    host.receive(peer(1), encode(members[1].joining.withdraw()))
    assert host.form_now(quorate=True) == [] and host.phase is Phase.JOINING  # 1 of 4: waits on
    for r in (2, 3):
        members[r].start_join()
        host.receive(peer(r), encode(members[r].joining.withdraw()))
    assert host.form_now(quorate=True) == []  # 1 in, 4 silent: 1 of 2 not gone is no majority: waits on
    members[4].start_join()
    downs = _downs(host.receive(peer(4), encode(members[4].joining.withdraw())))
    assert _welcomed(downs) == {0} and host.old_ranks == [0]  # every one came or withdrew: formed


def _five():
    host = Coordinator(5, SESSION, 1000, forming=Forming("ab12", frozenset(range(5)), 5))
    members = [Member(r, 5, ENDPOINT) for r in range(5)]
    for m in members:
        m.lineage = "ab12"
    return host, members


def test_too_few_is_still_refused_and_the_refusal_names_the_withdrawn():
    """Of 5: rank 1 withdrew, ranks 2-4 silent: one of four not gone is no majority (a partition may
    hold them); the message says rank 1 withdrew."""
    host, members = _five()
    for r in (0, 1):
        host.receive(peer(r), encode(members[r].start_join()[0]))
    host.receive(peer(1), encode(members[1].joining.withdraw()))
    [(to, refused)] = host.form_now()
    assert to == peer(0) and refused.kind is Kind.REJECT
    message = refused.body()["message"]
    assert "rank 1 withdrew" in message and "5 ranks" in message, message


def test_a_shrinks_host_counts_a_withdrawn_old_rank_above_the_new_size():
    """Old rank 0 lost, ranks 1-3 form at old rank 1 (3 expected, so old rank 3 is above the count of
    those expected): its withdrawal counts all the same, and 1 and 2 form without waiting for it."""
    host = Coordinator(4, SESSION, 1000, forming=Forming("ab12", frozenset({1, 2, 3}), 4, frozenset({0})))
    members = [Member(r, 4, ENDPOINT) for r in range(4)]
    for m in members:
        m.lineage = "ab12"
    host.receive(peer(1), encode(members[1].start_join()[0]))
    members[3].start_join()
    host.receive(peer(3), encode(members[3].joining.withdraw()))
    assert host.joining.withdrawn_ranks == {3} and host.missing_joins() == [2]
    downs = _downs(host.receive(peer(2), encode(members[2].start_join()[0])))
    assert _welcomed(downs) == {1, 2} and host.old_ranks == [1, 2]


def test_a_grows_host_names_ranks_withdrawn_at_the_earlier_coordinator_as_withdrawn():
    host = Coordinator(5, SESSION, 1000, forming=Forming("ab12", frozenset(range(5)), 5, frozenset({1}),
                                                         voters=4))
    member = Member(0, 5, ENDPOINT)
    member.lineage = "ab12"
    host.receive(peer(0), encode(member.start_join()[0]))
    [(_, refused)] = host.form_now()
    message = refused.body()["message"]
    assert "rank 1 withdrew" in message and "seen to die" not in message, message


def test_a_withdrawal_that_comes_back_as_a_join_is_counted_again():
    f = Forming4()
    f.join(0)
    f.members[1].start_join()
    f.up(1, [f.members[1].joining.withdraw()])
    assert 1 in f.host.joining.withdrawn_ranks
    again = Member(1, 4, ENDPOINT)  # a later try, a new connection
    again.lineage = "ab12"
    f.host.receive(b"R1-again", encode(again.start_join()[0]), "10.0.0.9")
    assert 1 not in f.host.joining.withdrawn_ranks and 1 in f.host.by_rank


def test_the_earlier_groups_coordinator_records_a_withdrawal_that_reached_it():
    """A grow's members reach rank 0's closing coordinator first: a withdrawal there is answered (as
    before) and its rank recorded, for the host forming next in the same process (see _elastic._host)."""
    old = joined(3)
    assert feed(old, b"N1", newcomer_join()) == []
    for r in range(3):
        feed(old, peer(r), contrib(r, 0, op=Op.GROW, segments=[]))
    assert old.phase is Phase.CLOSED
    member = Member(2, 4, ENDPOINT)
    member.lineage = f"{SESSION:x}"
    member.start_join()
    [(to, answer)] = old.receive(b"early", encode(member.joining.withdraw()))
    assert to == b"early" and answer.kind is Kind.BYE and old.joining.withdrawn_ranks == {2}


def test_a_newcomers_withdrawal_is_not_a_members():
    old = joined(3)
    feed(old, b"N1", newcomer_join(1))
    newcomer = Member(1, 1, ENDPOINT)
    newcomer.newcomer = True
    newcomer.start_join()
    msg = newcomer.joining.withdraw()
    old.receive(b"N1", encode(msg))
    assert not old.newcomers and old.joining.withdrawn_ranks == set()


def _downs(outs):
    return [(int(p[1:]), m) for p, m in outs]
