"""The gateway's pure routing rule: the work a worker's cached prefix saves against its load,
with no gRPC in sight, so the simulator (sim/) runs the very rule the gateway runs
(gateway/routing.py's Router calls it with the workers of one pool; sim/flow.py with its
simulated ones).

What a worker holds of a prompt comes from the gateway's index of the workers' own KV events
(gateway/prefix_index.py): `hits[w] = index.match(hashes, w)` = TierHits(device, host, disk),
the prompt's leading blocks w holds, each in its fastest tier. The rule, per candidate w of a
pool, for one prompt:

    saved(w) = block_size x (device + W_HOST x host + W_DISK x disk)          [tokens]
    cost(w)  = load(w) + (prompt tokens - saved(w)) - R x saved(w)            [tokens]
    least    = min over cands of (load_key(), requests_total)   (the least-loaded worker)
    eligible = least, and every w with  in_flight(w) <= in_flight(least) + slack
                                    or  in_flight(w) <= slack_ratio x in_flight(least)
    pick     = min over eligible of (cost, load_key(), requests_total)

  load(w) (`w.load_tokens()`), in the same unit as saved:
    prefill  prompt tokens queued on w and not yet computed: the uncached tokens of this
             gateway's Prefill calls open on it (exact and immediate), plus what its Stats'
             queued_prefill_tokens had beyond them (other gateways'; Stats lag a probe, and
             a call ended since is not counted twice). cost is then the tokens w computes
             before this prompt's first token: a TTFT in token units.
    decode   KV tokens in use on w: the prompt tokens of this gateway's Decode streams open
             on it, plus what its Stats' (total - free) blocks x block size had beyond them
             (the same way). Each decode step reads all of them (memory-bound), and the
             prompt's uncached part is what must be transferred to it (or computed there,
             local): Dynamo's KV router weighs the same two (blocks to prefill + active
             decode blocks) one to one.
  The prompt's own length is the same for every candidate: the pick is min(load - (1 + R) x
    saved).
  R = 1 (--prefix-weight-recompute): a token the pick's cache saves is worth 1 + R queued
    tokens. Without R the cost is this request's TTFT alone, and a holder with a queue as
    long as its saving ties with an idle worker that computes the whole prompt: same TTFT
    for this request, but the prompt's tokens are computed again, and every later request
    on that worker waits for them (and the holder's copy may be evicted by the time the
    next one comes). On the fast CPU engine the long-document trace computed 19611 prompt
    tokens that way, against 14475 for a gateway that always kept a document on the worker
    it last sent it to (bench/RESULTS.md, issue 31, 2026-12-07). With R = 1 a holder keeps
    the prompt while its extra queue is under twice its saving. Prefill picks only
    (`decode_weights`: R = 0): a decode worker's hit saves a KV transfer, and its load sets
    the token rate of every stream on it.
  W_HOST = 0.75, W_DISK = 0.5 (--prefix-weight-host, --prefix-weight-disk): a block revived
    from host memory or disk saves its compute but costs its copy back into the device
    pool (the engine loads it only when that is cheaper than computing it), so it is worth
    a fraction of a device hit; disk reads cost more than host copies.
  slack, slack_ratio (--affinity-slack 16, --affinity-slack-ratio 1.5; decode picks
    `decode_bounds`: --decode-affinity-slack 2, no ratio): a prefix is a preference, not a
    pin. Token costs come partly from Stats a probe old; request counts in flight are exact,
    so a burst of one shared prefix cannot pile past these bounds onto one worker.

So a cached worker wins exactly while its extra load is less than (1 + R) times the tokens
its prefix saves beyond the other's (load(w) - load(other) < (1 + R) x (saved(w) -
saved(other))), within the slack. With no hits anywhere the
pick is the least load in tokens. `hits=None` (--prefix-routing none) is the least-loaded
worker alone.

    leading_hashes(index, prompt, block_size, max_blocks)
        the prompt's chained block hashes (engine/block_hash.py, the engine's own keys), only
        as far as some worker holds them: the index matches leading chains only, so hashing
        stops at the first block no worker holds (a long uncached prompt costs one hash)
    decode_bounds(slack, decode_slack) -> the (slack, slack_ratio) decode picks use
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from engine.block_hash import hash_block_tokens

from .prefix_index import TierHits

MAX_HASHED_BLOCKS = 1024     # the most blocks of a prompt matched: 16k tokens at block size
                             # 16 (hashing stops sooner, at the first block no worker holds)
NO_HITS = TierHits()
REASONS = ("prefix", "load", "slack", "cold", "off")
# prefix: the pick holds blocks of the prompt; load: others hold some, but their load costs
# more than they save; slack: the cheapest was past the slack bounds; cold: nobody holds any;
# off: --prefix-routing none (the least loaded)


@dataclass(frozen=True)
class Weights:
    """What a hit in each tier is worth, in device hits (--prefix-weight-host/-disk), and
    what a saved token is worth beyond this request's wait (--prefix-weight-recompute: R)."""
    host: float = 0.75
    disk: float = 0.5
    recompute: float = 1.0

    def __post_init__(self):
        if not (0 <= self.host <= 1 and 0 <= self.disk <= 1):
            raise ValueError(f"prefix weights must be in [0, 1], got host {self.host}, "
                             f"disk {self.disk}")
        if self.recompute < 0:
            raise ValueError(f"the recompute weight must be >= 0, got {self.recompute}")


@dataclass(frozen=True)
class Pick:
    worker: object
    reason: str
    hits: TierHits = NO_HITS


def saved_tokens(hits: TierHits, block_size: int, weights: Weights) -> float:
    return block_size * (hits.device + weights.host * hits.host + weights.disk * hits.disk)


def _rank(w):
    return w.load_key(), w.requests_total


def choose(cands: Sequence, hits: Mapping[str, TierHits] | None = None, block_size: int = 16,
           weights: Weights = Weights(), slack: int = 16, slack_ratio: float = 1.5) -> Pick | None:
    """The rule above over `cands` (workers with .address, .in_flight, .load_key(),
    .requests_total, .load_tokens()); None if empty. `hits`: address -> TierHits (absent:
    none); None: least loaded only."""
    if not cands:
        return None
    least = min(cands, key=_rank)
    if hits is None:
        return Pick(least, "off")

    def cost(w):
        saved = saved_tokens(hits.get(w.address, NO_HITS), block_size, weights)
        return w.load_tokens() - (1.0 + weights.recompute) * saved

    def within(w):
        return w is least or w.in_flight <= least.in_flight + slack or (
            slack_ratio > 0 and w.in_flight <= slack_ratio * least.in_flight)

    keys = {id(w): (cost(w), _rank(w)) for w in cands}
    best = min((w for w in cands if within(w)), key=lambda w: keys[id(w)])
    got = hits.get(best.address, NO_HITS)
    if min(keys.values()) < keys[id(best)]:
        reason = "slack"
    elif got.total:
        reason = "prefix"
    else:
        reason = "load" if any(hits.get(w.address, NO_HITS).total for w in cands) else "cold"
    return Pick(best, reason, got)


def decode_weights(weights: Weights) -> Weights:
    """A decode pick's weights: the tiers' as given, no recompute weight (R = 0)."""
    return Weights(weights.host, weights.disk, 0.0)


def decode_bounds(slack: int, decode_slack: int) -> tuple[int, float]:
    """A decode pick's (slack, slack_ratio): the smaller absolute slack and no ratio (a
    decode worker's load sets every stream's token rate; a prefix there saves only KV
    transfer)."""
    return min(slack, decode_slack), 0.0


def leading_hashes(index, token_ids: Sequence[int], block_size: int,
                   max_blocks: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks (at most max_blocks), up to the first
    block no worker in `index` (a PrefixIndex) holds."""
    out, parent = [], b""
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        if not index.holders([parent]):
            break
        out.append(parent)
    return out


def with_in_flight(hits: TierHits, hashes: Sequence[bytes], held) -> TierHits:
    """`hits` (a worker's index match for `hashes`) continued by the blocks `held(h)` says an
    open Prefill call on that worker is computing (gateway/inflight.py): counted as device
    hits, since the worker will hold them in its pool by the time this prompt runs."""
    k = hits.total
    while k < len(hashes) and held(hashes[k]):
        k += 1
    return TierHits(hits.device + k - hits.total, hits.host, hits.disk)
