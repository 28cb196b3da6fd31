"""Where the program's code runs for the rules: a reduction they ask for
(:class:`~.._protocol._ops.Combine`: the coordinator's, or an interior rank's of the
tree), run by the driver where it stands. The rules never unpickle a value nor call
a reduce function; they ask, and take back the results or what was raised.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from typing import Any, Optional

from .._format import _serialize
from .._protocol._ops import Combine, Disagree, Unreadable, UserCode, reduce_name
from .._protocol._ring import reduction_name
from ..errors import SerializationError

ALIKE_TYPES = frozenset({int, float, complex, bool, str, bytes, list, tuple})  # whose + (and max,
# min) group as they like; a Counter's += drops counts below one at each step, so it does not


def run(asked: Combine, user_code: UserCode) -> list[list[Any]]:
    """Each index's result, pickled (the user's code: a function, a result's pickling);
    raises :class:`Unreadable` (nothing ran), :class:`Disagree` (arrays that differ, or a
    subtree's values whose grouping may matter) or what the user's code raised."""
    if asked.fn is None:
        raise ValueError(f"rank {asked.root} sent no reduce function")
    fn = asked.fn if callable(asked.fn) else _unpickled([asked.fn], f"reduce function of rank {asked.root}")
    call, out = user_code(fn), []
    ranks = asked.ranks or range(len(asked.values))
    if asked.names is not None and any(n is not None and n != reduce_name(fn) for n in asked.names):
        mine = reduce_name(fn) or getattr(fn, "__qualname__", "a function of its own")
        raise Disagree([f"a value to reduce with {mine}" if n is None else
                        f"a value reduced with {n} on the way (through the tree every rank must pass "
                        f"rank 0's function)" for n in asked.names])
    for index in range(asked.count):
        values = []
        for r, v in zip(ranks, asked.values, strict=True):
            try:
                values.append(_serialize.loads(v[index], f"value of rank {r}"))
            except SerializationError as exc:
                raise Unreadable(str(exc)) from exc
        if asked.grouped and not summable(values, fn):
            raise Disagree()
        if asked.prefix:  # a scan: each rank's fold of the values up to its own, kept as soon as made
            folded = values[0]  # (the next fold may change it in place, the default a += b: so each
            for value in values[1:]:  # result but the last is a copy, large buffers included)
                out.append([bytes(frame) for frame in _serialize.dumps(folded, "reduction result")])
                folded = call(folded, value)
            out.append(_serialize.dumps(folded, "reduction result"))
            return out
        name = None if type(values[0]) in ALIKE_TYPES else reduction_name(fn)  # (no array: the common call)
        described = described_arrays(values, name) if name is not None else None
        if described is not None and len(set(described)) > 1:  # elementwise: arrays must agree,
            raise Disagree(described)  # as on the data plane (no broadcasting)
        out.append(_serialize.dumps(functools.reduce(call, values), "reduction result"))
    return out


def applied(step: Iterable[Any], at: Any) -> list[Any]:
    """What a driver sends of ``step``, in order: a :class:`Combine` runs where it stands,
    in the driver's thread, before anything else is taken in, and what ``at`` (the
    coordinator, or the tree's relay) then answers takes its place. (A list, not a
    generator: one Python call, where a generator costs one per message.)"""
    sent: list[Any] = []
    for out in step:
        if not isinstance(out, Combine):
            sent.append(out)
            continue
        try:
            results = run(out, at.user_code)
        except BaseException as exc:  # SystemExit from a reduce function too: it is the user's error
            sent.extend(at.combine_failed(out, exc))
        else:
            sent.extend(at.combined(out, results))
    return sent


def answer(member: Any) -> None:
    """Run the reductions the member's relay asked for (its subtree's), in line with what waits
    behind them: each goes up in turn, a reduction's summary (or its parts) in its place."""
    asks = member.asks
    while asks:
        item = asks.popleft()
        if type(item) is Combine:
            asks.extendleft(reversed(applied([item], member.relay)))
        else:
            member.send_now([item])


def _unpickled(segment: list[Any], what: str) -> Any:
    try:
        return _serialize.loads(segment, what)
    except SerializationError as exc:
        raise Unreadable(str(exc)) from exc


def described_arrays(values: list[Any], fn: str) -> Optional[list[str]]:
    """Each value described as a data plan describes an array, when all are arrays
    (numpy's, torch's) and not all scalars; else None (left to the reduce function)."""
    try:  # (attributes read, not a `None in` test: numpy's dtype equals None, meaning float64 to it)
        described = [f"a {getattr(v.dtype, 'str', v.dtype)} array of shape {tuple(int(n) for n in v.shape)} "
                     f"reduced with {fn}" for v in values]
    except (AttributeError, TypeError):  # not arrays (a shape of something else than numbers)
        return None
    return described if any(len(v.shape) for v in values) else None


def summable(values: list[Any], reduce: Any) -> bool:
    """Are these values ones a known function may reduce in any grouping: one type, a builtin
    number or sequence, a numpy array or scalar, a torch tensor (or the function is marked
    :func:`~zcollective.elementwise`, its author's word)?"""
    if getattr(reduce, "__zcollective_elementwise__", False):
        return True
    kind = type(values[0])
    if any(type(v) is not kind for v in values):
        return False
    if kind in ALIKE_TYPES:
        return True
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")  # (a value of theirs imported them)
    if numpy is not None and (kind is numpy.ndarray or issubclass(kind, numpy.generic)):
        return True
    return torch is not None and kind is torch.Tensor
