"""The cost of the checks and statistics that are always on, measured in isolation.

    python benchmarks/checks_cost.py

Call-site capture and the call statistics (two clock reads, the bytes of the
contribution and the result, one record) run once per call on every replica;
the sequence-order and operation-match checks and the arrival time run once
per message at the coordinator, and the lateness record once per call there.
Compare with the time of a small allreduce in benchmarks/README.md.
"""

from __future__ import annotations

import time
import timeit

from zcollective._calls import _callsite
from zcollective._format._wire import Kind, Message
from zcollective._protocol._ops import Op
from zcollective._protocol._stats import CallStats, Lateness

N = 200_000


def main() -> None:
    per_call = timeit.timeit(_callsite, number=N) / N
    msg = Message(Kind.CONTRIB, Op.ALLREDUCE, rank=1, root=0, seq=7)
    next_seq = [7, 7, 7, 7]
    first = (Op.ALLREDUCE, 0)

    def checks() -> bool:  # what _coordinator._on_contribution adds per message for them
        return msg.seq != next_seq[msg.rank] or (msg.op, msg.root) != first

    per_message = timeit.timeit(checks, number=N) / N
    stats, result = CallStats(), Message(Kind.RESULT, segments=[[b"\x80\x05K\x03."]])

    def member_stats() -> None:  # what Member.submit and Member._record add per call for it
        started = time.perf_counter()  # (submit already measures each frame, for max_frame_bytes)
        received = 0
        for segment in result.segments:
            for f in segment:
                received += len(f) if type(f) is bytes else memoryview(f).nbytes
        stats.record("allreduce", 5, received, time.perf_counter() - started)

    per_call_stats = timeit.timeit(member_stats, number=N) / N
    late = {n: Lateness(n) for n in (2, 4, 8)}
    arrivals = {n: {r: time.monotonic() for r in range(n)} for n in (2, 4, 8)}
    print(f"call-site capture: {per_call * 1e6:.2f} µs per call")
    print(f"call statistics: {per_call_stats * 1e6:.2f} µs per call")
    print(f"sequence and match checks: {per_message * 1e6:.2f} µs per message")
    for n, op_us in ((2, 500), (4, 700), (8, 1300)):
        arrival = timeit.timeit(time.monotonic, number=N) / N
        lateness = timeit.timeit(lambda n=n: late[n].record(arrivals[n]), number=N // 10) / (N // 10)
        checks_share = (per_call + n * per_message) * 1e6 / op_us
        stats_share = (per_call_stats + n * arrival + lateness) * 1e6 / op_us
        print(f"N={n}: checks {checks_share:.2%}, statistics {stats_share:.2%} of a {op_us} µs "
              f"small allreduce (statistics at the coordinator: {lateness * 1e6:.2f} µs per call)")


if __name__ == "__main__":
    main()
