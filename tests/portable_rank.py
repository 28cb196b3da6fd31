"""Run by test_portable.py: one replica of a loopback group, with the
Linux-only modules (fcntl, termios) made unimportable and /proc unreadable,
as on a platform that has none of them."""

import builtins
import sys

sys.modules["fcntl"] = None  # type: ignore[assignment]  # import fcntl now raises ImportError
sys.modules["termios"] = None  # type: ignore[assignment]
_open = builtins.open


def _no_proc(file, *args, **kwargs):
    if str(file).startswith("/proc"):
        raise FileNotFoundError(2, "no /proc here", str(file))
    return _open(file, *args, **kwargs)


builtins.open = _no_proc

import numpy as np  # noqa: E402

import zcollective as zc  # noqa: E402

zc.initialize(timeout=60)
rank = zc.get_rank()
assert zc.allreduce(rank + 1) == 3
big = zc.allreduce(np.full(1 << 18, rank + 1.0))  # 2 MiB: out of band, and peer to peer if on
assert np.array_equal(big, np.full(1 << 18, 3.0)), big[:4]
assert zc.broadcast("hello" if rank == 0 else None) == "hello"
print(f"rank {rank} ok", "fcntl" in sys.modules and sys.modules["fcntl"] is None)
# no teardown: the program just ends, as most do
