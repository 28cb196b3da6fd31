"""Attack (1)/(4): whether an array "fits" a host's segment is decided per host (its room
and its number of ranks: SharedPlane.fits), but with ranks on several hosts the call is
one ring between the hosts' leaders: a host where the array fits goes the shared-memory
way (HostsAllreduce), a host where it does not goes the ring of all ranks. Here every
rank reports the same room (40 MiB in /dev/shm) and the layout is 3+2 ranks: a 4 MiB
array fits the 2-rank host (2*2*4 MiB <= 20 MiB) but not the 3-rank host (2*3*4 > 20).
Real hosts also differ in /dev/shm size; the second case gives host 1 a small room.
Expected: the call completes on every rank with the right sum (or, at worst, the same
error everywhere), quickly."""
import sys
import time

from common import report, run

MIB = 1 << 20


def body(room_by_host, host_of):
    import numpy as np
    import zcollective as zc
    from zcollective._io import _shared
    import os
    rank = int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
    _shared.room = lambda: room_by_host[host_of[rank]]  # what this host's /dev/shm has free
    zc.initialize(timeout=60)
    r, n = zc.get_rank(), zc.get_world_size()
    plane = zc._current()._life.shared
    fits = None if plane is None else plane.fits(4 * MIB)
    start = time.monotonic()
    try:
        res = zc.allreduce(np.full(MIB, r + 1.0, dtype=np.float32), timeout=40)
        said = f"ok {float(res[0])} (want {n * (n + 1) / 2})"
    except zc.CollectiveError as exc:
        said = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - start
    try:
        zc.teardown(timeout=10)
    except Exception as exc:  # noqa: BLE001
        said += f" | teardown: {type(exc).__name__}"
    return fits, round(took, 1), said


def main():
    bad = False
    cases = [("3+2 ranks, same room", [0, 0, 0, 1, 1], {0: 40 * MIB, 1: 40 * MIB}),
             ("2+2 ranks, host 1 small /dev/shm", [0, 0, 1, 1], {0: 400 * MIB, 1: 24 * MIB})]
    for name, layout, rooms in cases:
        outs = run(body, layout, rooms, layout, timeout=120, initialize=False)
        print(f"== {name}: layout {layout}")
        for o in outs:
            if not o.ok:
                bad = True
                print(f"  rank {o.rank} FAILED: {o.error!r}\n{o.output[-1500:]}")
            else:
                fits, took, said = o.value
                print(f"  rank {o.rank} (host {layout[o.rank]}) fits={fits} took {took}s: {said[:400]}")
                if not said.startswith("ok") or took > 10:
                    bad = True
    print("BAD" if bad else "all held")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
