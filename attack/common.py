"""Shared helpers for the attack8 reproducers: namespaced hosts (tests/netns.py) and
zcollective.testing.Replicas, each rank put on a host by a layout list."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("ATTACK_ROOT") or os.path.dirname(HERE)  # the zcollective tree the children run
sys.path[:0] = [ROOT, os.path.join(os.path.dirname(HERE), "tests")]

from netns import Hosts  # noqa: E402
from zcollective.testing import Replicas, report  # noqa: E402

SECRET = "a-secret-of-attack8-only-" + "y" * 10


def run(fn, layout, *args, env=None, timeout=120, port=29461, secret=True, rank_env=None,
        hosts_hook=None, initialize=True, rate_mbit=None):
    """Run ``fn`` on len(layout) ranks, rank r on host layout[r]; returns outcomes.
    ``hosts_hook(hosts, reps)`` runs while they run (for cutting links, signals)."""
    nhosts = max(layout) + 1
    with Hosts(nhosts, rate_mbit=rate_mbit) as hosts:
        e = {"ZCOLLECTIVE_MASTER_ADDR": hosts.addresses[layout[0]]}
        if secret:
            e["ZCOLLECTIVE_SECRET"] = SECRET
        e["PYTHONPATH"] = ROOT  # the children import this worktree's zcollective
        e.update(env or {})
        prefix = {r: hosts.prefix(h) for r, h in enumerate(layout)}
        with Replicas(fn, len(layout), *args, env=e, rank_prefix=prefix, port=port, rank_env=rank_env,
                      initialize=initialize) as reps:
            if hosts_hook is not None:
                hosts_hook(hosts, reps)
            return reps.wait(timeout)


def shm_segments():
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("zcollective-"))
