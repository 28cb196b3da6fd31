"""Every replica learns every replica's host name and process id.

    zcollective-run -n 3 examples/allgather.py
"""

import os
import socket

import zcollective

zcollective.initialize()
everyone = zcollective.allgather((socket.gethostname(), os.getpid()))
print(f"rank {zcollective.get_rank()}: replicas by rank = {everyone}")
zcollective.teardown()
