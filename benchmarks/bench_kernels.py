"""Kernel figures on the device (H200): copy GB/s by program count vs cudaMemcpyAsync, the NVFP4
decode kernel's share of HBM bandwidth, and the cost of ensure / prefetch_ensure under graph replay.

    python benchmarks/bench_kernels.py --out docs/bench_kernels.json
"""

from __future__ import annotations

import argparse
import json

import torch

from ftchat.codecs.rows import RowLayout
from ftchat.offload import cache as sc
from ftchat.offload.copy import copy_rows
from ftchat.kernels.routed_experts import routed_experts_triton
from ftchat.offload.policy import POLICIES
from ftchat.host_memory import pin


def timed(fn, iters: int = 20) -> float:
    """Median seconds of fn() over iters, CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def bench_copy(layout: RowLayout, n_rows: int = 64) -> dict:
    R = layout.nbytes
    host = torch.randint(0, 255, (n_rows * 4, R), dtype=torch.uint8)
    pin(host)
    bank = torch.zeros(n_rows + 1, R, dtype=torch.uint8, device="cuda")
    src = torch.randperm(n_rows * 4, device="cuda")[:n_rows]
    dst = torch.arange(n_rows, device="cuda", dtype=torch.int32)
    count = torch.tensor([n_rows], device="cuda", dtype=torch.int32)
    nbytes = n_rows * R
    out = {"row_bytes": R, "rows": n_rows}
    src_host = src.cpu()

    def memcpy():
        for i in range(n_rows):
            bank[i].copy_(host[src_host[i]], non_blocking=True)
    out["memcpy_async_GBps"] = nbytes / timed(memcpy) / 1e9
    for programs in (1, 2, 4, 8, 16, 32):
        t = timed(lambda: copy_rows(host, bank, src, dst, count, programs))
        out[f"triton_{programs}_programs_GBps"] = nbytes / t / 1e9
    ok = torch.equal(bank[:n_rows].cpu(), host[src_host])
    out["bytes_ok"] = bool(ok)
    return out


def bench_expert_kernel(layout: RowLayout, slots: int = 256, k: int = 10) -> dict:
    R, D = layout.nbytes, layout.hidden
    bank = torch.randint(0, 255, (slots + 1, R), dtype=torch.uint8, device="cuda")
    # sane scales and globals so the math stays finite
    for part in ("gate_up_scale", "down_scale"):
        layout.view(bank, part).copy_(torch.full(layout.view(bank, part).shape, 0.01,
                                  device="cuda").to(torch.float8_e4m3fn))
    for part in ("gate_up_global", "down_global"):
        layout.view(bank, part).fill_(1.0)
    out = {}
    for T in (1, 2):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        sl = torch.randperm(slots, device="cuda")[: T * k].view(T, k).to(torch.int32)
        w = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)
        g = graph_of(lambda: routed_experts_triton(x, bank, layout, sl, w))
        t = timed(g.replay, 50)
        weight_bytes = T * k * R
        out[f"bs{T}_us"] = t * 1e6
        out[f"bs{T}_weight_GBps"] = weight_bytes / t / 1e9
        out[f"bs{T}_hbm_fraction"] = weight_bytes / t / 4.8e12  # H200 HBM3e ~4.8 TB/s
    return out


def bench_ensure(num_layers: int = 48, E: int = 512, S: int = 1650, k: int = 10) -> dict:
    """us per layer under graph replay: torch ops vs the fused Triton kernels (random routing,
    so most ids miss: the expensive case)."""
    from ftchat.offload import cache_kernels as ck

    out = {}
    for name in ("lru", "rule"):
        for impl, ens, pf in (("triton", ck.ensure_triton, ck.prefetch_ensure_triton),
                              ("torch", sc.ensure, sc.prefetch_ensure)):
            maps = sc.SlotMaps.create(num_layers, E, S, "cuda")
            ids = torch.randint(0, E, (1, k), device="cuda")
            cands = torch.randint(0, E, (16,), device="cuda")
            pol = POLICIES[name]

            def step():
                ids.random_(0, E)
                plan = ens(maps, 3, ids, pol)
                pf(maps, 4, cands, 4, plan.slots)
            g = graph_of(step)
            out[f"{impl}_{name}_ensure_plus_prefetch_us"] = timed(g.replay, 50) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    fp4 = RowLayout("nvfp4", 2560, 640)
    res = {"device": torch.cuda.get_device_name()}
    for name, fn in (("ensure", bench_ensure), ("nvfp4_decode_kernel", lambda: bench_expert_kernel(fp4)),
                     ("copy", lambda: bench_copy(fp4))):
        try:
            res[name] = fn()
        except Exception as e:  # keep the other figures
            res[name] = {"error": repr(e)}
        print(name, json.dumps(res[name]), flush=True)
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
