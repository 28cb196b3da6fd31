"""Handshake tokens, without sockets: a single-use nonce and its HMAC under a key derived from the secret,
accepted once per ZAP domain. Why: docs/security.md, "With a secret" (At the ZeroMQ handshake)."""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Callable, Optional

from .._format._wire import NONCE_BYTES

KEY_LABEL = b"zcollective-v1-zap-plain"  # its own key: a handshake MAC is never a message tag
PORT_LABEL = b"zcollective-v1-data-link"  # a data port's key: bound to its group and rank
MAIL_LABEL = b"zcollective-v1-mailbox"  # a mailbox port's: apart from its data port's
LOCAL_LABEL = b"zcollective-v1-local-link"  # a group's one-host links' (_io/_local): apart from both
USERNAME_PREFIX = b"zc1."  # the token format's version
NOT_YET = "no key yet (the group is not formed)"  # a member early for its link: not logged
_USERNAME_LEN = len(USERNAME_PREFIX) + 2 * NONCE_BYTES
_PASSWORD_LEN = 2 * hashlib.sha256().digest_size
_HEX = frozenset(b"0123456789abcdef")


def port_key(base: bytes, session: int, rank: int, label: bytes = PORT_LABEL) -> bytes:
    """The token key of ``rank``'s data port in ``session``: a copied token opens no other port or group."""
    return hmac.new(base, label + session.to_bytes(8, "little") + rank.to_bytes(4, "little"),
                    hashlib.sha256).digest()


def derive_key(secret: bytes) -> bytes:
    """The handshake key: the secret under a label of its own."""
    return hmac.new(secret, KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, domain: bytes, username: bytes) -> bytes:
    msg = len(domain).to_bytes(2, "big") + domain + username  # length first: no ambiguity
    return hmac.new(key, msg, hashlib.sha256).hexdigest().encode()


def client_credentials(secret: bytes, domain: str,
                       entropy: Callable[[int], bytes] = os.urandom) -> tuple[bytes, bytes]:
    """A fresh single-use token (username, password) for a server in ``domain``."""
    username = USERNAME_PREFIX + entropy(NONCE_BYTES).hex().encode()
    return username, _mac(derive_key(secret), domain.encode(), username)


class TokenChecker:
    """The token rule: :meth:`check` says why a token is refused, or None (remembering its nonce)."""

    def __init__(self, secret: bytes) -> None:
        self._key = derive_key(secret)
        self._used: set[bytes] = set()  # grows only with tokens whose MAC was right

    def check(self, domain: bytes, username: bytes, password: bytes) -> Optional[str]:
        if (len(username) != _USERNAME_LEN or not username.startswith(USERNAME_PREFIX)
                or not _HEX.issuperset(username[len(USERNAME_PREFIX):])
                or len(password) != _PASSWORD_LEN or not _HEX.issuperset(password)):
            return "malformed credentials"
        if not hmac.compare_digest(_mac(self._key, domain, username), password):
            return "credentials failed authentication (another secret, or another port's token)"
        if username in self._used:
            return "credentials already used (a replayed token)"
        self._used.add(username)
        return None

    def spend(self, usernames: set[bytes]) -> None:
        """Count these tokens as used (offered before this key existed)."""
        self._used |= usernames


def zap_reply(request: list[bytes],
              checker: Optional[TokenChecker]) -> tuple[list[bytes], Optional[str], str]:
    """Answer one ZAP request: the reply's frames, why the peer was refused (None: accepted), its address;
    with no ``checker`` every token is refused."""
    if len(request) < 6 or request[0] != b"1.0":
        request_id = request[1] if len(request) > 1 else b""
        bad = "a malformed ZAP request"
        return [b"1.0", request_id, b"500", bad.encode(), b"", b""], bad, "an unknown address"
    request_id, domain, address, mechanism = request[1], request[2], request[3], request[5]
    peer = address.decode("ascii", "replace") or "an unknown address"
    if mechanism != b"PLAIN" or len(request) != 8:
        why: Optional[str] = f"security mechanism {mechanism.decode('ascii', 'replace')[:20]}, not PLAIN"
    elif checker is None:
        why = NOT_YET
    else:
        why = checker.check(domain, request[6], request[7])
    if why is None:
        return [b"1.0", request_id, b"200", b"OK", b"", b""], None, peer
    return [b"1.0", request_id, b"400", why.encode()[:200], b"", b""], why, peer
