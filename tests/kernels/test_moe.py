"""fused_moe (Triton) against the per-expert torch reference, and the routing and expert
alignment it runs on: uneven loads, experts no token chose, top-k ties, batch sizes 1 to 257.
Shapes stay small: under TRITON_INTERPRET every program runs in Python."""
import pytest
import torch

from engine.kernels import reference
from engine.kernels.moe import align_by_expert, fused_moe
from engine.models.moe import select_experts
from kernel_testlib import DEVICE, assert_close, fresh_generator, on_device, randn

E, H, I = 8, 32, 48


def weights(gen, dtype, e=E):
    return (randn(gen, e, 2 * I, H, dtype=dtype, scale=H ** -0.5),
            randn(gen, e, H, I, dtype=dtype, scale=I ** -0.5))


def check(x, w13, w2, topw, ids, dtype, seed, what, **kw):
    """Triton on DEVICE vs the reference on CPU in fp32 (from the same dtype-rounded inputs)."""
    got = fused_moe(*on_device(x, w13, w2, topw, ids), **kw)
    assert got.dtype == dtype and got.shape == x.shape
    want = reference.fused_moe(x.float(), w13.float(), w2.float(), topw, ids)
    assert_close(got, want, dtype, seed, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k", [(1, 1), (1, 4), (2, 2), (17, 2), (64, 2), (257, 2)])
def test_fused_moe_matches_reference(dtype, tokens, k):
    gen, seed = fresh_generator()
    x = randn(gen, tokens, H, dtype=dtype)
    w13, w2 = weights(gen, dtype)
    topw, ids = select_experts(randn(gen, tokens, E), k, renormalize=True)
    check(x, w13, w2, topw, ids, dtype, seed, f"T={tokens} k={k}")


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_uneven_loads_and_idle_experts(block_m):
    """Experts 1, 2, 5 and 7 get no token; expert 0 gets every token once, expert 6 most of
    them; runs longer than a block, shorter than one, and exactly one block."""
    gen, seed = fresh_generator()
    t, k = 70, 3
    x = randn(gen, t, H)
    w13, w2 = weights(gen, torch.float32)
    ids = torch.stack([torch.zeros(t, dtype=torch.int64),
                       torch.where(torch.arange(t) < 64, 6, 3),
                       torch.where(torch.arange(t) % 10 == 0, 3, 4)], dim=1)
    topw = torch.rand(t, k, generator=gen)                     # not normalised: Qwen2-MoE
    check(x, w13, w2, topw, ids, torch.float32, seed, f"block_m={block_m}",
          tiles={"BLOCK_M": block_m})


def test_top_k_ties():
    """Equal router logits: top-k still names k distinct experts, each weighted 1/k after
    renormalising, and the kernel agrees with the reference on that routing."""
    gen, seed = fresh_generator()
    t, k = 9, 4
    logits = torch.zeros(t, E)
    logits[::2, :6] = 1.0                                      # ties among the top six
    topw, ids = select_experts(logits, k, renormalize=True)
    assert all(len(set(row)) == k for row in ids.tolist())
    torch.testing.assert_close(topw, torch.full((t, k), 1.0 / k))
    x = randn(gen, t, H)
    w13, w2 = weights(gen, torch.float32)
    check(x, w13, w2, topw, ids, torch.float32, seed, "ties")


def test_select_experts_as_transformers_routes():
    """softmax in fp32, top-k, renormalised or not (Mixtral / Qwen3-MoE vs Qwen2-MoE)."""
    gen, _ = fresh_generator()
    logits = randn(gen, 5, E, dtype=torch.bfloat16)
    probs = torch.softmax(logits.float(), -1)
    top, idx = probs.topk(3, -1)
    w, ids = select_experts(logits, 3, renormalize=False)
    assert torch.equal(ids, idx) and torch.equal(w, top)
    w, _ = select_experts(logits, 3, renormalize=True)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True))


@pytest.mark.parametrize("tokens,k,block_m", [(1, 2, 16), (5, 1, 16), (40, 2, 16), (33, 4, 64)])
def test_align_by_expert(tokens, k, block_m):
    """Every (token, slot) row appears once, sorted by expert, each expert's run starting on
    a block boundary, padding marked M; every block's expert is right; shapes depend on T only."""
    gen, _ = fresh_generator()
    used = torch.tensor([0, 1, 2, 3, 4, 6])                    # experts 5 and 7: no token
    ids = torch.stack([used[torch.randperm(len(used), generator=gen)[:k]] for _ in range(tokens)])
    sorted_ids, block_expert = align_by_expert(ids.to(DEVICE), E, block_m)
    sorted_ids, block_expert = sorted_ids.cpu().long(), block_expert.cpu().long()
    m = tokens * k
    assert sorted_ids.numel() % block_m == 0 and block_expert.numel() == sorted_ids.numel() // block_m
    assert sorted_ids.numel() >= m + min(E, m) * (block_m - 1)
    real = sorted_ids[sorted_ids < m]
    assert sorted(real.tolist()) == list(range(m))
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < m]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows] == e).all()
            assert rows.tolist() == sorted(rows.tolist())      # stable: by token within an expert
    counts = torch.bincount(flat, minlength=E)
    blocks = torch.bincount(block_expert[block_expert >= 0], minlength=E)
    assert torch.equal(blocks, (counts + block_m - 1) // block_m)


def test_empty_batch():
    w13, w2 = weights(torch.Generator().manual_seed(0), torch.float32)
    x = torch.zeros(0, H)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    out = fused_moe(*on_device(x, w13, w2, ids.float(), ids))
    assert out.shape == (0, H)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("t", [1, 24])
def test_routing_and_experts_replay_in_a_cuda_graph(t):
    """Routing, alignment and both GEMMs capture in one graph (no host sync) and a replay
    on new inputs of the same batch size routes them afresh."""
    gen, seed = fresh_generator()
    w13, w2 = on_device(*weights(gen, torch.bfloat16))
    wg = randn(gen, E, H, dtype=torch.bfloat16).to(DEVICE)
    x = randn(gen, t, H, dtype=torch.bfloat16).to(DEVICE)

    def step():
        w, ids = select_experts(x @ wg.T, 2, renormalize=True)
        return w, ids, fused_moe(x, w13, w2, w, ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w, ids, out = step()
    x.copy_(randn(gen, t, H, dtype=torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    _, ids_now = select_experts(x @ wg.T, 2, renormalize=True)            # eager
    same = (ids.sort(-1).values == ids_now.sort(-1).values).all(-1).float().mean().item()
    assert same >= 0.9, f"seed={seed}: the replay routed only {same:.0%} of rows as eager does"
    want = reference.fused_moe(x.cpu().float(), w13.cpu().float(), w2.cpu().float(), w.cpu(), ids.cpu())
    assert_close(out, want, torch.bfloat16, seed, "graph replay")


def test_moe_engine_with_triton_kernels(tmp_path, monkeypatch):
    """The whole engine on Qwen2-MoE (a dense layer, a sparse one with the shared expert)
    with the Triton kernels selected gives transformers' greedy tokens, and the MoE layer
    really ran the fused kernel."""
    import engine.kernels as K
    from engine import LLMEngine, SamplingParams
    from tests.hf_models import hf_greedy, make_hf_model
    d = make_hf_model("qwen2_moe", tmp_path / "m")
    prompts = [[7, 100, 33, 250, 9], list(range(40, 52))]
    ref = hf_greedy(d, prompts, 4)
    engine = LLMEngine.from_model_dir(d, num_blocks=16, kernel_backend="triton", device=str(DEVICE),
                                      dtype="float32")
    launched = []
    triton_op = K._triton_op
    monkeypatch.setattr(K, "_triton_op", lambda *a: launched.append(a[0]) or triton_op(*a))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for i, (toks, lps) in enumerate(ref):
        assert done[f"r{i}"].token_ids == toks, f"prompt {i}"
        assert max(abs(a - b) for a, b in zip(done[f"r{i}"].logprobs, lps)) < 1e-3
    assert "moe" in launched
