#!/usr/bin/env bash
# The next device session's calls (written in session 18, not run yet), from the repository root:
#   run(command="bash benchmarks/device_s18.sh MODE")
#   fix15    issue 15's remainder, detached (then `wait`): the two flash-next verify shards the
#            session-18 queue lost to out-of-memory (seeds 3 and 5: 12 prompts, as in
#            benchmarks/verify_queue.sh), and `pytest -m gpu` on the three tests that failed in
#            session 18 plus the new tests/gpu/test_pin_gpu.py
#   wait     as device_s17.sh wait (WAIT_S, the archive $OUT/res.tgz, the totals)
#   skip48   48 layers resident at 4K: `resident` beside one `resident:skip=F` arm per kernel
#            family (ftchat/kernels/skip.py): each difference in us a layer is that family's
#            marginal cost inside the real chain (issue 14: where the 108 us a layer go);
#            skip=all leaves the step's other work (elementwise, cuBLAS, lm_head). Run it
#            before fix15, on an idle GPU
#   hc1      the GPU tests of this session's new code, each group under a timeout (the
#            one-launch HC read's grid barrier has never run on a GPU: a hang is cut): the
#            one-launch HC read against the two kernels and in graph replay, the skip switch,
#            the pin registration; then 48 layers resident at 4K and 32K, `resident` beside
#            `resident:hc1=1` (and both at pdl=0), if the HC tests passed
#   dec48    48 layers resident (device_s13.sh dec48b; ARMS, CTX), likewise before fix15
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
case $1 in
  fix15)
    . benchmarks/verify_queue.sh  # the queue's environment (OMP_NUM_THREADS=2 among it): here only
    mps_on
    setsid nohup bash -c "python3 -m pytest -m gpu -q -rs --junitxml=$R/pytest.xml \
        tests/gpu/test_pin_gpu.py tests/gpu/test_synth_memory_gpu.py \
        'tests/gpu/test_offload_gpu.py::test_eviction_of_a_slot_whose_prefetch_copy_is_in_flight' \
        > $R/pytest.log 2>&1; echo pytest rc=\$? \$(date +%T) >> $R/done.log" > /dev/null 2>&1 < /dev/null &
    setsid nohup bash -c "python3 -m ftchat.cli synth /tmp/fn4 --preset flash-next --layers 4 \
        --format nvfp4-modelopt --dense nvfp4 > $R/synth.log 2>&1; echo synth rc=\$? \$(date +%T) >> $R/done.log
      shard fn4 3 & shard fn4 5 & wait" > /dev/null 2>&1 < /dev/null &
    sleep 5; echo "started $(date +%T)" ;;
  wait) bash benchmarks/device_s17.sh wait ;;
  skip48)
    fams="hc gemv routed nvfp4 gdn router qsa all"
    CTX=${CTX:-4k} DEC_S=${DEC_S:-420} \
      ARMS=${ARMS:-"resident$(for f in $fams; do printf ';resident:skip=%s' $f; done)"} \
      bash benchmarks/device_s12.sh dec48
    mv "$O/bench48_offload.json" "$O/bench48_skip_s18.json" ;;
  hc1)
    timeout ${HC_S:-240} python3 -m pytest -m gpu -q -x -p no:cacheprovider \
      tests/gpu/test_hyper_router_gpu.py -k "one_launch or graph_replay" > "$O/ptest_hc1.log" 2>&1
    rc=$?; echo "hc1 tests rc=$rc: $(tail -1 "$O/ptest_hc1.log")"
    timeout ${SKIP_S:-200} python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/gpu/test_skip_gpu.py tests/gpu/test_pin_gpu.py > "$O/ptest_skip_pin.log" 2>&1
    echo "skip+pin tests rc=$?: $(tail -1 "$O/ptest_skip_pin.log")"
    [ $rc = 0 ] && CTX=${CTX:-4k,32k} DEC_S=${DEC_S:-360} \
      ARMS=${ARMS:-"resident;resident:hc1=1;resident:pdl=0;resident:hc1=1,pdl=0"} \
      bash benchmarks/device_s12.sh dec48 && mv "$O/bench48_offload.json" "$O/bench48_hc1_s18.json" ;;
  dec48) bash benchmarks/device_s13.sh dec48b ;;
esac
