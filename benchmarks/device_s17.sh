#!/usr/bin/env bash
# Session 17's device calls: issue 15's evidence after the span fix (qsa.decode_blocks), and the
# GPU tier. run(command="bash benchmarks/device_s17.sh MODE") from the repository root.
#   start  MPS on (falls back to plain sharing), then, detached:
#          - `pytest -m gpu $TESTS` (default tests/gpu, the whole GPU tier; log and junit XML);
#          - the verify queue on the trained demo model: 70 shards x 6 cold prompts (prompt
#            seeds 0-69: 420 prompts) x 256 tokens, audit every 64, --budget 4 --graph,
#            96 of 512 slots, DEMO_P workers (default 7; 0 skips it);
#          - `ftchat synth` of the 4-layer flash-next-geometry checkpoint, then its queue:
#            70 shards x 6 prompts, 137 of 2,048 slots, FN_P workers (default 5: a process
#            holds ~20 GiB of GPU memory; session 16 lost shards to OOM with 8).
#          Workers claim shards (mkdir), so `more` can add workers to a running queue.
#   wait   waits up to WAIT_S (default 540) for the queues and pytest, archives what is done
#          in $OUT/res.tgz, prints the progress and the mean seconds of each arm a prompt
#   more   TAG=demo|fn4 P=N: N more workers on a queue
. benchmarks/verify_queue.sh
case $1 in
  start)
    mps_on
    setsid nohup bash -c "python3 -m pytest -m gpu -q -rs ${TESTS:-tests/gpu} --junitxml=$R/pytest.xml \
      > $R/pytest.log 2>&1; echo pytest rc=\$? \$(date +%T) >> $R/done.log" > /dev/null 2>&1 < /dev/null &
    for i in $(seq ${DEMO_P:-7}); do setsid nohup bash -c "worker demo 70" > /dev/null 2>&1 < /dev/null & done
    setsid nohup bash -c "python3 -m ftchat.cli synth /tmp/fn4 --preset flash-next --layers 4 \
        --format nvfp4-modelopt --dense nvfp4 > $R/synth.log 2>&1; echo synth rc=\$? \$(date +%T) >> $R/done.log
      for i in \$(seq ${FN_P:-5}); do worker fn4 70 & done; wait" > /dev/null 2>&1 < /dev/null &
    sleep 5; echo "started $(date +%T): $(pgrep -fc 'ftchat.cli verify') verify, $(pgrep -fc 'pytest -m gpu') pytest" ;;
  more)
    for i in $(seq ${P:-2}); do setsid nohup bash -c "worker $TAG 70" > /dev/null 2>&1 < /dev/null & done ;;
  wait)
    end=$((SECONDS + ${WAIT_S:-540}))
    while [ $SECONDS -lt $end ]; do
      grep -q synth $R/done.log && grep -q pytest $R/done.log && \
        ! pgrep -f 'ftchat.cli verify' > /dev/null && break
      sleep 10
    done
    # one archive: the device returns only a few files a call
    (cd $R && tar czf "$O/res.tgz" $(ls *.json *.log *.xml 2> /dev/null) \
      $(for f in *.err; do [ -s "$f" ] && grep -qv "demo model\|^loading\|^verifying\|^building" "$f" && echo "$f"; done))
    echo "$(date +%T) demo shards $(ls $R/verify_demo_*.json 2> /dev/null | wc -l)/70, fn4 $(ls $R/verify_fn4_*.json 2> /dev/null | wc -l)/70; verify running $(pgrep -fc 'ftchat.cli verify'); pytest running $(pgrep -fc 'pytest -m gpu')"
    grep -v "rc=0" $R/done.log | tail -5
    queue_totals
    tail -3 $R/pytest.log; tail -1 $R/synth.log 2> /dev/null | cut -c1-200
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime ;;
esac
