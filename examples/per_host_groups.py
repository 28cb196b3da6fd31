"""A reduction in two stages: first among the ranks of each host, then across hosts with one
rank per host, then back to every rank of the host. Sub-groups made by split().

    python examples/per_host_groups.py                          # one replica
    zcollective-run -n 4 examples/per_host_groups.py            # four, on this host
    zcollective-run -n 4 examples/per_host_groups.py --hosts 2  # as if on two hosts
"""

import argparse
import socket

import zcollective

parser = argparse.ArgumentParser()
parser.add_argument("--hosts", type=int, default=0, help="pretend there are this many hosts")
args = parser.parse_args()

zcollective.initialize()
rank, size = zcollective.get_rank(), zcollective.get_world_size()
where = f"host {rank % args.hosts}" if args.hosts else socket.gethostname()

host = zcollective.split(where)  # the ranks on this host, as one group (every rank calls split)
leaders = zcollective.split(0 if host.rank == 0 else None)  # one rank per host (None on the others)



def add(a, b):
    return [x + y for x, y in zip(a, b, strict=True)]


value = [rank + 1] * 3  # say, this rank's gradients
local = host.reduce(value, add)  # on the host's rank 0
total = None
if leaders is not None:  # across hosts, between the hosts' ranks 0
    total = leaders.allreduce(local, add)
total, hosts = host.broadcast((total, leaders and leaders.size))  # back to every rank of the host

print(f"rank {rank}: rank {host.rank} of {host.size} on its host, one of {hosts} hosts, total {total}")
assert total == [size * (size + 1) // 2] * 3
# No teardown: the sub-groups end at exit before the default group, as a program's groups do.
