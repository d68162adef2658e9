"""Eviction keys of the slot cache: three bands and two policies (docs/design.md section 4).

A slot's key is one int64; the slot with the lowest key is evicted first (ties: lowest slot index).

    band       base        value inside the band
    empty      0           0                                  (never held)
    low        2^56        clock << 16 | (0xFFFF - rank)      (prefetched, not used yet)
    resident   2^57        score << 8 | h                     (used by a demand ensure)

Low-priority keys order prefetched slots by install time: a smaller clock is older and goes first;
inside one prefetch_ensure call the lower-priority candidate (larger rank) goes first.

Resident keys carry the slot's capped use count h (1..freq_cap) in their low 8 bits, so the key is
the whole per-slot state; score = clock of the last use + (h - 1) * W.

- `lru`: freq_cap = 1, so h = 1 and the key orders by the clock of the last use.
- `rule`: recency plus a capped frequency bonus. Each use after the first adds W clock ticks of
  "virtual recency", up to freq_cap - 1 of them, so an expert used often survives a while after
  its last use, while one used once ages out as under LRU. The bonus is bounded, so a formerly
  hot expert that stops being routed still leaves within (freq_cap - 1) * W ticks.
  W = clamp(S // M - L, 0, L) ticks, M = ids per ensure (B*K), L = layers: S // M is how many
  ensure calls it takes to cycle the whole cache if every id missed, so S // M - L is the slack
  beyond one token's working set. With room for less than one token (W = 0) the bonus would only
  evict the experts the next token reuses, so rule degrades to LRU there; with more room the bonus
  grows to one token per extra use.
  On synthetic routing (Zipf popularity per layer, per-token reuse probability 0.1-0.8, capacity
  1.05-4 tokens) this gave 0-12% fewer misses than LRU and at worst about 1% more; a fixed
  one-token bonus was better at large capacity but up to 60% worse at ~1 token. The test
  tests/test_cache.py::test_rule_beats_lru_on_skewed_routing keeps rule <= lru.

- `score`: ranks resident experts by what the router says of them (ftchat/offload/scores.py):
  each layer's router logits, standardised, are averaged over tokens at a few time constants,
  and the average that has best predicted the routing so far orders the slots. A use stamps the
  key as `lru` does, but from a clock that starts at SCORE_CLOCK0, above every score key, so the
  experts a token used stay until the next token's scores rank them.

Overflow: the low band holds clock < 2^40 and the resident band score < 2^54, so keys stay in
their bands and inside int64 for any run shorter than 2^40 ensure calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

EMPTY_BASE = 0
LOW_BASE = 1 << 56
RES_BASE = 2 << 56
RANK_BITS = 16  # low band: install rank inside one prefetch_ensure call
HIT_BITS = 8  # resident band: capped use count
MAX_BUDGET = 1 << RANK_BITS
MAX_FREQ_CAP = (1 << HIT_BITS) - 1
MASKED = (1 << 63) - 1  # above every real key: a slot that may not be a victim


@dataclass(frozen=True)
class EvictionPolicy:
    """How a use stamps a resident key. freq_cap = 1 is plain LRU."""

    name: str
    freq_cap: int
    reads_scores: bool = False  # keys come from the router's scores (offload/scores.py)

    def __post_init__(self) -> None:
        if not 1 <= self.freq_cap <= MAX_FREQ_CAP:
            raise ValueError(f"freq_cap must be in 1..{MAX_FREQ_CAP}, got {self.freq_cap}")

    def freq_weight(self, num_slots: int, num_layers: int, ids_per_call: int) -> int:
        """W, in clock ticks, of each use after the first (see the module docstring)."""
        if self.freq_cap == 1:
            return 0
        return min(num_layers, max(0, num_slots // ids_per_call - num_layers))

    def stamp(self, old_key: Tensor, clock: Tensor, weight: int) -> Tensor:
        """Resident key after a use at `clock`; an empty or low-priority key starts at h = 1."""
        resident = old_key >= RES_BASE
        h_old = torch.where(resident, old_key & MAX_FREQ_CAP, torch.zeros_like(old_key))
        h = torch.clamp(h_old + 1, max=self.freq_cap)
        score = clock + (h - 1) * weight
        return RES_BASE + (score << HIT_BITS) + h


LRU = EvictionPolicy("lru", freq_cap=1)
RULE = EvictionPolicy("rule", freq_cap=16)
SCORE = EvictionPolicy("score", freq_cap=1, reads_scores=True)
POLICIES = {"lru": LRU, "rule": RULE, "score": SCORE}

SCORE_BITS = 40  # a score key's value: below 2^40, so below every stamp of a clock >= 2^32
SCORE_CLOCK0 = 1 << (SCORE_BITS - HIT_BITS)  # the clock's start under `score`


def low_key(clock: Tensor, rank: Tensor) -> Tensor:
    """Low-priority key of the rank-th install of a prefetch_ensure call at `clock`."""
    return LOW_BASE + (clock << RANK_BITS) + (MAX_BUDGET - 1 - rank)


def band_of(key: Tensor) -> Tensor:
    """0 = empty, 1 = low priority, 2 = resident (elementwise)."""
    return (key >= LOW_BASE).long() + (key >= RES_BASE).long()
