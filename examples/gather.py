"""Collect per-replica evaluation metrics on rank 0 only.

    zcollective-run -n 3 examples/gather.py
"""

import random

import zcollective

zcollective.initialize()
rank = zcollective.get_rank()

metrics = {"rank": rank, "accuracy": round(random.Random(rank).uniform(0.8, 0.9), 3)}
collected = zcollective.gather(metrics, root=0)  # None on every rank but the root
if rank == 0:
    mean = sum(m["accuracy"] for m in collected) / len(collected)
    print(f"rank 0: metrics of all ranks {collected}; mean accuracy {mean:.3f}")

zcollective.teardown()
