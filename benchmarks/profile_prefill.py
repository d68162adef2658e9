"""Where a prefill chunk's time goes on the device: a model of a synthetic preset's geometry
(flash-next by default; --preset names another, --layers overrides its depth) built in memory (random weights, NVFP4 experts in pinned host memory), one prompt prefilled with
offloaded experts (the staging path, prefetch off) and with every expert resident, then one
chunk under torch.profiler: wall time per chunk and layer, the copy bytes, the top kernels.

    python benchmarks/profile_prefill.py --layers 4 --tokens 32768 --chunk 8192 --at 24576
    python benchmarks/profile_prefill.py --preset qwen3-next --dense bf16 --no-profile

--no-profile keeps the timed prefill (tok/s, copy bytes) and skips the breakdown and the
profiled chunk.

--at T profiles the chunk that starts at position T (the first T tokens prefilled unprofiled
first): the attention of a late chunk sees a long context.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ftchat.engine import Decoder, build_experts, resident_backend
from ftchat.model.synth_memory import synthetic_model
from ftchat.settings import Settings


def _copy_gb(ex) -> float:
    return float(ex.stats().get("prefill_copy_gb") or 0.0)


def _timed_prefill(m, ex, ids: torch.Tensor, chunk: int) -> tuple[float, float]:
    """(seconds, GB copied host -> device) of one prefill of ids after a warm-up."""
    dec = Decoder(m, ex, 1, len(ids) + 2, prefill_chunk=chunk)
    dec.prefill(0, ids[:256], 0)  # warm-up: compiles, first allocations
    dec.reset()
    torch.cuda.synchronize()
    gb = _copy_gb(ex)
    t = time.perf_counter()
    dec.prefill(0, ids, 0)
    torch.cuda.synchronize()
    return time.perf_counter() - t, _copy_gb(ex) - gb


def _profiled(m, ex, ids: torch.Tensor, chunk: int, top: int, at: int) -> dict:
    dec = Decoder(m, ex, 1, len(ids) + 2, prefill_chunk=chunk)
    dec.prefill(0, ids[:256], 0)
    dec.reset()
    if at:
        dec.prefill(0, ids[:at], 0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        dec.prefill(0, ids[at : at + chunk], at)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if dev > 0 and e.count:
            rows.append((e.key[:90], e.count, round(dev, 1)))
    rows.sort(key=lambda r: -r[2])
    kernels = [r for r in rows if not r[0].startswith(("aten::", "cuda", "Memcpy", "Memset"))]
    return {"top_device_us": rows[:top], "top_kernels_us": kernels[:top]}


# the forward's parts timed one by one (synchronized around each call) by `_breakdown`
PARTS = ("attention_mixer", "gdn_mixer", "moe_block", "hc_write_read", "ple_residual")


def _breakdown(m, ex, ids: torch.Tensor, chunk: int, at: int) -> dict:
    """ms per part of the forward for the chunk at position `at`: each of PARTS wrapped in
    synchronized timers (so the parts do not overlap; their sum is near the chunk's wall time)."""
    import ftchat.model.qwen4_exp as q

    dec = Decoder(m, ex, 1, len(ids) + 2, prefill_chunk=chunk)
    dec.prefill(0, ids[:256], 0)
    dec.reset()
    if at:
        dec.prefill(0, ids[:at], 0)
    spent = {p: 0.0 for p in PARTS}
    saved = {p: getattr(q, p) for p in PARTS}

    def timed(name, fn):
        def run(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            spent[name] += time.perf_counter() - t
            return out
        return run

    for p in PARTS:
        setattr(q, p, timed(p, saved[p]))
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        dec.prefill(0, ids[at : at + chunk], at)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        for p in PARTS:
            setattr(q, p, saved[p])
    return {"wall_ms": round(1e3 * wall, 1), **{p: round(1e3 * v, 1) for p, v in spent.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-next")
    ap.add_argument("--layers", type=int, default=None, help="the preset's when not given")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", default="8192", help="comma-separated --prefill-chunk values")
    ap.add_argument("--slots", type=int, default=1650)
    ap.add_argument("--dense", default=None,
                    help="nvfp4 (flash-next's default: its GDN qkv / z) or bf16 (the others')")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--at", type=int, default=0, help="position of the profiled chunk")
    ap.add_argument("--arms", default="offload,offload_nostream,resident")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t = time.perf_counter()
    dense = args.dense or ("nvfp4" if args.preset == "flash-next" else "bf16")
    m = synthetic_model(args.preset, args.layers, "nvfp4-modelopt", "cuda", torch.bfloat16,
                        dense=dense)
    L = m.args.num_hidden_layers
    res = {"preset": args.preset, "layers": L, "tokens": args.tokens, "build_s": round(time.perf_counter() - t, 1),
           "row_bytes": m.layout.nbytes, "runs": {}}
    ids = torch.randint(0, 1000, (args.tokens,))
    for chunk in (int(c) for c in args.chunk.split(",")):
        for arm in args.arms.split(","):
            ex = (resident_backend(m) if arm == "resident"
                  else build_experts(m, Settings(slots=args.slots, prefetch="off")))
            if arm == "offload_nostream":  # the layer streaming off: copies on demand
                ex.for_prefill().stream_layers = False
            s, gb = _timed_prefill(m, ex, ids, chunk)
            n_chunks = -(-args.tokens // chunk)
            row = {"tok_s": round(args.tokens / s, 1),
                   "ms_per_chunk_layer": round(1e3 * s / n_chunks / L, 2),
                   "copy_gb": round(gb, 2),  # host -> device bytes of the timed prefill
                   # the link alone at 52 GB/s (the H200's measured host-to-device rate)
                   "link_ms_per_chunk_layer": round(1e3 * gb / 52 / n_chunks / L, 2)}
            if args.profile:
                row["breakdown_ms"] = _breakdown(m, ex, ids, chunk, args.at)
                row.update(_profiled(m, ex, ids, chunk, args.top, args.at))
            res["runs"][f"{arm}_chunk{chunk}"] = row
            print(arm, chunk, {k: v for k, v in row.items() if not k.startswith("top")},
                  flush=True)
            if args.profile:
                print("    breakdown", row["breakdown_ms"], flush=True)
                for name, count, us in row["top_device_us"][:args.top]:
                    print(f"    {us / 1e3:9.2f} ms {count:6d}x  {name}", flush=True)
            ex.close()
            del ex
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
