"""Authentication tags for chunks of data at wire speed: one chunk under a *context* the caller supplies
(session, sender, seq, step, index), with the fastest secure MAC here (``benchmarks/mac_cost.py``).

``poly1305`` (``pip install zcollective[fast-auth]``): ``Poly1305(HMAC-SHA256(K, context), data)``,
ChaCha20-Poly1305's construction (RFC 8439) with HMAC as the PRF: a one-time Wegman-Carter MAC under
independent keys (forgery at most 8 * ceil(L / 16) / 2^106 per try), 4-5x HMAC-SHA256's speed.
``hmac-sha256`` (always): ``HMAC-SHA256(K', len(context) || context || data)`` cut to 16 bytes.

The caller's contract: **a context never tags two different chunks under one secret** (two Poly1305
tags under one key reveal it). A verifier computes the context from its own state, never the wire, so a
replayed or moved chunk is refused (``Signer``'s fast tag reads its nonce from the wire, under its HMAC).
"""

from __future__ import annotations

import hashlib
import hmac
import pickle  # only for PickleBuffer, the standard library's flat view of any buffer
from typing import Any, Optional

_Poly1305: Any
try:
    from cryptography.hazmat.primitives import poly1305 as _poly1305
    _Poly1305 = _poly1305.Poly1305
except ImportError:  # the fast-auth extra is not installed
    _Poly1305 = None

POLY1305 = "poly1305"
HMAC_SHA256 = "hmac-sha256"
KEY_LABELS = {  # one key per backend, apart from every other key derived from the secret
    POLY1305: b"zcollective-v3-chunk-poly1305-prf",
    HMAC_SHA256: b"zcollective-v3-chunk-hmac-sha256",
}


def available_backends() -> tuple[str, ...]:
    """The backends this process can use, fastest first."""
    return (POLY1305, HMAC_SHA256) if _Poly1305 is not None else (HMAC_SHA256,)


class ChunkMac:
    """Tags chunks, each bound to a unique context, under ``secret`` with ``backend`` (default: the
    fastest); ValueError for an unknown one, or ``"poly1305"`` without ``cryptography``."""

    TAG_BYTES = 16  # Poly1305's tag; HMAC-SHA256 is cut to the same length

    def __init__(self, secret: bytes, backend: Optional[str] = None) -> None:
        backend = backend or available_backends()[0]
        if backend not in KEY_LABELS:
            raise ValueError(f"unknown MAC backend {backend!r}; known: {', '.join(KEY_LABELS)}")
        if backend not in available_backends():
            raise ValueError(f"MAC backend {backend!r} needs the cryptography package "
                             "(pip install zcollective[fast-auth])")
        self.backend = backend
        self._poly = _Poly1305 if backend == POLY1305 else None
        key = hmac.new(secret, KEY_LABELS[backend], hashlib.sha256).digest()
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)  # copied for each tag

    def tag(self, context: bytes, data: Any) -> bytes:
        """The tag of ``data`` under ``context``, which must never have tagged other data."""
        h = self._keyed.copy()
        if self._poly is not None:
            h.update(context)
            return bytes(self._poly.generate_tag(h.digest(), byte_view(data)))
        h.update(len(context).to_bytes(8, "little"))
        h.update(context)
        h.update(byte_view(data))
        return h.digest()[:self.TAG_BYTES]

    def verify(self, context: bytes, data: Any, tag: Any) -> bool:
        """Whether ``tag`` is ``data``'s tag under ``context`` (constant-time comparison)."""
        return hmac.compare_digest(self.tag(context, data), bytes(tag))


def byte_view(data: Any) -> memoryview:
    """A one-dimensional byte view of any contiguous buffer, uncopied (for hashlib, cryptography, slicing)."""
    view = memoryview(data)
    if view.ndim == 1 and view.format == "B":
        return view
    if view.c_contiguous:
        return view.cast("B")
    return pickle.PickleBuffer(view).raw()  # Fortran order; raises BufferError if not contiguous
