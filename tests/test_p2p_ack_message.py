"""A matched message (mprobe's Message) received by two threads at once: one gets its value, the
other CollectiveError, never both past the "received already?" check (review of issue 46). The
first thread is held, by a trace function, at the first line of Message.recv after that check,
while the second receives: deterministic, where a plain race would almost never interleave."""

import inspect
import sys
import threading

import zcollective as zc
from zcollective._matched import Message

HOLD_S = 5.0  # the first thread waits this long at most for the second


def _after_check_line() -> int:
    """The last line of Message.recv's "received already" raise (a line past it: the check is passed)."""
    lines, first = inspect.getsourcelines(Message.recv)
    return first + next(i for i, line in enumerate(lines) if 'received once")' in line)


def test_a_message_received_by_two_threads_at_once_is_received_once():
    end, code = _after_check_line(), Message.recv.__code__
    held, second_done = threading.Event(), threading.Event()
    results = {}

    def hold(frame, event, arg):
        if event == "line" and frame.f_lineno > end and not held.is_set():
            held.set()
            second_done.wait(HOLD_S)  # the second thread receives meanwhile
        return hold

    def tracer(frame, event, arg):
        return hold if frame.f_code is code else None

    def receive(name, message, traced):
        if traced:
            sys.settrace(tracer)
        else:
            held.wait(HOLD_S)
        try:
            results[name] = ("value", message.recv())
        except zc.CollectiveError:
            results[name] = ("refused",)
        finally:
            sys.settrace(None)
            if not traced:
                second_done.set()

    with zc.Group(rank=0, size=1) as group:
        group.send(("v", 1), 0, tag=1)
        message = group.mprobe(0, 1, timeout=5)
        threads = [threading.Thread(target=receive, args=(name, message, name == "first"))
                   for name in ("first", "second")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2 * HOLD_S)
        assert held.is_set()
        assert results == {"first": ("value", ("v", 1)), "second": ("refused",)}, results
        assert not message
