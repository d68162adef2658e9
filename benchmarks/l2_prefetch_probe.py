"""Does the bulk L2 prefetch land, and what does it save the kernel that reads next? (issue 14)

The decode kernels' L2 prefetch (ftchat/kernels/l2_prefetch.py) is a hint: if the GPU dropped
it, the 48-layer arms would show nothing and say nothing about why. This probe isolates it. A
CUDA graph of CALLS rounds over distinct buffers (together several times L2), each round:
  1. a prefetch kernel (`prefetch_l2` from 128 programs, as the decode kernels issue it) asks L2
     for the whole buffer, or, in the `off` arm, for its first 16 bytes (the same kernel);
  2. a sleep kernel (`torch.cuda._sleep`) keeps HBM idle for SLEEP cycles, as a latency-bound
     decode kernel would;
  3. read_bound's reader streams the buffer (each program a contiguous stretch, summed).
Both arms run the same kernels, so their difference per round is what the prefetch saved the
reader (or cost it). The reader alone (no prefetch kernel, no sleep) is timed too, and an `on1`
arm issues the whole prefetch from one program: whether one SM's copy engine can pull a range
as fast (a kernel with few programs, such as the router, would prefetch that way).

    python benchmarks/l2_prefetch_probe.py --out docs/l2_prefetch_probe.json    (CUDA, sm_90+)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftchat.kernels import jit, tl  # noqa: E402
from ftchat.kernels.l2_prefetch import L2_PROGRAMS, prefetch_l2  # noqa: E402
from read_bound import read  # noqa: E402

SIZES_MB = (4, 8, 16, 32)
CALLS = 24  # rounds a graph, each over its own buffer
SLEEP = 40_000  # cycles (~20 us at the H200's ~2 GHz): long enough to pull 32 MiB at ~4 TB/s
SHAPE = (4096, 4, 8)  # read_bound's (BLOCK, ITERS, warps) for the reader


@jit
def _prefetch_kernel(x_ptr, nbytes, ON: tl.constexpr):
    prefetch_l2(x_ptr, nbytes, tl.program_id(0), tl.num_programs(0), ON)


def _graph(bufs: list[torch.Tensor], out: torch.Tensor, arm: str) -> torch.cuda.CUDAGraph:
    def rounds():
        for x in bufs:
            if arm != "alone":
                nbytes = x.numel() * x.element_size() if arm != "off" else 16
                _prefetch_kernel[(1 if arm == "on1" else L2_PROGRAMS,)](x, nbytes, ON=True)
                torch.cuda._sleep(SLEEP)
            read(x, out, *SHAPE, pdl=False)

    rounds()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rounds()
    return g


def _us_per_round(g: torch.cuda.CUDAGraph, reps: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / CALLS)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0), \
        "the bulk prefetch needs a CUDA GPU of sm_90 or later"
    res = {"device": torch.cuda.get_device_name(), "sleep_cycles": SLEEP, "calls": CALLS,
           "sizes": {}}
    for mb in SIZES_MB:
        n = mb * 2**20 // 2  # bf16 elements
        bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        out = torch.empty(n // (SHAPE[0] * SHAPE[1]) + 1, device="cuda")
        alone = _us_per_round(_graph(bufs, out, "alone"))
        g_off, g_on, g_on1 = (_graph(bufs, out, arm) for arm in ("off", "on", "on1"))
        off = [_us_per_round(g_off)]
        on, on1 = _us_per_round(g_on), _us_per_round(g_on1)
        off.append(_us_per_round(g_off))  # again after the `on` arms: the drift between them
        row = {"read_alone_us": alone, "round_off_us": off, "round_on_us": on,
               "round_on1_us": on1, "saved_us": min(off) - on, "saved_on1_us": min(off) - on1,
               "read_alone_tb_s": mb * 2**20 / (alone * 1e-6) / 1e12}
        res["sizes"][str(mb)] = row
        print(f"{mb:3d} MiB: reader alone {alone:6.2f} us ({row['read_alone_tb_s']:.2f} TB/s); "
              f"round off {off[0]:6.2f} / {off[1]:6.2f} us, on {on:6.2f} us (saved "
              f"{row['saved_us']:6.2f}), on1 {on1:6.2f} us (saved {row['saved_on1_us']:6.2f})",
              flush=True)
        del bufs
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
