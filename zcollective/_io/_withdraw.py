"""A member forming a group whose wait for the host was cut short (an interrupt, or out of time)
after its JOIN went takes the JOIN back, so that the host never forms the group with a member that
is gone (rule 9 of the coordinator; the rules are :meth:`Joining.withdraw
<zcollective._protocol._member_join.Joining.withdraw>` and the coordinator's ``on_withdraw``)."""

from __future__ import annotations

import time

from .._limits import STATUS_WAIT_S
from .._protocol._member import Member
from ..errors import CollectiveError, from_signal
from . import _interrupts
from ._driver import Driver

WITHDRAW_WAIT_S = STATUS_WAIT_S  # a member taking its JOIN back waits at least this long for its host's
# word (a host forming serves at once; past it, the host is gone or stopped), and as long as its host
# may wait for it (the forming's bound)


def withdraw(link: Driver, member: Member, exc: BaseException, wait_s: float = WITHDRAW_WAIT_S,
             reach_s: float = WITHDRAW_WAIT_S) -> None:
    """``member``'s wait for the host of the group it forms ended by ``exc``, its JOIN maybe there: take
    the JOIN back and wait, interrupts held, at most ``wait_s`` (at least :data:`WITHDRAW_WAIT_S`) for the
    host's word, so the group forms with it on every rank or on none (the host counting it gone by its
    own word); a host not reached within ``reach_s`` is gone. Returns if the
    host formed the group with it first (a signal's interrupt then comes again once the library
    returned); else raises ``exc``."""
    if not member.joined and member.failure is None:
        with _interrupts.deferring():
            try:
                _take_back(link, member, not isinstance(exc, CollectiveError), max(wait_s, WITHDRAW_WAIT_S),
                           max(min(reach_s, wait_s), WITHDRAW_WAIT_S))
            except CollectiveError:
                pass  # refused, or the link broke: not counted there
    if not member.joined:
        raise exc
    if from_signal(exc):
        _interrupts.signal_again(exc)
    elif not isinstance(exc, CollectiveError):
        raise exc  # the program's own error, or an interrupt no signal brought: as any call's


def _take_back(link: Driver, member: Member, reaching: bool, wait_s: float, reach_s: float) -> None:
    """Send the withdrawal on each connection made to the host (its JOIN gone or queued: a connection
    not yet made, or one the host's earlier group closed, takes it to the host forming) until the host
    answers or formed with it, for ``wait_s`` at most (``reach_s`` while no connection is made: the host
    is gone), so the host hears it said so.
    ``reaching``: interrupted, its connection maybe not up yet (else given up: a host not reached
    never had its JOIN)."""
    now = time.monotonic()
    deadline, reached = now + wait_s, now + reach_s
    link.wait_for(lambda: member.joined, now)  # its connection's news first
    if not (member.greeted or member.joined or reaching):
        return
    bye = member.joining.withdraw()
    sent = [False]  # on this connection
    while not (member.joined or member.farewell) and time.monotonic() < deadline:
        if member.greeted and not sent[0]:
            link.send([bye])
        sent[0] = member.greeted
        if not sent[0] and time.monotonic() >= reached:
            return  # not reached (a refused port may be the host binding again): nobody there has its JOIN
        link.wait_for(lambda: member.joined or member.farewell or member.greeted != sent[0],
                      deadline if sent[0] else reached)
