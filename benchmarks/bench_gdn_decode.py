"""GDN decode step (one layer, real geometry, bf16) on CUDA: the torch reference (four GEMVs and
dozens of elementwise kernels) vs the fused path (one GEMV, one Triton kernel, out_proj).

Times are us per call under CUDA-graph replay (`CALLS` calls captured in one graph, so the graph
launch is amortised as in the captured decode step); kernel counts come from torch.profiler on
one eager call. Also: the kernel alone over a (block_v, num_warps) sweep, and its HBM share.

    python benchmarks/bench_gdn_decode.py [--out docs/bench_gdn_decode.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from ftchat.kernels import gdn_decode as gk
from ftchat.model import gdn
from ftchat.model.config import ModelArgs
from ftchat.model.spec import dense_specs
from ftchat.model.synth import _init, preset_config

CALLS = 20  # calls per captured graph
HBM = 4.8e12  # H200 HBM3e bytes/s


def graph_us(fn, reps: int = 20) -> float:
    """Median us per fn() call, CALLS calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile, cuBLAS workspaces
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def kernel_count(fn) -> int:
    """GPU kernels (and memcpy/memset) one eager fn() call launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def layer(a: ModelArgs, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    p = "layers.0.linear_attn."
    specs = {k[len(p):]: s for k, s in dense_specs(a).items() if k.startswith(p)}
    w = {k: _init(s.shape, s.init, gen) for k, s in specs.items()}
    dt = torch.empty(a.linear_num_value_heads).uniform_(1e-3, 0.1, generator=gen)
    w["dt_bias"] = torch.log(torch.expm1(dt))  # decays as a trained model's (tests/gpu)
    return {k: t.to("cuda", dtype) for k, t in w.items()}


def bench(B: int, a: ModelArgs, dtype=torch.bfloat16) -> dict:
    Hk, Hv, dk, dv = gdn._dims(a)
    C = 2 * Hk * dk + Hv * dv
    w_ref = layer(a, dtype)
    w = dict(w_ref)
    gdn.fuse_gdn_projections(w)
    x = torch.randn(B, 1, a.hidden_size, device="cuda", dtype=dtype)
    conv = torch.randn(B, C, a.linear_conv_kernel_dim - 1, device="cuda", dtype=dtype)
    S = torch.randn(B, Hv, dk, dv, device="cuda") * 0.3
    # one step from the same state: the two paths agree (the tests bound it properly)
    states = [(conv.clone(), S.clone()) for _ in range(2)]
    ref = gdn.gdn_mixer_ref(x, w_ref, *states[0], a)
    got = gdn.gdn_decode_fused(x, w, *states[1], a)
    out = {"max_abs_diff": float((got.float() - ref.float()).abs().max()),
           "max_abs_ref": float(ref.float().abs().max())}

    def run_ref():
        gdn.gdn_mixer_ref(x, w_ref, conv, S, a)

    def run_fused():
        gdn.gdn_decode_fused(x, w, conv, S, a)

    proj = F.linear(x[:, 0], w[gdn.FUSED])
    for name, fn in (("torch_ref", run_ref), ("fused", run_fused)):
        out[f"{name}_us"] = graph_us(fn)
        out[f"{name}_kernels"] = kernel_count(fn)
    out["fused_gemv_us"] = graph_us(lambda: F.linear(x[:, 0], w[gdn.FUSED]))
    o = torch.randn(B, Hv * dv, device="cuda", dtype=dtype)
    out["out_proj_gemv_us"] = graph_us(lambda: F.linear(o, w["out_proj.weight"]))
    out["speedup"] = out["torch_ref_us"] / out["fused_us"]
    state_bytes = 2 * S.numel() * 4  # S read once and written once
    sweep = {}
    for bv in (16, 32, 64, 128):
        for warps in (2, 4, 8):
            def step(bv=bv, warps=warps):
                gk.gdn_decode_step(proj, conv, S, w["conv1d.weight"], w["A_log"], w["dt_bias"],
                                   w["norm.weight"], (Hk, Hv, dk, dv), a.rms_norm_eps,
                                   a.output_gate_type, block_v=bv, num_warps=warps)
            us = graph_us(step)
            sweep[f"bv{bv}_w{warps}"] = {"us": us, "programs": B * Hv * dv // bv,
                                         "hbm_fraction": state_bytes / (us * 1e-6) / HBM}
    out["kernel_sweep"] = sweep
    best = min(sweep, key=lambda k: sweep[k]["us"])
    out["kernel_best"] = best
    out["kernel_default"] = f"bv{gk.default_block_v(B, Hv, dv)}_w4"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    a = ModelArgs.from_hf(preset_config("flash-next", 4, eos=248044))
    res = {"device": torch.cuda.get_device_name(), "geometry": dict(
        hidden=a.hidden_size, Hk=a.linear_num_key_heads, Hv=a.linear_num_value_heads,
        dk=a.linear_key_head_dim, dv=a.linear_value_head_dim, Kc=a.linear_conv_kernel_dim),
        "calls_per_graph": CALLS}
    for B in (1, 2):
        try:
            res[f"bs{B}"] = bench(B, a)
        except Exception as e:  # keep the other batch size's figures
            res[f"bs{B}"] = {"error": repr(e)}
        print(f"bs{B}", json.dumps(res[f"bs{B}"]), flush=True)
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
