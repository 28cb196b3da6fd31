"""mpi4py's vendored test modules are run by tests/test_mpi4py_p2p.py in replica processes,
through the adapter in shim/, never collected by pytest itself."""

collect_ignore_glob = ["*.py", "shim/*"]
