"""Sum a number and merge a dict across every replica.

    python examples/allreduce.py                 # one replica
    zcollective-run -n 4 examples/allreduce.py   # four, on this host
"""

import zcollective

zcollective.initialize()
rank, size = zcollective.get_rank(), zcollective.get_world_size()

total = zcollective.allreduce(rank + 1)
print(f"rank {rank}: sum of 1..{size} = {total}")

# Any picklable value and any function, applied in rank order: fn(fn(v0, v1), v2) ...
words = zcollective.allreduce({f"rank{rank}": rank * 10}, lambda a, b: {**a, **b})
print(f"rank {rank}: merged dict = {words}")

# No teardown: like most programs (and every adaptdl program), this one just ends. Its last
# results still reach every replica; teardown() would add only the agreement that all are done.
