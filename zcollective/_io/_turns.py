"""Which thread uses a group's sockets: the holder of the group's *turn*
(:class:`Turns`). One waiting thread leads (holds it and polls), the others
follow; a thread wanting it nudges the holder. See docs/protocol.md, *Concurrency*.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from .._limits import AWAY_S, PARK_BUSY_S, PARK_IDLE_S
from . import _interrupts
from ._sockets import Wakeup

FOLLOW_SLICE_S = 0.05  # a follower re-checks its call this often (see wait)
GIVE_WAY_S = 0.02  # try_take waits this long for rank 0's server thread to give the turn back
# (within microseconds, unless it runs a reduce function)
STOP = "stop"  # a stand-in's waiter's name for its stop pipe

Drive = Callable[[Callable[[], bool], Optional[float], bool], bool]
# (until, deadline, may it be nudged) -> until() held (False: deadline)


class Turns:
    """The turn of one group (see the module's rules)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # the turn (re-entered by done-callbacks and nested steps)
        self.depth = 0  # the holder's nested takes
        self.owner: Optional[int] = None  # the holder's thread (read by drivers: held, without a call)
        self.left = 0.0  # when a holder last let go of the turn
        self.standby = False  # the holder is rank 0's server thread: it gives way to any program thread
        self._mutex = threading.Lock()  # guards what follows (with it, for speed: no Python frame)
        self._state = _interrupts.Condition(self._mutex)  # ... on which followers sleep
        self.wanting = 0  # threads waiting for the turn (read by a leader's driver: it lets go)
        self.leader: Optional[int] = None  # the thread leading the wait for results
        self.nudge = Wakeup()  # readable while some thread waits for the turn

    def wanted(self) -> bool:
        """Does another thread wait for the turn (read by the leader's wait)?"""
        return self.wanting > 0

    @property
    def _wanting(self) -> int:  # (the name tests read)
        return self.wanting

    @property
    def _leader(self) -> Optional[int]:  # (the name tests read)
        return self.leader

    def take(self, deadline: Optional[float] = None) -> bool:
        """Take the turn (nested takes count), nudging its holder; False if the holder, busy in a step that is
        not a wait (pickling, a reduce function), kept it past ``deadline``. (``_point``'s ``_make`` takes
        it uncontended inline, and gives it back so: change them together.)"""
        lock = self.lock
        if not lock.acquire(blocking=False):
            with self._mutex:
                self.wanting += 1
                self.nudge.set()
            try:
                if not _interrupts.acquire_by(lock, deadline):
                    return False
            finally:
                with self._mutex:
                    self.wanting -= 1
                    if not self.wanting:
                        self.nudge.clear()
                    self._state.notify_all()  # a leader that let go waits for this
        self.depth += 1
        self.owner = threading.get_ident()
        return True

    def try_take(self) -> bool:
        """Take the turn unless another program thread holds it (nested takes
        count; rank 0's server thread is nudged, and waited for a moment)."""
        if not self.lock.acquire(blocking=False):
            return self.standby and self.take(time.monotonic() + GIVE_WAY_S)
        self.depth += 1
        self.owner = threading.get_ident()
        return True

    def give(self) -> None:
        """Let go of one take."""
        self.depth -= 1
        if not self.depth:
            self.owner = None
            self.left = time.monotonic()
        self.lock.release()

    def __enter__(self) -> Turns:
        """``with turns:`` takes the turn, with no bound, for the block."""
        self.take()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.give()

    def held(self) -> bool:
        """Does this thread hold the turn?"""
        return self.owner == threading.get_ident()

    def close(self) -> None:
        """The group closed: no thread nudges any more (a thread still waiting
        for the turn finds the group closed once it has it)."""
        with self._mutex:
            self.nudge.close()

    def wait(self, done: Callable[[], bool], deadline: Optional[float], drive: Drive,
             follow: Callable[[Callable[[], None]], None]) -> bool:
        """Until ``done()`` (True) or ``deadline`` (False): lead, driving the link with ``drive``, or follow
        while another thread leads; ``follow(wake)`` arranges for ``wake()`` once the awaited call is done."""
        if self.held():
            # a step of this thread's (teardown, a done-callback) waits: it leads without letting go
            return self._lead(done, deadline, drive, nested=True)
        me, state, following = threading.get_ident(), self._state, False
        while not done():
            with self._mutex:
                leads = self.leader is None
                if leads:
                    self.leader = me
                elif following:  # another thread leads: follow
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return done()
                    if not done() and self.leader is not None:
                        # sliced: a wake-up lost to a call resolved just as its callback was
                        # added (futures take no lock) costs a slice, never the whole wait
                        _interrupts.wait_condition(state, FOLLOW_SLICE_S if remaining is None
                                                   else min(remaining, FOLLOW_SLICE_S))
                    continue
            if not leads:
                following = True
                follow(self._wake)  # not holding the mutex: a call done already wakes at once,
                continue  # which takes it
            try:
                return self._lead(done, deadline, drive, nested=False)
            finally:
                with self._mutex:
                    self.leader = None
                    if state.sleepers:
                        state.notify_all()  # a follower leads next
        return True

    def _lead(self, done: Callable[[], bool], deadline: Optional[float], drive: Drive,
              nested: bool) -> bool:
        """Lead until ``done()`` (True) or ``deadline`` (False), letting go whenever another thread wants the
        turn (unless ``nested``: this thread held the turn already, halfway through a step of its own)."""
        while True:
            if not self.take(deadline):
                return False
            try:
                if done():
                    return True
                top = self.depth == 1 and not nested
                until: Callable[[], bool] = (lambda: done() or self.wanting > 0) if top else done
                if not drive(until, deadline, top):
                    return done()
            finally:
                self.give()
            if done():
                return True
            with self._mutex:  # wanted: each thread that waits has the turn before it comes back
                while self.wanting:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    _interrupts.wait_condition(self._state, remaining)

    def _wake(self) -> None:
        with self._mutex:
            self._state.notify_all()


class StandIn:
    """A thread that stands in for a program gone from the library for :data:`AWAY_S`: it takes the turn when
    nobody wants it, runs ``serve`` (True: end the thread), and gives it back. Rank 0's coordinator server and
    an interior rank's relay of the tree are each one of these."""

    def __init__(self, name: str, turns: Turns, serve: Callable[[], bool], busy: Callable[[], bool],
                 crash: Callable[[BaseException], None], standby: bool = False) -> None:
        self._turns, self._serve, self._busy, self._crash = turns, serve, busy, crash
        self._standby = standby  # it gives way to any program thread (try_take waits for it)
        self.stop_pipe = Wakeup()  # readable once the thread must end (its owner may watch it too)
        self.stopping = False
        self._waiter = _interrupts.Waiter((STOP, self.stop_pipe.fd))
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Tell the thread to end (its owner joins it)."""
        self.stopping = True
        self.stop_pipe.set()

    def end(self, timeout: float) -> None:
        """Stop and join the thread (from a thread holding the turn: it then finds it taken and ends)."""
        self.stop()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            _interrupts.join(self.thread, timeout)
        if not self.thread.is_alive():
            self.stop_pipe.close()

    def _run(self) -> None:
        turns, busy = self._turns, self._busy
        try:
            while not self._waiter.wait((STOP,), None, PARK_BUSY_S if busy() else PARK_IDLE_S):
                if turns.wanting or time.monotonic() - turns.left < AWAY_S or not turns.try_take():
                    continue
                turns.standby = self._standby
                try:
                    if self.stopping or self._serve():
                        return
                finally:
                    turns.standby = False
                    turns.give()
        except BaseException as exc:  # a bug: its owner says so rather than leave the others waiting
            self._crash(exc)
