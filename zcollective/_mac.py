"""Stand-in for the chunk MAC (HMAC-SHA256); replaced by the measured one."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

KEY_LABEL = b"zcollective-v1-chunk-mac"


class ChunkMac:
    TAG_BYTES = 32
    backend = "hmac-sha256"

    def __init__(self, secret: bytes) -> None:
        self._base = hmac.new(hmac.new(secret, KEY_LABEL, hashlib.sha256).digest(), digestmod=hashlib.sha256)

    def tag(self, context: bytes, data: Any) -> bytes:
        h = self._base.copy()
        h.update(context)
        h.update(data)
        return h.digest()

    def verify(self, context: bytes, data: Any, tag: bytes) -> bool:
        return hmac.compare_digest(self.tag(context, data), tag)
