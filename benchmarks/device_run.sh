#!/usr/bin/env bash
# The device batch of this session: GPU tests, kernel figures, verify/audit on a flash-next-geometry
# synthetic model. Logs and JSON go to $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CACHE_KERNEL_STEPS=${CACHE_KERNEL_STEPS:-100}
O=${OUT:-/tmp/out}; mkdir -p "$O"
timeout 120 python3 -m pytest -m gpu tests/gpu/test_cache_kernels_gpu.py \
  tests/gpu/test_cache_kernels_graph_gpu.py -q -s -p no:cacheprovider > "$O/gpu_cache_kernels.log" 2>&1
tail -4 "$O/gpu_cache_kernels.log"
timeout 180 python3 -m pytest -m gpu tests/gpu/test_offload_gpu.py tests/gpu/test_kernels_gpu.py \
  -q -x -p no:cacheprovider > "$O/gpu_offload.log" 2>&1
tail -4 "$O/gpu_offload.log"
timeout 45 python3 benchmarks/bench_kernels.py --out "$O/kernels2.json" > "$O/kernels2.log" 2>&1
grep -E "^ensure" "$O/kernels2.log"
M=/tmp/fn4
timeout 90 python3 -m ftchat.cli synth $M --preset flash-next --layers 4 --format nvfp4-modelopt
timeout 150 python3 -m ftchat.cli verify $M --mode meta --prompts 60 --max-new-tokens 16 \
  --budget 4 --slots 137 --json > "$O/verify.json" 2> "$O/verify.err"; echo "verify rc=$?"
python3 -c "import json,sys; d=json.load(open('$O/verify.json')); d.pop('per_prompt'); print(d)"
printf 'Write a Python function that merges two sorted lists.\n' | timeout 60 python3 -m ftchat.cli \
  audit $M --every 64 --max-new-tokens 300 --prefetch on --budget 4 --slots 137 --json \
  > "$O/audit.json" 2> "$O/audit.err"; echo "audit rc=$?"; cat "$O/audit.json"
timeout 60 python3 -m ftchat.cli run $M --prompt "hello" --max-new-tokens 8 --slots 137 \
  --prefetch on --json > "$O/run.json" 2> "$O/run.err"; echo "run rc=$?"; tail -c 600 "$O/run.json"
