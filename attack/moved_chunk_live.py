"""Attack (3), live: the moved reduce-scatter chunk of test_moved_chunk.py in a real group,
2 hosts x 2 ranks (leaders 0 and 2), with a secret. A path attacker is simulated inside rank 0:
every reduce-scatter chunk rank 0 makes for rank 1 in a call of the ring of ALL ranks is also
written, MAC and all, into rank 0's other authenticated connection, the one to rank 2's data
port (the leaders' link), as an attacker on that TCP stream could. Rank 0's threshold for
shared memory is 1 GiB, so the 4 MiB allreduces go the ring of all ranks while the leaders'
links exist. Expected: every rank gets the right sum (or an error), never a wrong one.
Usage: python moved_chunk_live.py [ROOT]  (ROOT: a zcollective tree to run, default this one)."""
import sys

import common
from common import run

MIB = 1 << 20


def body():
    import numpy as np
    import zcollective as zc
    from zcollective._io import _dataplane
    r, n = zc.get_rank(), zc.get_world_size()
    if r == 0:
        orig = _dataplane.DataPlane._send

        def copying(self, seq, job, push):
            copies = []
            hosts, ring = self._via.get("hosts"), self._via.get("ring")
            if getattr(job, "via", "ring") == "ring" and hosts is not None and hosts is not ring:
                for out in job.outbox:
                    if out.frames is None and out.kind == 1:  # a reduce-scatter chunk made here
                        header = self._rules.header(out.kind, seq, out.step, out.index)
                        payload = np.ascontiguousarray(out.payload).tobytes()
                        tag = self._rules.mac.tag(header, payload) if self._rules.mac is not None else b""
                        copies.append([header, tag, payload])
            ok = orig(self, seq, job, push)
            for frames in copies:
                hosts.push.send_multipart(frames)
            return ok
        _dataplane.DataPlane._send = copying
    plane = zc._current()._life.shared
    results = []
    for k in range(5):
        v = zc.allreduce(np.full(MIB, 10.0 ** r + k, dtype=np.float32), timeout=30)
        want = sum(10.0 ** q + k for q in range(n))
        results.append(sorted(set(np.unique(v).tolist()))[:4] if not (v == want).all() else "ok")
    return None if plane is None else plane.leaders, results


if __name__ == "__main__":
    if len(sys.argv) > 1:
        common.ROOT = sys.argv[1]
    outs = run(body, [0, 0, 1, 1], env={"ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": str(1 << 30),
                                        "PYTHONPATH": common.ROOT}, timeout=120)
    bad = False
    for o in outs:
        print(f"rank {o.rank}: " + (repr(o.value) if o.ok else f"{o.error!r}"))
        bad |= not o.ok or any(x != "ok" for x in o.value[1])
    print("WRONG RESULTS" if bad else "all right")
    sys.exit(1 if bad else 0)
