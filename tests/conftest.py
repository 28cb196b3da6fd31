"""Shared by the tests, and by the replica processes they start: marker files
that order steps across processes instead of sleeps.

A rank touches a marker when it reaches a point; another waits for the file
with a bound, and fails loudly (naming the marker) if it never appears.

Also what keeps the hundreds of processes the suite starts cheaper (much of
the suite's time is their start-up): zcollective and the tests' modules, which
replicas import to find the function they run, are compiled once per session.
"""

import contextlib
import importlib.util
import os
import re
import signal
import sys
import threading
import time

import _zygote
import pytest
from netns import Hosts, NetnsUnavailable

import zcollective
import zcollective.testing
from zcollective.testing import report

collect_ignore = ["mpi4py"]  # mpi4py's vendored tests: run by test_mpi4py_p2p.py in replicas, not collected
MARKER_WAIT_S = 30.0  # a rank reaches its point within this, even on a loaded 2-core machine
MARKER_POLL_S = 0.01
MARKER_WAIT_AFTER_S = 5.0  # a marker's wait failed: the other replicas have this long to end
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
QUIET = 2  # compileall: not even errors (a read-only tree just stays uncompiled)
COMPILED_ENV = "ZC_TESTS_COMPILED"  # set by the session: its replicas, importing this, skip it


def compile_once():
    """Write the bytecode of zcollective and of the tests' modules, where
    Python looks for it (``__pycache__``, ignored by git).

    With PYTHONDONTWRITEBYTECODE (set on many CI machines) no interpreter
    writes it, so each replica process would compile the package (and the test
    module it imports to find its function) from source: a good part of its
    start-up. The interpreter checks each file's recorded source mtime and size
    on import, so a stale file is never used; compileall skips files already up
    to date.
    """
    if os.environ.get(COMPILED_ENV):
        return
    import compileall  # here: the replicas that import this module never need it

    package = os.path.dirname(importlib.util.find_spec("zcollective").origin)
    for directory in (package, TESTS_DIR):
        compileall.compile_dir(directory, maxlevels=0, quiet=QUIET)
    os.environ[COMPILED_ENV] = "1"


compile_once()

# replicas forked from warm processes: the suite starts hundreds (see _zygote.py)
zcollective.testing.spawner = _zygote.forked

# A run started in the background by a non-interactive shell ignores SIGINT, and every process it
# starts would too: the tests of Ctrl-C would then wait for a KeyboardInterrupt that never comes.
# A handler (not SIG_IGN) is reset to the default at exec, so the processes started get Python's.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def raising_on(rank, kind, message):
    """An elementwise ``a += b`` (as the data plane and shared memory reduce) that raises
    ``kind(message)`` on ``rank``: a reduce function one rank refuses. Called on every rank."""
    me = zcollective.get_rank()

    @zcollective.elementwise
    def add(a, b):
        if me == rank:
            raise kind(message)
        a += b
        return a
    return add


def touch(path):
    """Say, by creating ``path``, that this process reached a point."""
    with open(path, "w"):
        pass


def wait_for(*paths, timeout=MARKER_WAIT_S, watch=None):
    """Wait until every file in ``paths`` exists.

    ``watch``: the :class:`~zcollective.testing.Replicas` that make them; if one
    of its processes ends first, or the wait times out, the test fails at once
    with every rank's outcome and output (not a bare timeout).

    Raises
    ------
    TimeoutError
        One did not appear within ``timeout`` seconds (no ``watch``).
    """
    deadline = time.monotonic() + timeout
    for path in paths:
        while not os.path.exists(path):
            ended = watch is not None and any(p.poll() is not None for p in watch.procs)
            if ended and os.path.exists(path):
                break  # made just before its maker ended
            if ended or time.monotonic() >= deadline:
                why = "a replica ended before" if ended else f"did not appear within {timeout:g} s:"
                headline = f"marker {path}: {why} it appeared"
                if watch is None:
                    raise TimeoutError(headline)
                # the others end too, with the errors that explain it, or are killed
                raise AssertionError(report(watch.wait(MARKER_WAIT_AFTER_S), headline))
            time.sleep(MARKER_POLL_S)  # polling a file, with a bound


LAUNCHED_READER_JOIN_S = 5.0  # the launcher ended: the rest of its output is read within this


def launched_until_seen(args, seen, marker, timeout, **kwargs):
    """Run the launcher's command ``args`` (as ``subprocess.run``) and touch
    ``marker`` once a line of its output (stdout and stderr together)
    satisfies ``seen``: a job waits for it where it would sleep for long
    enough. Returns (exit code, the whole output).

    Raises
    ------
    subprocess.TimeoutExpired
        It did not end within ``timeout`` seconds (it is killed).
    """
    import subprocess

    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if seen(line) and not os.path.exists(marker):
                touch(marker)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(LAUNCHED_READER_JOIN_S)
        proc.stdout.close()
    return proc.returncode, "".join(lines)


class InterruptAtLine:
    """A trace hook (``sys.settrace``) sending SIGINT to the main thread at the
    k-th line run in a file whose name ``where`` accepts: a Ctrl-C at any
    line, met by the library's real signal handling."""

    def __init__(self, k, where):
        self.k, self.where, self.lines, self.sent = k, where, 0, False

    def __call__(self, frame, event, arg):
        if self.sent or not self.where(frame.f_code.co_filename):
            return None
        if event == "line":
            self.lines += 1
            if self.lines == self.k:
                self.sent = True
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                return None
        return self


def ring_loss_forms(rank, lost, seq, op, pids, host, data_endpoints, jobs):
    """Every exact message rank ``rank`` may get when rank ``lost`` is lost
    while call ``seq`` (``op``) moves peer to peer, as regular expressions:

    - the coordinator's, when its probes find the lost rank's connection gone;
    - this rank's own data plane's, when it is the rank before the lost one
      in the ring (the link to it closed; a link's far end cannot tell);
    - that rank's, passed on by the coordinator.

    ``pids``: rank -> process id; ``data_endpoints``: the data ports (from
    the WELCOME); ``jobs``: rank -> (chunks, bytes) that rank's part of the
    call receives in all (each form names what came of it)."""
    size = len(data_endpoints)
    prev = (lost - 1) % size

    def data_link(r):
        chunks, nbytes = jobs[r]
        return (rf"seq {seq} {op}: rank {r} lost its data link to rank {lost} "
                rf"\({re.escape(data_endpoints[lost])}\): connection closed or heartbeats unanswered; "
                rf"ring {op}: received \d+ of {chunks} chunks \(\d+ of {nbytes} bytes\) "
                rf"from rank {(r - 1) % size}")

    forms = [rf"rank {lost} \(pid {pids[lost]} on {re.escape(host)}\) was lost "
             rf"\(connection closed or heartbeats unanswered\); seq {seq} {op} was matched; "
             rf"its data moves peer to peer"]
    if rank == prev:
        forms.append(data_link(rank))
    elif prev != lost:
        forms.append(data_link(prev) + rf" \(reported by rank {prev} "
                                       rf"\(pid {pids[prev]} on {re.escape(host)}\)\)")
    return [re.compile(f) for f in forms]


def ring_jobs(n, elements, dtype):
    """rank -> (chunks, bytes) its part of a ring allreduce of ``elements``
    of ``dtype`` on ``n`` ranks receives in all (as its progress reports say)."""
    import numpy as np

    from zcollective._protocol._ring import RingAllreduce

    jobs = (RingAllreduce(r, n, np.empty(elements, dtype=dtype), None) for r in range(n))
    return {job.rank: (job.expected, job.total_bytes) for job in jobs}


MAX_WORKERS = 4  # each test starts a group of processes: more workers would overload the cores


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default, see pyproject.toml): one worker per core
    this process may use, at most :data:`MAX_WORKERS`. Measured with 2 workers
    on 2 cores: 553 tests in 134 s, against 208 s in one process."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


# The longest tests (`python -m pytest --durations=150`), longest first: pytest-xdist hands tests
# out in collection order, so one of them started last would run on alone at the end of the run
# while the other workers idle. "file::function" (every parametrization); one renamed or gone
# just loses its place.
LONGEST_FIRST = (
    "test_ending.py::test_programs_that_end_without_teardown_lose_nothing",
    "test_tree.py::test_a_tree_of_32_gives_up_a_call_a_deep_rank_is_late_for_alike_and_goes_on",
    "test_elastic_edges.py::test_a_busy_rank_0_never_strands_the_prompt_survivors",
    "test_elastic_grow_interrupts.py::test_a_member_withdrawing_after_the_forming_bound_still_counts_as_gone",
    "test_launcher.py::test_examples_run_under_the_launcher",
    "test_torch.py::test_operations_on_tensors_between_processes",
    "test_multihost.py::test_every_operation_across_namespaced_hosts_then_a_link_goes_down",
    "test_faults.py::test_soak_mixed_operations_lose_nothing",
    "test_compose_mail.py::test_a_send_to_a_rank_that_ended_fails_at_once_naming_it",
    "test_zap.py::test_a_flood_of_large_joins_neither_stalls_a_running_group_nor_grows_rank_0",
    "test_slow_links.py::test_large_values_over_a_slow_link_lose_nobody",
    "test_dataplane.py::test_a_rank_interrupted_again_and_again_mid_ring_loses_no_chunk",
    "test_compose_misc.py::test_a_waiting_ranks_completed_after_counts_from_its_call_not_its_warning",
    "test_compose_attack.py::test_a_signal_handlers_exception_at_exit_still_says_goodbye",
    "test_compose_mail.py::test_a_rank_that_ends_while_its_receiver_is_stopped_delivers_its_messages",
    "test_mp_children.py::test_children_ending_after_their_last_call_lose_nothing",
    "test_compose_signals.py::test_ctrl_c_during_a_slow_reduction_ends_the_call_alike_on_every_rank",
    "test_slow_links.py::test_a_program_ending_over_a_slow_link_loses_nothing_it_sent",
    "test_compose_mail.py::test_a_rank_whose_messages_cannot_leave_before_it_ends_says_so_to_their_receiver",
    "test_elastic_edges.py::test_a_late_shrink_is_told_it_was_left_out_even_after_the_others_ended",
    "test_launcher.py::test_a_newcomer_waiting_where_rank_0_was_is_started_again_where_the_coordinator_moved",
    "test_launcher.py::test_replace_lost_starts_newcomers_in_the_place_of_killed_ranks_and_training_sees_every_sample",
    "test_security.py::test_a_flood_of_connections_cannot_silence_heartbeats",
    "test_elastic_edges.py::test_busy_low_ranks_and_a_prompt_high_one_end_in_one_group",
    "test_faults.py::test_strangers_reusing_a_routing_id_cannot_crash_rank_0",
    "test_ending.py::test_a_rank_busy_past_rank_0s_ending_is_told_rank_0_ended_not_lost",
    "test_launcher.py::test_the_summary_quotes_the_users_exception_not_what_the_library_said_after_it",
    "test_ending.py::test_a_rank_ending_with_a_small_broadcast_uncollected_does_not_fail_it_with_a_data_plane",
    "test_tree.py::test_an_interior_rank_killed_mid_call_is_named_everywhere_and_the_rest_shrink_and_go_on",
    "test_tree.py::test_a_tree_of_16_gets_every_call_right_and_names_a_deep_mismatch_exactly",
    "test_threads.py::test_an_interrupt_of_one_thread_fails_its_call_alike_and_spares_the_others",
    "test_shared_hosts.py::test_an_allreduce_across_hosts_crosses_each_hosts_link_once_per_host",
)


def pytest_collection_modifyitems(config, items):
    """:data:`LONGEST_FIRST` first, in its order; the rest keep theirs."""
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.nodeid.rpartition("/")[2].partition("[")[0], len(place)))


INTERRUPT_SURFACE_S = 2.0  # a deferred interrupt comes out within this of its signal


def interrupted_at_line(k, package, fn, *args):
    """Run ``fn(*args)`` with SIGINT sent at the k-th line run in ``package``
    (a directory or one file; :class:`InterruptAtLine`); True if it was
    sent, in which case the KeyboardInterrupt must come out of ``fn`` or,
    deferred by the library, right after it returns."""
    from zcollective._io import _interrupts

    _interrupts.hold_signals()  # (a group does it when it starts; again changes nothing)
    hook = InterruptAtLine(k, lambda name: name.startswith(package))
    sys.settrace(hook)
    try:
        fn(*args)
        sys.settrace(None)
        if hook.sent:  # deferred: it comes once the library has returned
            deadline = time.monotonic() + INTERRUPT_SURFACE_S
            while time.monotonic() < deadline:
                time.sleep(0.001)
            raise AssertionError(f"SIGINT sent at line {k} never came out")
    except KeyboardInterrupt:
        assert hook.sent, "a KeyboardInterrupt nobody sent"
        return True
    finally:
        sys.settrace(None)
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Captured output made UTF-8-safe: what a fuzzed peer sends (a lone
    surrogate in a JSON string) ends up in the library's log, and pytest-xdist
    cannot send a report holding it from a worker."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [(title, text.encode("utf-8", "backslashreplace").decode("utf-8"))
                       for title, text in report.sections]


@contextlib.contextmanager
def hosts_or_skip(n, rate_mbit=None):
    """``n`` namespaced hosts (tests/netns.py), links shaped to ``rate_mbit``;
    the test is skipped, with the reason, where they cannot be built."""
    try:
        with Hosts(n, rate_mbit=rate_mbit) as hosts:
            yield hosts
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
