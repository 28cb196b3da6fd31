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


def dumps(value: Any, what: str = "value") -> list[Any]:
    """Serialize ``value`` to a segment ``[pickle, buffer...]``.

    Raises
    ------
    SerializationError
        ``value`` (or something inside it) cannot be pickled; the message
        names its type.
    """
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
