"""Where this process's threads are, written to its stderr: on :data:`STACKS_SIGNAL`, and when
zcollective-run asks by a file the stops watch looks for (no signal: the program's handlers never run
for it). Frames are read holding the GIL (faulthandler's dump without it crashed processes)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Optional

from .._announce import STACKS_DIR_ENV

STACKS_SIGNAL = signal.SIGUSR1  # a user asks a replica (or zcollective-run, every replica) with it
STACKS_GAP_S = 1.0  # at most one dump this often: a storm of requests costs a dump a second
MAX_FRAMES = 100  # per thread: a deep recursion is not written whole
_answering = [False]  # this process answers (ZCOLLECTIVE_STACKS was not 0 in a group it opened)
_last = [-STACKS_GAP_S]  # when the last dump was written (time.monotonic())


def answer(on: bool) -> None:
    """``stacks`` on: answer zcollective-run, and :data:`STACKS_SIGNAL` unless the program handles it."""
    if not on:
        return
    _answering[0] = True
    if signal.getsignal(STACKS_SIGNAL) is signal.SIG_DFL and threading.current_thread() is (
            threading.main_thread()):
        signal.signal(STACKS_SIGNAL, _on_signal)


def answering() -> bool:
    """Does this process answer zcollective-run's requests for its stacks?"""
    return _answering[0]


def answer_launcher() -> None:
    """The stops watch, at each wake: did zcollective-run ask for the stacks?"""
    where = os.environ.get(STACKS_DIR_ENV) if _answering[0] else None
    if where:
        try:
            os.unlink(os.path.join(where, str(os.getpid())))  # (its request: a file named by our pid)
        except OSError:
            return
        write_stacks(None, "as zcollective-run asked")


def _on_signal(signum: int, frame: Optional[FrameType]) -> None:
    try:
        write_stacks(frame, f"on {signal.Signals(signum).name}")
    except Exception:  # a diagnostic never fails the program
        pass


def write_stacks(top: Optional[FrameType], why: str) -> None:
    """Write every thread's stack to stderr (``top``: the caller's), once per :data:`STACKS_GAP_S`."""
    now = time.monotonic()
    if now - _last[0] < STACKS_GAP_S:
        return
    _last[0] = now
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    lines = [f"zcollective: the threads of process {os.getpid()}, {why}:"]
    for ident, frame in sys._current_frames().items():
        at: Optional[FrameType] = top if ident == me else frame
        if at is None:
            continue
        lines.append(f"Thread {ident:#x} ({names.get(ident, 'not started by threading')}), "
                     f"most recent call first:")
        for _ in range(MAX_FRAMES):
            if at is None:
                break
            lines.append(f'  File "{at.f_code.co_filename}", line {at.f_lineno} in {at.f_code.co_name}')
            at = at.f_back
    try:
        for line in lines:  # (a line a write: no line of another thread's output lands inside one)
            os.write(2, (line + "\n").encode("utf-8", "replace"))
    except OSError:  # (no stderr)
        pass
