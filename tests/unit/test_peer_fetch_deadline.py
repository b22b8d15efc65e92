"""prefill_worker/peer_fetch.py's deadline is sized from the work: the peer pins its blocks
between two of its engine steps, so a fetch may wait for STEP_WAITS of the slowest recent
step (StepPace, fed by this worker's own engine), plus the bytes at the slowest rate worth
waiting for, never past the decode reservation's time less the compute's margin."""
from prefill_worker.peer_fetch import (PEER_FETCH_BASE_S, PEER_FETCH_MARGIN_S,
                                       PEER_FETCH_MIN_BYTES_PER_S, STEP_DECAY, STEP_WAITS,
                                       PeerFetch, StepPace)


def _fetch(bytes_per_block=1_000_000):
    f = PeerFetch.__new__(PeerFetch)
    f.bytes_per_block, f.pace = bytes_per_block, StepPace()
    return f


def test_the_slowest_recent_step_decays_step_by_step():
    p = StepPace()
    p.on_step(3.0, {"r": 512})
    p.on_step(0.01, {"r": 1})
    assert p.slowest_s == 3.0 * STEP_DECAY
    p.on_step(5.0, {"r": 512})
    assert p.slowest_s == 5.0
    for _ in range(400):
        p.on_step(0.02, {"r": 1})
    assert p.slowest_s == 0.02                      # a slow step long past is forgotten


def test_the_deadline_waits_for_the_peers_steps_and_its_bytes_within_the_reservation():
    f = _fetch()
    assert f.deadline_s(10, None) == PEER_FETCH_BASE_S + 10e6 / PEER_FETCH_MIN_BYTES_PER_S
    f.pace.on_step(4.0, {"r": 512})                 # a CPU prefill step of seconds
    want = PEER_FETCH_BASE_S + STEP_WAITS * 4.0 + 10e6 / PEER_FETCH_MIN_BYTES_PER_S
    assert f.deadline_s(10, None) == want
    assert f.deadline_s(10, 5.0) == 5.0 - PEER_FETCH_MARGIN_S
    assert f.deadline_s(10, 100.0) == want
