#!/usr/bin/env bash
# Session 16's device calls: issue 15's evidence. run(command="bash benchmarks/device_s16.sh MODE")
# from the repository root (the working tree carries the trained demo model, ftchat/models/demo).
#   start  MPS on (the verify processes' small kernels then share one GPU context instead of
#          time-slicing between a dozen; falls back to plain sharing if MPS does not start),
#          then, detached (they outlive the call while the machine stays held):
#          - the 15-minute soak (demo model, prefetch on, budget 4, 96 slots);
#          - the verify queue on the trained demo model: 70 shards x 6 cold prompts (prompt
#            seeds 0-69: 420 prompts) x 256 tokens, audit every 64, --budget 4 --graph,
#            96 of 512 slots, DEMO_P workers;
#          - `ftchat synth` of the 4-layer flash-next-geometry checkpoint, then its queue:
#            42 shards x 10 prompts, 137 of 2,048 slots, FN_P workers.
#          Workers claim shards (mkdir), so `more` can add workers to a running queue.
#   wait   waits up to WAIT_S (default 540) for the queues and the soak, copies what is done
#          to $OUT, prints the progress and the mean seconds of each arm a prompt
#   more   TAG=demo|fn4 P=N: N more workers on a queue
export FN_N=10  # session 16: 42 flash-next shards of 10 prompts
. benchmarks/verify_queue.sh
case $1 in
  start)
    mps_on
    setsid nohup bash -c "python3 scripts/soak.py --minutes 15 --prefetch on --budget 4 --slots 96 \
      --out $R/soak.jsonl > $R/soak.log 2>&1; echo soak rc=\$? \$(date +%T) >> $R/done.log" > /dev/null 2>&1 < /dev/null &
    for i in $(seq ${DEMO_P:-6}); do setsid nohup bash -c "worker demo 70" > /dev/null 2>&1 < /dev/null & done
    setsid nohup bash -c "python3 -m ftchat.cli synth /tmp/fn4 --preset flash-next --layers 4 \
        --format nvfp4-modelopt --dense nvfp4 > $R/synth.log 2>&1; echo synth rc=\$? \$(date +%T) >> $R/done.log
      for i in \$(seq ${FN_P:-5}); do worker fn4 42 & done; wait" > /dev/null 2>&1 < /dev/null &
    sleep 5; echo "started $(date +%T): $(pgrep -fc 'ftchat.cli verify') verify, $(pgrep -fc scripts/soak.py) soak" ;;
  more)
    for i in $(seq ${P:-2}); do setsid nohup bash -c "worker $TAG $([ $TAG = demo ] && echo 70 || echo 42)" > /dev/null 2>&1 < /dev/null & done ;;
  wait)
    end=$((SECONDS + ${WAIT_S:-540}))
    while [ $SECONDS -lt $end ]; do
      [ "$(ls $R/verify_*.json 2> /dev/null | wc -l)" -ge 112 ] && ! pgrep -f scripts/soak.py > /dev/null && break
      sleep 10
    done
    cp $R/*.json $R/*.log $R/*.jsonl "$O/" 2> /dev/null
    for f in $R/*.err; do [ -s "$f" ] && grep -qv "demo model\|^loading\|^verifying\|^building" "$f" && cp "$f" "$O/"; done
    echo "$(date +%T) demo shards $(ls $R/verify_demo_*.json 2> /dev/null | wc -l)/70, fn4 $(ls $R/verify_fn4_*.json 2> /dev/null | wc -l)/42; verify running $(pgrep -fc 'ftchat.cli verify'); soak running $(pgrep -fc scripts/soak.py)"
    grep -v "rc=0" $R/done.log | tail -5
    queue_totals
    tail -2 $R/soak.jsonl 2> /dev/null | cut -c1-300; tail -2 $R/soak.log; tail -1 $R/synth.log 2> /dev/null | cut -c1-200
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime ;;
esac
