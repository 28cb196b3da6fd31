"""Attack (1): results across hosts for uneven and non-contiguous layouts, NaN, torch,
thresholds, many calls in flight, big allreduce mixed with big broadcast/allgather (async).
Every rank must get the right value and the same bits. Usage: python layouts_results.py [layout...]
where a layout is e.g. 0,0,0,1,1 (rank r on host layout[r])."""
import hashlib
import sys

from common import report, run, shm_segments

MIB = 1 << 20


def body():
    import numpy as np
    import torch
    import zcollective as zc
    r, n = zc.get_rank(), zc.get_world_size()
    plane = zc._current()._life.shared
    out = {"leaders": None if plane is None else plane.leaders}
    digest = lambda a: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()  # noqa: E731
    problems = []

    # random floats: the order of the sum matters; all ranks must agree bit for bit
    rng = np.random.default_rng(r)
    a = rng.standard_normal(MIB).astype(np.float32)  # 4 MiB
    res = zc.allreduce(a)
    out["rand"] = digest(res)
    allin = [np.random.default_rng(k).standard_normal(MIB).astype(np.float32) for k in range(n)]
    exact = np.sum(np.stack(allin).astype(np.float64), axis=0)
    out["rand_err"] = float(np.max(np.abs(res - exact)))

    # NaN and inf on one rank
    b = np.ones(MIB, dtype=np.float32)
    if r == n - 1:
        b[5] = np.nan
        b[-1] = np.inf
    res = zc.allreduce(b)
    out["nan"] = (bool(np.isnan(res[5])), bool(np.isinf(res[-1])), float(res[6]))

    # torch tensor
    t = torch.full((MIB,), float(r), dtype=torch.float32)
    res = zc.allreduce(t)
    out["torch"] = (type(res).__name__, float(res[0]), float(res[-1]))

    # around the thresholds (data_plane_min 1 MiB): exact, one element less, one more
    for nbytes in (MIB - 8, MIB, MIB + 8):
        res = zc.allreduce(np.full(nbytes // 8, r + 1, dtype=np.int64))
        if not (res == n * (n + 1) // 2).all():
            problems.append(f"threshold {nbytes}: {res[:3]}")
        out[f"thr{nbytes}"] = digest(res)

    # many in flight: allreduce_async alternating with broadcast/allgather async
    futs = []
    for k in range(8):
        futs.append(("ar", k, zc.allreduce_async(np.full(MIB // 2, float(r * 10 + k), dtype=np.float64))))
        if k % 3 == 1:
            futs.append(("bc", k, zc.broadcast_async(np.full(MIB // 4, float(k), dtype=np.float32)
                                                     if r == 0 else None)))
        if k % 3 == 2:
            futs.append(("ag", k, zc.allgather_async(np.full(MIB // 4, float(r + k), dtype=np.float32))))
    for kind, k, f in futs:
        v = f.result(timeout=120)
        if kind == "ar":
            want = sum(q * 10 + k for q in range(n))
            if not (v == want).all():
                problems.append(f"async ar {k}: got {np.unique(v)[:5]} want {want}")
        elif kind == "bc":
            if not (v == k).all():
                problems.append(f"async bc {k}: {np.unique(v)[:5]}")
        else:
            if [float(x[0]) for x in v] != [float(q + k) for q in range(n)]:
                problems.append(f"async ag {k}")
    # growing sizes in flight (a new segment each time) with reads in between
    futs = [zc.allreduce_async(np.full(MIB // 4 * (k + 1), r + 1.0)) for k in range(5)]
    for k, f in enumerate(futs):
        v = f.result(timeout=120)
        if v.size != MIB // 4 * (k + 1) or not (v == n * (n + 1) / 2).all():
            problems.append(f"growing {k}: {np.unique(v)[:5]}")
    # non-contiguous and 2-D
    m = np.arange(2 * MIB, dtype=np.float32).reshape(1024, -1)[:, ::2] + r
    res = zc.allreduce(m)
    want = np.arange(2 * MIB, dtype=np.float32).reshape(1024, -1)[:, ::2] * n + n * (n - 1) / 2
    if not np.array_equal(res, want):
        problems.append("non-contiguous")
    out["problems"] = problems
    return out


def main(layouts):
    before = shm_segments()
    bad = False
    for layout in layouts:
        outs = run(body, layout, timeout=300)
        print(f"layout {layout}")
        if not all(o.ok for o in outs):
            print(report(outs, "a rank failed"))
            bad = True
            continue
        vals = [o.value for o in outs]
        print("  leaders", [v["leaders"] for v in vals][:1], "rand_err", max(v["rand_err"] for v in vals))
        for key in vals[0]:
            if key in ("rand_err",):
                continue
            seen = {repr(v[key]) for v in vals}
            if len(seen) > 1:
                bad = True
                print(f"  NON-UNIFORM {key}: " + "; ".join(f"r{i}={v[key]!r:.80}" for i, v in enumerate(vals)))
        for i, v in enumerate(vals):
            if v["problems"]:
                bad = True
                print(f"  rank {i} problems: {v['problems']}")
        print("  nan/inf", vals[0]["nan"], "torch", vals[0]["torch"])
    after = shm_segments()
    if set(after) - set(before):
        print("LEFT IN /dev/shm:", set(after) - set(before))
        bad = True
    print("BAD" if bad else "all held")
    return 1 if bad else 0


if __name__ == "__main__":
    layouts = [[int(x) for x in a.split(",")] for a in sys.argv[1:]] or [
        [0, 0, 0, 1, 1], [0, 1, 2, 0, 1, 2, 2], [0, 1, 1, 0], [0, 1, 0, 1, 2, 2]]
    sys.exit(main(layouts))
