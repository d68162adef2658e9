"""How far the FP8 K/V cache moves the logits, on the CPU (docs/model.md 4.6).

For each model and dtype: prompts prefilled, then --steps decode steps; the FP8 arm teacher-forced
on the model-dtype arm's greedy tokens (tests/kv_compare.py), and a free-running FP8 greedy
decode for the token agreement. As a yardstick, the same comparison of a bf16 model against the
fp32 one (both with model-dtype K/V): the rounding a bf16 run has anyway.

    python benchmarks/kv_fp8_cpu.py [--steps 64] [--seeds 3] [--models tiny,demo]
        [--dtypes float32,bfloat16]

tiny: the synthetic `tiny` preset (random weights, one attention layer of six, budget 8: sparse
past 11 tokens), random 24-token prompts. demo: the shipped trained demo model (two attention
layers of eight, budget 128), chat prompts of ~180 tokens (sparse past 131).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kv_compare

from ftchat.engine import load_model  # noqa: E402
from ftchat.model.synth import write_checkpoint  # noqa: E402
from ftchat.model.tokenizer import Tokenizer  # noqa: E402
from ftchat.resolve import SHIPPED_DEMO  # noqa: E402
from tests.kv_compare import decode_arm, kv_difference  # noqa: E402

TEXT = ("Here is a list of things I need to do this week: buy groceries, call the bank about the "
        "card, write the report for Monday, fix the bike, book the train tickets for the trip, "
        "reply to the emails from the school, clean the kitchen, water the plants and read the "
        "two chapters for the book club. Please sort them by urgency, explain why in one short "
        "sentence each, and then write a short Python function that stores such a list with a "
        "priority for every item and returns the items in order. Question number {i}.")


def prompts(name: str, seeds: int) -> list[list[int]]:
    if name == "tiny":
        return [torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(s)).tolist()
                for s in range(seeds)]
    tok = Tokenizer.from_folder(SHIPPED_DEMO)
    return [tok.encode(tok.render_chat([{"role": "user", "content": TEXT.format(i=s)}]))
            for s in range(seeds)]


def folder(name: str, tmp: str) -> Path:
    return SHIPPED_DEMO if name == "demo" else write_checkpoint(Path(tmp) / "t", "tiny",
                                                                 fmt="bf16", seed=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--models", default="tiny,demo")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path, ps = folder(name, tmp), prompts(name, args.seeds)
            print(f"{name}: prompts of {[len(p) for p in ps]} tokens, {args.steps} steps")
            for dt in args.dtypes.split(","):
                m = load_model(path, dtype=getattr(torch, dt))
                for s, p in enumerate(ps):
                    t = time.perf_counter()
                    r = kv_difference(m, p, args.steps)
                    print(f"  {dt} fp8 vs {dt} K/V, prompt {s}: {r.line()} "
                          f"({time.perf_counter() - t:.0f} s)")
            m32, m16 = (load_model(path, dtype=d) for d in (torch.float32, torch.bfloat16))
            for s, p in enumerate(ps):  # the yardstick: bf16 against fp32, forced alike
                toks, ref = decode_arm(m32, p, args.steps, None)
                _, got = decode_arm(m16, p, args.steps, None, forced=toks)
                d = (got - ref).abs()
                print(f"  yardstick bf16 vs fp32 model, prompt {s}: max|d| {float(d.max()):.4g}, "
                      f"mean|d| {float(d.mean()):.4g}, forced argmax agreement "
                      f"{float((got.argmax(-1) == ref.argmax(-1)).float().mean()):.3f}")


if __name__ == "__main__":
    main()
