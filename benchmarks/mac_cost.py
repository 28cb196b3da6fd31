"""What authenticating large data costs: MAC candidates side by side.

    python benchmarks/mac_cost.py            # prints a table, writes results/mac_cost.json

Each candidate tags 1 MiB chunks and 16 MiB buffers (random bytes); the
figure is the median throughput over repeats (GB/s of data tagged), with a
copy (memcpy) and a numpy add beside them for scale. Every per-message key is
derived inside the timed region, as a real sender would:

* HMAC-SHA256, one thread (what ``Signer`` does today);
* HMAC-SHA256 over 1 MiB chunks in threads (hashlib releases the GIL), the
  chunk tags then HMAC-ed together;
* keyed BLAKE2b;
* Poly1305 (``cryptography``) with a one-time key HMAC-SHA256(K, nonce) for
  a fresh 16-byte nonce;
* keyed BLAKE3, single thread and multithreaded, if ``blake3`` is installed;
* ``ChunkMac`` itself, with each backend this process has.

Never run as a test: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zcollective._format._mac import ChunkMac, available_backends  # noqa: E402

SIZES = {"1 MiB": 1 << 20, "16 MiB": 16 << 20}
CHUNK = 1 << 20  # the threaded HMAC's unit
MIN_SECONDS = 0.3  # per (candidate, size): enough repeats for a stable median on a noisy machine
KEY = hashlib.sha256(b"mac-cost benchmark key").digest()
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "mac_cost.json")


def hmac_one(buf: memoryview) -> bytes:
    return hmac.new(KEY, buf, hashlib.sha256).digest()


def hmac_threads(pool: ThreadPoolExecutor, threads: int) -> Callable[[memoryview], bytes]:
    def run(buf: memoryview) -> bytes:
        # chunks of CHUNK bytes, or split in `threads` parts when smaller
        step = max(1 << 16, min(CHUNK, -(-buf.nbytes // threads)))
        chunks = [buf[i:i + step] for i in range(0, buf.nbytes, step)]
        tags = pool.map(lambda c: hmac.new(KEY, c, hashlib.sha256).digest(), chunks)
        return hmac.new(KEY, b"".join(tags), hashlib.sha256).digest()
    return run


def blake2b_keyed(buf: memoryview) -> bytes:
    return hashlib.blake2b(buf, key=KEY, digest_size=32).digest()


def poly1305_one_time() -> Optional[Callable[[memoryview], bytes]]:
    try:
        from cryptography.hazmat.primitives.poly1305 import Poly1305
    except ImportError:
        return None
    prf = hmac.new(KEY, digestmod=hashlib.sha256)

    def run(buf: memoryview) -> bytes:
        h = prf.copy()
        h.update(os.urandom(16))
        return Poly1305.generate_tag(h.digest(), buf)
    return run


def blake3_keyed(threads: bool) -> Optional[Callable[[memoryview], bytes]]:
    try:
        import blake3
    except ImportError:
        return None
    workers = blake3.blake3.AUTO if threads else 1
    return lambda buf: blake3.blake3(buf, key=KEY, max_threads=workers).digest()


def chunk_mac(backend: str) -> Callable[[memoryview], bytes]:
    mac = ChunkMac(KEY, backend)
    counter = iter(range(1 << 62))
    return lambda buf: mac.tag(next(counter).to_bytes(8, "little"), buf)


def memcpy() -> Callable[[memoryview], bytes]:
    """A copy into a buffer allocated once (the pages already mapped)."""
    targets: dict[int, memoryview] = {}

    def run(buf: memoryview) -> bytes:
        out = targets.setdefault(buf.nbytes, memoryview(bytearray(buf.nbytes)))
        out[:] = buf
        return b""
    return run


def numpy_add() -> Optional[Callable[[memoryview], bytes]]:
    try:
        import numpy as np
    except ImportError:
        return None

    def run(buf: memoryview) -> bytes:
        a = np.frombuffer(buf, dtype=np.uint32)  # random bytes as floats would overflow
        a + a  # noqa: B018 (the cost being measured)
        return b""
    return run


def measure(fn: Callable[[memoryview], Any], buf: memoryview) -> float:
    """Median GB/s over repeats lasting at least MIN_SECONDS (after one warm-up)."""
    fn(buf)
    rates = []
    spent = 0.0
    while spent < MIN_SECONDS or len(rates) < 5:
        start = time.perf_counter()
        fn(buf)
        elapsed = time.perf_counter() - start
        spent += elapsed
        rates.append(buf.nbytes / elapsed / 1e9)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads for the threaded HMAC (default: the CPU count)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    pool = ThreadPoolExecutor(args.threads)
    candidates: list[tuple[str, Optional[Callable[[memoryview], Any]]]] = [
        ("HMAC-SHA256, 1 thread", hmac_one),
        (f"HMAC-SHA256, 1 MiB chunks in {args.threads} threads", hmac_threads(pool, args.threads)),
        ("BLAKE2b keyed", blake2b_keyed),
        ("Poly1305, one-time key HMAC(K, nonce)", poly1305_one_time()),
        ("BLAKE3 keyed, 1 thread", blake3_keyed(False)),
        ("BLAKE3 keyed, threads", blake3_keyed(True)),
        *((f"ChunkMac [{b}]", chunk_mac(b)) for b in available_backends()),
        ("(memcpy)", memcpy()),
        ("(numpy 32-bit add, new result)", numpy_add()),
    ]
    buffers = {name: memoryview(bytearray(os.urandom(size))) for name, size in SIZES.items()}
    rows = []
    print(f"| candidate | {' | '.join(f'{n} GB/s' for n in SIZES)} | ms per 16 MiB |")
    print(f"|---|{'---|' * len(SIZES)}---|")
    for name, fn in candidates:
        if fn is None:
            print(f"| {name} | {' | '.join('not installed' for _ in SIZES)} | |")
            continue
        rates = {size: measure(fn, buf) for size, buf in buffers.items()}
        rows.append({"candidate": name, "gb_per_s": rates})
        cells = " | ".join(f"{rate:.2f}" for rate in rates.values())
        print(f"| {name} | {cells} | {SIZES['16 MiB'] / rates['16 MiB'] / 1e6:.1f} |")
    pool.shutdown()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
                   "cpus": os.cpu_count(), "threads": args.threads, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
