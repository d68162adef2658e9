#!/usr/bin/env bash
# Session 12's device calls. Usage: run(command="bash benchmarks/device_s12.sh MODE...")
#   rsweep   the routed-expert decode kernels, v2 (the default before) vs v4 tiles (kernel 1 as a
#            row loop), graph replay, bs 1 / 2 (bench_routed_nvfp4.py --tiles RTILES)
#   dec48    48 layers, one process: the resident arm with the row-loop kernels on and off, and the
#            offload arms at 1,650 slots (device_bench48.sh offload; CTX, ARMS)
#   gtests   the GPU tests of the kernels this session touches, in parallel groups (ptests)
#   rsweep2  session 13: v2 against v4 at 2 / 1 h rows and other kernel-2 tiles (RS_S 150)
#   dec48r   the resident arms only, row-loop kernels on and off (4K / 32K / 255K)
#   gtests2  the GPU test groups that did not finish or failed in session 12
#   others   as device_s11.sh (kbench, ncu, e2e, prefill48, ...)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=/tmp/s12logs; mkdir -p $L
N=tests/gpu/test_nvfp4_gemv_gpu.py
for mode in "$@"; do
  case $mode in
    rsweep)
      timeout ${RS_S:-120} python3 benchmarks/bench_routed_nvfp4.py --no-tail --iters 30 \
        --tiles "${RTILES:-v2:8,512,2,64,128,4;v4:4,512,1,64,128,4;v4:2,512,1,64,128,4;v4:8,512,1,64,128,4;v4:4,256,1,64,128,4;v4:4,512,1,32,128,2;v4:4,512,1,128,128,4}" \
        --out "$O/bench_routed_s12.json" > "$L/rsweep.log" 2>&1
      echo "rsweep rc=$?"; cut -c1-400 "$L/rsweep.log" | grep -v "^ *$" | tail -14 ;;
    dec48)
      CTX=${CTX:-4k,32k,255k} DENSE=nvfp4 ARMS=${ARMS:-"resident;resident:rowloop=0;off;on;on:budget=4"} \
        timeout ${DEC_S:-300} bash benchmarks/device_bench48.sh offload ;;
    gtests)
      PT_GROUPS=${PT_GROUPS:-"$N::test_real_shape_matches_float64 $N::test_default_tiles_odd_shapes $N::test_lead_shapes_tiles_and_masks;$N::test_x_once_tiles_match_float64;$N::test_masked_k_chunks $N::test_scalar_global_and_mixed_tail_dtype $N::test_x_once_tiles_masked_k_and_decode_k $N::test_x_once_decodes_equal_and_split_invariant $N::test_x_once_tiles_unaligned_x_and_bad_combinations $N::test_kernel_flags $N::test_decode_helpers_exhaustive $N::test_deterministic_and_split_invariant $N::test_ptx_decode_equals_bit_decode $N::test_counters_left_zero_and_owned $N::test_negative_control $N::test_dispatch_picks_the_path $N::test_graph_replay_equals_eager $N::test_wrapper_rejects_what_it_cannot_take $N::test_default_tiles_rule_and_sweep;tests/gpu/test_kernels_gpu.py tests/gpu/test_moe_fused_gpu.py tests/gpu/test_pdl_gpu.py;tests/gpu/test_offload_gpu.py;tests/gpu/test_gemv_gpu.py tests/gpu/test_hyper_router_gpu.py"} \
        TESTS_S=${TESTS_S:-230} bash benchmarks/device_s10.sh ptests ;;
    rsweep2)
      RS_S=${RS_S:-150} RTILES="v2:8,512,2,64,128,4;v4:2,512,1,64,128,4;v4:1,512,1,64,128,4;v4:2,1024,1,64,128,4;v4:2,512,1,32,128,2;v4:2,512,1,64,256,4" \
        bash "$0" rsweep ;;
    dec48r)
      ARMS="resident;resident:rowloop=0" DEC_S=${DEC_S:-170} bash "$0" dec48 ;;
    gtests2)
      PT_GROUPS="tests/gpu/test_kernels_gpu.py tests/gpu/test_moe_fused_gpu.py tests/gpu/test_pdl_gpu.py;$N::test_x_once_tiles_match_float64;$N::test_masked_k_chunks $N::test_scalar_global_and_mixed_tail_dtype $N::test_x_once_tiles_masked_k_and_decode_k $N::test_x_once_decodes_equal_and_split_invariant;$N::test_x_once_tiles_unaligned_x_and_bad_combinations $N::test_kernel_flags $N::test_decode_helpers_exhaustive $N::test_deterministic_and_split_invariant;$N::test_ptx_decode_equals_bit_decode $N::test_counters_left_zero_and_owned $N::test_negative_control $N::test_dispatch_picks_the_path $N::test_graph_replay_equals_eager $N::test_wrapper_rejects_what_it_cannot_take $N::test_default_tiles_rule_and_sweep" \
        TESTS_S=${TESTS_S:-240} bash "$0" gtests ;;
    *) bash benchmarks/device_s11.sh "$mode" ;;
  esac
done
