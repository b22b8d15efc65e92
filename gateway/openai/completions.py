"""POST /v1/completions: prompt(s), text or token ids -> n choices per prompt -> JSON | SSE.

echo=true prepends the prompt (with its logprobs when asked: loglikelihood evaluation);
max_tokens=0 is allowed only with echo: one token is generated and dropped.
"""
from __future__ import annotations

from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from .endpoint import (ChoiceOut, Endpoint, Run, check_structured, finite, response_format_spec,
                       sampling_params, sse, usage)
from ..prompt import PromptError, encode
from ..validate import MAX_CHOICES
from .errors import OpenAIError, bad, from_prompt


class Completion(Endpoint):
    prefix = "cmpl"

    async def run(self):
        b = self.body
        if b.suffix:
            raise bad("suffix is not supported", "suffix")
        if b.max_tokens == 0 and not b.echo:
            raise bad("max_tokens=0 is only allowed with echo=true", "max_tokens")
        gen_tokens = b.max_tokens if b.max_tokens != 0 else 1     # echo-only: run 1, drop it
        prompt_lp = b.logprobs if (b.echo and b.logprobs is not None) else None
        spec = response_format_spec(b)
        check_structured(spec, "response_format")
        params = sampling_params(b, gen_tokens, b.logprobs, prompt_lp, spec)
        self.prompt_list = await self.prompts()
        for ids, _ in self.prompt_list:
            self.check_prompt(ids, b.max_tokens or None, "prompt")
        run = Run(self.gw, self.inputs([ids for ids, _ in self.prompt_list], params, b.n))
        await run.start()
        if b.stream:
            return StreamingResponse(self.gw.metrics.token_path.timed_writes(self.stream(run)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        outs = await run.collect()
        choices = [self.choice(i, o) for i, o in enumerate(outs)]
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.gw.model_name, "choices": choices, "usage": self.usage(outs)}

    async def prompts(self) -> list[tuple[list[int], str | None]]:
        """(token ids, original text or None) per prompt (tokenized off the loop)."""
        p, tok = self.body.prompt, self.gw.tokenizer
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise bad("prompt must not be empty", "prompt")
        if len(items) > MAX_CHOICES:
            raise bad(f"at most {MAX_CHOICES} prompts per request, got {len(items)}", "prompt")
        try:
            return [(await encode(tok, x, self.gw.max_model_len), x) if isinstance(x, str)
                    else (list(x), None) for x in items]
        except PromptError as e:
            raise from_prompt(e, "prompt") from None

    def usage(self, outs: list[ChoiceOut]) -> dict:
        comp = 0 if self.body.max_tokens == 0 else sum(o.completion_tokens for o in outs)
        return usage(sum(len(ids) for ids, _ in self.prompt_list), comp, outs[0].cached_tokens,
                     outs, self.timings)

    def _prompt_of(self, i: int) -> tuple[list[int], str | None]:
        return self.prompt_list[i // self.body.n]

    def _prompt_text(self, i: int) -> str:
        ids, text = self._prompt_of(i)
        return text if text is not None else self.gw.tokenizer.decode(ids, False)

    def _prompt_logprobs(self, i: int, o: ChoiceOut) -> dict:
        ids, _ = self._prompt_of(i)
        return self.logprobs(ids, o.prompt_logprobs or [(None, None)] * len(ids), 0)

    def choice(self, i: int, o: ChoiceOut) -> dict:
        b = self.body
        echo_only = b.max_tokens == 0
        gen_ids = [] if echo_only else o.token_ids
        gen_lps = [] if echo_only else o.logprobs
        text = "" if echo_only else o.text
        finish = "length" if echo_only else o.finish_reason
        lp = None
        if b.echo:
            prompt_text = self._prompt_text(i)
            if b.logprobs is not None:
                lp = _join_logprobs(self._prompt_logprobs(i, o),
                                    self.logprobs(gen_ids, gen_lps, len(prompt_text)))
            text = prompt_text + text
        elif b.logprobs is not None:
            lp = self.logprobs(gen_ids, gen_lps, 0)
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

    def logprobs(self, ids: list[int], lps: list, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, (lp, top) in zip(ids, lps):
            s = self.token_str(t)
            tokens.append(s)
            token_lps.append(finite(lp))
            tops.append(None if top is None else {self.token_str(x): finite(l) for x, l in top})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    async def stream(self, run: Run) -> AsyncIterator[str]:
        opts = self.body.stream_options
        inc_usage = bool(opts and opts.include_usage)
        outs = [ChoiceOut() for _ in run.inputs]
        echoed = [False] * len(outs)
        try:
            async for i, ev in run.events():
                choice = self._stream_choice(i, outs[i], ev, echoed)
                if choice is None:
                    continue
                obj = {"id": self.id, "object": "text_completion", "created": self.created,
                       "model": self.gw.model_name, "choices": [choice]}
                if inc_usage:
                    obj["usage"] = None
                yield sse(obj)
            if inc_usage:
                yield sse({"id": self.id, "object": "text_completion", "created": self.created,
                           "model": self.gw.model_name, "choices": [], "usage": self.usage(outs)})
        except OpenAIError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    def _stream_choice(self, i: int, o: ChoiceOut, ev, echoed: list[bool]) -> dict | None:
        """The streamed choice for one event of choice i (None: nothing to send); the first
        one carries the echoed prompt."""
        b = self.body
        start, offset = len(o.token_ids), len(o.text)
        o.add(ev)
        echo_only = b.max_tokens == 0           # the one generated token is dropped
        gen_ids = [] if echo_only else ev.token_ids
        text, lp = ("" if echo_only else ev.text), None
        if b.logprobs is not None:
            lp = self.logprobs(gen_ids, o.logprobs[start:], offset)
        if b.echo and not echoed[i]:
            echoed[i] = True
            ptext = self._prompt_text(i)
            if b.logprobs is not None:
                lp = _join_logprobs(self._prompt_logprobs(i, o),
                                    self.logprobs(gen_ids, o.logprobs[start:], len(ptext)))
            text = ptext + text
        finish = ("length" if echo_only else ev.finish_reason) if ev.finish_reason else None
        if not text and finish is None and not (lp and lp["tokens"]):
            return None
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}


def _join_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}
