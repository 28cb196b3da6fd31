"""cloudpickle protocol 5 with out-of-band buffers, to and from frames.

A serialized value is a *segment*: the pickle stream, then one frame per large
contiguous buffer (numpy arrays, PickleBuffer-aware types), so large data is
never copied into the pickle. Knows nothing of sockets.
"""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle

from .errors import SerializationError

PROTOCOL = 5  # the first protocol with out-of-band buffers
INBAND_MAX_BYTES = 1 << 16  # smaller buffers cost less to copy than a frame of their own
# Builtin scalars pickle identically with the standard pickler, ten times faster
# than constructing a CloudPickler; anything else may hold a function or class.
PLAIN_TYPES = frozenset({int, float, bool, str, bytes, type(None), complex})
MAX_CACHED_FUNCTIONS = 256  # importable reduce functions whose pickles are kept
_by_reference: dict[Any, bytes] = {}


def dumps(value: Any, what: str = "value") -> list[Any]:
    """Serialize ``value`` to a segment ``[pickle, buffer...]``.

    Raises
    ------
    SerializationError
        ``value`` (or something inside it) cannot be pickled; the message
        names its type.
    """
    if type(value) in PLAIN_TYPES:
        return [pickle.dumps(value, PROTOCOL)]
    buffers: list[Any] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < INBAND_MAX_BYTES:
            return True  # pickle it in-band
        buffers.append(raw)
        return False

    try:
        stream = cloudpickle.dumps(value, protocol=PROTOCOL, buffer_callback=keep)
    except Exception as exc:
        raise SerializationError(
            f"cannot serialize the {what} of type {type(value).__module__}."
            f"{type(value).__qualname__}: {type(exc).__name__}: {exc}"
        ) from exc
    return [stream, *buffers]


def dumps_function(fn: Any) -> bytes:
    """Pickle a reduce function. A module-level function of an importable
    module pickles as a reference (the same bytes every time), so its pickle
    is kept; lambdas, closures and ``__main__`` functions travel by value and
    are pickled at each call, as their state may change."""
    try:
        return _by_reference[fn]
    except (KeyError, TypeError):
        pass
    try:  # in-band: the function travels as one frame, with any arrays it captured
        data = cloudpickle.dumps(fn, protocol=PROTOCOL)
    except Exception as exc:
        raise SerializationError(f"cannot serialize the reduce function {fn!r}: "
                                 f"{type(exc).__name__}: {exc}") from exc
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if (module not in (None, "__main__") and "<" not in qualname and len(_by_reference) < MAX_CACHED_FUNCTIONS
            and not getattr(fn, "__closure__", None)):
        try:
            if pickle.loads(pickle.dumps(fn, PROTOCOL)) is fn:  # truly importable by reference
                _by_reference[fn] = data
        except Exception:
            pass
    return data


def loads(segment: list[Any], what: str = "value") -> Any:
    """Rebuild a value from a segment; buffers are used in place, not copied.

    Raises
    ------
    SerializationError
        The pickle could not be loaded (for instance a class that does not
        exist on this replica).
    """
    try:
        return pickle.loads(segment[0], buffers=segment[1:])
    except Exception as exc:
        raise SerializationError(f"cannot deserialize the {what}: {type(exc).__name__}: {exc}") from exc
