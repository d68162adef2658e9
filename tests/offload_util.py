"""Helpers for the offload / prefetch / debug tests: runs against the all-resident backend."""

from __future__ import annotations

import functools

import torch

from ftchat.engine import build_experts, generate, load_model, resident_backend
from ftchat.offload.cache import check_invariants
from ftchat.offload.hooks import Hooks
from ftchat.settings import Settings

STEPS = 201  # tokens: the prefill gives the first, then 200 decode steps
PROMPTS = {1: [[3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81]],
           2: [[3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81], [9, 120, 44, 2, 300]]}


@functools.lru_cache(maxsize=None)
def model(folder):
    return load_model(folder)


@functools.lru_cache(maxsize=None)
def reference(folder, bs: int, steps: int = STEPS):
    """Greedy tokens and logits of the all-resident backend (the ground truth)."""
    m = model(folder)
    out = list(generate(m, PROMPTS[bs], steps, resident_backend(m)))
    return [s.tokens for s in out], torch.stack([s.logits for s in out])


class InvariantChecker(Hooks):
    """Checks the slot maps after every decode step."""

    def __init__(self):
        self.problems: list[str] = []
        self.steps = 0

    def end_step(self, b) -> None:
        self.steps += 1
        self.problems += check_invariants(b.maps)


def run(folder, bs: int, steps: int = STEPS, hooks=None, predictor=None, **settings):
    """(tokens, logits, backend) of an offloaded run."""
    m = model(folder)
    ex = build_experts(m, Settings(batch_size=bs, **settings), hooks=hooks or Hooks())
    if predictor is not None:  # predictor(x, router, k), as router_lookahead
        ex.predictor = lambda nxt, x: predictor(x, ex.routers[nxt], ex.cfg.candidates)
    out = list(generate(m, PROMPTS[bs], steps, ex))
    return [s.tokens for s in out], torch.stack([s.logits for s in out]), ex
