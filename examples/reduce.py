"""Count words across replicas, with the total on rank 0 only.

    zcollective-run -n 3 examples/reduce.py
"""

from collections import Counter

import zcollective

zcollective.initialize()
rank = zcollective.get_rank()

text = ["the quick brown fox", "jumps over the lazy dog", "the end"][rank % 3]
counts = zcollective.reduce(Counter(text.split()), root=0)  # Counter + Counter
if rank == 0:
    print(f"rank 0: most common words {counts.most_common(3)}")

zcollective.teardown()
