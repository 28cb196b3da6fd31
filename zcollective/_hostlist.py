"""Slurm's compressed host lists (``gpu[01-04,07],cpu3``) to host names, as Slurm's ``hostlist.c`` reads
them: bracket groups of numbers and ranges ``lo-hi``, zero-padded to ``lo``'s width, the first group
varying slowest. Anything else (unclosed or nested brackets, reversed ranges) is a ``ValueError``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Union

SEPARATORS = ", \t"  # Slurm's own: hostlist_create() splits on "\t, "
MAX_HOSTS = 1 << 20  # more nodes than any cluster has: a longer list is a typo (a[0-99999999])

_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # ASCII digits only: \d also matches other scripts' digits


@dataclass(frozen=True)
class _Numbers:
    """One bracket group: ranges of numbers, each written zero-padded to its width."""

    ranges: tuple[tuple[int, int, int], ...]  # (lo, hi, width)

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi, _ in self.ranges)

    def __iter__(self) -> Iterator[str]:
        for lo, hi, width in self.ranges:
            for n in range(lo, hi + 1):
                yield str(n).zfill(width)


Part = Union[tuple[str], _Numbers]  # the choices at one place of a host name: ("gpu",) or numbers


def _split(hostlist: str) -> Iterator[tuple[int, str]]:
    """Each host expression with its position: separators split, except inside brackets."""
    start, depth = 0, 0
    for i, c in enumerate(hostlist):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c in SEPARATORS and depth <= 0:
            if i > start:
                yield start, hostlist[start:i]
            start, depth = i + 1, 0
    if start < len(hostlist):
        yield start, hostlist[start:]


def _numbers(group: str, at: int) -> _Numbers:
    """``01-03,7`` -> 01, 02, 03, 7."""
    if not group:
        raise ValueError(f"the brackets at position {at} are empty")
    ranges = []
    for item in group.split(","):
        match = _ITEM.fullmatch(item)
        if not match:
            what = "an empty item" if not item else f"{item!r}, which is not a number or a range lo-hi"
            raise ValueError(f"the brackets at position {at} hold {what}")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(lo) > int(hi):
            raise ValueError(f"the range {item!r} at position {at} runs backwards")
        ranges.append((int(lo), int(hi), len(lo)))
    return _Numbers(tuple(ranges))


def _parts(expr: str, at: int) -> list[Part]:
    """``node[1-2]-ib`` -> ("node",), 1 and 2, ("-ib",)."""
    parts: list[Part] = []
    rest, offset = expr, at
    while rest:
        opened, closed = rest.find("["), rest.find("]")
        if opened < 0 and closed < 0:
            parts.append((rest,))
            break
        if closed >= 0 and (opened < 0 or closed < opened):
            raise ValueError(f"']' at position {offset + closed} closes no '['")
        end = rest.find("]", opened)
        if end < 0:
            raise ValueError(f"'[' at position {offset + opened} is never closed")
        inner = rest[opened + 1:end]
        if "[" in inner:
            raise ValueError(f"'[' at position {offset + opened + 1 + inner.index('[')} is inside "
                             f"another pair of brackets")
        if opened:
            parts.append((rest[:opened],))
        parts.append(_numbers(inner, offset + opened))
        rest, offset = rest[end + 1:], offset + end + 1
    return parts


def _parse(hostlist: str) -> list[list[Part]]:
    if not isinstance(hostlist, str):
        raise ValueError(f"a host list is a string, not {type(hostlist).__name__}")
    exprs = [_parts(expr, at) for at, expr in _split(hostlist)]
    if not exprs:
        raise ValueError("it names no host")
    total = sum(math.prod(len(part) for part in parts) for parts in exprs)
    if total > MAX_HOSTS:
        raise ValueError(f"it names {total} hosts, more than {MAX_HOSTS}")
    return exprs


def _names(parts: Sequence[Part], prefix: str = "") -> Iterator[str]:
    if not parts:
        yield prefix
        return
    for choice in parts[0]:
        yield from _names(parts[1:], prefix + choice)


def expand(hostlist: str) -> list[str]:
    """Every host name of a Slurm host list: ``"a[1-2],b"`` -> ``["a1", "a2", "b"]``."""
    return [name for parts in _parse(hostlist) for name in _names(parts)]


def first_host(hostlist: str) -> str:
    """The first host name of a Slurm host list (task 0's), once the whole list is checked."""
    return next(_names(_parse(hostlist)[0]))
