"""The exception hierarchy of zcollective.

Every error the library raises on purpose is a :class:`CollectiveError` (a ``RuntimeError``, so ``except
RuntimeError`` written for adaptdl keeps working) or a ``ValueError`` for configuration mistakes. This
module knows nothing of sockets, threads or pickle.
"""

from __future__ import annotations

__all__ = ["CollectiveError", "RemoteError", "ReplicaLostError", "PeerEndedError",
           "CollectiveTimeoutError", "CallMismatchError", "AuthenticationError", "SerializationError",
           "ProtocolError", "PeerError", "AddressError", "LateJoinError", "LeftOutError",
           "JobMismatchError", "ForkedProcessError", "InternalError"]


class CollectiveError(RuntimeError):
    """Base of every error raised by a collective operation; the message names the rank that raised it
    and, where one was in flight, the operation and its sequence number."""


class RemoteError(CollectiveError):
    """*Your* reduce function raised on the coordinator (rank 0); the group is still usable. The original
    exception is kept in :attr:`remote_type`, :attr:`remote_message` and :attr:`remote_traceback`."""

    def __init__(self, message: str, remote_type: str = "", remote_message: str = "",
                 remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[type[RemoteError], tuple[str, str, str, str]]:
        # keep the attributes through copy and pickle
        return type(self), (str(self), self.remote_type, self.remote_message, self.remote_traceback)


class ReplicaLostError(CollectiveError):
    """A replica, or the coordinator at rank 0, disconnected or stopped answering, or its program ended
    while the others still expected it.

    Failed due to *external circumstances* (a crash, a kill, a network fault) when the message says "was
    lost"; due to *another replica's program* when it says "ended its program (without teardown)". The group
    is failed for good: every later call raises this at once; call :func:`zcollective.teardown` and start a
    new group. A rank that ended normally (it called teardown, or its program ended) is no loss: a
    point-to-point call that only it could answer raises :class:`PeerEndedError`.
    """


class PeerEndedError(CollectiveError):
    """A point-to-point call needs a rank that ended normally: it called teardown, or its program ended
    (without teardown), so it sends and receives nothing more.

    *Another replica's program* ended; nothing was lost and only this call fails: a ``send`` at once, a
    ``recv`` or ``probe`` once every message it sent was taken in (``ANY_SOURCE``: once every other rank
    ended). Not a :class:`ReplicaLostError`, so ``except ReplicaLostError: shrink()`` does not fire on a
    clean ending. :attr:`ended_ranks` names the ranks.
    """

    ended_ranks: tuple[int, ...] = ()


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A call's timeout passed before every replica arrived at it (the message names those missing). The
    group is not failed: a timed-out :meth:`Future.result` may be waited on again."""


class CallMismatchError(CollectiveError):
    """Replicas called different operations (or roots) at the same sequence number.

    *Your* program diverged between replicas; the message lists which ranks called what and where. The
    group is failed for good, except when only the arrays of a data-plane allreduce disagree (dtype,
    shape, reduce function): then that call fails on every rank and the group goes on.
    """


class AuthenticationError(CollectiveError):
    """A peer could not prove it knows the job's secret, or a message was altered, moved or replayed on its
    way.

    Either the *configuration* differs between replicas (set the same secret everywhere) or *someone on the
    network* tampered with the traffic. Once a group has started, it is failed for good.
    """


class SerializationError(CollectiveError, TypeError):
    """A value or reduce function could not be pickled or unpickled.

    *Your* value is the cause: raised on the calling replica before anything is sent, or, when rank 0
    cannot unpickle a rank's value or reduce function, on every replica naming that rank. Either way the
    group stays usable.
    """


class ProtocolError(CollectiveError):
    """A peer spoke a different protocol or Python version, or the master port is answered by a program
    that is not a zcollective coordinator: the *installation* differs between hosts, or the address is
    wrong."""


class PeerError(CollectiveError):
    """Another replica's part of this call failed there, before it was sent (a ``scatter`` or ``alltoall``
    with the wrong number of values, an interrupt while its value was being pickled).

    *Another replica's program* is the cause (it raised its own error); the message names the rank and
    what it said. Only this call failed: the group stays usable.
    """


class AddressError(CollectiveError):
    """The master address could not be used: rank 0 cannot bind it (the port is taken by another program, or
    the address is not one of rank 0's host), or a replica cannot connect to it (a malformed address).

    The *configuration* or the *environment* is the cause: check ``master_addr``/``master_port``
    (``MASTER_ADDR``/``MASTER_PORT``).
    """


class LateJoinError(CollectiveError):
    """This replica tried to join a group that had already started (or failed): the *launch* is the
    cause (a replica restarted, or two jobs share a master address and port)."""


class JobMismatchError(LateJoinError):
    """This replica reached the coordinator of another job: its job's name (``ZCOLLECTIVE_JOB``, or its
    launcher's) is not rank 0's, or only one of the two has a name. The message names both, and the rank and
    host refused.

    The *launch* is the cause: two jobs share a master address and port, or one job's replicas were given
    different names. Only this replica is refused; the group at that port goes on. Give each job its own
    port, and the same ``ZCOLLECTIVE_JOB`` to every replica of one job.
    """


class LeftOutError(LateJoinError):
    """The survivors of a loss formed their new group without this replica (:func:`zcollective.shrink`): it
    did not come within the bound, or the group it belonged to had already counted it as lost.

    *This replica was too slow*: it is no longer a member; end it, or start it again as a newcomer
    (``initialize(join=True)``) and have the group ``grow()``.
    """


class ForkedProcessError(CollectiveError):
    """A group was used in a process forked from the one that created it: a child cannot use its
    parent's sockets; call :func:`zcollective.initialize` in the child for a group of its own."""


class InternalError(CollectiveError):
    """The coordinator crashed, a *bug in zcollective*: please report it with the message and rank 0's log.
    The group is failed for good."""


# The names errors travel under (ERROR, FAIL, REJECT); a name not listed arrives as CollectiveError.
WIRE_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (CollectiveError, CollectiveTimeoutError, ReplicaLostError, PeerEndedError,
                                  CallMismatchError, AuthenticationError, SerializationError,
                                  ProtocolError, PeerError, LateJoinError, LeftOutError, InternalError,
                                  JobMismatchError, ValueError)
}


SIGNAL_ATTR = "zcollective_signal"  # set on an exception a signal handler raised: its signal number


def from_signal(exc: BaseException) -> bool:
    """Did a signal handler raise ``exc`` (an interrupt, not the code's own error)?"""
    return hasattr(exc, SIGNAL_ATTR)


def is_interrupt(exc: BaseException) -> bool:
    """Is ``exc`` an interrupt (``KeyboardInterrupt``, ``SystemExit``, a signal handler's exception)?"""
    return not isinstance(exc, Exception) or from_signal(exc)
