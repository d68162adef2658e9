"""The `score` eviction policy's state: what the routers said of every expert, averaged over
tokens (docs/design.md section 4).

Each decode step records every layer's router logits, standardised over the experts, plus
ROUTED_BONUS for the experts the layer routed to (the largest over the batch's rows). At the
next step's first layer they are folded into averages at a few time constants (DECAYS, per
token); each average is also graded on how high it ranked the experts this token's routers put
first, and the best-graded average orders the resident slots (cache.rekey_by_score). A
routing that drifts fast is followed by a short average, one that persists by a long one,
without a setting. Every tensor here has a fixed address and every op runs on the compute
stream without a host sync, so a CUDA graph replays it.
Legend: D averages, L layers, E experts, B rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.offload import cache as sc

DECAYS = (0.5, 0.7, 0.85, 0.95)  # per token: time constants of ~1.4 to ~20 tokens
# Added to a routed expert's standardised logit: the averages then weigh what was routed, not
# only what the router leaned to. Replayed (docs/routing.md 3), logits alone missed up to 18 %
# more than rule on the demo model's trained routing; with the routed part (2.0; 0.5 to 4 tried)
# 2-4 % fewer on its long capture, and at most 1.2 % more than logits alone on the calibrated
# routing, whose logits are a persistent part plus noise.
ROUTED_BONUS = 2.0
GRADE_DECAY = 0.999  # the grades' memory, in tokens


def standardise(x: Tensor) -> Tensor:
    """Zero mean, unit deviation along the last dim (all-equal rows give zeros)."""
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / (x.std(-1, keepdim=True) + 1e-6)


class RouterScores:
    def __init__(self, num_layers: int, num_experts: int, top_k: int,
                 device: torch.device | str):
        d = len(DECAYS)
        self.top_k = top_k
        self.decay = torch.tensor(DECAYS, dtype=torch.float32, device=device).view(d, 1, 1)
        self.avg = torch.zeros(d, num_layers, num_experts, device=device)  # [D, L, E]
        self.grade = torch.zeros(d, device=device)  # [D] how well each average predicted
        self.logits = torch.zeros(num_layers, num_experts, device=device)  # [L, E] this token's
        self.fresh = torch.zeros(1, dtype=torch.bool, device=device)  # logits recorded since
        self.bonus = torch.full((1, top_k), ROUTED_BONUS, device=device)  # [1, K] a constant

    def reset(self) -> None:
        for t in (self.avg, self.grade, self.logits, self.fresh):
            t.zero_()

    def record(self, layer: int, logits: Tensor, ids: Tensor) -> None:
        """logits [B, E] and routed ids [B, K] of `layer` at this step (a step records from
        layer 0 on). Four kernels a layer: layer_norm standardises (its biased deviation differs
        from standardise's by one factor for every layer and expert, which the ranking does not
        see), the routed experts get ROUTED_BONUS, the rows' largest is kept."""
        z = F.layer_norm(logits.float(), logits.shape[-1:], eps=1e-12)  # [B, E]
        z.scatter_add_(1, ids, self.bonus.expand_as(ids))
        torch.amax(z, 0, out=self.logits[layer])
        if layer == 0:
            self.fresh.fill_(True)

    def observe(self, maps: sc.SlotMaps) -> None:
        """Fold the last step's logits in (if any were recorded) and rekey the resident slots."""
        z = self.logits  # [L, E]
        top = z.topk(self.top_k, dim=-1).indices  # [L, K] what the routers put first
        ranked = standardise(self.avg)  # [D, L, E] the averages before this token
        hit = ranked.gather(2, top.expand(ranked.shape[0], -1, -1)).mean((1, 2))  # [D]
        fresh = self.fresh.float()
        self.grade.mul_(1 - fresh * (1 - GRADE_DECAY)).add_(fresh * hit)
        keep = 1 - fresh * (1 - self.decay)  # [D, 1, 1]: 1 when nothing was recorded
        self.avg.mul_(keep).add_((1 - keep) * z)
        self.fresh.fill_(False)
        best = self.grade.argmax().reshape(1)
        score = standardise(self.avg.index_select(0, best)[0])  # [L, E]
        sc.rekey_by_score(maps, score.reshape(-1))
