"""Decode and prefill throughput of a flash-next-geometry synthetic model on the device.

Arms run side by side in one process, interleaved ABAB (every round runs every arm once), on the
same weights: all experts resident, offload with prefetch off / on (default budget) / on (budget
4), lru vs rule, overlap off, eager. Each arm has its own decode state; decoding starts at a fixed
context length with a zero KV cache (no prefill), so the figures are the step cost at that
context, not model quality. A random-weight model routes almost uniformly: its misses and
prefetch precision are not the real model's.

    python benchmarks/bench_decode.py --layers 8 --contexts 4096,32768 --out docs/bench_decode.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ftchat.commands.bench import bench_context, bench_prefill, parse_arms
from ftchat.engine import load_model
from ftchat.model.synth import write_checkpoint
from ftchat.settings import Settings

ARMS = ["resident", "off", "on", "on:budget=4", "off:eviction=lru", "off:overlap=0",
        "off:graph=0"]

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/ftchat-bench/flash-next")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--slots-frac", type=float, default=0.067)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default=";".join(ARMS))
    ap.add_argument("--prefill", default="4096,32768")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    folder = Path(args.model)
    t = time.time()
    if not folder.exists():
        write_checkpoint(folder, "flash-next", layers=args.layers, fmt="nvfp4-modelopt", seed=0)
    synth_s = time.time() - t
    m = load_model(folder, device="cuda", dtype=torch.bfloat16)
    a = m.args
    slots = int(args.slots_frac * a.num_hidden_layers * a.num_experts)
    base = Settings(slots=slots, device="cuda")
    res = {"device": torch.cuda.get_device_name(), "layers": a.num_hidden_layers,
           "slots": slots, "row_bytes": m.layout.nbytes, "synth_s": synth_s, "contexts": {}}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        res["contexts"][ctx] = bench_context(m, parse_arms(args.arms, base), ctx, base, args.steps,
                                             args.rounds)
        print(json.dumps({ctx: res["contexts"][ctx]}, indent=1), flush=True)
    if args.prefill:
        res["prefill_tok_s"] = bench_prefill(m, base, [int(n) for n in args.prefill.split(",")])
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
