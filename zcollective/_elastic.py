"""Elastic groups: the survivors of a loss go on in the same processes (:func:`shrink`), a running group
admits newcomers (:func:`regroup`), each step asking :class:`~zcollective._lifecycle.Lifecycle` for the next
group. See docs/protocol.md, *Elastic groups*."""

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
from ._limits import FORM_PROBE_S, FORM_REACH_S, GROW_FORM_WAIT_S, HOST_WINDOW_S
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
    """Where old rank ``old_rank`` hosts a group formed from one at ``master_port``: that port
    + ``old_rank``, so no host needs a port a living old rank 0 may still hold."""
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
    if inferred:  # stopped long enough, shortly before, for its peers to drop it: they shrank since
        began = _stops.stopped(config.liveness_timeout * 2 / 3, failed_at - 2 * config.liveness_timeout)
        if began is not None:
            failed_at = min(failed_at, began)
    coordinator = life.coordinator()
    if coordinator is not None and coordinator.failed_at is not None:  # rank 0: when it failed
        failed_at = min(failed_at, coordinator.failed_at)
    life.close_to_form(quick=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    allowed = 0.0  # the time its tries of the candidates so far were allowed to take

    def is_late() -> bool:  # more time went than its tries explain: the others may have counted it lost
        return time.monotonic() - failed_at - allowed > HOST_WINDOW_S

    if life.reforming == "grow()":  # its grow() did not finish: the grown group formed without it
        raise LeftOutError(f"old rank {old_rank}: its grow() did not finish here (interrupted, or out "
                           f"of time: it withdrew from the grown group), so the others formed the grown "
                           f"group without it")
    late = is_late()
    candidates = [r for r in range(old_size) if r not in lost]
    tried: list[str] = []
    reach_more = 0.0  # it could not host: a later candidate tries it meanwhile, and hosts only after

    def at(candidate: int) -> Config:  # old rank 0 where the group was, another where rank 0 saw it
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
            expected = frozenset(r for r in candidates if r not in dead)  # a lower one may yet come
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
            # lost too, another program's port, or no route to it
            if candidate == 0 and getattr(exc, "refused", False):
                dead.add(candidate)  # nobody listens where its coordinator did
            tried.append(f"old rank {candidate}: {exc}")
    if late:
        raise LeftOutError(f"old rank {old_rank} came to shrink {time.monotonic() - failed_at:.1f} s "
                           f"after its group failed, too late to host the survivors' group, and found "
                           f"none that would take it: the others may have gone on without it"
                           + "".join(f"; {t}" for t in tried))
    raise CollectiveTimeoutError(f"old rank {old_rank} could not shrink within {timeout} s: "
                                 + "; ".join(tried))


def died(ranks: set[int], addresses: list[str], config: Config) -> set[int]:
    """Of ``ranks``, those whose host refuses a TCP connection at the rank's form port at once
    (one cut off does not answer within :data:`FORM_PROBE_S`, and is not counted dead)."""
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


MAX_DEATH_PROBES = 64  # lost ranks' hosts a shrink probes at most (each may cost FORM_PROBE_S)


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
    """The part behind Group's shrink, grow, agree, coordinator_address, old_ranks and
    lost_ranks; ``form`` makes a group of a life, ``part`` is a group's part."""

    def __init__(self, group: G, calls: Calls, form: Callable[[Lifecycle], G],
                 part: Callable[[G], Elastic[G]]) -> None:
        self.group, self.calls, self.life, self.form, self.part = group, calls, calls.life, form, part


    def shrink(self, timeout: Optional[float] = None, *, majority: bool = True) -> G:
        """After a loss, the survivors' new group in the same processes: call it on every survivor (README,
        "Elastic groups"). This group closes; the new one ranks the survivors densely in old-rank order
        (:attr:`old_ranks`). If rank 0 was lost, the lowest survivor ``r`` hosts the coordinator at the
        master port + ``r``. They form a group only if more than half of the ranks not seen to die
        (``majority=False``: whoever came). With nobody lost it is a collective call returning this group.
        (:func:`~zcollective.shrink` returns None: the new group becomes the default.)

        Raises
        ------
        LeftOutError
            The others formed their group without this replica (it came too late, or they had counted it
            lost).
        CollectiveTimeoutError
            No group could be formed within ``timeout``.
        CallMismatchError
            Called in a group that had lost nobody, while another rank made another call: a healthy group
            shrinks only when every rank calls it.
        CollectiveError
            The group had failed for another reason than a loss (a mismatch, ...): that error, as every
            later call of it raises.
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
        """Admit every newcomer waiting (started with ``join=True`` at this group's coordinator address): a
        collective call. With nobody waiting, returns this group unchanged; otherwise it closes and the next
        one forms at the same address, members keeping their ranks, newcomers numbered after them
        (:attr:`admitted` counts them). A member lost meanwhile: the others shrink instead and ``admitted``
        is 0. (:func:`~zcollective.grow` returns the count, and makes the new group the default.)

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
        """``host:port`` of this group's coordinator, where newcomers go (it moves if rank 0 is lost)."""
        return self.life.coordinator_address()

    def agree(self, flag: bool, timeout: Optional[float] = None) -> tuple[G, Agreement]:
        """ULFM's agree: every living member gets the same AND of the members' ``flag`` and the
        same set of ranks found lost. In a failed group the survivors shrink first: returns the
        group they agreed in and the :class:`~zcollective.Agreement`. (:func:`~zcollective.agree`
        returns the agreement only, and makes that group the default.)

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
        """In a group formed by :meth:`shrink` or :meth:`grow`: each rank's rank in the group
        before (a newcomer's: from the old size on); None for any other group."""
        return self.life.member.old_ranks

    def lost_ranks(self) -> list[int]:
        """The ranks of the group before (:attr:`old_ranks`) not in this one; ``[]`` otherwise."""
        old = self.life.member.old_ranks
        return [] if old is None else sorted(set(range(self.life.member.old_size)) - set(old))


def regroup(life: Lifecycle, newcomers: int) -> Lifecycle:
    """A grow() admitted ``newcomers``: this group closes, and its members and the newcomers form the next
    one where it was (rule 9), rank 0 hosting. Rank 0 holds interrupts back until the group formed (at
    most the forming bound: the others wait for it alone), a member until its JOIN went (then, at its wait
    for the host, it takes the JOIN back): either comes again once grow() returned or raises."""
    config, member = life.config, life.member
    lineage, size = f"{member.session:x}", config.num_replicas + newcomers
    if config.rank == 0:
        with _interrupts.deferring():
            return _host(life, lineage, size)
    with _interrupts.deferring():
        life.close_to_form(quick=False)
    try:
        return Lifecycle(dataclasses.replace(config, num_replicas=size),
                         Form(lineage, wait_s=GROW_FORM_WAIT_S))  # (its host may wait that long)
    except (Unreachable, CollectiveTimeoutError) as exc:  # rank 0 lost as it formed: as any loss
        member.fail(lost_rank_0(ReplicaLostError(
            f"rank {config.rank}: the coordinator (rank 0) was lost while the group formed again "
            f"after a grow(): {exc}")))
        life.reforming = "shrink()"  # (not a grow's that went on without it: a loss)
        return shrink(life, None)


def _host(life: Lifecycle, lineage: str, size: int) -> Lifecycle:
    """Rank 0 forms the grown group; a member that withdrew its JOIN at this group's coordinator (the
    earlier one, still closing) is counted gone, as one that withdrew at the new one."""
    from ._protocol._coordinator import Forming  # (loaded by a host only, as in _lifecycle)

    config = life.config
    life.close_to_form(quick=False)
    coordinator = life.coordinator()
    withdrew = frozenset(coordinator.joining.withdrawn_ranks) if coordinator is not None else frozenset()
    forming = Forming(lineage, frozenset(range(size)), size, withdrew, voters=config.num_replicas)
    try:
        return Lifecycle(dataclasses.replace(config, num_replicas=size),
                         Form(lineage, forming, quorum_s=GROW_FORM_WAIT_S))
    except Overslept as exc:  # stopped while the others waited: they may have gone on
        raise LeftOutError(f"rank 0: {exc}; the others may have gone on without it") from None
