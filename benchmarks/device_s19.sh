#!/usr/bin/env bash
# Session 19's device calls, from the repository root: run(command="bash benchmarks/device_s19.sh MODE")
#   tests    the one-launch HC read's GPU tests under timeouts, each test's end time-stamped (its
#            first run, session 19, stopped at a 200 s timeout after 28 of 64 passed), after
#            tests/gpu/test_sync_gpu.py (co_resident against the SM's limits, the barrier at that
#            count); then issue 15's remainder (device_s18.sh fix15, then its wait, WAIT_S)
#   bench    48 layers resident at 4K: `resident` beside one `resident:skip=F` arm per kernel
#            family (device_s18.sh skip48) and, with HC1=1, `resident:hc1=1`
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
stamp() { while IFS= read -r l; do echo "$(date +%T) $l"; done; }
case $1 in
  tests)
    timeout ${SYNC_S:-200} python3 -m pytest -m gpu -v -p no:cacheprovider tests/gpu/test_sync_gpu.py 2>&1 | stamp > "$O/ptest_sync.log"
    echo "sync: $(tail -1 "$O/ptest_sync.log")"
    timeout ${HC_S:-240} python3 -m pytest -m gpu -v -x -p no:cacheprovider --durations=8 \
      tests/gpu/test_hyper_router_gpu.py -k "one_launch or graph_replay" 2>&1 | stamp > "$O/ptest_hc1.log"
    echo "hc1: $(grep -c PASSED "$O/ptest_hc1.log") passed; $(tail -1 "$O/ptest_hc1.log")"
    bash benchmarks/device_s18.sh fix15
    WAIT_S=${WAIT_S:-300} bash benchmarks/device_s18.sh wait ;;
  bench)
    fams="hc gemv routed nvfp4 gdn router qsa all"
    arms="resident$([ "${HC1:-0}" = 1 ] && echo ';resident:hc1=1')$(for f in $fams; do printf ';resident:skip=%s' $f; done)"
    ARMS=$arms DEC_S=${DEC_S:-500} bash benchmarks/device_s18.sh skip48
    tail -4 "$O/bench48_offload.err" 2> /dev/null ;;
esac
