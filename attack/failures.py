"""Attack (2): a host's leader stopped (SIGSTOP) mid-ring then continued, interrupted
(SIGINT), or its host's link cut mid-ring, with ranks on 2 hosts x 2 (leaders 0 and 2).
Expected: survivors get an error naming the rank/host within the liveness bound (or the
call completes, for a short stop), never a hang or a wrong result; no segment of the
group is left in /dev/shm. Usage: python failures.py [scenario ...]"""
import os
import signal
import sys
import tempfile
import time

from common import run, shm_segments

MIB = 1 << 20
LIVENESS = 2.0
ENV = {"ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": "off"} if os.environ.get("NO_SHM") else {}
ELEMENTS = 8 * MIB  # 32 MiB of float32: the ring takes a while on a 400 Mbit/s link


def body(markers, victim):
    import inspect
    import numpy as np
    import zcollective as zc
    r = zc.get_rank()
    zc.allreduce(np.ones(MIB, dtype=np.float32))  # segments made
    session = zc._current()._life.member.session

    @zc.elementwise
    def add(a, b):
        if r == victim and any(f.function == "receive" for f in inspect.stack()[1:6]):
            p = os.path.join(markers, "in-ring")
            if not os.path.exists(p):
                open(p, "w").close()
                time.sleep(0.3)  # (the signal comes while this rank is inside the ring)
        a += b
        return a

    start = time.monotonic()
    try:
        out = zc.allreduce(np.full(ELEMENTS, r + 1.0, dtype=np.float32), add, timeout=60)
        said = f"ok {float(out[0])} {float(out[-1])}"
    except KeyboardInterrupt as exc:
        said = f"KeyboardInterrupt {exc}"
    except zc.CollectiveError as exc:
        said = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - start
    with open(os.path.join(markers, f"said{r}"), "w") as f:
        f.write(f"{took:.1f}s: {said}")
    after = None
    try:
        if not said.startswith("ok"):
            zc.shrink(timeout=20)
        after = float(zc.allreduce(np.full(MIB, 1.0, dtype=np.float32), timeout=20)[0])
    except BaseException as exc:  # noqa: BLE001
        after = f"{type(exc).__name__}: {str(exc)[:200]}"
    zc.teardown = lambda: None  # (the harness must not hang in a teardown after a loss)
    return said, round(took, 1), session, after, os.getpid()


def wait_marker(markers, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(markers, "in-ring")):
        if time.monotonic() > deadline:
            raise AssertionError("the victim never reached the ring")
        time.sleep(0.005)


def scenario(name):
    victim = int(os.environ.get("VICTIM", "2"))
    layout = [int(x) for x in os.environ.get("LAYOUT", "0,0,1,1").split(",")]
    markers = tempfile.mkdtemp(prefix="attack8-")

    def hook(hosts, reps):
        wait_marker(markers)
        if name == "stop-short":
            reps.kill(victim, signal.SIGSTOP)
            time.sleep(1.0)
            reps.kill(victim, signal.SIGCONT)
        elif name == "stop-long":
            reps.kill(victim, signal.SIGSTOP)
            time.sleep(4 * LIVENESS)
            reps.kill(victim, signal.SIGCONT)
        elif name == "sigint":
            reps.kill(victim, signal.SIGINT)
        elif name == "cut":
            hosts.cut(int(os.environ.get("CUT", "1")))
            time.sleep(3 * LIVENESS + 6)
            hosts.restore(int(os.environ.get("CUT", "1")))
        elif name == "sigint-nonleader":
            reps.kill(3, signal.SIGINT)
        elif name == "kill":
            reps.kill(victim, signal.SIGKILL)
        elif name == "stop-nonleader-long":
            reps.kill(3, signal.SIGSTOP)
            time.sleep(4 * LIVENESS)
            reps.kill(3, signal.SIGCONT)

    before = shm_segments()
    outs = run(body, layout, markers, victim, timeout=120, rate_mbit=400,
               env={"ZCOLLECTIVE_LIVENESS_TIMEOUT": str(LIVENESS), **ENV}, hosts_hook=hook)
    print(f"== {name}")
    for o in outs:
        if o.ok:
            said, took, session, after, pid = o.value
            print(f"  rank {o.rank}: took {took}s: {said[:600]}\n     then: {after}")
        else:
            print(f"  rank {o.rank}: rc={o.returncode} timed_out={o.timed_out} err={o.error!r}")
            print("     " + o.output[-1200:].replace("\n", "\n     "))
    for r in range(len(layout)):
        p = os.path.join(markers, f"said{r}")
        if os.path.exists(p):
            print(f"  rank {r}'s call said: {open(p).read()[:500]}")
    left = set(shm_segments()) - set(before)
    print("  left in /dev/shm:", left or "nothing")
    return outs


if __name__ == "__main__":
    for name in sys.argv[1:] or ["stop-short", "stop-long", "sigint", "cut"]:
        scenario(name)
