#!/usr/bin/env bash
# Session 8's device calls. Usage: run(command="bash benchmarks/device_s8.sh MODE...", timeout_s=600)
#   tier   the whole GPU test tier, files in parallel groups (Triton compiles are CPU-bound and the
#          device has 16 cores), one log per group under $OUT
#   sweep  the HC read's tile sweep (bs 1, 2) and the GEMV at the router / router+shared shapes
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
T=${TIER_S:-300}
gpu() {  # name, seconds, pytest args... (background)
  local name=$1 secs=$2; shift 2
  ( timeout "$secs" python3 -m pytest -m gpu -q -rf -p no:cacheprovider "$@" > "$O/gpu_$name.log" 2>&1
    echo "gpu $name rc=$?: $(tail -1 "$O/gpu_$name.log")" ) &
}
for mode in "$@"; do
  case $mode in
    tier)
      g=tests/gpu
      gpu offload $T $g/test_offload_gpu.py
      gpu qsa $T $g/test_qsa_decode_gpu.py
      gpu gdn_moe $T $g/test_gdn_decode_gpu.py $g/test_moe_fused_gpu.py tests/test_nvfp4.py
      gpu hyper_gemv $T $g/test_hyper_router_gpu.py $g/test_gemv_gpu.py
      gpu topk_emb_verify $T $g/test_qsa_topk_gpu.py $g/test_embedding_gpu.py $g/test_verify_graph_gpu.py
      gpu kernels $T $g/test_kernels_gpu.py $g/test_cache_gpu.py $g/test_cache_kernels_graph_gpu.py \
        $g/test_profile_gpu.py $g/test_synth_memory_gpu.py $g/test_ple_gather_gpu.py
      gpu cache_kernels $T $g/test_cache_kernels_gpu.py
      [ -f $g/test_nvfp4_gemv_gpu.py ] && gpu nvfp4_gemv $T $g/test_nvfp4_gemv_gpu.py
      wait ;;
    sweep)
      timeout ${SWEEP_S:-170} python3 benchmarks/bench_hyper_router.py --bs 1,2 --sweep \
        --out "$O/bench_hyper_router.json" > "$O/bench_hyper_router.log" 2>&1
      echo "bench_hyper_router rc=$?"; grep -E "^[12] (hc_write_read|layer) |best" "$O/bench_hyper_router.log" | cut -c1-160
      python3 -c "import json; r=json.load(open('$O/bench_hyper_router.json'))['results']; [print(b, v['best_tiles'], min(v['sweep_hc_write_read_us'].values())) for b, v in r.items()]"
      timeout 90 python3 benchmarks/bench_gemv.py --shapes 512x2560,1281x2560,1793x2560 \
        --out "$O/bench_gemv_router.json" > "$O/bench_gemv_router.log" 2>&1
      echo "bench_gemv rc=$?"; tail -8 "$O/bench_gemv_router.log" | cut -c1-200 ;;
  esac
done
