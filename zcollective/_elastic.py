"""Elastic groups: the survivors of a loss go on in the same processes
(:func:`shrink`), a running group admits newcomers (:func:`regroup`), each
step asking :class:`~zcollective._lifecycle.Lifecycle` for the next group.
See docs/protocol.md, *Elastic groups*."""

from __future__ import annotations

import dataclasses
import operator
import socket
import time
from typing import Any, Callable, Generic, NamedTuple, Optional, Protocol, TypeVar

from ._calls import DEFAULT, Calls, Timeout
from ._forming import Form, Overslept, Unreachable
from ._io import _interrupts, _stops
from ._lifecycle import Lifecycle
from ._limits import FORM_PROBE_S, FORM_REACH_S, HOST_WINDOW_S
from ._protocol._member import fresh, lost_rank_0
from .config import Config
from .errors import (
    AddressError,
    AuthenticationError,
    CollectiveTimeoutError,
    LateJoinError,
    LeftOutError,
    ProtocolError,
    ReplicaLostError,
)


def form_port(master_port: int, old_rank: int) -> int:
    """Where old rank ``old_rank`` hosts a group formed from one at
    ``master_port``: old rank 0 at that port, the others ``old_rank`` above it,
    so a would-be host never needs a port a living old rank 0 (stopped, busy
    in its own code) still holds on the same host."""
    port = master_port + old_rank
    span = MAX_PORT + 1 - MIN_FORM_PORT
    return port if port <= MAX_PORT else MIN_FORM_PORT + (port - MIN_FORM_PORT) % span


MAX_PORT = 65535
MIN_FORM_PORT = 1024  # past the top, form ports wrap to here (below: ports only root may bind)


def shrink(life: Lifecycle, timeout: Optional[float], majority: bool = True) -> Lifecycle:
    """The survivors' next group (see the module's steps); ``life`` is closed."""
    member, config = life.member, life.config
    old_rank, old_size = config.rank, config.num_replicas
    failure = member.failure
    if failure is not None and not isinstance(failure, ReplicaLostError):
        raise fresh(failure)  # a program's bug (a mismatch, ...) failed it for good: no shrink hides it
    lost = set(getattr(failure, "lost_ranks", ()))  # the coordinator's word
    dead = set(getattr(failure, "dead_ranks", ()))  # ... that they died (not merely went silent)
    inferred = set(getattr(failure, "lost_inferred", ())) - lost  # a connection closed
    addresses = member.addresses or [config.master_addr] * old_size
    lineage = f"{member.session:x}"
    failed_at = member.failed_at if failure is not None else time.monotonic()
    if inferred:  # its link went: if this process was stopped long enough for its peers to drop
        # it, shortly before, that is why, and the others have been shrinking since
        began = _stops.stopped(config.liveness_timeout * 2 / 3, failed_at - 2 * config.liveness_timeout)
        if began is not None:
            failed_at = min(failed_at, began)
    coordinator = life.coordinator()
    if coordinator is not None and coordinator.failed_at is not None:  # rank 0: when its coordinator
        failed_at = min(failed_at, coordinator.failed_at)  # failed, not when its program heard
    life.close_to_form(quick=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    allowed = 0.0  # the time its tries of the candidates so far were allowed to take

    def is_late() -> bool:
        # late: more time went since the failure than its own tries explain (it shrank late,
        # or was stopped or starved meanwhile, even while probing): the others may have
        # counted it lost by now, and must not find two groups
        return time.monotonic() - failed_at - allowed > HOST_WINDOW_S

    if life.reforming == "grow()":  # its grow() did not finish: the grown group formed without it
        raise LeftOutError(f"old rank {old_rank}: its grow() did not finish here, so the others "
                           f"formed the grown group without it")
    late = is_late()
    candidates = [r for r in range(old_size) if r not in lost]
    tried: list[str] = []
    reach_more = 0.0  # it could not host (its port another program's): a later candidate may be
    # trying it meanwhile, and hosts only after that

    def at(candidate: int) -> Config:
        """Where ``candidate`` hosts: old rank 0 where the group was, another at
        the address rank 0 saw it at (binding that)."""
        if candidate == 0:
            return config
        return dataclasses.replace(config, master_addr=addresses[candidate], bind_addr=None,
                                   master_port=form_port(config.master_port, candidate))

    for candidate in candidates:
        if deadline is not None and time.monotonic() > deadline:
            break
        if candidate == old_rank:
            if late or is_late():
                late = True
                continue  # too late to host: join a later one (which may say this one was left out)
            if majority:  # a rank the coordinator lost whose host refuses a connection: it died
                dead |= died(lost - dead, addresses, config)
            # a lower candidate not seen to die may come: it could not host (too late, or its
            # port another program's), and is not to be left out for that
            expected = frozenset(r for r in candidates if r not in dead)
            from ._protocol._coordinator import Forming  # (loaded by a host only, as in _lifecycle)

            forming = Forming(lineage, expected, old_size, frozenset(dead), majority, host=old_rank)
            try:
                return Lifecycle(at(candidate), Form(lineage, forming))
            except Overslept as exc:  # stopped while it waited for them: as too late to host
                tried.append(f"old rank {candidate}: {exc}")
                late = True
                continue
            except AddressError as exc:  # its port is another program's: the next one hosts
                tried.append(f"old rank {candidate}: {exc}")
                reach_more = FORM_REACH_S + FORM_PROBE_S
                continue
        reach_s = (FORM_PROBE_S if candidate in inferred else FORM_REACH_S) + reach_more
        allowed += reach_s
        try:
            return Lifecycle(at(candidate), Form(lineage, reach_s=reach_s))
        except LeftOutError:
            raise
        except (Unreachable, LateJoinError, AuthenticationError, ProtocolError, AddressError) as exc:
            # lost too, or another program's port (another group's, a stranger's), or no route
            # from here to it (this host cut off: its ports cannot be opened towards it)
            if candidate == 0 and getattr(exc, "refused", False):
                dead.add(candidate)  # nobody listens where its coordinator did: its process is gone
                # (another would-be host listens only once it hosts: its refusal says nothing)
            tried.append(f"old rank {candidate}: {exc}")
    if late:
        raise LeftOutError(f"old rank {old_rank} came to shrink {time.monotonic() - failed_at:.1f} s "
                           f"after its group failed, too late to host the survivors' group, and found "
                           f"none that would take it: the others may have gone on without it"
                           + "".join(f"; {t}" for t in tried))
    raise CollectiveTimeoutError(f"old rank {old_rank} could not shrink within {timeout} s: "
                                 + "; ".join(tried))


def died(ranks: set[int], addresses: list[str], config: Config) -> set[int]:
    """Of ``ranks`` (lost by the coordinator's word), those whose host refuses a
    TCP connection at the rank's form port at once: the host is up and the
    rank's process is not hosting there. A rank cut off (or a host down) does
    not answer within :data:`FORM_PROBE_S`, and is not counted dead."""
    out = set()
    for rank in sorted(ranks)[:MAX_DEATH_PROBES]:
        host = config.master_addr if rank == 0 else addresses[rank]
        try:
            socket.create_connection((host.strip("[]"), form_port(config.master_port, rank)),
                                     timeout=FORM_PROBE_S).close()
        except ConnectionRefusedError:
            out.add(rank)
        except OSError:
            pass  # silent, unreachable, or not an address: not seen to die
    return out


MAX_DEATH_PROBES = 64  # a shrink probes at most this many lost ranks' hosts (each refuses at once,
# or costs FORM_PROBE_S)


class Agreement(NamedTuple):
    """What :func:`zcollective.agree` returns on every member alike."""

    flag: bool  # every living member's flag, AND-ed
    lost: frozenset[int]  # the ranks (of the group agree was called on) found lost


class _Group(Protocol):
    """What the elastic part asks of its group."""

    admitted: int

    def allreduce(self, value: Any, reduce_fn: Any = ..., *, timeout: Any = ...) -> Any: ...


G = TypeVar("G", bound=_Group)


class Elastic(Generic[G]):
    """A group's elastic steps: the part behind :meth:`~zcollective.Group.shrink`,
    ``grow``, ``agree``, ``coordinator_address``, ``old_ranks`` and ``lost_ranks``;
    ``form`` makes a group of a life, ``part`` is a group's part."""

    def __init__(self, group: G, calls: Calls, form: Callable[[Lifecycle], G],
                 part: Callable[[G], Elastic[G]]) -> None:
        self.group, self.calls, self.life, self.form, self.part = group, calls, calls.life, form, part


    def shrink(self, timeout: Optional[float] = None, *, majority: bool = True) -> G:
        """After a loss, the survivors' new group, in the same processes: call
        it on every survivor (the rules: README, "Elastic groups"). This group
        is closed; the new one ranks the survivors densely in old-rank order
        (:attr:`old_ranks`, :attr:`lost_ranks` say how). If rank 0 was lost,
        the lowest surviving rank ``r`` hosts the coordinator, on its own host
        at the master port + ``r``. The survivors form a group only if they are
        more than half of the ranks not seen to die (a partition never leaves
        two groups going on); ``majority=False`` (on every survivor) forms one
        with whoever came. In a group that lost nobody it is a collective call:
        it returns this group once every rank has called it. (The module's
        :func:`~zcollective.shrink` returns None: the new group becomes the default.)

        Raises
        ------
        LeftOutError
            The others formed their group without this replica (it came too
            late, or they had counted it lost).
        CollectiveTimeoutError
            No group could be formed within ``timeout``.
        CallMismatchError
            Called in a group that had lost nobody, while another rank made
            another call: a healthy group shrinks only when every rank calls it.
        CollectiveError
            The group had failed for another reason than a loss (a mismatch,
            ...): that error, as every later call of it raises.
        """
        life = self.life
        _interrupts.hold_new_handlers()  # (a handler the program installed since: wrapped first)
        life.check_process()
        if life.closed and life.reforming is None:
            raise RuntimeError("this zcollective group was torn down: there is nothing to shrink")
        if not life.closed and life.member.failure is None:  # nothing lost that it knows of:
            try:  # a collective call of every member (one calling it alone is a mismatch)
                self.calls.blocking(self.calls.call("shrink"), DEFAULT if timeout is None else timeout)
                return self.group  # every member called it, and nobody was lost
            except ReplicaLostError:
                pass  # lost meanwhile: shrink as after any loss
        return self.form(shrink(life, timeout, majority))

    def grow(self, timeout: Timeout = DEFAULT) -> G:
        """Admit every newcomer waiting (started with ``join=True`` at this
        group's coordinator address): a collective call of every member. With
        nobody waiting, returns this group at once, unchanged; otherwise this
        group closes, and its members and the newcomers form the next one at
        the same address, the members keeping their ranks, the newcomers
        numbered after them (:attr:`admitted` says how many joined). No call
        ever mixes the two memberships. A member lost while the group forms
        again: the others shrink instead (the newcomers are told to start
        again), and ``admitted`` is 0. (The module's :func:`~zcollective.grow`
        returns the count, and makes the new group the default.)

        Raises
        ------
        CollectiveError
            As for any collective call (the group goes on, unchanged).
        """
        count = self.calls.run("grow", timeout)
        if not count:
            return self.group
        grown = self.form(regroup(self.life, count))
        old = self.part(grown).old_ranks() or []  # newcomers were numbered from this group's size on
        grown.admitted = sum(r >= self.life.config.num_replicas for r in old)  # those in the group formed
        return grown

    def coordinator_address(self) -> str:
        """``host:port`` of this group's coordinator: where newcomers go (it
        moves when rank 0 is lost and the survivors shrink)."""
        return self.life.coordinator_address()

    def agree(self, flag: bool, timeout: Optional[float] = None) -> tuple[G, Agreement]:
        """ULFM's agree: every living member gets the same AND of the
        members' ``flag`` and the same set of ranks found lost (of this
        group). In a failed group (or one failing meanwhile) the survivors
        shrink first: returns the group they agreed in (this one if nothing
        was lost) and the :class:`~zcollective.Agreement`. (The module's
        :func:`~zcollective.agree` returns the agreement only, and makes that
        group the default.)

        Raises
        ------
        LeftOutError
            The others went on without this replica (see :meth:`shrink`).
        CollectiveError
            The group failed for another reason than a loss.
        """
        size = self.life.config.num_replicas
        at_call = list(range(size))  # each rank of the current group, as a rank of this one
        current: Elastic[G] = self
        while True:
            failure = current.life.member.failure
            if failure is None:
                try:
                    together = current.group.allreduce(bool(flag), operator.and_, timeout=timeout)
                    lost = frozenset(set(range(size)) - set(at_call))
                    return current.group, Agreement(bool(together), lost)
                except ReplicaLostError:
                    pass
            elif not isinstance(failure, ReplicaLostError):
                raise fresh(failure)
            current = self.part(current.shrink(timeout))
            at_call = [at_call[old] for old in current.old_ranks() or range(current.life.config.num_replicas)]

    def old_ranks(self) -> Optional[list[int]]:
        """A group formed from an earlier one, by :meth:`shrink` or a
        :meth:`grow` that admitted newcomers: every rank's rank in the group
        before (by new rank; a newcomer's is the number :meth:`grow` gave it,
        from the size before on); None for any other group."""
        return self.life.member.old_ranks

    def lost_ranks(self) -> list[int]:
        """A group formed from an earlier one (:attr:`old_ranks`): the ranks
        of the group before that are not in this one; ``[]`` otherwise."""
        old = self.life.member.old_ranks
        return [] if old is None else sorted(set(range(self.life.member.old_size)) - set(old))


def regroup(life: Lifecycle, newcomers: int) -> Lifecycle:
    """A grow() admitted ``newcomers``: this group closes, and its members
    and the newcomers form the next one where it was (rule 9), rank 0 hosting."""
    config, member = life.config, life.member
    lineage, size = f"{member.session:x}", config.num_replicas + newcomers
    life.close_to_form(quick=False)
    where = dataclasses.replace(config, num_replicas=size)
    if config.rank == 0:
        from ._protocol._coordinator import Forming  # (loaded by a host only, as in _lifecycle)

        forming = Forming(lineage, frozenset(range(size)), size, voters=config.num_replicas)
        try:
            return Lifecycle(where, Form(lineage, forming))
        except Overslept as exc:  # stopped while the others waited: they may have gone on
            raise LeftOutError(f"rank 0: {exc}; the others may have gone on without it") from None
    try:
        return Lifecycle(where, Form(lineage))
    except (Unreachable, CollectiveTimeoutError) as exc:  # rank 0 was lost as the group formed
        # again: its members go on as after any loss (the newcomers are told to start again)
        member.fail(lost_rank_0(ReplicaLostError(
            f"rank {config.rank}: the coordinator (rank 0) was lost while the group formed again "
            f"after a grow(): {exc}")))
        life.reforming = "shrink()"  # (not a grow's that went on without it: a loss)
        return shrink(life, None)
