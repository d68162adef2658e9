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

from ftchat.engine import Decoder, build_experts, load_model, resident_backend
from ftchat.model.synth import write_checkpoint
from ftchat.settings import Settings

ARMS = {
    "resident": None,
    "off": dict(prefetch="off"),
    "on": dict(prefetch="on"),
    "on_budget4": dict(prefetch="on", budget_gdn=4, budget_attn=4),
    "off_lru": dict(prefetch="off", eviction="lru"),
    "off_no_overlap": dict(prefetch="off", overlap=False),
    "off_eager": dict(prefetch="off", graph=False),
}


def make_arm(m, name: str, slots: int, max_len: int):
    kw = ARMS[name]
    if kw is None:
        ex = resident_backend(m)
        graph = True
    else:
        kw = dict(kw)
        graph = kw.pop("graph", True)
        ex = build_experts(m, Settings(slots=slots, **kw))
    before = torch.cuda.memory_allocated()
    dec = Decoder(m, ex, 1, max_len, graph=graph)
    return {"dec": dec, "ex": ex, "mem": torch.cuda.memory_allocated() - before,
            "times": [], "misses": 0, "installs": 0, "useful": 0, "tokens": 0}


def counters(ex) -> tuple[int, int, int]:
    if not hasattr(ex, "maps"):
        return 0, 0, 0
    st = ex.maps.stats
    return int(st.misses.sum()), int(st.prefetch_installs.sum()), int(st.prefetch_useful.sum())


def run_round(arm, token: torch.Tensor, length: int, steps: int) -> tuple[torch.Tensor, int]:
    before = counters(arm["ex"])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        logits = arm["dec"].step(token, [length])
        token = logits.argmax(-1)
        length += 1
    torch.cuda.synchronize()
    arm["times"].append(time.perf_counter() - t)
    after = counters(arm["ex"])
    arm["misses"] += after[0] - before[0]
    arm["installs"] += after[1] - before[1]
    arm["useful"] += after[2] - before[2]
    arm["tokens"] += steps
    return token, length


def bench_context(m, arms: list[str], ctx: int, slots: int, steps: int, rounds: int) -> dict:
    max_len = ctx + (rounds + 1) * steps + 2
    built = {name: make_arm(m, name, slots, max_len) for name in arms}
    state = {name: (torch.tensor([7], device="cuda"), ctx) for name in arms}
    for name in arms:  # warm-up round (fills the caches), not timed
        state[name] = run_round(built[name], *state[name], steps)
        built[name].update(times=[], misses=0, installs=0, useful=0, tokens=0)
    for _ in range(rounds):  # ABAB: every round runs every arm once
        for name in arms:
            state[name] = run_round(built[name], *state[name], steps)
    L = m.args.num_hidden_layers
    out = {}
    for name, a in built.items():
        tps = a["tokens"] / sum(a["times"])
        out[name] = {"tok_s": tps, "round_tok_s": [steps / t for t in a["times"]],
                     "misses_per_token": a["misses"] / a["tokens"],
                     "prefetch_installs_per_token": a["installs"] / a["tokens"],
                     "useful_per_layer": a["useful"] / a["tokens"] / L,
                     "precision": a["useful"] / a["installs"] if a["installs"] else None,
                     "extra_vram_mib": a["mem"] / 2**20}
    base = out.get("off", {}).get("tok_s")
    for v in out.values():
        v["vs_off"] = v["tok_s"] / base if base else None
    del built
    torch.cuda.empty_cache()
    return out


def bench_prefill(m, slots: int, lengths: list[int]) -> dict:
    ex = build_experts(m, Settings(slots=slots))
    out = {}
    for n in lengths:
        dec = Decoder(m, ex, 1, n + 2)
        ids = torch.randint(0, 1000, (n,))
        dec.prefill(0, ids[:256], 0)  # warm-up
        dec.reset()
        torch.cuda.synchronize()
        t = time.perf_counter()
        dec.prefill(0, ids, 0)
        torch.cuda.synchronize()
        out[n] = n / (time.perf_counter() - t)
        del dec
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/ftchat-bench/flash-next")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--slots-frac", type=float, default=0.067)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
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
    res = {"device": torch.cuda.get_device_name(), "layers": a.num_hidden_layers,
           "slots": slots, "row_bytes": m.layout.nbytes, "synth_s": synth_s, "contexts": {}}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        res["contexts"][ctx] = bench_context(m, args.arms.split(","), ctx, slots, args.steps,
                                             args.rounds)
        print(json.dumps({ctx: res["contexts"][ctx]}, indent=1), flush=True)
    if args.prefill:
        res["prefill_tok_s"] = bench_prefill(m, slots, [int(n) for n in args.prefill.split(",")])
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
