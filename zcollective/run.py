"""``zcollective-run``: start the replicas of a job, like torchrun's standalone mode or mpiexec
(``zcollective-run -n 4 train.py --lr 0.1``). What each replica is given, the rank prefix, failures,
the exit status: docs/launching.md, *zcollective-run*. The replicas say where they are in the files
:mod:`zcollective._announce` writes and reads."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import IO, Callable, NoReturn, Optional

from . import __version__
from ._announce import COORDINATOR_FILE_ENV, GROUPS_FILE_ENV, STACKS_DIR_ENV, Groups
from ._io._stacks import STACKS_SIGNAL
from ._protocol._stats import slowest
from .config import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, JOB_ENV, SECRET_ENV, SECRET_FILE_ENV

DEFAULT_GRACE_S = 5.0  # time a replica gets to notice a failure and exit, or go on without the lost
KILL_AFTER_S = 5.0  # after SIGTERM/SIGINT, the time before SIGKILL
COORDINATOR_MOVE_S = 10.0  # --replace-lost: rank 0 died; the survivors' new one says where it is
POLL_S = 0.05  # how often the launcher looks at its replicas: a stop is late by at most this
STOP_NEWCOMER_S = 5.0  # a newcomer killed to start it again at a moved coordinator ends within this
SPAWN_THREADS = 16  # replicas started at once (each start waits for its exec; benchmarks/join.py)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="zcollective-run",
        description="Start the replicas of a zcollective job on this host. Each line of output is "
                    "prefixed with the process's current rank (it changes after a shrink or grow). "
                    "Exit status: 0 when every replica exited 0, or was lost and the others went on "
                    "without it (shrink); else that of the first failure not tolerated.",
        epilog="Example: zcollective-run -n 4 train.py --epochs 3. The script reads its rank "
               "with zcollective.initialize(); no arguments are needed in it.",
    )
    parser.add_argument("-n", "--nproc-per-node", type=int, default=1, metavar="N",
                        help="replicas to start on this host (default 1)")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="hosts in the job (default 1); start the launcher on each")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this host's index, 0 to nnodes-1; node 0 hosts rank 0 (default 0)")
    parser.add_argument("--master-addr", default=None,
                        help=f"address of node 0, reachable from every host (default {DEFAULT_MASTER_ADDR})")
    parser.add_argument("--master-port", type=int, default=None,
                        help="port of the coordinator on node 0 (default: a free port on a single "
                             f"host, {DEFAULT_MASTER_PORT} across hosts)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                        help="seconds the others get after a replica fails to exit, or to go on "
                             "without it in a new group (zcollective.shrink()): if they went on, "
                             f"they are kept, else stopped (default {DEFAULT_GRACE_S:g})")
    parser.add_argument("--tolerate-lost", action="store_true",
                        help="a replica that fails stops nobody and is not replaced: the others "
                             "may go on without it (zcollective.shrink()), however long they take; "
                             "prints how a newcomer started by hand joins the job")
    parser.add_argument("--replace-lost", type=int, default=0, metavar="K",
                        help="start a replica that dies (up to K times in all) again, as a "
                             "newcomer (ZCOLLECTIVE_JOIN=1) at the group's coordinator, while the "
                             "others keep running; the program admits it with zcollective.grow() "
                             "(default 0: nobody is replaced); prints how a newcomer started by "
                             "hand joins the job")
    parser.add_argument("--no-straggler-summary", dest="straggler_summary", action="store_false",
                        help="do not print which rank of the last group was slowest when the job "
                             "ends (said on the host of that group's rank 0)")
    parser.add_argument("--version", action="version", version=f"zcollective {__version__}")
    parser.add_argument("script", help="a Python script (run with this Python) or a program")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.nproc_per_node < 1:
        parser.error(f"-n/--nproc-per-node must be at least 1, not {ns.nproc_per_node}")
    if ns.nnodes < 1:
        parser.error(f"--nnodes must be at least 1, not {ns.nnodes}")
    if not 0 <= ns.node_rank < ns.nnodes:
        parser.error(f"--node-rank must be from 0 to {ns.nnodes - 1}, not {ns.node_rank}")
    if ns.nnodes > 1 and ns.master_addr is None:
        parser.error("--master-addr is required with --nnodes > 1 (the address of node 0)")
    if ns.master_port is not None and not 1 <= ns.master_port <= 65535:
        parser.error(f"--master-port must be from 1 to 65535, not {ns.master_port}")
    if ns.grace < 0:
        parser.error("--grace must not be negative")
    if ns.replace_lost < 0:
        parser.error("--replace-lost must not be negative")
    if ns.script.endswith(".py") and not os.path.isfile(ns.script):
        parser.error(f"no such script: {ns.script}")
    return ns


@dataclass(eq=False)
class Replica:
    """One process the launcher started."""

    slot: int  # the rank it was started as (a newcomer: that of the replica it replaces)
    local_rank: int
    proc: subprocess.Popen[bytes]
    newcomer: int = 0  # the n-th newcomer this launcher started; 0: one of the first group
    said: bytes = b""  # what explains its failure (see _pump)
    eof_at: float = float("inf")  # when its output ended: about when it did (which ended first)
    pump: Optional[threading.Thread] = None  # copies its output
    ended: bool = False  # its end was dealt with
    at: str = ""  # a newcomer: the coordinator's address it was started at (host:port)


@dataclass(eq=False)
class Loss:
    """A replica that failed, and whether the others went on without it."""

    who: str  # as the messages name it
    code: int
    group: Optional[str]  # the group it was in (None: it never joined one)
    rank: Optional[int]  # its rank there
    deadline: Optional[float]  # the others are stopped then, unless they went on (None: never)
    tolerated: bool = False  # the others went on without it, in a group formed from its group
    replaced: bool = False  # a newcomer was started in its place (--replace-lost)


def _pump(replica: Replica, out: IO[bytes], lock: threading.Lock, label: Callable[[], str]) -> None:
    """Copy a replica's output, each line prefixed with ``label()``; keep what explains a failure: its
    last traceback's exception, else its last line."""
    stream = replica.proc.stdout
    assert stream is not None
    in_traceback, raised = False, b""
    for line in iter(stream.readline, b""):
        if line.startswith(b"Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line.strip() and not line[:1].isspace():
            in_traceback, raised = False, line.strip()
        if line.strip():
            replica.said = raised or line.strip()
        prefix = f"[{label()}] ".encode()
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    replica.eof_at = time.monotonic()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _temp_file(prefix: str, text: str = "") -> str:
    """A new file only this user can read, holding ``text``."""
    fd, path = tempfile.mkstemp(prefix=prefix)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _joining(where: str) -> dict[str, str]:
    """A newcomer's variables: wait at ``where`` (``host:port``; else at the master address)."""
    host, _, port = where.rpartition(":")
    at = {"ZCOLLECTIVE_MASTER_ADDR": host.strip("[]"), "ZCOLLECTIVE_MASTER_PORT": port}
    return {"ZCOLLECTIVE_JOIN": "1", **(at if host and port.isdigit() else {})}


class Losses:
    """The replicas that failed, whether the others went on without each, and the job's exit status."""

    def __init__(self, groups: Groups, grace: Optional[float]) -> None:
        self.groups = groups
        self.grace = grace  # the others' time to go on without a loss; None: no bound
        self.all: list[Loss] = []

    def add(self, loss: Loss, said: str, never_admitted: bool) -> None:
        """Record ``loss`` and, unless it was replaced, say what happened and what happens now."""
        if not loss.replaced:
            what = f"{loss.who} {_describe(loss.code)}" + (f" ({said})" if said else "")
            earlier = self.pending(loss.group)
            if never_admitted:  # no group needed it
                loss.tolerated = True
                _say(f"{what} before it was admitted")
            elif earlier is not None:  # likely a consequence of the loss said already
                loss.deadline = earlier.deadline
            elif self.grace is None:
                _say(f"{what}; the others may go on without it")
            else:
                loss.deadline = time.monotonic() + self.grace
                _say(f"{what}; stopping the others in {self.grace:g} s unless they go on "
                     f"without it (zcollective.shrink())")
        self.all.append(loss)

    def pending(self, group: Optional[str]) -> Optional[Loss]:
        """A loss in ``group`` (not replaced) the others have not gone on without (yet)."""
        return next((loss for loss in self.all
                     if not loss.tolerated and not loss.replaced and loss.group == group), None)

    def settle(self) -> None:
        """Mark the losses the others went on without, and say so."""
        for loss in self.all:
            if loss.tolerated or loss.group is None:
                continue
            went_on = self.groups.formed_from(loss.group)
            if went_on is not None:
                loss.tolerated = True
                _say(f"the others went on without {loss.who} (it {_describe(loss.code)}), "
                     f"in a group of {self.groups.size[went_on]}: keeping them")

    def overdue(self, now: float) -> bool:
        """A loss the others did not go on without within their grace."""
        return any(not loss.tolerated and loss.deadline is not None and now > loss.deadline
                   for loss in self.all)

    def status(self) -> int:
        """0 when every loss was tolerated; else the first other's status (128 + N for signal N)."""
        for loss in self.all:
            if not loss.tolerated:
                return loss.code if loss.code > 0 else 128 - loss.code
        if self.all:
            lost = "; ".join(f"{loss.who} {_describe(loss.code)}" for loss in self.all)
            _say(f"the job went on without {len(self.all)} lost replica"
                 f"{'s' if len(self.all) > 1 else ''} ({lost}); every other exited 0")
        return 0


def _say(text: str) -> None:
    sys.stderr.write(f"zcollective-run: {text}\n")
    sys.stderr.flush()


class Launcher:
    """Starts this host's replicas, copies their output, and watches them until the job ends."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.elastic = ns.tolerate_lost or ns.replace_lost > 0  # newcomers may come: say how
        self.replicas: list[Replica] = []
        self.replaced = 0  # replicas started again as newcomers (--replace-lost)
        self.secret: Optional[str] = None
        self.secret_file: Optional[str] = None  # the launcher's secret, for newcomers by hand
        if ns.nnodes == 1 and not os.environ.get(SECRET_ENV) and not os.environ.get(SECRET_FILE_ENV):
            # one host: a fresh secret per job, so nobody else on the machine can join or inject
            self.secret = secrets.token_hex(32)
            if self.elastic:
                self.secret_file = _temp_file("zcollective-secret-", self.secret)
        self.groups_file = _temp_file("zcollective-groups-")
        self.stacks_dir = tempfile.mkdtemp(prefix="zcollective-stacks-")  # a file here asks for stacks
        self.groups = Groups(self.groups_file)
        self.losses = Losses(self.groups, None if ns.tolerate_lost else ns.grace)
        self.coordinator_file = _temp_file("zcollective-coordinator-") if self.elastic else None
        self.told: Optional[str] = None  # the coordinator's address last told for newcomers
        self.job = os.environ.get(JOB_ENV) or (f"zcollective-run {os.getpid()}" if ns.nnodes == 1 else None)
        self.where: Optional[str] = None  # the coordinator's address last seen (see redirect_newcomers)

    def env_for(self, rank: int, local_rank: int, port: int, size: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.secret is not None:
            env[SECRET_ENV] = self.secret
        if self.job is not None:
            env.setdefault(JOB_ENV, self.job)
        env.update({
            "ZCOLLECTIVE_MASTER_ADDR": self.ns.master_addr or DEFAULT_MASTER_ADDR,
            "ZCOLLECTIVE_MASTER_PORT": str(port),
            "ZCOLLECTIVE_REPLICA_RANK": str(rank),
            "ZCOLLECTIVE_NUM_REPLICAS": str(size),
            "ZCOLLECTIVE_LOCAL_RANK": str(local_rank),
            "PYTHONUNBUFFERED": "1",
            GROUPS_FILE_ENV: self.groups_file,
            STACKS_DIR_ENV: self.stacks_dir,
        })
        if self.coordinator_file is not None:
            env[COORDINATOR_FILE_ENV] = self.coordinator_file
        return env

    def newcomer_env(self, replica: Replica, where: str) -> dict[str, str]:
        """The environment of a newcomer in ``replica``'s slot, waiting at ``where``."""
        return {**self.env_for(replica.slot, replica.local_rank, self.port, self.size), **_joining(where)}

    def name(self, replica: Replica) -> str:
        """A replica as the messages name it: its current rank, and how it started if that differs."""
        joined = self.groups.current(replica.proc.pid)
        if joined is None:
            return f"newcomer {replica.newcomer}" if replica.newcomer else f"rank {replica.slot}"
        if joined.rank == replica.slot and not replica.newcomer:
            return f"rank {joined.rank}"
        started = f"newcomer {replica.newcomer}" if replica.newcomer else f"launched as rank {replica.slot}"
        return f"rank {joined.rank} ({started})"

    def label(self, replica: Replica) -> str:
        """The prefix of a replica's lines: its current rank (``newcomer N`` before it is admitted)."""
        joined = self.groups.current(replica.proc.pid)
        if joined is not None:
            return str(joined.rank)
        return f"newcomer {replica.newcomer}" if replica.newcomer else str(replica.slot)

    def straggler_summary(self) -> None:
        """Name the last group's slowest rank, from its rank 0's stats, never a rank lost in it."""
        if not self.ns.straggler_summary:
            return
        self.groups.refresh()
        if not self.groups.formed:
            return
        last = self.groups.formed[-1]
        ranks = dict(self.groups.stats.get(last, {}).get("ranks") or {})
        for loss in self.losses.all:
            if loss.group == last and loss.rank is not None:
                ranks.pop(str(loss.rank), None)
        line = slowest(ranks)
        if line is not None:
            _say(line)

    def start(self) -> None:
        ns = self.ns
        size = ns.nnodes * ns.nproc_per_node
        port = ns.master_port
        if port is None:
            if ns.nnodes == 1:
                from ._io._sockets import kernel_port

                port = kernel_port(ns.master_addr or DEFAULT_MASTER_ADDR)
            else:
                port = DEFAULT_MASTER_PORT
        self.port, self.size = port, size
        self.command = [ns.script, *ns.args]
        if ns.script.endswith(".py"):
            self.command = [sys.executable, *self.command]
        self.lock = threading.Lock()
        ranks = [(ns.node_rank * ns.nproc_per_node + local, local) for local in range(ns.nproc_per_node)]
        self.spawn_all([(rank, local, self.env_for(rank, local, port, size)) for rank, local in ranks])
        if self.elastic:
            self.tell_newcomers(f"{ns.master_addr or DEFAULT_MASTER_ADDR}:{port}")

    def spawn(self, slot: int, local_rank: int, env: dict[str, str], newcomer: int = 0) -> None:
        try:
            proc = self.popen(env)
        except OSError as exc:
            self.cannot_start(exc)
        self.adopt(slot, local_rank, env, proc, newcomer)

    def spawn_all(self, slots: list[tuple[int, int, dict[str, str]]]) -> None:
        """Start a process in each ``(slot, local_rank, env)``, :data:`SPAWN_THREADS` at a time."""
        def start(slot: int, local_rank: int, env: dict[str, str]) -> None:
            self.adopt(slot, local_rank, env, self.popen(env))  # (adopted in the thread: never lost)

        pool = ThreadPoolExecutor(min(SPAWN_THREADS, len(slots)), thread_name_prefix="spawn")
        try:
            starts = [pool.submit(start, *slot) for slot in slots]
            wait(starts)
        finally:
            pool.shutdown(cancel_futures=True)  # (waits for the starts under way)
            self.replicas.sort(key=lambda replica: replica.slot)
        for failure in (s.exception() for s in starts):
            if isinstance(failure, OSError):
                self.cannot_start(failure)
            if failure is not None:
                raise failure

    def popen(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def cannot_start(self, exc: OSError) -> NoReturn:
        _say(f"cannot start {self.command[0]!r}: {exc.strerror}")
        self.stop(signal.SIGTERM)
        raise SystemExit(127) from None

    def adopt(self, slot: int, local_rank: int, env: dict[str, str], proc: subprocess.Popen[bytes],
              newcomer: int = 0) -> None:
        """``proc`` started in ``slot``: pump its output."""
        self.groups.forget(proc.pid)
        replica = Replica(slot, local_rank, proc, newcomer,
                          at=f"{env.get('ZCOLLECTIVE_MASTER_ADDR')}:{env.get('ZCOLLECTIVE_MASTER_PORT')}")
        replica.pump = threading.Thread(target=_pump, daemon=True, args=(
            replica, sys.stdout.buffer, self.lock, lambda: self.label(replica)))
        replica.pump.start()
        self.replicas.append(replica)

    def coordinator(self, dead: Optional[int] = None) -> str:
        """The coordinator's ``host:port`` ("": not yet); if ``dead`` was its rank 0, the new one's."""
        assert self.coordinator_file is not None
        deadline = time.monotonic() + COORDINATOR_MOVE_S
        while True:
            try:
                with open(self.coordinator_file) as f:
                    where, _, pid = f.read().strip().partition(" ")
            except OSError:
                where, pid = "", ""
            if dead is None or pid != str(dead) or time.monotonic() > deadline:
                return where
            time.sleep(POLL_S)

    def tell_newcomers(self, where: str) -> None:
        """Say how a newcomer started by hand joins at ``where``: at the start and when it moves."""
        env = _joining(where)
        if "ZCOLLECTIVE_MASTER_PORT" not in env or where == self.told:
            return
        moved = self.told is not None
        self.told = where
        if self.secret_file is not None:
            env[SECRET_FILE_ENV] = self.secret_file
        if self.job is not None and JOB_ENV not in os.environ:  # (exported: the newcomer has it)
            env[JOB_ENV] = self.job
        command = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(self.command)])
        exported = os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV)
        mind = f" (with the {SECRET_ENV} or {SECRET_FILE_ENV} exported here)" if exported else ""
        _say(f"{'the coordinator moved; ' if moved else ''}a newcomer started by hand joins "
             f"this job (at its group's next grow()) with: {command}{mind}")

    def replace(self, replica: Replica, code: int) -> bool:
        """``--replace-lost``: start ``replica``'s slot again, a newcomer at the group's coordinator."""
        if self.replaced >= self.ns.replace_lost or self.coordinator_file is None or not self.running():
            return False
        where = self.coordinator(replica.proc.pid)
        env = self.newcomer_env(replica, where)
        self.replaced += 1
        _say(f"{self.name(replica)} {_describe(code)}; starting a newcomer in its place at "
             f"{where or 'the master address'} ({self.replaced} of {self.ns.replace_lost})")
        self.spawn(replica.slot, replica.local_rank, env, newcomer=self.replaced)
        return True

    def running(self) -> list[Replica]:
        return [r for r in self.replicas if r.proc.poll() is None]

    def signal_all(self, sig: int) -> None:
        for replica in self.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(replica.proc.pid, sig)

    def stop(self, sig: int) -> None:
        """Send ``sig`` to every replica still running, SIGKILL after a bound."""
        self.signal_all(sig)
        deadline = time.monotonic() + KILL_AFTER_S
        while time.monotonic() < deadline and self.running():
            time.sleep(POLL_S)
        self.signal_all(signal.SIGKILL)
        for replica in self.replicas:
            replica.proc.wait()

    def join_pumps(self, timeout: float) -> None:
        for replica in self.replicas:
            if replica.pump is not None:
                replica.pump.join(timeout=timeout)

    def just_ended(self) -> list[Replica]:
        """The replicas that ended since the last call, the first first (the others likely failed of it)."""
        ended = [r for r in self.replicas if not r.ended and r.proc.poll() is not None]
        for replica in ended:
            replica.ended = True
            if replica.proc.returncode != 0:
                assert replica.pump is not None
                replica.pump.join(timeout=1)  # its last output
        return sorted(ended, key=lambda r: r.eof_at)

    def ended(self, replica: Replica) -> None:
        """``replica`` ended: a failure is replaced, or a loss the others have the grace to go on without."""
        code = replica.proc.returncode
        if code == 0:
            return
        joined = self.groups.current(replica.proc.pid)  # (dead: all it said is written)
        loss = Loss(self.name(replica), code, joined.group if joined else None,
                    joined.rank if joined else None, None)
        loss.replaced = self.replace(replica, code)
        said = replica.said.decode("utf-8", "replace")[:300] if code > 0 else ""  # (a kill: no word)
        self.losses.add(loss, said, never_admitted=joined is None and replica.newcomer > 0)

    def wait(self) -> int:
        """Watch the replicas until every one ended (or was stopped); the job's exit status."""
        while True:
            self.groups.refresh()
            for replica in self.just_ended():
                self.ended(replica)
            self.losses.settle()
            self.show_stalled()
            if self.coordinator_file is not None:
                where = self.coordinator()
                self.redirect_newcomers(where)
                self.tell_newcomers(where)
            running = self.running()
            if not running:
                break
            if all(self.waiting_newcomer(r) for r in running):
                self.dismiss(running)  # the job is over: nobody will admit them
                break
            if self.losses.overdue(time.monotonic()):
                _say(f"stopping {', '.join(self.name(r) for r in running)}")
                self.stop(signal.SIGTERM)
                break
            time.sleep(POLL_S)
        self.join_pumps(timeout=2)
        return self.losses.status()

    def redirect_newcomers(self, where: str) -> None:
        """The coordinator moved (rank 0 was lost): start a newcomer still waiting at the old one again."""
        if not where or where == self.where:
            return
        moved, self.where = self.where is not None, where
        if not moved:
            return
        for replica in self.running():
            if replica.at != where and self.waiting_newcomer(replica):
                replica.ended = True  # (not a loss: this launcher ends it)
                with contextlib.suppress(OSError):
                    os.killpg(replica.proc.pid, signal.SIGKILL)
                replica.proc.wait(timeout=STOP_NEWCOMER_S)
                env = self.newcomer_env(replica, where)
                _say(f"the coordinator moved to {where}: starting {self.name(replica)} "
                     f"again there (it waited at the old one)")
                self.spawn(replica.slot, replica.local_rank, env, newcomer=replica.newcomer)

    def waiting_newcomer(self, replica: Replica) -> bool:
        """A newcomer this launcher started that no group has admitted yet."""
        return bool(replica.newcomer) and self.groups.current(replica.proc.pid) is None

    def dismiss(self, newcomers: list[Replica]) -> None:
        """Only ``newcomers`` waiting to be admitted are left: stop them (no loss)."""
        for replica in newcomers:
            _say(f"the job ended before a grow() admitted {self.name(replica)}: stopping it")
            replica.ended = True
        self.stop(signal.SIGTERM)

    def show_stalled(self) -> None:
        """A stall warning named ranks: have each write its threads' stacks to its stderr."""
        for group, ranks in self.groups.take_stalls():
            for replica in self.running():
                joined = self.groups.current(replica.proc.pid)
                if joined is not None and joined.group == group and joined.rank in ranks and joined.stacks:
                    _say(f"{self.name(replica)} is late in a call the others wait for: "
                         f"where its threads are:")
                    self.dump_stacks(replica)

    def dump_stacks(self, replica: Replica) -> bool:
        """Ask ``replica`` for its stacks (a file named by its pid), if it said it answers."""
        joined = self.groups.current(replica.proc.pid)
        if joined is None or not joined.stacks:
            return False
        with contextlib.suppress(OSError), open(os.path.join(self.stacks_dir, str(replica.proc.pid)), "w"):
            pass
        return True

    def dump_all_stacks(self) -> None:
        """The user asked (SIGUSR1 to the launcher): every replica's stacks."""
        _say("every replica's threads, as asked (SIGUSR1):")
        for replica in self.running():
            if not self.dump_stacks(replica):
                _say(f"{self.name(replica)}: no stacks (it has not joined a group, or "
                     f"ZCOLLECTIVE_STACKS=0)")


def main(argv: Optional[list[str]] = None) -> int:
    ns = parse_args(argv)
    launcher = Launcher(ns)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(STACKS_SIGNAL, lambda signum, frame: launcher.dump_all_stacks())
    try:
        launcher.start()
        code = launcher.wait()
        launcher.straggler_summary()
        return code
    except KeyboardInterrupt:
        _say("interrupted; stopping every replica")
        launcher.stop(signal.SIGINT)
        launcher.join_pumps(timeout=2)
        return 130
    finally:
        launcher.groups.close()
        for path in (launcher.groups_file, launcher.coordinator_file, launcher.secret_file):
            if path is not None:  # the launcher's files, removed when it ends
                with contextlib.suppress(OSError):
                    os.unlink(path)
        shutil.rmtree(launcher.stacks_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
