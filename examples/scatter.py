"""Rank 0 splits a work list into one shard per replica.

    zcollective-run -n 3 examples/scatter.py
"""

import zcollective

zcollective.initialize()
rank, size = zcollective.get_rank(), zcollective.get_world_size()

shards = None
if rank == 0:
    files = [f"part-{i:03d}.csv" for i in range(10)]
    shards = [files[i::size] for i in range(size)]
mine = zcollective.scatter(shards, root=0)
print(f"rank {rank}: my files {mine}")

zcollective.teardown()
