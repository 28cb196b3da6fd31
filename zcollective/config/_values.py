"""A setting's raw value to its value: where it came from, conversions, checks, and
adjustments of what the environment says. Knows nothing of sockets."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional, TypeVar

from .._limits import MAX_JOB_CHARS, MAX_LIVENESS_S, MIN_LIVENESS_S

SHARED_MEMORY_OFF = "off"
MIN_SECRET_BYTES = 16  # shorter secrets can be guessed; `zcollective-run` makes 32 random bytes
TORCHRUN_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # "True": torchrun's agent holds MASTER_PORT
JOB_NAMERS = {"ADAPTDL_JOB_ID": "adaptdl job", "TORCHELASTIC_RUN_ID": "torchrun run"}  # as errors call them
TORCHRUN_UNNAMED_RUN = "none"  # torchrun's default --rdzv-id: every run not --standalone has it
T = TypeVar("T")


# -- where a value came from -------------------------------------------------


class Origin(NamedTuple):
    """Where a setting's value came from."""

    raw: Any  # the value as found, before conversion
    source: str  # "argument replica_rank", "environment variable RANK", "the default", ...
    shown: str  # how error messages quote it: source and raw value (never a secret's)


def variable(env: Mapping[str, str], name: str, secret: bool = False) -> Optional[Origin]:
    raw = env.get(name)
    if raw is not None and not secret:
        raw = raw.strip()
    if not raw:  # set but empty counts as unset
        return None
    source = f"environment variable {name}"
    return Origin(raw, source, source if secret else f"{source}={raw!r}")


def converted(found: Origin, convert: Callable[[Any], T]) -> T:
    """``convert(found.raw)``; its ValueError quotes where the value came from."""
    try:
        return convert(found.raw)
    except ValueError as exc:
        raise ValueError(f"{found.shown} {exc}") from None


# -- conversions: raw value -> value, or ValueError(what is wrong) -----------


def to_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError("is not an integer")
    if isinstance(raw, int):
        return raw
    try:
        return int(str(raw), 10)
    except ValueError:
        raise ValueError("is not an integer") from None


def to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("is not a boolean (1/0, true/false, yes/no, on/off)")


def to_seconds(raw: Any, unbounded: bool = False) -> Optional[float]:
    """Positive seconds; with ``unbounded``, None and infinity mean no bound."""
    if unbounded and (raw is None or isinstance(raw, str) and raw.lower() in ("none", "inf", "infinity")):
        return None
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        raise ValueError("is not a number of seconds") from None
    if math.isinf(seconds) and unbounded:
        return None
    if not seconds > 0 or math.isnan(seconds):
        raise ValueError("must be a positive number of seconds")
    return seconds


def to_seconds_or_none(raw: Any) -> Optional[float]:
    return to_seconds(raw, unbounded=True)


def to_seconds_or_zero(raw: Any) -> Optional[float]:
    """Positive seconds, or 0 (None): off."""
    try:
        if float(raw) == 0:
            return None
    except (TypeError, ValueError):
        pass
    return to_seconds(raw)


def to_bytes_or_off(raw: Any) -> Optional[int]:
    """A number of bytes (0 or more), or ``off`` (None)."""
    if isinstance(raw, str) and raw.strip().lower() == SHARED_MEMORY_OFF:
        return None
    try:
        value = to_int(raw)
    except ValueError:
        raise ValueError(f"is neither a number of bytes nor {SHARED_MEMORY_OFF!r}") from None
    if value < 0:
        raise ValueError("must be 0 or more bytes, or 'off'")
    return value


def to_str(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"must be a str, not {type(raw).__name__}")
    return raw


def to_secret(raw: Any) -> bytes:
    if isinstance(raw, str):
        raw = raw.encode()
    if not isinstance(raw, bytes):
        raise ValueError(f"must be bytes or str, not {type(raw).__name__}")
    return raw


# -- checks: value -> what is wrong with it, or None -------------------------


def host_problem(addr: str) -> Optional[str]:
    bad = not addr or addr.startswith("-") or any(c.isspace() or c in "/;,'\"" for c in addr)
    return "is not a host name or IP address" if bad else None


def port_problem(port: int) -> Optional[str]:
    return None if 0 <= port <= 65535 else "is not a TCP port (1 to 65535)"


def liveness_problem(seconds: float) -> Optional[str]:
    if seconds > MAX_LIVENESS_S:  # libzmq takes heartbeat times as int milliseconds
        return f"is above the maximum of {MAX_LIVENESS_S:g} s"
    return None if seconds >= MIN_LIVENESS_S else f"is below the minimum of {MIN_LIVENESS_S} s"


def secret_problem(secret: bytes) -> Optional[str]:
    if len(secret) >= MIN_SECRET_BYTES:
        return None
    return (f"is {len(secret)} bytes long; use at least {MIN_SECRET_BYTES} "
            f"(for instance: python -c 'import secrets; print(secrets.token_hex(32))')")


def bind_problem(addr: str) -> Optional[str]:
    bad = not addr or any(c.isspace() or c == "/" for c in addr)
    return "is not an address to bind" if bad else None


def at_least(low: int) -> Callable[[int], Optional[str]]:
    problem = "must be 0 or more" if low == 0 else f"must be at least {low}"
    return lambda n: None if n >= low else problem


def one_of(choices: tuple[str, ...]) -> Callable[[str], Optional[str]]:
    return lambda value: None if value in choices else f"must be one of {', '.join(map(repr, choices))}"


LOG_CHOICES = ("", "calls")


def job_problem(name: str) -> Optional[str]:
    if not name.strip():
        return "is empty"
    if len(name) > MAX_JOB_CHARS:
        return f"is {len(name)} characters long; use at most {MAX_JOB_CHARS}"
    return None if name.isprintable() else "has characters that do not print"


# -- adjustments: a value found in the environment -> the value it stands for -


def beside_torchrun_agent(found: Origin, env: Mapping[str, str]) -> Origin:
    """torchrun's agent listens on MASTER_PORT under TORCHELASTIC_USE_AGENT_STORE=True: take the next."""
    if found.source != "environment variable MASTER_PORT" or env.get(TORCHRUN_AGENT_STORE) != "True":
        return found
    port = converted(found, to_int) + 1
    return Origin(port, "environment variable MASTER_PORT, plus 1",
                  f"{found.shown} plus 1 ({TORCHRUN_AGENT_STORE}='True': torchrun's agent listens "
                  f"on MASTER_PORT itself), {port},")


def named_job(found: Origin, env: Mapping[str, str]) -> Optional[Origin]:
    """adaptdl's job id or torchrun's run id, called so ("torchrun run 8f3c..."; its default names none)."""
    kind = JOB_NAMERS.get(found.source.removeprefix("environment variable "))
    if kind is None:
        return found
    if kind == JOB_NAMERS["TORCHELASTIC_RUN_ID"] and found.raw == TORCHRUN_UNNAMED_RUN:
        return None
    return found._replace(raw=f"{kind} {found.raw}")
