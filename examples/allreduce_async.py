"""Overlap communication with work: start several allreduces, collect later.

    zcollective-run -n 3 examples/allreduce_async.py
"""

import time

import zcollective

zcollective.initialize()
rank = zcollective.get_rank()

futures = [zcollective.allreduce_async(i * (rank + 1)) for i in range(4)]
time.sleep(0.1)  # stand-in for real work done while the results travel
# Futures may be collected in any order.
print(f"rank {rank}: results in reverse order {[f.result(timeout=60) for f in reversed(futures)]}")

# adaptdl's way to end: one more async call, never collected, then the program ends (no
# teardown). Rank 0 still completes it, for everyone, before its process goes.
zcollective.allreduce_async(rank)
