"""A long prompt end to end at the real depth (issues 17 and 18): prefill, then greedy decode.

The 48-layer flash-next model built in memory (random weights, `bench --synthetic`'s generator:
dense weights on the GPU, NVFP4 expert rows in pinned host memory), run the way `ftchat run`
runs it: the VRAM plan checked before loading under --vram-budget (the process capped at the
budget, the slots the plan gives unless --slots), one Decoder with a captured decode graph,
prefill in chunks with a progress line, then greedy decode. Prints one JSON line: the plan,
prefill seconds and tok/s, decode tok/s, the peaks (allocated, reserved) against the budget.

    python benchmarks/e2e48.py --tokens 261000 --budget 15.9 --chunk 8192 [--slots N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import os
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as ftchat.cli

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=261_000, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="tokens to decode after the prompt")
    p.add_argument("--context", type=int, default=None,
                   help="KV capacity (default: the prompt, the new tokens and a margin)")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--budget", type=float, default=15.9, help="--vram-budget GiB (0: none)")
    p.add_argument("--chunk", type=int, default=8192, help="--prefill-chunk")
    p.add_argument("--slots", type=int, default=None, help="--slots (default: the plan's)")
    p.add_argument("--kv", default="fp8", help="--kv-cache-dtype")
    p.add_argument("--dense", default="nvfp4")
    p.add_argument("--preset", default="flash-next", help="synthetic preset (tiny: a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    from ftchat import engine
    from ftchat.model.synth_memory import synthetic_model
    from ftchat.settings import Settings
    from ftchat.vram.items import GIB, MIB
    from ftchat.vram.workloads import (budget_bytes, peak_report, preflight, run_workload,
                                       synthetic_inputs)

    context = args.context or args.tokens + args.new + 8
    s = Settings(device=args.device, context=context, prefill_chunk=args.chunk, slots=args.slots,
                 kv_cache_dtype=args.kv, vram_budget_gib=args.budget or None, prefetch="on")
    a, layout = synthetic_inputs(args.preset, args.layers, "nvfp4-modelopt", args.dense)
    w = dataclasses.replace(run_workload(a, layout, s), dense_nvfp4=args.dense == "nvfp4")
    plan = preflight(a, layout, s, w)  # refuses what cannot fit; caps the process
    if s.slots is None and s.vram_budget_gib is not None:
        s = dataclasses.replace(s, slots=plan.slots)
    out = {"tokens": args.tokens, "layers": args.layers, "chunk": args.chunk, "kv": args.kv,
           "budget_gib": args.budget, "slots": s.slots, "planned_total_gib":
           round(plan.total / GIB, 3)}
    print(json.dumps({"plan": out}), file=sys.stderr, flush=True)

    mib = (lambda: torch.cuda.memory_allocated() / MIB) if args.device == "cuda" else (
        lambda: 0.0)
    measured = {}  # MiB allocated by each stage (the plan's groups, planned beside them)
    base = mib()
    t = time.perf_counter()
    m = synthetic_model(args.preset, args.layers, "nvfp4-modelopt", args.device, torch.bfloat16,
                        dense=args.dense)
    out["build_s"] = round(time.perf_counter() - t, 1)
    measured["dense weights"] = mib() - base
    at = mib()
    ex = engine.build_experts(m, s)
    measured["slot bank, maps"] = mib() - at
    at = mib()
    dec = engine.Decoder(m, ex, 1, context, prefill_chunk=args.chunk, graph=args.device == "cuda",
                         kv_dtype=s.kv_torch_dtype())
    measured["decode state (KV, QSA keys, GDN, PLE)"] = mib() - at
    steady = mib()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, min(1000, a.vocab_size), (args.tokens,)).tolist()
    marks: dict[str, float] = {}

    def progress(done: int, total: int) -> None:  # called once a chunk's work is finished
        now = time.perf_counter()
        el = now - marks.setdefault("start", now)
        print(f"prefill {done}/{total} {done / max(el, 1e-9):.0f} tok/s {el:.0f} s",
              file=sys.stderr, flush=True)

    # engine.decode, the loop chat runs: the prompt's prefill (in chunks), then a step a token
    steps = engine.decode(dec, [ids], [0], [args.new], on_prefill=progress)
    first = next(steps)  # the prefill (and its logits: the first token), no decode step yet
    pre = first.prefill_s[0]
    if args.device == "cuda":  # staging (own or none when lent) and the prefill's transients
        measured["prefill: staging + transients (peak over steady)"] = (
            torch.cuda.max_memory_allocated() / MIB - steady)
    out.update(prefill_s=round(pre, 1), prefill_tok_s=round(args.tokens / pre, 1),
               prefill_stats=ex.stats())
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    t1 = time.perf_counter()
    next(steps)  # the first decode step captures the graph: timed on its own
    sync()
    t2, n = time.perf_counter(), 0
    for _ in steps:
        n += 1
    sync()
    out.update(first_step_s=round(t2 - t1, 2), decoded=n,
               decode_tok_s=round(n / (time.perf_counter() - t2), 1) if n else None)
    out.update(peak_report(m.device, budget_bytes(s)))
    groups = {"dense weights": {i.name for i in plan.items if i.dense},
              "slot bank, maps": {"expert slot bank", "slot maps", "copy plans (estimate)"},
              "decode state (KV, QSA keys, GDN, PLE)": {
                  "KV cache (K and V)", "QSA index keys", "QSA block keys", "GDN recurrent state",
                  "GDN conv state", "PLE state"},
              "prefill: staging + transients (peak over steady)": {
                  "prefill staging", "activations and workspaces (estimate)"}}
    out["per_item_mib"] = {g: {"planned": round(sum(i.nbytes for i in plan.items if i.name in names)
                                                / MIB, 1),
                               "measured": round(measured[g], 1) if g in measured else None}
                           for g, names in groups.items()}
    out["plan_items_mib"] = {i.name: round(i.nbytes / MIB, 1) for i in plan.items}
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
