"""AsyncEngine: one engine thread, commands through an inbox, per-request output streams."""
import asyncio
import time

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineError
from engine.llm_engine import LLMEngine
from engine.offline import LLM
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def _prompts():
    return [[1, 5, 9, 33, 2] * k + [7] for k in (1, 3, 6, 2, 9)]


def _engine(model_dir, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 8)
    return LLMEngine.from_model_dir(model_dir, **kw)


async def _collect(ae, rid):
    outs = [o async for o in ae.stream(rid)]
    return outs


def test_concurrent_requests_match_offline_generate(model_dir):
    ref = LLM(model_dir, num_blocks=64, block_size=8).generate(_prompts(), GREEDY)

    async def main():
        ae = AsyncEngine(_engine(model_dir, max_num_batched_tokens=24))  # chunked prefill too
        ae.start()
        try:
            async def one(i, p):
                await asyncio.sleep(0.01 * i)                  # staggered arrival
                await ae.add_request(f"r{i}", p, GREEDY)
                return await _collect(ae, f"r{i}")
            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(_prompts())))
            assert ae.engine.kv.num_held_blocks() == 0
            return results
        finally:
            await ae.shutdown()

    results = asyncio.run(main())
    for outs, r in zip(results, ref):
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert [t for o in outs for t in o.new_token_ids] == r.token_ids
        assert outs[-1].token_ids == r.token_ids


def test_abort_mid_stream_frees_every_block(model_dir):
    async def main():
        ae = AsyncEngine(_engine(model_dir))
        ae.start()
        try:
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            await ae.add_request("a", _prompts()[2], long)
            await ae.add_request("b", _prompts()[1], long)
            seen = []
            async for out in ae.stream("a"):
                seen.append(out)
                if len(seen) == 3:
                    assert await ae.abort("a")
                    assert await ae.abort("b")
            assert seen[-1].finished and seen[-1].finish_reason == "abort"
            # outputs already queued before the abort still arrive; then the stream ends
            assert 4 <= len(seen) < 20 and not any(o.finished for o in seen[:-1])
            with pytest.raises(KeyError):                      # unclaimed: dropped on abort
                [o async for o in ae.stream("b")]
            await ae.call(lambda: None)                         # a full turn of the thread
            assert ae.engine.kv.num_held_blocks() == 0
            assert ae.stats().num_held_blocks == 0 and ae.stats().num_running == 0
            assert not await ae.abort("a")                      # unknown now
        finally:
            await ae.shutdown()
    asyncio.run(main())


def test_remote_and_prefill_only_paths(model_dir):
    """Prefill-only output, release, remote reservation, remote_kv_done then decoding."""
    async def main():
        pre, dec = AsyncEngine(_engine(model_dir), name="pre"), AsyncEngine(_engine(model_dir), name="dec")
        pre.start()
        dec.start()
        try:
            p = _prompts()[3]
            await pre.add_request("x", p, GREEDY, prefill_only=True)
            first = [o async for o in pre.stream("x")][-1]
            assert first.finish_reason == "prefill_done" and len(first.token_ids) == 1
            got = await dec.add_remote_request("x", p, GREEDY)
            assert got is not None
            block_ids, cached = got
            assert cached == 0 and len(block_ids) == len(first.block_ids)

            def copy():
                src, dst = torch.tensor(first.block_ids), torch.tensor(block_ids)
                dec.engine.kv_cache[:, :, dst] = pre.engine.kv_cache[:, :, src]
            await dec.call(copy)
            await pre.release("x")
            assert pre.engine.kv.num_held_blocks() == 0
            assert dec.stats().num_waiting_for_remote_kv == 1
            out0 = await dec.remote_kv_done("x", first.token_ids[0], first.logprobs[0])
            assert not out0.finished
            outs = [o async for o in dec.stream("x")]
            ref = LLM(model_dir, num_blocks=64, block_size=8).generate([p], GREEDY)[0]
            assert outs[-1].token_ids == ref.token_ids
            assert dec.engine.kv.num_held_blocks() == 0
        finally:
            await pre.shutdown()
            await dec.shutdown()
    asyncio.run(main())


def test_errors_come_back_and_thread_sleeps_when_idle(model_dir):
    async def main():
        ae = AsyncEngine(_engine(model_dir))
        ae.start()
        try:
            with pytest.raises(ValueError, match="empty"):
                await ae.add_request("e", [], GREEDY)
            with pytest.raises(KeyError):
                [o async for o in ae.stream("nope")]
            steps = ae.num_steps
            await asyncio.sleep(0.2)                            # idle: no steps, no spin
            assert ae.num_steps == steps
            assert ae._thread.is_alive()
        finally:
            await ae.shutdown()
        assert not ae._thread.is_alive()
        with pytest.raises(EngineError):
            await ae.add_request("late", [1, 2], GREEDY)
    asyncio.run(main())


def test_step_failure_fails_streams_and_frees(model_dir):
    async def main():
        ae = AsyncEngine(_engine(model_dir))
        eng = ae.engine
        real = eng.step
        calls = {"n": 0}

        def flaky():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return real()
        eng.step = flaky
        ae.start()
        try:
            await ae.add_request("f", _prompts()[0], GREEDY)
            with pytest.raises(EngineError, match="boom"):
                [o async for o in ae.stream("f")]
            await ae.call(lambda: None)
            assert eng.kv.num_held_blocks() == 0
            await ae.add_request("g", _prompts()[0], GREEDY)   # the thread lives on
            assert [o async for o in ae.stream("g")][-1].finished
        finally:
            await ae.shutdown()
    asyncio.run(main())


def test_coalesced_stream_skips_to_the_newest_output(model_dir):
    """A consumer that fell behind gets the newest cumulative output, not every step's."""
    ref = LLM(model_dir, num_blocks=64, block_size=8).generate([_prompts()[0]], GREEDY)[0]

    async def main():
        ae = AsyncEngine(_engine(model_dir))
        ae.start()
        try:
            await ae.add_request("c", _prompts()[0], GREEDY)
            for _ in range(200):                       # let it finish before reading (bounded)
                if ae.engine.requests.get("c") is None:
                    break
                await ae.call(lambda: None)
            return [o async for o in ae.stream("c", coalesce=True)]
        finally:
            await ae.shutdown()

    outs = asyncio.run(main())
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].token_ids == ref.token_ids and len(outs[0].logprobs) == len(ref.token_ids)


def test_stalled_engine_sleeps_until_blocks_are_freed(model_dir):
    """Waiting requests that cannot get blocks do not spin the engine thread: it sleeps
    (no steps, next to no CPU) until a command frees blocks, then serves them."""
    async def main():
        ae = AsyncEngine(_engine(model_dir, num_blocks=4))   # 32 tokens of cache
        ae.start()
        try:
            hold = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            await ae.add_request("held", [3] * 30, hold, prefill_only=True)
            assert [o async for o in ae.stream("held")][-1].finish_reason == "prefill_done"
            await ae.add_request("w", [4] * 20, GREEDY)          # 4 blocks held: it waits
            await ae.call(lambda: None)
            steps, cpu, wall = ae.num_steps, time.process_time(), time.monotonic()
            await asyncio.sleep(0.5)
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            assert ae.num_steps - steps <= 1, "the stalled engine kept stepping"
            assert cpu < 0.1 * wall, f"{cpu:.3f}s CPU in {wall:.3f}s while stalled"
            assert ae.stats().num_waiting == 1
            await ae.release("held")                               # blocks freed: it runs
            outs = await asyncio.wait_for(_collect(ae, "w"), 30)
            assert outs[-1].finished and len(outs[-1].token_ids) == GREEDY.max_tokens
        finally:
            await ae.shutdown()
    asyncio.run(main())


def test_consecutive_step_failures_make_the_engine_unhealthy(model_dir):
    async def main():
        changes = []
        ae = AsyncEngine(_engine(model_dir), max_step_failures=2, on_health=changes.append)
        eng = ae.engine
        real, broken = eng.step, {"on": True}

        def step():
            if broken["on"]:
                raise RuntimeError("device lost")
            return real()
        eng.step = step
        ae.start()
        try:
            for i in range(2):
                await ae.add_request(f"f{i}", _prompts()[0], GREEDY)
                with pytest.raises(EngineError):
                    [o async for o in ae.stream(f"f{i}")]
                assert ae.healthy == (i == 0)
            await asyncio.sleep(0)                                  # on_health runs on the loop
            assert changes == [False]
            broken["on"] = False
            await ae.add_request("ok", _prompts()[0], GREEDY)
            assert [o async for o in ae.stream("ok")][-1].finished
            await asyncio.sleep(0)
            assert ae.healthy and changes == [False, True]
        finally:
            await ae.shutdown()
    asyncio.run(main())


def test_recompute_with_the_first_token_keeps_the_grammar(model_dir):
    """A decode worker's recompute fallback knows the first token (prompt + [first]): the
    grammar is fed it, so the rest equals the offline engine's constrained output."""
    from engine.structured import StructuredOutput
    spec = StructuredOutput(regex=r"(yes|no), [0-9]{3}")
    params = SamplingParams(temperature=0.0, max_tokens=40, structured=spec)
    prompt = _prompts()[1]
    ref = LLM(model_dir, num_blocks=64, block_size=8).generate([prompt], params)[0].token_ids
    assert len(ref) > 2

    async def main():
        ae = AsyncEngine(_engine(model_dir))
        ae.start()
        try:
            assert await ae.add_remote_request("s", prompt, params) is not None
            rest = SamplingParams(temperature=0.0, max_tokens=39, structured=spec)
            await ae.recompute_locally("s", prompt + ref[:1], rest, ref[:1])
            return (await _collect(ae, "s"))[-1]
        finally:
            await ae.shutdown()
    out = asyncio.run(main())
    assert out.finish_reason == "stop" and out.token_ids == ref[1:]


def test_abort_racing_an_add_leaves_no_stream_behind(model_dir):
    async def main():
        ae = AsyncEngine(_engine(model_dir))
        ae.start()
        try:
            add = asyncio.ensure_future(ae.add_remote_request("race", _prompts()[0], GREEDY))
            await asyncio.sleep(0)                    # the add's command is queued first
            assert await ae.abort("race")
            assert await add is not None
            assert ae._unclaimed == {} and not ae._streams
            await ae.call(lambda: None)
            assert ae.engine.kv.num_held_blocks() == 0
        finally:
            await ae.shutdown()
    asyncio.run(main())
