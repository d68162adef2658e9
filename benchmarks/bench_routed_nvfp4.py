"""Tile / kernel-set sweep of the NVFP4 routed-expert decode kernels on the device (H200), under
CUDA graph replay, to pick `routed_experts.default_tiles` (ftchat/kernels/routed_experts.py); and
the MoE tail (shared expert +
routed) torch path vs the fused one.

    python benchmarks/bench_routed_nvfp4.py --out docs/bench_routed_nvfp4.json [--full]

Method. Flash-Next geometry (D 2560, I 640, K 10, 2,780,160-byte rows). One graph holds LAYERS
calls, each on its own slots (every routed row distinct within a replay: 16 layers x 20 rows
x 2.78 MB = 0.9 GB, far over the 50 MB L2, so each call reads its rows from HBM, as decode
does); the figure per call is the median replay time / LAYERS. bs 2 routes the two tokens to
disjoint experts (the worst case: 20 rows). GB/s counts the distinct rows read (T x K x R);
the HBM fraction is against 4.8 TB/s. Each variant's output is checked against the kernels' torch
mirror (max |diff| / max |ref|, bf16) and against v1's default. Variants that fail to compile or
run are reported with their error and skipped. Sweep: v1 (the baseline kernels) at its default
and two other tiles; v2 over gate_up tiles at a fixed down tile, then over down tiles at the best
gate_up tile; v4 (the default) with --tiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from graph_timing import median_replay  # benchmarks/ (the script's folder)
from ftchat.codecs.rows import RowLayout
from ftchat.kernels import routed_experts as rk
from ftchat.kernels.shared_expert import shared_act_triton
from ftchat.model import layers
from ftchat.model import qwen4_exp as q
from ftchat.offload.experts import routed_experts_decode_ref

HBM = 4.8e12
D, I, K = 2560, 640, 10
V1 = rk.DecodeTiles(16, 512, 4, 64, 128, 2)  # the measured default (34.3 us at bs 1)
V1_OTHER = [rk.DecodeTiles(16, 512, 2, 64, 128, 2), rk.DecodeTiles(8, 512, 2, 32, 128, 2)]
V2_GATE_UP = [(16, 512, 2), (16, 512, 4), (8, 512, 1), (8, 512, 2), (16, 256, 2), (32, 512, 4),
              (8, 256, 1)]  # (h rows per program, reduction elements per step, warps)
V2_DOWN = [(64, 128, 2), (32, 128, 1), (32, 128, 2), (64, 128, 4), (128, 128, 4), (16, 128, 1)]
QUICK_GATE_UP = [(16, 512, 4), (16, 512, 2), (8, 512, 2)]
QUICK_DOWN = [(64, 128, 2), (32, 128, 1), (64, 128, 4)]


def capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def make_bank(layout: RowLayout, slots: int, gen: torch.Generator) -> torch.Tensor:
    """Random codes, block scales in [1, 448) and globals ~1e-3 (finite, realistic magnitudes)."""
    bank = torch.randint(0, 256, (slots + 1, layout.nbytes), dtype=torch.uint8, device="cuda",
                         generator=gen)
    for part in ("gate_up_scale", "down_scale"):
        v = layout.view(bank, part)
        v.copy_((1 + 447 * torch.rand(v.shape, device="cuda", generator=gen)).to(v.dtype))
    for part in ("gate_up_global", "down_global"):
        layout.view(bank, part).fill_(1e-3)
    return bank


@dataclasses.dataclass
class Setup:
    layout: RowLayout
    bank: torch.Tensor
    x: dict  # T -> [T, D] bf16
    slots: dict  # T -> [LAYERS, T, K] int32, all distinct
    weights: dict  # T -> [T, K] bf16
    layers: int


def make_setup(n_layers: int) -> Setup:
    layout = RowLayout("nvfp4", D, I)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = n_layers * 2 * K
    bank = make_bank(layout, n, gen)
    perm = torch.randperm(n, device="cuda", generator=gen).to(torch.int32)
    x, slots, weights = {}, {}, {}
    for T in (1, 2):
        x[T] = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
        slots[T] = perm[: n_layers * T * K].view(n_layers, T, K).contiguous()
        weights[T] = torch.softmax(torch.randn(T, K, device="cuda", generator=gen), -1).bfloat16()
    return Setup(layout, bank, x, slots, weights, n_layers)


def run_variant(s: Setup, tiles: rk.DecodeTiles, T: int, iters: int, want: torch.Tensor | None):
    """us per call, GB/s, HBM fraction, and the first layer's output."""
    outs = []

    def step():
        outs.clear()
        for layer in range(s.layers):
            outs.append(rk.routed_experts_triton(s.x[T], s.bank, s.layout, s.slots[T][layer],
                                                 s.weights[T], tiles))
    t0 = time.perf_counter()
    g = capture(step)
    compile_s = time.perf_counter() - t0
    t = median_replay(g, iters) / s.layers
    nbytes = T * K * s.layout.nbytes
    res = {"us": t * 1e6, "GBps": nbytes / t / 1e9, "hbm_fraction": nbytes / t / HBM,
           "capture_s": compile_s}
    first = outs[0].clone()
    mirror = routed_experts_decode_ref(s.x[T], s.bank, s.layout, s.slots[T][0], s.weights[T])
    scale = float(mirror.float().abs().max())
    res["max_rel_diff_vs_mirror"] = float((first.float() - mirror.float()).abs().max()) / scale
    if want is not None:
        res["max_rel_diff_vs_v1"] = float((first.float() - want.float()).abs().max()) / scale
    return res, first


def name_of(t: rk.DecodeTiles) -> str:
    return (f"{t.variant} gate_up {t.gate_up_rows}x{t.gate_up_k}/{t.gate_up_warps}w "
            f"down {t.down_rows}x{t.down_k}/{t.down_warps}w")


def sweep(s: Setup, iters: int, quick: bool, explicit: list | None = None) -> dict:
    results, ref_out = {}, {}

    def measure(tiles: rk.DecodeTiles) -> float:
        name, per_bs = name_of(tiles), {}
        for T in (1, 2):
            try:
                per_bs[f"bs{T}"], out = run_variant(s, tiles, T, iters, ref_out.get(T))
                ref_out.setdefault(T, out)
            except Exception as e:  # keep sweeping: report the failure
                per_bs[f"bs{T}"] = {"error": repr(e)[:500]}
        per_bs["tiles"] = dataclasses.asdict(tiles)
        results[name] = per_bs
        print(name, json.dumps({k: v for k, v in per_bs.items() if k != "tiles"}), flush=True)
        ok = all("us" in per_bs[f"bs{T}"] for T in (1, 2))
        return per_bs["bs1"]["us"] + per_bs["bs2"]["us"] if ok else float("inf")

    measure(V1)
    if explicit:  # --tiles: exactly these, after the baseline
        for t in explicit:
            measure(t)
        return results
    for t in ([] if quick else V1_OTHER):
        measure(t)
    gu_list, dn_list = (QUICK_GATE_UP, QUICK_DOWN) if quick else (V2_GATE_UP, V2_DOWN)
    dn0 = dn_list[0]
    best_gu = min(gu_list, key=lambda gu: measure(rk.DecodeTiles(*gu, *dn0, variant="v2")))
    for dn in dn_list[1:]:
        measure(rk.DecodeTiles(*best_gu, *dn, variant="v2"))
    return results


def pick(results: dict) -> dict:
    """The fastest variant by bs 1 + bs 2 time (both must run and match the mirror)."""
    def score(r):
        if not all("us" in r.get(f"bs{T}", {}) for T in (1, 2)):
            return float("inf")
        if max(r[f"bs{T}"]["max_rel_diff_vs_mirror"] for T in (1, 2)) > 2**-5:
            return float("inf")
        return r["bs1"]["us"] + r["bs2"]["us"]
    name = min(results, key=lambda n: score(results[n]))
    return {"name": name, "tiles": results[name]["tiles"],
            "bs1_us": results[name]["bs1"]["us"], "bs2_us": results[name]["bs2"]["us"]}


def moe_tail(s: Setup, tiles: rk.DecodeTiles, iters: int) -> dict:
    """us per layer of the MoE block after routing: torch shared expert (3 GEMVs, silu, mul,
    down GEMV, sigmoid GEMV, mul, add) + routed kernels, vs the fused path (one GEMV, the down
    GEMV computing silu(g) * u itself at bs <= 2, routed kernels with the shared expert in their
    combine: "fused_shared"), vs that path with the activation kernel apart (one GEMV, the
    activation kernel, the down GEMV: "fused_shared_act", the previous path; bit-identical,
    "gated_bit_equal" checks it)."""
    from ftchat.kernels import gemv  # moe_tail's own arm
    from ftchat.model.expert_backend import SharedOut

    def parts_act_apart(x, w):
        # the previous shared_expert_parts: silu(g) * u in its own kernel, then the down GEMV
        proj = gemv.linear(x, w[layers.SHARED_FUSED])
        h = shared_act_triton(proj, I)
        return SharedOut(gemv.linear(h, w["shared_expert.down_proj.weight"]),
                         proj[:, 2 * I:2 * I + 1])

    gen = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    ws = []
    for _ in range(s.layers):
        w = {"shared_expert.gate_proj.weight": torch.randn(I, D, device="cuda", generator=gen),
             "shared_expert.up_proj.weight": torch.randn(I, D, device="cuda", generator=gen),
             "shared_expert.down_proj.weight": torch.randn(D, I, device="cuda", generator=gen),
             "shared_expert_gate.weight": torch.randn(1, D, device="cuda", generator=gen)}
        w = {k: (v * v.shape[1] ** -0.5).bfloat16() for k, v in w.items()}
        layers.fuse_moe_projections(w)
        ws.append(w)
    for T in (1, 2):
        x, wt = s.x[T], s.weights[T]

        def torch_path(x=x, wt=wt, T=T):  # this T's tensors
            for layer, w in enumerate(ws):
                routed = rk.routed_experts_triton(x, s.bank, s.layout, s.slots[T][layer], wt, tiles)
                routed + layers.shared_expert_ref(x, w)

        def fused_path(x=x, wt=wt, T=T):  # this T's tensors
            for layer, w in enumerate(ws):
                rk.routed_experts_triton(x, s.bank, s.layout, s.slots[T][layer], wt, tiles,
                                         q.shared_expert_parts(x, w))

        def fused_act_path(x=x, wt=wt, T=T):  # this T's tensors
            for layer, w in enumerate(ws):
                rk.routed_experts_triton(x, s.bank, s.layout, s.slots[T][layer], wt, tiles,
                                         parts_act_apart(x, w))
        for name, fn in (("torch_shared", torch_path), ("fused_shared", fused_path),
                         ("fused_shared_act", fused_act_path)):
            out[f"bs{T}_{name}_us"] = median_replay(capture(fn), iters) / s.layers * 1e6
        out[f"bs{T}_gated_bit_equal"] = all(
            torch.equal(a, b) for a, b in zip(q.shared_expert_parts(x, ws[0]),
                                              parts_act_apart(x, ws[0])))
    return out


def parse_tiles(spec: str | None) -> list | None:
    if not spec:
        return None
    out = []
    for item in spec.split(";"):
        variant, nums = item.split(":")
        out.append(rk.DecodeTiles(*map(int, nums.split(",")), variant=variant.strip()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=16, help="calls per graph (distinct rows)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--full", action="store_true",
                    help="the whole grid (~15 variants, a few minutes); default: 3 gate_up tiles "
                         "(v2) then 3 down tiles, v1 at its default only (< 60 s)")
    ap.add_argument("--tiles", default=None,
                    help="measure only these (after v1's default), ';'-separated "
                         "VARIANT:gu_rows,gu_k,gu_warps,down_rows,down_k,down_warps, "
                         "e.g. 'v2:16,512,4,64,128,2;v4:2,512,1,64,128,4'")
    ap.add_argument("--no-tail", action="store_true", help="skip the MoE-tail comparison")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    s = make_setup(args.layers)
    res = {"device": torch.cuda.get_device_name(), "layers_per_graph": args.layers,
           "row_bytes": s.layout.nbytes,
           "variants": sweep(s, args.iters, not args.full, parse_tiles(args.tiles))}
    res["best"] = pick(res["variants"])
    print("best", json.dumps(res["best"]), flush=True)
    best = rk.DecodeTiles(**res["best"]["tiles"])
    try:
        if not args.no_tail:
            res["moe_tail_v1"] = moe_tail(s, V1, args.iters)
            res["moe_tail_best"] = moe_tail(s, best, args.iters)
    except Exception as e:
        res["moe_tail_error"] = repr(e)[:500]
    print(json.dumps({k: v for k, v in res.items() if k != "variants"}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
