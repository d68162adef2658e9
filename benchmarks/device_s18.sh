#!/usr/bin/env bash
# The next device session's calls (written in session 18, not run yet), from the repository root:
#   run(command="bash benchmarks/device_s18.sh MODE")
#   fix15    issue 15's remainder, detached (then `wait`): the two flash-next verify shards the
#            session-18 queue lost to out-of-memory (seeds 3 and 5: 12 prompts, as in
#            benchmarks/verify_queue.sh), and `pytest -m gpu` on the three tests that failed in
#            session 18 plus the new tests/gpu/test_pin_gpu.py
#   wait     as device_s17.sh wait (WAIT_S, the archive $OUT/res.tgz, the totals)
#   dec48    48 layers resident (device_s13.sh dec48b; ARMS, CTX): run it before fix15, on an
#            idle GPU; its figures are wrong under the verify load
. benchmarks/verify_queue.sh
case $1 in
  fix15)
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
  dec48) bash benchmarks/device_s13.sh dec48b ;;
esac
