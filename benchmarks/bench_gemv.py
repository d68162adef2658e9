"""Decode GEMV cost on the device (H200): F.linear (cuBLAS) vs the Triton kernel `linear_triton`
(ftchat/kernels/gemv.py), per call under CUDA-graph replay, bf16, at the decode shapes; and the
NVFP4 arm (ftchat/kernels/nvfp4_gemv.py) at the GDN input projection.

    python benchmarks/bench_gemv.py --out docs/bench_gemv.json [--sweep] [--bs 1,2]
        [--arms dense,nvfp4]

Each graph holds REPS calls in a row, cycling through distinct weight sets (at least ~200 MB of
them, or REPS sets: more bytes than the 50 MB L2), so the figure is a call's steady-state cost
inside a long graph with the weights from HBM, as in decode. GB/s counts the weight, x and output
bytes of one call. max_abs_diff is against F.linear (cuBLAS with fp32 reductions: TF32 and the
bf16 reduced-precision reduction off). --sweep also times a handful of tile choices per shape
(default_tiles and its neighbours) and reports the best.
One line per (shape, bs); --out writes everything as JSON. --tiles times given tiles on every
shape (e.g. --tiles 4x512s4w1,8x1024s3w4).
NVFP4 arm ("nvfp4" in the JSON): [x @ W4^T | x @ tail^T] with W4 [16384, 2560] NVFP4 (qkv 10240
and z 6144 rows, quantized by nvfp4.quantize with a global each) and a bf16 tail [96, 2560] (b,
a), at each bs, next to cuBLAS and linear_triton on the bf16 [16480, 2560] weight (the same
weights dequantized), all cycled beyond L2 as above. GB/s counts the bytes a call moves: for
NVFP4 codes, block scales, globals, tail, x and output (~24 MB against the bf16 84 MB).
max_abs_diff is against nvfp4_linear_ref (fp32 math on the exact weights, rounded once).
--nvfp4-tiles times given tiles (BNxBKsSPLITwWARPS, then optionally tT for the tail rows, then
flags: "tc" the tensor-core tiles, "rows" the row loop (Nvfp4Tiles.tc / .rowloop), e.g.
8x512s5w1t4, 64x256s10w4tc, 8x512s1w1t4rows; `repr` of the tiles is what the JSON records).

Measured (H200, 2026-12-01, bs 1 / 2, us per call, F.linear -> linear_triton default tiles):
2560x6144 12.1 -> 10.5 / 12.9 -> 11.8; 1281x2560 5.5 -> 5.0 / 12.8 -> 5.8; 2560x640 4.2 -> 3.3 /
4.2 -> 3.6; 512x2560 6.5 -> 4.1 / 6.5 -> 4.9; 2560x2560 7.1 -> 6.3 / 7.1 -> 7.6; but 16480x2560
23.4 -> 24.5 / 23.3 -> 28.5 and 12800x2560 19.1 -> 20.6 / 19.3 -> 23.8 (cuBLAS already streams
those at ~3.5 TB/s). At bs 8 the kernel is slower than cuBLAS at the large shapes (each row
costs a dot product per weight held in registers). The tile sweep that chose the defaults:
one-warp programs of [4, 512] beat 4-warp [8, 1024] / [16, 512] tiles (cross-warp reductions),
prefetching the next chunk in registers and a [rows, BLOCK_N] accumulator did not help.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

import torch
import torch.nn.functional as F

from graph_timing import graph_us  # benchmarks/ (the script's folder)
from ftchat.kernels import gemv, nvfp4_gemv
from ftchat.codecs import nvfp4

SHAPES = [(2560, 6144), (1281, 2560), (2560, 640), (512, 2560), (16480, 2560), (12800, 2560),
          (2560, 2560)]  # N (outputs), K (reduction)
REPS = 48  # calls per graph
SET_BYTES = 200e6  # weight bytes to cycle through per shape (H200 L2: 50 MB)
DTYPE = torch.bfloat16
DEV = "cuda"
NVFP4_SHAPE = (16384, 96, 2560)  # N4 (NVFP4 rows), Nt (bf16 tail rows), K: GDN in_proj at decode
NVFP4_GROUPS = (10240, 6144)  # qkv, z: the rows sharing one global


def timed_graph(fn, xs, ws, iters: int = 30) -> float:
    """us per call: a graph of REPS calls, weight sets cycled (graph_timing.graph_us)."""
    def body():
        for i in range(REPS):
            fn(xs[i % len(xs)], ws[i % len(ws)])
    return graph_us(body, REPS, iters)


def _gbs(N: int, K: int, bs: int, us: float) -> float:
    elt = torch.finfo(DTYPE).bits // 8
    return (N * K + bs * K + bs * N) * elt / (us * 1e-6) / 1e9


def _max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _triton(tiles):
    return lambda x, w: gemv.linear_triton(x, w, tiles)


def _candidates(N: int, K: int, bs: int) -> list[gemv.GemvTiles]:
    # default_tiles and its neighbours (warps, BLOCK_N x2 / /2, no split / full split, BLOCK_K
    # /2 or x2 at the same tile size), and two wider-CTA designs that lost the first sweep
    base = gemv.default_tiles(N, K, bs)
    nk = -(-K // base.block_k)
    rep = dataclasses.replace
    cands = [base, rep(base, warps=2), rep(base, block_n=base.block_n * 2),
             rep(base, block_n=max(2, base.block_n // 2)), rep(base, split=1),
             rep(base, split=nk),
             rep(base, block_k=max(256, base.block_k // 2), block_n=base.block_n * 2,
                 split=2 * base.split),
             rep(base, block_k=min(2048, base.block_k * 2), block_n=max(2, base.block_n // 2),
                 split=max(1, base.split // 2)),
             gemv.GemvTiles(8, 1024, 3, 4), gemv.GemvTiles(16, 256, 4, 4)]
    seen, out = set(), []
    for t in cands:
        key = _effective(t, K)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _effective(t: gemv.GemvTiles, K: int) -> tuple:
    # the launch linear_triton makes of tiles t: (BLOCK_N, BLOCK_K, SPLIT, warps)
    return (t.block_n, *gemv.launch_plan(K, t), t.warps)


def parse_tiles(spec: str) -> gemv.GemvTiles:
    """'BNxBKsSPLITwWARPS', e.g. '8x1024s3w4' -> GemvTiles(8, 1024, 3, 4)."""
    m = re.fullmatch(r"(\d+)x(\d+)s(\d+)w(\d+)", spec)
    assert m, f"tiles like 8x1024s3w4, not {spec!r}"
    return gemv.GemvTiles(*(int(g) for g in m.groups()))


NVFP4_FLAGS = {"tc": ("tc", True), "rows": ("rowloop", True)}


def parse_nvfp4_tiles(spec: str) -> nvfp4_gemv.Nvfp4Tiles:
    """'BNxBKsSPLITwWARPS[tTAIL][flags]', flags tc or rows (see the module docstring), e.g.
    '8x512s5w1', '64x256s10w4tc', '8x512s1w1rows' (no flag: the tiled form)."""
    names = "|".join(NVFP4_FLAGS)
    m = re.fullmatch(r"(\d+)x(\d+)s(\d+)w(\d+)(?:t(\d+))?((?:" + names + ")*)", spec)
    assert m, f"tiles like 8x512s5w1t4 (then flags of {sorted(NVFP4_FLAGS)}), not {spec!r}"
    bn, bk, split, warps = (int(g) for g in m.groups()[:4])
    flags = [NVFP4_FLAGS[f] for f in re.findall(names, m.group(6))]
    assert len({k for k, _ in flags}) == len(flags), f"a flag named twice in {spec!r}"
    return nvfp4_gemv.Nvfp4Tiles(bn, bk, split, warps, tail_n=int(m.group(5) or 4), **dict(flags))


def nvfp4_spec(t: nvfp4_gemv.Nvfp4Tiles) -> str:
    """The --nvfp4-tiles spec of tiles t (parse_nvfp4_tiles' inverse), e.g. '8x512s1w1t4rows'."""
    flags = [f for f, (k, v) in NVFP4_FLAGS.items() if getattr(t, k) == v]
    return f"{t.block_n}x{t.block_k}s{t.split}w{t.warps}t{t.tail_n}" + "".join(flags)


def _nvfp4_bytes(N4: int, Nt: int, K: int, bs: int) -> int:
    # one call's bytes: codes, e4m3 block scales, fp32 globals, bf16 tail, bf16 x and output
    return N4 * K // 2 + N4 * K // nvfp4.GROUP + 4 * N4 + 2 * (Nt * K + bs * K + bs * (N4 + Nt))


def _nvfp4_set(N4: int, Nt: int, K: int) -> tuple:
    # (packed, scale, g [N4], tail) on the device: random normals quantized per row group
    qs = [nvfp4.quantize(torch.randn(rows, K, device=DEV) * K ** -0.5) for rows in NVFP4_GROUPS]
    assert sum(NVFP4_GROUPS) == N4
    g = torch.cat([gl.expand(p.shape[0]) for p, _, gl in qs]).contiguous()
    tail = (torch.randn(Nt, K, device=DEV) * K ** -0.5).to(DTYPE)
    return torch.cat([p for p, _, _ in qs]), torch.cat([s for _, s, _ in qs]), g, tail


def _nvfp4_fn(tiles):
    return lambda x, s: nvfp4_gemv.nvfp4_linear_triton(x, *s, tiles=tiles)


def _nvfp4_launch(t: nvfp4_gemv.Nvfp4Tiles, K: int) -> tuple:
    # the launch nvfp4_linear_triton makes: (BLOCK_N, BLOCK_K, SPLIT, chunks a program, warps,
    # BLOCK_T, tensor cores, row loop)
    return (t.block_n, *nvfp4_gemv.launch_plan(K, t), t.warps, t.tail_n, t.tc, t.rowloop)


def bench_nvfp4(bs_list, extra=()) -> dict:
    """The NVFP4 arm: cuBLAS and linear_triton on the bf16 [N4 + Nt, K] weight, then
    nvfp4_linear_triton (default tiles; the extra tiles) on the NVFP4 + tail weights, per bs."""
    N4, Nt, K = NVFP4_SHAPE
    N = N4 + Nt
    sets = max(2, min(REPS, math.ceil(SET_BYTES / _nvfp4_bytes(N4, Nt, K, 0))))
    nv = [_nvfp4_set(N4, Nt, K) for _ in range(sets)]
    dense_sets = max(2, min(REPS, math.ceil(SET_BYTES / (N * K * 2))))
    dense = [torch.cat([nvfp4.dequantize(p, s, g).to(DTYPE), tail]) for p, s, g, tail
             in nv[:dense_sets]]  # [N, K] bf16, the same weights (rounded to bf16); fewer sets
    res = {}
    for bs in bs_list:
        xs = [torch.randn(bs, K, device=DEV).to(DTYPE) for _ in range(4)]
        tiles = nvfp4_gemv.default_tiles(N4, Nt, K, bs)
        ref = nvfp4_gemv.nvfp4_linear_ref(xs[0], *nv[0])
        got = nvfp4_gemv.nvfp4_linear_triton(xs[0], *nv[0])
        again = nvfp4_gemv.nvfp4_linear_triton(xs[0], *nv[0])
        t_us = timed_graph(F.linear, xs, dense)
        g_us = timed_graph(_triton(None), xs, dense)
        n_us = timed_graph(_nvfp4_fn(None), xs, nv)
        nbytes = _nvfp4_bytes(N4, Nt, K, bs)
        row = {"N4": N4, "Nt": Nt, "K": K, "bs": bs, "weight_sets": sets,
               "dense_weight_sets": dense_sets, "tiles": repr(tiles),
               "launch": _nvfp4_launch(tiles, K), "bytes": nbytes,
               "torch_bf16_us": round(t_us, 2), "triton_bf16_us": round(g_us, 2),
               "nvfp4_us": round(n_us, 2), "speedup_vs_torch": round(t_us / n_us, 2),
               "torch_bf16_GBs": round(_gbs(N, K, bs, t_us)),
               "triton_bf16_GBs": round(_gbs(N, K, bs, g_us)),
               "nvfp4_GBs": round(nbytes / (n_us * 1e-6) / 1e9),
               "max_abs_diff": _max_diff(got, ref), "max_abs_ref": float(ref.float().abs().max()),
               "repeat_bit_equal": bool(torch.equal(got, again))}
        if extra:
            times = {}
            for t in extra:
                us = timed_graph(_nvfp4_fn(t), xs, nv)
                times[repr(t)] = {"us": round(us, 2), "GBs": round(nbytes / (us * 1e-6) / 1e9),
                                  "spec": nvfp4_spec(t), "launch": _nvfp4_launch(t, K),
                                  "max_abs_diff": _max_diff(
                                      nvfp4_gemv.nvfp4_linear_triton(xs[0], *nv[0], tiles=t),
                                      ref)}
                print(f"  nvfp4 {N4}+{Nt}x{K} bs{bs} {nvfp4_spec(t)}: {us:.2f} us", flush=True)
            best = min(times, key=lambda k: times[k]["us"])
            row["sweep"], row["best_tiles"], row["best_us"] = times, best, times[best]["us"]
        print(f"nvfp4 {N4}+{Nt}x{K} bs{bs}: cuBLAS bf16 {t_us:.2f} us "
              f"({row['torch_bf16_GBs']} GB/s), triton bf16 {g_us:.2f} us "
              f"({row['triton_bf16_GBs']} GB/s), nvfp4 {n_us:.2f} us ({row['nvfp4_GBs']} GB/s), "
              f"x{row['speedup_vs_torch']} vs cuBLAS, max|diff| {row['max_abs_diff']:.3g}, "
              f"tiles {tiles}"
              + (f", best {row['best_tiles']} {row['best_us']} us" if "sweep" in row else ""),
              flush=True)
        res[f"nvfp4_{N4}+{Nt}x{K}_bs{bs}"] = row
    del nv, dense
    torch.cuda.empty_cache()
    return res


def bench(shapes, bs_list, sweep: bool, extra=()) -> dict:
    mm = torch.backends.cuda.matmul
    mm.allow_bf16_reduced_precision_reduction = mm.allow_tf32 = False
    res = {}
    for N, K in shapes:
        sets = max(2, min(REPS, math.ceil(SET_BYTES / (N * K * 2))))
        ws = [(torch.randn(N, K, device=DEV) * K ** -0.5).to(DTYPE) for _ in range(sets)]
        for bs in bs_list:
            xs = [torch.randn(bs, K, device=DEV).to(DTYPE) for _ in range(4)]
            tiles = gemv.default_tiles(N, K, bs)
            ref = F.linear(xs[0], ws[0])
            got = gemv.linear_triton(xs[0], ws[0])
            again = gemv.linear_triton(xs[0], ws[0])
            t_us = timed_graph(F.linear, xs, ws)
            g_us = timed_graph(_triton(None), xs, ws)
            row = {"N": N, "K": K, "bs": bs, "weight_sets": sets, "tiles": repr(tiles),
                   "launch": _effective(tiles, K),
                   "torch_us": round(t_us, 2), "triton_us": round(g_us, 2),
                   "speedup": round(t_us / g_us, 2), "torch_GBs": round(_gbs(N, K, bs, t_us)),
                   "triton_GBs": round(_gbs(N, K, bs, g_us)), "max_abs_diff": _max_diff(got, ref),
                   "max_abs_ref": float(ref.float().abs().max()),
                   "repeat_bit_equal": bool(torch.equal(got, again))}
            if sweep or extra:
                times = {}
                for t in (_candidates(N, K, bs) if sweep else []) + list(extra):
                    us = timed_graph(_triton(t), xs, ws)
                    times[repr(t)] = {"us": round(us, 2), "GBs": round(_gbs(N, K, bs, us)),
                                      "launch": _effective(t, K),
                                      "max_abs_diff": _max_diff(
                                          gemv.linear_triton(xs[0], ws[0], t), ref)}
                    print(f"  {N}x{K} bs{bs} {t}: {us:.2f} us", flush=True)
                best = min(times, key=lambda k: times[k]["us"])
                row["sweep"], row["best_tiles"], row["best_us"] = times, best, times[best]["us"]
            print(f"{N}x{K} bs{bs}: torch {t_us:.2f} us ({row['torch_GBs']} GB/s), triton "
                  f"{g_us:.2f} us ({row['triton_GBs']} GB/s), x{row['speedup']}, "
                  f"max|diff| {row['max_abs_diff']:.3g}, tiles {tiles}"
                  + (f", best {row['best_tiles']} {row['best_us']} us" if "sweep" in row else ""),
                  flush=True)
            res[f"{N}x{K}_bs{bs}"] = row
        del ws
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the results as JSON to this file")
    ap.add_argument("--bs", default="1,2", help="decode batch sizes (rows), comma-separated")
    ap.add_argument("--shapes", default=None,
                    help="N x K list like 2560x6144,1281x2560 (default: the decode shapes)")
    ap.add_argument("--sweep", action="store_true", help="also time a few tile choices per shape")
    ap.add_argument("--tiles", default="",
                    help="also time these tiles on every shape: BNxBKsSPLITwWARPS,... "
                         "(split at most nk, evened)")
    ap.add_argument("--arms", default="dense,nvfp4",
                    help="dense (the bf16 shapes), nvfp4 (the NVFP4 + tail arm), comma-separated")
    ap.add_argument("--nvfp4-tiles", default="",
                    help="also time these tiles in the NVFP4 arm: "
                         "BNxBKsSPLITwWARPS[tT][tc|rows],... (e.g. 8x512s1w1t4rows)")
    args = ap.parse_args()
    arms = {a for a in args.arms.split(",") if a}
    assert arms and arms <= {"dense", "nvfp4"}, f"--arms: dense and/or nvfp4, not {args.arms!r}"
    shapes = SHAPES if args.shapes is None else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    bs_list = [int(b) for b in args.bs.split(",")]
    nv_extra = [parse_nvfp4_tiles(t) for t in args.nvfp4_tiles.split(",") if t]
    extra = [parse_tiles(t) for t in args.tiles.split(",") if t]
    res = {"device": torch.cuda.get_device_name(), "dtype": "bf16", "reps_per_graph": REPS}
    if "dense" in arms:
        res["results"] = bench(shapes, bs_list, args.sweep, extra)
    if "nvfp4" in arms:
        res["nvfp4"] = bench_nvfp4(bs_list, nv_extra)
    print(json.dumps({k: v for k, v in res.items() if k not in ("results", "nvfp4")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
