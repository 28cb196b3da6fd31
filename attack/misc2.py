"""Attack (1)-(3), 2 hosts x 2 ranks (leaders 0, 2):
timeouts - only leader 2 passes a timeout (0.5 s) while leader 0 is slow in the ring (2 s);
           then the same with a non-leader (3) alone timing out; then calls that must be right;
torch    - tensors: float16, bfloat16, float64, non-contiguous, requires_grad, int32;
stranger - a process with no token connects a PUSH to leader 2's data port (and one to
           rank 3's) and sends a chunk-shaped message, during big allreduces.
Expected: every call that completes is right everywhere; a timed-out call fails alike."""
import inspect
import os
import sys
import time

from common import report, run, shm_segments

MIB = 1 << 20


def timeouts_body():
    import numpy as np
    import zcollective as zc
    r, n = zc.get_rank(), zc.get_world_size()
    pending = []

    @zc.elementwise
    def slow_in_ring(a, b):  # 2 s once per call, at rank 0's first chunk in the ring
        if r == 0 and pending and any(f.function == "receive" for f in inspect.stack()[1:6]):
            pending.clear()
            time.sleep(2.0)
        a += b
        return a
    said = []
    for who in (2, 3):
        pending.append(1)
        try:
            zc.allreduce(np.full(2 * MIB, r + 1.0, dtype=np.float32), slow_in_ring,
                         timeout=0.5 if r == who else None)
            said.append("ok")
        except zc.CollectiveError as exc:
            said.append(f"{type(exc).__name__}: {str(exc)[:300]}")
        for k in range(3):
            v = zc.allreduce(np.full(2 * MIB, r + k + 1.0, dtype=np.float32), timeout=30)
            want = sum(q + k + 1.0 for q in range(n))
            said.append(bool((v == want).all()))
        fs = [zc.allreduce_async(np.full(MIB, r + k + 1.0)) for k in range(4)]
        said.append([bool((f.result(timeout=30) == sum(q + k + 1.0 for q in range(n))).all())
                     for k, f in enumerate(fs)])
    return said


def torch_body():
    import torch
    import zcollective as zc
    r, n = zc.get_rank(), zc.get_world_size()
    out = {}
    for name, t in (("f16", torch.full((MIB,), r + 1.0, dtype=torch.float16)),
                    ("bf16", torch.full((MIB,), r + 1.0, dtype=torch.bfloat16)),
                    ("f64", torch.full((MIB,), r + 1.0, dtype=torch.float64)),
                    ("i32", torch.full((MIB,), r + 1, dtype=torch.int32)),
                    ("strided", torch.full((2048, 1024), r + 1.0).t()),
                    ("grad", torch.full((MIB,), r + 1.0, requires_grad=True))):
        try:
            v = zc.allreduce(t.detach() if name == "grad" and False else t)
            out[name] = (type(v).__name__, str(getattr(v, "dtype", "")), tuple(v.shape),
                         float(v.float().min()), float(v.float().max()), float(n * (n + 1) / 2))
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def stranger_body():
    import numpy as np
    import zmq
    import zcollective as zc
    from zcollective._protocol import _chunks
    r, n = zc.get_rank(), zc.get_world_size()
    member = zc._current()._life.member
    if r == 1:  # the stranger lives in rank 1's process but uses none of its keys
        ctx = zmq.Context()
        socks = []
        for target in (2, 3):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, 100)
            s.connect(member.data_endpoints[target])
            socks.append(s)
        header = _chunks.HEADER.pack(_chunks.MAGIC, _chunks.VERSION, 1, member.session, 1, 0, 0, 0)
        for s in socks:
            try:
                s.send_multipart([header, b"\0" * 16, b"\0" * (MIB // 2)], zmq.NOBLOCK)
            except zmq.Again:
                pass
    got = []
    for k in range(4):
        v = zc.allreduce(np.full(2 * MIB, r + 1.0, dtype=np.float32), timeout=30)
        got.append(bool((v == n * (n + 1) / 2).all()))
    return got


if __name__ == "__main__":
    names = sys.argv[1:] or ["timeouts", "torch", "stranger"]
    for name in names:
        before = shm_segments()
        fn = {"timeouts": timeouts_body, "torch": torch_body, "stranger": stranger_body}[name]
        outs = run(fn, [0, 0, 1, 1], timeout=180)
        print(f"== {name}")
        for o in outs:
            print(f"  rank {o.rank}: " + (repr(o.value)[:900] if o.ok else report([o], "FAILED")[-2000:]))
        print("  left in /dev/shm:", set(shm_segments()) - set(before) or "nothing")
