#!/usr/bin/env bash
# Issue 17's prefill figures at the real depth (not run yet: for the next device session): the
# 48-layer flash-next model built in memory (random weights, NVFP4 experts in pinned host
# memory), offloaded at 1,650 slots, prefill tok/s per --prefill-chunk and prompt length
# (commands/bench.py bench_prefill: staging path, prefetch off).
#   run(command="CHUNKS=1024,4096,8192 LENGTHS=4096,32768 bash benchmarks/device_prefill48.sh", timeout_s=600)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 - "${CHUNKS:-1024,4096,8192}" "${LENGTHS:-4096}" > "$O/prefill48.json" 2> "$O/prefill48.err" <<'PY'
import json, sys, time
import torch
from ftchat.commands.bench import bench_prefill
from ftchat.model.synth_memory import synthetic_model
from ftchat.settings import Settings
chunks, lengths = ([int(x) for x in a.split(",")] for a in sys.argv[1:3])
t = time.perf_counter()
import os
m = synthetic_model("flash-next", 48, "nvfp4-modelopt", "cuda", torch.bfloat16,
                    dense=os.environ.get("DENSE", "bf16"))
out = {"build_s": round(time.perf_counter() - t, 1), "tok_s": {}}
streams = [s == "1" for s in os.environ.get("STREAM", "1,0").split(",")]
for chunk in chunks:
    for stream in streams:  # layer streaming on / off, side by side
        torch.cuda.reset_peak_memory_stats()
        copied = {}
        res = bench_prefill(m, Settings(slots=1650, prefill_chunk=chunk), lengths, stream, copied)
        key = f"{chunk}" + ("" if stream else ":nostream")
        out["tok_s"][key] = {n: round(v, 1) for n, v in res.items()}
        out.setdefault("copy_mb_per_token", {})[key] = {n: round(b / n / 1e6, 2) for n, b in copied.items()}
        out.setdefault("peak_reserved_gib", {})[key] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        print(key, out["tok_s"][key], out["copy_mb_per_token"][key], file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
if os.environ.get("RESIDENT") == "1":  # every expert in VRAM (64 GB of rows): no copies
    for chunk in chunks:
        res = bench_prefill(m, Settings(prefill_chunk=chunk), lengths)
        out["tok_s"][f"{chunk}:resident"] = {n: round(v, 1) for n, v in res.items()}
        print(f"{chunk}:resident", out["tok_s"][f"{chunk}:resident"], file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
print(json.dumps(out))
PY
echo "prefill48 rc=$?"; tail -5 "$O/prefill48.err"; cat "$O/prefill48.json"
