#!/usr/bin/env bash
# Session 20's device calls, from the repository root: run(command="bash benchmarks/device_s20.sh MODE")
#   tests    tests/gpu/test_sync_gpu.py (its child kernel now a file: Triton reads a kernel's
#            source, which `python -c` code has none of) and the in-flight eviction test with its
#            control (now joined at each step's end), then the one-launch HC read's GPU tests in
#            four shards at once (one shard ran 37 of 64 in 240 s in session 19: compiles), each
#            test's end time-stamped, each shard under a timeout
#   bench    as device_s19.sh bench: 48 layers resident at 4K, `resident` beside one
#            `resident:skip=F` arm per kernel family (HC1=1 adds `resident:hc1=1`)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
stamp() { while IFS= read -r l; do echo "$(date +%T) $l"; done; }
case $1 in
  tests)
    timeout ${SYNC_S:-200} python3 -m pytest -m gpu -v -rA -p no:cacheprovider \
      tests/gpu/test_sync_gpu.py 2>&1 | stamp > "$O/ptest_sync.log"
    echo "sync: $(tail -1 "$O/ptest_sync.log")"
    timeout ${EVICT_S:-200} python3 -m pytest -m gpu -v -rA -p no:cacheprovider \
      "tests/gpu/test_offload_gpu.py::test_eviction_of_a_slot_whose_prefetch_copy_is_in_flight" \
      2>&1 | stamp > "$O/ptest_evict.log"
    echo "evict: $(tail -1 "$O/ptest_evict.log")"
    python3 -m pytest -m gpu --collect-only -p no:cacheprovider tests/gpu/test_hyper_router_gpu.py \
      -k "one_launch or graph_replay" 2>/dev/null | grep '::' > "$O/hc1_ids.txt"
    echo "hc1: $(wc -l < "$O/hc1_ids.txt") tests"
    for s in 0 1 2 3; do
      awk -v s=$s 'NR % 4 == s' "$O/hc1_ids.txt" > "$O/hc1_ids_$s.txt"
      (timeout ${HC_S:-300} python3 -m pytest -m gpu -v -p no:cacheprovider \
        $(cat "$O/hc1_ids_$s.txt") 2>&1 | stamp > "$O/ptest_hc1_$s.log") &
    done
    wait
    for s in 0 1 2 3; do echo "hc1 shard $s: $(grep -c ' PASSED' "$O/ptest_hc1_$s.log") passed; $(tail -1 "$O/ptest_hc1_$s.log")"; done ;;
  bench) bash benchmarks/device_s19.sh bench ;;
esac
