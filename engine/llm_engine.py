"""The engine: `step()` = schedule -> run -> postprocess.

    schedule      the speculator's proposals (engine/spec_decode.py), then the scheduler's
                  tokens for this step (engine/scheduler.py)
    run           the model over them (engine/runner.py; the KV connector told per layer)
    postprocess   the scheduler advances computed tokens; prompt logprobs; one token sampled
                  per sampling row and proposals verified, each through the token-level
                  finish rules (`_append_token`); finished requests leave the scheduler
Only the scheduler and the KV manager change their own state (queues, blocks); the engine
changes a request's outputs and status, and its own table of requests.

Serves both halves of the disaggregated split:
  * prefill role: `add_request(..., prefill_only=True)` finishes the request after its first
    sampled token with `finish_reason="prefill_done"` and keeps its blocks (their KV is being
    shipped: the `kv_connector` is called as each layer's KV is written) until
    `release(request_id)`;
  * decode role: `add_remote_request()` reserves blocks for a prompt whose KV arrives from
    outside (status WAITING_FOR_REMOTE_KV); `remote_kv_done()` hands in the first token that
    the prefill worker sampled and the request joins the running batch.
Not thread-safe: call it from one thread (the async wrapper owns that thread).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from . import kv_offload, memory
from .build_cache import build_model, cached_model
from .config import EngineConfig, EngineOptions
from .kv_cache_manager import KVCacheManager, cdiv
from .kv_connector import KVConnector
from .quant import amx
from .outputs import EngineStats, Prefix, RequestOutput
from .request import Request, RequestStatus
from .runner import ModelOutput, ModelRunner, StepAbandoned
from .sampler import DeviceSampler, Sampler, compute_prompt_logprobs, skip_draws
from .sampling_params import SamplingParams
from .scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from .spec_decode import DraftProposer, Speculator, SpecStats
from .step_observer import StepObserver
from .structured import StructuredOutputs
from .tokenizer import Tokenizer, has_tokenizer

log = logging.getLogger(__name__)


def check_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """ValueError unless `ids` is a prompt this model can continue: not empty, every id in
    the vocabulary, room for one generated token. (The gateway checks first, in its own
    words for each front: gateway/prompt.py.)"""
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens: the context length is {max_model_len}, "
                         f"so at most {max_model_len - 1} prompt tokens leave room for one "
                         "generated token")


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_connector: KVConnector | None = None,
                 step_observers: Sequence[StepObserver] = (), decode_graphs: bool | None = None):
        """`kv_connector`: told as each layer's KV is written (the prefill worker ships it,
        see kv_connector.py); `step_observers`: told each step's duration and tokens (see
        step_observer.py). Both are called on the thread that steps the engine.
        `decode_graphs`: replay decode steps from CUDA graphs (None: on CUDA; False: never, as
        a prefill worker; True on CPU: the same padded path, eagerly, for tests)."""
        self.config = config
        mc = config.model
        self.dtype = config.torch_dtype
        t0 = time.perf_counter()      # start-up phases, in startup_s (a worker logs them)
        # the loaded, quantized model, its backend settled (the C kernels' layouts) and its
        # bfloat16 copies made: from engine/build_cache.py when built here before
        self.model, self.model_cache = cached_model(config, lambda: build_model(config))
        t1 = time.perf_counter()
        self.tokenizer = Tokenizer.from_dir(mc.model_dir) if has_tokenizer(mc.model_dir) else None
        t2 = time.perf_counter()
        eos = set(mc.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        self.eos_token_ids = eos
        cc = config.cache
        self.num_blocks = cc.num_blocks or memory.kv_cache_blocks(config)
        self.kv = KVCacheManager(self.num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.kv_events = self.kv.events      # what the worker streams to the gateway (KvEvents)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        # the decode plan's threads (built with the runner, when the backend is settled)
        self.model.step_threads = config.step_threads or len(os.sched_getaffinity(0))
        self.runner = ModelRunner(self.model, self.num_blocks, cc.block_size, self.dtype, config.device,
                                  config.scheduler.max_num_seqs, decode_graphs,
                                  kv_dtype=config.kv_torch_dtype)
        # after the runner: bind_kv_cache settles the backend, and so each layer's kernel
        self.amx = amx.attach(self.model, config.amx_weights, config.amx_weights_max_gb,
                              config.amx_min_rows, config.device)
        self.startup_s = {"weights": t1 - t0, "tokenizer": t2 - t1,
                          "kv cache + kernels": time.perf_counter() - t2}
        # off the CPU, logits stay on the device and only the sampled ids come back
        self.sampler = Sampler(eos) if config.device == "cpu" else DeviceSampler(eos)
        # speculative verification runs per position on the host (spec logits are copied back)
        self.verifier = self.sampler if isinstance(self.sampler, Sampler) else Sampler(eos)
        # grammars for SamplingParams.structured; the llguidance tokenizer is built on first use
        self.structured = StructuredOutputs(self.tokenizer.to_json() if self.tokenizer else None,
                                            mc.vocab_size, eos)
        self.requests: dict[str, Request] = {}
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_cache, mc.name, self.kv_scales, mc.kv_layout())
        self.step_observers = list(step_observers)
        # host / disk tiers under the pool (None: off); each step's time prices a revival
        self.offload = kv_offload.attach(self.kv, self.runner, config)
        if self.offload is not None:
            self.step_observers.append(self.offload)
        self.speculator = self._speculator()
        self.spec_stats = self.speculator.stats if self.speculator is not None else SpecStats()
        # the last step scheduled nothing (every waiting request lacks blocks or a slot):
        # until a command frees blocks or adds work, another step would do nothing either
        self.stalled = False
        self.abandoned_steps = 0             # steps dropped mid-way: all their requests abandoned
        self.prompt_tokens_computed = 0      # prompt tokens run through the model (steps done)
        # ids whose abort is on its way; the one field another thread writes (AsyncEngine.abort
        # adds, while a step may be running): see step()
        self.abandoned: set[str] = set()

    def close(self) -> None:
        """Stop the engine's helper threads (the offload tiers'); idempotent."""
        self.kv.close()

    def _speculator(self) -> Speculator | None:
        sc, mc = self.config.speculative, self.config.model
        if sc is None:
            return None
        draft = None
        if sc.method == "draft":
            c = self.config
            draft = LLMEngine.from_model_dir(sc.draft_model, EngineOptions(
                device=c.device, dtype=c.dtype, kernel_backend=c.kernel_backend,
                max_model_len=mc.max_model_len, cache=replace(c.cache, num_blocks=None,
                                                              kv_offload_host_gb=0.0, kv_offload_disk=""),
                scheduler=c.scheduler))
            if draft.config.model.vocab_size != mc.vocab_size:
                raise ValueError(f"draft model {sc.draft_model}: vocabulary of "
                                 f"{draft.config.model.vocab_size}, the target's is {mc.vocab_size}")
            draft = DraftProposer(draft)
        return Speculator(sc, mc.max_model_len, draft)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, options: EngineOptions | None = None, *,
                       kv_connector: KVConnector | None = None,
                       step_observers: Sequence[StepObserver] = (), decode_graphs: bool | None = None,
                       **by_name) -> "LLMEngine":
        """The engine for a model directory, with `options` or EngineOptions given by name
        (`from_model_dir(d, num_blocks=64, kernel_backend="triton")`; defaults: EngineOptions')."""
        if options is not None and by_name:
            raise TypeError("give EngineOptions or options by name, not both")
        t0 = time.perf_counter()
        config = EngineConfig.build(model_dir, options or EngineOptions.of(**by_name))
        t1 = time.perf_counter()
        engine = cls(config, kv_connector, step_observers, decode_graphs)
        engine.startup_s = {"config": t1 - t0, **engine.startup_s}
        return engine

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def kv_scales(self) -> torch.Tensor | None:
        """[layers, K|V, blocks, kv heads] fp32 scales of an 8-bit cache, else None."""
        return self.runner.kv_scales

    # -- admission ----------------------------------------------------------------------
    def _make_request(self, request_id: str, prompt, params: SamplingParams | None,
                      prefill_only: bool = False) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        L = self.config.model.max_model_len
        check_prompt_ids(ids, self.config.model.vocab_size, L)
        max_tokens = min(params.max_tokens or L, L - len(ids))
        if params.max_tokens is None:
            # no limit asked: up to the context or what the whole cache holds, whichever is
            # less (a model whose full context does not fit the cache still serves; the
            # request finishes with "length" when the cache is full)
            max_tokens = max(min(max_tokens, self.num_blocks * self.kv.block_size - len(ids)), 1)
        # a prefill-only request computes the prompt and samples one token, nothing more
        need = cdiv(len(ids) + (1 if prefill_only else max_tokens), self.kv.block_size)
        if need > self.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks, the cache has {self.num_blocks}")
        req = Request(request_id, ids, params, max_tokens, self.eos_token_ids, prefill_only,
                      arrival_time=time.monotonic())
        if params.structured is not None:
            self.structured.add(request_id, params.structured)   # ValueError on a bad spec
        return req

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, prefill_only: bool = False) -> Request:
        req = self._make_request(request_id, prompt, params, prefill_only)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def add_remote_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams | None = None) -> Request | None:
        """Reserve blocks for a prompt whose KV is computed elsewhere. Returns the request
        (`block_ids`, `num_cached_tokens` say what to fill), or None if blocks are short."""
        req = self._make_request(request_id, prompt_token_ids, params)
        if not self.scheduler.reserve_remote(req):
            self.structured.remove(request_id)
            return None
        self.requests[request_id] = req
        return req

    def remote_kv_done(self, request_id: str, first_token_id: int, logprob: float = 0.0,
                       top_logprobs=None) -> RequestOutput:
        """The prompt's KV is in the reserved blocks; `first_token_id` was sampled by the
        prefill worker. The request starts decoding (or finishes at once on a stop)."""
        req = self.requests[request_id]
        if req.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV ({req.status})")
        self.scheduler.remote_ready(req)
        if req.generator is not None and not req.sampling_params.greedy:
            skip_draws(req.generator, self.config.model.vocab_size)   # the first token's draw
        out = self._append_token(req, first_token_id, logprob, top_logprobs)
        if req.is_finished:
            self._finish(req)
        return out

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        self.abandoned.discard(request_id)
        self.structured.remove(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        if req is None:
            return False
        if not req.is_finished or req.prefill_only:
            self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        return True

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished prefill-only request (its KV has been shipped)."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.release(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. `self.abandoned`: ids whose abort is on its way (AsyncEngine.abort adds
        to it from another thread while the step runs): when every request of the step is in it,
        the forward pass stops after its current layer and the step is dropped -- no request
        advances, no output -- so a long prompt chunk nobody waits for stops within a layer
        instead of a chunk. The blocks are freed by the abort that follows."""
        t0 = time.perf_counter()
        sched = self._schedule()
        if not sched:
            return []
        abandoned = self.abandoned
        try:
            out = self.runner.execute(sched, self.kv_connector, lambda: bool(abandoned) and all(
                s.request.request_id in abandoned for s in sched.scheduled))
        except StepAbandoned as e:
            self.abandoned_steps += 1
            log.info("step dropped: %s", e)
            return []
        self.prompt_tokens_computed += sched.num_prompt_tokens
        outputs = self._postprocess(sched, out)
        if self.step_observers:
            tokens = {s.request.request_id: s.num_new_tokens for s in sched.scheduled}
            seconds = time.perf_counter() - t0          # one reading: every observer agrees
            for o in self.step_observers:
                o.on_step(seconds, tokens)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self.stalled = not sched and not sched.preempted
        return sched

    def _postprocess(self, sched: SchedulerOutput, mo: ModelOutput) -> list[RequestOutput]:
        self.scheduler.update(sched)
        for s in sched.scheduled:
            if s.request.request_id in mo.prompt_logits:
                self._add_prompt_logprobs(s.request, *mo.prompt_logits[s.request.request_id])
        outputs = []
        if mo.sample_rows:
            reqs = [s.request for s in mo.sample_rows]
            allowed = self.structured.token_mask([r.request_id for r in reqs], mo.logits.shape[1])
            sampled = self.sampler(mo.logits, reqs, allowed)
            for i, req in enumerate(reqs):
                outputs.append(self._emit(req, sampled, i))
        for s in sched.scheduled:
            if s.spec_token_ids:
                outputs.append(self._verify(s, mo.spec_logits[s.request.request_id]))
        return outputs

    def _emit(self, req: Request, sampled, i: int) -> RequestOutput:
        """Row i of a sampler result appended to `req`; the request finished where it ends."""
        out = self._append_sampled(req, sampled, i)
        if req.is_finished:
            self._finish(req)
        return out

    def _append_sampled(self, req: Request, sampled, i: int) -> RequestOutput:
        top = sampled.top_logprobs[i] if sampled.top_logprobs else None
        return self._append_token(req, sampled.token_ids[i], sampled.logprobs[i], top)

    def _verify(self, s: ScheduledRequest, logits: torch.Tensor) -> RequestOutput:
        """Emit the accepted prefix of the proposal plus one corrected (or bonus) token, each
        through the usual per-token rules; the scheduler keeps the accepted tokens' KV."""
        req = s.request

        def emit(i: int, draft: int | None):
            allowed = self.structured.token_mask([req.request_id], logits.shape[1])
            sampled, ok = self.verifier.verify(logits[i:i + 1], req, allowed, draft)
            return sampled.token_ids[0], ok, self._append_sampled(req, sampled, 0)
        new, accepted, out = self.speculator.verify(req, s.spec_token_ids, emit)
        if req.is_finished:
            self._finish(req)
        else:
            self.scheduler.accept_speculative(req, s.start + 1 + accepted)
        out.new_token_ids = new
        return out

    def _add_prompt_logprobs(self, req: Request, logits, targets, first_pos: int) -> None:
        if not req.prompt_logprobs:
            req.prompt_logprobs = [(None, None)]          # the first prompt token has none
        lps, tops = compute_prompt_logprobs(logits, targets, req.sampling_params.prompt_logprobs)
        req.prompt_logprobs.extend(zip(lps, tops))

    def _append_token(self, req: Request, token: int, logprob: float, top) -> RequestOutput:
        """Record a sampled token and apply the token-level finish rules: a stop token (once
        min_tokens are out), a complete grammar, max_tokens or the context length. Text and
        stop strings are the OutputProcessor's (the gateway's, or `LLM`'s offline)."""
        p = req.sampling_params
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_token_ids.append(token)
        req.output_logprobs.append(logprob)
        req.output_top_logprobs.append(top)
        n = len(req.output_token_ids)
        stop_token = (token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids))
        if stop_token and n >= p.min_tokens:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif self.structured.advance(req.request_id, req.output_token_ids):
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None   # grammar complete
        elif n >= req.max_tokens or req.num_tokens >= self.config.model.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
        elif req.prefill_only:
            req.status = RequestStatus.FINISHED_PREFILL
        return RequestOutput(
            req.request_id, req.prompt_token_ids, Prefix(req.output_token_ids), [token], "",
            req.is_finished, req.finish_reason, req.stop_reason, Prefix(req.output_logprobs),
            Prefix(req.output_top_logprobs),
            req.prompt_logprobs if p.prompt_logprobs is not None else None,
            max(req.num_cached_tokens, 0), list(req.block_ids) if req.prefill_only else [])

    def _finish(self, req: Request) -> None:
        """Leave the scheduler (Scheduler.finish); a prefill-only request stays known until
        `release`."""
        self.structured.remove(req.request_id)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        self.scheduler.finish(req)
        if not req.prefill_only:
            self.requests.pop(req.request_id, None)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_waiting_for_remote_kv=len(s.remote), num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.num_blocks, num_held_blocks=self.kv.num_held_blocks(),
            queued_prefill_tokens=s.queued_prefill_tokens, num_preemptions=s.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_num_emitted_tokens=self.spec_stats.num_emitted_tokens)
