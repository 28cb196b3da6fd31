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
DEFAULT_WARN_AFTER_S = 60.0  # Horovod's stall inspector's: past any step's jitter, far below op_timeout
MAX_STALL_WARNINGS = 4  # a stall is warned of at 1, 2, 4 and 8 times warn_after, then only its end
DEFAULT_LIVENESS_S = 10.0  # a silent peer (host down, cable cut) is declared lost after this
MIN_LIVENESS_S = 1.0  # below this, scheduler hiccups on a loaded host look like deaths
MAX_LIVENESS_S = 86400.0  # a day; libzmq's heartbeat options are int milliseconds (inf overflows)
HEARTBEAT_MIN_IVL_MS = 100  # pings no more often than this, whatever L
HANDSHAKE_MIN_MS = int(MIN_LIVENESS_S * 1000)  # a data link's handshake gets L, never less (busy hosts)


def heartbeats(liveness_s: float) -> tuple[int, int, int]:
    """ZMTP heartbeat options (interval, timeout, TTL, in ms) for bound L: libzmq's own threads answer
    pings, outside the GIL, so a busy process is never taken for a dead one. A ping every L/3; its pong due
    within L minus that; a peer's pings may stop for L: lost within about L."""
    ms = int(liveness_s * 1000)
    ivl = max(HEARTBEAT_MIN_IVL_MS, ms // 3)
    return ivl, ms - ivl, ms


# -- what travels in one piece: well within the smallest L on a slow link ------------------------

# A frame above WIRE_PART_BYTES travels as parts (docs/protocol.md, *Frames*), each within the smallest
# heartbeat timeout (667 ms) on a shared link: 256 KiB take 0.33 s at 0.8 MB/s (100 Mbit/s by 16).
SLOW_LINK_BYTES_S = 0.8e6  # the slowest link a part must cross within the smallest timeout
WIRE_PART_BYTES = 1 << 18
LOCAL_PART_BYTES = 1 << 26  # one host: 64 MiB cross loopback in tens of ms, far inside any L
CHUNK_BYTES = 1 << 19  # a data-plane chunk, the largest: 0.42 s at 10 Mbit/s, within L = 1 s
MIN_CHUNK_BYTES = 1 << 16  # the smallest: below, the per-chunk cost shows even on a slow link
CHUNKS_PER_PART = 32  # a pipeline fills in about a chunk per hop: a few percent (benchmarks/README.md)

MAX_JOB_CHARS = 128  # a job's name: both names of a refusal fit in its text (MAX_REFUSAL_BYTES)

# -- waits around a call and at an ending --------------------------------------------------------

AWAY_S = 0.002  # the program away this long: a stand-in thread takes the turn (shorter: ping-pong per call)
PARK_BUSY_S = AWAY_S  # a stand-in thread looks this often whether to take the turn, with calls in flight
PARK_IDLE_S = 0.05  # ... and this often without (a loss, a question or a subtree's part waits this long)
POLL_SLICE_S = 0.5  # longest a wait sleeps before re-checking failure and thread liveness (< L)
JOIN_RESEND_S = 1.0  # a member not yet welcomed sends its JOIN again this often (one may be lost)
STATUS_WAIT_S = 1.0  # how long a timed-out call waits for the coordinator to say who is late
INTERRUPTED_MOVE_S = 0.5  # an interrupted call moving data finishes if it can within this (256 MiB: 0.1 s)
DATA_LOSS_GRACE_S = 0.5  # a data link lost: how long the control plane may take to say why
CLOSE_LINGER_MS = 2000  # time for the last results of a teardown to leave; bounds teardown
TREE_LINK_WAIT_S = 5.0  # joining, the most a rank waits for its tree links (later: made as needed)
EXIT_LINGER_MS = 5000  # ending without teardown: time for what it produced to leave, BYEs answered
SENT_AT_FAILURE_S = 5.0  # a send under way when the group failed gets this long (unless to the rank lost)
LEAVING_SHARE = 1.0  # share of the liveness bound an ending program gives messages still leaving
STOP_TIMEOUT_S = CLOSE_LINGER_MS / 1000 + 3.0  # rank 0's background thread stops within this
EXIT_WAIT_S = 30.0  # rank 0 ended with calls the others have not reached: they are usually a step behind

# -- elastic groups (zcollective._elastic) -----------------------------------------
FORM_REACH_S = 2.0  # shrink: a survivor tries this long to reach a would-be host (bounds a silent one)
FORM_PROBE_S = 0.25  # ... a rank 0 it saw close its connection: shrinking, it binds again within ms
FORM_WAIT_S = 2.0  # shrink: the host waits this long for the survivors it expects, then forms
GROW_FORM_WAIT_S = 10.0  # grow: its members completed the GROW (alive), so when too few came within
# FORM_WAIT_S the host waits up to this for each to come or withdraw (a loaded host's member interrupted
# as it starts takes seconds to say it withdrew) before it leaves them out; the members wait as long
FORM_BIND_RETRY_S = 0.3  # the host binds its port again this long (a killed holder may still be closing)
HOST_WINDOW_S = FORM_REACH_S / 2  # a survivor hosts only if it shrinks this soon (later: counted lost)

# -- point to point ---------------------------------------------------------------------------------

MAX_TAG = (1 << 31) - 1  # a tag travels in the header's int32
