"""The decode step's heaviest kernels, each launched a few times eagerly at the flash-next shapes,
for Nsight Compute (one process, no CUDA graph: ncu profiles kernel launches):

    ncu --clock-control none -k regex:'_nvfp4_gemv|_gate_up|_down_combine|_down_split|_up_split|
        _topk_softmax|_gemv_kernel' --section SpeedOfLight ... python benchmarks/ncu_decode.py

What it launches (bs 1 by default): the GDN input projection [16384 + 96, 2560] in NVFP4 with its
bf16 tail (`nvfp4_gemv`), the routed experts of one token (10 NVFP4 rows: gate_up, then down and
the combine), one hyper-connection write + read (kernels 1 and 2), the router's top-k and a
[2560, 6144] bf16 GEMV (the GDN out_proj). Random weights at realistic magnitudes.
"""

from __future__ import annotations

import argparse

import torch

from bench_routed_nvfp4 import make_setup  # benchmarks/ (the script's folder)
from ftchat.codecs import nvfp4
from ftchat.kernels import gemv, hyper, nvfp4_gemv, router
from ftchat.kernels.routed_experts import routed_experts_triton

D, HC, L = 2560, 4, 320
C = HC * D


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    dev, T = "cuda", a.bs
    torch.manual_seed(0)
    K = D
    packed, scale, g = nvfp4.quantize(torch.randn(16384, K, device=dev) * K ** -0.5)
    tail = (torch.randn(96, K, device=dev) * K ** -0.5).bfloat16()
    x = torch.randn(T, K, device=dev).bfloat16()
    s = make_setup(1)
    w_hc = {"hc_norm.weight": (torch.randn(C, device=dev) * 0.1).bfloat16(),
            "input_mix_weight_down.weight": (torch.randn(L, C, device=dev) * C ** -0.5).bfloat16(),
            "input_mix_weight_up.weight": (torch.randn(C, L, device=dev) * L ** -0.5).bfloat16(),
            "block_inject_weight.weight": (torch.randn(HC, C, device=dev) * C ** -0.5).bfloat16()}
    R = torch.randn(T, 1, C, device=dev).bfloat16()
    y = torch.randn(T, 1, D, device=dev).bfloat16()
    sc = (2 * torch.rand(T, 1, HC, device=dev)).bfloat16()
    logits = torch.randn(T, 512, device=dev).bfloat16()
    w_out = (torch.randn(D, 6144, device=dev) * 6144 ** -0.5).bfloat16()
    h = torch.randn(T, 6144, device=dev).bfloat16()
    for _ in range(a.reps + 1):  # the first round compiles
        nvfp4_gemv.nvfp4_linear_triton(x, packed, scale, g.reshape(1), tail)
        routed_experts_triton(s.x[T], s.bank, s.layout, s.slots[T][0], s.weights[T])
        hyper.hc_mix_triton(R, w_hc, HC, 1e-6, y, sc)
        router.router_topk_triton(logits, 10, True)
        gemv.linear_triton(h, w_out)
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
