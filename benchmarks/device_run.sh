#!/usr/bin/env bash
# One device call's worth of checks on an H200: the GPU test tier file by file, then the fused
# kernels' micro-benchmarks. Logs to $OUT. Usage (one call):
#   run(command="bash benchmarks/device_run.sh [tests|micro|all]", timeout_s=600)
# The 48-layer decode figures are benchmarks/device_bench48.sh (a call of their own).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
what=${1:-all}
gpu() {  # name, seconds, pytest args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest -m gpu -q -rf -p no:cacheprovider "$@" > "$O/gpu_$name.log" 2>&1
  echo "gpu $name rc=$?: $(tail -1 "$O/gpu_$name.log")"
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  gpu fused 150 tests/gpu/test_gdn_decode_gpu.py tests/gpu/test_hyper_router_gpu.py \
    $(ls tests/gpu/test_qsa_decode_gpu.py tests/gpu/test_moe_fused_gpu.py 2>/dev/null)
  gpu offload 150 tests/gpu/test_offload_gpu.py
  gpu kernels 100 tests/gpu/test_kernels_gpu.py tests/gpu/test_cache_gpu.py \
    tests/gpu/test_cache_kernels_graph_gpu.py tests/gpu/test_profile_gpu.py \
    tests/gpu/test_synth_memory_gpu.py tests/gpu/test_ple_gather_gpu.py
fi
if [ "$what" = cache ]; then
  gpu cache_kernels 150 tests/gpu/test_cache_kernels_gpu.py
fi
if [ "$what" = micro ] || [ "$what" = all ]; then
  for b in bench_gdn_decode bench_hyper_router bench_qsa_decode bench_routed_nvfp4; do
    [ -f benchmarks/$b.py ] || continue
    timeout 60 python3 benchmarks/$b.py --out "$O/$b.json" > "$O/$b.log" 2>&1
    echo "$b rc=$?: $(tail -1 "$O/$b.log" | cut -c1-200)"
  done
fi
