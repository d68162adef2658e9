#!/usr/bin/env bash
# Session 11's device calls. Usage: run(command="bash benchmarks/device_s11.sh MODE...")
#   ncu      Nsight Compute on the decode step's heaviest kernels (benchmarks/ncu_decode.py, bs BS)
#   kbench   the router top-k arms (bench_hyper_router.py) and the NVFP4 GEMV tiles (bench_gemv.py:
#            NV_TILES, ','-separated specs, else its --sweep)
#   dec48    the 48-layer resident decode (device_bench48.sh; CTX, ARMS)
#   others   as device_s10.sh (tests, ptests, e2e, prefill48, pdl48, offload48, ...)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=/tmp/s11logs; mkdir -p $L
for mode in "$@"; do
  case $mode in
    ncu)
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      echo "ncu: $NCU"
      timeout ${NCU_S:-240} "$NCU" --clock-control none --target-processes all \
        -k "regex:${NCU_K:-_nvfp4_gemv|_gate_up|_down_combine|_down_split|_up_split|_topk_softmax|_gemv_kernel}" \
        --launch-skip ${NCU_SKIP:-7} --launch-count ${NCU_COUNT:-7} \
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        --section SchedulerStats --section Occupancy --section LaunchStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python3 benchmarks/ncu_decode.py --bs ${BS:-1} > "$O/ncu_bs${BS:-1}.txt" 2> "$L/ncu.err"
      echo "ncu rc=$?"; tail -5 "$L/ncu.err"
      grep -E '^  _|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Executed Ipc A|Issue Slots Busy|No Eligible|Registers Per|Achieved Occupancy|Stall' "$O/ncu_bs${BS:-1}.txt" | cut -c1-150 | head -120 ;;
    kbench)  # the decode kernels changed this session, old and new arms in one process each
      timeout ${KB_S:-120} python3 benchmarks/bench_hyper_router.py --ops topk,route,moe_route --bs 1,2 \
        --out "$O/bench_router_s11.json" > "$L/router.log" 2>&1; echo "bench_hyper_router rc=$?"
      grep -vE "^\s*$" "$L/router.log" | cut -c1-220 | tail -20
      timeout ${KB_S:-150} python3 benchmarks/bench_gemv.py --arms nvfp4 --bs 1,2 ${NV_TILES:+--nvfp4-tiles $NV_TILES} $([ -z "$NV_TILES" ] && echo --sweep) \
        --out "$O/bench_gemv_nvfp4_s11.json" > "$L/gemv.log" 2>&1; echo "bench_gemv rc=$?"
      grep -vE "^\s*$" "$L/gemv.log" | cut -c1-220 | tail -45 ;;
    dec48)  # the 48-layer resident decode at 4K, PDL on (the defaults), one arm
      CTX=${CTX:-4k} DENSE=nvfp4 ARMS=${ARMS:-resident} timeout ${DEC_S:-200} bash benchmarks/device_bench48.sh resident ;;
    *) bash benchmarks/device_s10.sh "$mode" ;;
  esac
done
