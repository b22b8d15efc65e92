"""A step whose every request was abandoned stops after its current layer and keeps nothing
(engine/llm_engine.py `step(abandoned)`, engine/runner.py StepAbandoned; AsyncEngine.abort
marks the id before its command runs). Checked against the same engine never interrupted:
the greedy tokens after a dropped step are the undisturbed ones, every block comes back."""
import asyncio
import threading

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.kv_connector import KVConnector
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
A, B = [3 + i % 50 for i in range(40)], [7 + i % 31 for i in range(24)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


class Layers(KVConnector):
    """Counts the layers each step ran; `at_layer(i)` runs inside the forward pass."""

    def __init__(self, at_layer=None):
        self.calls, self.at_layer = [], at_layer

    def register_kv_caches(self, *args, **kwargs):
        pass

    def save_kv_layer(self, layer, scheduler_output):
        self.calls.append(layer)
        if self.at_layer is not None:
            self.at_layer(layer)


def _engine(model_dir, connector=None):
    return LLMEngine.from_model_dir(model_dir, num_blocks=64, block_size=8,
                                    max_num_batched_tokens=16, kv_connector=connector)


def _step(eng, abandoned=()):
    eng.abandoned = set(abandoned)
    try:
        return eng.step()
    finally:
        eng.abandoned = set()


def _run(eng):
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return done


def test_a_dropped_step_keeps_nothing_and_the_requests_go_on_undisturbed(model_dir):
    ref = _engine(model_dir)
    ref.add_request("a", A, GREEDY)
    ref.add_request("b", B, GREEDY)
    want = _run(ref)

    layers = Layers()
    eng = _engine(model_dir, layers)
    eng.add_request("a", A, GREEDY)
    eng.add_request("b", B, GREEDY)
    eng.step()                                           # one 16-token chunk of a
    computed = eng.requests["a"].num_computed_tokens
    layers.calls.clear()
    assert _step(eng, {"a", "b"}) == [] and eng.abandoned_steps == 1
    assert layers.calls == [], "stopped after layer 0, before its KV was handed on"
    assert eng.requests["a"].num_computed_tokens == computed       # nothing advanced
    _step(eng, {"b"})                                     # b is not in this step: it runs
    assert eng.abandoned_steps == 1 and eng.requests["a"].num_computed_tokens == computed + 16
    assert _run(eng) == want
    assert eng.kv.num_free_blocks == eng.num_blocks


def test_abort_stops_a_running_chunk_within_a_layer(model_dir):
    """A chunk computing (layer 0 of it blocks until the test aborts): the abort lands
    before layer 1; the request's blocks are freed; the next request runs normally."""
    started, go = threading.Event(), threading.Event()

    def at_layer(i):
        if i == 0 and not go.is_set():
            started.set()
            go.wait(30)

    layers = Layers(at_layer)
    eng = _engine(model_dir, layers)
    ae = AsyncEngine(eng)

    async def main():
        ae.start()
        try:
            await ae.add_request("long", A * 4, GREEDY, prefill_only=True)
            assert await asyncio.to_thread(started.wait, 30)
            aborting = asyncio.ensure_future(ae.abort("long"))
            await asyncio.sleep(0)                    # abort() marked it abandoned
            go.set()
            assert await asyncio.wait_for(aborting, 30)
            assert layers.calls == [0], layers.calls  # layers 1.. of that chunk never ran
            assert eng.abandoned_steps == 1
            assert ae.stats().num_free_blocks == eng.num_blocks
            await ae.add_request("next", B, GREEDY)
            outs = [o async for o in ae.stream("next")]
            assert outs[-1].finished and len(outs[-1].token_ids) == GREEDY.max_tokens
        finally:
            go.set()
            await ae.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))
