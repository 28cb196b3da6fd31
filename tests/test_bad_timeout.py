"""A timeout that is no number of seconds a call could wait (negative, NaN) is refused at once with
a ValueError naming the rank and the call, and nothing is sent: a reviewer found ``timeout=-1``
taken ("timed out after -1 s") and ``timeout=nan`` taken as no bound."""

import math

import pytest

import zcollective as zc


@pytest.mark.parametrize("timeout", [-1, -0.5, math.nan])
def test_a_timeout_no_call_could_wait_is_refused_and_nothing_is_sent(timeout):
    with zc.Group(rank=0, size=1) as group:
        with pytest.raises(ValueError, match=r"rank 0: allreduce's timeout must be a number of seconds"):
            group.allreduce(1, timeout=timeout)
        with pytest.raises(ValueError, match=r"rank 0: recv's timeout must be"):
            group.recv(source=0, timeout=timeout)
        assert group.allreduce(2, timeout=5) == 2  # nothing was sent: the next call pairs up
        group.send("x", dest=0)
        assert group.recv(source=0, timeout=0) == "x"
