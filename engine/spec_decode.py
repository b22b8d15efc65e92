"""Speculative decoding: propose k tokens cheaply, verify them in one target forward.

    step t:  request has tokens ... x            (x sampled, its KV not yet computed)
             proposer guesses  d1 .. dk          (n-gram lookup, or a small draft model)
             target computes   x d1 .. dk        (k+1 positions, one forward, like a prefill chunk)
             logits L0 .. Lk:  Li predicts the token after position i
             verify in order:  accept d(i+1) from Li, or emit a corrected token and stop;
                               all k accepted: one bonus token from Lk
             => 1 .. k+1 tokens per step; KV of rejected drafts is dropped (blocks trimmed)

Verification keeps the target's distribution exactly (engine/sampler.py `Sampler.verify`):
greedy rows take the argmax; sampled rows accept a proposed token d with probability
min(1, p(d) / q(d)) and otherwise draw from the normalised (p - q)+, where p is the
target's processed distribution and q the proposer's (a point mass for n-gram lookup and
the greedy draft model: accept with p(d), else draw from p without d). Every emitted token
goes through the engine's usual per-token rules (stop tokens, max_tokens, the grammar), so
a rejected token never reaches the grammar and an early stop ends the run.

Adaptive: a request's k follows its recent acceptance (shrinks to 1 when drafts keep being
rejected, grows back as they are accepted), and no request speculates in a step where the
running batch is at least `disable_batch_size` (decode is then compute-bound: the extra
positions cost real time). Proposals are cut to the request's remaining max_tokens and
context, and dropped when the cache is short of blocks (never a preemption for a guess).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass
class SpeculativeConfig:
    method: str                         # "ngram" | "draft"
    k: int = 4                          # tokens proposed per step (most)
    n: int = 3                          # ngram: longest suffix matched
    min_n: int = 2                      # ngram: shortest suffix matched
    draft_model: str = ""               # draft: model directory (the target's tokenizer)
    disable_batch_size: int = 32        # no speculation when this many requests run

    def __post_init__(self):
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be ngram or draft, got {self.method!r}")
        if not 1 <= self.k <= 16:
            raise ValueError(f"speculative k must be in [1, 16], got {self.k}")
        if not 1 <= self.min_n <= self.n:
            raise ValueError(f"speculative n-gram sizes need 1 <= min_n <= n, got {self.min_n}, {self.n}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative draft needs a model: draft:DIR,k=4")
        if self.disable_batch_size < 1:
            raise ValueError("speculative disable_batch_size must be >= 1")

    @classmethod
    def parse(cls, spec: str) -> "SpeculativeConfig | None":
        """'' -> None; 'ngram:n=3,k=4'; 'draft:/models/small,k=4'; also min_n= and
        disable_batch_size=. ValueError naming what is wrong."""
        spec = spec.strip()
        if not spec:
            return None
        method, _, rest = spec.partition(":")
        kw: dict = {}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                if method != "draft" or "draft_model" in kw:
                    raise ValueError(f"speculative: expected key=value, got {part!r} in {spec!r}")
                kw["draft_model"] = part
                continue
            if key not in ("k", "n", "min_n", "disable_batch_size"):
                raise ValueError(f"speculative: unknown option {key!r} in {spec!r}")
            try:
                kw[key] = int(value)
            except ValueError:
                raise ValueError(f"speculative: {key} must be an integer, got {value!r}") from None
        return cls(method=method, **kw)


def ngram_propose(tokens: list[int], k: int, n: int, min_n: int = 1) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the
    longest suffix of `tokens` (n down to min_n long); [] when there is none.

    The search runs in C (`bytes.rfind` over the ids packed as 4-byte words), so a long
    context costs microseconds, not a Python loop per position."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    buf = array("i", tokens).tobytes()
    for size in range(min(n, len(tokens) - 1), min_n - 1, -1):
        pattern = buf[-4 * size:]
        end = len(buf) - 4                 # an occurrence must end before the last token
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:                # aligned on a token, not inside one
                follow = at // 4 + size
                return tokens[follow:follow + k]
            end = at + 4 * size - 1
    return []


@dataclass
class SpecState:
    """A request's adaptive speculation: its proposal length k follows recent acceptance, and
    while acceptance stays very poor the request stops proposing for a while (`wait` steps,
    doubling each time it is still poor when it tries again), so a text that does not repeat
    itself costs almost nothing."""
    k: int
    accepted_ema: float = 1.0
    backoff: int = 0
    wait: int = 0

    def update(self, proposed: int, accepted: int, k_max: int) -> None:
        if proposed == 0:
            return
        self.accepted_ema = 0.7 * self.accepted_ema + 0.3 * (accepted / proposed)
        if accepted == proposed:
            self.k = min(k_max, self.k + 1)
        elif self.accepted_ema < 0.5:
            self.k = max(1, min(self.k - 1, accepted + 1))
        if self.accepted_ema < 0.2:
            self.backoff = min(max(2 * self.backoff, 2), 64)
            self.wait = self.backoff
        else:
            self.backoff = 0

    def ready(self) -> bool:
        """Whether to propose this step (counts a waiting step down)."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True


@dataclass
class SpecStats:
    """Counters with vLLM's meaning: drafts (steps in which a request speculated), draft
    tokens proposed, accepted tokens, accepted per draft position, and tokens emitted by
    speculating requests (accepted + the one corrected or bonus token per draft)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += emitted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.extend([0] * (proposed - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


class Speculator:
    """A decode engine's speculation: which running requests propose how many tokens this
    step (`propose`), and the accept-or-correct walk over the target's logits (`verify`).
    It edits only the requests' proposals and its own per-request state and counters; the
    scheduler keeps the accepted KV (Scheduler.accept_speculative)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: "DraftProposer | None" = None):
        self.config, self.max_model_len, self.draft = config, max_model_len, draft
        self.stats = SpecStats()
        self.states: dict[str, SpecState] = {}

    def propose(self, running: list) -> None:
        """Proposals for the running requests that are decoding, unless the batch is large
        enough that decode is compute-bound (then nobody speculates this step)."""
        sc = self.config
        for r in running:
            r.spec_token_ids = []
        if len(running) >= sc.disable_batch_size:
            return
        wants = []
        for r in running:
            if (r.prefill_only or not r.sampling_params.speculative
                    or r.num_computed_tokens != r.num_tokens - 1):
                continue
            state = self.states.setdefault(r.request_id, SpecState(sc.k))
            if not state.ready():
                continue
            # k + 1 tokens may come out: stay within max_tokens and the context
            k = min(state.k, r.max_tokens - len(r.output_token_ids) - 1, self.max_model_len - r.num_tokens - 1)
            if k > 0:
                wants.append((r, k))
        if self.draft is not None:
            got = self.draft.propose([(r.request_id, r.all_token_ids, k) for r, k in wants])
            for r, k in wants:
                r.spec_token_ids = got.get(r.request_id, [])[:k]
        else:
            for r, k in wants:
                r.spec_token_ids = ngram_propose(r.all_token_ids, k, sc.n, sc.min_n)

    def verify(self, req, drafts: list[int], emit) -> tuple[list[int], int, object]:
        """Walk the proposal: `emit(i, draft)` samples position i against `draft` (None: the
        bonus position) through the engine's per-token rules and returns (token, accepted,
        output); the walk stops at the first rejection or a finish. -> (tokens emitted, drafts
        accepted, the last output)."""
        new, accepted, out = [], 0, None
        for i in range(len(drafts) + 1):
            token, ok, out = emit(i, drafts[i] if i < len(drafts) else None)
            new.append(token)
            accepted += ok
            if req.is_finished or not ok:
                break
        self.stats.record(len(drafts), accepted, len(new))
        state = self.states.get(req.request_id)
        if state is not None:
            state.update(len(drafts), accepted, self.config.k)
        return new, accepted, out

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)


class DraftProposer:
    """Proposals from a smaller model sharing the target's tokenizer, run greedily by its own
    engine (own paged KV, own prefix cache) in the same worker.

    Each round re-adds every speculating request to the draft engine with the target's tokens
    so far and decodes k tokens: the draft's prefix cache holds the earlier rounds' KV, so a
    round computes only the tokens since the last full cached block plus the k drafts. The
    draft engine's prompt is the request's prompt as the decode worker received it, so the
    prefill worker needs to know nothing about the draft."""

    def __init__(self, engine):
        self.engine = engine

    def propose(self, wants: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        from .sampling_params import SamplingParams
        eng = self.engine
        for rid in list(eng.requests):          # last round's leftovers
            eng.abort_request(rid)
        added = 0
        for rid, tokens, k in wants:
            try:
                eng.add_request(rid, tokens, SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
                added += 1
            except ValueError:                  # longer than the draft's context: no proposal
                continue
        got: dict[str, list[int]] = {}
        budget = eng.config.scheduler.max_num_batched_tokens
        steps = sum(len(t) for _, t, _ in wants) // budget + max((k for *_, k in wants), default=0) + added + 2
        for _ in range(steps):                  # bounded: prefill chunks + k decode steps
            if not eng.has_unfinished_requests():
                break
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = list(o.token_ids)
        return got
