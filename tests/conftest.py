"""Shared by the tests, and by the replica processes they start: marker files
that order steps across processes instead of sleeps.

A rank touches a marker when it reaches a point; another waits for the file
with a bound, and fails loudly (naming the marker) if it never appears.
"""

import os
import time

MARKER_WAIT_S = 30.0  # a rank reaches its point within this, even on a loaded 2-core machine
MARKER_POLL_S = 0.01


def touch(path):
    """Say, by creating ``path``, that this process reached a point."""
    with open(path, "w"):
        pass


def wait_for(*paths, timeout=MARKER_WAIT_S):
    """Wait until every file in ``paths`` exists.

    Raises
    ------
    TimeoutError
        One did not appear within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    for path in paths:
        while not os.path.exists(path):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"marker {path} did not appear within {timeout:g} s")
            time.sleep(MARKER_POLL_S)  # polling a file, with a bound
