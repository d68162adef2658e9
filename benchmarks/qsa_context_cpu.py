"""CPU decode-step time of the tiny synthetic model at a short vs a long context (issue 14).

The QSA decode is O(budget) (docs/model.md 4.5), so a step at 64K context should cost
at most ~3x a step at 2K; the dense form re-pooled and attended the whole context (~6-8x).
Prints the whole eager step (engine.decode_step, what Decoder.step runs without a graph) and the
attention mixer alone, both over a zeroed state, one thread; short and long steps alternate so
that load from other processes hits both alike.

    python benchmarks/qsa_context_cpu.py [--short 2048] [--long 65536] [--steps 30]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ftchat.engine import decode_step, load_model, resident_backend
from ftchat.model.qsa import attention_mixer
from ftchat.model.state import DecodeState
from ftchat.model.synth import write_checkpoint


def timings(fns: list[Callable[[], object]], rounds: int) -> list[list[float]]:
    """Sorted seconds of each fn, called in turn `rounds` times after one warm-up round."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(rounds + 1):
        for t, fn in zip(times, fns):
            t0 = time.perf_counter()
            fn()
            if i:
                t.append(time.perf_counter() - t0)
    return [sorted(t) for t in times]


def report(what: str, ctx: tuple[int, int], times: list[list[float]]) -> None:
    """Medians and their ratio; the minima too (the least disturbed runs on a shared machine)."""
    med = [t[len(t) // 2] for t in times]
    low = [t[0] for t in times]
    print(f"{what}: median {ctx[0]} ctx {med[0] * 1e3:.3f} ms, {ctx[1]} ctx {med[1] * 1e3:.3f} ms, "
          f"ratio {med[1] / med[0]:.2f}x (min: {low[0] * 1e3:.3f} / {low[1] * 1e3:.3f} ms, "
          f"{low[1] / low[0]:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", type=int, default=2048)
    p.add_argument("--long", type=int, default=65536)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(Path(tmp) / "tiny", "tiny", fmt="bf16", seed=0)
        m = load_model(folder)
    a, ex = m.args, resident_backend(m)
    ctx = (args.short, args.long)
    state = DecodeState.create(a, 1, args.long + 8, "cpu", torch.float32)
    tok = torch.zeros(1, dtype=torch.long)
    step = [lambda n=n: decode_step(m, state, tok, [n], ex) for n in ctx]
    report("tiny decode step", ctx, timings(step, args.steps))

    layer = next(i for i in range(a.num_hidden_layers) if a.is_attention(i))
    w, cache = m.weights.layers[layer]["self_attn"], state.mixers[layer]
    x = torch.randn(1, 1, a.hidden_size)
    mix = [lambda n=n: attention_mixer(x, w, cache, torch.tensor([[n]]), n + 1, a) for n in ctx]
    report(f"attention mixer (layer {layer})", ctx, timings(mix, 5 * args.steps))


if __name__ == "__main__":
    main()
