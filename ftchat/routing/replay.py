"""Counts without a GPU: a routing source replayed through the project's own cache code, in
the order OffloadExperts.begin calls it (docs/routing.md 3).

Per layer of a decode step: prefetch_measure (what prefetch would install for this layer,
before its ensure: the one definition of precision), ensure, prefetch_ensure of the next
layer with this layer's slots protected (prefetch on), the router scores recorded (eviction
`score`); the score policy folds them in at the next step's start, as the backend does.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ftchat.offload import cache as sc
from ftchat.offload.policy import POLICIES, SCORE_CLOCK0
from ftchat.offload.scores import RouterScores
from ftchat.routing.calibrated import RoutingStep


@dataclass(frozen=True)
class ReplayConfig:
    num_slots: int
    eviction: str  # rule | lru | score
    prefetch: str  # off | on
    budgets: tuple[int, ...]  # per layer: installs before it (its candidates made one layer up)


@dataclass
class ReplayCounts:
    """Per-token figures over the counted steps; `per_layer_*` [tokens, L] for the link model."""

    tokens: int
    misses: float  # demand rows copied
    installs: float  # prefetch rows copied
    useful: float  # demand hits on a prefetched slot
    selected: float  # candidates prefetch would install (measure mode, before each ensure)
    selected_useful: float  # ... of them, routed by their layer
    per_layer_misses: np.ndarray = field(repr=False)
    per_layer_installs: np.ndarray = field(repr=False)

    @property
    def rows(self) -> float:
        """Rows over the link per token: demand copies plus prefetch installs."""
        return self.misses + self.installs

    @property
    def precision(self) -> float:
        """Useful / selected: of the rows prefetch installs (on) or would install (off), the
        share its layer routes to. One definition wherever ftchat prints the word."""
        if self.installs:
            return self.useful / self.installs
        return self.selected_useful / self.selected if self.selected else float("nan")

    def useful_per_layer(self, num_layers: int) -> float:
        """Useful predictions per predicted layer (layers 1..L-1)."""
        useful = self.useful if self.installs else self.selected_useful
        return useful / (num_layers - 1)


def replay(steps: Iterable[RoutingStep], num_experts: int, cfg: ReplayConfig,
           warmup: int) -> ReplayCounts:
    """Counts of every step after the first `warmup` (the cache starts empty)."""
    policy = POLICIES[cfg.eviction]
    maps = scores = None
    per_m, per_i = [], []
    sel = sel_use = 0
    for t, step in enumerate(steps):
        L = step.routed.shape[0]
        if maps is None:
            maps = sc.SlotMaps.create(L, num_experts, cfg.num_slots,
                                      clock0=SCORE_CLOCK0 if policy.reads_scores else 0)
            if policy.reads_scores:
                if step.logits is None:
                    raise ValueError("eviction score needs router logits: a trace has none")
                scores = RouterScores(L, num_experts, step.routed.shape[1], "cpu")
        if len(cfg.budgets) != L:
            raise ValueError(f"{len(cfg.budgets)} budgets for {L} layers")
        if scores is not None:
            scores.observe(maps)
        before_m = maps.stats.misses.clone()
        before_i = maps.stats.prefetch_installs.clone()
        routed = torch.from_numpy(step.routed)
        cands = torch.from_numpy(step.candidates)
        for layer in range(L):
            ids = routed[layer][None]  # [1, K]
            if layer > 0 and cfg.prefetch == "off" and t >= warmup:
                c = sc.prefetch_measure(maps, layer, cands[layer - 1], cfg.budgets[layer], ids)
                sel += int(c.selected)
                sel_use += int(c.useful)
            plan = sc.ensure(maps, layer, ids, policy)
            if cfg.prefetch == "on" and layer + 1 < L and cfg.budgets[layer + 1] > 0:
                sc.prefetch_ensure(maps, layer + 1, cands[layer], cfg.budgets[layer + 1],
                                   plan.slots)
            if scores is not None:
                scores.record(layer, torch.from_numpy(step.logits[layer])[None], ids)
        if t == warmup - 1:
            base_useful = int(maps.stats.prefetch_useful.sum())
        if t >= warmup:
            per_m.append((maps.stats.misses - before_m).numpy())
            per_i.append((maps.stats.prefetch_installs - before_i).numpy())
    n = len(per_m)
    if n == 0:
        raise ValueError("no step after the warm-up")
    m, i = np.stack(per_m), np.stack(per_i)  # [n, L]
    useful = int(maps.stats.prefetch_useful.sum()) - (base_useful if warmup else 0)
    return ReplayCounts(tokens=n, misses=m.sum() / n, installs=i.sum() / n, useful=useful / n,
                        selected=sel / n, selected_useful=sel_use / n,
                        per_layer_misses=m, per_layer_installs=i)


def belady(steps: Sequence[RoutingStep], num_experts: int, num_slots: int,
           warmup: int) -> float:
    """Demand misses per token of the furthest-next-use oracle over the routed ids (each
    token's ids per layer in order; a token's ids need not be resident together)."""
    seq, token_start = [], []
    for step in steps:
        token_start.append(len(seq))
        for layer, ids in enumerate(step.routed.tolist()):
            seq.extend(layer * num_experts + e for e in dict.fromkeys(ids))
    never = len(seq)
    nxt, last = [never] * len(seq), {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], never)
        last[seq[i]] = i
    held: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    counted = 0
    start = token_start[warmup] if warmup < len(token_start) else never
    for i, g in enumerate(seq):
        if g not in held:
            counted += i >= start
            if len(held) >= num_slots:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if held.get(victim) == -neg:
                        del held[victim]
                        break
        held[g] = nxt[i]
        heapq.heappush(heap, (-nxt[i], g))
    return counted / (len(steps) - warmup)
