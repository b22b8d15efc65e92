"""`tool_choice: "auto"` on a real model: how many of ten prompts that plainly need a tool
come back as tool calls, through a running pdserve (1 prefill + 1 decode + gateway) with the
openai SDK as the client. Greedy decoding, so a run is repeatable.

    python bench/tool_auto.py [--model FILE.gguf] [--max-tokens 96] [--show]

The default model is SmolLM2-135M-Instruct (its template has no tools section, so the tools
reach it in the generic format of gateway/prompt.py). The prompts are held out: none is the
example call the generic format shows. Five control prompts need no tool: a call there is a
false one. Prints, per prompt, whether the reply was a tool call, whether it named the right
tool, and the totals.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.launcher import Launcher  # noqa: E402
from pdserve.processes import free_port  # noqa: E402


def _tool(name, description, **props):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in props.items()},
                       "required": list(props)}}}


TOOLS = [_tool("get_weather", "Get the current weather in a city", city="string"),
         _tool("get_time", "Get the current local time in a city", city="string"),
         _tool("convert_currency", "Convert an amount of money from one currency to another",
               amount="number", source="string", target="string")]
PROMPTS = [   # (prompt, the tool it needs)
    ("What's the weather in Paris?", "get_weather"),
    ("Is it raining in London right now?", "get_weather"),
    ("How hot is it in Cairo today?", "get_weather"),
    ("Tell me the weather forecast for Tokyo.", "get_weather"),
    ("What time is it in New York?", "get_time"),
    ("What is the local time in Sydney?", "get_time"),
    ("Could you check the current time in Berlin?", "get_time"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 50 British pounds?", "convert_currency"),
    ("Change 20 euros into Swiss francs.", "convert_currency"),
]
CONTROLS = [  # prompts no tool serves: a call here is a false one
    "Write a haiku about the sea.",
    "What is the capital of Italy?",
    "Say hello to my friend Anna.",
    "Give me three tips for sleeping better.",
    "What is 12 times 7?",
]


def measure(base_url: str, max_tokens: int, show: bool) -> tuple[int, int, int]:
    """(prompts answered with a call, ... with the right tool, controls answered with one)."""
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="none", timeout=600)
    model = client.models.list().data[0].id
    calls = right = false = 0
    for text, want in [*PROMPTS, *((c, None) for c in CONTROLS)]:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                           tools=TOOLS, tool_choice="auto", temperature=0,
                                           max_tokens=max_tokens)
        msg = r.choices[0].message
        names = [c.function.name for c in msg.tool_calls or []]
        if want is None:
            false += bool(names)
        calls += bool(names) and want is not None
        right += names[:1] == [want]
        verdict = ("ok " if names[:1] == [want] else "-- ") if want else ("-- " if names else "ok ")
        print(f"{'call' if names else 'text':4} {verdict}{'(control) ' if want is None else ''}"
              f"{text!r}: {names or repr((msg.content or '')[:70])}", flush=True)
        if show:
            print(f"     raw: {msg.content!r}" if not names else
                  f"     args: {[c.function.arguments for c in msg.tool_calls]}", flush=True)
    return calls, right, false


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a GGUF file or model directory (default: the default model)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--show", action="store_true", help="print each raw reply too")
    args = ap.parse_args()
    port, t0 = free_port(), time.perf_counter()
    launcher = Launcher(args.model, 1, 1, http_port=port,
                        log_dir=Path(tempfile.mkdtemp(prefix="tool-auto-")))
    launcher.start(900)
    print(f"pdserve ready in {time.perf_counter() - t0:.0f}s ({launcher.model_dir})", flush=True)
    try:
        calls, right, false = measure(f"http://127.0.0.1:{port}/v1", args.max_tokens, args.show)
    finally:
        launcher.stop()
    print(f"auto tool calls: {calls}/{len(PROMPTS)} prompts, {right}/{len(PROMPTS)} with the right "
          f"tool; {false}/{len(CONTROLS)} controls (no tool needed) called one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
