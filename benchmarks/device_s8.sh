#!/usr/bin/env bash
# Session 8's device calls. Usage: run(command="bash benchmarks/device_s8.sh MODE...", timeout_s=600)
#   tier   the whole GPU test tier, files in parallel groups (Triton compiles are CPU-bound and the
#          device has 16 cores), one log per group under $OUT
#   tests2 / final  the changed kernels' GPU tests (final: with the offload identity grid)
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
    tests2)  # the kernels changed or added since the first call
      g=tests/gpu
      gpu nvfp4_gemv $T $g/test_nvfp4_gemv_gpu.py
      gpu gdn $T $g/test_gdn_decode_gpu.py
      gpu moe $T $g/test_moe_fused_gpu.py
      gpu hyper $T $g/test_hyper_router_gpu.py
      [ -f $g/test_qsa_kv_fp8_gpu.py ] && gpu kv_fp8 $T $g/test_qsa_kv_fp8_gpu.py
      wait ;;
    final)  # the last call's tests: everything the session changed, the identity grid included
      g=tests/gpu
      gpu dequant $T $g/test_nvfp4_dequant_gpu.py $g/test_nvfp4_gemv_gpu.py
      gpu gdn_nvfp4 $T $g/test_gdn_decode_gpu.py -k nvfp4
      gpu moe_kernels $T $g/test_moe_fused_gpu.py $g/test_kernels_gpu.py
      gpu offload $T $g/test_offload_gpu.py
      [ -f $g/test_qsa_kv_fp8_gpu.py ] && gpu kv_fp8 $T $g/test_qsa_kv_fp8_gpu.py
      wait ;;
    gemv4)
      timeout 100 python3 benchmarks/bench_gemv.py --nvfp4 --out "$O/bench_gemv_nvfp4.json" \
        > "$O/bench_gemv_nvfp4.log" 2>&1
      echo "bench_gemv nvfp4 rc=$?"; grep -i "nvfp4\|16480" "$O/bench_gemv_nvfp4.log" | cut -c1-200 ;;
    prefill)
      timeout ${PREFILL_S:-150} python3 benchmarks/profile_prefill.py --layers 4 --tokens 8192 \
        --chunk 8192,1024 --out "$O/profile_prefill.json" > "$O/profile_prefill.log" 2>&1
      echo "profile_prefill rc=$?"; cut -c1-160 "$O/profile_prefill.log" | head -70 ;;
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
