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

WITHDRAW_WAIT_S = STATUS_WAIT_S  # a member taking its JOIN back waits this long for its host's word
# (a host forming serves at once; past it, the host is gone or stopped)


def withdraw(link: Driver, member: Member, exc: BaseException) -> None:
    """``member``'s wait for the host of the group it forms ended by ``exc``, its JOIN maybe there: take
    the JOIN back and wait, interrupts held, at most :data:`WITHDRAW_WAIT_S` for the host's word, so the
    group forms with it on every rank or on none. Returns if the host formed the group with it first (a
    signal's interrupt then comes again once the library returned); else raises ``exc``."""
    if not member.joined and member.failure is None:
        with _interrupts.deferring():
            try:
                link.wait_for(lambda: member.joined, time.monotonic())  # its connection's news first
                if member.greeted and not member.joined:  # (no handshake yet: its JOIN never went)
                    link.send([member.joining.withdraw()])
                    link.wait_for(lambda: member.joined or member.farewell or not member.greeted,
                                  time.monotonic() + WITHDRAW_WAIT_S)
            except CollectiveError:
                pass  # refused, or the link broke: not counted there
    if not member.joined:
        raise exc
    if from_signal(exc):
        _interrupts.signal_again(exc)
    elif not isinstance(exc, CollectiveError):
        raise exc  # the program's own error, or an interrupt no signal brought: as any call's
