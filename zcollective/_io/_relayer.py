"""An interior rank of the tree while its program is elsewhere: a stand-in thread moves what climbs
through it and comes down, so its subtree is not held up (docs/protocol.md, *Concurrency*)."""

from __future__ import annotations

import logging

from .._protocol._member import Member
from ..errors import CollectiveError
from ._driver import Driver
from ._turns import StandIn, Turns

log = logging.getLogger("zcollective")

STOP_WAIT_S = 1.0  # closing waits this long for the thread (it holds the turn for microseconds)


def relayer(turns: Turns, driver: Driver, member: Member) -> StandIn:
    """The stand-in of one interior rank (started by its owner, ended with ``end(STOP_WAIT_S)``)."""

    def busy() -> bool:  # parks briefly while this rank's calls or its subtree's parts are in flight
        mail = driver.mail
        return bool(member.calls or (member.relay is not None and member.relay.calls) or (
            mail is not None and mail.holding())) and member.failure is None

    def serve() -> bool:
        if member.failure is not None:
            return False
        try:
            driver.progress(data=False)
        except CollectiveError:
            pass  # (the member failed: its program hears of it at its next call)
        except Exception:  # a bug: the program's next wait meets the same state
            log.exception("zcollective rank %d: the relay thread failed", member.rank)
            return True
        return False

    return StandIn("zcollective-relay", turns, serve, busy, lambda exc: None)
