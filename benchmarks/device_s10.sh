#!/usr/bin/env bash
# Session 10's device calls. Usage: run(command="bash benchmarks/device_s10.sh MODE...")
#   prof     where a late prefill chunk's time goes: profile_prefill.py, 4 layers, a 32K prompt,
#            the chunk at 24,576 (PROF_ARGS to change), resident and offloaded
#   e2e      benchmarks/e2e48.py under --vram-budget (TOKENS, BUDGET, CHUNK, SLOTS, CONTEXT)
#   tests    GPU test files (TESTS, space-separated, default: the prefill and offload files)
#   gdnb     bench_gdn_prefill.py: the GDN prefill rule and mixer, torch vs the Triton scan
#   pdl48 / offload48 / prefill48 / moe / gemv4: as device_s9.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=/tmp/s10logs; mkdir -p $L
for mode in "$@"; do
  case $mode in
    prof)
      timeout ${PROF_S:-240} python3 benchmarks/profile_prefill.py ${PROF_ARGS:---layers 4 --tokens 32768 --chunk 8192 --at 24576 --top 30} \
        --out "$O/profile_prefill.json" > "$L/prof.log" 2>&1
      echo "profile_prefill rc=$?"; cut -c1-200 "$L/prof.log" | tail -80 ;;
    e2e)
      timeout ${E2E_S:-400} python3 benchmarks/e2e48.py --tokens ${TOKENS:-32768} --budget ${BUDGET:-15.9} \
        --chunk ${CHUNK:-4096} ${SLOTS:+--slots $SLOTS} ${CONTEXT:+--context $CONTEXT} > "$O/e2e48_${CHUNK:-4096}.json" 2> "$L/e2e48.err"
      echo "e2e48 rc=$?"; grep -v "^prefill" "$L/e2e48.err" | tail -12 | cut -c1-300; grep "^prefill" "$L/e2e48.err" | tail -2; cat "$O/e2e48_${CHUNK:-4096}.json" ;;
    tests)
      timeout ${TESTS_S:-200} python3 -m pytest -m gpu -q -rf -p no:cacheprovider ${TESTS:-tests/gpu/test_moe_prefill_gpu.py tests/gpu/test_offload_gpu.py tests/gpu/test_gdn_decode_gpu.py} > "$L/tests.log" 2>&1
      echo "tests rc=$?"; tail -3 "$L/tests.log"; grep -E "^FAILED|^ERROR" "$L/tests.log" | tail -15
      grep -B5 -A25 "FAILED\|Error" "$L/tests.log" | head -60 ;;
    ptests)  # GPU test files in parallel groups (PT_GROUPS: ';'-separated file lists), tracebacks under $OUT
      i=0; IFS=';' read -ra groups <<< "${PT_GROUPS}"
      for grp in "${groups[@]}"; do i=$((i+1))
        ( timeout ${TESTS_S:-170} python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider $grp > "$O/ptest_$i.log" 2>&1
          echo "group $i rc=$?: $(tail -1 $O/ptest_$i.log)" ) &
      done; wait; grep -h "^FAILED" $O/ptest_*.log | cut -c1-250 ;;
    gdnb)
      timeout ${GDNB_S:-120} python3 benchmarks/bench_gdn_prefill.py --out "$O/bench_gdn_prefill.json" > "$L/gdnb.log" 2>&1
      echo "bench_gdn_prefill rc=$?"; grep -E "^(rule|mixer)_T" "$L/gdnb.log" | cut -c1-400; grep -E '"best"|"default"|Error' "$L/gdnb.log" | head -5 ;;
    *) bash benchmarks/device_s9.sh "$mode" ;;
  esac
done
