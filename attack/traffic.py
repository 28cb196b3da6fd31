"""Attack (4), docs: docs/data-plane.md says of shared memory across hosts "with 2 replicas
on each of 2 hosts, half what the ring of all replicas sends". Measured here: what host 1's
link takes in and sends out for one 16 MiB allreduce, 2 hosts x 2 ranks, contiguous and
interleaved placement, with shared memory on (the leaders' ring) and off (the ring of all
ranks)."""
from common import run

MIB = 1 << 20


def body():
    import numpy as np
    import zcollective as zc

    def link():
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "eth0":
                    fields = rest.split()
                    return int(fields[0]), int(fields[8])
    a = np.ones(4 * MIB, dtype=np.float32)
    zc.allreduce(a)
    zc.barrier()
    before = link()
    zc.allreduce(a)
    zc.barrier()
    after = link()
    return after[0] - before[0], after[1] - before[1]


if __name__ == "__main__":
    nbytes = 16 * MIB
    for layout in ([0, 0, 1, 1], [0, 1, 0, 1]):
        got = {}
        for name, env in (("shared", {}), ("ring of all", {"ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": "off"})):
            outs = run(body, layout, env=env)
            assert all(o.ok for o in outs), [o.error for o in outs]
            got[name] = outs[-1].value  # the last rank is on host 1
            rx, tx = got[name]
            print(f"layout {layout} {name:12s}: host 1 took in {rx / nbytes:.2f}x, sent {tx / nbytes:.2f}x "
                  f"the array")
        print(f"  shared / ring of all (taken in): {got['shared'][0] / got['ring of all'][0]:.2f}")
