"""A send to a rank in teardown goes if a receive it posted before its teardown waits for it.

Found by CI (test_compose_endings, 1 run in 1,170): rank 2 posted receives from rank 1, called teardown,
and its FINAL reached rank 1 before rank 1 posted its sends; rank 1's sends then failed (`cannot go: rank 2
called teardown`) and rank 2's receives with them, though rank 2's teardown still took messages in for
them. The FINAL of a teardown now lists, for each rank, the tags of the receives still posted that its
messages could match; sends that one of them waits for go, and others fail as before.
"""

from collections import deque

from zcollective._format import _bodies
from zcollective._format._wire import Kind
from zcollective._protocol._p2p import Mail
from zcollective.testing import run_replicas

WINDOW = 1000
ENDED = "rank 2 called teardown (pid 8 on h)"


def _mail(rank=1, size=3):
    return Mail(rank, size, WINDOW, session=7, outcomes=deque())


def _went(mail):
    return [m.root for _, m, _ in mail.out if m.kind is Kind.SEND]  # (a SEND's root: its tag)


def _failed(mail):
    return [(o.future, str(o.error)) for o in mail.outcomes if o.error is not None]


def test_sends_that_posted_receives_wait_for_go_to_a_rank_in_teardown_and_others_fail():
    mail = _mail()
    mail.ended(2, 0, ENDED, True, 0, 0, [0, 2, 3])
    for tag in range(4):
        mail.send(2, tag, [b"x"], f"tag {tag}")
    assert _went(mail) == [0, 2, 3]
    assert _failed(mail) == [("tag 1", "rank 1: send(dest=2, tag=1) cannot go: rank 2 called teardown (pid 8 "
                                       "on h): its program receives nothing more (nothing was sent)")]


def test_each_posted_receive_lets_one_send_go_any_tag_included():
    mail = _mail()
    mail.ended(2, 0, ENDED, True, 0, 0, [-1, 5])
    for tag in (5, 5, 5):
        mail.send(2, tag, [b"x"], "s")
    assert _went(mail) == [5, 5] and len(_failed(mail)) == 1


def test_messages_on_their_way_and_waiting_for_credit_take_the_posted_receives_first():
    mail = _mail()
    mail.send(2, 4, [bytes(WINDOW)], "on its way")  # fills the window
    mail.send(2, 4, [b"y"], "waiting for credit")
    mail.ended(2, 0, ENDED, True, 0, 0, [4, 4, 4])  # received none of rank 1's: both still to come
    mail.send(2, 4, [b"z"], "third")
    mail.send(2, 4, [b"w"], "fourth")
    assert [f for f, _ in _failed(mail)] == ["fourth"]
    mail.ended(2, 0, ENDED, True, [1], 0, [4])  # said again (a second FINAL): nothing changes
    assert _went(mail) == [4]


def test_a_received_message_takes_no_posted_receive():
    mail = _mail()
    mail.send(2, 4, [b"a"], "received")
    mail.ended(2, 0, ENDED, True, 1, 0, [4])
    mail.send(2, 4, [b"b"], "goes")
    assert _failed(mail) == [] and _went(mail) == [4, 4]


def test_unsaid_posted_receives_let_every_send_go_and_an_exit_lets_none():
    mail = _mail()
    mail.ended(2, 0, ENDED, True, 0, 0, None)
    mail.send(2, 9, [b"x"], "goes")
    assert _failed(mail) == []
    mail.outcomes.clear()
    mail.ended(2, 1, "rank 2 ended its program (without teardown) (pid 8 on h)", False, 1, 0)
    mail.send(2, 9, [b"x"], "fails")
    assert [f for f, _ in _failed(mail)] == ["fails"]


def test_the_final_carries_the_posted_tags_to_each_rank_within_a_bound():
    final = _bodies.final([0, 0, 0], True, [0, 0, 0], [0, 0, 0], 0, [[1, -1], None, [7] * 3],
                          rank=0, session=7)
    parsed = _bodies.parse_final(final, 3)
    assert parsed["posted"] == [[1, -1], None, [7, 7, 7]]
    told = _bodies.ended("rank 0 called teardown", 0, 0, teardown=True, posted=parsed["posted"][0],
                         rank=1, root=0, seq=0, session=7)
    assert _bodies.ended_counts(told) == (0, 0) and _bodies.ended_posted(told) == [1, -1]
    many = _bodies.final([0, 0], True, None, None, 0, [[3] * _bodies.MAX_POSTED_TAGS, [4]], rank=0, session=7)
    assert _bodies.parse_final(many, 2)["posted"] == [[3] * _bodies.MAX_POSTED_TAGS, None]
    bad = _bodies.ended("x", 0, 0, teardown=True, posted=[1 << 40], rank=1, root=0, seq=0, session=7)
    assert _bodies.ended_posted(bad) is None


def _late_sender():
    """Rank 1 posts a receive from rank 0 and calls teardown at once; rank 0 sends it only once rank 1's
    teardown is known here (a send tagged 99, which no receive waits for, fails)."""
    import time

    import zcollective as zc

    if zc.get_rank() == 1:
        got = zc.recv_async(0, tag=5)
        zc.teardown()
        return got.result(timeout=1)
    deadline = time.monotonic() + 30
    while True:
        zc.iprobe(1, tag=98)  # (takes in the news: a program that only sends, never waiting, reads none)
        try:
            zc.send("probe", 1, tag=99, timeout=5)  # goes (dropped by rank 1's teardown) until its FINAL came
        except zc.PeerEndedError as exc:
            told = str(exc)
            break
        if time.monotonic() > deadline:
            raise AssertionError("rank 1's teardown was never known here")
        time.sleep(0.01)
    zc.send("late", 1, tag=5, timeout=10)
    zc.teardown()
    return told


def test_a_receive_posted_before_teardown_gets_a_message_sent_after_the_teardown_was_known():
    told, got = run_replicas(_late_sender, 2, timeout=60)
    assert told.startswith("rank 0: send(dest=1, tag=99) cannot go: rank 1 called teardown"), told
    assert got == "late"


# -- the reviewer's findings (r-end) --------------------------------------------------------------------


def test_a_send_taken_back_gives_its_posted_receive_back_to_the_next():
    """m1: a send that took a posted receive, then waited for credit and was taken back (timeout,
    Ctrl-C), kept it: a retry failed `cannot go` while the receive still waited."""
    mail = _mail()
    mail.send(2, 7, [bytes(WINDOW)], "fills the window")
    mail.ended(2, 0, ENDED, True, 0, 0, [5])
    mail.send(2, 5, [b"y"], "first try")  # takes the receive, waits for credit
    assert mail.waiting_for("first try") == 2 and mail.withdraw("first try")
    mail.send(2, 5, [b"y"], "retry")
    assert _failed(mail) == [] and mail.waiting_for("retry") == 2
    mail.send(2, 5, [b"z"], "one too many")
    assert [f for f, _ in _failed(mail)] == ["one too many"]


def test_a_waiting_send_taken_back_after_the_final_gives_its_receive_back_too():
    mail = _mail()
    mail.send(2, 7, [bytes(WINDOW)], "fills the window")
    mail.send(2, 5, [b"y"], "waiting")
    mail.ended(2, 0, ENDED, True, 0, 0, [5])  # the waiting send takes the receive
    assert mail.withdraw("waiting")
    mail.send(2, 5, [b"y"], "again")
    assert _failed(mail) == []


def test_a_rank_lists_no_receives_for_itself_and_the_bound_is_for_all_ranks():
    """m2: its own list (nobody else sends as it) spent the bound, so a rank's that mattered went
    unsaid; and the parser bounded each rank's list, not all together as documented."""
    mail = Mail(0, 2, WINDOW, session=7, outcomes=deque())
    for i in range(300):
        mail.receive(-1, 5, f"r{i}")  # ANY_SOURCE
    posted = mail.open_to()
    assert posted[0] == [] and len(posted[1]) == 300
    parsed = _bodies.parse_final(_bodies.final([0, 0], True, [0, 0], [0, 0], 0, posted, rank=0, session=7), 2)
    assert parsed["posted"] == [[], [5] * 300]
    hostile = _bodies.control(Kind.FINAL, {"sent": [0, 0, 0], "how": "teardown",
                                           "posted": [[1] * 400, [2] * 400, [3]]}, rank=0, session=7)
    assert _bodies.parse_final(hostile, 3)["posted"] == [[1] * 400, None, [3]]


def test_a_synchronous_send_that_cannot_go_is_named_ssend():
    """m4: it was named `send(...)`."""
    mail = _mail()
    mail.ended(2, 0, ENDED, True, 0, 0, [])
    mail.send(2, 6, [b"x"], "ssend", sent="its message")
    assert _failed(mail) == [("ssend", "rank 1: ssend(dest=2, tag=6) cannot go: rank 2 called teardown "
                                       "(pid 8 on h): its program receives nothing more (nothing was sent)")]
