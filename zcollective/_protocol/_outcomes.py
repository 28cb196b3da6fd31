"""What the rules say a call came to, for the call runner to apply (rule 3
of the member): the member's collective calls and its point-to-point ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(slots=True)
class CallOutcome:
    """What a call came to, for the call runner to apply to ``future``: ``error``, or the value ``make()``
    returns (it unpickles, or finishes a transfer: the program's code may run there, never in the rules); a
    received message's ``status`` (where it came from) goes on the future, and ``undo`` puts it back if its
    receive is given up before it applies."""

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
