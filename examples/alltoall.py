"""Shuffle keyed records so that each replica ends up owning one key range.

    zcollective-run -n 3 examples/alltoall.py
"""

import zcollective

zcollective.initialize()
rank, size = zcollective.get_rank(), zcollective.get_world_size()

records = [(key, f"from rank {rank}") for key in range(rank, rank + 6)]
outgoing = [[r for r in records if r[0] % size == dest] for dest in range(size)]
incoming = zcollective.alltoall(outgoing)  # incoming[j] came from rank j
mine = sorted(r for part in incoming for r in part)
print(f"rank {rank}: I own keys {sorted({k for k, _ in mine})}")

zcollective.teardown()
