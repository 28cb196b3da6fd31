"""Wait until every replica has finished a phase.

    zcollective-run -n 3 examples/barrier.py
"""

import time

import zcollective

zcollective.initialize()
rank = zcollective.get_rank()

time.sleep(0.2 * rank)  # replicas finish at different times
start = time.monotonic()
zcollective.barrier()
print(f"rank {rank}: passed the barrier after waiting {time.monotonic() - start:.2f} s")

zcollective.teardown()
