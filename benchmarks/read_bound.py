"""What one kernel that only streams S bytes from HBM costs in a CUDA graph, by S (issue 14).

The decode kernels each read 3-30 MB of weights (HC down/up 6.6 MB, the routed experts' down
9.2 MB, gate-up 18.4 MB, GDN out_proj 31.5 MB at the flash-next geometry) and reach 1-2 TB/s.
This measures the best a kernel of that size can do on this GPU: a Triton kernel that reads S
bytes of bf16 (each program a contiguous stretch, summed into one fp32 per program) and does
nothing else, >= 48 calls a graph over distinct buffers (3x what L2 holds), with and without
PDL, over a few tile shapes; the best shape per size and arm. A decode kernel near its size's
figure has no bandwidth left to win; one far below it does.

    python benchmarks/read_bound.py --out docs/read_bound.json          (CUDA)
    TRITON_INTERPRET=1 python benchmarks/read_bound.py --check          (CPU: the sums only)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftchat.kernels import jit, tl, triton  # noqa: E402
from ftchat.kernels.sync import pdl_release, pdl_wait  # noqa: E402

SIZES_MB = (1.0, 2.0, 4.0, 6.6, 9.2, 18.4, 31.5, 64.0)
# (BLOCK, ITERS, warps): elements a load, loads a program, warps a program
SHAPES = ((2048, 1, 4), (4096, 1, 8), (2048, 4, 4), (4096, 4, 8), (8192, 2, 8))
CALLS = 48  # one per layer
L2_BYTES = 60 * 2**20  # the buffers of a graph together exceed this several times


@jit
def _read_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                 PDL: tl.constexpr):
    # program p sums x[p*ITERS*BLOCK, (p+1)*ITERS*BLOCK); its loads issue before the PDL wait,
    # as the decode kernels' weight loads do, and only the store waits
    pdl_release(PDL)
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(ITERS):
        o = (p * ITERS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + o, mask=o < N, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


def read(x: torch.Tensor, out: torch.Tensor, block: int, iters: int, warps: int, pdl: bool):
    grid = (triton.cdiv(x.numel(), block * iters),)
    kw = {"launch_pdl": True} if pdl else {}
    _read_kernel[grid](x, out, x.numel(), BLOCK=block, ITERS=iters, PDL=pdl, num_warps=warps,
                       **kw)


def check() -> None:
    """The kernel sums what it reads (interpreter or CUDA): every shape, a ragged length."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(50_001, device=dev).to(torch.bfloat16)
    for block, iters, warps in SHAPES:
        out = torch.zeros(triton.cdiv(x.numel(), block * iters), device=dev)
        read(x, out, block, iters, warps, False)
        want = x.float().sum().item()
        assert abs(out.sum().item() - want) <= 1e-3 * x.float().abs().sum().item(), (block, iters)
    print("read kernel sums: ok")


def measure(sizes_mb, calls: int) -> list[dict]:
    from graph_timing import graph_us

    rows = []
    for mb in sizes_mb:
        n = int(mb * 2**20) // 2
        # a distinct buffer a call, and enough calls that a replay reads 3x L2: no call hits L2
        nbuf = max(calls, -(-3 * L2_BYTES // (2 * n)))
        bufs = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(nbuf)]
        for pdl in (False, True):
            best = None
            for block, iters, warps in SHAPES:
                out = torch.empty(triton.cdiv(n, block * iters), device="cuda")

                def body(bufs=bufs, out=out, shape=(block, iters, warps), pdl=pdl):
                    for b in bufs:
                        read(b, out, *shape, pdl)

                us = graph_us(body, len(bufs))
                if best is None or us < best["us"]:
                    best = {"us": us, "shape": [block, iters, warps]}
            gbs = 2 * n / best["us"] / 1e3
            rows.append({"mb": mb, "pdl": pdl, "us": round(best["us"], 2), "gb_s": round(gbs),
                         "shape": best["shape"]})
            print(f"{mb:6.1f} MB  pdl={int(pdl)}  {best['us']:7.2f} us  {gbs:6.0f} GB/s  "
                  f"(BLOCK, ITERS, warps) = {tuple(best['shape'])}", flush=True)
        bufs.clear()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_MB)), help="MB, comma-separated")
    ap.add_argument("--calls", type=int, default=CALLS)
    ap.add_argument("--check", action="store_true", help="only check the kernel's sums")
    args = ap.parse_args(argv)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not (args.check and interpret):
        print("read_bound: needs CUDA (or --check with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    check()
    if args.check:
        return 0
    rows = measure([float(s) for s in args.sizes.split(",")], args.calls)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "calls": args.calls, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
