"""Attack (1): sub-groups across hosts. 8 ranks on 2 hosts, contiguous (0-3 host 0, 4-7
host 1). split by parity: each half has 2 ranks per host; a subgroup whose rank 0 is on
host 1 (ranks listed 5,4,1,0); dup(). Big allreduces on the parent and the sub-groups
interleaved and async. Expected: right sums, same bits, nothing left."""
import sys

from common import report, run, shm_segments

MIB = 1 << 20


def body():
    import numpy as np
    import zcollective as zc
    r = zc.get_rank()
    g = zc._current()
    half = g.split(r % 2)
    sub = g.subgroup([5, 4, 1, 0])
    dup = g.dup()
    out = {}
    for name, grp in (("half", half), ("sub", sub), ("dup", dup), ("world", g)):
        if grp is None:
            continue
        plane = grp._life.shared
        out[name + "_leaders"] = None if plane is None else plane.leaders
        n, rr = grp.size, grp.rank
        v = grp.allreduce(np.full(2 * MIB, rr + 1.0, dtype=np.float32))
        out[name] = (float(v[0]), float(v[-1]), n * (n + 1) / 2)
    futs = []
    for k in range(4):
        for name, grp in (("half", half), ("sub", sub), ("dup", dup), ("world", g)):
            if grp is not None:
                futs.append((name, k, grp.size, grp.allreduce_async(np.full(MIB, grp.rank + k + 1.0))))
    bad = []
    for name, k, n, f in futs:
        v = f.result(timeout=120)
        want = sum(q + k + 1.0 for q in range(n))
        if not (v == want).all():
            bad.append((name, k, float(v[0]), want))
    out["async_bad"] = bad
    for grp in (half, sub, dup):
        if grp is not None:
            grp.teardown()
    return out


if __name__ == "__main__":
    before = shm_segments()
    outs = run(body, [0, 0, 0, 0, 1, 1, 1, 1], timeout=240)
    for o in outs:
        print(f"rank {o.rank}: " + (repr(o.value) if o.ok else report([o], "FAILED")[-2500:]))
    print("left in /dev/shm:", set(shm_segments()) - set(before) or "nothing")
    sys.exit(0 if all(o.ok for o in outs) else 1)
