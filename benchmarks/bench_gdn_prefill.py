"""GDN prefill (one layer, real geometry: Hv 48, dk = dv 128, B 1) on CUDA: the torch chunked
rule (chunk_states' Python loop, the chunk states, the batched output matmuls) vs the Triton
scan kernel (ftchat/kernels/gdn_prefill.py), both arms in one process, warm-up first.

For T = 1,024 / 4,096 / 8,192 (sub-blocks of gdn.GDN_SUBBLOCK):
  * rule: gdn.delta_rule_chunked alone (fp32 q, k, v, g, beta), ms each, peak bytes above the
    inputs, and the kernel's max |diff| to the torch arm (relative to max |ref|);
  * mixer: gdn.gdn_mixer_ref (projections, conv, the rule, gated norm, out_proj; bf16), ms each;
  * at T = 1,024 (one sub-block): the kernel alone over (precision, block_v, num_warps,
    num_stages).

    python benchmarks/bench_gdn_prefill.py [--out docs/bench_gdn_prefill.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from bench_moe_prefill import time_ms  # CUDA-event median (run from benchmarks/ as a script)

from ftchat.kernels import gdn_prefill as gp
from ftchat.kernels.config import KernelConfig
from ftchat.model import gdn
from ftchat.model.config import ModelArgs
from ftchat.model.spec import dense_specs
from ftchat.model.synth import _init, preset_config

REPS = 10


def ms(fn, reps: int = REPS) -> float:
    """Median ms of fn() after two warm-up calls (compile, cuBLAS workspaces)."""
    return time_ms(fn, 2, reps)


def peak(fn) -> int:
    """Bytes fn() holds at once above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def rule_inputs(T: int, H: int = 48, d: int = 128):
    gen = torch.Generator(device="cuda").manual_seed(T)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q = F.normalize(rnd(1, H, T, d), dim=-1) / d**0.5
    k = F.normalize(rnd(1, H, T, d), dim=-1)
    g = -torch.rand(1, H, T, device="cuda", generator=gen) * 0.3
    beta = torch.rand(1, H, T, device="cuda", generator=gen)
    return q, k, rnd(1, H, T, d), g, beta, rnd(1, H, d, d) * 0.3


def bench_rule(T: int) -> dict:
    q, k, v, g, beta, S0 = rule_inputs(T)
    out, res = {}, {}
    for name, on in (("torch", False), ("kernel", True)):
        kc = KernelConfig(fused=on)
        S = S0.clone()
        res[name] = (gdn.delta_rule_chunked(q, k, v, g, beta, S, kc=kc), S)
        out[f"{name}_ms"] = ms(lambda: gdn.delta_rule_chunked(q, k, v, g, beta, S0.clone(), kc=kc))
        out[f"{name}_peak_mib"] = peak(
            lambda: gdn.delta_rule_chunked(q, k, v, g, beta, S0.clone(), kc=kc)) / 2**20
    (ref, S_ref), (got, S_got) = res["torch"], res["kernel"]
    out["out_rel_diff"] = float((got - ref).abs().max() / ref.abs().max())
    out["S_rel_diff"] = float((S_got - S_ref).abs().max() / S_ref.abs().max())
    out["speedup"] = out["torch_ms"] / out["kernel_ms"]
    return out


def layer(a: ModelArgs, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    p = "layers.0.linear_attn."
    specs = {k[len(p):]: s for k, s in dense_specs(a).items() if k.startswith(p)}
    w = {k: _init(s.shape, s.init, gen) for k, s in specs.items()}
    dt = torch.empty(a.linear_num_value_heads).uniform_(1e-3, 0.1, generator=gen)
    w["dt_bias"] = torch.log(torch.expm1(dt))  # decays as a trained model's (tests/gpu)
    return {k: t.to("cuda", dtype) for k, t in w.items()}


def bench_mixer(a: ModelArgs, w: dict, T: int, dtype=torch.bfloat16) -> dict:
    Hk, Hv, dk, dv = gdn._dims(a)
    x = torch.randn(1, T, a.hidden_size, device="cuda", dtype=dtype)
    conv = torch.randn(1, 2 * Hk * dk + Hv * dv, a.linear_conv_kernel_dim - 1, device="cuda",
                       dtype=dtype)
    S = torch.randn(1, Hv, dk, dv, device="cuda") * 0.3
    out = {}
    for name, on in (("torch", False), ("kernel", True)):
        kc = KernelConfig(fused=on)
        out[f"{name}_ms"] = ms(lambda: gdn.gdn_mixer_ref(x, w, conv.clone(), S.clone(), a, kc=kc))
        out[f"{name}_peak_mib"] = peak(
            lambda: gdn.gdn_mixer_ref(x, w, conv.clone(), S.clone(), a, kc=kc)) / 2**20
    out["speedup"] = out["torch_ms"] / out["kernel_ms"]
    return out


def sweep(T: int = 1024) -> dict:
    """The kernel alone on one sub-block's inputs (the torch part run once)."""
    q, k, _, g, _, S0 = rule_inputs(T)
    C = gdn.CHUNK
    n = T // C
    gamma = g.unflatten(2, (n, C)).cumsum(-1)
    A = torch.randn(1, 48, n, C, C, device="cuda").tril_() * 0.1
    X = torch.randn(1, 48, n, C, 256, device="cuda") * 0.1  # [U | Wk], A: any values (timing)
    res = {}
    for prec, bv, warps, stages in itertools.product(("tf32x3", "ieee"), (16, 32, 64, 128),
                                                     (4, 8), (1, 2)):
        def run(prec=prec, bv=bv, warps=warps, stages=stages):
            gp.chunk_scan(q, k, gamma.flatten(2, 3), A, X, S0.clone(), block_v=bv,
                          num_warps=warps, num_stages=stages, precision=prec)
        key = f"{prec}_bv{bv}_w{warps}_s{stages}"
        if bv < 32 and warps > 4:  # refused by chunk_scan (an illegal address on the H200)
            continue
        try:
            res[key] = ms(run)
        except Exception as e:  # noqa: BLE001 (out of registers / shared memory at a tile)
            res[key] = repr(e)[:200]
    timed = {k: t for k, t in res.items() if isinstance(t, float)}
    res["best"] = min(timed, key=timed.get)
    bv = gp.default_block_v(48, 128)
    res["default"] = f"{gp.PRECISION}_bv{bv}_w{8 if 128 * bv > 4096 else 4}_s1"
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch arm in full fp32, as the model
    a = ModelArgs.from_hf(preset_config("flash-next", 4, eos=248044))
    res = {"device": torch.cuda.get_device_name(), "subblock": gdn.GDN_SUBBLOCK,
           "precision": gp.PRECISION}
    w = layer(a, torch.bfloat16)
    for T in (1024, 4096, 8192):
        for part, fn in (("rule", lambda T=T: bench_rule(T)),
                         ("mixer", lambda T=T: bench_mixer(a, w, T))):
            try:
                res[f"{part}_T{T}"] = fn()
            except Exception as e:  # noqa: BLE001 (keep the other figures)
                res[f"{part}_T{T}"] = {"error": repr(e)[:300]}
            print(f"{part}_T{T}", json.dumps(res[f"{part}_T{T}"]), flush=True)
    res["kernel_sweep_T1024"] = sweep()
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
