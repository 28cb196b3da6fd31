"""Every bound on time and size that others depend on, with how they relate.

The pivot is a group's liveness bound L (``liveness_timeout``; users set it, within
:data:`MIN_LIVENESS_S` .. :data:`MAX_LIVENESS_S`): a peer silent for about L is lost. So whatever travels
in one piece (a part of a large frame, a data-plane chunk) must arrive well within the smallest L even on
a slow link, and the waits that end a call or a program are bounded apart from it. ``tests/test_wire.py``
checks the relations written here.
"""

from __future__ import annotations

# -- timeouts and liveness (the defaults of config.py's settings) --------------------------------

DEFAULT_INIT_TIMEOUT_S = 300.0  # replicas of a job may start minutes apart on a busy cluster
DEFAULT_OP_TIMEOUT_S = 1800.0  # torch.distributed's default: long steps pass, hangs end
DEFAULT_WARN_AFTER_S = 60.0  # Horovod's stall inspector's: well past any step's jitter, far below
# op_timeout (a stalled job says who and where within a minute, not after 30)
MAX_STALL_WARNINGS = 4  # a stall is warned of at 1, 2, 4 and 8 times warn_after, then only its end
DEFAULT_LIVENESS_S = 10.0  # a silent peer (host down, cable cut) is declared lost after this
MIN_LIVENESS_S = 1.0  # below this, scheduler hiccups on a loaded host look like deaths
MAX_LIVENESS_S = 86400.0  # a day; libzmq's heartbeat options are int milliseconds (inf overflows)
HEARTBEAT_MIN_IVL_MS = 100  # pings no more often than this, whatever L
HANDSHAKE_MIN_MS = int(MIN_LIVENESS_S * 1000)  # a data link's handshake gets L, never less: a
# handshake on a busy host still fits


def heartbeats(liveness_s: float) -> tuple[int, int, int]:
    """ZMTP heartbeat options (interval, timeout, TTL, in ms) for bound L: libzmq's own threads answer
    pings, outside the GIL, so a busy process is never taken for a dead one. A ping every L/3; its pong due
    within L minus that; a peer's pings may stop for L: lost within about L."""
    ms = int(liveness_s * 1000)
    ivl = max(HEARTBEAT_MIN_IVL_MS, ms // 3)
    return ivl, ms - ivl, ms


# -- what travels in one piece: well within the smallest L on a slow link ------------------------

# A frame above WIRE_PART_BYTES travels as parts (see docs/protocol.md, *Frames*), each within the
# smallest heartbeat timeout (L = 1 s: 667 ms) even on a link shared by many connections: 256 KiB
# take 0.33 s at 0.8 MB/s (100 Mbit/s shared by 16). On loopback 256 KiB to 4 MiB parts cost the
# same: the receiver's one copy to join them, 4-6 ms of CPU per 16 MiB (~3-4 GB/s), plus ~5 us a part.
SLOW_LINK_BYTES_S = 0.8e6  # the slowest link a part must cross within the smallest timeout
WIRE_PART_BYTES = 1 << 18
LOCAL_PART_BYTES = 1 << 26  # a group on one host: 64 MiB cross loopback in tens of ms, far inside
# any L, and the arrays users send most (up to 64 MiB) need no join
CHUNK_BYTES = 1 << 19  # a data-plane chunk, the largest: 0.42 s at 10 Mbit/s, within L = 1 s (a
# data link is one connection, not one of 16; data ports take no larger frame)
MIN_CHUNK_BYTES = 1 << 16  # the smallest: below, the per-chunk cost (a header, a poll, a tag)
# shows even on a slow link
CHUNKS_PER_PART = 32  # a ring or chain fills in about one chunk per hop: with a part (a segment,
# a rank's share) cut into this many, filling costs a few percent of the transfer (measured on
# shaped links, benchmarks/README.md: 512 KiB chunks 1.16-1.29x the bound at N = 8, 128 KiB 1.07-1.18x)

MAX_JOB_CHARS = 128  # a job's name (config checks it, a JOIN carries it whole): both names
# of a refusal fit in its text (MAX_REFUSAL_BYTES)

# -- waits around a call and at an ending --------------------------------------------------------

AWAY_S = 0.002  # the program out of the library this long: a stand-in thread (rank 0's server,
# an interior rank's relay) takes the turn (shorter, and a tight loop of calls would hand the
# sockets over and back at every call)
PARK_BUSY_S = AWAY_S  # a stand-in thread looks this often whether to take the turn, with calls in flight
PARK_IDLE_S = 0.05  # ... and this often without (a loss, a question or a subtree's part waits this long)
POLL_SLICE_S = 0.5  # longest a wait sleeps before re-checking failure and thread liveness (< L)
JOIN_RESEND_S = 1.0  # a member not yet welcomed sends its JOIN again this often (one lost to a
# connection made twice, or its WELCOME, would leave it waiting out its join timeout)
STATUS_WAIT_S = 1.0  # how long a timed-out call waits for the coordinator to say who is late
INTERRUPTED_MOVE_S = 0.5  # an interrupted call whose data moves here finishes if it can within this
# (256 MiB cross shared memory in ~0.1 s): given up mid-move, a rank that finished keeps its result
DATA_LOSS_GRACE_S = 0.5  # a data link lost: how long the control plane may take to say why
CLOSE_LINGER_MS = 2000  # time for the last results of a teardown to leave; bounds teardown
TREE_LINK_WAIT_S = 5.0  # joining, a rank waits this long at most for its tree links' handshakes (a link
# not made by then is made when a message needs it)
EXIT_LINGER_MS = 5000  # a program ending without teardown: time for what it produced to leave
# (results, contributions, notices) and for rank 0's last BYEs to be answered; a peer that
# stopped reading holds a process no longer
SENT_AT_FAILURE_S = 5.0  # a send libzmq was sending when the group failed gets this long to leave
# (then it is done, as its receiver takes it), unless its receiver is the rank lost; else it fails
LEAVING_SHARE = 1.0  # a program ending waits this share of the liveness bound for its point-to-point
# messages libzmq still sends (a receiver stopped within the bound takes them in after); those
# still leaving then are cut off, and their receiver told
STOP_TIMEOUT_S = CLOSE_LINGER_MS / 1000 + 3.0  # rank 0's background thread stops within this
EXIT_WAIT_S = 30.0  # rank 0's program ended with calls the others have not reached yet: they
# are usually a step behind, so wait this long for them (a rank that is lost or ends stops the wait)

# -- elastic groups (zcollective._elastic) -----------------------------------------
FORM_REACH_S = 2.0  # shrink: a survivor tries this long to reach a would-be host before it
# counts that one lost too (a killed host's port refuses at once; this bounds a silent one)
FORM_PROBE_S = 0.25  # ... and this long a rank 0 it only saw close its connection: one that is
# shrinking binds again within milliseconds (FORM_PROBE_S < FORM_REACH_S)
FORM_WAIT_S = 2.0  # shrink: the host waits this long for the survivors it expects, then forms
# the group with those that came (the others are left out, alike on every survivor)
FORM_BIND_RETRY_S = 0.3  # the host binds its port again this long: the port's last
# holder, just killed, may still be closing its files
HOST_WINDOW_S = FORM_REACH_S / 2  # a survivor hosts only if it shrinks this soon after its
# group failed: later, the others may have counted it lost already (no split group)
