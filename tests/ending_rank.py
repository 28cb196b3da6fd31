"""One rank of tests/test_ending.py's exit races, run as a script.

The process is started once (imports paid once) and forks one child per
round. Each child joins that round's group, makes its calls, writes what it
got to ``OUT/rank-round.json`` and then *ends its program* the way the round
says, without teardown: by falling off the end of this module, by an uncaught
exception. Interpreter shutdown runs for real in every child.

argv: rank size out_dir rounds_json, where rounds_json is a list of
``[ending, size_name, port]``.
"""

import json
import os
import sys
import time

import numpy as np

import zcollective as zc

rank, size, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rounds = json.loads(sys.argv[4])
ARRAY = 1 << 20  # float32 elements: 4 MiB
LATE_S = 0.1  # how far the others lag behind when rank 0 ends first

this_round = None
for index, spec in enumerate(rounds):
    pid = os.fork()
    if pid == 0:
        this_round = (index, *spec)
        break
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(out_dir, f"{rank}-{index}.status"), "w") as f:
        f.write(str(status))
if this_round is None:
    sys.exit(0)  # the forking parent is done

index, ending, size_name, port = this_round
zc.initialize("127.0.0.1", port, rank, size, timeout=60, op_timeout=60)


def value(r):
    return np.full(ARRAY, r + 1, dtype=np.float32) if size_name == "4MiB" else r + 1


def total(v):
    return float(v[0]) if size_name == "4MiB" else v


expected = size * (size + 1) / 2
record = {"rank": rank, "round": index, "ending": ending}


def write(**got):
    record.update(got)
    with open(os.path.join(out_dir, f"{rank}-{index}.json"), "w") as f:
        json.dump(record, f)


if ending == "rank0-first" or ending == "rank0-raises":
    # rank 0 ends with its last call in flight, before the others have made it
    first = zc.allreduce(value(rank))
    if rank == 0:
        zc.broadcast_async("config")  # never collected
        write(allreduce=total(first))
        if ending == "rank0-raises":
            raise RuntimeError("rank 0's program fails here, on purpose")
    else:
        time.sleep(LATE_S)
        write(allreduce=total(first), broadcast=zc.broadcast(None))
elif ending == "rank0-last":
    # adaptdl's ending: the others exit with an async call never collected; rank 0 needs it
    last = zc.allreduce(value(rank))
    pending = zc.allreduce_async(value(rank))
    if rank == 0:
        time.sleep(LATE_S)
        write(allreduce=total(last), pending=total(pending.result()))
    else:
        write(allreduce=total(last))
# the program ends here: no teardown
