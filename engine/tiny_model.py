"""A tiny Llama-architecture model with deterministic random weights, written from scratch.

`pdserve up` with no `--model` serves this model so that every code path (HF-format loading,
tokenizer, chat template, paged KV, transfer) is real while needing no download. Its text is
meaningless. Everything is written without transformers (a test-only dependency):

    out_dir/
      config.json              LlamaForCausalLM config
      generation_config.json   bos/eos/pad ids
      model.safetensors        float32, Hugging Face Llama tensor names
      tokenizer.json           byte-level BPE trained on the embedded text below
      tokenizer_config.json    PreTrainedTokenizerFast, special tokens, chat template
      chat_template.jinja      the same chat template (where transformers 5 looks first)
      .pdserve-tiny.json       stamp of the arguments; a matching stamp means "already built"

The init scale is chosen so that logits are well spread (std of a few units): greedy
decoding then has no near-ties, and two correct implementations pick the same tokens.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
STAMP = ".pdserve-tiny.json"
FORMAT_VERSION = 1  # bump when the files written here change for the same arguments

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if tools %}\n"
    "{{- '<|system|>\\nYou may call these tools. Reply with "
    "{\"name\": ..., \"arguments\": ...}.\\n' }}\n"
    "{%- for tool in tools %}\n"
    "{{- tool | tojson }}{{ '\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '</s>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{{- '<|' + message['role'] + '|>\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- elif message['content'] %}\n"
    "{%- for part in message['content'] if part['type'] == 'text' %}\n"
    "{{- part['text'] }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}\n"
    "{%- for call in message['tool_calls'] %}\n"
    "{{- '\\n' }}{{ (call['function'] if call['function'] is defined else call) | tojson }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '</s>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|assistant|>\\n' }}\n"
    "{%- endif %}\n"
)

# A few KB of varied English, the tokenizer's whole training corpus. Changing it changes the
# vocabulary (and so every tiny model): bump FORMAT_VERSION if you do.
CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the porch.
Every morning the baker opens her shop at six, and the smell of fresh bread fills the street.
Children walk to school in small groups, talking about games, homework, and the weather.
A server receives a request, reads the prompt, and returns tokens one at a time to the client.
Large language models predict the next word from the words that came before it.
The river runs quietly through the valley, past old mills, green fields, and a stone bridge.
In the winter the mountains are covered with snow, and the roads are closed for weeks.
She asked him what time it was; he looked at the clock and said it was almost noon.
Scientists measure the temperature of the ocean to understand how the climate is changing.
The library has thousands of books about history, science, art, music, and mathematics.
When the train arrived, the passengers stood up, took their bags, and stepped onto the platform.
Please remember to save your work often, because the power might go out during the storm.
Our team builds software that schedules work across many machines in a data center.
A good teacher explains difficult ideas with simple examples and a lot of patience.
The museum opened a new exhibition of paintings, photographs, and sculptures last Friday.
He planted tomatoes, beans, peppers, and herbs in the garden behind the house.
Water boils at one hundred degrees and freezes at zero degrees on the Celsius scale.
The meeting started late because the manager was stuck in traffic on the highway.
Birds fly south in the autumn and return in the spring when the days grow longer.
If you have any questions about the project, send a message and we will answer quickly.
The cat slept on the warm windowsill all afternoon, ignoring the noise from the street.
Numbers like 1, 2, 3, 10, 42, 100, 2024, and 3.14 appear in many everyday texts.
Cooking dinner for friends is a pleasant way to spend a long Saturday evening.
The engineer checked the logs, found the bug, wrote a test, and fixed the problem.
Memory is fast but expensive, while disks are slow but cheap and hold much more data.
A network connects computers so that they can share messages, files, and results.
The doctor told the patient to drink more water, sleep well, and walk every day.
At the market you can buy apples, oranges, bananas, grapes, cheese, fish, and flowers.
Stories about dragons, kings, and brave travelers have been told for hundreds of years.
The answer is yes, but only if the weather is good and everyone arrives on time.
Questions? Answers! Lists: first, second, third. Quotes: "hello", 'world'. Brackets (like this).
Write clearly, think carefully, and always check your results before you share them.
The city council voted to build a new park with trees, benches, and a playground.
Our neighbors have two dogs, three cats, and a parrot that can say a few words.
Light travels faster than sound, which is why we see lightning before we hear thunder.
The company reported higher sales this quarter thanks to strong demand in Europe and Asia.
Mathematics studies numbers, shapes, patterns, and the relations between them.
The assistant replied politely and suggested three possible solutions to the problem.
The user asked the system to summarize the document and translate it into French.
A function takes some inputs, does a computation, and returns an output to its caller.
def add(a, b): return a + b  # a small example of Python code with a comment
for i in range(10): print(i * i)  # loops, calls, and arithmetic in one short line
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
The first step is to read the instructions; the second step is to follow them carefully.
Under the bright moon the sailors sang old songs and told jokes until the morning came.
Rain fell softly on the roof, and the whole family gathered in the kitchen to play cards.
The student solved the puzzle after trying many different approaches for several hours.
Modern phones contain cameras, sensors, radios, and processors that are very powerful.
Travelers should carry a map, some water, a warm jacket, and a charged phone.
The orchestra played a symphony, and the audience applauded for several minutes.
It was the best of times, it was the worst of times, it was the age of wisdom.
Good morning! How are you today? I am fine, thank you, and I hope you are well too.
Tokens, blocks, caches, batches, queues, and streams are words that engineers use a lot.
Prefill computes the prompt; decode produces new tokens; transfer moves the cache between them.
"""


def default_model_dir() -> Path:
    """Where `pdserve up` keeps the embedded tiny model (under engine.config.cache_dir)."""
    from .config import cache_dir
    return cache_dir() / "tiny-llama"


def ensure_default_model() -> Path:
    """Return the default tiny model directory, creating it on first use."""
    return make_tiny_model(default_model_dir())


def make_tiny_model(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    intermediate_size: int = 384,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
) -> Path:
    """Write a tiny Llama model directory (see module docstring) and return its path.

    Idempotent: the same arguments always give byte-identical files, and a directory that
    already holds a model built from the same arguments is returned untouched; one built from
    other arguments is replaced, and any other non-empty directory is refused. The model is
    built in a temporary sibling directory and renamed into place, so concurrent callers
    never see half a model.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    out = Path(out_dir).expanduser()
    args = dict(seed=seed, hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                format_version=FORMAT_VERSION)
    if _stamp_matches(out, args):
        return out
    if out.is_dir() and any(out.iterdir()) and not (out / STAMP).exists():
        raise ValueError(f"{out} exists and is not a tiny model directory; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_model(tmp, args)
        _install(tmp, out, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _stamp_matches(out: Path, args: dict) -> bool:
    try:
        return json.loads((out / STAMP).read_text()) == args
    except (OSError, ValueError):
        return False


def _install(tmp: Path, out: Path, args: dict) -> None:
    """Move the finished `tmp` to `out`, replacing a stale directory; tolerate a racing twin."""
    if out.exists():
        if _stamp_matches(out, args):  # another process finished first
            return
        stale = out.with_name(f".{out.name}.stale-{os.getpid()}")
        os.replace(out, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:
        if not _stamp_matches(out, args):
            raise


def _write_model(d: Path, args: dict) -> None:
    tok = train_tokenizer(args["vocab_size"])
    tok.save(str(d / "tokenizer.json"))
    # The model's vocab must cover the tokenizer; it may be larger (HF allows padding).
    vocab = max(args["vocab_size"], tok.get_vocab_size(with_added_tokens=True))
    config = _config(args, vocab)
    _write_json(d / "config.json", config)
    _write_json(d / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "do_sample": False,
    })
    _write_json(d / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": args["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    })
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    save_file(make_weights(config, args["seed"]), str(d / "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(d / STAMP, args)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _config(args: dict, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args["hidden_size"],
        "intermediate_size": args["intermediate_size"],
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": args["num_heads"],
        "num_key_value_heads": args["num_kv_heads"],
        "head_dim": args["hidden_size"] // args["num_heads"],
        "vocab_size": vocab,
        "max_position_embeddings": args["max_position_embeddings"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


def make_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights under Hugging Face Llama names.

    Scales: embeddings ~ N(0, 1); every projection ~ N(0, 1/fan_in) so each residual branch
    adds O(1) to an O(1) stream; lm_head ~ N(0, (5 / sqrt(hidden))^2) so that, after the final
    RMSNorm (unit RMS), the logits have a standard deviation of about 5.
    """
    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g, dtype=torch.float32) * std

    def norm() -> torch.Tensor:
        return 1.0 + 0.05 * torch.randn(h, generator=g, dtype=torch.float32)

    w = {"model.embed_tokens.weight": normal(config["vocab_size"], h, 1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = normal(q_out, h, 1 / math.sqrt(h))
        w[p + "self_attn.k_proj.weight"] = normal(kv_out, h, 1 / math.sqrt(h))
        w[p + "self_attn.v_proj.weight"] = normal(kv_out, h, 1 / math.sqrt(h))
        w[p + "self_attn.o_proj.weight"] = normal(h, q_out, 1 / math.sqrt(q_out))
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, 1 / math.sqrt(h))
        w[p + "mlp.up_proj.weight"] = normal(inter, h, 1 / math.sqrt(h))
        w[p + "mlp.down_proj.weight"] = normal(h, inter, 1 / math.sqrt(inter))
    w["model.norm.weight"] = norm()
    w["lm_head.weight"] = normal(config["vocab_size"], h, 5.0 / math.sqrt(h))
    return w


def train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on CORPUS: <pad>=0, <s>=1, </s>=2, BOS prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, BOS_ID)])
    return tok
