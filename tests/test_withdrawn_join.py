"""A JOIN taken back before its WELCOME (rule 9 of the coordinator), without sockets: a member whose
wait for the group it forms was interrupted (or ran out of time) withdraws its JOIN with a BYE bound
to it; the host forgets it if the group has not formed (and counts nothing from that peer again),
or, having formed it first, changes nothing: its WELCOME went before, so the member is in. Either
way the group forms with it on every rank or on none."""

import pytest
from pair import ENDPOINT, SESSION
from test_coordinator import SESSION as OLD_SESSION
from test_coordinator import form_join, joined

from zcollective._format._wire import Kind, Signer, control, decode, encode
from zcollective._io._combine import applied
from zcollective._protocol._coordinator import Coordinator, Forming, Phase
from zcollective._protocol._member import ConnectionEvent, Member

LINEAGE = "ab12"
SECRET = b"0123456789abcdef-the-job-secret"


def peer(rank):
    return b"R%d" % rank


class Forming4:
    """A host forming a group of old ranks 0-3 (a grow's), and the members joining it; messages move
    when a test says so, as real frames (with the job's secret if ``secret``)."""

    def __init__(self, secret=False):
        self.signer = Signer(SECRET) if secret else None
        self.host = Coordinator(4, SESSION, 1000, self.signer,
                                forming=Forming(LINEAGE, frozenset(range(4)), 4, voters=3))
        self.members = [self._member(r) for r in range(4)]

    def _member(self, rank):
        member = Member(rank, 4, ENDPOINT, self.signer)
        member.lineage = LINEAGE
        member.connection(ConnectionEvent.CONNECTED)
        member.connection(ConnectionEvent.HANDSHAKE_SUCCEEDED)
        return member

    def up(self, rank, msgs):
        """``rank`` sends ``msgs``; every answer is delivered, in order, until none is left."""
        flight = [("up", rank, encode(m, self.signer)) for m in msgs]
        downs = []
        while flight:
            way, r, frames = flight.pop(0)
            if way == "up":
                for p, out in applied(self.host.receive(peer(r), frames, "10.0.0.9"), self.host):
                    to = int(p[1:])
                    downs.append((to, decode(encode(out, self.signer), signer=self.signer)))
                    flight.append(("down", to, encode(out, self.signer)))
            else:
                flight += [("up", r, encode(m, self.signer)) for m in self.members[r].receive(frames)]
        return downs

    def join(self, *ranks):
        for r in ranks:
            self.up(r, self.members[r].start_join())


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "secret"])
def test_a_join_taken_back_before_the_group_forms_is_forgotten_and_the_others_form_without_it(secret):
    f = Forming4(secret)
    f.join(0, 1, 2)
    two = f.members[2]
    assert f.host.missing_joins() == [3]
    answers = f.up(2, [two.joining.withdraw()])
    assert [(to, m.kind) for to, m in answers] == [(2, Kind.BYE)]  # bound to its JOIN: taken in
    assert two.farewell and not two.joined and two.failure is None
    assert f.host.phase is Phase.JOINING and f.host.missing_joins() == [3]  # (not waited for)
    # nothing it sent before counts again: a JOIN sent again (a resend, a challenge's echo)
    assert f.up(2, [two.join()]) == [] and f.host.missing_joins() == [3]
    assert two.joining.on_timer(two.clock() + 60) == []  # and its member sends none
    assert two.connection(ConnectionEvent.DISCONNECTED) == []
    assert two.connection(ConnectionEvent.HANDSHAKE_SUCCEEDED) == []
    downs = f.up(3, f.members[3].start_join())  # the newcomer: the host forms at once (rank 2 is gone)
    welcomed = {to for to, m in downs if m.kind is Kind.WELCOME}
    assert welcomed == {0, 1, 3} and f.host.old_ranks == [0, 1, 3] and f.host.phase is Phase.RUNNING


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "secret"])
def test_a_join_taken_back_after_the_host_formed_with_it_changes_nothing(secret):
    f = Forming4(secret)
    f.join(0, 1, 3)
    two = f.members[2]
    joined = f.up(2, two.start_join())  # its JOIN completes the group: every member is welcomed
    assert {to for to, m in joined if m.kind is Kind.WELCOME} == {0, 1, 2, 3} and two.joined
    # its withdrawal, sent before it read its WELCOME, comes after the group formed: it is a member
    assert f.host.receive(peer(2), encode(_withdrawal(two), f.signer), "10.0.0.9") == []
    assert f.host.phase is Phase.RUNNING and f.host.num_replicas == 4 and f.host.failure is None


def _withdrawal(member):
    """The BYE a member not yet welcomed sends (``member`` was, since: its JOIN's token is the binding)."""
    msg = member.joining.withdraw()
    assert msg.kind is Kind.BYE and msg.session == member.joining.token != SESSION
    return msg


def test_a_peer_that_withdraws_before_its_join_was_counted_is_answered_and_never_counted():
    f = Forming4(secret=True)
    one = f.members[1]
    [(_, challenge)] = f.host.receive(peer(1), encode(one.start_join()[0], f.signer))
    assert challenge.kind is Kind.CHALLENGE  # (not counted yet: its JOIN must echo this)
    answers = f.up(1, [one.joining.withdraw()])
    assert [(to, m.kind) for to, m in answers] == [(1, Kind.BYE)] and one.farewell
    assert one.receive(encode(challenge, f.signer)) != []  # the challenge read late: its member echoes it
    assert f.up(1, [one.join(one.challenge)]) == [] and 1 not in f.host.by_rank  # never counted


def test_a_join_taken_back_while_a_group_first_starts_opens_its_slot_again():
    host = Coordinator(2, SESSION, 1000)
    member = Member(1, 2, ENDPOINT)
    [join] = member.start_join()
    assert host.receive(peer(1), encode(join)) == [] and host.missing_joins() == [0]
    [(to, answer)] = host.receive(peer(1), encode(member.joining.withdraw()))
    assert to == peer(1) and answer.kind is Kind.BYE and host.missing_joins() == [0, 1]


def test_a_welcomed_members_bye_is_still_its_ending():
    host = Coordinator(2, SESSION, 1000)
    members = [Member(r, 2, ENDPOINT) for r in range(2)]
    for r, m in enumerate(members):
        for p, out in host.receive(peer(r), encode(m.start_join()[0])):
            members[int(p[1:])].receive(encode(out))
    assert all(m.joined for m in members) and host.phase is Phase.RUNNING
    out = host.receive(peer(1), encode(members[1].bye()))
    assert host.by_rank[1].ended == 0 and [m.kind for _, m in out] == [Kind.BYE]


def test_a_withdrawal_reaching_the_earlier_groups_coordinator_is_answered_at_once():
    """Forming too early, a member reaches the earlier group's coordinator, still open (its host busy
    in its own code): told NotFormingHere, and still read, so its withdrawal is answered at once (a
    shrink going on to the next would-be host loses no time)."""
    old = joined(3)
    old.lost(2, "test")  # failed: the survivors shrink
    member = Member(1, 3, ENDPOINT)
    member.lineage = f"{OLD_SESSION:x}"
    join = member.start_join()[0]
    body = form_join(1, 3, lineage=member.lineage).body()
    body["nonce"] = join.body()["nonce"]
    for _ in range(2):  # a JOIN sent again is told again (the member only learns its host is busy)
        [(_, refused)] = old.receive(b"early", encode(control(Kind.JOIN, body, rank=1)))
        assert refused.kind is Kind.REJECT and refused.body()["error"] == "NotFormingHere"
        member.receive(encode(refused))
        assert member.host_busy and member.failure is None
    [(_, answer)] = old.receive(b"early", encode(member.joining.withdraw()))
    assert answer.kind is Kind.BYE
    member.receive(encode(answer))
    assert member.farewell and old.phase is Phase.FAILED
