"""An interior rank of the tree of small calls, while its program is
elsewhere: a thread that takes the group's turn when nobody holds it, moves
what climbs through this rank and what comes down, and gives the turn back
(rank 0's server thread does the same for the coordinator). Without it, a
rank computing after an ``_async`` call would hold up its whole subtree until
its next wait. See docs/protocol.md, *Concurrency*.
"""

from __future__ import annotations

import logging
import threading
import time

from .._limits import AWAY_S, PARK_BUSY_S, PARK_IDLE_S
from .._protocol._member import Member
from ..errors import CollectiveError
from . import _interrupts, _sockets
from ._driver import Driver
from ._interrupts import Waiter
from ._turns import Turns

log = logging.getLogger("zcollective")

STOP = "stop"  # its waiter's name for the stop pipe
STOP_WAIT_S = 1.0  # closing waits this long for the thread (it holds the turn for microseconds)


class Relayer:
    """The background thread of one interior rank (see the module docstring)."""

    def __init__(self, turns: Turns, driver: Driver, member: Member) -> None:
        self._turns, self._driver, self._member = turns, driver, member
        self._stop = _sockets.Wakeup()  # readable once the thread must end
        self._park_waiter = Waiter((STOP, self._stop.fd))
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="zcollective-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread (from a thread holding the turn: it then finds it taken and parks)."""
        self._stopping = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            _interrupts.join(self._thread, STOP_WAIT_S)
        if not self._thread.is_alive():
            self._stop.close()

    def _park_s(self) -> float:
        """How long to park: briefly while this rank's calls or its subtree's parts are in flight."""
        member, mail = self._member, self._driver.mail
        busy = member.calls or (member.relay is not None and member.relay.calls) or (
            mail is not None and mail.holding())
        return PARK_BUSY_S if busy and member.failure is None else PARK_IDLE_S

    def _run(self) -> None:
        turns, member = self._turns, self._member
        while not self._park_waiter.wait((STOP,), None, self._park_s()):
            if turns.wanted() or time.monotonic() - turns.left < AWAY_S or not turns.try_take():
                continue
            try:
                if not self._stopping and member.failure is None:
                    self._driver.relay_io()
            except CollectiveError:
                pass  # (the member failed: its program hears of it at its next call)
            except Exception:  # a bug: the program's next wait meets the same state
                log.exception("zcollective rank %d: the relay thread failed", member.rank)
                return
            finally:
                turns.give()
