"""How one replica takes part in forming a group from an earlier one (the
rules are the coordinator's rule 9; the steps are :mod:`zcollective._elastic`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ._limits import FORM_REACH_S, FORM_WAIT_S
from .errors import CollectiveError

if TYPE_CHECKING:
    from ._protocol._coordinator import Forming


@dataclass(frozen=True)
class Form:
    """This replica's part: ``lineage``, the earlier session (hex); ``forming``: the host's expectation."""

    lineage: str
    forming: Optional[Forming] = None
    reach_s: float = FORM_REACH_S  # a member gives up on a host it cannot reach within this
    wait_s: float = FORM_WAIT_S  # the host forms with those that came within this
    quorum_s: float = 0.0  # ... or, too few for a majority, within this (a grow's members: alive)


class Unreachable(CollectiveError):
    """A would-be host could not be reached (lost too); ``refused``: nobody listened (its process is gone)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class Overslept(CollectiveError):
    """A would-be host came back from its wait much later than the bound: the others may have gone on."""
