"""Elastic data-parallel training on numpy: it keeps training while ranks are
killed and new ones join, re-sharding its data each time, and sees as many
samples as an undisturbed run.

    python examples/elastic_training.py                 # one replica
    zcollective-run -n 4 examples/elastic_training.py   # four, undisturbed
    zcollective-run -n 4 --replace-lost 2 examples/elastic_training.py --kill 2@40 --kill 0@100

``--kill R@S``: the replica launched as rank R kills itself (SIGKILL) at step S.
The survivors shrink and go on at once; ``--replace-lost`` has the launcher
start a newcomer in each dead one's place, which the group admits at its next
epoch boundary (``grow``); rank 0 then sends it the training state (``send``).

Every step trains on one global batch of BATCH samples, split among the
replicas alive at that step (rank r takes every size-th sample from r). A step
that a loss interrupts is done again by the survivors, so no sample is lost
or counted twice.
"""

import argparse
import os
import signal
import time

import numpy as np

import zcollective

STEPS = 200
BATCH = 64
STEP_S = 0.02  # each step's computation, as the real one would take (newcomers start meanwhile)
EPOCH_STEPS = 10  # newcomers are admitted at each epoch's end
LEARNING_RATE = 0.1
STATE_TAG = 1  # the training state, sent to a newcomer

parser = argparse.ArgumentParser()
parser.add_argument("--kill", action="append", default=[], metavar="RANK@STEP",
                    help="the replica launched as RANK kills itself at STEP")
args = parser.parse_args()
newcomer = os.environ.get("ZCOLLECTIVE_JOIN") == "1"
launched_as = int(os.environ.get("ZCOLLECTIVE_REPLICA_RANK", "0"))
kill_at = {int(step) for rank, step in (k.split("@") for k in args.kill) if int(rank) == launched_as}

rng = np.random.default_rng(0)  # the same data set on every replica
true_w = rng.normal(size=5)
features = rng.normal(size=(4096, 5))
targets = features @ true_w + 0.01 * rng.normal(size=4096)

try:
    zcollective.initialize()  # a newcomer (ZCOLLECTIVE_JOIN=1) returns once a grow() admits it
except zcollective.LateJoinError as exc:  # the training ended first: nothing left to do
    print(f"newcomer: {exc}")
    raise SystemExit(0) from None
if newcomer:
    state = zcollective.recv(0, STATE_TAG)  # rank 0 sends it to each newcomer after the grow()
else:
    state = {"step": 0, "seen": 0, "weights": np.random.default_rng(42).normal(size=5)}

while state["step"] < STEPS:
    step = state["step"]
    try:
        if step in kill_at and not newcomer:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, mid-training
        rank, size = zcollective.get_rank(), zcollective.get_world_size()
        batch = np.arange(step * BATCH, (step + 1) * BATCH) % len(targets)
        mine = batch[rank::size]  # this step's shard: re-sharded whenever the group changes
        x, y = features[mine], targets[mine]
        time.sleep(STEP_S)
        grad = zcollective.allreduce(x.T @ (x @ state["weights"] - y))
        seen = zcollective.allreduce(len(mine))
        state = {"step": step + 1, "seen": state["seen"] + seen,
                 "weights": state["weights"] - LEARNING_RATE * grad / BATCH}
        admitted = zcollective.grow() if state["step"] % EPOCH_STEPS == 0 else 0  # newcomers waiting
        if admitted and zcollective.get_rank() == 0:  # ... are given the state, by rank 0 alone (the
            size = zcollective.get_world_size()  # members have it): newcomers rank after the members
            for newcomer_rank in range(size - admitted, size):
                zcollective.send(state, newcomer_rank, tag=STATE_TAG)
    except zcollective.ReplicaLostError as exc:
        zcollective.shrink()  # the survivors go on, in these processes
        # a result rank 0 sent some ranks only as it died: take the new rank 0's state everywhere
        state = zcollective.broadcast(state)
        print(f"rank {zcollective.get_rank()}: lost ranks {zcollective.lost_ranks()} at "
              f"step {step} ({type(exc).__name__}); going on with {zcollective.get_world_size()}")

loss = float(np.mean((features @ state["weights"] - targets) ** 2))
print(f"rank {zcollective.get_rank()}: trained {state['step']} steps on {state['seen']} samples "
      f"(undisturbed: {STEPS * BATCH}); {zcollective.get_world_size()} "
      f"replica{'s' if zcollective.get_world_size() != 1 else ''} at the end; "
      f"loss {loss:.6f}")
