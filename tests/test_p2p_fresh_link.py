"""A link to a rank heard from sends at once, before its handshake is seen (issue 46's ssend
acknowledgements). Its handshake failing for another cause than a refused token (the rank closed its
mailbox mid-handshake as its program ended: found attacking this round's work, 5 of 90 loaded runs
failed the group with ReplicaLostError) is no broken link: libzmq tries again, and the rank's FINAL
settles what it received. A refusal (a spent token) still breaks it, as one of a made link does."""

import pytest
import zmq

from zcollective._io import _mailbox
from zcollective._io._mailbox import MailSockets


def _sockets_with(events, made=(), fresh=()):
    box = object.__new__(MailSockets)  # the decision alone: no socket
    box._made, box._fresh, box.retry, box._held = set(made), set(fresh), {}, {}
    return box, events


@pytest.fixture
def events(monkeypatch):
    said = []
    monkeypatch.setattr(_mailbox._sockets, "monitor_events", lambda monitor: list(said))
    return said


@pytest.mark.parametrize("event", [zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL])
def test_a_fresh_links_handshake_cut_short_is_not_a_broken_link(events, event):
    box, _ = _sockets_with(events, fresh={1})
    events.append((event, None))
    assert box._look(1, None, 0.0) == ([], None)
    assert box.retry == {}  # (libzmq tries again itself: its messages are queued there)


def test_a_fresh_links_refused_token_breaks_it(events):
    box, _ = _sockets_with(events, fresh={1})
    events.append((zmq.EVENT_HANDSHAKE_FAILED_AUTH, None))
    assert box._look(1, None, 0.0) == ([], 1)


@pytest.mark.parametrize("event", [zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_AUTH])
def test_a_made_links_failed_handshake_breaks_it_and_an_unkeyed_ones_is_tried_again(events, event):
    box, _ = _sockets_with(events, made={1})
    events.append((event, None))
    assert box._look(1, None, 0.0) == ([], 1)
    box, _ = _sockets_with(events)
    assert box._look(2, None, 0.0) == ([], None) and 2 in box.retry
