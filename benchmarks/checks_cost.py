"""The cost of the checks that are always on, measured in isolation.

    python benchmarks/checks_cost.py

Call-site capture runs once per call on every replica; the sequence-order and
operation-match checks run once per message at the coordinator. Compare with
the time of a small allreduce in benchmarks/README.md.
"""

from __future__ import annotations

import timeit

from zcollective._group import _callsite
from zcollective._wire import Kind, Message, Op

N = 200_000


def main() -> None:
    per_call = timeit.timeit(_callsite, number=N) / N
    msg = Message(Kind.CONTRIB, Op.ALLREDUCE, rank=1, root=0, seq=7)
    next_seq = [7, 7, 7, 7]
    first = (Op.ALLREDUCE, 0)

    def checks() -> bool:  # what _coordinator._on_contribution adds per message for them
        return msg.seq != next_seq[msg.rank] or (msg.op, msg.root) != first

    per_message = timeit.timeit(checks, number=N) / N
    print(f"call-site capture: {per_call * 1e6:.2f} µs per call")
    print(f"sequence and match checks: {per_message * 1e6:.2f} µs per message")
    for n, op_us in ((2, 500), (4, 700), (8, 1300)):
        share = (per_call + n * per_message) * 1e6 / op_us
        print(f"N={n}: {share:.2%} of a {op_us} µs small allreduce")


if __name__ == "__main__":
    main()
