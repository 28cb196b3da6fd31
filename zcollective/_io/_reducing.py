"""Where the program's elementwise reduce function runs off the star: the rules' data-plane jobs
(:mod:`zcollective._protocol._ring`, :mod:`~zcollective._protocol._shm`) are handed a reducer made
here (:attr:`~zcollective._protocol._ops_types.Here.reducer`) and say when and on what to reduce;
they never call a function of the program's own themselves. (The star's reductions run in
:mod:`._combine`.)
"""

from __future__ import annotations

from typing import Any, Callable

Reducer = Callable[[Any, Any, Any], None]  # reduce(dst, acc, mine): dst[:] = fn(acc, mine)


def elementwise(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Mark ``fn(a, b)`` as elementwise: ``result[i]`` depends only on ``a[i]`` and ``b[i]``. Large numeric
    arrays reduced with it then travel between replicas directly (see the README's "The data plane"), each
    replica applying its own ``fn``, so it must be the same function everywhere. ``fn`` may update ``a`` in
    place and return it."""
    fn.__zcollective_elementwise__ = True  # type: ignore[attr-defined]
    return fn


def reducer(name: str, fn: Callable[[Any, Any], Any]) -> Reducer:
    """``reduce(dst, acc, mine)``: ``dst[:] = fn(acc, mine)``; ``acc`` came round the ring (read-only).
    ``name``: the data plane's name of ``fn`` (:func:`~zcollective._protocol._ring.reduction_name`):
    numpy's own function for the names it knows, else ``fn`` itself (marked :func:`elementwise`)."""
    import numpy
    ufunc = {"add": numpy.add, "maximum": numpy.maximum, "minimum": numpy.minimum,
             "multiply": numpy.multiply}.get(name)
    if ufunc is not None:
        def by_ufunc(dst: Any, acc: Any, mine: Any) -> None:
            ufunc(acc, mine, out=dst)
        return by_ufunc

    def by_fn(dst: Any, acc: Any, mine: Any) -> None:
        numpy.copyto(dst, acc)
        out = fn(dst, mine)
        if out is not dst:
            dst[...] = out
    return by_fn
