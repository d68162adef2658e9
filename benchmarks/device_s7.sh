#!/usr/bin/env bash
# Session 7's one short device call: the new kernels' GPU tests, the HC before/after, and the
# 48-layer resident decode. run(command="bash benchmarks/device_s7.sh", timeout_s=...)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
gpu() {  # name, seconds, pytest args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest -m gpu -q -rf -p no:cacheprovider "$@" > "$O/gpu_$name.log" 2>&1
  echo "gpu $name rc=$?: $(tail -1 "$O/gpu_$name.log")"
}
gpu new 75 tests/gpu/test_hyper_router_gpu.py tests/gpu/test_gemv_gpu.py \
  tests/gpu/test_qsa_topk_gpu.py tests/gpu/test_embedding_gpu.py
timeout 30 python3 benchmarks/bench_hyper_router.py --bs 1 --out "$O/bench_hyper_router.json" > "$O/bench_hyper_router.log" 2>&1
echo "bench_hyper_router rc=$?"; grep -E "hc_write_read|layer" "$O/bench_hyper_router.log" | cut -c1-220
python3 -c "import json; r=json.load(open('$O/bench_hyper_router.json'))['results']['bs1']; print({k: v for k, v in r.items() if 'stream' in k})" 2>&1 | tail -1
CTX=${CTX:-4k,32k,255k} timeout ${B48_S:-170} bash benchmarks/device_bench48.sh resident
