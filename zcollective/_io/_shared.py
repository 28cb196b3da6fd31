"""The shared-memory segment of one host's ranks, and the moving of a
:class:`~zcollective._protocol._shm.SharedJob` through it (segment steps, memory steps, SYNCs through the
driver). See docs/protocol.md, *Shared memory*: a POSIX object made by the host's leader, mode 0600, named
by a hash of session, host and generation, unlinked once every rank attached.

``_posixshmem`` is used directly: ``SharedMemory``'s resource tracker would unlink a segment others still
use when one that merely attached ends (CPython gh-82300, fixed only by ``track=False`` in 3.13).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import stat
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from .._format._wire import Kind, Message
from .._protocol import _shm
from .._protocol._ring import Transfer
from ..errors import PeerError

if TYPE_CHECKING:
    from .._protocol._member import Member

try:
    import _posixshmem
except ImportError:  # (Windows: no shared memory path)
    _posixshmem = None

log = logging.getLogger("zcollective")

MODE = 0o600  # the job's user alone may map it
GROWTH = 5 / 4  # a segment made anew is at least this much larger (arrays growing slowly make few)


def available() -> bool:
    """Can this process take part in a host's segment?"""
    return _posixshmem is not None and hasattr(os, "ftruncate")


def room() -> int:
    """Bytes free where segments live (``/dev/shm``), 0 if unknown."""
    try:
        st = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return 0
    return st.f_bavail * st.f_frsize


def segment_name(session: int, host: int, gen: int) -> str:
    """The segment's name: a hash, so one seen in ``/dev/shm`` tells neither the session nor the next name."""
    digest = hashlib.sha256(b"zcollective-shm|%d|%d|%d" % (session, host, gen)).hexdigest()
    return f"/zcollective-{digest[:32]}"


class Segment:
    """One mapped segment: ``sets`` x ``size`` slots of ``capacity`` bytes."""

    def __init__(self, name: str, gen: int, capacity: int, size: int, create: bool) -> None:
        self.name = name
        self.gen = gen
        self.capacity = capacity
        self.nbytes = 2 * size * capacity
        assert _posixshmem is not None
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(name, flags, mode=MODE)
        try:
            if create:
                os.ftruncate(fd, self.nbytes)
                if hasattr(os, "posix_fallocate"):  # the memory is taken now, or ENOSPC: never a
                    os.posix_fallocate(fd, 0, self.nbytes)  # SIGBUS at a write into a full tmpfs
            else:
                st = os.fstat(fd)
                if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077 or st.st_size != self.nbytes:
                    raise PermissionError(f"the segment {name} is not this group's (owner {st.st_uid}, "
                                          f"mode {stat.S_IMODE(st.st_mode):o}, {st.st_size} bytes)")
            self._map: Optional[mmap.mmap] = mmap.mmap(fd, self.nbytes)
        except BaseException:
            if create:
                with contextlib.suppress(OSError):
                    _posixshmem.shm_unlink(name)
            raise
        finally:
            os.close(fd)  # (the mapping keeps the memory)
        import numpy
        self.slots: Any = numpy.frombuffer(self._map, dtype=numpy.uint8).reshape(2, size, capacity)

    def close(self) -> None:
        """Let go of the mapping (the memory goes once every rank did and the name is unlinked)."""
        self.slots = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view is still alive: the GC unmaps it
                self._map.close()
            self._map = None


def unlink(name: str) -> None:
    """Unlink a segment's name, if it is still there and this user may (closing goes on regardless)."""
    if _posixshmem is not None:
        with contextlib.suppress(OSError):
            _posixshmem.shm_unlink(name)


class _Unmade(Exception):
    """The segment a call was placed in was never made."""

    def __init__(self, gen: int) -> None:
        super().__init__(f"generation {gen} was never made")
        self.gen = gen


class SharedPlane:
    """This rank's part in its host's segment; used by the thread that holds the group's turn."""

    @classmethod
    def welcomed(cls, member: Any) -> SharedPlane:
        """The plane the WELCOME's ``shared`` says (with ranks on several hosts, each host's leader too)."""
        shared = member.shared
        hosts = shared["hosts"]
        host = hosts[member.rank]
        known = {h for h in hosts if h is not None}
        leaders = sorted(hosts.index(h) for h in known) if len(known) > 1 else None  # (rule 13)
        return cls(member, member.session, host, [r for r, h in enumerate(hosts) if h == host],
                   shared["room"][host], leaders)

    def __init__(self, member: Member, session: int, host: int, ranks: list[int], room: int,
                 leaders: Optional[list[int]] = None) -> None:
        self.member = member
        self.session = session
        self.host = host
        self.ranks = ranks  # the group ranks on this host, in order
        self.rank = ranks.index(member.rank)  # this rank among them
        self.size = len(ranks)
        self.leader = self.rank == 0
        self.leaders = leaders  # ranks on several hosts: each host's leader, in ring order (None: one host)
        self.host_index = -1 if leaders is None else leaders.index(ranks[0])  # this host's place among them
        self.room = room  # the most bytes a segment of this host may take
        self.pid = os.getpid()
        self.segment: Optional[Segment] = None
        self.planned = 0  # the capacity of the segment the last plan uses (plan order)
        self.gen = 0  # ... and its generation
        self.count = 0  # plans placed: the next call uses set count % 2
        self.completed = 0  # ... of which the last completed here is the one before this
        self.linked: set[str] = set()  # names made (or to be made) and not yet unlinked
        self.growing: Optional[int] = None  # the last plan making a new segment, until its call completes

    def fits(self, nbytes: int) -> bool:
        """May an array of ``nbytes`` go through this host's segment?"""
        return 2 * self.size * _shm.aligned(nbytes) <= self.room

    def knows_free(self) -> bool:
        """Is the next call's set free of readers (no call in flight, the last placed completed)?"""
        member = self.member
        return self.completed == self.count and not member.calls and not member.transfers

    def free_slot(self, nbytes: int) -> Optional[Any]:
        """This rank's slot of the next call's set, if it may write its input there now; else None."""
        segment = self.segment
        if not self.knows_free() or segment is None or nbytes > segment.capacity or segment.gen != self.gen:
            return None
        return segment.slots[self.count % 2, self.rank]

    def place(self, nbytes: int) -> _shm.Place:
        """Where the next call (its plan came, in order) puts ``nbytes`` a rank."""
        self.check()  # (then this call makes the segment anew)
        grow = nbytes > self.planned
        if grow:
            self.planned = max(_shm.aligned(nbytes), _shm.aligned(int(self.planned * GROWTH)))
            if 2 * self.size * self.planned > self.room:
                self.planned = _shm.aligned(nbytes)
            self.gen += 1
            self.linked.add(segment_name(self.session, self.host, self.gen))
        place = _shm.Place(self.count % 2, self.planned, self.gen, grow, self.count)
        if grow:
            self.growing = self.count
        self.count += 1
        return place

    def check(self) -> None:
        """The call that was to make the segment failed (alike on the host): forget it, the next makes one."""
        if self.growing is not None and not any(
                getattr(job, "place", None) is not None and job.place.index == self.growing
                for _, job in self.member.transfers):
            self._forget()

    def _forget(self) -> None:
        """No segment is known any more: the next call makes one, of a new generation."""
        self.growing, self.planned = None, 0
        for name in sorted(self.linked):
            self._unlink(name)
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    # -- moving a job -----------------------------------------------------------

    def run(self, seq: int, job: _shm.SharedJob, deadline: Optional[float], pump: Callable[[], bool],
            send: Callable[[list[Message]], None], fail: Callable[[Exception], None],
            ring: Callable[[Transfer], bool]) -> bool:
        """Do ``job``'s steps until done or failed (True), or ``pump`` or ``ring`` (the leaders' ring on the
        data plane) says stop (False: it goes on at the next wait; docs/protocol.md, *Progress*)."""
        member = self.member
        while member.transfers and member.transfers[0][1] is job:
            step = job.step
            if step is None:
                self.completed = max(self.completed, job.place.index + 1)
                if job.place.index == self.growing:
                    self.growing = None
                return True
            if step == _shm.SYNC:
                if not job.asked:
                    job.asked = True
                    send([Message(Kind.SYNC, rank=member.rank, root=job.syncs, seq=seq,
                                  session=member.session)])
                    continue
                if not pump() or (deadline is not None and time.monotonic() >= deadline):
                    return False
                continue
            try:
                if step == _shm.RING:
                    transfer = job.ring()
                    if not ring(transfer):
                        return False
                    if not transfer.done:  # (the call failed meanwhile)
                        continue
                else:
                    self._do(step, job)
            except Exception as exc:  # the segment could not be made or reached, or the reduce
                fail(self._failed(seq, job, step, exc))  # function raised: this call fails on
                return True  # every rank, the group goes on
            job.advance()
        return True

    def _failed(self, seq: int, job: _shm.SharedJob, step: str, exc: Exception) -> PeerError:
        """The error of a step that raised ``exc`` (for every rank: the call fails alike)."""
        rank, said = self.member.rank, f"{type(exc).__name__}: {exc}"
        if isinstance(exc, _Unmade):
            what = (f"its host's shared-memory segment of generation {exc.gen} was never made (the call "
                    f"that was to make it failed); the next call makes a new one")
        elif step == _shm.REDUCE:
            what = f"the reduce function raised on rank {rank} (through shared memory): {said}"
        elif step == _shm.RING:
            what = f"rank {rank} could not take its host's sum round the ring between hosts: {said}"
        else:
            name = segment_name(self.session, self.host, job.place.gen)
            verb = "make" if step == _shm.CREATE else "map"
            what = (f"rank {rank} could not {verb} its host's shared-memory segment {name} of "
                    f"{2 * self.size * job.place.capacity} bytes: {said} (is /dev/shm full? "
                    f"ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES=off keeps arrays out of it)")
        error = PeerError(f"seq {seq} {job.op}: {what}")
        error.seq = seq  # type: ignore[attr-defined]
        return error

    def _do(self, step: str, job: _shm.SharedJob) -> None:
        place = job.place
        if step in (_shm.CREATE, _shm.ATTACH):
            name = segment_name(self.session, self.host, place.gen)
            old, self.segment = self.segment, None
            if old is not None:
                old.close()
            self.segment = Segment(name, place.gen, place.capacity, self.size, create=step == _shm.CREATE)
        elif step == _shm.UNLINK:
            self._unlink(segment_name(self.session, self.host, place.gen))
        else:
            if self.segment is None or self.segment.gen != place.gen:  # (a call before it that was to
                raise _Unmade(place.gen)  # make it failed after this one was placed)
            job.memory(step, self.segment.slots[place.set])

    def _unlink(self, name: str) -> None:
        if os.getpid() == self.pid:  # (a forked child never touches its parent's)
            unlink(name)
        self.linked.discard(name)

    def close(self) -> None:
        """The group closes: let go of the segment; unlink every name not yet unlinked."""
        self._forget()
