"""The coordinator's membership: the group starts once every rank joined (WELCOME, with what the group
settles on: parts, MACs, data plane, shared memory, tree), forms from an earlier group's members by majority
(rule 9), and admits newcomers at a GROW (rule 10)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, cast

from .._format import _bodies
from .._format._bodies import error_body
from .._format._mac import HMAC_SHA256, POLY1305
from .._format._wire import Kind, Message, control, join_token
from .._limits import LOCAL_PART_BYTES, WIRE_PART_BYTES
from . import _tree
from ._ops import Outgoing, rank_list
from ._parts import MAX_REFUSAL_BYTES, Forming, Joined, Owner, Phase, is_loopback
from ._stats import Lateness

log = logging.getLogger("zcollective")


class Membership:
    """Starting, forming and growing the group."""

    def __init__(self, co: Owner, data_key: str) -> None:
        self.co = co
        self.data_key = data_key  # data ports' tokens, without a secret
        self.data_ports: Optional[list[str]] = None  # by rank, when the group uses the data plane
        self.shared: Optional[dict[str, Any]] = None  # the WELCOME's shared memory

    def start(self) -> list[Outgoing]:
        """Every member joined (or, forming, the bound passed): WELCOME them."""
        co = self.co
        if co.forming is not None:
            if not self._counted().quorate(co.by_rank):
                return self._no_quorum()
            self._renumber()
        co.phase = Phase.RUNNING
        self._settle()
        co.welcomed = True
        return [(m.peer, self.welcome(m)) for m in co.members.values()]

    def form_now(self, quorate: bool = False) -> list[Outgoing]:
        """The forming bound passed: start with the members that came, if the host's own is among them
        (``quorate``: only if they are enough, else wait on)."""
        co, forming = self.co, self.co.forming
        if forming is None or co.phase is not Phase.JOINING or forming.host_rank not in co.by_rank:
            return []
        if quorate and not self._counted().quorate(co.by_rank):
            return []
        return self.start()

    def missing_joins(self) -> list[int]:
        co = self.co
        if co.forming is None:
            return [r for r in range(co.num_replicas) if r not in co.by_rank]
        gone = co.forming.dead | co.joining.withdrawn_ranks  # (not waited for)
        return [r for r in sorted(co.forming.expected) if r not in co.by_rank and r not in gone]

    def _renumber(self) -> None:
        """Rule 9: the members that came, ranked densely in old-rank order, the host first."""
        co = self.co
        host = co.forming.host_rank if co.forming is not None else 0
        old = sorted(co.by_rank, key=lambda r: (r != host, r))
        members = [co.by_rank[r] for r in old]
        co.num_replicas = len(members)
        co.by_rank = {}
        for rank, member in enumerate(members):
            member.old_rank, member.rank = member.rank, rank
            co.by_rank[rank] = member
        co.old_ranks = old
        co.next_seq = [0] * co.num_replicas
        co.lateness = Lateness(co.num_replicas)

    def _counted(self) -> Forming:
        """The forming, a rank that withdrew its join counted as one seen to die (rule 9): it said it is
        gone, so it is neither partitioned away nor forming elsewhere."""
        forming, withdrawn = self.co.forming, self.co.joining.withdrawn_ranks
        assert forming is not None
        return dataclasses.replace(forming, dead=forming.dead | withdrawn) if withdrawn else forming

    def _no_quorum(self) -> list[Outgoing]:
        """Rule 9: too few came to form the group: each is told it is left out."""
        co, forming = self.co, self.co.forming
        assert forming is not None
        voters = forming.old_size if forming.voters is None else forming.voters
        grown = forming.dead if forming.voters is not None else frozenset()  # (a grow's: withdrawn there)
        withdrew = sorted(r for r in co.joining.withdrawn_ranks | grown if r < voters)
        dead = sorted(r for r in forming.dead if r < voters and r not in withdrew)
        gone = "; ".join(([f"{rank_list(dead)} seen to die"] if dead else [])
                         + ([f"{rank_list(withdrew)} withdrew"] if withdrew else []))
        message = (f"old {rank_list(sorted(co.by_rank))} could not form a group: fewer than half of the "
                   f"{voters} ranks of the group before{f' ({gone})' if gone else ''} came, so the "
                   f"others may be alive and going on (a partition?); shrink(majority=False) goes on anyway")
        members, co.members, co.by_rank = list(co.members.values()), {}, {}
        body = error_body("LeftOutError", message, MAX_REFUSAL_BYTES)
        outs = [(m.peer, control(Kind.REJECT, body, rank=m.rank, session=join_token(m.nonce)))
                for m in members]
        co.fail("LeftOutError", message, level=logging.WARNING)
        return outs

    def left_out(self, join: Joined) -> str:
        co, forming = self.co, self.co.forming
        assert forming is not None
        if co.old_ranks is not None:
            return (f"{join.describe()} was left out: the survivors formed a group of "
                    f"{co.num_replicas} without it (old ranks {','.join(map(str, co.old_ranks))}); "
                    f"it did not come within the bound")
        return (f"{join.describe()} was left out: the survivors counted it as lost (they form "
                f"a group of old ranks {','.join(map(str, sorted(forming.expected)))})")

    def admit(self, seq: int) -> list[Outgoing]:
        """Rule 10: a GROW completed: WELCOME each newcomer in, then close."""
        co = self.co
        newcomers, co.newcomers = list(co.newcomers.values()), {}
        if not newcomers:
            return []
        size, lineage = co.num_replicas + len(newcomers), f"{co.session:x}"
        log.info("zcollective coordinator: seq %d grow: admitting %d newcomers (%s); the group "
                 "of %d forms again here", seq, len(newcomers), ", ".join(n.describe() for n in newcomers),
                 size)
        co.phase = Phase.CLOSED  # its members, and the newcomers, form the next group here
        return [(n.peer, _bodies.welcome(size, n.nonce, None, None, None, 0, None, admitted={
            "rank": co.num_replicas + i, "size": size, "lineage": lineage},
            rank=n.rank, session=join_token(n.nonce))) for i, n in enumerate(newcomers)]

    def dismiss_newcomers(self) -> list[Outgoing]:
        """The group ends for good: every newcomer still parked is told so (rule 10)."""
        newcomers, self.co.newcomers = list(self.co.newcomers.values()), {}
        return [(n.peer, control(Kind.REJECT, error_body(
            "LateJoinError", f"{n.describe()}: the group ended before a grow() admitted it"),
            rank=n.rank, session=join_token(n.nonce))) for n in newcomers]

    def _settle(self) -> None:
        """Every rank joined: what the group uses, from what they all can (parts across hosts, fast MACs)."""
        co = self.co
        members = [co.by_rank[r] for r in range(co.num_replicas)]
        ports = [m.data for m in members]
        one_host = (all(ports) and len({_host_of(p) for p in ports}) == 1) or all(
            is_loopback(m.address) for m in members[1:])
        co.part_bytes = LOCAL_PART_BYTES if one_host else WIRE_PART_BYTES
        co.mac = POLY1305 if all(POLY1305 in m.macs for m in members) else HMAC_SHA256
        if co.signer is not None and co.mac == POLY1305:
            co.signer.fast = True  # every rank can verify the fast tag
        if all(ports) and (members[0].data_mode == "on" or not one_host):
            self.data_ports = cast("list[str]", ports)
        self._settle_shared(members)
        n, mode = co.num_replicas, co.tree_mode
        wanted = mode == "on" or (mode == "auto" and n >= _tree.TREE_MIN_RANKS
                                  and not _oversubscribed(members))
        if wanted and n > 2 and all(m.mail for m in members):  # (the tree's links are the mailboxes')
            co.tree = _tree.shape(n)
            co.climb.down = [0, *co.tree.children[0]]

    def _settle_shared(self, members: list[Joined]) -> None:
        """Rule 12: which ranks share a host's segment (two or more offered it; half the least room they
        reported; across hosts only if every host shares: docs/protocol.md, *Shared memory*)."""
        co = self.co
        keys: dict[tuple[str, str], int] = {}
        found: list[int] = []
        for m in members:
            here = m.rank == 0 or is_loopback(m.address) or m.address == co.host_address
            found.append(keys.setdefault((m.host, "" if here else m.address), len(keys)))
        offered = [all(m.shm is not None for m, h in zip(members, found, strict=True) if h == host)
                   for host in range(len(keys))]
        if members[0].shm is None or not offered[0]:
            return
        if len(keys) > 1 and (self.data_ports is None or not all(offered)
                              or any(found.count(h) < 2 for h in range(len(keys)))):
            return  # several hosts: allreduce's ring between the hosts' leaders needs each to share
        hosts: list[Optional[int]] = [h if offered[h] and found.count(h) > 1 else None for h in found]
        if not any(h is not None for h in hosts):
            return
        room = [min(m.shm[1] for m, h in zip(members, found, strict=True) if h == host and m.shm) // 2
                for host in range(len(keys))]
        if len(keys) > 1:  # one call is one ring between hosts: an array fits every host's segment or none
            per_rank = min(r // found.count(h) for h, r in enumerate(room))
            room = [per_rank * found.count(h) for h in range(len(keys))]
        co.hosts = hosts
        self.shared = _bodies.shared_plan(members[0].shm[0], hosts, room)

    def welcome(self, member: Joined) -> Message:
        """``member``'s WELCOME (rank 0's data threshold for all)."""
        co, n = self.co, self.co.num_replicas
        by_rank = co.by_rank
        addresses = [co.host_address] + [by_rank[r].address for r in range(1, n)]
        renumber, rank = None, member.rank
        if co.old_ranks is not None:  # bound to the rank its JOIN claimed: its old one
            renumber, rank = {"rank": member.rank, "old": co.old_ranks}, cast(int, member.old_rank)
        mail = [by_rank[r].mail for r in range(n)]
        return _bodies.welcome(n, member.nonce, co.part_bytes, co.mac, self.data_ports,
                               by_rank[0].data_min, self.data_key, addresses, renumber, rank=rank,
                               session=co.session, mail=cast("list[str]", mail) if all(mail) else None,
                               shm=self.shared, tree=_tree.TREE_FANOUT if co.tree is not None else None,
                               mail_windows=[by_rank[r].mail_window for r in range(n)],
                               local=[by_rank[r].local for r in range(n)])


def _oversubscribed(members: list[Joined]) -> bool:
    """Does some host run more ranks than it has cores? (Then the star beats the tree.)"""
    ranks: dict[str, int] = {}
    for m in members:  # (by host name: rank 0's own member has no address)
        ranks[m.host] = ranks.get(m.host, 0) + 1
        if ranks[m.host] > m.cores:
            return True
    return False


def _host_of(endpoint: Optional[str]) -> str:
    """``tcp://host:port`` -> ``host``."""
    return (endpoint or "").rpartition(":")[0]
