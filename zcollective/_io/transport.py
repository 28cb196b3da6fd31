"""The I/O seam: what the drivers (:class:`~._driver.Driver`, :class:`~._server.Server`, the relay's
stand-in) ask of a transport. Nothing above the drivers knows which one carries the frames; ZeroMQ's is
:mod:`._zmq` (a one-host shared-memory transport can sit beside it).

Rules every transport keeps, whatever it is:

- A transport moves whole messages (lists of frames, bytes or buffers) and never blocks:
  ``send`` returns at once (False: the peer's link is gone), ``recv`` returns None when nothing waits.
- The one blocking wait is a :class:`~._interrupts.Waiter`'s (an interrupt's surface): a
  transport registers its readable sources there under names (:meth:`Link.connect`, :meth:`Hub.watch`), as
  ``SOURCES``; a source is a pollable socket or a file descriptor (an ``eventfd`` or a pipe for shared
  memory).
- Links up and down reach the drivers as events: :class:`ConnectionEvent` for a replica's
  link, a count of connections closed for the coordinator's end (the probes find whose).
- Errors leave as :class:`~zcollective.errors.CollectiveError`; no transport's own exception
  crosses the seam.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Optional, Protocol, Union

from .._protocol._member import ConnectionEvent
from ._interrupts import Waiter

__all__ = ["Hub", "Link", "Mailbox"]


class Link(Protocol):
    """A replica's link to the coordinator."""

    SOURCES: ClassVar[tuple[str, ...]]  # the names its sources have in a Waiter

    def connect(self, waiter: Waiter) -> None:
        """Register the sources in ``waiter``, then reach the coordinator."""

    def send(self, frames: list[Any], what: Any = None) -> bool:
        """Send one message (``what``: named in an error); False if the link is down."""

    def recv(self, waiting: bool) -> Optional[list[Any]]:
        """The next message, or None (``waiting``: a wait just found one)."""

    def events(self, rank: int, joining: bool) -> list[Union[ConnectionEvent, Exception]]:
        """The link's news since last asked: up and down, or a refusal's error."""

    def close(self, linger_ms: int) -> None:
        """Let go; what is queued gets ``linger_ms`` to leave."""


class Hub(Protocol):
    """The coordinator's end, where every replica's link arrives (rank 0's, or a formed group's host)."""

    SOURCES: ClassVar[tuple[str, ...]]
    port: int  # bound (0 asked: the system chose)
    router: Any  # None once closed
    handover: bool  # a peer reconnecting may still take over its name (while joining)
    gatekeeper: Any  # what admits peers, shared with the transport's other ports (None: no secret)

    def bind(self) -> tuple[Any, Any]:
        """Listen at the master address; raise CollectiveError."""

    def watch(self, router: Any, monitor: Any, waiter: Waiter) -> int:
        """Register the sources in ``waiter``; the connections closed so far."""

    def handshakes(self) -> None:
        """Answer peers waiting to be admitted (authentication)."""

    def recv(self, waiting: bool) -> Optional[list[Any]]:
        """The next message, its peer's name first, or None."""

    def address(self, frame: Any) -> str:
        """Where a received frame came from (for warnings)."""

    def send(self, frames: list[Any]) -> bool:
        """Send to the peer named by the first frame; False if it is gone."""

    def joined(self) -> None:
        """The group has joined: no peer takes over another's name any more."""

    def events(self) -> int:
        """The connections closed since last asked (refused strangers are logged)."""

    def refusals(self) -> list[str]:
        """The first peers refused at the handshake, and why."""

    def close(self, linger_ms: int) -> None:
        """Let go; what is queued gets ``linger_ms`` to leave."""


class Mailbox(Protocol):
    """One rank's point-to-point links to the others (the mailbox; the tree's links too): a message
    waits for its link's handshake, a send may lend its buffers (a tracker says when they are free)."""

    @property
    def source(self) -> Any:
        """Readable while a message waits (watched in a Waiter)."""

    retry: dict[int, float]  # links refused before they were made: when each is tried again
    offered: set[int]  # ranks whose one-host link is offered, not yet made (link() makes it)
    via_local: set[int]  # ranks whose one-host link is made: messages there go unsigned
    local: Any  # the one-host links (their ``source``: the last message's rank, -1 if not theirs), or None
    monitors: dict[int, Any]  # one watched source per link (its news: made, refused, broken)
    quiet_until: float  # till then progress() has nothing to do unless a wait woke for a link
    keyed: Callable[[int], bool]  # a message came from rank k: its link needs no wait for the handshake

    @property
    def local_name(self) -> Optional[str]:
        """Where ranks on this host reach its one-host links (its JOIN says), or None."""

    def start(self, session: int, endpoints: list[str], base: bytes, rank: int,
              local: Optional[list[Optional[str]]] = None) -> None:
        """Welcomed: the ranks' addresses (``local``: their one-host links'), the key their links prove."""

    def send(self, dest: int, frames: list[Any], track: bool, handle: Any) -> list[tuple[Any, Any]]:
        """Send (never blocking) or hold until the link is made; what went: (tracker, handle)."""

    def recv(self, waiting: bool) -> Optional[list[Any]]:
        """The next message waiting, or None (``waiting``: a wait just found one)."""

    def progress(self, now: float, look: bool = False) -> tuple[list[tuple[Any, Any]], Optional[int]]:
        """The links' news: what went once made, and a rank whose link broke."""

    def links(self) -> dict[str, Any]:
        """Each link's watched source, by its name in a Waiter (the one-host links' first: they have one)."""

    def link(self, dest: int) -> None:
        """Make the one-host link to ``dest`` (in :attr:`offered`) now, or give it up for ZeroMQ's."""

    def connect(self, dests: list[int]) -> None:
        """Make the links to ``dests`` now (not at their first message)."""

    def made(self, dests: list[int]) -> bool:
        """Are the links to ``dests`` made?"""

    def holding(self, but: Any = ()) -> bool:
        """Does a message wait for a link (to a rank not in ``but``)?"""

    def holds(self, handle: Any) -> Optional[int]:
        """The rank whose link the send ``handle`` waits for."""

    def held_last(self, handle: Any) -> Optional[int]:
        """That rank, if ``handle`` is the last send held for it."""

    def drop_send(self, dest: int, handle: Any) -> None:
        """Forget the held send ``handle``."""

    def drop_to(self, dest: int, sends_only: bool) -> list[Any]:
        """Forget what is held for ``dest``; the sends' handles."""

    def drop_held(self) -> dict[int, list[Any]]:
        """Forget everything held; the handles by rank."""

    def cut_off(self, dests: Any) -> None:
        """Stop sending to ``dests`` (what is under way is lost)."""

    def close(self, linger_ms: int = 0) -> None:
        """Let go; what is queued gets ``linger_ms`` to leave."""
