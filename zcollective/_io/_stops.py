"""Whether this process was stopped (SIGSTOP, a paused VM, a debugger): a daemon thread wakes every
:data:`WATCH_S` and notes a late wake-up (docs/protocol.md, *Stops*); it also answers stacks requests."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

from . import _interrupts, _stacks

WATCH_S = 0.25  # sees every stop that matters (shorter than 0.67 s, the smallest bound's 2/3, is no loss)
NOTED_S = 0.5  # a wake-up this much later than due is noted as a stop
_lock = threading.Lock()
_watchers: dict[str, Any] = {"pid": 0, "groups": 0, "wake": None, "thread": None}
_stops: list[tuple[float, float]] = []  # (began, ended), time.monotonic(), the last few
MAX_STOPS = 8
STOP_JOIN_S = 1.0  # the watch ends within this once no group is open


def watch() -> None:
    """A group opened: the watch runs while any group of this process is open."""
    with _lock:
        if _watchers["pid"] != os.getpid():  # (a forked child: its parent's thread is not here)
            _watchers.update(pid=os.getpid(), groups=0, wake=None, thread=None)
            _stops.clear()
        _watchers["groups"] += 1
        if _watchers["thread"] is None:
            wake = threading.Lock()  # held until the watch must end
            wake.acquire(blocking=False)
            thread = threading.Thread(target=_run, args=(wake,), name="zcollective-stops", daemon=True)
            _watchers.update(wake=wake, thread=thread)
            thread.start()


def unwatch() -> None:
    """A group closed: the last one ends the watch."""
    with _lock:
        if _watchers["pid"] != os.getpid() or _watchers["groups"] == 0:
            return
        _watchers["groups"] -= 1
        if _watchers["groups"] or _watchers["thread"] is None:
            return
        wake, thread = _watchers["wake"], _watchers["thread"]
        _watchers.update(wake=None, thread=None)
    wake.release()
    if thread is not threading.current_thread():
        _interrupts.finish(thread, STOP_JOIN_S)


_awake = [0.0]  # when the watch last woke (time.monotonic())


def _run(wake: Any) -> None:
    _awake[0] = time.monotonic()
    while not _interrupts.wait_lock(wake, WATCH_S):
        now = time.monotonic()
        if now - _awake[0] > WATCH_S + NOTED_S:
            _stops.append((_awake[0], now))
            del _stops[:-MAX_STOPS]
        _awake[0] = now
        _stacks.answer_launcher()


def stopped(longer_than: float, ended_after: float) -> Optional[float]:
    """When the last stop longer than ``longer_than`` s that ended after ``ended_after`` began (one not yet
    woken from too), or None."""
    now, awake = time.monotonic(), _awake[0]
    if _watchers["thread"] is not None and now - awake > WATCH_S + NOTED_S and now - awake > longer_than:
        return awake
    for began, ended in reversed(list(_stops)):
        if ended > ended_after and ended - began > longer_than:
            return began
    return None
