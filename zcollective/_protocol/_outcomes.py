"""What the rules say a call came to, for the call runner to apply (rule 3 of the member)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(slots=True)
class CallOutcome:
    """What a call came to: ``error``, or ``make()``'s value (program code may run there, never in the
    rules); a message's ``status`` goes on ``future``; ``undo`` puts it back if given up first."""

    future: Any
    error: Optional[BaseException] = None
    make: Optional[Callable[[], Any]] = None
    status: Any = None
    undo: Optional[Callable[[], None]] = None  # a receive's: put its message back, unreceived


def fresh(error: BaseException) -> BaseException:
    """A new instance of a sticky error, so each raise has its own traceback."""
    try:
        new = type(error).__new__(type(error))
        new.__dict__.update(error.__dict__)
        new.args = error.args
        return new
    except Exception:
        return error
