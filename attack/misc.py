"""Attack (2): an untidy program across hosts (2 hosts x 2 ranks unless said):
busy   - a non-leader busy in its own code for 5 s (> liveness 2 s) before calling;
fork   - a leader forks a worker that calls nothing and exits normally (atexit runs);
grow1  - grow() admits a newcomer alone on a new host (the group must leave the path);
grow2  - grow() admits a newcomer on host 1 (3 + 2 afterwards: still the path).
Expected: right sums everywhere, no error, nothing left in /dev/shm."""
import os
import sys
import time

from common import ROOT, SECRET, Hosts, Replicas, report, run, shm_segments

MIB = 1 << 20


def busy_body():
    import numpy as np
    import zcollective as zc
    r, n = zc.get_rank(), zc.get_world_size()
    zc.allreduce(np.ones(MIB, dtype=np.float32))
    if r == 3:
        t = time.monotonic()
        while time.monotonic() - t < 5:  # spinning in its own code, holding the GIL
            sum(range(1000))
    got = zc.allreduce(np.full(2 * MIB, r + 1.0, dtype=np.float32), timeout=60)
    return float(got[0]), float(got[-1]), n * (n + 1) / 2


def fork_body():
    import numpy as np
    import zcollective as zc
    r, n = zc.get_rank(), zc.get_world_size()
    got = [float(zc.allreduce(np.full(MIB, r + 1.0, dtype=np.float32))[0])]
    if r == 2:
        pid = os.fork()
        if pid == 0:  # the worker: calls nothing, ends as a Python program does
            time.sleep(1.0)
            sys.exit(0)
    for k in range(6):
        got.append(float(zc.allreduce(np.full(MIB * (k + 1), r + 1.0, dtype=np.float32))[-1]))
        time.sleep(0.3)
    if r == 2:
        _, status = os.waitpid(pid, 0)
        got.append(("worker", status))
    return got, n * (n + 1) / 2


def growing(target):
    import numpy as np
    import zcollective as zc
    seen = []
    deadline = time.monotonic() + 60
    while True:
        n, r = zc.get_world_size(), zc.get_rank()
        plane = zc._current()._life.shared
        got = zc.allreduce(np.full(2 * MIB, r + 1.0, dtype=np.float32))
        seen.append((n, None if plane is None else plane.leaders, float(got[0]), float(got[-1]),
                     n * (n + 1) / 2))
        if n >= target:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError("the newcomer never came")
        time.sleep(0.05)
        zc.grow()


def newcomer(target):
    import zcollective as zc
    zc.initialize(join=True)
    return growing(target)


def grow(host_of_newcomer):
    layout = [0, 0, 1, 1]
    with Hosts(3) as hosts:
        env = {"ZCOLLECTIVE_MASTER_ADDR": hosts.addresses[0], "ZCOLLECTIVE_SECRET": SECRET,
               "PYTHONPATH": ROOT}
        with Replicas(growing, 4, 5, env=env, port=29463,
                      rank_prefix={r: hosts.prefix(h) for r, h in enumerate(layout)}) as members, \
                Replicas(newcomer, 1, 5, initialize=False, port=29463,
                         env={**env, "ZCOLLECTIVE_NUM_REPLICAS": ""},
                         rank_prefix={0: hosts.prefix(host_of_newcomer)}) as newcomers:
            return newcomers.wait(90) + members.wait(90)


def main(names):
    for name in names:
        before = shm_segments()
        if name == "busy":
            outs = run(busy_body, [0, 0, 1, 1], env={"ZCOLLECTIVE_LIVENESS_TIMEOUT": "2"})
        elif name == "fork":
            outs = run(fork_body, [0, 0, 1, 1])
        elif name == "grow1":
            outs = grow(2)
        elif name == "grow2":
            outs = grow(1)
        print(f"== {name}")
        for o in outs:
            print(f"  rank {o.rank}: " + (repr(o.value)[:600] if o.ok else report([o], "FAILED")[-2000:]))
        print("  left in /dev/shm:", set(shm_segments()) - set(before) or "nothing")


if __name__ == "__main__":
    main(sys.argv[1:] or ["busy", "fork", "grow1", "grow2"])
