"""Point-to-point rules without sockets (zcollective._protocol._p2p): MPI's matching, the
order of each pair's messages, the window a sender may fill at a receiver and the credit that
frees it."""

import pytest

from zcollective._protocol._p2p import (
    ANY_SOURCE,
    ANY_TAG,
    MAX_TAG,
    Credit,
    Mailbox,
    OutOfOrder,
    Receive,
    Status,
    check_rank,
    check_tag,
)

WINDOW = 1000


def test_an_arriving_message_completes_the_earliest_posted_receive_it_matches():
    box = Mailbox(0, 3, WINDOW)
    tag5, anyone, from2 = Receive(ANY_SOURCE, 5, "a"), Receive(ANY_SOURCE, ANY_TAG, "b"), Receive(2, 7, "c")
    for r in (tag5, anyone, from2):
        assert box.post(r) == (None, [])
    done, _ = box.arrive(2, 7, 0, 10, "m0")
    assert done[0] is anyone and done[1].message == "m0"  # posted before from2, and it matches
    done, _ = box.arrive(1, 5, 0, 10, "m1")
    assert done[0] is tag5
    done, _ = box.arrive(2, 7, 1, 10, "m2")
    assert done[0] is from2 and box.posted == []


def test_a_receive_takes_the_earliest_arrived_match_and_each_pair_keeps_its_order():
    box = Mailbox(0, 3, WINDOW)
    box.arrive(1, 3, 0, 1, "1:3:a")
    box.arrive(2, 3, 0, 1, "2:3:a")
    box.arrive(1, 4, 1, 1, "1:4")
    box.arrive(1, 3, 2, 1, "1:3:b")
    assert box.probe(ANY_SOURCE, 4) == Status(1, 4, 1)
    assert box.probe(2, 4) is None
    taken = [box.post(Receive(s, t, None))[0].message for s, t in
             [(1, ANY_TAG), (ANY_SOURCE, 3), (1, 3), (ANY_SOURCE, ANY_TAG)]]
    assert taken == ["1:3:a", "2:3:a", "1:3:b", "1:4"]  # non-overtaking within (source, tag)
    assert box.probe(ANY_SOURCE, ANY_TAG) is None


def test_a_message_out_of_its_pairs_order_is_refused():
    box = Mailbox(0, 2, WINDOW)
    box.arrive(1, 0, 0, 1, "first")
    with pytest.raises(OutOfOrder, match="message 0 from rank 1, where 1 was next"):
        box.arrive(1, 0, 0, 1, "replayed")
    with pytest.raises(OutOfOrder):
        box.arrive(1, 0, 5, 1, "skipped ahead")
    assert len(box.arrived) == 1


def test_a_sender_fills_its_window_then_waits_for_credit():
    sender, receiver = Mailbox(0, 2, WINDOW), Mailbox(1, 2, WINDOW)
    assert sender.may_send(1, 5 * WINDOW)  # one message of any size when nothing is held
    seqs = [sender.send(1, 400), sender.send(1, 400)]
    assert seqs == [0, 1] and not sender.may_send(1, 400) and sender.may_send(1, 200)
    assert sender.ask(1) and not sender.ask(1)  # asks once
    for seq in seqs:
        receiver.arrive(0, 0, seq, 400, seq)
    assert receiver.asked(0) == []  # nothing received by the program yet: owed at the next take
    came, credit = receiver.post(Receive(0, ANY_TAG, None))
    assert came.seq == 0 and credit == [Credit(0, 0)]  # owed: at once
    sender.credited(1, 0)
    assert sender.may_send(1, 600) and not sender.may_send(1, 601) and sender.ask(1)
    came, credit = receiver.post(Receive(0, ANY_TAG, None))
    assert came.seq == 1 and credit == [Credit(0, 1)]  # 400 bytes: over a quarter of the window


def test_credit_is_sent_once_a_quarter_of_the_window_was_received():
    receiver = Mailbox(1, 2, WINDOW)
    for seq in range(5):
        receiver.arrive(0, 0, seq, 100, seq)
    credits = [receiver.post(Receive(0, 0, None))[1] for _ in range(5)]
    assert credits == [[], [], [Credit(0, 2)], [], []]  # 300 bytes >= 250


def test_messages_to_oneself_are_credited_without_travelling():
    box = Mailbox(0, 1, WINDOW)
    seq = box.send(0, 900)
    assert not box.may_send(0, 200)
    assert box.arrive(0, 1, seq, 900, "me") == (None, [])
    came, credit = box.post(Receive(0, 1, None))
    assert came.message == "me" and credit == [] and box.may_send(0, WINDOW)


def test_a_withdrawn_receive_takes_nothing():
    box = Mailbox(0, 2, WINDOW)
    r = Receive(1, 0, None)
    box.post(r)
    assert box.withdraw(r) and not box.withdraw(r)
    assert box.arrive(1, 0, 0, 1, "m") == (None, [])
    assert box.held_from(1) == 1


def test_tags_and_ranks_are_checked():
    assert check_tag(0, False) == 0 and check_tag(MAX_TAG, False) == MAX_TAG
    assert check_tag(ANY_TAG, True) == ANY_TAG
    for bad in (-1, MAX_TAG + 1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="is not an int from 0 to"):
            check_tag(bad, False)
    assert check_rank(ANY_SOURCE, 4, "source", any_source=True) == ANY_SOURCE
    with pytest.raises(ValueError, match="dest=4 is not a rank of this group of 4 replicas"):
        check_rank(4, 4, "dest")
    with pytest.raises(ValueError):
        check_rank(ANY_SOURCE, 4, "dest")
