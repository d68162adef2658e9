"""Sampling, opt-in: the token chooser `engine.decode` takes instead of its greedy argmax.

Per row (one request each), in llama-cli's order: repeat penalty over the row's last
REPEAT_WINDOW tokens, top-k, top-p, min-p (both on the untempered distribution), temperature,
then one draw from the row's own torch.Generator, seeded once per request. Every step runs on
the logits' device with no host sync: the decode loop's token readback stays the only one. A
row with temperature 0 takes the argmax of its penalized logits.

The draw is the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i (it is the Gumbel-max trick written with probabilities), with no sort of random
numbers and no host sync, unlike torch.multinomial on some devices.
Legend: B batch (rows), V vocab, W window.
"""

from __future__ import annotations

import dataclasses

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

REPEAT_WINDOW = 64  # tokens a repeat penalty looks back over (llama-cli's repeat_last_n)


TOP_K_CAP = 2**31  # above any vocabulary size


@dataclass(frozen=True)
class Sampling:
    """How one request chooses its tokens; the defaults are greedy decoding."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repeat_penalty: float = 1.0  # 1: off
    seed: int | None = None  # None: drawn at random when the request starts
    min_p: float = 0.0  # 0: off; else drop tokens below min_p x the likeliest one's probability

    @property
    def greedy(self) -> bool:
        """The plain argmax: no temperature and no penalty."""
        return self.temperature == 0 and self.repeat_penalty == 1

    @property
    def sampled(self) -> bool:
        """Tokens drawn at random (temperature above 0): the reply has a seed."""
        return self.temperature > 0

    @classmethod
    def from_settings(cls, s) -> Sampling:
        """The settings' sampling; a field they leave unset (None) takes the default here."""
        d = cls()
        given = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                 "repeat_penalty": s.repeat_penalty, "min_p": s.min_p}
        return dataclasses.replace(d, seed=s.seed, **{k: v for k, v in given.items()
                                                      if v is not None})

    def with_seed(self) -> Sampling:
        """This request with its seed fixed (a random one where none was given), so that the
        reply can say which seed reproduces it."""
        if not self.sampled or self.seed is not None:  # a penalty alone draws nothing
            return self
        return dataclasses.replace(self, seed=secrets.randbits(63))


class Sampler:
    """A token chooser for `engine.decode`: `sampler(logits [B, V]) -> tokens [B]` (int64, on
    the logits' device). Row b follows params[b] and draws from its own generator, so a row's
    tokens do not depend on the rows decoded beside it.

    Args:
        params: one Sampling per row, seeds fixed (Sampling.with_seed) where sampling.
        prompts: each row's prompt ids: the repeat penalty's window starts with their tail.
        device: where the logits are.
    """

    def __init__(self, params: Sequence[Sampling], prompts: Sequence[Sequence[int]],
                 device: torch.device):
        B = len(params)
        self.device = device
        self.temperature = torch.tensor([p.temperature for p in params], device=device)
        self.sampled = [p.temperature > 0 for p in params]
        self.any_sampled = any(self.sampled)
        # a K past the vocabulary keeps every token, as 0 does: capped to fit an int64
        self.top_k = torch.tensor([min(p.top_k, TOP_K_CAP) for p in params], device=device)
        self.top_p = torch.tensor([p.top_p for p in params], device=device)
        self.min_p = torch.tensor([p.min_p for p in params], device=device)
        self.penalty = torch.tensor([p.repeat_penalty for p in params], device=device)
        self.penalized = any(p.repeat_penalty != 1 for p in params)
        self.generators = []
        for p in params:
            g = None
            if p.temperature > 0:
                if p.seed is None:
                    raise ValueError("a sampled row needs its seed fixed (Sampling.with_seed)")
                g = torch.Generator(device=device)
                g.manual_seed(p.seed)
            self.generators.append(g)
        # The recent tokens of each row [B, W]; a short prompt is padded with its first token
        # (a token listed twice is penalized once: the penalty sets, it does not accumulate).
        rows = []
        for ids in prompts:
            tail = list(ids)[-REPEAT_WINDOW:]
            rows.append([tail[0]] * (REPEAT_WINDOW - len(tail)) + tail)
        self.recent = torch.tensor(rows, dtype=torch.long, device=device).reshape(B, -1)

    def __call__(self, logits: Tensor) -> Tensor:
        x = logits.float()  # [B, V]; a copy: the caller's logits stay as they were
        if self.penalized:
            x = x.clone() if x is logits else x
            seen = x.gather(1, self.recent)  # [B, W]
            p = self.penalty[:, None]
            x.scatter_(1, self.recent, torch.where(seen > 0, seen / p, seen * p))
        tokens = x.argmax(-1)  # [B]: the rows with temperature 0
        if self.any_sampled:
            tokens = torch.where(self.temperature > 0, self._draw(x), tokens)
        if self.penalized:
            self.recent = torch.cat([self.recent[:, 1:], tokens[:, None]], 1)
        return tokens

    def _draw(self, x: Tensor) -> Tensor:
        B, V = x.shape
        vals, order = x.sort(dim=-1, descending=True, stable=True)  # [B, V]
        rank = torch.arange(V, device=x.device)[None]
        k = torch.where(self.top_k > 0, self.top_k, V)[:, None]
        vals = vals.masked_fill(rank >= k, float("-inf"))
        probs = vals.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        # top-p: the likeliest tokens until their mass reaches p (rank 0 always stays)
        vals = vals.masked_fill(before >= self.top_p[:, None], float("-inf"))
        # min-p: tokens below min_p x the likeliest one's probability (untempered; rank 0 stays)
        vals = vals.masked_fill(probs < self.min_p[:, None] * probs[:, :1], float("-inf"))
        temp = torch.where(self.temperature > 0, self.temperature, 1.0)[:, None]
        probs = (vals / temp).softmax(-1)
        picks = []
        for b in range(B):
            g = self.generators[b]
            if g is None:  # a greedy row beside sampled ones: its pick is not used
                picks.append(torch.zeros(1, dtype=torch.long, device=x.device))
                continue
            race = torch.empty(V, device=x.device).exponential_(generator=g)
            score = torch.where(probs[b] > 0, probs[b] / race, -1.0)  # 0/0 would be NaN
            picks.append(score.argmax()[None])
        return order.gather(1, torch.cat(picks)[:, None])[:, 0]
