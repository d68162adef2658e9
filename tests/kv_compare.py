"""The FP8 K/V cache against the model-dtype one on a loaded model (docs/model.md 4.6).

Both arms prefill the same prompt and decode N steps. The reference (K/V in the model dtype)
decodes greedily; the FP8 arm is teacher-forced on the reference's tokens, so every position
compares the logits of the same context (free-running, one flipped token would make every later
comparison one of different contexts). A third, free-running FP8 greedy decode gives the token
agreement. Used by tests/test_kv_fp8.py and benchmarks/kv_fp8_cpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.engine import Decoder, LoadedModel, resident_backend
from ftchat.codecs.fp8 import FP8


@dataclass(frozen=True)
class KvDiff:
    positions: int  # compared logit rows: the prompt's last position and every decode step
    max_abs: float  # max |fp8 - reference| over every logit of every compared row
    mean_abs: float  # mean |fp8 - reference| over the same
    ref_std: float  # the reference logits' standard deviation (their scale)
    argmax_agree: float  # fraction of compared rows whose argmax is the reference's
    greedy_agree: float  # free-running FP8 greedy: fraction of the N tokens equal position-wise
    first_divergence: int | None  # free-running: the first differing token (None: identical)

    def line(self) -> str:
        first = "none" if self.first_divergence is None else str(self.first_divergence)
        return (f"max|d| {self.max_abs:.4g}, mean|d| {self.mean_abs:.4g} (logit std "
                f"{self.ref_std:.3g}; max/std {self.max_abs / self.ref_std:.3g}), forced argmax "
                f"agreement {self.argmax_agree:.3f} of {self.positions}, greedy agreement "
                f"{self.greedy_agree:.3f}, first divergence {first}")


def decode_arm(m: LoadedModel, prompt: list[int], steps: int, kv_dtype: torch.dtype | None,
               forced: list[int] | None = None) -> tuple[list[int], Tensor]:
    """(tokens [steps], logits [steps + 1, V] fp32): the prompt's last logits, then one row per
    decode step; greedy, or the `forced` tokens fed instead."""
    dec = Decoder(m, resident_backend(m), 1, len(prompt) + steps + 1, kv_dtype=kv_dtype)
    rows = [dec.prefill(0, torch.tensor(prompt), 0)[-1].float()]
    tokens, n = [], len(prompt)
    for t in range(steps):
        tok = forced[t] if forced is not None else int(rows[-1].argmax())
        tokens.append(tok)
        rows.append(dec.step(torch.tensor([tok]), [n])[0].float())
        n += 1
    return tokens, torch.stack(rows)


def kv_difference(m: LoadedModel, prompt: list[int], steps: int,
                  ref_kv: torch.dtype | None = None) -> KvDiff:
    """FP8 against `ref_kv` (None: the model dtype) over the prompt and `steps` decode steps."""
    ref_tokens, ref = decode_arm(m, prompt, steps, ref_kv)
    _, got = decode_arm(m, prompt, steps, FP8, forced=ref_tokens)
    free, _ = decode_arm(m, prompt, steps, FP8)
    d = (got - ref).abs()
    same = [a == b for a, b in zip(free, ref_tokens)]
    return KvDiff(ref.shape[0], float(d.max()), float(d.mean()), float(ref.std()),
                  float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                  sum(same) / steps, None if all(same) else same.index(False))
