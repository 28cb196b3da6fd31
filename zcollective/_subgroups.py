"""Sub-groups: :meth:`~zcollective.Group.split`, ``subgroup`` and ``dup``.

A sub-group is a whole group of its own, formed in the same processes from
two calls of its parent: every rank says its color and key, then the new
groups' ranks 0 say where they listen (a port the system chose). Its
coordinator, sequence, data plane and failures are its own: see
docs/protocol.md, *Sub-groups*.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import operator
import os
from collections.abc import Sequence
from typing import Any, Optional

from ._calls import Calls, Timeout
from ._io._dataplane import local_address
from ._lifecycle import Lifecycle
from ._protocol._ops import rank_list
from .config import Config
from .errors import AddressError, CallMismatchError

NONCE_BYTES = 16  # names a sub-group (its job) and, under a secret, makes its own secret


def split(calls: Calls, color: Any, key: Any, timeout: Timeout,
          ranks: Optional[Sequence[Any]] = None) -> Optional[Lifecycle]:
    """This rank's sub-group (None for ``color`` None), formed by two calls of
    the group ``calls`` makes; ``ranks``: ``subgroup``'s list, which every
    rank must pass alike. A mistake in any rank's arguments fails the call
    alike on every rank, after the first round (so nobody waits for it)."""
    config = calls.config
    said = (color, key, ranks, _problem(color, key, ranks, config.num_replicas))
    everyone: list[tuple[Any, Any, Any, Optional[str]]] = calls.run("split", timeout, said)
    what = "subgroup" if ranks is not None else "split"
    _check(everyone, what, ranks is not None)
    members = _members(everyone, config.rank)
    if members and len(members) > 1 and members[0] == config.rank:
        return _host(calls, config, members, timeout)
    told = calls.run("split", timeout, None)  # where each new group's rank 0 listens
    if not members:
        return None
    if len(members) == 1:  # a group of one: no port, no coordinator to reach
        return _opened(_config(config, members, 0, "", 0, os.urandom(NONCE_BYTES)), members)
    address, nonce = told[members[0]]
    if address is None:
        raise AddressError(f"{what}: rank {members[0]}, rank 0 of the new group of ranks "
                           f"{','.join(map(str, members))}, could not open it: {nonce}")
    host, _, port = address.rpartition(":")
    return _opened(_config(config, members, members.index(config.rank), host.strip("[]"), int(port), nonce),
                   members)


def _host(calls: Calls, config: Config, members: list[int], timeout: Timeout) -> Lifecycle:
    """Rank 0 of a new group: listen, say where (the second round), then wait
    for its members. If it cannot listen, the second round says why, so its
    members raise too instead of waiting."""
    nonce = os.urandom(NONCE_BYTES)
    published = False

    def publish(address: str) -> None:
        nonlocal published
        published = True
        calls.run("split", timeout, (address, nonce))
    here = local_address(config).strip("[]")  # the interface this host reaches the group's rank 0 by
    try:
        return _opened(_config(config, members, 0, here, 0, nonce), members, publish)
    except BaseException as exc:
        if not published:
            calls.run("split", timeout, (None, f"{type(exc).__name__}: {exc}"))
        raise


def _opened(config: Config, members: list[int], publish: Any = None) -> Lifecycle:
    life = Lifecycle(config, nested=True, publish=publish)
    life.parent_ranks = members
    return life


def _config(parent: Config, members: list[int], rank: int, host: str, port: int, nonce: bytes) -> Config:
    """The sub-group's configuration: the parent's, at its own address, with a
    job name of its own and, under a secret, a secret of its own."""
    secret = None if parent.secret is None else hmac.new(
        parent.secret, b"zcollective sub-group " + nonce, hashlib.sha256).digest()
    return dataclasses.replace(
        parent, master_addr=host or parent.master_addr, master_port=port, rank=rank,
        num_replicas=len(members), secret=secret, bind_addr=None, join=False, port_given=len(members) > 1,
        job=f"{parent.job or 'group'}/sub-{nonce.hex()[:12]}")


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
    """Every rank's arguments as every rank sees them: a mistake fails the
    call alike everywhere."""
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
    """The ranks (of the parent) of this rank's new group, in their new order:
    by key, then by parent rank; a listed subgroup's in its list's order."""
    color, _, ranks, _ = everyone[rank]
    if ranks is not None:
        listed = [operator.index(r) for r in ranks]
        return listed if rank in listed else None
    if color is None:
        return None
    same = [r for r, (c, _, _, _) in enumerate(everyone) if c is not None and c == color]
    return sorted(same, key=lambda r: (operator.index(everyone[r][1]), r))
