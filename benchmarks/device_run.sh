#!/usr/bin/env bash
# One device call's worth of checks on an H200: the GPU test tier file by file, then the fused
# kernels' micro-benchmarks (tune: the QSA decode tests and benchmark and the HC tile sweep; verify:
# issue 15's verify --graph). Logs to $OUT. Usage (one call):
#   run(command="bash benchmarks/device_run.sh [tests|cache|tune|verify|gemv|micro|all]", timeout_s=600)
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
if [ "$what" = tune ]; then  # the fused QSA decode's tests, its benchmark, the HC tile sweep
  gpu qsa 240 tests/gpu/test_qsa_decode_gpu.py
  timeout 90 python3 benchmarks/bench_qsa_decode.py --out "$O/bench_qsa_decode.json" > "$O/bench_qsa_decode.log" 2>&1
  echo "bench_qsa_decode rc=$?: $(tail -1 "$O/bench_qsa_decode.log" | cut -c1-200)"
  timeout 150 python3 benchmarks/bench_hyper_router.py --bs 1,2 --sweep --out "$O/bench_hyper_router.json" > "$O/bench_hyper_router.log" 2>&1
  echo "bench_hyper_router rc=$?: $(tail -1 "$O/bench_hyper_router.log" | cut -c1-200)"
fi
if [ "$what" = verify ]; then  # issue 15 on the device: verify --graph's GPU tests, then a run on the demo model
  gpu verify_graph 110 tests/gpu/test_verify_graph_gpu.py
  timeout ${VERIFY_S:-130} python3 -m ftchat.cli verify --prompts ${PROMPTS:-40} --max-new-tokens ${TOKENS:-128} \
    --budget 4 --slots 96 --audit-every 64 --graph --json > "$O/verify_demo.json" 2> "$O/verify_demo.err"
  echo "verify demo rc=$?"; tail -2 "$O/verify_demo.err"
  python3 -c "import json, sys; d = json.loads(open(sys.argv[1]).read().splitlines()[-1]); print({k: v for k, v in d.items() if k != 'per_prompt'})" "$O/verify_demo.json"
fi
if [ "$what" = gemv ]; then  # session 7: the split HC read and the Triton GEMV, tests then sweeps
  gpu hyper 150 tests/gpu/test_hyper_router_gpu.py
  gpu gemv 120 tests/gpu/test_gemv_gpu.py
  timeout 150 python3 benchmarks/bench_hyper_router.py --bs 1,2 --sweep --out "$O/bench_hyper_router.json" > "$O/bench_hyper_router.log" 2>&1
  echo "bench_hyper_router rc=$?: $(tail -1 "$O/bench_hyper_router.log" | cut -c1-200)"
  timeout 150 python3 benchmarks/bench_gemv.py --sweep --out "$O/bench_gemv.json" > "$O/bench_gemv.log" 2>&1
  echo "bench_gemv rc=$?: $(tail -1 "$O/bench_gemv.log" | cut -c1-200)"
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
