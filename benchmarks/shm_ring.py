"""The floor of issue 47: small messages between processes of one host through
shared memory, with a kernel wake-up only for a side that sleeps.

One ``Ring`` carries one direction between one producer and one consumer
(single-producer single-consumer): length-prefixed records in a byte ring of an
anonymous shared mapping (``mmap(-1, ...)``: ``MAP_SHARED | MAP_ANONYMOUS``,
made before ``fork``, so no name exists anywhere and nothing is left in
``/dev/shm``), and an ``eventfd`` that wakes the consumer. The producer writes
the eventfd only when the consumer has said, in the ring's header, that it is
going to sleep, as futex-based locks do: a message to a consumer that is awake
or spinning costs no system call.

The header, each field on its own cache line (the producer writes ``head``, the
consumer ``tail`` and ``sleeping``; sharing a line would bounce it between the
cores at every message)::

    offset   0  head      bytes ever published (u64, monotonic; written by the producer)
    offset  64  tail      bytes ever consumed  (u64, monotonic; written by the consumer)
    offset 128  sleeping  1 while the consumer is about to sleep or sleeps (u64)
    offset 192  data      ``capacity`` bytes (a power of two)

A record is an 8-byte length and the payload, padded to 8 bytes, so that a
length never straddles the end of the data; a payload may (it is copied in
two pieces). The indexes only grow; a position is ``index & (capacity - 1)``.

The wake-up protocol (``sleeping`` against ``head``) is Dekker's: the consumer
stores ``sleeping = 1`` then loads ``head``; the producer stores ``head`` then
loads ``sleeping``. Each side needs its store seen before its load (a
store-load fence) or both may read the old value: the consumer sleeps on a
record the producer never signals (a lost wake-up). Python has no fence;
``full_fence`` takes and releases a ``threading.Lock``, which on x86-64 glibc is
a ``lock``-prefixed instruction, a full barrier. Everything else relies on
x86-64's order (stores seen in program order, loads not passed by loads): the
payload is written before ``head`` is, and read before ``tail`` is. An 8-byte
aligned index is one ``mov`` through a ``memoryview`` cast to ``'Q'`` (never
torn). A real transport needs real atomics (acquire/release, a seq_cst fence)
in C. The poll's ``SAFETY_POLL_MS`` makes a lost wake-up a delay, not a hang,
and ``lost_wakeups`` counts each one the benchmark saw (zero so far).

A full ring: the producer yields (``sleep(0)``) until the consumer has made
room; the benchmarks here have one message in flight per direction, so it never
happens. A transport would give the producer a flag and a wake-up of its own.
"""

from __future__ import annotations

import mmap
import os
import select
import threading
import time
from typing import Sequence

CACHE_LINE = 64
HEAD, TAIL, SLEEPING = 0, CACHE_LINE // 8, 2 * CACHE_LINE // 8  # u64 slots of the header
HEADER_BYTES = 3 * CACHE_LINE
LENGTH_BYTES = 8
ALIGN = 8
DEFAULT_CAPACITY = 1 << 16  # 64 KiB a direction: many small records
SPIN_S = 50e-6  # the bounded spin before sleeping (the floors "+spin" and "+yield"): longer
# than the other side's turn in a small-dict ping-pong here (~10 µs), shorter than a wake-up
# across CPUs (~50-90 µs on this VM), and bounded, so a blocked receive costs next to nothing.
# A spin may yield (Waiter's ``yields``: sched_yield after each empty look, as Open MPI's
# mpi_yield_when_idle): where both sides share a CPU a plain spin holds the CPU the other side
# needs to answer (both pinned to one CPU: 125 µs a round trip spinning, 14 µs not, 13 µs
# spinning and yielding; benchmarks/README.md, issue 47)
SAFETY_POLL_MS = 1000  # a sleeping consumer looks again after this: a lost wake-up is a delay


_fence_lock = threading.Lock()


def full_fence() -> None:
    """A store-load barrier (see the module's docstring: a locked instruction)."""
    _fence_lock.acquire()
    _fence_lock.release()


def ring_bytes(capacity: int = DEFAULT_CAPACITY) -> int:
    return HEADER_BYTES + capacity


class Ring:
    """One direction of a pair: ``publish`` on the producer's side, ``consume``
    (or ``wait_any``) on the consumer's. Both sides build it over the same bytes
    of one shared mapping and the same eventfd (inherited through ``fork``)."""

    def __init__(self, mapping: mmap.mmap, offset: int, wake_fd: int,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity & (capacity - 1) or capacity % ALIGN:
            raise ValueError(f"capacity {capacity} must be a power of two")
        view = memoryview(mapping)[offset:offset + HEADER_BYTES + capacity]
        self._index = view[:HEADER_BYTES].cast("Q")  # head, tail, sleeping: single loads and stores
        self._data = view[HEADER_BYTES:]
        self._lengths = self._data.cast("Q")  # a record's length, at an 8-aligned position
        self.capacity = capacity
        self._mask = capacity - 1
        self.wake_fd = wake_fd
        self.lost_wakeups = 0  # consumer's: a safety poll that timed out on a record

    # -- the producer's side -------------------------------------------------
    def publish(self, payload: bytes) -> None:
        """Append one record; wake the consumer only if it said it sleeps."""
        n = len(payload)
        size = record_size(n)
        if size > self.capacity:
            raise ValueError(f"a record of {n} bytes does not fit a ring of {self.capacity}")
        head = self._index[HEAD]  # (only this side writes it)
        while head + size - self._index[TAIL] > self.capacity:
            time.sleep(0)  # full: let the consumer run (never, in these benchmarks)
        pos = head & self._mask
        self._lengths[pos // LENGTH_BYTES] = n
        self._copy_in((pos + LENGTH_BYTES) & self._mask, payload)
        self._index[HEAD] = head + size  # the record is published (stores seen in order)
        full_fence()  # ... before this side reads whether the consumer sleeps
        if self._index[SLEEPING]:
            os.eventfd_write(self.wake_fd, 1)

    def _copy_in(self, pos: int, payload: bytes) -> None:
        first = min(len(payload), self.capacity - pos)
        self._data[pos:pos + first] = payload[:first]
        if first < len(payload):  # wrapped around
            self._data[:len(payload) - first] = payload[first:]

    # -- the consumer's side -------------------------------------------------
    def consume(self) -> bytes | None:
        """The next record's payload, or None if there is none (never waits)."""
        tail = self._index[TAIL]
        if self._index[HEAD] == tail:
            return None
        pos = tail & self._mask
        n = self._lengths[pos // LENGTH_BYTES]
        start = (pos + LENGTH_BYTES) & self._mask
        first = min(n, self.capacity - start)
        payload = bytes(self._data[start:start + first])
        if first < n:  # wrapped around
            payload += bytes(self._data[:n - first])
        self._index[TAIL] = tail + record_size(n)  # room given back, after the bytes were read
        return payload

    def announce_sleep(self, sleeping: bool) -> None:
        self._index[SLEEPING] = int(sleeping)

    def close(self) -> None:
        """Let go of the views of the mapping (an mmap with views cannot close)."""
        for view in (self._lengths, self._index, self._data):
            view.release()


def record_size(n: int) -> int:
    return (LENGTH_BYTES + n + ALIGN - 1) // ALIGN * ALIGN


class Waiter:
    """A consumer of one or more rings (a rank's inbound rings): the next record
    of any, spinning up to ``spin_s`` first (``sched_yield`` after each empty
    look if ``yields``), then sleeping in ``poll`` on their eventfds. Rings are
    looked at in turn from the one after the last served, so that no producer
    is starved."""

    def __init__(self, rings: Sequence[Ring], spin_s: float = 0.0, yields: bool = False) -> None:
        self.rings = list(rings)
        self.spin_s = spin_s
        self.yields = yields
        self._next = 0
        self._poll = select.poll()
        for ring in self.rings:
            self._poll.register(ring.wake_fd, select.POLLIN)

    def _try(self) -> tuple[int, bytes] | None:
        count = len(self.rings)
        for k in range(count):
            i = (self._next + k) % count
            payload = self.rings[i].consume()
            if payload is not None:
                self._next = (i + 1) % count
                return i, payload
        return None

    def wait_any(self) -> tuple[int, bytes]:
        """(index of the ring, payload) of the next record."""
        got = self._try()
        if got is not None:
            return got
        if self.spin_s > 0:
            deadline = time.perf_counter() + self.spin_s
            while time.perf_counter() < deadline:
                got = self._try()
                if got is not None:
                    return got
                if self.yields:
                    os.sched_yield()
        while True:
            self._announce(True)
            full_fence()  # 'sleeping' seen before this side reads head (the producer's mirror)
            got = self._try()
            if got is None:
                ready = self._poll.poll(SAFETY_POLL_MS)
                for fd, _ in ready:
                    try:
                        os.eventfd_read(fd)  # drain: the next sleep waits for a new wake-up
                    except BlockingIOError:
                        pass
                self._announce(False)
                got = self._try()
                if got is not None and not ready:
                    self.rings[got[0]].lost_wakeups += 1
            else:
                self._announce(False)
            if got is not None:
                return got

    def _announce(self, sleeping: bool) -> None:
        for ring in self.rings:
            ring.announce_sleep(sleeping)

    @property
    def lost_wakeups(self) -> int:
        return sum(ring.lost_wakeups for ring in self.rings)


def make_eventfd() -> int:
    """Non-blocking (a drain after a spurious wake-up must not block), inherited by ``fork``."""
    return os.eventfd(0, os.EFD_NONBLOCK)
