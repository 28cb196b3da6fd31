"""``mpi4py.MPI``'s names for zcollective (see the package docstring): a name map, nothing more.

=========================================  ==================================================
mpi4py                                     zcollective
=========================================  ==================================================
``COMM_WORLD``                             a :class:`zcollective.Group` from the environment
``COMM_SELF``                              ``world.split(color=rank)``: a sub-group of one
``Dup`` / ``Free``                         ``dup`` / ``teardown``
``send`` / ``recv`` / ``sendrecv``         the same names
``isend`` / ``irecv``                      ``send_async`` / ``recv_async``
``ssend`` / ``issend``                     ``ssend`` / ``ssend_async``
``probe`` / ``iprobe``                     the same names (the Status filled from theirs)
``mprobe`` / ``improbe`` / ``Message``     ``mprobe`` / ``improbe`` / their message handle
``Request`` (``wait``, ``test``, ...)      a :class:`zcollective.CollectiveFuture`
``Request.waitany`` / ``testall`` / ...    :func:`zcollective.wait` (``timeout=0`` to test)
``Request.cancel`` / ``Status.Is_cancelled``  ``future.cancel()`` / ``future.cancelled()``
``PROC_NULL`` / ``ANY_SOURCE`` / ``ANY_TAG``  zcollective's
``bcast`` / ``barrier``                    ``broadcast`` / ``barrier``
=========================================  ==================================================

What the Python layer of mpi4py itself does is mirrored here as mpi4py does it: a request or a
message handle becomes null (falsy) once completed or received; a predefined constant never does.
Names zcollective does not have (yet) are looked up with ``getattr``: a test that needs one fails,
and that is the finding. Buffered sends, typed buffers (``Isend``) and ``_comm_lock_table`` are
left out on purpose (tests/test_mpi4py_p2p.py lists why).
"""

import pickle  # noqa: F401 (mpi4py's MPI.pickle: the tests call MPI.pickle.dumps)
import warnings

import zcollective as zc

ANY_SOURCE = zc.ANY_SOURCE
ANY_TAG = zc.ANY_TAG
PROC_NULL = getattr(zc, "PROC_NULL", -2)  # (-2: not a rank, not ANY_SOURCE: zcollective refuses it)
UNDEFINED = -32766
SUCCESS = 0
THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = range(4)


def Query_thread():
    return THREAD_MULTIPLE  # zcollective's groups may be used from any thread


def Get_version():
    return (3, 1)


def Get_abi_version():
    return (0, 0)


def get_vendor():
    return ("zcollective", tuple(int(p) for p in zc.__version__.split(".")[:3]))


class Status(zc.Status):
    """MPI's status: zcollective's (which its calls fill), with mpi4py's accessors."""

    error = SUCCESS
    cancelled = False

    def Get_source(self):
        return self.source

    def Get_tag(self):
        return self.tag

    def Get_error(self):
        return self.error

    def Is_cancelled(self):
        return self.cancelled


def _fill(status, came, future=None):
    """Copy where a message came from (a zcollective Status, or None) into an MPI ``status``."""
    if status is None:
        return
    if came is not None:
        status.source, status.tag, status.nbytes = came.source, came.tag, came.nbytes
    if future is not None:
        status.cancelled = bool(future.cancelled())


class Request:
    """An MPI request: a zcollective future; null (falsy) once completed."""

    def __init__(self, future=None):
        self.future = future.future if isinstance(future, Request) else future

    def __bool__(self):
        return self.future is not None

    def __eq__(self, other):
        return isinstance(other, Request) and self.future is other.future

    __hash__ = object.__hash__

    def _complete(self, status=None):
        future, self.future = self.future, None
        if future is None:
            _fill(status, None)
            return None
        value = future.result()
        _fill(status, future.status, future)
        return value

    # -- one request
    def wait(self, status=None):
        if self.future is not None:
            zc.wait([self.future])
        return self._complete(status)

    def Wait(self, status=None):
        self.wait(status)
        return True

    def test(self, status=None):
        if self.future is None or self.future.done():
            return True, self._complete(status)
        return False, None

    def Test(self, status=None):
        return self.test(status)[0]

    def get_status(self, status=None):
        future = self.future
        if future is None:
            return True
        flag = future.done() or future.cancelled()
        if flag:
            _fill(status, future.status, future)
        return flag

    def cancel(self):
        if self.future is not None:
            self.future.cancel()

    Cancel = cancel

    def Free(self):
        self.future = None

    # -- many requests: zcollective.wait
    @staticmethod
    def _first(requests, timeout):
        """The lowest index of a completed request (None: none yet; UNDEFINED: all null)."""
        done = Request._done(requests, timeout)
        return UNDEFINED if done is None else (done[0] if done else None)

    @staticmethod
    def _done(requests, timeout):
        """The indices of the completed requests (None: all null)."""
        active = [(i, r.future) for i, r in enumerate(requests) if r]
        if not active:
            return None
        done, _ = zc.wait([f for _, f in active], timeout=timeout, return_when=zc.FIRST_COMPLETED)
        return [i for i, f in active if f in done]

    @classmethod
    def waitany(cls, requests, status=None):
        index = cls._first(requests, None)
        if index == UNDEFINED:
            return UNDEFINED, None
        return index, requests[index]._complete(status)

    @classmethod
    def testany(cls, requests, status=None):
        index = cls._first(requests, 0)
        if index == UNDEFINED:
            return UNDEFINED, True, None
        if index is None:
            return UNDEFINED, False, None
        return index, True, requests[index]._complete(status)

    @classmethod
    def waitall(cls, requests, statuses=None):
        zc.wait([r.future for r in requests if r])
        return cls._all(requests, statuses)

    @classmethod
    def testall(cls, requests, statuses=None):
        active = [r.future for r in requests if r]
        _, not_done = zc.wait(active, timeout=0)
        if not_done:
            return False, None
        return True, cls._all(requests, statuses)

    @staticmethod
    def _all(requests, statuses):
        values = []
        for request in requests:
            status = Status() if statuses is not None else None
            values.append(request._complete(status))
            if statuses is not None:
                statuses.append(status)
        return values

    @classmethod
    def waitsome(cls, requests, statuses=None):
        return cls._some(requests, statuses, None)

    @classmethod
    def testsome(cls, requests, statuses=None):
        return cls._some(requests, statuses, 0)

    @classmethod
    def _some(cls, requests, statuses, timeout):
        indices = cls._done(requests, timeout)
        if indices is None:
            return None, None
        values = []
        for i in indices:
            status = Status() if statuses is not None else None
            values.append(requests[i]._complete(status))
            if statuses is not None:
                statuses.append(status)
        return indices, values

    @classmethod
    def Waitany(cls, requests, status=None):
        return cls.waitany(requests, status)[0]

    @classmethod
    def Testany(cls, requests, status=None):
        index, flag, _ = cls.testany(requests, status)
        return index, flag

    @classmethod
    def Waitall(cls, requests, statuses=None):
        cls.waitall(requests, statuses)
        return True

    @classmethod
    def Testall(cls, requests, statuses=None):
        return cls.testall(requests, statuses)[0]

    @classmethod
    def Waitsome(cls, requests, statuses=None):
        return cls.waitsome(requests, statuses)[0]

    @classmethod
    def Testsome(cls, requests, statuses=None):
        return cls.testsome(requests, statuses)[0]


REQUEST_NULL = Request()


class Message:
    """A matched probe's message handle (zcollective's); null once received. A predefined
    constant (``MESSAGE_NO_PROC``) stays as it is, as in mpi4py."""

    def __init__(self, handle=None, constant=False):
        self.handle = handle.handle if isinstance(handle, Message) else handle
        self.constant = constant

    def __bool__(self):
        return self.handle is not None and bool(self.handle)

    def __eq__(self, other):
        if not isinstance(other, Message):
            return NotImplemented
        return (not self and not other) if (self.handle is None or other.handle is None) else \
            self.handle == other.handle

    __hash__ = object.__hash__

    def _received(self):
        if not self.constant:  # (a handle received through is null after, as MPI's)
            self.handle = None

    def recv(self, status=None):
        value = self.handle.recv(status=status)
        self._received()
        return value

    def irecv(self):
        request = Request(self.handle.recv_async())
        self._received()
        return request

    @classmethod
    def probe(cls, comm, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        return comm.mprobe(source, tag, status)

    @classmethod
    def iprobe(cls, comm, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        return comm.improbe(source, tag, status)


MESSAGE_NULL = Message(constant=True)


class Comm:
    """An MPI communicator: a zcollective group."""

    def __init__(self, group=None):
        self.group = group

    def __bool__(self):
        return self.group is not None

    def Get_size(self):
        return self.group.size

    def Get_rank(self):
        return self.group.rank

    size = property(Get_size)
    rank = property(Get_rank)

    def Dup(self):
        return Comm(self.group.dup())

    def Free(self):
        group, self.group = self.group, None
        group.teardown()

    # -- point to point
    def send(self, obj, dest, tag=0):
        self.group.send(obj, dest, tag)

    def ssend(self, obj, dest, tag=0):
        self.group.ssend(obj, dest, tag)

    def recv(self, buf=None, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        if buf is not None:  # (mpi4py's own argument check: zcollective has no buffer to pass)
            warnings.warn("the 'buf' argument is deprecated", UserWarning, stacklevel=2)
        return self.group.recv(source, tag, status=status)

    def sendrecv(self, sendobj, dest, sendtag=0, recvbuf=None, source=ANY_SOURCE, recvtag=ANY_TAG,
                 status=None):
        return self.group.sendrecv(sendobj, dest, source, sendtag, recvtag, status=status)

    def isend(self, obj, dest, tag=0):
        return Request(self.group.send_async(obj, dest, tag))

    def issend(self, obj, dest, tag=0):
        return Request(self.group.ssend_async(obj, dest, tag))

    def irecv(self, buf=None, source=ANY_SOURCE, tag=ANY_TAG):
        return Request(self.group.recv_async(source, tag))

    def probe(self, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        _fill(status, self.group.probe(source, tag))
        return True

    def iprobe(self, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        came = self.group.iprobe(source, tag)
        _fill(status, came)
        return came is not None

    def mprobe(self, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        handle = self.group.mprobe(source, tag)
        _fill(status, handle)
        return Message(handle)

    def improbe(self, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        handle = self.group.improbe(source, tag)
        if handle is None:
            return None
        _fill(status, handle)
        return Message(handle)

    # -- collectives the tests use
    def bcast(self, obj, root=0):
        return self.group.broadcast(obj, root)

    def barrier(self):
        self.group.barrier()

    Barrier = barrier


COMM_NULL = Comm()
COMM_WORLD = Comm(zc.Group())  # from the environment the launcher set
COMM_SELF = Comm(COMM_WORLD.group.split(COMM_WORLD.group.rank))
SYNC = Comm(COMM_WORLD.group.dup())  # the runner's own, between tests (never the tests')


def _no_proc():
    improbe = getattr(COMM_SELF.group, "improbe", None)
    try:
        handle = improbe(PROC_NULL) if improbe is not None else None
    except Exception:  # noqa: BLE001 (zcollective refuses PROC_NULL: MESSAGE_NO_PROC is missing)
        handle = None
    return Message(handle if handle is not None else object(), constant=True)


MESSAGE_NO_PROC = _no_proc()


def finalize():
    """The runner's end: every communicator it made, torn down (the tests free their own)."""
    for comm in (SYNC, COMM_SELF, COMM_WORLD):
        if comm.group is not None:
            comm.Free()
