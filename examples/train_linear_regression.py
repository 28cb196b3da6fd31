"""Data-parallel training of a linear regression on numpy, end to end.

Each replica holds one shard of the data. Rank 0 initialises the weights and
broadcasts them; every step, replicas allreduce their gradients (numpy arrays)
and agree on an early-stop flag with allreduce_async, collected a step later so
that it overlaps with the next step's work.

    python examples/train_linear_regression.py                # one replica
    zcollective-run -n 4 examples/train_linear_regression.py  # four
"""

import numpy as np

import zcollective

STEPS = 200
LEARNING_RATE = 0.1
TARGET_LOSS = 1e-3

zcollective.initialize()
rank, size = zcollective.get_rank(), zcollective.get_world_size()

# The same synthetic data set everywhere; each replica keeps its own shard.
rng = np.random.default_rng(0)
true_w = rng.normal(size=5)
features = rng.normal(size=(4000, 5))
targets = features @ true_w + 0.01 * rng.normal(size=4000)
x, y = features[rank::size], targets[rank::size]

weights = zcollective.broadcast(np.random.default_rng(42).normal(size=5) if rank == 0 else None)
stop_flag = None
for step in range(STEPS):
    error = x @ weights - y
    grad_sum = zcollective.allreduce(x.T @ error)  # numpy arrays sum with the default reduce_fn
    count = zcollective.allreduce(len(y))
    weights -= LEARNING_RATE * grad_sum / count
    loss = zcollective.allreduce(float(error @ error)) / count
    if step % 20 == 0:
        print(f"rank {rank}: step {step:3d} loss {loss:.6f}")
    if stop_flag is not None and stop_flag.result(timeout=60):
        print(f"rank {rank}: every replica agreed to stop at step {step}, loss {loss:.6f}")
        break
    stop_flag = zcollective.allreduce_async(loss < TARGET_LOSS, lambda a, b: a and b)

# Every replica holds exactly the same weights.
same = zcollective.allreduce([weights.tobytes()], lambda a, b: a if a == b else [b"differ"])
print(f"rank {rank}: weights agree across replicas: {same != [b'differ']}; "
      f"distance to truth {np.linalg.norm(weights - true_w):.4f}")
zcollective.teardown()
