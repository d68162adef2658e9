#!/usr/bin/env bash
# One device call's worth of checks (about 6 minutes on an H200): the GPU test tier file by file,
# kernel figures, and verify/audit/run on a flash-next-geometry synthetic model. Logs to $OUT.
#   run(command="bash benchmarks/device_run.sh", timeout_s=600)
# Training the demo model is a separate call: docs/training.md.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
gpu() {  # name, seconds, pytest args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest -m gpu -q -rf -p no:cacheprovider "$@" > "$O/gpu_$name.log" 2>&1
  echo "gpu $name rc=$?: $(tail -1 "$O/gpu_$name.log")"
}
gpu offload 200 tests/gpu/test_offload_gpu.py
gpu kernels 120 -s tests/gpu/test_kernels_gpu.py tests/gpu/test_cache_gpu.py \
  tests/gpu/test_cache_kernels_graph_gpu.py
CACHE_KERNEL_STEPS=100 gpu cache_kernels 150 tests/gpu/test_cache_kernels_gpu.py
grep "us per layer" "$O/gpu_kernels.log" | grep triton
M=/tmp/fn4
timeout 60 python3 -m ftchat.cli synth $M --preset flash-next --layers 4 --format nvfp4-modelopt \
  > /dev/null 2>&1
timeout 90 python3 -m ftchat.cli verify $M --mode meta --prompts 30 --max-new-tokens 16 \
  --budget 4 --slots 137 --json > "$O/verify.json" 2> "$O/verify.err"; echo "verify rc=$?"
for p in on off; do
  timeout 40 python3 -m ftchat.cli run $M --prompt "hello" --max-new-tokens 16 --slots 137 \
    --prefetch $p --json > "$O/run_$p.json" 2> "$O/run_$p.err"; echo "run prefetch=$p rc=$?"
done
cmp <(python3 -c "import json;print(json.loads(open('$O/run_on.json').read())['tokens'])") \
    <(python3 -c "import json;print(json.loads(open('$O/run_off.json').read())['tokens'])") \
  && echo "run: prefetch on == off tokens"
