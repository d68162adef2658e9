#!/usr/bin/env bash
# Session 21's device calls, from the repository root: run(command="bash benchmarks/device_s21.sh MODE")
#   tests    the GPU tests the shared-down fold and the resident slot view touch: the MoE kernels
#            (the fold against its own launch, its control, graph replay), the skip arms, the
#            offload identity tests; in four shards at once, each under a timeout
#   bench    48 layers resident (DENSE=nvfp4), `resident` beside the fold on / the slot view off
#            (ARMS), at CTX (default 4k,32k,255k)
#   diag     benchmarks/diag_fold_tolerance.py: the elements a seed-82 tolerance check missed
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
stamp() { while IFS= read -r l; do echo "$(date +%T) $l"; done; }
case $1 in
  tests)
    python3 -m pytest -m gpu --collect-only -p no:cacheprovider ${TESTS:-tests/gpu/test_moe_fused_gpu.py \
      tests/gpu/test_skip_gpu.py tests/gpu/test_offload_gpu.py} 2>/dev/null | grep '::' > "$O/ids.txt"
    echo "$(wc -l < "$O/ids.txt") tests"
    for s in 0 1 2 3; do
      awk -v s=$s 'NR % 4 == s' "$O/ids.txt" > "$O/ids_$s.txt"
      (timeout ${TESTS_S:-240} python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider \
        $(cat "$O/ids_$s.txt") 2>&1 | stamp > "$O/ptest_$s.log") &
    done
    wait
    for s in 0 1 2 3; do echo "shard $s: $(grep -c ' PASSED' "$O/ptest_$s.log") passed; $(tail -1 "$O/ptest_$s.log")"; done
    grep -h "FAILED\|ERROR" "$O"/ptest_*.log | head -20 ;;
  diag) PYTHONPATH=$PWD python3 benchmarks/diag_fold_tolerance.py ;;
  bench)
    CTX=${CTX:-4k,32k,255k} DENSE=nvfp4 \
      ARMS=${ARMS:-"resident;resident:fold=1;resident:slotview=0"} \
      bash benchmarks/device_bench48.sh resident ;;
esac
