"""A member's driver at the group's edges: joining, the tree's links, ending (teardown, or the
program ends), and a send that cannot finish (taken back, or let leave). It moves everything
through the driver's one wait (:meth:`Driver.wait_for`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Optional

from .._format._wire import Message
from .._limits import POLL_SLICE_S, SENT_AT_FAILURE_S, TREE_LINK_WAIT_S
from .._protocol._p2p import ANY_SOURCE
from ..config import Config
from ..errors import CollectiveError, CollectiveTimeoutError
from ._driver import Driver
from ._mailbox import LINK, TRACKER_POLL_S


class Edges:
    """Joining and ending for one member's :class:`Driver`."""

    def __init__(self, driver: Driver) -> None:
        self.driver, self.member = driver, driver.member

    def send_waiting(self, deadline: Optional[float], links: bool = True) -> bool:
        """Ending: move everything until no send waits for credit or (``links``) a handshake, or
        ``deadline`` (False)."""
        mail, sockets = self.member.mail, self.driver.mail
        if mail is None:
            return True

        def sent() -> bool:
            return not (mail.out or mail.sending()) and (
                not links or sockets is None or not sockets.holding(mail.gone()))
        return sent() or self.driver.wait_for(sent, deadline)

    def finish_calls(self, deadline: Optional[float]) -> bool:
        """Teardown, FINAL sent: move everything until every call this rank made is done and every other
        rank's last message was taken in, or ``deadline`` (False)."""
        member, mail, driver = self.member, self.member.mail, self.driver

        def done() -> bool:
            return not (member.calls or driver.tracked) and (mail is None or mail.box.drained(ANY_SOURCE))
        return driver.wait_for(done, deadline)

    def leaving(self) -> dict[int, int]:
        """By rank still running, the first seq of the sends libzmq still sends."""
        rules = self.member.mail
        if rules is None or not self.driver.tracked:
            return {}
        return rules.leaving({id(h) for t, h in self.driver.tracked if not t.done})

    def say_bye(self, timeout: float, deliver: float = 0.0) -> None:
        """Tell the coordinator this program is ending and wait at most ``timeout`` s for its answer
        (docs/protocol.md, *Ending without teardown*); messages still leaving get ``deliver`` s first."""
        member = self.member
        bye = member.bye()
        if bye is None:
            return
        now = time.monotonic()
        final = self.final(teardown=False, deadline=now + timeout, deliver=now + deliver)  # (before the BYE)
        self.driver.send([bye] if final is None else [final, bye])
        if self.driver.remote:  # (no data moves: finish_data had its time)
            until, driver = time.monotonic() + timeout, self.driver
            while not member.farewell and member.failure is None and driver.pump(until):
                pass

    def link_tree(self, deadline: Optional[float]) -> None:
        """Joined into a tree: link parent and children, waiting for handshakes until ``deadline``."""
        member, sockets = self.member, self.driver.mail
        if sockets is None or member.mail is None or (member.parent <= 0 and member.relay is None):
            return
        ranks = [*([member.parent] if member.parent > 0 else []),
                 *(member.relay.children if member.relay is not None else ())]
        sockets.connect(ranks)
        until = time.monotonic() + TREE_LINK_WAIT_S
        self._wait_links(lambda: sockets.made(ranks) or member.failure is not None,
                         until if deadline is None else min(deadline, until))

    def relay_out(self, deadline: float) -> None:
        """An interior rank's program ends: its subtree's parts of its calls climb on through it until none
        is held here, the group fails, or ``deadline``."""
        member, relay = self.member, self.member.relay
        if relay is None or member.mail is None:
            return
        while member.failure is None and (any(seq < member.next_seq for seq in relay.calls)
                                          or member.awaits_tree()):  # (its results, to pass down)
            now = time.monotonic()
            if now >= deadline:
                return
            self.driver.pump(min(deadline, now + POLL_SLICE_S))
            self.driver.mail_io(ready=self.driver.mail_ready)
            self.driver.mail_ready = 0

    def hand_down(self, deadline: float) -> None:
        """Closing: results owed to children, waiting for a handshake, get until ``deadline`` to go."""
        sockets = self.driver.mail
        if self.member.relay is None or sockets is None or self.member.mail is None:
            return
        self._wait_links(lambda: not sockets.holding(), deadline)

    def _wait_links(self, done: Callable[[], bool], deadline: float) -> None:
        """Send what the mailbox owes and take in its links' news until ``done()`` or ``deadline``."""
        self.driver.mail_io(take=False, ready=LINK)
        while not done() and time.monotonic() < deadline:
            self.driver.waiter.wait(self.driver.mail_names, deadline, POLL_SLICE_S)
            self.driver.mail_io(take=False, ready=LINK)

    def final(self, teardown: bool, deadline: float, deliver: Optional[float] = None) -> Optional[Message]:
        """This rank's FINAL (:meth:`Member.final`) once messages waiting for a handshake had until
        ``deadline`` (then they fail, uncounted); ``deliver``: until then messages still leaving may go, the
        rest counted lost so their receiver is told at once."""
        member, sockets = self.member, self.driver.mail
        unsent, leaving = None, None
        self.hand_down(deadline)  # (results owed down the tree go first, failed or not)
        if sockets is not None and member.mail is not None and member.failure is None:
            with contextlib.suppress(CollectiveError):  # (the group failed: no FINAL goes)
                self.driver.mail_io(take=False)
                if deliver is None:
                    self.driver.wait_for(lambda: not sockets.holding(), deadline)
                else:  # (a receiver stopped within the bound answers a handshake, takes them in, after)
                    self.driver.wait_for(lambda: not (sockets.holding() or self.leaving()),
                                         max(deadline, deliver))
            unsent = sockets.drop_held()
            leaving = self.leaving() if deliver is not None else None
            if leaving:
                sockets.cut_off(leaving)
        return member.final(teardown, unsent, leaving)  # (the unsent sends' outcomes: the caller's to settle)

    def await_admission(self, config: Config, deadline: Optional[float]) -> None:
        """A newcomer: wait until a grow() admits it (rule 10); :attr:`Member.admitted` says where."""
        member = self.member
        if not self.driver.send_join(lambda: member.admitted is not None, deadline):  # (parked anew)
            raise CollectiveTimeoutError(
                f"a newcomer was not admitted to the group at {config.endpoint} within "
                f"{config.init_timeout:g} s: its members admit newcomers when they call grow()"
                + ("" if member.greeted or member.connected else "; the coordinator could not be "
                   "reached there (is the address right? after rank 0's loss, "
                   "coordinator_address() on a member says where the group is)"))

    def take_back(self, handle: Any) -> bool:
        """Take back the send ``handle`` whose message still waits for its link (timed out, interrupted): only
        the last numbered for its rank, so that pair's numbers stay whole. Was it taken back?"""
        sockets, rules = self.driver.mail, self.member.mail
        if sockets is None or rules is None:
            return False
        dest = sockets.held_last(held := rules.sent_as(handle))  # (an ssend's: held as its message's)
        if dest is None or not rules.unsend(dest, handle):
            return False
        sockets.drop_send(dest, held)
        return True

    def where(self, handle: Any) -> Optional[tuple[str, int, bool]]:
        """Where the send ``handle`` waits, once it left the rules: ``"link"``
        (its link's handshake) or ``"leaving"`` (libzmq still sends its
        buffers); the rank; and whether :meth:`take_back` would take it back."""
        sockets, rules = self.driver.mail, self.member.mail
        if sockets is None or rules is None:
            return None
        dest = sockets.holds(held := rules.sent_as(handle))  # (an ssend's: held as its message's)
        if dest is not None:
            last = rules.box.peers[dest].unreceived
            return "link", dest, sockets.held_last(held) == dest and bool(last) and last[-1][2] is handle
        if any(h is held for t, h in self.driver.tracked if not t.done):
            found = rules.leaving({id(handle)})
            if found:
                return "leaving", next(iter(found)), False
        return None

    def finish_leaving(self, handle: Any, deadline: Optional[float]) -> None:
        """The group failed while libzmq sends the send ``handle``'s message (its receiver, not the rank lost,
        takes it in even so): it gets until ``deadline``, at most
        :data:`~zcollective._limits.SENT_AT_FAILURE_S`, to leave and be done, so that a send that raises was
        never delivered (but for one cut off at that bound, its receiver stopped)."""
        where, lost = self.where(handle), getattr(self.member.failure, "lost_ranks", ())
        if where is None or where[0] != "leaving" or where[1] in lost:
            return
        until = time.monotonic() + SENT_AT_FAILURE_S
        until = until if deadline is None else min(deadline, until)
        driver = self.driver
        with contextlib.suppress(CollectiveError):
            while any(h is handle for _, h in driver.tracked) and time.monotonic() < until:
                driver.waiter.wait(driver.mail_names, until, TRACKER_POLL_S)
                driver.mail_io(take=False)
