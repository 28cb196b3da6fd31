"""Run a function on n local replicas, each a separate process, for tests.

::

    from zcollective.testing import run_replicas

    def step(x):
        import zcollective
        return zcollective.allreduce(x * (zcollective.get_rank() + 1))

    def test_step():
        assert run_replicas(step, 3, 2) == [12, 12, 12]

Each replica joins a fresh default group on a free loopback port (so ``fn`` calls the module functions
directly), runs ``fn(*args, **kwargs)`` and tears the group down. Every wait is bounded; on any failure the
error shows each rank's exception, traceback and output.

Each replica is a fresh interpreter, unless a test suite sets :data:`spawner` to a faster way of starting
them (zcollective's own suite forks them from warm processes: its tests/_zygote.py).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import cloudpickle

from ._io import _sockets
from .config import DEFAULT_MASTER_PORT

__all__ = ["run_replicas", "Replicas", "ReplicasFailed", "SpawnRequest", "free_port", "spawner"]

DEFAULT_TIMEOUT_S = 60.0  # generous for a loaded 2-core CI machine, short enough to notice a hang
OUTPUT_TAIL_CHARS = 4000  # per rank, in failure messages
STACKS_WAIT_S = 1.0  # a replica that overran gets this long to write its stacks before it is killed
KILL_WAIT_S = 30.0  # a killed process is gone within this


class ReplicasFailed(AssertionError):
    """At least one replica raised, exited non-zero, or ran out of time (``outcomes``: one per rank)."""

    def __init__(self, message: str, outcomes: list[Outcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


class Outcome:
    """What one replica process did."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.returncode: Optional[int] = None
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.traceback = ""
        self.output = ""
        self.timed_out = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None and not self.timed_out

    def describe(self) -> str:
        if self.timed_out:
            state = "did not finish in time (killed)"
        elif self.error is not None:
            state = f"raised {type(self.error).__name__}: {self.error}"
        elif self.returncode is not None and self.returncode < 0:
            state = f"was killed by signal {-self.returncode}"
        else:
            state = f"exited with code {self.returncode}"
        text = f"--- rank {self.rank} {state}\n"
        if self.traceback:
            text += self.traceback
        output = self.output[-OUTPUT_TAIL_CHARS:]
        tail = " (tail)" if len(self.output) > len(output) else ""
        text += f"--- rank {self.rank} output{tail}:\n{output or '(none)'}\n"
        return text


@dataclass
class SpawnRequest:
    """What a replica process needs to be ``python -m zcollective._child payload result``."""

    payload: str
    result: str
    output: str  # the file its stdout and stderr go to
    env: dict[str, str]
    cwd: str
    path: list[str]  # sys.path entries to add, for importing ``module``
    module: Optional[str]  # the module that defines the function it runs


spawner: Optional[Callable[[list[SpawnRequest]], Optional[list[Any]]]] = None
"""A faster way to start replica processes: given one request per rank, Popen-like process objects, or
None (fresh interpreters). None: always fresh interpreters."""


PORTS_BELOW_EPHEMERAL = 8192  # how many ports under the ephemeral range free_port hands out
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"  # read on Linux only
DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default start; BSDs, macOS and Windows start higher (49152)
LAUNCHER_PORTS = frozenset({DEFAULT_MASTER_PORT, DEFAULT_MASTER_PORT + 1, 29400, 29500, 29501})
# never handed out: launchers' default ports (a test's group there and a job would join each other)
_next_port: list[int] = []  # this process's next candidate in its slice
os.register_at_fork(after_in_child=_next_port.clear)  # a forked child starts at a random place


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago: taken in turn just under the kernel's ephemeral range (no
    port bound to 0 takes it meanwhile), a slice per pytest-xdist worker, :data:`LAUNCHER_PORTS` skipped."""
    ephemeral = _ephemeral_low()
    low = max(1024, ephemeral - PORTS_BELOW_EPHEMERAL)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % workers
    size = (ephemeral - low) // workers
    if size >= 64:
        start = low + worker * size
        if not _next_port:
            _next_port.append(start + int.from_bytes(os.urandom(2), "big") % size)
        for _ in range(size):
            port = start + (_next_port[0] - start) % size
            _next_port[0] = port + 1
            if port in LAUNCHER_PORTS:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError as exc:
                    if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                        continue
                    raise  # not the port's fault (a host that is not this one's): said at once
                return port
    return _sockets.kernel_port(host)  # no such range here


def _ephemeral_low() -> int:
    """Where the kernel's ephemeral ports start (Linux says)."""
    if sys.platform.startswith("linux"):
        try:
            with open(EPHEMERAL_RANGE_FILE) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return DEFAULT_EPHEMERAL_LOW


class Replicas:
    """``n`` replica processes running ``fn``; start them, then :meth:`wait`.

    Lower level than :func:`run_replicas`: the processes are reachable in :attr:`procs`, so a test can kill
    or signal one of them.

    Parameters
    ----------
    initialize
        Join the default group before calling ``fn`` (and tear it down after). ``False`` leaves that to
        ``fn``; the environment still names the master and this replica's rank.
    env
        Extra environment variables for every replica; ``rank_env`` maps a rank to extra variables for that
        rank only.
    rank_prefix
        Maps a rank to a command its process is started under, for instance ``["ip", "netns", "exec",
        "host1"]`` to run it in a network namespace.
    """

    def __init__(self, fn: Callable[..., Any], n: int, *args: Any, initialize: bool = True,
                 env: Optional[dict[str, str]] = None,
                 rank_env: Optional[dict[int, dict[str, str]]] = None,
                 port: Optional[int] = None, init_timeout: float = DEFAULT_TIMEOUT_S,
                 rank_prefix: Optional[dict[int, list[str]]] = None, **kwargs: Any) -> None:
        self.n = n
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="zcollective-test-")
        payload = os.path.join(self._dir.name, "payload.pkl")
        with open(payload, "wb") as f:
            cloudpickle.dump(list(sys.path), f)  # first, so the child can import fn's module
            cloudpickle.dump((fn, args, kwargs, initialize, init_timeout), f)
        self.outcomes = [Outcome(r) for r in range(n)]
        self.procs: list[Any] = []  # subprocess.Popen, or what the spawner gives
        self._outs: list[Any] = []
        module = getattr(fn, "__module__", None)
        requests, prefixes = [], []
        for rank in range(n):
            child_env = {
                **os.environ,
                "ZCOLLECTIVE_MASTER_ADDR": "127.0.0.1",
                "ZCOLLECTIVE_MASTER_PORT": str(self.port),
                "ZCOLLECTIVE_REPLICA_RANK": str(rank),
                "ZCOLLECTIVE_NUM_REPLICAS": str(n),
                "PYTHONUNBUFFERED": "1",
                **(env or {}),
                **(rank_env or {}).get(rank, {}),
            }
            output = os.path.join(self._dir.name, f"out{rank}.txt")
            out = open(output, "w+b")  # noqa: SIM115 (closed in wait)
            self._outs.append(out)
            requests.append(SpawnRequest(payload, os.path.join(self._dir.name, f"result{rank}.pkl"), output,
                                         child_env, os.getcwd(), list(sys.path),
                                         module if module != "__main__" else None))
            prefixes.append((rank_prefix or {}).get(rank, []))
        forked = None if any(prefixes) or spawner is None else spawner(requests)
        self.procs.extend(forked or (subprocess.Popen(
            [*prefix, sys.executable, "-m", "zcollective._child", r.payload, r.result],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=r.env,
        ) for prefix, r, out in zip(prefixes, requests, self._outs, strict=True)))

    def wait(self, timeout: float = DEFAULT_TIMEOUT_S) -> list[Outcome]:
        """Wait for every replica (killing those left at ``timeout``); collect what each did."""
        deadline = time.monotonic() + timeout
        for rank in range(self.n):
            self.outcomes[rank].timed_out = not self.join([rank], deadline - time.monotonic())
        if any(o.timed_out for o in self.outcomes) and hasattr(signal, "SIGUSR2"):
            for proc in self.procs:  # each overrunning replica writes its threads' stacks
                if proc.poll() is None:  # to its output (zcollective._child registered it)
                    proc.send_signal(signal.SIGUSR2)
            time.sleep(STACKS_WAIT_S)
        self.kill_all()
        for rank, proc in enumerate(self.procs):
            outcome = self.outcomes[rank]
            outcome.returncode = proc.returncode
            self._outs[rank].seek(0)
            outcome.output = self._outs[rank].read().decode("utf-8", "replace")
            self._outs[rank].close()
            path = os.path.join(self._dir.name, f"result{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    kind, value, tb = cloudpickle.load(f)
                if kind == "ok":
                    outcome.value = value
                else:
                    outcome.error, outcome.traceback = value, tb
        self._dir.cleanup()
        return self.outcomes

    def join(self, ranks: list[int], timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Wait until the given ranks' processes have exited; False on timeout."""
        deadline = time.monotonic() + timeout
        for rank in ranks:
            try:
                self.procs[rank].wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        self.procs[rank].send_signal(sig)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(KILL_WAIT_S)

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill_all()
        for out in self._outs:
            if not out.closed:
                out.close()
        self._dir.cleanup()


def report(outcomes: list[Outcome], headline: str) -> str:
    return headline + "\n" + "".join(o.describe() for o in outcomes)


def run_replicas(fn: Callable[..., Any], n: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                 initialize: bool = True, env: Optional[dict[str, str]] = None,
                 **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``n`` local replicas in separate processes, each in a fresh group;
    return the return values in rank order.

    ``fn`` and its arguments travel with cloudpickle, so lambdas and local functions work. The whole run is
    bounded by ``timeout`` seconds.

    Raises
    ------
    ReplicasFailed
        A replica raised, exited non-zero or did not finish in time; the message holds every rank's
        exception, traceback and output, and ``.outcomes`` the details.
    """
    with Replicas(fn, n, *args, initialize=initialize, env=env,
                  init_timeout=timeout, **kwargs) as replicas:
        outcomes = replicas.wait(timeout)
    failed = [o.rank for o in outcomes if not o.ok]
    if failed:
        raise ReplicasFailed(report(outcomes, f"replicas {failed} of {n} failed"), outcomes)
    return [o.value for o in outcomes]
