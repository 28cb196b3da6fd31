"""Arguments and environment variables to one validated :class:`Config`.

Precedence, field by field: an explicit argument; else ``ZCOLLECTIVE_*``;
else adaptdl's ``ADAPTDL_*``; else torchrun's names; else the default.
Every malformed value is a ``ValueError`` that names where it came from.
This module knows nothing of sockets.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Union

DEFAULT_MASTER_ADDR = "127.0.0.1"  # one machine needs no configuration at all
DEFAULT_MASTER_PORT = 29457  # near torchrun's 29500 range but not on it, so both fit in one job
DEFAULT_NUM_REPLICAS = 1  # a script written for many replicas runs unchanged on one
DEFAULT_INIT_TIMEOUT_S = 300.0  # replicas of a job may start minutes apart on a busy cluster
DEFAULT_OP_TIMEOUT_S = 1800.0  # torch.distributed's default: long steps pass, hangs end
DEFAULT_LIVENESS_S = 10.0  # a silent peer (host down, cable cut) is declared lost after this
MIN_LIVENESS_S = 1.0  # below this, scheduler hiccups on a loaded host look like deaths
DEFAULT_MAX_FRAME_BYTES = 1 << 31  # 2 GiB: libzmq allocates what a frame announces, so a stranger's
# claim is bounded by this; raise it (on every replica) for single arrays above 2 GiB

Number = Union[int, float]

# field -> environment variables, in precedence order
ENV_NAMES: dict[str, tuple[str, ...]] = {
    "master_addr": ("ZCOLLECTIVE_MASTER_ADDR", "ADAPTDL_MASTER_ADDR", "MASTER_ADDR"),
    "master_port": ("ZCOLLECTIVE_MASTER_PORT", "ADAPTDL_MASTER_PORT", "MASTER_PORT"),
    "rank": ("ZCOLLECTIVE_REPLICA_RANK", "ADAPTDL_REPLICA_RANK", "RANK"),
    "num_replicas": ("ZCOLLECTIVE_NUM_REPLICAS", "ADAPTDL_NUM_REPLICAS", "WORLD_SIZE"),
    "op_timeout": ("ZCOLLECTIVE_TIMEOUT",),
    "liveness_timeout": ("ZCOLLECTIVE_LIVENESS_TIMEOUT",),
    "max_frame_bytes": ("ZCOLLECTIVE_MAX_FRAME_BYTES",),
    "bind_addr": ("ZCOLLECTIVE_BIND_ADDR",),
}
SECRET_ENV = "ZCOLLECTIVE_SECRET"
SECRET_FILE_ENV = "ZCOLLECTIVE_SECRET_FILE"
MIN_SECRET_BYTES = 16  # shorter secrets can be guessed; `zcollective-run` makes 32 random bytes
ALL_INTERFACES = ("*", "0.0.0.0", "::")


@dataclass(frozen=True)
class Config:
    """A validated group configuration; build it with :func:`resolve`."""

    master_addr: str
    master_port: int
    rank: int
    num_replicas: int
    init_timeout: Optional[float] = DEFAULT_INIT_TIMEOUT_S
    op_timeout: Optional[float] = DEFAULT_OP_TIMEOUT_S
    liveness_timeout: float = DEFAULT_LIVENESS_S
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    secret: Optional[bytes] = field(default=None, repr=False)
    bind_addr: Optional[str] = None  # rank 0 binds here; None: the interface of master_addr

    @property
    def endpoint(self) -> str:
        host = self.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        return f"tcp://{host}:{self.master_port}"

    @property
    def bind_host(self) -> str:
        host = self.bind_addr or self.master_addr
        return "*" if host in ALL_INTERFACES else host


def _lookup(field: str, arg: object, argname: str, env: Mapping[str, str]) -> tuple[object, str]:
    """Return (raw value, its source's name) for one field."""
    if arg is not None:
        return arg, f"argument {argname}"
    for name in ENV_NAMES.get(field, ()):
        raw = env.get(name)
        if raw is not None and raw.strip() != "":
            return raw.strip(), f"environment variable {name}"
    return None, ""


def _as_int(value: object, source: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{source}={value!r} is not an integer")
    if isinstance(value, int):
        return value
    try:
        return int(str(value), 10)
    except ValueError:
        raise ValueError(f"{source}={value!r} is not an integer") from None


def _as_timeout(value: object, source: str, allow_none: bool = True) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in ("none", "inf", "infinity") and allow_none:
        return None
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{source}={value!r} is not a number of seconds") from None
    if math.isinf(seconds) and allow_none:
        return None
    if not seconds > 0 or math.isnan(seconds):
        raise ValueError(f"{source}={value!r} must be a positive number of seconds")
    return seconds


def _secret(secret: Union[bytes, str, None], env: Mapping[str, str]) -> Optional[bytes]:
    if secret is not None:
        raw, source = secret, "argument secret"
    elif env.get(SECRET_ENV):
        raw, source = env[SECRET_ENV], f"environment variable {SECRET_ENV}"
    elif env.get(SECRET_FILE_ENV):
        path = env[SECRET_FILE_ENV]
        source = f"the file {path!r} named by {SECRET_FILE_ENV}"
        try:
            with open(path, "rb") as f:
                raw = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {source}: {exc.strerror}") from None
    else:
        return None
    if isinstance(raw, str):
        raw = raw.encode()
    if not isinstance(raw, bytes):
        raise ValueError(f"{source} must be bytes or str, not {type(raw).__name__}")
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{source} is {len(raw)} bytes long; use at least {MIN_SECRET_BYTES} "
                         f"(for instance: python -c 'import secrets; print(secrets.token_hex(32))')")
    return raw


def resolve(
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    replica_rank: Optional[int] = None,
    num_replicas: Optional[int] = None,
    *,
    timeout: Optional[Number] = DEFAULT_INIT_TIMEOUT_S,
    op_timeout: Optional[Number] = None,
    liveness_timeout: Optional[Number] = None,
    max_frame_bytes: Optional[int] = None,
    secret: Union[bytes, str, None] = None,
    bind_addr: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
) -> Config:
    """Build a :class:`Config` from arguments, then the environment, then defaults.

    Raises
    ------
    ValueError
        A value is malformed or out of range; the message names the argument
        or environment variable it came from.
    """
    env = os.environ if env is None else env

    raw, src = _lookup("num_replicas", num_replicas, "num_replicas", env)
    n = DEFAULT_NUM_REPLICAS if raw is None else _as_int(raw, src)
    if n < 1:
        raise ValueError(f"{src}={raw!r} must be at least 1")
    n_src = src or "the default"

    raw, src = _lookup("rank", replica_rank, "replica_rank", env)
    rank = 0 if raw is None else _as_int(raw, src)
    if not 0 <= rank < n:
        raise ValueError(
            f"{src}={raw!r} is out of range: ranks run from 0 to {n - 1} "
            f"for num_replicas={n} (from {n_src})"
        )

    raw, src = _lookup("master_addr", master_addr, "master_addr", env)
    addr = DEFAULT_MASTER_ADDR if raw is None else str(raw)
    if not addr or addr.startswith("-") or any(c.isspace() or c in "/;,'\"" for c in addr):
        raise ValueError(f"{src}={raw!r} is not a host name or IP address")

    raw, src = _lookup("master_port", master_port, "master_port", env)
    port = DEFAULT_MASTER_PORT if raw is None else _as_int(raw, src)
    if not 0 <= port <= 65535:
        raise ValueError(f"{src}={raw!r} is not a TCP port (1 to 65535)")
    if port == 0 and n > 1:  # one replica binds nothing, so adaptdl's standalone port 0 is fine
        raise ValueError(f"{src}=0 cannot be used with num_replicas={n}: rank 0 must listen on a "
                         f"port that every replica is given; pass the same master_port everywhere")

    init_timeout = _as_timeout(timeout, "argument timeout")

    raw, src = _lookup("op_timeout", op_timeout, "op_timeout", env)
    op_t = DEFAULT_OP_TIMEOUT_S if raw is None else _as_timeout(raw, src)

    raw, src = _lookup("liveness_timeout", liveness_timeout, "liveness_timeout", env)
    live = DEFAULT_LIVENESS_S if raw is None else _as_timeout(raw, src, allow_none=False)
    assert live is not None
    if live < MIN_LIVENESS_S:
        raise ValueError(f"{src}={raw!r} is below the minimum of {MIN_LIVENESS_S} s")

    raw, src = _lookup("max_frame_bytes", max_frame_bytes, "max_frame_bytes", env)
    max_frame = DEFAULT_MAX_FRAME_BYTES if raw is None else _as_int(raw, src)
    if max_frame < 1024:
        raise ValueError(f"{src}={raw!r} must be at least 1024")

    raw, src = _lookup("bind_addr", bind_addr, "bind_addr", env)
    if raw is not None and (not str(raw) or any(c.isspace() or c == "/" for c in str(raw))):
        raise ValueError(f"{src}={raw!r} is not an address to bind")

    return Config(
        secret=_secret(secret, env),
        bind_addr=None if raw is None else str(raw),
        master_addr=addr,
        master_port=port,
        rank=rank,
        num_replicas=n,
        init_timeout=init_timeout,
        op_timeout=op_t,
        liveness_timeout=live,
        max_frame_bytes=max_frame,
    )
