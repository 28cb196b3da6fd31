"""Share rank 0's configuration with everyone.

    zcollective-run -n 3 examples/broadcast.py
"""

import zcollective

zcollective.initialize()
rank = zcollective.get_rank()

config = {"lr": 0.1, "seed": 1234} if rank == 0 else None
config = zcollective.broadcast(config)
print(f"rank {rank}: config from rank 0 = {config}")

# Any rank can be the root.
last = zcollective.get_world_size() - 1
print(f"rank {rank}: hello from rank {last}: {zcollective.broadcast(f'hi from {rank}', root=last)}")

zcollective.teardown()
