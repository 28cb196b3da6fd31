"""A reduce-scatter chunk moved from one data link to another, with a secret (an attack's
finding on the leaders' ring between hosts: docs/protocol.md, *Shared memory*). A chunk's
MAC binds its session, seq, kind, origin, step and index, not its recipient; a host's
leader takes reduce-scatter chunks from its previous rank and from the previous host's
leader, so a chunk the previous leader sent its own next rank, copied by a path attacker
into the link to this leader, must not be taken by a call of the ring of all ranks (it
was: a wrong sum, silently). Pure: the real ChunkRules, ChunkMac and RingAllreduce, as
DataPlane.start and DataPlane._take use them, no sockets. Layout: 2 hosts x 2 ranks,
ranks 0, 1 on one and 2, 3 on the other; leaders 0 and 2."""

import numpy as np

from zcollective._format._mac import ChunkMac
from zcollective._io._reducing import reducer
from zcollective._protocol import _chunks
from zcollective._protocol._ring import HOSTS, RING, RingAllreduce

SECRET = b"a-secret-of-attack8-only-yyyyyyyyyy"
SESSION, SEQ, N = 0x1234, 7, 4
LEADERS = [0, 2]


def senders_of(rank):
    """As DataPlane.start computes them (the previous rank; at a leader, the previous leader too)."""
    senders = {RING: (rank - 1) % N}
    if rank in LEADERS:
        at = LEADERS.index(rank)
        senders[HOSTS] = LEADERS[(at - 1) % len(LEADERS)]
    return senders


def make_rules(rank, secret=SECRET):
    rules = _chunks.ChunkRules(rank, N)
    rules.start(SESSION, None if secret is None else ChunkMac(secret), rank, N, senders_of(rank))
    return rules


def frames_of(rules, chunk):
    header = rules.header(chunk.kind, SEQ, chunk.step, chunk.index)
    payload = memoryview(np.ascontiguousarray(chunk.payload)).cast("B").tobytes()
    tag = rules.mac.tag(header, payload) if rules.mac is not None else b""
    return [header, tag, payload]


def deliver(rules, job, frames):
    verdict = rules.check(frames, SEQ, SEQ + 1, job.via)
    if verdict.reason != _chunks.NOW:
        return verdict.reason
    return "taken" if job.receive(verdict.kind, verdict.step, verdict.index, frames[2], frames,
                                  verdict.origin) else "dropped as unexpected"


def ring(moved, secret=SECRET):
    """A ring allreduce of all 4 ranks (the data plane's, not the leaders'), in lock step;
    ``moved``: the attacker copies rank 0's step-0 RS chunk (for rank 1) into rank 2's link
    first. Returns each rank's result and what happened to the moved chunk."""
    elements = 1 << 12
    inputs = [np.full(elements, 10.0 ** r, dtype=np.float64) for r in range(N)]
    rules = [make_rules(r, secret) for r in range(N)]
    jobs = [RingAllreduce(r, N, inputs[r].copy(), reducer("add", None)) for r in range(N)]
    fate = None
    if moved:
        stolen = frames_of(rules[0], jobs[0].outbox[0])  # rank 0 -> rank 1, RS step 0 index 0
        fate = deliver(rules[2], jobs[2], stolen)  # ... moved into the link 1 -> 2 (or 0 -> 2)
    for _ in range(4 * N):
        pending = [(r, list(jobs[r].outbox)) for r in range(N)]
        for r, _ in pending:
            jobs[r].outbox.clear()
        for r, chunks in pending:
            nxt = (r + 1) % N
            for c in chunks:
                frames = c.frames if c.frames is not None else frames_of(rules[r], c)
                deliver(rules[nxt], jobs[nxt], frames)
    return [j.result() for j in jobs], fate


def test_an_rs_chunk_moved_from_the_previous_leaders_ring_link_is_refused_at_a_leader():
    want = sum(10.0 ** r for r in range(N))
    clean, _ = ring(False)
    assert all((res == want).all() for res in clean)
    results, fate = ring(True)
    wrong = [r for r, res in enumerate(results) if not (res == want).all()]
    assert fate != "taken" and not wrong, (
        f"rank 0's RS chunk for rank 1, moved into rank 2's link, was {fate}; wrong results on ranks "
        f"{wrong}: e.g. rank {wrong[0] if wrong else '-'} got {np.unique(results[wrong[0]]) if wrong else ''}"
        f" (want {want})")


def test_the_leaders_ring_takes_the_previous_leaders_chunks_not_the_previous_ranks():
    """Rank 2 (a leader) in the leaders' ring (via HOSTS) takes RS chunks from rank 0, the
    previous leader, and not from rank 1, its previous rank (which sends it RS chunks only in
    the ring of all ranks)."""
    def job_at(rank):
        at = LEADERS.index(rank)
        job = RingAllreduce(at, len(LEADERS), np.zeros(1 << 12), reducer("add", None))
        job.via, job.ranks = HOSTS, LEADERS
        return job
    sender = RingAllreduce(0, len(LEADERS), np.ones(1 << 12), reducer("add", None))
    assert deliver(make_rules(2), job_at(2), frames_of(make_rules(0), sender.outbox[0])) == "taken"
    assert deliver(make_rules(2), job_at(2), frames_of(make_rules(1), sender.outbox[0])) == "origin"
