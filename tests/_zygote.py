"""Warm processes that fork replica processes for :mod:`zcollective.testing`:
this test suite's own way to start replicas fast (conftest.py plugs it in as
``zcollective.testing.spawner``; the installed package starts fresh
interpreters).

A replica started as ``python -m zcollective._child`` spends most of its
start-up importing: the interpreter's site packages, zcollective and
cloudpickle, then the module that defines the function it runs (for a test,
with pytest and numpy). The test suite starts hundreds of them. A zygote
imports all of that once, then forks a child per replica, as
``multiprocessing``'s forkserver does. There is one zygote per rank index, so
the ranks of one group do not share a string hash seed (fresh interpreters
never do, and code that iterates a set of strings on every rank must be
caught differing).

A child is a separate process like any other (its own sockets, its own
signals, its own exit). What it changes to look like a fresh interpreter:
the requested environment, working directory and ``sys.argv``; default
handling of SIGINT and SIGCHLD; numpy's global generator reseeded (Python
reseeds ``random`` itself); and it leaves through the interpreter's own exit,
so ``atexit`` handlers run (``multiprocessing`` children skip them with
``os._exit``, which would hide what a program ending without ``teardown``
does). What it cannot change:

- what an interpreter reads only when it starts (``PYTHON*`` variables) or
  numpy when it loads (thread counts): a request whose environment differs
  there is refused, and the caller starts a fresh interpreter instead;
- the module-level code of the function's module ran once, in the zygote,
  with the environment of the test process at that moment;
- ``__main__`` is this module.

Protocol, over two private pipes (the zygote's stdout stays free for what
an imported module prints): length-prefixed pickles. Requests:
``("spawn", id, request)``, ``("signal", pid, signum)``; replies:
``("started", id, pid)`` and ``("exited", pid, returncode)`` whenever a child
ends. The zygote signals only a child it has not reaped yet, so a recycled pid
is never hit. Each child dies with its zygote (``PR_SET_PDEATHSIG``), and a
zygote whose requests end (the test process is gone) kills its children.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from typing import Any, Optional

from zcollective.testing import SpawnRequest

__all__ = ["Zygote", "ForkedProcess", "ZygoteGone", "forked", "zygote"]

HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 << 20  # a larger length means the stream is corrupt
PRELOAD = ("cloudpickle", "zcollective", "zcollective._child")
# read once, when the interpreter or numpy starts:
FIXED_AT_START = ("PYTHON", "OMP_", "OPENBLAS_", "MKL_", "LD_", "MALLOC_")
DISABLE_ENV = "ZCOLLECTIVE_TESTING_FRESH"  # "1": every replica is a fresh interpreter
START_TIMEOUT_S = 30.0  # a zygote answers a spawn within this (its first import of a test module included)
CLOSE_WAIT_S = 5.0
PR_SET_PDEATHSIG = 1


class ZygoteGone(RuntimeError):
    """A zygote ended or stopped answering: start fresh interpreters instead."""


def _write(fd: int, message: Any) -> None:
    data = pickle.dumps(message)
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes, or fewer at end of stream. Unbuffered: the zygote
    selects on ``fd``, and a buffered reader would hide what it read ahead."""
    chunks, got = [], 0
    while got < size:
        chunk = os.read(fd, size - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read(fd: int) -> Any:
    """The next message, or None at end of stream.

    Raises
    ------
    ZygoteGone
        The stream is corrupt.
    """
    header = _read_exactly(fd, HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        raise ZygoteGone(f"a message of {size} bytes: the stream is corrupt")
    data = _read_exactly(fd, size)
    return pickle.loads(data) if len(data) == size else None


def fixed_at_start(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that only take effect when an interpreter starts."""
    return {k: v for k, v in env.items() if k.startswith(FIXED_AT_START)}


# -- a zygote process ----------------------------------------------------------

class _Server:
    """The zygote's loop: fork on request, reap, report."""

    def __init__(self, requests: int, replies: int) -> None:
        self.requests, self.replies = requests, replies
        self.pid = os.getpid()
        self.children: set[int] = set()

    def serve(self) -> tuple[int, SpawnRequest]:
        """Serve until the requests end (then exit); in a child only, return
        its spawn id and request."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the test run is for the children
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        try:
            while True:
                ready, _, _ = select.select([self.requests, wake_r], [], [])
                if wake_r in ready:
                    _drain(wake_r)
                    self._reap()
                if self.requests not in ready:
                    continue
                message = _read(self.requests)
                if message is None:
                    sys.exit(0)  # the test process is gone: so are its replicas (below)
                if message[0] == "signal":
                    _, pid, signum = message
                    if pid in self.children:
                        os.kill(pid, signum)
                    continue
                _, spawn_id, request = message
                _preload(request)
                pid = os.fork()
                if pid == 0:
                    for fd in (wake_r, wake_w, self.requests, self.replies):
                        os.close(fd)
                    signal.set_wakeup_fd(-1)
                    return spawn_id, request
                self.children.add(pid)
                _write(self.replies, ("started", spawn_id, pid))
        finally:
            if os.getpid() == self.pid:  # the zygote ends, however: its children with it
                for pid in self.children:
                    os.kill(pid, signal.SIGKILL)
                for pid in self.children:
                    os.waitpid(pid, 0)

    def _reap(self) -> None:
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            self.children.discard(pid)
            _write(self.replies, ("exited", pid, os.waitstatus_to_exitcode(status)))


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 4096):
                return
        except BlockingIOError:
            return


def _preload(request: SpawnRequest) -> None:
    sys.path[:0] = [p for p in request.path if p not in sys.path]
    if request.module and request.module not in sys.modules:
        try:
            importlib.import_module(request.module)
        except BaseException:  # noqa: S110 (the child imports it again, and reports why it fails)
            pass


def _become(request: SpawnRequest, zygote_pid: int) -> None:
    """Turn this freshly forked child into the requested replica process."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote_pid:  # it died before the line above
        os._exit(1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = os.open(request.output, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    sys.argv = [sys.modules["zcollective._child"].__file__ or "", request.payload, request.result]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # as a fresh interpreter's would be (Python reseeds random itself)


def main(requests: int, replies: int) -> int:
    for name in PRELOAD:
        importlib.import_module(name)
    server = _Server(requests, replies)
    _, request = server.serve()
    _become(request, server.pid)
    from zcollective._child import main as run
    return run(request.payload, request.result)


# -- the test process's side ---------------------------------------------------

class Zygote:
    """A zygote process and what it reports."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env = fixed_at_start(env)
        their_requests, self._requests = os.pipe()
        self._replies, their_replies = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(their_requests), str(their_replies)],
                stdin=subprocess.DEVNULL, stdout=sys.__stderr__, env=env,
                pass_fds=(their_requests, their_replies),
            )
        finally:
            os.close(their_requests)
            os.close(their_replies)
        self._write_lock = threading.Lock()  # a request is larger than a pipe writes at once
        self._changed = threading.Condition()
        self._next_id = 0
        self._started: dict[int, ForkedProcess] = {}
        self._running: dict[int, ForkedProcess] = {}
        self.gone = False
        threading.Thread(target=self._listen, name="zcollective-zygote", daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                message = _read(self._replies)
            except Exception:  # a corrupt stream: this zygote is of no more use
                message = None
            with self._changed:
                if message is None:
                    self._end()
                elif message[0] == "started":
                    _, spawn_id, pid = message
                    child = ForkedProcess(self, pid)
                    self._running[pid] = self._started[spawn_id] = child
                else:  # "exited": the zygote reaped it, so its pid may be reused from now on
                    _, pid, returncode = message
                    ended = self._running.pop(pid, None)
                    if ended is not None:
                        ended.returncode = returncode
                self._changed.notify_all()
            if message is None:
                replies, self._replies = self._replies, -1  # (only this thread reads it)
                os.close(replies)
                return

    def _end(self) -> None:
        """(With ``_changed``.) This zygote is gone or of no use: kill it;
        its children die with it (``PR_SET_PDEATHSIG``)."""
        self.gone = True
        if self._proc.poll() is None:
            self._proc.kill()
        for child in self._running.values():
            child.returncode = -signal.SIGKILL
        self._running.clear()
        self._changed.notify_all()

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a child forked here can have environment ``env``."""
        return not self.gone and fixed_at_start(env) == self.env

    def submit(self, request: SpawnRequest) -> int:
        """Ask for a child; :meth:`collect` it with the id returned."""
        with self._changed:
            spawn_id = self._next_id = self._next_id + 1
        self._send(("spawn", spawn_id, request))
        return spawn_id

    def collect(self, spawn_id: int, timeout: Optional[float] = None) -> ForkedProcess:
        """The child asked for as ``spawn_id``.

        Raises
        ------
        ZygoteGone
            It was not started in time: the zygote is given up, with every
            child it has (a late start would run a replica twice).
        """
        with self._changed:
            if not self._changed.wait_for(lambda: spawn_id in self._started or self.gone,
                                          START_TIMEOUT_S if timeout is None else timeout):
                self._end()
            if spawn_id not in self._started:
                raise ZygoteGone("the zygote did not start the process in time")
            return self._started.pop(spawn_id)

    def abandon(self) -> None:
        """Give this zygote up, with every child it has or is about to have."""
        with self._changed:
            self._end()

    def signal(self, child: ForkedProcess, signum: int) -> None:
        with self._changed:
            if child.returncode is not None or self.gone:
                return
        try:
            self._send(("signal", child.pid, signum))
        except ZygoteGone:
            pass  # then the child died with it

    def wait(self, child: ForkedProcess, timeout: Optional[float]) -> Optional[int]:
        with self._changed:
            self._changed.wait_for(lambda: child.returncode is not None, timeout)
            return child.returncode

    def _send(self, message: Any) -> None:
        try:
            with self._write_lock:
                _write(self._requests, message)
        except OSError as exc:
            with self._changed:
                self._end()
            raise ZygoteGone("the zygote ended") from exc

    def close(self) -> None:
        """End the zygote (it kills any child still running)."""
        with self._write_lock:
            if self._requests < 0:
                return
            os.close(self._requests)
            self._requests = -1
        try:
            self._proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def forget(self) -> None:
        """In a child of the test process: let go of the pipes without a word."""
        for fd in (self._requests, self._replies):
            if fd >= 0:  # a closed one's number may be another file's now
                os.close(fd)


class ForkedProcess:
    """A child of a zygote, with the part of :class:`subprocess.Popen`'s
    interface that :class:`zcollective.testing.Replicas` offers."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: Optional[int] = None  # set by the zygote's listener

    def poll(self) -> Optional[int]:
        return self._zygote.wait(self, 0)

    def wait(self, timeout: Optional[float] = None) -> int:
        returncode = self._zygote.wait(self, timeout)
        if returncode is None:
            raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)
        return returncode

    def send_signal(self, signum: int) -> None:
        self._zygote.signal(self, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_zygotes: dict[int, Zygote] = {}
_started: list[Zygote] = []  # every one, replaced ones too: each is closed at exit
_lock = threading.Lock()


def zygote(index: int) -> Optional[Zygote]:
    """This process's zygote for rank ``index``, started on first use; None
    if fresh interpreters are wanted."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    with _lock:
        found = _zygotes.get(index)
        if found is None or found.gone:
            if not _started:
                import atexit

                atexit.register(_close_all)
            found = _zygotes[index] = Zygote()
            _started.append(found)
        return found


def _close_all() -> None:
    for z in _started:
        z.close()


def _forget_all() -> None:
    """After a fork of the test process: the child has no zygotes of its own."""
    for z in _started:
        z.forget()
    _zygotes.clear()
    _started.clear()


os.register_at_fork(after_in_child=_forget_all)


def forked(requests: list[SpawnRequest]) -> Optional[list[ForkedProcess]]:
    """Every replica forked from its rank's zygote, if they all can be (None:
    start fresh interpreters): ``zcollective.testing.spawner``."""
    zygotes = []
    for rank, request in enumerate(requests):
        found = zygote(rank)
        if found is None or not found.accepts(request.env):
            return None
        zygotes.append(found)
    started: list[ForkedProcess] = []
    try:
        ids = [z.submit(r) for z, r in zip(zygotes, requests, strict=True)]  # all first: a first
        started.extend(z.collect(i) for z, i in zip(zygotes, ids, strict=True))  # import runs in each at once
    except ZygoteGone:  # every one asked is given up: a late fork would run a replica twice
        for z in zygotes:
            z.abandon()
        return None
    return started


if __name__ == "__main__":
    sys.modules["_zygote"] = sys.modules["__main__"]  # a test module importing it gets this one
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
