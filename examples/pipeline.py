"""A pipeline: each rank is a stage that receives work from the stage before it, transforms it
and sends it on; the last stage collects the results. Point-to-point messages, with tags.

    python examples/pipeline.py                 # one stage does everything
    zcollective-run -n 3 examples/pipeline.py   # three stages
"""

import zcollective

WORK, DONE = 0, 1  # tags: an item, and the end of the stream

zcollective.initialize()
rank, size = zcollective.get_rank(), zcollective.get_world_size()
last = rank == size - 1


def stage(item):
    """This stage's part of the work: here, each stage adds its rank and doubles the result."""
    return (item + rank) * 2


results = []
status = zcollective.Status()
if rank == 0:
    items = iter(range(5))
while True:
    if rank == 0:  # the source: reads its input
        item = next(items, None)
        tag = WORK if item is not None else DONE
    else:  # the others: whatever the stage before sends
        item = zcollective.recv(rank - 1, status=status)
        tag = status.tag
    if tag == DONE:
        if not last:
            zcollective.send(None, rank + 1, tag=DONE)
        break
    item = stage(item)
    if last:
        results.append(item)
    else:
        zcollective.send(item, rank + 1, tag=WORK)

if last:
    print(f"rank {rank}: the pipeline of {size} stages made {results}")
# The group lives as long as rank 0's program (it hosts the coordinator): the source, done first,
# waits here for the stages after it, which still send, before its program ends.
zcollective.barrier()
