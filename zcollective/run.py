"""``zcollective-run``: start the replicas of a job, like torchrun's standalone
mode or mpiexec.

    zcollective-run -n 4 train.py --lr 0.1
    zcollective-run --nnodes 2 --node-rank 1 --nproc-per-node 2 \\
        --master-addr host0 --master-port 29457 train.py

Each replica gets ``ZCOLLECTIVE_MASTER_ADDR``, ``ZCOLLECTIVE_MASTER_PORT``,
``ZCOLLECTIVE_REPLICA_RANK``, ``ZCOLLECTIVE_NUM_REPLICAS`` and
``ZCOLLECTIVE_LOCAL_RANK``; on a single host, also a fresh random
``ZCOLLECTIVE_SECRET`` and ``ZCOLLECTIVE_JOB`` (unless set). Its output is prefixed with ``[rank]``. The
launcher exits with the first non-zero exit code; when a replica fails, the
others are stopped after a grace period; with ``--replace-lost K``, up to K
replicas that die are started again instead, as newcomers the group admits at
its next ``grow()`` (the others keep running). Ctrl-C stops every replica. When
the job ends, it names the slowest rank (how late its contributions reached
rank 0), unless ``--no-straggler-summary``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Optional

from . import __version__
from ._protocol._stats import COORDINATOR_FILE_ENV, STATS_FILE_ENV, slowest
from .config import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, SECRET_ENV, SECRET_FILE_ENV

DEFAULT_GRACE_S = 5.0  # time a replica gets to notice a failure and exit by itself
KILL_AFTER_S = 5.0  # after SIGTERM/SIGINT, the time before SIGKILL
COORDINATOR_MOVE_S = 10.0  # --replace-lost: rank 0 died; the survivors' new one says where it is


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="zcollective-run",
        description="Start the replicas of a zcollective job on this host.",
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
                        help=f"seconds the others get after a replica fails (default {DEFAULT_GRACE_S:g})")
    parser.add_argument("--replace-lost", type=int, default=0, metavar="K",
                        help="start a replica that dies (up to K times in all) again, as a "
                             "newcomer (ZCOLLECTIVE_JOIN=1) at the group's coordinator, while the "
                             "others keep running; the program admits it with zcollective.grow() "
                             "(default 0: a replica that fails stops the job)")
    parser.add_argument("--no-straggler-summary", dest="straggler_summary", action="store_false",
                        help="do not print which rank was slowest when the job ends (rank 0 "
                             "runs on this host)")
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


def _pump(rank: int, stream: IO[bytes], out: IO[bytes], lock: threading.Lock,
          last: dict[int, bytes]) -> None:
    """Copy a rank's output, prefixed; remember what explains its failure:
    the exception of its last traceback (what a library or atexit handler
    printed after it does not), else its last line."""
    prefix = f"[{rank}] ".encode()
    in_traceback, raised = False, b""
    for line in iter(stream.readline, b""):
        if line.startswith(b"Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line.strip() and not line[:1].isspace():
            in_traceback, raised = False, line.strip()
        if line.strip():
            last[rank] = raised or line.strip()
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Launcher:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.threads: dict[int, threading.Thread] = {}  # each rank's output pump (its latest process)
        self.replaced = 0  # replicas started again as newcomers (--replace-lost)
        self.coordinator_file: Optional[str] = None  # where each group's rank 0 says where it is
        if ns.replace_lost:
            fd, self.coordinator_file = tempfile.mkstemp(prefix="zcollective-coordinator-")
            os.close(fd)
        self.last_lines: dict[int, bytes] = {}
        self.interrupted = False
        self.secret: Optional[str] = None
        self.stats_file: Optional[str] = None  # where rank 0 leaves its stats (see _stats)
        if ns.straggler_summary and ns.node_rank == 0:
            fd, self.stats_file = tempfile.mkstemp(prefix="zcollective-stats-", suffix=".json")
            os.close(fd)
        if ns.nnodes == 1 and not os.environ.get(SECRET_ENV) and not os.environ.get(SECRET_FILE_ENV):
            # one host: a fresh secret per job, so nobody else on the machine can join or inject
            self.secret = secrets.token_hex(32)

    def env_for(self, rank: int, local_rank: int, port: int, size: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.secret is not None:
            env[SECRET_ENV] = self.secret
        if self.ns.nnodes == 1:  # one host: this launch names its job, unless the user did
            env.setdefault("ZCOLLECTIVE_JOB", f"zcollective-run {os.getpid()}")
        env.update({
            "ZCOLLECTIVE_MASTER_ADDR": self.ns.master_addr or DEFAULT_MASTER_ADDR,
            "ZCOLLECTIVE_MASTER_PORT": str(port),
            "ZCOLLECTIVE_REPLICA_RANK": str(rank),
            "ZCOLLECTIVE_NUM_REPLICAS": str(size),
            "ZCOLLECTIVE_LOCAL_RANK": str(local_rank),
            "PYTHONUNBUFFERED": "1",
        })
        if self.stats_file is not None and rank == 0:
            env[STATS_FILE_ENV] = self.stats_file
        if self.coordinator_file is not None:
            env[COORDINATOR_FILE_ENV] = self.coordinator_file
        return env

    def straggler_summary(self) -> None:
        """Say which rank was slowest, from what rank 0 left (if it did)."""
        path, self.stats_file = self.stats_file, None
        if path is None:
            return
        try:
            with open(path) as f:
                ranks = json.load(f).get("ranks") or {}
        except (OSError, ValueError):
            ranks = {}  # rank 0 never closed a group of two or more: nothing to say
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        line = slowest(ranks)
        if line is not None:
            self.message(line)

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
        for local in range(ns.nproc_per_node):
            rank = ns.node_rank * ns.nproc_per_node + local
            self.spawn(rank, self.env_for(rank, local, port, size))

    def spawn(self, rank: int, env: dict[str, str]) -> None:
        """Start the process of ``rank``'s slot, its output pumped."""
        try:
            proc = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            self.message(f"cannot start {self.command[0]!r}: {exc.strerror}")
            self.stop(signal.SIGTERM)
            raise SystemExit(127) from None
        self.procs[rank] = proc
        thread = threading.Thread(target=_pump, args=(rank, proc.stdout, sys.stdout.buffer, self.lock,
                                                      self.last_lines), daemon=True)
        thread.start()
        self.threads[rank] = thread

    def coordinator(self, dead: int) -> str:
        """Where the group's coordinator is (``host:port``, from what its rank 0
        wrote): if the process ``dead`` was that rank 0, once the survivors' new
        one said so (within :data:`COORDINATOR_MOVE_S`)."""
        assert self.coordinator_file is not None
        deadline = time.monotonic() + COORDINATOR_MOVE_S
        while True:
            try:
                with open(self.coordinator_file) as f:
                    where, _, pid = f.read().strip().partition(" ")
            except OSError:
                where, pid = "", ""
            if pid != str(dead) or time.monotonic() > deadline:
                return where
            time.sleep(0.05)

    def replace(self, rank: int, code: int) -> bool:
        """``--replace-lost``: start ``rank``'s slot again, as a newcomer at the
        group's coordinator (it moves when rank 0 is lost), while others run."""
        if self.replaced >= self.ns.replace_lost or self.coordinator_file is None or not any(
                p.poll() is None for p in self.procs.values()):
            return False
        where = self.coordinator(self.procs[rank].pid)
        host, _, port = where.rpartition(":")
        env = self.env_for(rank, rank % self.ns.nproc_per_node, self.port, self.size)
        if host and port.isdigit():
            env.update(ZCOLLECTIVE_MASTER_ADDR=host.strip("[]"), ZCOLLECTIVE_MASTER_PORT=port)
        env["ZCOLLECTIVE_JOIN"] = "1"
        self.replaced += 1
        self.threads[rank].join(timeout=1)  # its last output
        self.message(f"rank {rank} {_describe(code)}; starting a newcomer in its place at "
                     f"{where or 'the master address'} ({self.replaced} of {self.ns.replace_lost})")
        self.spawn(rank, env)
        return True

    def message(self, text: str) -> None:
        sys.stderr.write(f"zcollective-run: {text}\n")
        sys.stderr.flush()

    def signal_all(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, sig: int) -> None:
        """Send ``sig`` to every replica still running, SIGKILL after a bound."""
        self.signal_all(sig)
        deadline = time.monotonic() + KILL_AFTER_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()

    def wait(self) -> int:
        first_failure: Optional[tuple[int, int]] = None
        failed_at = 0.0
        while True:
            running = [r for r, p in self.procs.items() if p.poll() is None]
            if first_failure is None:
                for rank, proc in sorted(self.procs.items()):
                    if proc.returncode not in (None, 0):
                        if self.replace(rank, proc.returncode):
                            continue
                        first_failure = (rank, proc.returncode)
                        failed_at = time.monotonic()
                        self.threads[rank].join(timeout=1)  # its last output
                        said = self.last_lines.get(rank, b"").decode("utf-8", "replace")[:300]
                        self.message(f"rank {rank} {_describe(proc.returncode)}"
                                     f"{f' ({said})' if said else ''}; stopping the others in "
                                     f"{self.ns.grace:g} s")
                        break
            if not running:
                break
            if first_failure is not None and time.monotonic() - failed_at > self.ns.grace:
                self.message(f"stopping ranks {','.join(map(str, running))}")
                self.stop(signal.SIGTERM)
                break
            time.sleep(0.05)
        for thread in self.threads.values():
            thread.join(timeout=2)
        if first_failure is None:
            return 0
        rank, code = first_failure
        return code if code > 0 else 128 - code


def main(argv: Optional[list[str]] = None) -> int:
    ns = parse_args(argv)
    launcher = Launcher(ns)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        launcher.start()
        code = launcher.wait()
        launcher.straggler_summary()
        return code
    except KeyboardInterrupt:
        launcher.message("interrupted; stopping every replica")
        launcher.stop(signal.SIGINT)
        for thread in launcher.threads.values():
            thread.join(timeout=2)
        return 130
    finally:
        for path in (launcher.stats_file, launcher.coordinator_file):
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
