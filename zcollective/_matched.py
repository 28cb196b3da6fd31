"""A matched probe's message (:class:`Message`): what ``mprobe``/``improbe``
took out of matching, received once, later, by its holder; no other receive
or probe can match it meanwhile. It knows nothing of sockets or groups: the
message is here, so receiving it only unpickles it.

A matched message counts as received from its probe on (its window is
credited, a synchronous sender is told): one never received is simply
dropped with its holder, at teardown and exit alike.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Optional

from ._format import _serialize
from ._future import CollectiveFuture, settle
from ._protocol._outcomes import CallOutcome
from ._protocol._p2p import ANY_TAG, PROC_NULL, Arrived, Status
from .errors import CollectiveError


class Message:
    """A message a matched probe took (``mprobe``/``improbe``): its
    ``source``, ``tag`` and ``nbytes``; true until received (:meth:`recv` or
    :meth:`recv_async`, once). From ``PROC_NULL``: received as None."""

    __slots__ = ("source", "tag", "nbytes", "_came", "_rank", "_received")

    def __init__(self, rank: int, came: Optional[Arrived]) -> None:
        self._rank, self._came = rank, came
        self._received = threading.Lock()  # held once received: taken in one step, by one thread only
        if came is None:  # (from PROC_NULL)
            self.source, self.tag, self.nbytes = PROC_NULL, ANY_TAG, 0
        else:
            self.source, self.tag, self.nbytes = came.source, came.tag, came.nbytes

    def __bool__(self) -> bool:
        return not self._received.locked()

    @classmethod
    def no_proc(cls) -> Message:
        """The message every matched probe of ``PROC_NULL`` returns: one, received as None any number
        of times and true for ever (MPI's ``MESSAGE_NO_PROC``)."""
        return NO_PROC

    def __repr__(self) -> str:
        state = "received" if self._received.locked() else "not received"
        return f"<Message source={self.source} tag={self.tag} nbytes={self.nbytes} {state}>"

    def recv(self, status: Optional[Status] = None) -> Any:
        """The message's value (``status``, if given, says where it came from).

        Raises
        ------
        CollectiveError
            It was received already (a matched message is received once).
        SerializationError
            Its value cannot be unpickled here.
        """
        if self is not NO_PROC and not self._received.acquire(False):  # (NO_PROC: received as often as asked)
            raise CollectiveError(f"rank {self._rank}: this Message (source={self.source}, tag={self.tag}) "
                                  f"was received already: a matched message is received once")
        if status is not None:
            status.source, status.tag, status.nbytes = self.source, self.tag, self.nbytes
        came, self._came = self._came, None
        if came is None:  # (NO_PROC's)
            return None
        return _serialize.loads(came.message.segments[0], f"message from rank {came.source}")

    def recv_async(self) -> CollectiveFuture[Any]:
        """:meth:`recv`, as a future (done at once: the message is here); raises as :meth:`recv` does
        if it was received already, an unpickling error from ``result()``."""
        if self._received.locked():
            self.recv()  # (raises, saying so)
        future: CollectiveFuture[Any] = CollectiveFuture(None, -1, f"Message(source={self.source}, "
                                                                  f"tag={self.tag}).recv_async()")
        status = Status(self.source, self.tag, self.nbytes)
        settle(deque([CallOutcome(future, None, self.recv, status)]))
        return future


NO_PROC = Message(-1, None)
