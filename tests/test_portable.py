"""Nothing Linux-only is needed to import zcollective and run a group on
loopback: a replica with fcntl and termios unimportable and /proc unreadable
(tests/portable_rank.py) computes as any other, its program ending without
teardown. (What Linux still gives more is listed in the README.)"""

import os
import subprocess
import sys

import pytest

from zcollective.testing import free_port

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("plane", ["off", "on"])
def test_a_group_runs_without_linux_only_modules(plane):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, ZCOLLECTIVE_MASTER_ADDR="127.0.0.1", ZCOLLECTIVE_MASTER_PORT=str(port),
                   ZCOLLECTIVE_REPLICA_RANK=str(rank), ZCOLLECTIVE_NUM_REPLICAS="2",
                   ZCOLLECTIVE_DATA_PLANE=plane, ZCOLLECTIVE_DATA_PLANE_MIN_BYTES="4096",
                   ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES="off")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "portable_rank.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=60)[0].decode())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    said = "".join(f"--- rank {r} (exit {p.returncode}):\n{o}"
                   for r, (p, o) in enumerate(zip(procs, outs, strict=False)))
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0 and f"rank {rank} ok True" in outs[rank], said
