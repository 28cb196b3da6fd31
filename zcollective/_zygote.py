"""A warm process that forks replica processes for :mod:`zcollective.testing`.

A replica started as ``python -m zcollective._child`` spends most of its
start-up importing: the interpreter's site packages, zcollective and
cloudpickle, then the module that defines the function it runs (for a test,
with pytest and numpy). The test suite starts hundreds of them. The zygote
imports all of that once, then forks a child per replica, as
``multiprocessing``'s forkserver does.

A child is a separate process like any other (its own sockets, its own
signals, its own exit), with three differences from a fresh interpreter,
each of which it undoes: it sets its environment, working directory and
``sys.argv`` to the requested ones; it restores default signal handling; and
it leaves through the interpreter's own exit, so ``atexit`` handlers run
(``multiprocessing`` children skip them with ``os._exit``, which would hide
what a program ending without ``teardown`` does). What an interpreter reads
only at start-up (``PYTHON*`` variables, thread-count variables read when
numpy loads) cannot be undone after a fork, so :class:`Zygote` refuses a
request whose environment differs there, and the caller starts a fresh
interpreter instead.

Protocol, over the zygote's stdin and stdout: length-prefixed pickles.
Requests: ``("spawn", request)``, ``("signal", pid, signum)``; replies:
``("started", pid)`` or ``("refused", why)`` for each spawn, and
``("exited", pid, returncode)`` whenever a child ends. The zygote sends a
signal only to a child it has not yet reaped, so a recycled pid is never hit.
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Zygote", "ForkedProcess", "SpawnRequest", "zygote"]

HEADER = struct.Struct("!I")
PRELOAD = ("cloudpickle", "zcollective", "zcollective._child")
# read once, when the interpreter or numpy starts:
FIXED_AT_START = ("PYTHON", "OMP_", "OPENBLAS_", "MKL_", "LD_", "MALLOC_")
DISABLE_ENV = "ZCOLLECTIVE_TESTING_FRESH"  # "1": every replica is a fresh interpreter
START_TIMEOUT_S = 30.0  # the zygote answers a spawn within this (its first import of a test module included)


@dataclass
class SpawnRequest:
    """What a child needs to become ``python -m zcollective._child payload result``."""

    payload: str
    result: str
    output: str  # the file its stdout and stderr go to
    env: dict[str, str]
    cwd: str
    path: list[str]  # sys.path entries to add, for importing ``module``
    module: Optional[str]  # imported by the zygote first, so that every later child has it


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
    """The next message, or None at end of stream."""
    header = _read_exactly(fd, HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    data = _read_exactly(fd, size)
    return pickle.loads(data) if len(data) == size else None


def fixed_at_start(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that only take effect when an interpreter starts."""
    return {k: v for k, v in env.items() if k.startswith(FIXED_AT_START)}


# -- the zygote process ------------------------------------------------------

def _serve(requests: int, replies: int) -> SpawnRequest:
    """Fork children on request until the requests end (then exit); return, in
    a child only, the request it is to run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the test run is for the children, not for this
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in ready:
            while True:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    break
            _reap(children, replies)
        if requests not in ready:
            continue
        message = _read(requests)
        if message is None:
            for pid in children:  # the test process is gone: so are the replicas it started
                os.kill(pid, signal.SIGKILL)
            for pid in children:
                os.waitpid(pid, 0)
            sys.exit(0)
        if message[0] == "signal":
            _, pid, signum = message
            if pid in children:
                os.kill(pid, signum)
            continue
        request: SpawnRequest = message[1]
        _preload(request)
        pid = os.fork()
        if pid == 0:
            for fd in (wake_r, wake_w):
                os.close(fd)
            signal.set_wakeup_fd(-1)
            return request
        children.add(pid)
        _write(replies, ("started", pid))


def _reap(children: set[int], replies: int) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        _write(replies, ("exited", pid, os.waitstatus_to_exitcode(status)))


def _preload(request: SpawnRequest) -> None:
    sys.path[:0] = [p for p in request.path if p not in sys.path]
    if request.module and request.module not in sys.modules:
        try:
            importlib.import_module(request.module)
        except BaseException:  # noqa: S110 (the child imports it again, and reports why it fails)
            pass


def _become(request: SpawnRequest) -> None:
    """Turn this freshly forked child into the requested replica process
    (its stdin and stdout, the zygote's pipes, are replaced)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
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


def main() -> int:
    for name in PRELOAD:
        importlib.import_module(name)
    request = _serve(sys.stdin.fileno(), sys.stdout.fileno())
    _become(request)
    from ._child import main as run
    return run(request.payload, request.result)


# -- the test process's side -------------------------------------------------

class ZygoteGone(RuntimeError):
    """The zygote ended: start fresh interpreters instead."""


class Zygote:
    """A zygote process and what it reports; one per test process."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env = fixed_at_start(env)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "zcollective._zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, close_fds=True, bufsize=0,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._requests, self._replies = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        self._lock = threading.Lock()  # one spawn at a time: its reply is the next "started"
        self._changed = threading.Condition()
        self._started: list[ForkedProcess] = []
        self._running: dict[int, ForkedProcess] = {}
        self.gone = False
        threading.Thread(target=self._listen, name="zcollective-zygote", daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                message = _read(self._replies)
            except OSError:
                message = None
            with self._changed:
                if message is None:
                    self.gone = True
                elif message[0] == "started":
                    child = ForkedProcess(self, message[1])
                    self._running[child.pid] = child
                    self._started.append(child)
                else:  # "exited": the zygote reaped it, so its pid may be reused from now on
                    _, pid, returncode = message
                    ended = self._running.pop(pid, None)
                    if ended is not None:
                        ended.returncode = returncode
                self._changed.notify_all()
            if message is None:
                return

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a child forked here can have environment ``env``."""
        return not self.gone and fixed_at_start(env) == self.env

    def spawn(self, request: SpawnRequest) -> ForkedProcess:
        with self._lock:
            self._send(("spawn", request))
            with self._changed:
                if not self._changed.wait_for(lambda: self._started or self.gone, START_TIMEOUT_S) \
                        or not self._started:
                    raise ZygoteGone("the zygote did not start the process")
                return self._started.pop(0)

    def signal(self, child: ForkedProcess, signum: int) -> None:
        with self._changed:
            if child.returncode is not None:
                return
        self._send(("signal", child.pid, signum))

    def wait(self, child: ForkedProcess, timeout: Optional[float]) -> Optional[int]:
        with self._changed:
            self._changed.wait_for(lambda: child.returncode is not None or self.gone, timeout)
            if child.returncode is None and self.gone:
                raise ZygoteGone(f"the zygote ended before its child {child.pid}")
            return child.returncode

    def _send(self, message: Any) -> None:
        try:
            _write(self._requests, message)
        except OSError as exc:
            with self._changed:
                self.gone = True
            raise ZygoteGone("the zygote ended") from exc

    def close(self) -> None:
        """End the zygote (it kills any child still running)."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ForkedProcess:
    """A child of the zygote, with the part of :class:`subprocess.Popen`'s
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


_zygote: Optional[Zygote] = None
_owner = 0


def zygote() -> Optional[Zygote]:
    """This process's zygote, started on first use; None if fresh interpreters are wanted."""
    global _zygote, _owner
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    if _zygote is None or _owner != os.getpid() or _zygote.gone:
        import atexit

        _zygote, _owner = Zygote(), os.getpid()
        atexit.register(_zygote.close)
    return _zygote


if __name__ == "__main__":
    sys.exit(main())
