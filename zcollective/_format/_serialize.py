"""cloudpickle protocol 5 with out-of-band buffers, to and from frames. A value is a *segment*:
the pickle, then one frame per large contiguous buffer (numpy arrays, CPU tensors), never copied
into the pickle. Knows nothing of sockets; imports torch only to rebuild a tensor sent."""

from __future__ import annotations

import importlib
import io
import pickle
import sys
import types
from typing import Any, Callable

import cloudpickle

from ..errors import SerializationError

PROTOCOL = 5  # the first protocol with out-of-band buffers
INBAND_MAX_BYTES = 1 << 16  # smaller buffers cost less to copy than a frame of their own
PLAIN_TYPES = frozenset({int, float, bool, str, bytes, type(None), complex})  # pickle's own pickler
# takes these ten times faster than a CloudPickler is made; anything else may hold a function
CONTAINER_TYPES = (dict, list, tuple)  # ... and these of them (exactly these types, not subclasses)
PLAIN_MAX_ITEMS = 64  # a container looked through item by item: small ones (a larger one's walk
# would cost more than the CloudPickler it saves)
MAX_CACHED_FUNCTIONS = 256  # importable reduce functions whose pickles are kept
_by_reference: dict[Any, bytes] = {}


def dumps(value: Any, what: str = "value") -> list[Any]:
    """Serialize ``value`` to a segment ``[pickle, buffer...]``; raise
    SerializationError naming its type if it (or something in it) cannot be pickled."""
    kind = type(value)
    if kind in PLAIN_TYPES or (kind is dict and len(value) <= PLAIN_MAX_ITEMS // 2 and PLAIN_TYPES.issuperset(
            map(type, value.keys())) and PLAIN_TYPES.issuperset(map(type, value.values()))) or (
            kind in CONTAINER_TYPES and _plain(value, [PLAIN_MAX_ITEMS])):  # (a flat dict: _plain's, inline)
        return [pickle.dumps(value, PROTOCOL)]
    buffers: list[Any] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < INBAND_MAX_BYTES:
            return True  # pickle it in-band
        buffers.append(raw)
        return False

    try:
        stream = _pickle(value, keep)
    except Exception as exc:
        raise SerializationError(
            f"cannot serialize the {what} of type {type(value).__module__}."
            f"{type(value).__qualname__}: {type(exc).__name__}: {exc}"
        ) from exc
    return [stream, *buffers]


def _plain(value: Any, budget: list[int]) -> bool:
    """Is ``value`` :data:`PLAIN_TYPES` all the way down, through at most ``budget[0]`` items of
    dicts, lists and tuples (spent as it goes)? A flat container costs this one call."""
    kind = type(value)
    if kind in PLAIN_TYPES:
        return True
    if kind is dict:
        budget[0] -= 2 * len(value)
        keys, values = value.keys(), value.values()
        return budget[0] >= 0 and (
            (PLAIN_TYPES.issuperset(map(type, keys)) or all(_plain(x, budget) for x in keys))
            and (PLAIN_TYPES.issuperset(map(type, values)) or all(_plain(x, budget) for x in values)))
    if kind is list or kind is tuple:
        budget[0] -= len(value)
        return budget[0] >= 0 and (PLAIN_TYPES.issuperset(map(type, value))
                                   or all(_plain(x, budget) for x in value))
    return False


def dumps_function(fn: Any) -> bytes:
    """Pickle a reduce function; an importable module-level one's pickle (a reference) is kept,
    lambdas, closures and ``__main__`` functions are pickled at each call (their state may change)."""
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


def as_is(fn: Any) -> bool:
    """May rank 0 hand ``fn`` to its coordinator as it is, not pickled? Only when the two cannot
    differ (docs/protocol.md, *Frames*): a lambda made in a loop keeps the loop's value of its call."""
    try:
        if fn in _by_reference:
            return True
    except TypeError:  # an unhashable callable: never kept there
        return False
    if type(fn) is not types.FunctionType:
        return False
    if fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__ or fn.__dict__:
        return False
    code = fn.__code__  # (_stateless's test, written out: one call less on rank 0's every call)
    if code.co_names:
        return False
    for const in code.co_consts:  # noqa: SIM110 (all() would cost a generator call)
        if type(const) is types.CodeType and not _stateless(const):
            return False
    return True


def _stateless(code: types.CodeType) -> bool:
    """No names looked up (globals, builtins, attributes), here or in code nested in it (a
    comprehension's cells are the function's own, made at each call)."""
    if code.co_names:
        return False
    for const in code.co_consts:  # noqa: SIM110
        if type(const) is types.CodeType and not _stateless(const):
            return False
    return True


def loads(segment: list[Any], what: str = "value") -> Any:
    """Rebuild a value from a segment, its buffers used in place; raise
    SerializationError if it cannot be loaded (a class this replica lacks)."""
    try:
        return pickle.loads(segment[0], buffers=segment[1:])
    except Exception as exc:
        raise SerializationError(f"cannot deserialize the {what}: {type(exc).__name__}: {exc}") from exc


def _pickle(value: Any, keep: Callable[[pickle.PickleBuffer], bool]) -> bytes:
    # torch is looked up, never imported: a program without it sends no tensor
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
    if not isinstance(tensor_type, type):
        return cloudpickle.dumps(value, protocol=PROTOCOL, buffer_callback=keep)
    with io.BytesIO() as file:
        _TensorPickler(file, tensor_type, keep).dump(value)
        return file.getvalue()


class _TensorPickler(cloudpickle.Pickler):
    """cloudpickle, with plain CPU tensors sent as numpy arrays are: their bytes as one buffer,
    rebuilt by :func:`_tensor`. ``reducer_override`` may decline, leaving any other tensor to torch."""

    def __init__(self, file: io.BytesIO, tensor_type: type,
                 keep: Callable[[pickle.PickleBuffer], bool]) -> None:
        super().__init__(file, protocol=PROTOCOL, buffer_callback=keep)
        self._tensor_type = tensor_type

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is self._tensor_type:
            reduced = _reduce_tensor(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def _reduce_tensor(tensor: Any) -> Any:
    """``(_tensor, (bytes, dtype name, shape))`` for a plain CPU tensor, else ``NotImplemented``."""
    if (tensor.requires_grad  # autograd state travels as torch pickles it
            or tensor.device.type != "cpu" or tensor.layout is not _torch().strided
            or tensor.is_quantized or tensor.is_nested
            or getattr(tensor, "has_names", bool)()  # named tensors (older torch): pickling refuses them
            or tensor.__dict__):  # Python attributes, which torch's pickle keeps
        return NotImplemented
    # a strided view is made contiguous (torch's pickle copies its whole storage)
    flat = tensor.contiguous().resolve_conj().resolve_neg().reshape(-1)
    try:
        data = flat.view(_torch().uint8).numpy()  # shares the tensor's memory
    except RuntimeError:  # torch without numpy, or a dtype without a byte view
        return NotImplemented
    name = str(tensor.dtype).removeprefix("torch.")
    return _tensor, (pickle.PickleBuffer(data), name, tuple(tensor.shape))


def _tensor(data: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """Rebuild a tensor from its bytes, sharing their memory (a received frame is writable)."""
    torch = _torch()
    kind = getattr(torch, dtype)
    view = memoryview(data)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=kind)  # frombuffer refuses an empty buffer
    if view.readonly:
        data = bytearray(view)  # a tensor cannot be read-only: its own copy
    flat = torch.frombuffer(data, dtype=torch.uint8)
    if flat.data_ptr() % kind.itemsize:
        flat = flat.clone()  # kernels may assume elements are aligned
    return flat.view(kind).reshape(shape)


def _torch() -> Any:
    module = sys.modules.get("torch")
    if module is None:  # a tensor arrives at a process that has not imported torch yet
        module = importlib.import_module("torch")
    return module
