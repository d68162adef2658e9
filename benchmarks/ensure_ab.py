"""The fused `ensure` / `prefetch_ensure` under graph replay, arms side by side in one process,
rounds interleaved (CUDA only): the slot-cache kernels (ftchat/kernels/slot_cache.py) at one or
more warp counts.

    python benchmarks/ensure_ab.py --warps 1,2,4,8 --json /tmp/kernel_ensure_warps.json

The maps of 48 Flash-Next layers (512 experts, top-10, S = 1650, 16 candidates, prefetch budget
4) are captured in one CUDA graph per arm; each figure is the median replay time over 48, in us
per layer, for: all hits, 3 new ids per row (~2.7 misses) and fresh random routing (~9.4).
The timing helpers are the GPU cost test's (tests/gpu/test_cache_kernels_graph_gpu.py). Each
arm's "all hits" follows the previous arm's fresh routing, so the cache is full and prefetch
installs its budget (4) every replay; the cost test's "all hits" has free slots (see
docs/performance.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ftchat.offload import cache_kernels  # noqa: E402
from ftchat.offload.cache import SlotMaps  # noqa: E402
from tests.gpu.test_cache_kernels_graph_gpu import _graph_of, _token, _us_per_layer  # noqa: E402

LAYERS, E, S, K = 48, 512, 1650, 10



def measure(arms: dict, bs: int, rounds: int) -> dict[str, list[float]]:
    ids = torch.zeros(LAYERS, bs, K, dtype=torch.int64, device="cuda")
    cands = torch.zeros(LAYERS, 16, dtype=torch.int64, device="cuda")
    stable = torch.rand(LAYERS, bs, E // 2, device="cuda").argsort(-1)[..., : K - 3]

    def fresh():
        ids.copy_(torch.rand(LAYERS, bs, E, device="cuda").argsort(-1)[..., :K])
        cands.copy_(torch.randint(0, E, (LAYERS, 16), device="cuda"))

    def three_new():
        ids[..., : K - 3] = stable
        ids[..., K - 3:] = E // 2 + torch.rand(LAYERS, bs, E // 2, device="cuda").argsort(-1)[
            ..., :3]
        cands.copy_(torch.randint(0, E, (LAYERS, 16), device="cuda"))

    graphs = {}
    for name, (mod, warps) in arms.items():
        ensure = functools.partial(mod.ensure_triton, num_warps=warps)
        for with_prefetch in (False, True):
            maps = SlotMaps.create(LAYERS, E, S, "cuda")
            three_new()
            prefetch = (functools.partial(mod.prefetch_ensure_triton, num_warps=warps)
                        if with_prefetch else None)
            # the graph holds raw pointers: keep its maps alive beside it, or a later arm's
            # allocations reuse their memory and the replay indexes through garbage
            graphs[name, with_prefetch] = (_graph_of(_token(maps, ids, cands, ensure, prefetch)),
                                           maps)
    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for (name, with_prefetch), (g, _maps) in graphs.items():
            for scenario, refill in (("all hits", lambda: None), ("3 new", three_new),
                                     ("fresh", fresh)):
                op = "ensure+prefetch" if with_prefetch else "ensure"
                key = f"bs{bs} {op} {scenario} {name}"
                out.setdefault(key, []).append(round(_us_per_layer(g, LAYERS, refill), 2))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warps", default="", help="this tree at these warp counts, e.g. 1,2,4,8 "
                   "(default: its own choice)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("error: needs CUDA", file=sys.stderr)
        return 2
    warps = [int(w) for w in a.warps.split(",") if w] or [None]
    arms = {("this tree" if w is None else f"this tree, {w} warps"): (cache_kernels, w)
            for w in warps}
    out = {}
    for bs in (1, 2):
        out.update(measure(arms, bs, a.rounds))
    for k, v in out.items():
        print(f"{k}: {v} us per layer")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
