"""Scheduler: pure CPU logic, no model. Asserts exact token counts and block ids."""
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=16, block_size=4, budget=16, max_seqs=8, chunked=True):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(budget, max_seqs, chunked), kv)


def req(rid, n, max_tokens=4, base=None):
    """A prompt of n tokens, distinct per request id unless `base` says otherwise."""
    base = 1000 * (ord(rid[0]) - 96) if base is None else base
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens), max_tokens)


def run_step(s, sampled_token=7):
    """Pretend the model ran: advance, and append a token for each sampling request."""
    out = s.schedule()
    s.update(out)
    out.sampled = [x.request.request_id for x in out.scheduled if x.samples]
    for x in out.scheduled:
        if x.samples:
            x.request.output_token_ids.append(sampled_token)
    return out


def plan(out):
    return [(x.request.request_id, x.start, x.num_new_tokens) for x in out.scheduled]


def test_chunked_prefill_splits_long_prompt_under_budget():
    s = make(budget=8)
    a = req("a", 20)
    s.add(a)
    out = run_step(s)
    assert plan(out) == [("a", 0, 8)] and out.sampled == []
    assert plan(run_step(s)) == [("a", 8, 8)]
    out = run_step(s)
    assert plan(out) == [("a", 16, 4)] and out.sampled == ["a"]
    assert plan(run_step(s)) == [("a", 20, 1)]            # decode
    assert a.block_ids == [0, 1, 2, 3, 4, 5]


def test_without_chunking_a_prompt_over_budget_waits():
    s = make(budget=8, chunked=False)
    s.add(req("a", 6))
    s.add(req("b", 6))
    assert plan(run_step(s)) == [("a", 0, 6)]
    assert plan(run_step(s)) == [("a", 6, 1), ("b", 0, 6)]


def test_new_requests_join_between_steps_decode_first():
    s = make(budget=10)
    s.add(req("a", 5))
    run_step(s)
    s.add(req("b", 12))
    # a decodes (1 token), b gets the remaining 9 of the budget
    assert plan(run_step(s)) == [("a", 5, 1), ("b", 0, 9)]
    assert plan(run_step(s)) == [("a", 6, 1), ("b", 9, 3)]


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for r in "abc":
        s.add(req(r, 2))
    assert [x[0] for x in plan(run_step(s))] == ["a", "b"]
    assert len(s.waiting) == 1


def test_preemption_frees_the_latest_request_and_recomputes_it():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = req("a", 7, max_tokens=8), req("b", 8, max_tokens=8)
    s.add(a)
    s.add(b)
    run_step(s)                  # a: 7 tokens (2 blocks), b: 8 tokens (2 blocks): pool full
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    run_step(s)                  # a fits its 9th token in block 1; b needs a third block
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.num_preemptions == 1 and list(s.waiting) == [b] and b.block_ids == []
    assert b.output_token_ids == [7]     # generated tokens are kept and recomputed later


def test_remote_reservation_and_ready():
    s = make(num_blocks=8, block_size=4)
    r = req("r", 10)
    assert s.reserve_remote(r)
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV and r.block_ids == [0, 1, 2]
    assert plan(s.schedule()) == []      # nothing to compute until the KV is there
    r.output_token_ids.append(5)
    s.remote_ready(r)
    assert plan(run_step(s)) == [("r", 10, 1)]
    # a second request with the same prompt now hits the 2 full blocks on reservation
    r2 = req("r2", 10, base=1000 * (ord("r") - 96))
    assert s.reserve_remote(r2)
    assert r2.num_cached_tokens == 8 and r2.block_ids[:2] == [0, 1]


def test_remove_frees_everything():
    s = make()
    a = req("a", 9)
    s.add(a)
    run_step(s)
    s.remove(a)
    assert s.kv.num_held_blocks() == 0 and not s.running


def test_remote_reservations_keep_a_watermark_and_max_num_seqs():
    """A reservation that would leave running requests no block to grow into is refused
    (nothing reserved), and so is one beyond max_num_seqs; running requests then decode
    without preemption."""
    s = make(num_blocks=8, block_size=4, max_seqs=8)
    a = req("a", 12)                          # 3 blocks
    assert s.reserve_remote(a)
    b = req("b", 12)                          # 3 more: 2 free, watermark 2 (a and b)
    assert s.reserve_remote(b) and s.kv.num_free_blocks == 2
    c = req("c", 4)                           # 1 block would leave 1 < watermark 3
    assert not s.reserve_remote(c)
    assert c.block_ids == [] and "c" not in s.remote and s.kv.num_free_blocks == 2
    for r in (a, b):
        r.output_token_ids.append(5)
        s.remote_ready(r)
    for _ in range(4):                        # both cross into a new block: no preemption
        out = run_step(s)
        assert not out.preempted and len(out.scheduled) == 2
    s2 = make(num_blocks=64, block_size=4, max_seqs=2)
    assert s2.reserve_remote(req("x", 4)) and s2.reserve_remote(req("y", 4))
    assert not s2.reserve_remote(req("z", 4))


def test_finish_frees_blocks_but_a_prefill_only_request_keeps_them_until_release():
    s = make()
    a, p = req("a", 6), req("p", 6)
    p.prefill_only = True
    s.add(a)
    s.add(p)
    run_step(s)
    assert a.block_ids == [0, 1] and p.block_ids == [2, 3]
    s.finish(a)
    s.finish(p)
    assert s.running == [] and a.block_ids == [] and p.block_ids == [2, 3]
    assert s.kv.num_free_blocks == 14
    s.release(p)
    assert p.block_ids == [] and s.kv.num_free_blocks == 16
    s.kv.pool.check()


def test_accept_speculative_keeps_the_accepted_tokens_kv_and_trims_the_rest():
    s = make(block_size=4)
    a = req("a", 5, max_tokens=16)
    s.add(a)
    run_step(s)                                    # prompt 5 tokens + 1 sampled: 6 known
    a.spec_token_ids = [1, 2, 3, 4, 5]             # 5 proposals after the last known token
    out = s.schedule()
    s.update(out)
    assert plan(out) == [("a", 5, 6)] and a.block_ids == [0, 1, 2]    # 11 positions
    assert a.num_computed_tokens == 6              # the known token; proposals once verified
    s.accept_speculative(a, 5 + 1 + 1)             # the known token and one draft accepted
    assert a.num_computed_tokens == 7 and a.block_ids == [0, 1]       # block 2 given back
    assert s.kv.num_free_blocks == 14
    s.kv.pool.check()


def test_requests_sharing_a_new_prefix_in_one_batch_compute_it_once():
    # a and b share 8 prompt tokens (2 blocks) nobody has cached; c shares nothing
    s = make(budget=32)
    a, b, c = req("a", 10, base=500), req("b", 11, base=500), req("c", 6)
    for r in (a, b, c):
        s.add(r)
    assert plan(run_step(s)) == [("a", 0, 10), ("c", 0, 6)]   # b waits for a's blocks
    assert list(s.waiting) == [b]
    # a's two full blocks are cached now: b computes only its last 3 tokens
    assert plan(run_step(s)) == [("a", 10, 1), ("c", 6, 1), ("b", 8, 3)]
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]


def test_a_follower_trails_its_leader_chunk_by_chunk():
    s = make(num_blocks=32, budget=8)
    a, b = req("a", 24, base=500), req("b", 26, base=500)
    s.add(a)
    s.add(b)
    assert plan(run_step(s)) == [("a", 0, 8)]
    assert plan(run_step(s)) == [("a", 8, 8)]                 # b: its next block is a's
    assert plan(run_step(s)) == [("a", 16, 8)]
    assert plan(run_step(s)) == [("a", 24, 1), ("b", 24, 2)]  # all 6 of a's blocks hit
    assert b.num_cached_tokens == 24


def test_a_follower_does_not_wait_without_prefix_caching():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(32, 8, True), kv)
    s.add(req("a", 10, base=500))
    s.add(req("b", 11, base=500))
    assert plan(run_step(s)) == [("a", 0, 10), ("b", 0, 11)]


def test_a_follower_does_not_wait_on_a_request_that_is_not_running():
    # b's leader a is preempted back to the queue: b is no longer held behind it
    s = make(budget=32)
    a = req("a", 10, base=500)
    s.add(a)
    run_step(s)
    s.remove(a)
    b = req("b", 11, base=500)
    s.add(b)
    assert plan(run_step(s)) == [("b", 8, 3)]        # a's cached blocks, not a's queue
