"""Sub-groups (``split``, ``subgroup``, ``dup``): whole groups formed in the same
processes by three calls of the parent (colors and keys; where each new rank 0
listens; each rank's part opened). See docs/protocol.md, *Sub-groups*."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import operator
import os
from collections.abc import Sequence
from typing import Any, Callable, Generic, Optional, TypeVar

from ._calls import DEFAULT, Calls, Timeout
from ._format._wire import NONCE_BYTES
from ._io._dataplane import local_address
from ._lifecycle import Lifecycle
from ._protocol._ops import Split, in_world, rank_list
from ._protocol._outcomes import fresh
from .config import Config
from .errors import AddressError, CallMismatchError, CollectiveError, CollectiveTimeoutError, ReplicaLostError

JOIN_LIVENESS = 3  # members join within this many liveness bounds (all had sockets open at round 3)
FORMED = "nothing was formed; the group goes on"


def split(calls: Calls, color: Any, key: Any, timeout: Timeout,
          ranks: Optional[Sequence[Any]] = None, what: str = "split") -> Optional[Lifecycle]:
    """This rank's sub-group (None for ``color`` None), formed by three calls of the parent;
    ``ranks``: ``subgroup``'s list; ``what``: split, subgroup or dup. Any rank's mistake fails
    the call alike on every rank, at the round it shows in."""
    config = calls.config
    if ranks is not None and not isinstance(ranks, Sequence):
        ranks = list(ranks)  # (a generator: read once, here)
    rounds = _Rounds(calls, timeout, what)
    said = (color, key, ranks, _problem(color, key, ranks, config.num_replicas))
    rounds.everyone = everyone = rounds.run(said)
    _check(everyone, what, ranks is not None)
    members = _members(everyone, config.rank)
    if members and len(members) > 1 and members[0] == config.rank:
        return _host(rounds, config, members, timeout)
    told = rounds.tell(None)  # where each new group's rank 0 listens
    if not members or len(members) == 1:  # (a group of one: no port, no coordinator to reach)
        rounds.opened(None)
        if not members:
            return None
        return _opened(rounds, _config(config, members, 0, "", 0, os.urandom(NONCE_BYTES), timeout), members)
    address, nonce = told[members[0]]
    host, _, port = address.rpartition(":")
    sub = _config(config, members, members.index(config.rank), host.strip("[]"), int(port), nonce, timeout)
    try:
        return _opened(rounds, sub, members, lambda _: rounds.opened(None))
    except BaseException as exc:
        rounds.failed(exc)
        raise


G = TypeVar("G")


class SubGroups(Generic[G]):
    """The part behind Group's split, subgroup, dup and parent_ranks; ``form`` makes a group of a life."""

    def __init__(self, calls: Calls, form: Callable[[Lifecycle], G]) -> None:
        self.calls, self.form = calls, form


    def split(self, color: Any, key: int = 0, *, timeout: Timeout = DEFAULT) -> Optional[G]:
        """A collective call: every rank with the same ``color`` (any hashable value, equal as
        dict keys are) ends in one new group, ranked by ``key`` then by rank here;
        ``color=None`` takes part and gets ``None``.

        A sub-group is a whole group in the same processes, with its own sequence (its calls
        and this group's interleave freely), coordinator (its rank 0, on a port the system
        chooses) and secret. A lost process fails only the groups it is in.
        :attr:`parent_ranks` says who is who. Close it with :meth:`teardown`.

        Raises
        ------
        ValueError
            A rank passed a key that is not an int or an unhashable color (on every rank; the
            group goes on).
        AddressError
            A new group's rank 0 could not listen (on every rank; the group goes on).
        CollectiveError
            A rank could not open its part of its new group (on every rank, naming it; the
            group goes on); otherwise as for any collective call.
        CallMismatchError
            Another rank called something else: this group fails.
        """
        life = split(self.calls, color, key, timeout)
        return None if life is None else self.form(life)

    def subgroup(self, ranks: Sequence[int], *, timeout: Timeout = DEFAULT) -> Optional[G]:
        """A collective call: the ranks listed form a new group in the list's order; every rank
        passes the same list, and those not in it get ``None``. Otherwise as :meth:`split`.

        Raises
        ------
        CallMismatchError
            The ranks passed different lists (on every rank; the group goes on).
        ValueError
            The list names a rank twice, none, or one outside the group.
        """
        life = split(self.calls, None, 0, timeout, ranks, "subgroup")
        return None if life is None else self.form(life)

    def dup(self, *, timeout: Timeout = DEFAULT) -> G:
        """A collective call: a new group of the same ranks in the same order, whose calls
        never mix with this one's. As :meth:`split`."""
        life = split(self.calls, None, 0, timeout, range(self.calls.config.num_replicas), "dup")
        assert life is not None
        return self.form(life)

    def parent_ranks(self) -> Optional[list[int]]:
        """A sub-group's: ``parent_ranks[i]`` is rank i's rank in the parent; None otherwise."""
        return self.calls.life.parent_ranks


def _host(rounds: _Rounds, config: Config, members: list[int], timeout: Timeout) -> Lifecycle:
    """Rank 0 of a new group: listen, say where (round 2; or why it cannot), hear every part
    opened (round 3), then wait for its members."""
    nonce = os.urandom(NONCE_BYTES)  # names the sub-group (its job); under a secret, makes its secret

    def opened(address: str) -> None:
        rounds.tell((address, nonce))
        rounds.opened(None)
    try:
        here = local_address(config).strip("[]")  # the interface this host reaches the parent's rank 0 by
        return _opened(rounds, _config(config, members, 0, here, 0, nonce, timeout), members, opened)
    except BaseException as exc:
        rounds.failed(exc)
        raise


class _Rounds:
    """The parent's three rounds of one split (op 13). A rank that failed says why in its next
    round, so every rank raises alike there, and the parent goes on."""

    def __init__(self, calls: Calls, timeout: Timeout, what: str) -> None:
        self.calls, self.timeout, self.what = calls, timeout, what
        self.kind = Split.KINDS.index(what)
        self.made = 0  # the rounds begun
        self.everyone: list[tuple[Any, Any, Any, Optional[str]]] = []  # the first round's
        self.told: Optional[list[Any]] = None  # the second round's
        self.over = False  # a round said a rank failed: every rank raised, and makes no more

    def run(self, value: Any) -> Any:
        self.made += 1
        return self.calls.run("split", self.timeout, value, self.kind)

    def tell(self, where: Optional[tuple[Any, Any]]) -> list[Any]:
        """Round 2: ``(address, nonce)`` from a new rank 0, ``(None, (error, why))``, or None."""
        self.told = told = self.run(where)
        failed = [(r, t[1]) for r, t in enumerate(told) if t is not None and t[0] is None]
        if failed:
            self.over = True
            rank, (error, why) = failed[0]
            raise _alike(error, f"{self.what}: {self._rank(rank)} could not open the new group of "
                                f"{self._group(rank)} it was to host: {why} ({FORMED})")
        return told

    def opened(self, why: Optional[tuple[str, str]]) -> None:
        """Round 3: None (its part is open, or it has none), or ``(error, why)``."""
        failed = [(r, w) for r, w in enumerate(self.run(why)) if w is not None]
        if failed:
            self.over = True
            (rank, (error, text)), more = failed[0], len(failed) - 1
            others = f" (and {more} other rank{'s' if more > 1 else ''})" if more else ""
            raise _alike(error, f"{self.what}: {self._rank(rank)}{others} could not open its part of the "
                                f"new group of {self._group(rank)}: {text} ({FORMED})")

    def _rank(self, rank: int) -> str:
        return f"rank {rank}{in_world([rank], self.calls.life.world)}"

    def _group(self, rank: int) -> str:
        return rank_list(_members(self.everyone, rank) or [rank], self.calls.life.world)

    def failed(self, exc: BaseException) -> None:
        """This rank could not open its new group: its next round says so (an interrupt makes
        it without waiting)."""
        if self.over or self.made == 3 or (self.made == 2 and self.told is None):
            return  # said, or failed after its part was open (the sub-group's own rules)
        said = str(exc) if isinstance(exc, CollectiveError) else f"{type(exc).__name__}: {exc}"
        why = (type(exc).__name__, said)
        value = (None, why) if self.made == 1 else why
        if not isinstance(exc, Exception):
            with contextlib.suppress(Exception):
                self.calls.call("split", value, self.kind)  # (its result is never waited for)
            return
        if self.made == 1:
            self.tell(value)  # type: ignore[arg-type]
        self.opened(why)


def _alike(error: str, message: str) -> CollectiveError:
    return AddressError(message) if error == "AddressError" else CollectiveError(message)


def _opened(rounds: _Rounds, config: Config, members: list[int],
            opened: Optional[Callable[[str], None]] = None) -> Lifecycle:
    """Join the sub-group; if it does not form and the parent fails, the parent's error."""
    calls = rounds.calls
    parent = calls.life
    world = [parent.world[m] for m in members] if parent.world is not None else members
    def parent_failed() -> None:  # (its members are the parent's: a loss there fails this join)
        failure = calls.failure_within(0.0)
        if failure is not None:
            raise fresh(failure)

    try:
        life = Lifecycle(config, nested=True, opened=opened, world=world, check=parent_failed)
    except (CollectiveTimeoutError, ReplicaLostError) as exc:
        if not rounds.over:
            wait = 0.0 if isinstance(exc, CollectiveTimeoutError) else calls.config.liveness_timeout or 0.0
            failure = calls.failure_within(wait)
            if failure is not None:
                raise fresh(failure) from None
        raise
    life.parent_ranks = members
    life.parent = parent
    return life


def _config(parent: Config, members: list[int], rank: int, host: str, port: int, nonce: bytes,
            timeout: Timeout) -> Config:
    """The parent's configuration at the sub-group's address, with its own job name and secret."""
    secret = None if parent.secret is None else hmac.new(
        parent.secret, b"zcollective sub-group " + nonce, hashlib.sha256).digest()
    bound = timeout if isinstance(timeout, (int, float)) else JOIN_LIVENESS * parent.liveness_timeout
    return dataclasses.replace(
        parent, master_addr=host or parent.master_addr, master_port=port, rank=rank,
        num_replicas=len(members), secret=secret, bind_addr=None, join=False, port_given=len(members) > 1,
        job=f"{parent.job or 'group'}/sub-{nonce.hex()[:12]}", init_timeout=bound)


def _problem(color: Any, key: Any, ranks: Optional[Sequence[Any]], size: int) -> Optional[str]:
    """What is wrong with this rank's arguments (said to every rank), or None."""
    try:
        operator.index(key)
        if isinstance(key, bool):
            raise TypeError
    except TypeError:
        return f"key must be an int, not {type(key).__name__}"
    try:
        hash(color)
    except TypeError:
        return f"color must be hashable (an int, a string, ...), not {type(color).__name__}"
    if color != color:  # (NaN: no rank's color would ever be its own)
        return f"color must equal itself, not {color!r}"
    if ranks is None:
        return None
    try:
        listed = [operator.index(r) for r in ranks]
    except TypeError:
        return f"ranks must be a sequence of ints, not {ranks!r}"
    outside = [r for r in listed if not 0 <= r < size]
    if outside:
        return f"ranks {outside} are not ranks of this group of {size} replicas"
    if len(set(listed)) != len(listed) or not listed:
        return f"ranks must list each rank once, and at least one: got {listed}"
    return None


def _check(everyone: list[tuple[Any, Any, Any, Optional[str]]], what: str, listed: bool) -> None:
    """Every rank's arguments as every rank sees them: a mistake fails the call alike everywhere."""
    problems = [f"rank {r}: {p}" for r, (_, _, _, p) in enumerate(everyone) if p is not None]
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems) + " (nothing was formed; the group goes on)")
    if listed:
        lists: dict[str, list[int]] = {}
        for r, (_, _, ranks, _) in enumerate(everyone):
            lists.setdefault(repr([operator.index(x) for x in ranks]), []).append(r)
        if len(lists) > 1:
            raise CallMismatchError(
                "subgroup: the ranks passed different lists: " + "; ".join(
                    f"{rank_list(rs)} passed {text}" for text, rs in lists.items())
                + " (nothing was formed; the group goes on)")


def _members(everyone: list[tuple[Any, Any, Any, Optional[str]]], rank: int) -> Optional[list[int]]:
    """The parent ranks of this rank's new group in order: by key then rank, or as listed."""
    color, _, ranks, _ = everyone[rank]
    if ranks is not None:
        listed = [operator.index(r) for r in ranks]
        return listed if rank in listed else None
    if color is None:
        return None
    same = [r for r, (c, _, _, _) in enumerate(everyone) if c is not None and c == color]
    return sorted(same, key=lambda r: (operator.index(everyone[r][1]), r))
