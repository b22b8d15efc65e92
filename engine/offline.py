"""`LLM`: the offline API, `LLM(model_dir).generate(prompts, params)`, over one LLMEngine."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterable

from .llm_engine import LLMEngine
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Offline API: `LLM(model_dir).generate(prompts, params)`.

    The engine finishes requests on token criteria; text, stop strings and their finish
    reasons come from one `OutputProcessor` per request, the same one the gateway runs."""

    def __init__(self, model_dir: str | Path, **engine_kwargs):
        self.engine = LLMEngine.from_model_dir(model_dir, **engine_kwargs)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | Iterable[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        procs = self._add_all(prompts, params)
        texts = dict.fromkeys(procs, "")
        final: dict[str, RequestOutput] = {}
        while len(final) < len(procs):
            for out in self.engine.step():
                done = self._process(procs[out.request_id], texts, out)
                if done is not None:
                    final[out.request_id] = done
        return [final[rid] for rid in procs]

    def _add_all(self, prompts, params) -> dict[str, OutputProcessor | None]:
        """Admit every prompt (all or none); request id -> its processor (None: no tokenizer,
        token ids only)."""
        procs: dict[str, OutputProcessor | None] = {}
        try:
            for p, sp in zip(prompts, params):
                rid = f"offline-{self._counter}"
                self._counter += 1
                req = self.engine.add_request(rid, p, sp)
                procs[rid] = None if self.tokenizer is None else OutputProcessor(
                    self.tokenizer, req.prompt_token_ids, req.sampling_params,
                    self.engine.config.model.max_model_len)
        except ValueError:
            for rid in procs:
                self.engine.abort_request(rid)
            raise
        return procs

    def _process(self, proc: OutputProcessor | None, texts: dict[str, str],
                 out: RequestOutput) -> RequestOutput | None:
        """The request's final output once it is finished, by the engine or by a stop string
        the processor found (the engine request is then aborted); else None."""
        rid = out.request_id
        if proc is None:
            return out if out.finished else None
        delta = proc.add(out.new_token_ids, None, out.finish_reason if out.finished else None)
        if delta is not None:
            texts[rid] += delta.text
        if not proc.finished:
            return None
        if not out.finished:                    # a stop string: the engine would go on
            self.engine.abort_request(rid)
        n = len(proc.token_ids)
        by_text = isinstance(proc.stop_reason, str)
        return replace(out, token_ids=list(proc.token_ids), text=texts[rid], finished=True,
                       finish_reason=proc.finish_reason if by_text or not out.finished else out.finish_reason,
                       stop_reason=proc.stop_reason if by_text or not out.finished else out.stop_reason,
                       logprobs=list(out.logprobs)[:n], top_logprobs=list(out.top_logprobs)[:n])
