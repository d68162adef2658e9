"""The prefill's hyper-connection read and PLE layer on CUDA in sub-blocks of 1,024 tokens vs at
once (qwen4_exp.HC_SUBBLOCK, ple.PLE_SUBBLOCK), flash-next geometry, one process, warm-up first:
ms per call and peak MiB above the inputs, for T = 4,096 / 8,192.

    python benchmarks/bench_prefill_subblocks.py
"""

from __future__ import annotations

import json

import torch

from ftchat.model import ple
from ftchat.model import qwen4_exp as q
from ftchat.model.state import DecodeState
from ftchat.model.synth_memory import synthetic_model


def timed(fn, reps: int = 5) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    m = synthetic_model("flash-next", 4, "nvfp4-modelopt", "cuda", torch.bfloat16, dense="nvfp4")
    a = m.args
    i = a.ple_layers[0]
    hcD = a.hc_count * a.hidden_size
    out = {}
    for T in (4096, 8192):
        R = torch.randn(1, T, hcD, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(1, T, a.hidden_size, device="cuda", dtype=torch.bfloat16)
        s = torch.rand(1, T, a.hc_count, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, 1000, (1, T), device="cuda")
        st = DecodeState.create(a, 1, 8, "cuda", torch.bfloat16)
        hw, pw = m.weights.layers[0]["mlp_hyper_connection"], m.weights.layers[i]["ple"]
        for sub in (1024, 1 << 30):
            q.HC_SUBBLOCK = ple.PLE_SUBBLOCK = sub
            key = f"T{T}_" + ("sub1024" if sub == 1024 else "whole")
            out[f"hc_{key}"] = timed(lambda R=R, y=y, s=s, hw=hw: q.hc_write_read(R, y, s, hw, a))
            out[f"ple_{key}"] = timed(lambda R=R, ids=ids, pw=pw, st=st:
                                      ple.ple_layer(R, ids, pw, st.ple_ctx, st.ple[i].conv, a))
            print(key, out[f"hc_{key}"], out[f"ple_{key}"], flush=True)
    print(json.dumps({k: [round(v[0], 3), round(v[1], 1)] for k, v in out.items()}))


if __name__ == "__main__":
    main()
