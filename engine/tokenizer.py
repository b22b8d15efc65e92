"""Tokenizer, chat template, incremental detokenizer and stop strings, from an HF directory
or a GGUF file.

Loads a Hugging Face model directory offline, with the `tokenizers` library and jinja2 only
(transformers is a test dependency). A GGUF file (or a directory holding one) instead gives
the same parts rebuilt from its tokenizer.ggml.* metadata (engine/gguf.py). Files read:

    tokenizer.json           required: the fast tokenizer (normaliser, BPE, post-processor)
    tokenizer_config.json    bos/eos/pad tokens (strings or {"content": ...}), add_bos_token,
                             chat_template (a string, or a list of {"name", "template"})
    chat_template.jinja      where transformers 5 writes the default template (wins over config)
    generation_config.json   eos_token_id, an int or a list; all go into `eos_token_ids`

Chat templates are rendered the way transformers renders them (sandboxed, trim_blocks,
lstrip_blocks, `raise_exception`, a `tojson` that does not escape HTML, `strftime_now`), so
the rendered prompt is the same string a transformers user would get. Templates that begin
with `{{ bos_token }}` already contain BOS: encode such prompts with add_special_tokens=False.
"""
from __future__ import annotations

import functools

import json
from collections import deque
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

# How many tokens before the read offset are re-decoded for context (vLLM uses 5): enough for
# decoders whose output for a token depends on its left neighbour (leading-space handling).
_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes, so at most 4 byte tokens; past this many pending
# tokens the text is genuinely invalid and is emitted with its replacement characters.
_MAX_PENDING_TOKENS = 8


class Tokenizer:
    """A Hugging Face tokenizer directory: encode, decode, special ids, chat template."""

    def __init__(self, hf_tokenizer, config: dict, chat_templates: dict[str, str],
                 generation_config: dict):
        self._tok = hf_tokenizer
        self._config = config
        self.chat_templates = chat_templates  # name -> template source; "default" first
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.pad_token_id = self._id_of(self.pad_token)
        self.eos_token_ids = _collect_eos_ids(self._id_of(self.eos_token), generation_config)
        self.eos_token_id = self._id_of(self.eos_token)
        if self.eos_token_id is None and self.eos_token_ids:
            self.eos_token_id = min(self.eos_token_ids)
        self.add_bos_token = config.get("add_bos_token")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.model_max_length = config.get("model_max_length")
        self.all_special_ids = {i for i, t in hf_tokenizer.get_added_tokens_decoder().items()
                                if t.special}

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a local HF model directory or GGUF file; raises ValueError if the
        directory has no tokenizer.json (or the GGUF file a tokenizer this can rebuild)."""
        from tokenizers import Tokenizer as HFTokenizer

        from .gguf import find_gguf, open_gguf
        if find_gguf(path) is not None:
            return cls(*open_gguf(path).tokenizer_parts())
        d = Path(path)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{d}: missing tokenizer.json (only fast tokenizers are supported)")
        config = _read_json(d / "tokenizer_config.json")
        return cls(HFTokenizer.from_file(str(tok_file)), config, _load_chat_templates(d, config),
                   _read_json(d / "generation_config.json"))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's vocab may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token string: one token covers at most this much
        (normalized) text, so a text over context x this is too long without tokenizing it."""
        return max((len(t.encode()) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # Some tokenizer.json files leave BOS to the Python tokenizer class (add_bos_token).
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def decode_raw(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode without the clean-up pass: concatenation-friendly, for incremental use."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance builds its tokenizer from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, chat_template: str | None = None,
                            **kwargs: Any) -> str:
        """Render `messages` to the prompt string, as transformers' apply_chat_template(tokenize=False).

        `chat_template` may name one of the directory's templates or be a template source.
        Extra keyword arguments (documents, enable_thinking, ...) are passed to the template.
        """
        source = self._select_template(chat_template, tools)
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise TypeError("tools must be JSON-schema dicts")
        special = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                     ("pad_token", self.pad_token), ("unk_token", self.unk_token))
                   if v is not None}
        variables = {**special, **kwargs}
        return _compile(source).render(messages=messages, tools=tools,
                                       add_generation_prompt=add_generation_prompt, **variables)

    def _select_template(self, chat_template: str | None, tools) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise ValueError("this tokenizer has no chat template; pass chat_template=...")

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, O(1) tokens of decoding per call.

    Like vLLM, it keeps two offsets into `ids` (prompt + output):

        ids:  ... p p p p p | o o o o | o o   (p prompt, o output)
                  ^prefix_offset      ^read_offset
        prefix text = decode(ids[prefix:read])   already emitted (context only)
        full text   = decode(ids[prefix:])       delta = full text minus prefix text

    A delta is emitted only when the full text does not end in U+FFFD, i.e. when the last
    token did not stop inside a multi-byte UTF-8 character; otherwise the pending tokens wait
    for the next call. Then the offsets move forward, so each call decodes a window of a
    few tokens whatever the sequence length.

    After an emission the new prefix offset is the old read offset (vLLM's rule): the context
    window always begins at a character boundary.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.output_token_ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text (maybe "")."""
        self._ids.append(token_id)
        self.output_token_ids.append(token_id)
        return self._emit(force=False)

    def flush(self) -> str:
        """At end of stream: emit whatever is pending, even an incomplete character."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        decode = self._tok.decode_raw
        prefix_text = decode(self._ids[self.prefix_offset:self.read_offset], self._skip)
        full_text = decode(self._ids[self.prefix_offset:], self._skip)
        pending = len(self._ids) - self.read_offset
        ready = len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd")
        # Too many pending tokens (invalid UTF-8, or a run of skipped special tokens): emit
        # what there is so the window, and so the cost per call, stays bounded.
        if not (ready or force or pending >= _MAX_PENDING_TOKENS):
            return ""
        delta = full_text[len(prefix_text):]
        # The next window starts where this delta started: a point where complete text was
        # emitted, never inside a character (byte-fallback decoders turn a whole run of byte
        # tokens into U+FFFD when the run starts mid-character). Older ids are dropped.
        self._ids = self._ids[self.read_offset:]
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.text += delta
        return delta


class StopStrings:
    """One request's stop strings, matched as its text grows at a cost per character that
    does not depend on how many stop strings there are (an Aho-Corasick automaton, shared by
    every request with the same list; the request only keeps its current node).

    `feed(delta)` scans the newest text and reports the stop string that ends in it and
    begins earliest (ties: the first in the list, as the request listed them); `held()` is
    how many characters at the end of the text may still become a stop string, which a
    stream holds back. `steps` counts automaton transitions taken (at most 2 per character
    fed, amortized), the cost a test bounds.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self._auto = _automaton(tuple(self.stops))
        self._node = 0
        self._seen = 0           # characters fed so far
        self.steps = 0

    def feed(self, delta: str) -> tuple[int, str] | None:
        """(index in the whole text where it begins, the stop string) of the earliest
        beginning stop string that ends inside `delta`, or None."""
        goto, fail, out, _ = self._auto
        node, best, steps = self._node, None, 0
        for k, ch in enumerate(delta):
            while True:
                steps += 1
                nxt = goto[node].get(ch)
                if nxt is not None:
                    node = nxt
                    break
                if node == 0:
                    break
                node = fail[node]
            if out[node] is not None:
                length, index = out[node]
                start = self._seen + k + 1 - length
                if best is None or (start, index) < best:
                    best = (start, index)
        self._node, self._seen, self.steps = node, self._seen + len(delta), self.steps + steps
        return None if best is None else (best[0], self.stops[best[1]])

    def held(self) -> int:
        """Length of the longest suffix of the text fed that is a proper prefix of some stop
        string."""
        return self._auto[3][self._node]

    @staticmethod
    def prepare(stops: Sequence[str]) -> None:
        """Build (and cache) the automaton of `stops`, so that a StopStrings made from the
        same list later finds it built. The gateway calls this in a worker thread: for
        16 x 1 kB stops the build takes tens of milliseconds, too long for its event loop."""
        _automaton(tuple(stops))


@lru_cache(maxsize=32)
def _automaton(stops: tuple[str, ...]):
    """(goto, fail, out, held) per trie node, node 0 the root: `goto` the child per character,
    `fail` the node of the longest proper suffix that is in the trie, `out` (length, list
    index) of the longest stop string ending at the node (None: none does), `held` the depth
    of the deepest node on the fail chain that has children (a proper prefix of a stop)."""
    goto: list[dict[str, int]] = [{}]
    depth, own = [0], [None]
    for index, stop in enumerate(stops):
        node = 0
        for ch in stop:
            nxt = goto[node].get(ch)
            if nxt is None:
                nxt = len(goto)
                goto[node][ch] = nxt
                goto.append({})
                depth.append(depth[node] + 1)
                own.append(None)
            node = nxt
        if stop and own[node] is None:
            own[node] = (len(stop), index)
    n = len(goto)
    fail, out, held = [0] * n, [None] * n, [0] * n
    queue = deque(goto[0].values())
    while queue:                       # breadth first: a node's fail node is done before it
        node = queue.popleft()
        out[node] = own[node] or out[fail[node]]
        held[node] = depth[node] if goto[node] else held[fail[node]]
        for ch, child in goto[node].items():
            f = fail[node]
            while f and ch not in goto[f]:
                f = fail[f]
            fail[child] = goto[f][ch] if ch in goto[f] else 0
            queue.append(child)
    return goto, fail, out, held


# ----------------------------------------------------------------------------- loading helpers

def has_tokenizer(path: str | Path) -> bool:
    """Whether `path` is a GGUF model or a directory with tokenizer.json."""
    from .gguf import find_gguf
    return find_gguf(path) is not None or (Path(path) / "tokenizer.json").is_file()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(tok) -> str | None:
    """Special tokens appear as "<s>" or as {"content": "<s>", ...} (AddedToken dicts)."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _collect_eos_ids(eos_id: int | None, generation_config: dict) -> set[int]:
    ids = set() if eos_id is None else {eos_id}
    gen = generation_config.get("eos_token_id")
    if isinstance(gen, int):
        ids.add(gen)
    elif isinstance(gen, list):
        ids.update(int(i) for i in gen)
    return ids


def _load_chat_templates(d: Path, config: dict) -> dict[str, str]:
    """name -> source. chat_template.jinja and additional_chat_templates/ win over the config."""
    templates: dict[str, str] = {}
    cfg = config.get("chat_template")
    if isinstance(cfg, str):
        templates["default"] = cfg
    elif isinstance(cfg, list):
        templates.update({t["name"]: t["template"] for t in cfg})
    if (d / "chat_template.jinja").is_file():
        templates["default"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    extra = d / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    return templates


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (only used when the config asks for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


# ----------------------------------------------------------------------------- jinja

@lru_cache(maxsize=32)
def _compile(source: str):
    """Compile a chat template in a sandbox configured like transformers'."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text; render it as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
