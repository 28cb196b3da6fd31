"""Shared by the tests that attack the master port."""


class Boom:
    """Unpickling this creates a file: proof that something was executed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
