"""Routed-expert prefill on the device (H200): the per-expert torch path
(experts.routed_experts_torch) against the grouped Triton kernels (kernels/moe_prefill.py), one
layer's call at the Flash-Next geometry; optionally a tile sweep to pick `default_tiles`.

    python benchmarks/bench_moe_prefill.py [--tokens 1024,8192] [--sweep] [--out FILE.json]

Method. D 2560, I 640, 512 NVFP4 experts (random codes, block scales in [1, 448), globals ~
1/sqrt(fan-in)) at random slots of a 520-slot bank, K 10 experts per token drawn uniformly
(~T * 10 / 512 pairs an expert), bf16 x and softmax routing weights. ms per call is the median of
CUDA-event timings after warm-up calls (compilation), each call issued by the host as the engine
does (no graph): the torch path's host launches count. TFLOP/s counts 2 * T*K * 3 * I * D;
weight GB/s counts the bytes of the experts the call reaches (rows of 2,780,160 bytes, each read
at least once). max_rel_diff: max|kernel - torch path| / max|torch path| (the test's bound
against the torch path is 2^-5). The default arm also reports device ms per kernel (torch
profiler). --sweep: kernel 1's tiles at the default kernel 2, then kernel 2's at the best kernel
1, then BLOCK_M and the persistent programs per SM, at the largest --tokens; a config that fails
to compile or run is reported with its error. JSON on stdout (and in --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch

from ftchat.kernels import moe_prefill as mp
from ftchat.codecs.rows import RowLayout
from ftchat.offload.experts import routed_experts_torch

D, I, E, K, SLOTS = 2560, 640, 512, 10, 520
GATE_UP = [(64, 128, 4, 3), (64, 256, 4, 3), (64, 128, 4, 4), (64, 128, 8, 3), (32, 128, 4, 3),
           (128, 128, 8, 3), (128, 64, 4, 3)]  # (gate_up_n, gate_up_k, warps, stages)
DOWN = [(128, 128, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 4, 4), (256, 128, 8, 3),
        (128, 128, 8, 3)]  # (down_n, down_k, warps, stages)
BLOCK_M = [64, 128]
PER_SM = [1, 2, 3, 4, 0]


def make_inputs(T: int, gen: torch.Generator) -> dict:
    layout = RowLayout("nvfp4", D, I)
    bank = torch.randint(0, 256, (SLOTS, layout.nbytes), dtype=torch.uint8, device="cuda",
                         generator=gen)
    for part, fan_in in (("gate_up", D), ("down", I)):
        sc = layout.view(bank, part + "_scale")
        sc.copy_((1 + 447 * torch.rand(sc.shape, device="cuda", generator=gen)).to(sc.dtype))
        layout.view(bank, part + "_global").fill_(fan_in ** -0.5 / (2.1 * 224))
    slot_of = torch.randperm(SLOTS, device="cuda", generator=gen)[:E]
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices
    return dict(x=torch.randn(T, D, device="cuda", generator=gen).bfloat16(), bank=bank,
                layout=layout, slots=slot_of[ids].int(), ids=ids,
                weights=torch.softmax(torch.randn(T, K, device="cuda", generator=gen), -1)
                .bfloat16())


def time_ms(fn, warm: int, reps: int) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def figures(inp: dict, ms: float) -> dict:
    T = inp["x"].shape[0]
    used = int(inp["slots"].unique().numel())
    return {"ms": round(ms, 3), "tflops": round(2 * T * K * 3 * I * D / ms / 1e9, 1),
            "weight_GBps": round(used * inp["layout"].nbytes / ms / 1e6, 1), "experts": used}


def kernel_ms_by_name(fn) -> dict:
    # device ms per kernel name over one call (torch profiler), the largest first
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3) for e in prof.key_averages()
            if e.device_time_total > 0]
    return {k: round(v, 3) for k, v in sorted(rows, key=lambda r: -r[1])[:12]}


def run_kernel(inp: dict, tiles: mp.PrefillTiles, want: torch.Tensor, reps: int = 10) -> dict:
    def call():
        return mp.routed_experts_grouped(inp["x"], inp["bank"], inp["layout"], inp["slots"],
                                         inp["ids"], inp["weights"], tiles)
    try:
        ms = time_ms(call, warm=2, reps=reps)
        got = call()
    except Exception as e:  # keep sweeping: report the failure
        return {"error": repr(e)[:400]}
    res = figures(inp, ms)
    res["max_rel_diff"] = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    return res


def sweep(inp: dict, want: torch.Tensor) -> dict:
    results, best = {}, mp.default_tiles()

    def stage(name: str, variants: list) -> None:
        nonlocal best
        scores = {}
        for v in variants:
            tiles = dataclasses.replace(best, **v)
            key = json.dumps(v)
            results[f"{name} {key}"] = r = run_kernel(inp, tiles, want, reps=5)
            print(name, key, json.dumps(r), flush=True)
            if "ms" in r:
                scores[key] = (r["ms"], tiles)
        if scores:
            best = min(scores.values(), key=lambda s: s[0])[1]

    stage("gate_up", [dict(gate_up_n=n, gate_up_k=k, gate_up_warps=w, gate_up_stages=s)
                      for n, k, w, s in GATE_UP])
    stage("down", [dict(down_n=n, down_k=k, down_warps=w, down_stages=s) for n, k, w, s in DOWN])
    stage("block_m", [dict(block_m=m) for m in BLOCK_M])
    stage("per_sm", [dict(per_sm=p) for p in PER_SM])
    return {"results": results, "best": dataclasses.asdict(best),
            "best_result": run_kernel(inp, best, want)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {"geometry": dict(D=D, I=I, E=E, K=K), "default_tiles":
              dataclasses.asdict(mp.default_tiles()), "device": torch.cuda.get_device_name()}
    inp = None
    for T in [int(t) for t in a.tokens.split(",")]:
        inp = make_inputs(T, gen)
        args = [inp[k] for k in ("x", "bank", "layout", "slots", "ids", "weights")]
        want = routed_experts_torch(*args)
        old = figures(inp, time_ms(functools.partial(routed_experts_torch, *args), 1, 3))
        new = run_kernel(inp, mp.default_tiles(), want)
        if "ms" in new:
            new["kernels_ms"] = kernel_ms_by_name(functools.partial(mp.routed_experts_grouped,
                                                                    *args))
        report[f"T{T}"] = {"torch_path": old, "kernel": new,
                           "speedup": round(old["ms"] / new["ms"], 1) if "ms" in new else None}
        print(f"T={T}", json.dumps(report[f"T{T}"]), flush=True)
    if a.sweep:
        report["sweep"] = sweep(inp, routed_experts_torch(
            *[inp[k] for k in ("x", "bank", "layout", "slots", "ids", "weights")]))
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
