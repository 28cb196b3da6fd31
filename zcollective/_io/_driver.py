"""Drivers of a :class:`~zcollective._protocol._member.Member`: how its messages reach
the coordinator and the replies come back. :class:`Driver` holds what every
driver does the same way; a subclass says how one message is sent and how to
wait for the next. See docs/protocol.md, *Topology* and *Drivers*.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from functools import partial
from threading import get_ident
from typing import TYPE_CHECKING, Any, Callable, Optional

from .._format._wire import DEFAULT_MAX_FRAMES, Kind, Message, WireError, decode, encode, owned
from .._limits import POLL_SLICE_S, STATUS_WAIT_S
from .._protocol._member import NO_DUE, Member
from .._protocol._outcomes import CallOutcome, fresh
from ..errors import CollectiveError, CollectiveTimeoutError
from . import transport
from ._combine import answer, applied
from ._interrupts import NUDGE, Waiter, user_code
from ._mailbox import LINK, LOCAL, MAIL, MESSAGE, TAKE_BATCH, TRACKER_POLL_S

if TYPE_CHECKING:
    from .._protocol._coordinator import Coordinator
    from ._dataplane import DataPlane
    from ._server import Server
    from ._shared import SharedPlane


class Driver:
    """What every member's driver does; subclasses send and wait."""

    remote = False  # True when the coordinator is at the other end of a connection
    fixed_slice_s: Optional[float] = None  # :meth:`slice_s`, when it never changes (read without a call)
    queued: tuple[Any, ...] = ()  # queues whose messages a wait for mail must not sleep on (rank 0's)
    warn_after: Optional[float] = None  # a join waiting this long says so (rank 0's coordinator does)

    def __init__(self, member: Member) -> None:
        self.member = member
        self.data: Optional[DataPlane] = None  # the data plane, once the group has one
        self.shared: Optional[SharedPlane] = None  # this rank's host's shared memory, if it has some
        self.sleepers: Callable[[], object] = bool  # does a coroutine sleep on the fds (the group
        # sets _future.sleeping): then every progress drains the sockets (rule 3 of _future)
        self.waiter = Waiter()  # what its waits watch: the link's sources, the nudge, the data plane's
        self._watches()
        self.nudged = False  # the waiting thread leads (_turns): a nudge ends its wait too
        self.turns: Any = None  # the group's Turns (whose holder uses the link)
        self.pump = self._pump  # (its public name, for Edges: the driver's wait for anything)
        self.mail: Optional[transport.Mailbox] = None  # the mailbox (point to point), once joined
        self.mail_names: tuple[str, ...] = ()
        self._mail_fixed = 1  # names of mail_names not a link's monitor (the mailbox, its one-host links)
        self.mail_ready = 0  # what a wait woke for of the mailbox's (MESSAGE, LINK: see _mailbox.mail_woke):
        # take in, look at the links (else a wait only looks at it)
        self.tracked: list[tuple[Any, Any]] = []  # (tracker, send's future): buffers libzmq still reads

    def _watches(self, *names: str) -> None:
        """The names of the link's sources in :attr:`waiter`."""
        self._names, self._nudged_names = names, (*names, NUDGE)

    def watching(self) -> tuple[str, ...]:
        """What a wait of the link watches now: its sources, and the nudge if :attr:`nudged`."""
        return self._nudged_names if self.nudged else self._names

    def attach_mail(self, mail: transport.Mailbox) -> None:
        """The group is formed: its waits watch the mailbox too."""
        self.mail, mail.keyed = mail, lambda rank: _heard_from(self.member, rank)
        self.waiter.watch(MAIL, mail.source)
        links = mail.links()  # (the one-host links', if any: no monitor yet)
        for name, fd in links.items():
            self.waiter.watch(name, fd)
        self.mail_names = (MAIL, *links)  # the mailbox (its one-host links), then each link's monitor
        self._mail_fixed = len(self.mail_names)
        self._watches(*self._names, *self.mail_names)

    def _soon(self) -> Optional[float]:
        """When the mailbox has something to do without news: a tracked buffer to
        look at again, a refused link to make again."""
        if self.tracked:
            return time.monotonic() + TRACKER_POLL_S
        retry = min(self.mail.retry.values()) if self.mail is not None and self.mail.retry else None
        due = self.member.tree_due()  # parts held go up as they came; a held FAIL takes effect
        return due if retry is None else retry if due is None else min(due, retry)

    def mail_io(self, take: bool = True, ready: int = 0, enough: Optional[Callable[[], Any]] = None) -> bool:
        """Point to point: take in what came to the mailbox (if ``take``; ``ready``: what a wait woke for, see
        :attr:`mail_ready`), send what the rules owe (a send is done once libzmq no longer reads its buffers).
        Once ``enough()`` holds (a call waited for is done) the rest stays for the next wait, unless a
        coroutine sleeps on the descriptors (rule 3 of _future); True: it stopped there."""
        member, sockets = self.member, self.mail
        rules, done = member.mail, False
        if rules is None:
            return done
        timed = member.relay is not None or member.deferred is not None
        if timed:
            member.tree_timer(time.monotonic())
        signer = member.signer
        if sockets is not None and take:
            mine = signer.to(member.rank) if signer is not None else None  # (this mailbox's key)
            local = sockets.local  # (a one-host link's message is not signed: its link proved its sender)
            for i in range(TAKE_BATCH):  # (then the other sockets get a look)
                if (frames := sockets.recv(not i and bool(ready & MESSAGE))) is None:
                    break
                try:
                    msg = decode(frames, signer=None if local is not None and local.source >= 0 else mine,
                                 max_frame_bytes=member.max_frame_bytes)
                except WireError:  # (admitted by the handshake: a bug, or a peer of another release)
                    rules.dropped += 1
                    continue
                rules.take(msg)
                if enough is not None and member.outcomes and enough() and not self.sleepers():
                    done = True
                    break
        if member.asks:  # a subtree's reduction its relay asked for
            answer(member)
        if rules.cut and sockets is not None:  # ranks whose messages waiting for their link never go
            failure, decided = rules.failure, set[int]()  # (Mail.cut): dropped; after a failure, sends fail
            while rules.cut:  # with it (never sent), so no send that raised is delivered
                dest, handles = rules.cut.pop()
                decided.update(map(id, handles))
                for handle in sockets.drop_to(dest, sends_only=failure is not None):
                    if failure is not None:
                        member.outcomes.append(CallOutcome(handle, fresh(failure)))
            if decided:  # (their outcome is said: a tracker never done, to a rank gone, is not watched)
                self.tracked = [(t, h) for t, h in self.tracked if id(h) not in decided]
        out, went = rules.out, []
        while out and sockets is not None:
            dest, msg, handle = out.pop(0)
            if dest in sockets.offered:  # (its first message: its one-host link made now, or never)
                sockets.link(dest)
            segment = msg.segments[0] if msg.segments else []
            borrowed = handle is not None and not (len(segment) == 1 and type(segment[0]) is bytes) and any(
                type(f) is not bytes for f in segment)
            frames = encode(msg, None if signer is None or dest in sockets.via_local else signer.to(dest),
                            part_bytes=member.part_bytes)
            went += sockets.send(dest, frames, borrowed, handle)
        broken = None
        if sockets is not None and (ready & LINK or time.monotonic() >= sockets.quiet_until):
            made, broken = sockets.progress(time.monotonic(), bool(ready & LINK))
            went += made
        for tracker, handle in went:
            if tracker is not None and not tracker.done:
                self.tracked.append((tracker, handle))
            elif handle is not None:
                member.outcomes.append(CallOutcome(handle))
        if self.tracked:
            left = [(t, h) for t, h in self.tracked if not t.done]
            member.outcomes.extend(CallOutcome(h) for t, h in self.tracked if t.done)
            self.tracked = left
        if sockets is not None and len(self.mail_names) != self._mail_fixed + len(sockets.monitors):  # a new
            links = sockets.links()  # link: its refusal ends a wait too
            for name, monitor in links.items():
                self.waiter.watch(name, monitor)
            self._watches(*(n for n in self._names if n not in self.mail_names), MAIL, *links)
            self.mail_names = (MAIL, *links)
        if broken is not None or rules.gap is not None:
            self._fail_data(rules.link_broke(broken, sockets is not None and broken in sockets.via_local))
        if timed and member.owed:  # what climbed to here (or a held FAIL's answer) goes on to rank 0
            self.flush()
        if member.relay is not None:
            interrupted = member.relay.interrupted  # (a signal handler's, in a reduce function run
            if interrupted is not None and threading.current_thread() is threading.main_thread():
                member.relay.interrupted = None  # here: only the main thread gets signals)
                raise interrupted
        return done

    # -- to implement -----------------------------------------------------

    def _send(self, msg: Message) -> None:
        """Send one whole message (or raise a library error)."""
        raise NotImplementedError

    def _pump(self, deadline: Optional[float], until: Optional[Callable[[], bool]] = None) -> bool:
        """Wait until something arrives or ``deadline``; hand it all to the member (or, once ``until()``
        holds, as much as a driver chooses). False on timeout."""
        raise NotImplementedError

    def lead(self, seq: int, deadline: Optional[float]) -> bool:
        """A blocking call's wait at its cheapest, by the turn's holder alone (nudged): True once call
        ``seq`` is answered; False, all else unread, when anything else is pending or came (then wait_for)."""
        return False

    def slice_s(self) -> Optional[float]:
        """How long :meth:`wait_mail`'s poll may sleep (0: a duty of the
        driver's own is due: none of it here); None: it has no such poll."""
        return None

    def fds(self) -> list[int]:
        """File descriptors that become readable when something may have arrived."""
        return self.waiter.fds(self._names)

    def busy(self) -> Optional[str]:
        """What the coordinator is stuck in, when it runs in this process."""
        return None

    def close(self, linger_ms: int = 0) -> None:
        """Let go of the link; what is queued gets ``linger_ms`` to leave."""

    # -- shared -----------------------------------------------------------

    def send(self, msgs: list[Message]) -> None:
        """Send what the member owes, then ``msgs``."""
        self.flush()
        for msg in msgs:
            self._send(msg)

    def flush(self) -> None:
        """Send what the member owes (rule 4 of :mod:`zcollective._protocol._member`):
        a contribution leaves the queue only once it was sent whole."""
        member = self.member
        owed, climbs = member.owed, member.parent > 0 or member.relay is not None
        mailed = False
        while owed:
            msg = owed[0]
            if climbs and msg.kind is Kind.CONTRIB:  # up the tree (rule 11 of the member)
                owed.popleft()
                for dest, part in member.climb(msg):
                    if dest == 0:
                        self._send(part)
                    elif member.mail is not None:
                        member.mail.out.append((dest, part, None))
                        mailed = True
                continue
            self._send(msg)
            if owed:  # a failure while sending empties it
                owed.popleft()
        if mailed or member.asks:
            self.mail_io(take=False)

    def join(self, timeout: Optional[float], check: Optional[Callable[[], None]] = None) -> None:
        """Send JOIN and wait for every replica to have joined; raise :class:`CollectiveTimeoutError` naming
        who was missing, or the error of the coordinator's refusal (or what ``check``, asked every
        :data:`~zcollective._limits.POLL_SLICE_S`, raises: a sub-group's parent's failure)."""
        member = self.member
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.send_join(lambda: member.joined, deadline, check):
            status = self.ask_status(0) if member.connected else None
            raise CollectiveTimeoutError(member.join_timeout_message(timeout, status))

    def send_join(self, done: Callable[[], bool], deadline: Optional[float],
                  check: Optional[Callable[[], None]] = None) -> bool:
        """Send JOIN, and again when the member's timer says (rule 8 of :mod:`zcollective._protocol._member`),
        until ``done()`` (True) or ``deadline`` (False); ``check()`` raises to end it (see :meth:`join`)."""
        member = self.member
        try:
            self.send(member.start_join(self.warn_after if self.remote else None))
            while True:
                due = member.next_deadline()
                until = due if deadline is None else deadline if due is None else min(deadline, due)
                if check is not None:
                    check()
                    soon = time.monotonic() + POLL_SLICE_S
                    until = soon if until is None else min(until, soon)
                if self.wait_for(done, until):
                    return True
                now = member.clock()
                if deadline is not None and now >= deadline:
                    return False
                self.send(member.on_timer(now))
        finally:
            member.stop_join()

    def wait_for(self, done: Callable[[], bool], deadline: Optional[float]) -> bool:
        """Take in messages until ``done()`` or ``deadline`` (False); raise the group's failure (sticky)."""
        member = self.member
        if member.owed:
            self.flush()
        while not done():
            # (a call kept by a failure too: see Member.fail)
            if self.shared is not None and self.shared.growing is not None:
                self.shared.check()  # (a call that was to make its segment failed: unlinked now)
            moved = self._move_data(deadline, done) if member.transfers else None  # (a nested wait's too:
            # once ``done()`` a data move stops between steps and goes on at the next wait)
            if moved:
                continue
            if member.failure is not None:
                member.check()
            if moved is False or not self._news(deadline, done):
                return done()
        return True

    def _news(self, deadline: Optional[float], until: Optional[Callable[[], bool]] = None) -> bool:
        """The driver's one wait (:meth:`wait_for`'s, and a data move's: a shared-memory job's at a sync, a
        ring's look at the rest), which moves everything but the data: the mailbox (point to point, the tree's
        parts, buffers lent to libzmq, links), then the control plane's news, until ``deadline``. False once
        ``until()`` holds or ``deadline`` passed. See docs/protocol.md, *Progress*."""
        mail, wake = self.member.mail, deadline
        if mail is not None:
            soon = self._soon()
            if self.mail_ready or mail.out or mail.cut or soon is not None:
                ready, self.mail_ready = self.mail_ready, 0  # (a wait wakes at once while a message
                self.mail_io(ready=ready, enough=until)  # waits: the PULL is polled as a socket, level)
                if until is not None and until():
                    return False
                soon = self._soon()
            if soon is not None and (deadline is None or soon < deadline):  # nothing wakes a wait
                wake = soon  # when libzmq lets go of a buffer, nor when a link is due again
        return (self._pump(wake, until) or wake != deadline) and not (until is not None and until())

    def wait_mail(self, done: Callable[[], Any], deadline: Optional[float]) -> bool:
        """A point-to-point call's wait at its cheapest: one poll of what :meth:`wait_for` watches (the nudge
        too), taking in what came if the mailbox alone woke it; True once ``done()``. False, nothing else read
        (wait_for's poll finds it), when anything else woke it or is due, or nothing came within the slice."""
        member, sockets = self.member, self.mail
        if (sockets is None or member.transfers or member.owed or member.failure is not None
                or self.tracked or sockets.retry or any(self.queued)):
            return False
        slice_s = self.fixed_slice_s if self.fixed_slice_s is not None else self.slice_s()
        if not slice_s or slice_s < 0:
            return False
        woke = self.waiter.wait(self._nudged_names, deadline, slice_s)
        if woke != [MAIL] and woke != [LOCAL]:  # (the one-host links': their messages, or news taken in
            return False  # with them)
        return self.mail_io(ready=MESSAGE, enough=done) or bool(done())

    def progress(self, data: bool = True) -> None:
        """Send what is owed; take in whatever has arrived, without blocking; move
        data only if ``data`` (the relay's stand-in leaves data jobs to the program)."""
        self._take_in()
        if data:
            self._move_data(time.monotonic())
        if self.member.mail is not None:
            self.mail_io()

    def _move_data(self, deadline: Optional[float], until: Optional[Callable[[], bool]] = None
                   ) -> Optional[bool]:
        """Move the data of the first call the data plane has to carry: True when it is done (its future
        resolved), False when ``deadline`` came first, or ``until()`` held after news (it goes on at the next
        wait), None if there is none."""
        member, data, shared = self.member, self.data, self.shared
        if not member.transfers:
            return None
        seq, job = member.transfers[0]
        if getattr(job, "shared", False):
            if shared is None:
                return None
            def between_hosts(ring: Any) -> bool:  # (its host's leader's step)
                if data is None:
                    raise RuntimeError("no data plane to reach the other hosts' leaders")
                return data.run(seq, ring, deadline, member, self.waiter, self.watching(), self._take_in,
                                self._fail_data, until, owner=job)
            if not shared.run(seq, job, deadline, lambda: self._news(deadline, until), self.send,
                              self._fail_data, between_hosts):
                return False
        elif data is None:
            return None
        elif not data.run(seq, job, deadline, member, self.waiter, self.watching(), self._take_in,
                          self._fail_data, until):
            return False
        if member.transfers and member.transfers[0][1] is job:
            member.data_done()  # (else the call failed meanwhile: its future has the error)
        if member.owed:  # a TAKEN its data owed (rule 7 of the member)
            self.flush()
        return True

    def finish_data(self, timeout: float) -> None:
        """Move the data of every call that has some to move, its plan first (the program is ending: the other
        ranks need this one's chunks), for at most ``timeout`` seconds."""
        member = self.member
        deadline = time.monotonic() + timeout
        while any(c.transfer is not None for c in member.calls.values()) and (
                member.failure is None or member.transfers):
            if time.monotonic() >= deadline:
                return
            self.flush()
            if self._move_data(deadline) is None:  # its plan has not come yet
                self._news(deadline)

    def _take_in(self) -> None:
        """What has come, without blocking (a ring's look at the rest of the group: :meth:`_news`)."""
        self.flush()
        self._news(time.monotonic())

    def _fail_data(self, error: Exception) -> None:
        """The data plane failed here: the member says what follows (rule 9
        of :mod:`zcollective._protocol._member`), waiting for news meanwhile."""
        member = self.member
        replies = member.data_lost(error)
        while member.losing_data:
            self._pump(member.next_deadline())
            replies = member.on_timer(member.clock())
        with contextlib.suppress(CollectiveError):  # the link to rank 0 broke too, which tells it
            self.send(replies)

    def ask_status(self, seq: int) -> Optional[dict[str, Any]]:
        """The coordinator's view of call ``seq`` (who arrived), or None if it
        does not answer within :data:`~zcollective._limits.STATUS_WAIT_S`."""
        member = self.member
        self.send([member.status_query(seq)])
        deadline = time.monotonic() + STATUS_WAIT_S  # (taken in, no data moves)
        while seq not in member.status and member.failure is None and self._pump(deadline):
            pass
        return member.status.pop(seq, None)

    def _handle(self, msg: Message) -> None:
        """Give the member one decoded message; send what it answers."""
        replies = self.member.receive_message(msg)
        if replies:
            self.send(replies)


def _heard_from(member: Member, rank: int) -> bool:
    """Has a message come from ``rank`` (its mailbox takes the group's tokens: see MailSockets.keyed)?"""
    return member.mail is not None and member.mail.box.peers[rank].next_in > 0


def pending_else(driver: Driver) -> bool:
    """Has anything but the link to the coordinator something to do at ``driver`` (data moving, owed
    parts, a failure, the tree, mail, trackers, shared memory)? Then a lead gives way to the general
    wait: one list for every driver's :meth:`Driver.lead`."""
    member, rules, sockets = driver.member, driver.member.mail, driver.mail
    return bool(member.transfers or member.owed or member.failure is not None or member.relay is not None
                or member.tree_due is not NO_DUE or driver.mail_ready or driver.tracked
                or (rules is not None and (rules.out or rules.cut))
                or (sockets is not None and sockets.retry)
                or (driver.shared is not None and driver.shared.growing is not None))


class HostDriver(Driver):
    """Rank 0's member, beside the coordinator (:class:`Server`): rank 0's thread owns the coordinator's
    sockets while it waits here, and serves them itself."""

    def __init__(self, member: Member, server: Server) -> None:
        super().__init__(member)
        self.server = server
        self.turns = server.turns  # its holder owns the coordinator's sockets
        self.waiter = server.waiter
        self._watches(*server.SERVED)
        member.connected = True  # nothing between them can break
        self.queued = (server.to_host, server.from_member)  # (news for the member, or the coordinator)
        self.slice_s = partial(server.sleep_s, POLL_SLICE_S)  # type: ignore[method-assign]  # (one call)

    def ask_status(self, seq: int) -> Optional[dict[str, Any]]:
        status = super().ask_status(seq)
        if status is not None and not self.member.joined:  # a join timeout: whom the port refused
            status["handshakes"] = list(self.server.hub.refusals())
        return status

    def _send(self, msg: Message) -> None:
        if msg.kind is Kind.CONTRIB:
            msg = owned(msg)
        self.server.from_host(msg)

    def flush(self) -> None:
        member = self.member
        if member.parent > 0 or member.relay is not None or member.asks:
            return super().flush()  # (up the tree)
        owed, take = member.owed, self.server.from_host
        while owed:  # (Driver.flush's and _send's, inline: the common call)
            msg = owed[0]
            segments = msg.segments  # (one immutable frame, a small call's, needs no copy: owned's test)
            take(msg if msg.kind is not Kind.CONTRIB or (len(segments) == 1 and len(segments[0]) == 1
                                                          and type(segments[0][0]) is bytes) else owned(msg))
            if owed:  # a failure while sending empties it
                owed.popleft()

    def _pump(self, deadline: Optional[float], until: Optional[Callable[[], bool]] = None) -> bool:
        server, member, turns = self.server, self.member, self.turns
        held = turns.owner == get_ident()  # (as wait_for)
        if not held and not turns.take(deadline):
            return False
        try:
            got = server.serve(deadline, self._handle, self.nudged, self.mail_names)
            self.mail_ready |= server.mail_woke
            server.mail_woke = 0
        finally:
            if not held:
                turns.give()
        if (server.crashed or server.stopped) and member.failure is None:
            member.coordinator_gone(server.gone() or "it stopped")
        return got

    def wait_for(self, done: Callable[[], bool], deadline: Optional[float]) -> bool:
        turns = self.turns
        held = turns.owner == get_ident()  # (the common call's leader: taken once, by its Turns)
        if not held and not turns.take(deadline):  # (the background thread runs a reduce function)
            return done()
        try:
            if self.server.to_host:  # what the background thread took in meanwhile: first
                self._pump(time.monotonic())
            return super().wait_for(done, deadline)
        finally:
            if not held:
                turns.give()

    def lead(self, seq: int, deadline: Optional[float]) -> bool:
        """As :meth:`Driver.lead`, serving the coordinator (:meth:`Server.quick`)."""
        server, member = self.server, self.member
        calls, to_host, names = member.calls, server.to_host, self._nudged_names
        while True:
            while to_host:
                replies = member.receive_message(to_host.popleft())
                if replies:
                    self.send(replies)
            if seq not in calls:
                return True
            if pending_else(self) or not server.quick(names, deadline, bool(self.sleepers())):
                return False

    def fds(self) -> list[int]:
        return self.server.fds() + self.waiter.fds(self.mail_names)  # (the mailbox: the program's own)

    def busy(self) -> Optional[str]:
        return self.server.busy()


class DirectDriver(Driver):
    """A group of one: the coordinator runs in the caller's thread."""

    def __init__(self, member: Member, coordinator: Coordinator) -> None:
        from .._protocol._coordinator import RANK0_PEER  # (loaded: the coordinator's module)

        super().__init__(member)
        self.coordinator = coordinator
        self._peer = RANK0_PEER
        self._inbox: deque[Message] = deque()
        member.connected = True

    @classmethod
    def alone(cls, member: Member, signer: Any, config: Any) -> DirectDriver:
        """A group of one: its member calls the coordinator in-process, no socket."""
        from .._protocol._coordinator import Coordinator

        session = int.from_bytes(os.urandom(8), "little") | 1
        member.mail_window = config.mail_window_bytes  # (no mailbox sockets)
        return cls(member, Coordinator(1, session, DEFAULT_MAX_FRAMES, signer, user_code=user_code,
                                       job=config.job))

    def _send(self, msg: Message) -> None:
        at = self.coordinator
        self._inbox.extend(out for _, out in applied(at.receive_message(self._peer, msg), at))
        if at.interrupted is not None:  # in the reduce function: its error is queued
            interrupted, at.interrupted = at.interrupted, None
            raise interrupted

    def _pump(self, deadline: Optional[float], until: Optional[Callable[[], bool]] = None) -> bool:
        """What the coordinator answered; else, leading a wait (:attr:`nudged`), sleep until ``deadline`` or
        another thread wants the turn (to send to this rank, say: only a thread of this process can); a nested
        wait holds the turn, so nothing else can come."""
        inbox = self._inbox
        if not inbox:
            return self.nudged and NUDGE in self.waiter.wait(self._nudged_names, deadline)
        while inbox:
            self._handle(inbox.popleft())
        return True
