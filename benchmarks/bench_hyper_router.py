"""Hyper-connection and router decode cost on the device (H200): the torch references vs the fused
Triton kernels, per call under CUDA-graph replay at the real geometry (D=2560, hc=4, L=320,
E=512, K=10, bf16), and kernels per call (torch.profiler, one eager call).

    python benchmarks/bench_hyper_router.py --out docs/bench_hyper_router.json [--sweep]
    python benchmarks/bench_hyper_router.py --ops route,topk --bs 1,2,8   # the top-k arms only

Each graph holds REPS calls in a row, cycling through distinct weight sets (more bytes than L2),
so the figure is a call's steady-state cost inside a long graph, weights from HBM as in decode.
Ops: hc_read; hc_write_read (the write folded into the next read); hc_write alone; route (the
router GEMV + top-k); topk (the top-k kernel alone, on given logits); and "layer" = what one
decoder layer spends on these: 2 x hc_write_read + route.
route and topk also time the previous top-k kernel (`router_topk_triton_v0`, three warp
reductions per pick) in the same process: "v0_us" against "fused_us" (the keyed kernel),
"v0_over_fused" their ratio and "v0_bit_equal" whether the two gave the same ids and weights.
moe_route: the MoE block's fused GEMV [gate | up | gate logit | router] ([2I + 1 + E, D], I =
640) and its top-k: torch (F.linear, softmax, topk) vs the decode path (the Triton GEMV, then
the keyed kernel, "fused") and the GEMV then the previous kernel ("v0").
--sweep also times a few tile choices of the split read (ftchat/kernels/hyper.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from graph_timing import graph_us  # benchmarks/ (the script's folder)
from ftchat.kernels import gemv, hyper, router
from ftchat.model import qwen4_exp as q

D, HC, L, E, K = 2560, 4, 320, 512, 10
INTER = 640  # the shared expert's: the fused MoE GEMV has 2 * INTER + 1 + E rows
C = HC * D
REPS = 24  # calls per graph
SETS = 8  # distinct weight sets: 8 x 13 MB of HC weights (H200 L2: 50 MB)
DEV = "cuda"
ARGS = SimpleNamespace(hidden_size=D, hc_count=HC, rms_norm_eps=1e-6, num_experts_per_tok=K,
                       norm_topk_prob=True)


def _hc_weights() -> dict:
    def rnd(*shape, scale):
        return (torch.randn(*shape, device=DEV) * scale).bfloat16()
    return {"hc_norm.weight": rnd(C, scale=0.1),
            "input_mix_weight_down.weight": rnd(L, C, scale=C ** -0.5),
            "input_mix_weight_up.weight": rnd(C, L, scale=L ** -0.5),
            "block_inject_weight.weight": rnd(HC, C, scale=C ** -0.5),
            "moe_fused": rnd(2 * INTER + 1 + E, D, scale=D ** -0.5)}  # moe_route's GEMV


def _inputs(bs: int) -> dict:
    return {"R": torch.randn(bs, 1, C, device=DEV).bfloat16(),
            "y": torch.randn(bs, 1, D, device=DEV).bfloat16(),
            "s": (2 * torch.rand(bs, 1, HC, device=DEV)).bfloat16(),
            "x": torch.randn(bs, D, device=DEV).bfloat16(),
            "logits": torch.randn(bs, E, device=DEV).bfloat16()}


# one call of each op, torch and fused; w: an HC weight set, g: a router weight
def _ops(tiles=None):
    return {
        "hc_read": (lambda t, w, g: q.hc_read_ref(t["R"], w, ARGS),
                    lambda t, w, g: hyper.hc_mix_triton(t["R"], w, HC, 1e-6, tiles=tiles)),
        "hc_write_read": (
            lambda t, w, g: q.hc_read_ref(q.hc_write_ref(t["R"], t["y"], t["s"]), w, ARGS),
            lambda t, w, g: hyper.hc_mix_triton(t["R"], w, HC, 1e-6, t["y"], t["s"],
                                                tiles=tiles)),
        "hc_write": (lambda t, w, g: q.hc_write_ref(t["R"], t["y"], t["s"]),
                     lambda t, w, g: hyper.hc_write_triton(t["R"], t["y"], t["s"])),
        "route": (lambda t, w, g: q.route_ref(t["x"], g, ARGS),
                  lambda t, w, g: router.router_topk_triton(F.linear(t["x"], g), K, True)),
        "topk": (lambda t, w, g: _topk_torch(t["logits"]),
                 lambda t, w, g: router.router_topk_triton(t["logits"], K, True)),
        "moe_route": (lambda t, w, g: _topk_torch(F.linear(t["x"], w["moe_fused"])[:, -E:]),
                      lambda t, w, g: router.router_topk_triton(
                          gemv.linear(t["x"], w["moe_fused"])[:, -E:], K, True)),
        "layer": (lambda t, w, g: _layer(t, w, g, fused=False),
                  lambda t, w, g: _layer(t, w, g, fused=True, tiles=tiles)),
    }


# more arms of the ops that route, by label: the previous top-k kernel
ARMS = {
    "route": {"v0": lambda t, w, g: router.router_topk_triton_v0(F.linear(t["x"], g), K, True)},
    "topk": {"v0": lambda t, w, g: router.router_topk_triton_v0(t["logits"], K, True)},
    "moe_route": {"v0": lambda t, w, g: router.router_topk_triton_v0(
        gemv.linear(t["x"], w["moe_fused"])[:, -E:], K, True)},
}


def _topk_torch(logits):
    # route_ref after its GEMV: softmax in fp32, top-k, renormalise, cast
    top, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), K, dim=-1)
    return ids, (top / top.sum(-1, keepdim=True)).to(logits.dtype)


def _layer(t, w, g, fused: bool, tiles=None):
    # the HC and router work of one decoder layer (the mixer and experts left out)
    if fused:
        R, x, s = hyper.hc_mix_triton(t["R"], w, HC, 1e-6, t["y"], t["s"], tiles=tiles)
        R, x, s = hyper.hc_mix_triton(R, w, HC, 1e-6, x, s, tiles=tiles)
        return router.router_topk_triton(F.linear(x.flatten(0, 1), g), K, True)
    R = q.hc_write_ref(t["R"], t["y"], t["s"])
    x, s = q.hc_read_ref(R, w, ARGS)
    R = q.hc_write_ref(R, x, s)
    x, s = q.hc_read_ref(R, w, ARGS)
    return q.route_ref(x.flatten(0, 1), g, ARGS)


def timed_graph(fn, t, ws, gs, iters: int = 30) -> float:
    """us per call: a graph of REPS calls, weight sets cycled (graph_timing.graph_us)."""
    def body():
        for i in range(REPS):
            fn(t, ws[i % len(ws)], gs[i % len(gs)])
    return graph_us(body, REPS, iters)


def kernels_of(fn, t, w, g) -> tuple[int, list[str]]:
    """GPU kernels (and memcpy/memset) one eager call launches, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn(t, w, g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(t, w, g)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(names), sorted(set(names))


def _max_diff(a, b) -> float:
    # the largest elementwise difference over the outputs (ids: count of differing entries)
    out = 0.0
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        if x is None or y is None:
            continue
        if x.dtype == torch.int64:
            out = max(out, float((x != y).sum()))
        else:
            out = max(out, float((x.float() - y.float()).abs().max()))
    return out


def bench(bs_list, sweep: bool, ops: list[str] | None = None) -> dict:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    ws = [_hc_weights() for _ in range(SETS)]
    gs = [(torch.randn(E, D, device=DEV) * D ** -0.5).bfloat16() for _ in range(REPS)]
    res = {}
    for bs in bs_list:
        t = _inputs(bs)
        row = {}
        for name, (ref, fused) in _ops().items():
            if ops and name not in ops:
                continue
            n_ref, k_ref = kernels_of(ref, t, ws[0], gs[0])
            n_fus, k_fus = kernels_of(fused, t, ws[0], gs[0])
            r_us, f_us = timed_graph(ref, t, ws, gs), timed_graph(fused, t, ws, gs)
            fo, ro = fused(t, ws[0], gs[0]), ref(t, ws[0], gs[0])
            if name in ("hc_read", "hc_write_read"):
                fo = fo[1:] if name == "hc_read" else (fo[0], fo[1], fo[2])
                ro = ro if name == "hc_read" else (q.hc_write_ref(t["R"], t["y"], t["s"]), *ro)
            row[name] = {"torch_us": round(r_us, 2), "fused_us": round(f_us, 2),
                         "speedup": round(r_us / f_us, 2), "torch_kernels": n_ref,
                         "fused_kernels": n_fus, "max_abs_diff": _max_diff(fo, ro),
                         "fused_kernel_names": k_fus, "torch_kernel_names": k_ref}
            for label, arm in ARMS.get(name, {}).items():  # same graphs and weights
                a_us = timed_graph(arm, t, ws, gs)
                ao = arm(t, ws[0], gs[0])
                row[name].update({f"{label}_us": round(a_us, 2),
                                  f"{label}_over_fused": round(a_us / f_us, 2),
                                  f"{label}_kernel_names": kernels_of(arm, t, ws[0], gs[0])[1]})
                row[name][f"{label}_bit_equal"] = all(torch.equal(a, b) for a, b in zip(ao, fo))
            print(bs, name, {k: v for k, v in row[name].items() if "names" not in k}, flush=True)
        if sweep:
            row["sweep_hc_write_read_us"], row["best_tiles"] = _sweep(t, ws, gs, bs)
        res[f"bs{bs}"] = row
    return res


def _sweep(t, ws, gs, bs: int) -> tuple[dict, str]:
    # two phases (the kernels are independent): kernel 1's tiles with kernel 2's default, then
    # kernel 2's with the best kernel 1; a step at or above D (L) means one masked pass
    base = hyper.default_tiles(bs)
    times = {}

    def timed(tiles) -> float:
        times[repr(tiles)] = round(timed_graph(_ops(tiles)["hc_write_read"][1], t, ws, gs), 2)
        print(bs, tiles, times[repr(tiles)], flush=True)
        return times[repr(tiles)]

    downs = [(base.down_rows, base.down_k, base.down_warps), (8, 512, 4), (32, 512, 8),
             (16, 256, 4), (32, 256, 4), (16, 1024, 8), (8, 1024, 4), (64, 256, 8)]
    d_best = min(downs, key=lambda d: timed(dataclasses.replace(
        base, down_rows=d[0], down_k=d[1], down_warps=d[2])))
    mid = dataclasses.replace(base, down_rows=d_best[0], down_k=d_best[1], down_warps=d_best[2])
    ups = [(base.up_cols, base.up_k, base.up_warps), (8, 512, 8), (2, 512, 2), (2, 512, 4),
           (4, 64, 4), (8, 128, 4), (16, 512, 8)]
    u_best = min(ups, key=lambda u: timed(dataclasses.replace(
        mid, up_cols=u[0], up_k=u[1], up_warps=u[2])))
    best = dataclasses.replace(mid, up_cols=u_best[0], up_k=u_best[1], up_warps=u_best[2])
    timed(dataclasses.replace(best, fp_fusion=True))
    return times, repr(best)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--bs", default="1,2,4,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ops", default=None, help="only these ops, ','-separated (e.g. route,topk)")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "geometry": dict(D=D, hc=HC, L=L, E=E, K=K),
           "dtype": "bf16", "reps_per_graph": REPS, "weight_sets": SETS,
           "results": bench([int(b) for b in args.bs.split(",")], args.sweep,
                            args.ops.split(",") if args.ops else None)}
    print(json.dumps({k: v for k, v in res.items() if k != "results"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
