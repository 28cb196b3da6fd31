"""Where an interrupt may surface, and every blocking wait of the library.

While a group is open the handlers of :data:`DEFERRED_SIGNALS` are wrapped
(:func:`hold_signals`: when the group opens, and at each entry of the library
where a handler was installed since) to run at once only outside the library
or in one of its *surfaces* (:func:`surface`: the waits here, and
:func:`call_user`), and be deferred anywhere else. See docs/protocol.md,
*Concurrency*.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from _signal import getsignal  # (signal.getsignal converts in Python: the entries' check wants C only)
from _thread import allocate_lock as _allocate_lock
from collections.abc import Iterator
from functools import partial
from types import CodeType, FrameType
from typing import Any, Callable, Optional, TypeVar

from zmq.backend import zmq_poll

from ..errors import SIGNAL_ATTR

T = TypeVar("T")

DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGINT", "SIGTERM", "SIGALRM", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
# those whose Python handlers may raise
RESEND_FIRST_S = 0.001  # a deferred signal comes again this soon: most library steps are shorter
RESEND_MAX_S = 0.05  # ... backing off to this, within a long step (pickling a large value)

_PACKAGE = __name__.split(".")[0]  # the library's code is its package's modules (by name, not path)
_NOT_LIBRARY = {f"{_PACKAGE}.{name}" for name in ("run", "testing", "_child", "__main__")}
# (the launcher and the test helpers run programs: their code is not the library at work)
_SURFACES: set[CodeType] = set()
_library_modules: dict[str, bool] = {}
_MAIN_THREAD = threading.main_thread().ident
held: tuple[Any, ...] = ()  # the handlers of DEFERRED_SIGNALS as hold_signals left them: an entry
# of the library that finds others wraps them (tuple(map(getsignal, DEFERRED_SIGNALS)) != held)
_holding = [False]  # hold_signals was called and release_signals not since
_deferring = [0]  # inside deferring(): every signal is deferred, at the surfaces too


def surface(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark ``fn`` as a surface: a signal handler runs at once inside it."""
    _SURFACES.add(fn.__code__)
    return fn


@surface
def wait(items: list[Any], timeout_ms: int) -> list[Any]:
    """Wait in ``zmq_poll`` for ``items``: the library's one socket wait."""
    return zmq_poll(items, timeout_ms)  # type: ignore[no-any-return]


DEADLINE = "deadline"  # why a Waiter woke: the caller's deadline passed
NUDGE = "nudge"  # the name of the group's nudge (_turns), in every waiter that watches it


class Waiter:
    """How every wait on sockets is written (see docs/protocol.md, *Drivers*):
    sources watched under names, waits for some of them that say why they
    woke. Used by one thread at a time (a group's by the holder of its turn)."""

    def __init__(self, *watched: tuple[str, Any]) -> None:
        self._sources: dict[str, Any] = {}
        self._fds: dict[str, int] = {}
        self._polls: dict[tuple[str, ...], tuple[list[Any], dict[Any, str]]] = {}
        for name, source in watched:
            self.watch(name, source)

    def watch(self, name: str, source: Any) -> None:
        """Watch ``source`` (readable) as ``name``; the same again costs nothing."""
        if self._sources.get(name) != source:
            self._sources[name], self._polls = source, {}
            self._fds[name] = source if isinstance(source, int) else source.FD  # (read by its owner)

    def fds(self, names: tuple[str, ...]) -> list[int]:
        """The file descriptors of ``names`` (an awaiting event loop watches them)."""
        return [self._fds[name] for name in names if name in self._fds]

    @surface
    def wait(self, names: tuple[str, ...], deadline: Optional[float],
             slice_s: Optional[float] = None) -> list[str]:
        """Wait until one of ``names`` is readable, ``deadline`` passes or
        ``slice_s`` ends (None: no bound); why it woke, as the class says."""
        poll = self._polls.get(names)
        if poll is None:
            watched = [(self._sources[name], name) for name in names if name in self._sources]
            poll = self._polls[names] = ([(s, 1) for s, _ in watched], dict(watched))  # (1: POLLIN)
        if deadline is not None:
            left = deadline - time.monotonic()
            slice_s = left if slice_s is None or left < slice_s else slice_s
        timeout_ms = -1 if slice_s is None else max(0, math.ceil(slice_s * 1000))  # (up: a wait of
        woke, named = [], poll[1]  # under a millisecond never spins; a loop: no call, as a listcomp's)
        for s, _ in zmq_poll(poll[0], timeout_ms):
            woke.append(named[s])
        if deadline is not None and time.monotonic() >= deadline:
            woke.append(DEADLINE)
        return woke


def acquire_by(lock: Any, deadline: Optional[float]) -> bool:
    """Take an ``RLock`` another thread holds by ``deadline`` (None: no bound), where an interrupt may stop
    the wait; False if it did not come. An interrupt leaves it not held."""
    timeout = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        return wait_lock(lock, timeout)
    except BaseException:
        with contextlib.suppress(RuntimeError):  # (taken just before: only its owner may release it)
            lock.release()
        raise


@surface
def wait_lock(lock: Any, timeout: float) -> bool:
    """Wait for ``lock`` (another thread's hold); -1: no bound. The caller
    checks whether it holds the lock if this raises."""
    return bool(lock.acquire(timeout=timeout))


@surface
def sleep(seconds: float) -> None:
    """Sleep (nothing to wait for but time)."""
    time.sleep(seconds)


@surface
def join(thread: threading.Thread, timeout: Optional[float]) -> bool:
    """Wait for ``thread`` to end; False if it had not within ``timeout``."""
    thread.join(timeout)
    return not thread.is_alive()


def finish(thread: threading.Thread, timeout: Optional[float]) -> bool:
    """:func:`join` where an interrupt is deferred (the caller must go on to
    close what the thread leaves it, whatever comes)."""
    thread.join(timeout)
    return not thread.is_alive()


class Condition:
    """A condition over a plain lock, held by its user (``with lock:``), whose
    sleep alone is a surface (:func:`wait_condition`)."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.sleepers: list[Any] = []  # one held lock per waiting thread; released to wake it (read
        # by its user, with the lock held: does a thread wait?)

    def notify_all(self) -> None:
        """Wake every thread waiting (the caller holds the lock)."""
        sleepers, self.sleepers = self.sleepers, []
        for sleeper in sleepers:
            sleeper.release()


def wait_condition(condition: Condition, timeout: Optional[float]) -> bool:
    """Wait on ``condition`` (whose lock the caller holds) for another thread's news, at most ``timeout`` s;
    True if notified. Only the sleep is a surface (:func:`wait_lock`): an interrupt while the lock is taken
    back would leave the caller's ``with`` to release another thread's hold."""
    sleeper = _allocate_lock()
    sleeper.acquire()
    condition.sleepers.append(sleeper)
    condition.lock.release()
    got = False
    try:
        got = wait_lock(sleeper, -1.0 if timeout is None else max(0.0, timeout))
        return got
    finally:
        condition.lock.acquire()
        if not got:
            with contextlib.suppress(ValueError):  # (else notified meanwhile)
                condition.sleepers.remove(sleeper)


@surface
def call_user(fn: Callable[..., T], *args: Any) -> T:
    """Call user code (a reduce function): an interrupt comes out of it (a
    handler it installed is wrapped before the library goes on)."""
    try:
        return fn(*args)
    finally:
        hold_new_handlers()


def user_code(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` made callable where an interrupt may stop it: through
    :func:`call_user` unless it is the library's own (or built in)."""
    module = getattr(fn, "__module__", None)
    mine = _library_modules.get(module or "")  # (looked up inline: once per call)
    if mine is None:
        mine = _is_library(module)
    return fn if mine or getattr(fn, "__code__", None) is None else partial(call_user, fn)


def _is_library(module: Optional[str]) -> bool:
    """Is ``module`` (a name) one of the library's, at work (not its launcher or test helpers)?"""
    mine = _library_modules.get(module or "")
    if mine is None:
        name = module or ""
        mine = _library_modules[name] = (name == _PACKAGE or name.startswith(_PACKAGE + ".")) and (
            name not in _NOT_LIBRARY)
    return mine


def deferred(frame: Optional[FrameType]) -> bool:
    """Would a signal coming at ``frame`` be deferred? The innermost frame that is a surface or the library's
    decides; others' (numpy, pickle, the program's) are looked through. Inside :func:`deferring`: yes."""
    if _deferring[0]:
        return True
    while frame is not None:
        if frame.f_code in _SURFACES:
            return False
        if _is_library(frame.f_globals.get("__name__")):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """Defer every signal while in the block, at the surfaces too (the
    main thread's wait for a verdict that must not be cut short)."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1


class _Wrapped:
    """A program's signal handler, deferred while the library is at work."""

    def __init__(self, handler: Callable[..., Any]) -> None:
        self.handler = handler
        self.delay = RESEND_FIRST_S
        self.resending = False  # a resend is scheduled: more of the signal meanwhile are one

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        if not deferred(frame):
            self.delay = RESEND_FIRST_S
            try:
                self.handler(signum, frame)
            except BaseException as exc:
                setattr(exc, SIGNAL_ATTR, signum)  # (see errors.from_signal)
                raise
            return
        if not self.resend(signum):  # no new thread (the interpreter is shutting down): run it now
            self.handler(signum, frame)

    def resend(self, signum: int) -> bool:
        """Send the signal again soon (False: no thread to do it)."""
        if self.resending:
            return True
        self.resending = True
        timer = threading.Timer(self.delay, self._resend, (signum,))
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:
            self.resending = False
            return False
        self.delay = min(RESEND_MAX_S, self.delay * 2)
        return True

    def _resend(self, signum: int) -> None:
        self.resending = False
        if hasattr(signal, "pthread_kill") and _MAIN_THREAD is not None:
            signal.pthread_kill(_MAIN_THREAD, signum)  # ends a wait in the main thread at once
        else:  # (Windows: the handler runs when the main thread's wait returns)
            signal.raise_signal(signum)


def pending() -> bool:
    """Is a signal held back, to come again (an interrupt the program is waiting for)?"""
    return any(isinstance(h, _Wrapped) and h.resending for h in map(getsignal, DEFERRED_SIGNALS))


def signal_again(exc: BaseException) -> None:
    """The signal whose handler raised ``exc`` in a call that then completed on every rank comes again once
    the library has returned (the call returns its result; the interrupt is never swallowed)."""
    signum = getattr(exc, SIGNAL_ATTR, None)
    handler = getsignal(signum) if isinstance(signum, int) else None
    if isinstance(handler, _Wrapped) and isinstance(signum, int):  # (else the program replaced it: its own
        handler.resend(signum)  # handler is the program's to run)


def hold_signals() -> None:
    """Wrap the current Python signal handlers (in the main thread, the only one that may set them and runs
    them), but the library's own (they never raise)."""
    global held
    _holding[0] = True
    if threading.get_ident() != _MAIN_THREAD:
        return
    for sig in DEFERRED_SIGNALS:
        handler = getsignal(sig)
        if callable(handler) and not isinstance(handler, _Wrapped) and not _is_library(
                getattr(handler, "__module__", None)):
            signal.signal(sig, _Wrapped(handler))
    held = tuple(map(getsignal, DEFERRED_SIGNALS))


def hold_new_handlers() -> None:
    """An entry of the library: wrap the handlers the program installed
    since they were last held, if a group is open (a check of a few C calls)."""
    if tuple(map(getsignal, DEFERRED_SIGNALS)) != held and _holding[0]:
        hold_signals()


def release_signals() -> None:
    """Put back the handlers :func:`hold_signals` wrapped (when no group is
    left), unless the program has installed others since."""
    global held
    _holding[0] = False
    if threading.get_ident() != _MAIN_THREAD:
        return
    for sig in DEFERRED_SIGNALS:
        handler = getsignal(sig)
        if isinstance(handler, _Wrapped):
            signal.signal(sig, handler.handler)
    held = tuple(map(getsignal, DEFERRED_SIGNALS))
