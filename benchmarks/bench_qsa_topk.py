"""QSA block selection's top-k on the device (H200): torch.topk(sorted=False) vs the Triton radix
select (ftchat/kernels/topk_select.py), us per call under CUDA-graph replay, and an exactness
check of the chosen sets.

    python benchmarks/bench_qsa_topk.py --out docs/bench_qsa_topk.json [--sweep]

Cases: N in {1024, 8192, 32768, 65280} candidate blocks (4K to 255K context at r = 4), B in {1, 2}
rows, K = min(512, N). Each graph holds REPS calls in a row on REPS distinct key tensors (built
like qsa.rank_key: a sum of 4 ReLU'd Gaussian dot products, about 6 % exact zeros, the last block
incomplete), so a figure is one call's steady-state cost inside a long graph, as in decode. The
"zeros" input (every score 0.0: one tie group, all keys in one histogram bin) is the kernel's
worst case for atomic contention. --sweep also times the kernel's chunk, warps, one- vs
multi-program path and 12-bit digits (slow under Triton 3.6: see the kernel's docstring).
Exactness: for every input, the kernel's values sorted equal torch.topk's and the index sets of
the keys >= 0 are equal.
"""

from __future__ import annotations

import argparse
import json

import torch

from graph_timing import graph_us  # benchmarks/ (the script's folder)

REPS = 20  # calls per graph, each on its own input
NS = (1024, 8192, 32768, 65280)
DEV = "cuda"


def _inputs(B: int, N: int, kind: str, seed: int) -> torch.Tensor:
    from ftchat.model.qsa import rank_key

    gen = torch.Generator(device=DEV).manual_seed(seed)
    if kind == "zeros":
        s = torch.zeros(B, N, device=DEV)
    else:
        s = torch.randn(B, N, 4, device=DEV, generator=gen).relu().sum(-1) * 0.125
    complete = (torch.arange(N, device=DEV) < N - 1).expand(B, N)
    return rank_key(s, complete)


def timed_graph(fn, inputs, iters: int = 30) -> float:
    """us per call: a graph of one call per input (graph_timing.graph_us)."""
    def body():
        for x in inputs:
            fn(x)
    return graph_us(body, len(inputs), iters)


def kernels_of(fn, x) -> int:
    """GPU kernels (and memcpy/memset) one eager call launches, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def same_set(got, x: torch.Tensor, k: int) -> bool:
    idx, val = got
    tv, ti = torch.topk(x, k, dim=-1, sorted=False)
    if not torch.equal(val.sort(-1).values, tv.sort(-1).values):
        return False
    return all(set(idx[r][val[r] >= 0].tolist()) == set(ti[r][tv[r] >= 0].tolist())
               for r in range(x.shape[0]))


def _variants(N: int) -> dict:
    # the sweep's kernel settings: name -> topk_keys_triton kwargs (few: each compiles anew)
    out = {}
    if N <= 8192:
        out["small_w8"] = dict(small_max=N, num_warps=8)
    for chunk in (1024, 2048, 4096):
        for w in (4, 8):
            out[f"multi_c{chunk}_w{w}"] = dict(small_max=0, chunk=chunk, num_warps=w)
    out["multi_c1024_w8_d12"] = dict(small_max=0, chunk=1024, num_warps=8, digit_bits=12)
    return out


def bench(ns, bs_list, kinds, sweep: bool) -> dict:
    from ftchat.kernels import topk_select as ts

    res = {}
    for kind in kinds:
        for N in ns:
            for B in bs_list:
                k = min(512, N)
                xs = [_inputs(B, N, kind, 1000 * N + 10 * B + i) for i in range(REPS)]
                ref = lambda x: torch.topk(x, k, dim=-1, sorted=False)  # noqa: E731
                fused = lambda x: ts.topk_keys_triton(x, k)  # noqa: E731
                t_us, f_us = timed_graph(ref, xs), timed_graph(fused, xs)
                exact = all(same_set(fused(x), x, k) for x in xs)
                row = {"N": N, "B": B, "K": k, "input": kind, "torch_us": round(t_us, 2),
                       "triton_us": round(f_us, 2), "speedup": round(t_us / f_us, 2),
                       "exact": exact, "torch_kernels": kernels_of(ref, xs[0]),
                       "triton_kernels": kernels_of(fused, xs[0])}
                if sweep:
                    sw = {}
                    for name, kw in _variants(N).items():
                        fn = lambda x, kw=kw: ts.topk_keys_triton(x, k, **kw)  # noqa: E731
                        sw[name] = round(timed_graph(fn, xs, iters=15), 2)
                        if not same_set(fn(xs[0]), xs[0], k):
                            sw[name + "_INEXACT"] = True
                    row["sweep_us"] = sw
                    row["best"] = min(sw, key=lambda n: sw[n] if isinstance(sw[n], float)
                                      else 1e9)
                print(json.dumps({k_: v for k_, v in row.items() if k_ != "sweep_us"}),
                      flush=True)
                res[f"{kind}_N{N}_B{B}"] = row
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON to this file")
    ap.add_argument("--n", default=",".join(map(str, NS)), help="candidate blocks N, comma list")
    ap.add_argument("--bs", default="1,2", help="rows B, comma list")
    ap.add_argument("--inputs", default="random,zeros", help="input kinds: random, zeros")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's settings")
    args = ap.parse_args()
    from ftchat.kernels import topk_select as ts

    res = {"device": torch.cuda.get_device_name(), "reps_per_graph": REPS,
           "defaults": dict(chunk=ts.CHUNK, small_max=ts.SMALL_MAX, digit_bits=ts.DIGIT_BITS),
           "results": bench([int(n) for n in args.n.split(",")],
                            [int(b) for b in args.bs.split(",")], args.inputs.split(","),
                            args.sweep)}
    res["all_exact"] = all(r["exact"] for r in res["results"].values())
    print(json.dumps({k: v for k, v in res.items() if k != "results"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
