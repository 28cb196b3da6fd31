"""A stand-in ``mpi4py`` package for running mpi4py's own object point-to-point tests
(tests/mpi4py/, vendored unmodified) on zcollective: ``mpi4py.MPI`` maps MPI's names and shapes
onto zcollective's and adds no semantics of its own. Only tests/test_mpi4py_p2p.py puts it on
``sys.path``, in the replica processes it starts."""

__version__ = "0.0+zcollective"

rc = type("rc", (), {"recv_mprobe": False, "threads": True})()
