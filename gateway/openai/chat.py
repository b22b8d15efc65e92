"""POST /v1/chat/completions: messages (+ tools) -> chat template -> token ids -> n choices
-> one JSON response, or SSE chunks.

Tools: `tool_choice` "required" or a named function constrains the output with a JSON
schema (tools.forced_schema) and its output is always calls (tools.forced_calls), cut ones
(max_tokens) with the arguments generated so far and the model's finish reason; "auto"
parses the finished text as calls (tools.parse_calls). A stream sends each call's id and
name as soon as they are known (a named call's before any token), then the arguments as
they are generated (tools.StreamedCalls); with "auto" it holds the output back only while
it may still become a call, then streams it as calls or as content. Complete calls finish
with "tool_calls".
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterator

from fastapi.responses import StreamingResponse

from engine.structured import StructuredOutput

from ..prompt import PromptError, chat_prompt_ids, check_template_kwargs
from ..validate import template_role
from . import tools as toolkit
from .endpoint import (ChoiceOut, Endpoint, Run, check_structured, finite, response_format_spec,
                       sampling_params, sse, usage)
from .errors import OpenAIError, bad, from_prompt
from .protocol import ChatCompletionRequest


class Chat(Endpoint):
    prefix = "chatcmpl"
    inc_usage = cont_usage = False         # stream_options, set by stream()

    def __init__(self, gw, body: ChatCompletionRequest, trace_parent=None, arrived=None):
        super().__init__(gw, body, trace_parent, arrived)
        self.tools = body.tools or []
        choice = body.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice != "none" and not self.tools:
            raise bad("tool_choice needs tools", "tool_choice")
        self.tool_choice = choice
        self.forced = choice == "required" or not isinstance(choice, str)
        self.named = choice.function.name if not isinstance(choice, str) else None
        self.parse_tools = bool(self.tools) and choice != "none"

    async def run(self):
        b = self.body
        max_tokens = b.max_completion_tokens or b.max_tokens
        ids = await self.prompt_ids()
        self.check_prompt(ids, max_tokens, "messages")
        k = None
        if b.logprobs:
            k = b.top_logprobs or 0
        elif b.top_logprobs:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        params = sampling_params(b, max_tokens, k, structured=self.structured())
        self.n_prompt = len(ids)
        run = Run(self.gw, self.inputs([ids], params, b.n))
        await run.start()
        if b.stream:
            return StreamingResponse(self.gw.metrics.token_path.timed_writes(self.stream(run)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return self.response(await run.collect())

    async def prompt_ids(self) -> list[int]:
        b = self.body
        messages = [_message_dict(m) for m in b.messages]
        tools = [t.model_dump(exclude_none=True) for t in self.tools] \
            if self.tools and self.tool_choice != "none" else None
        try:
            check_template_kwargs(b.chat_template_kwargs)
            return await chat_prompt_ids(self.gw.tokenizer, messages, b.add_generation_prompt, tools,
                                         self.gw.max_model_len, b.chat_template_kwargs,
                                         example_call=not self.forced)
        except PromptError as e:
            raise from_prompt(e, "messages") from None

    def structured(self) -> StructuredOutput | None:
        spec = response_format_spec(self.body)
        check_structured(spec, "response_format")
        if self.forced:
            if spec is not None:
                raise bad("response_format cannot be combined with a forced tool_choice",
                          "response_format")
            try:
                spec = StructuredOutput(json_schema=toolkit.forced_schema(
                    self.tools, self.named, parallel=self.body.parallel_tool_calls is not False))
            except ValueError as e:
                raise bad(str(e), "tool_choice") from None
            check_structured(spec, "tools")
        return spec

    # -- one JSON response -----------------------------------------------------------------
    def response(self, outs: list[ChoiceOut]) -> dict:
        choices = []
        for i, o in enumerate(outs):
            msg: dict[str, Any] = {"role": "assistant", "content": o.text}
            finish = o.finish_reason
            if self.forced:          # calls even when cut short (max_tokens): never the wrapper
                calls, complete = toolkit.forced_calls(o.text, self.named is None, self.named)
                msg = {"role": "assistant", "content": None, "tool_calls": calls or None}
                finish = "tool_calls" if complete else finish
            elif self.parse_tools and (calls := toolkit.parse_calls(o.text, self.tools)):
                msg = {"role": "assistant", "content": None, "tool_calls": calls}
                finish = "tool_calls"
            choices.append({"index": i, "message": msg, "finish_reason": finish,
                            "logprobs": self.logprobs(o.token_ids, o.logprobs) if self.body.logprobs else None})
        u = usage(self.n_prompt, sum(o.completion_tokens for o in outs), outs[0].cached_tokens, outs,
                  self.timings)
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.gw.model_name, "choices": choices, "usage": u}

    def logprobs(self, ids: list[int], lps: list) -> dict:
        content = []
        for t, (lp, top) in zip(ids, lps):
            s = self.token_str(t)
            content.append({"token": s, "logprob": finite(lp), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.token_str(x), "logprob": finite(l),
                                              "bytes": list(self.token_str(x).encode())}
                                             for x, l in (top or [])]})
        return {"content": content}

    # -- SSE ---------------------------------------------------------------------------------
    async def stream(self, run: Run) -> AsyncIterator[str]:
        opts = self.body.stream_options
        self.inc_usage = bool(opts and opts.include_usage)
        self.cont_usage = bool(opts and opts.continuous_usage_stats)
        n = len(run.inputs)
        outs = [ChoiceOut() for _ in range(n)]
        calls = [toolkit.StreamedCalls(self.tools, self.forced, self.tool_choice == "required",
                                       self.named)
                 if self.parse_tools else None for _ in range(n)]
        try:
            for i in range(n):
                yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}])
                for k, name, piece in calls[i].feed("") if calls[i] else ():   # a named call
                    yield self._call_delta(i, k, calls[i].scan.calls[k]["id"], name, piece)
            async for i, ev in run.events():
                for c in self._event_chunks(i, outs[i], ev, calls[i]):
                    yield c
            if self.inc_usage:
                yield self.chunk([], usage(self.n_prompt, sum(o.completion_tokens for o in outs),
                                           outs[0].cached_tokens, outs, self.timings), True)
        except OpenAIError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    def _event_chunks(self, i: int, o: ChoiceOut, ev, calls: toolkit.StreamedCalls | None
                      ) -> Iterator[str]:
        """The chunks one event of choice i makes (`o` is what the choice made before it)."""
        start, text = len(o.token_ids), ev.text
        o.add(ev)
        if calls is not None and calls.mode != "content":
            for k, name, piece in calls.feed(o.text):
                yield self._call_delta(i, k, calls.scan.calls[k]["id"], name, piece)
            if calls.mode != "content":
                if ev.finish_reason is not None:
                    yield from self._finish_chunks(i, o, ev.finish_reason, calls)
                return
            start, text = 0, o.text        # not a call after all: everything held, as content
        if text or (self.body.logprobs and o.token_ids[start:]):
            yield self.chunk([self._content(i, text, o.token_ids[start:], o.logprobs[start:])],
                             self._running_usage(o))
        if ev.finish_reason is not None:
            yield from self._finish_chunks(i, o, ev.finish_reason, calls)

    def _call_delta(self, i: int, k: int, call_id: str, name: str | None, piece: str) -> str:
        """Call k's first delta (its id and name: `name` given) or a piece of its arguments."""
        if name is not None:
            return self._delta(i, {"tool_calls": [{
                "index": k, "id": call_id, "type": "function",
                "function": {"name": name, "arguments": ""}}]})
        return self._delta(i, {"tool_calls": [{"index": k, "function": {"arguments": piece}}]})

    def _finish_chunks(self, i: int, o: ChoiceOut, finish: str,
                       calls: toolkit.StreamedCalls | None) -> Iterator[str]:
        """What was held back (as tool calls, or as content), then the finish chunk."""
        if calls is not None and (calls.sent_calls or calls.forced):
            rest, complete = calls.finish(o.text)
            for k, name, piece in rest:
                yield self._call_delta(i, k, calls.scan.calls[k]["id"], name, piece)
            if complete:
                finish = "tool_calls"
        elif calls is not None and calls.mode != "content":
            held = toolkit.parse_calls(o.text, self.tools)
            if held:
                finish = "tool_calls"
                for k, c in enumerate(held):
                    yield self._call_delta(i, k, c["id"], c["function"]["name"], "")
                    yield self._call_delta(i, k, c["id"], None, c["function"]["arguments"])
            elif o.text or o.token_ids:
                yield self.chunk([self._content(i, o.text, o.token_ids, o.logprobs)])
        yield self.chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}],
                         self._running_usage(o))

    def _running_usage(self, o: ChoiceOut) -> dict | None:
        return usage(self.n_prompt, o.completion_tokens, o.cached_tokens) if self.cont_usage else None

    def chunk(self, choices: list[dict], u: dict | None = None, with_usage: bool = False) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.gw.model_name, "choices": choices}
        if with_usage or self.inc_usage:
            obj["usage"] = u
        return sse(obj)

    def _delta(self, i: int, delta: dict) -> str:
        return self.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])

    def _content(self, i: int, text: str, ids: list[int], lps: list) -> dict:
        return {"index": i, "delta": {"content": text},
                "logprobs": self.logprobs(ids, lps) if self.body.logprobs else None,
                "finish_reason": None}


def _message_dict(m) -> dict:
    d: dict[str, Any] = {"role": template_role(m.role)}
    content = m.content
    if isinstance(content, list):
        parts = []
        for p in content:
            if p.get("type") != "text":
                raise bad(f"message content part type {p.get('type')!r} is not supported "
                          "(text only)", "messages")
            parts.append(str(p.get("text", "")))
        content = "".join(parts)
    d["content"] = content if content is not None else ""
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        d["tool_calls"] = calls
    return d

