#!/usr/bin/env bash
# Session 15's device calls (issue 15's evidence). Usage: run(command="bash benchmarks/device_s15.sh
# MODE...") from the repository root (the working tree carries the trained demo model,
# ftchat/models/demo: no tarball, so verify runs on the trained weights, not the fallback).
#   qstart  starts, detached (setsid; they outlive the call while the machine stays held):
#           the 15-minute soak (demo model, prefetch on, budget 4, 96 slots), the 4-layer
#           flash-next-geometry checkpoint (ftchat synth, GDN qkv and z in NVFP4 as the real one), and the verify queue: 20 shards x 21
#           cold prompts (prompt seeds 0-19: 420 prompts) x 256 tokens, audit every 64,
#           --budget 4 --graph, on the demo model (96 of 512 slots, DEMO_P at once) and on the
#           flash-next model (137 of 2,048 slots, FN_P at once, after the synth). A shard
#           whose JSON exists is skipped, so a queue started again resumes.
#   qwait   waits up to WAIT_S (default 540) for the queue and the soak, copies what is done to
#           $OUT, prints the progress
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
O=${OUT:-/tmp/out}; mkdir -p "$O"
R=/tmp/vres; mkdir -p $R
shard() {  # shard MODEL_TAG SEED: one verify process, its JSON written whole or not at all
  local tag=$1 seed=$2 f=$R/verify_$1_seed$2.json
  [ -s "$f" ] && return 0
  if [ "$tag" = demo ]; then m=""; s=96; else m=/tmp/fn4; s=137; fi
  python3 -m ftchat.cli verify $m --prompts 21 --max-new-tokens 256 --budget 4 \
    --audit-every 64 --slots $s --graph --prompt-seed "$seed" --json > "$f.part" 2> "$R/verify_$1_seed$2.err"
  echo "$tag seed $seed rc=$? $(date +%T)" >> $R/done.log
  [ -s "$f.part" ] && mv "$f.part" "$f"
}
export -f shard; export R
for mode in "$@"; do
  case $mode in
    qstart)
      if ! pgrep -f scripts/soak.py > /dev/null && [ ! -s $R/soak.jsonl ]; then
        setsid nohup python3 scripts/soak.py --minutes 15 --prefetch on --budget 4 --slots 96 \
          --out $R/soak.jsonl > $R/soak.log 2>&1 < /dev/null &
      fi
      setsid nohup bash -c '
        ( [ -f /tmp/fn4/config.json ] || python3 -m ftchat.cli synth /tmp/fn4 --preset flash-next \
            --layers 4 --format nvfp4-modelopt --dense nvfp4 > $R/synth.log 2>&1; \
          seq 0 19 | xargs -P '${FN_P:-4}' -I{} bash -c "shard fn4 {}" ) &
        seq 0 19 | xargs -P '${DEMO_P:-8}' -I{} bash -c "shard demo {}"
        wait; echo queue done >> $R/done.log' > $R/queue.log 2>&1 < /dev/null &
      sleep 2; echo "started: $(pgrep -fc 'ftchat.cli verify') verify processes, soak $(pgrep -fc scripts/soak.py)" ;;
    qwait)
      end=$((SECONDS + ${WAIT_S:-540}))
      while [ $SECONDS -lt $end ] && ! grep -q "queue done" $R/done.log 2>/dev/null; do sleep 10; done
      while [ $SECONDS -lt $end ] && pgrep -f scripts/soak.py > /dev/null; do sleep 5; done
      cp $R/*.json $R/*.log $R/*.jsonl "$O/" 2>/dev/null
      for f in $R/*.err; do [ -s "$f" ] && cp "$f" "$O/"; done
      echo "done shards: $(ls $R/*.json 2>/dev/null | wc -l); running verify: $(pgrep -fc 'ftchat.cli verify'); soak running: $(pgrep -fc scripts/soak.py)"
      tail -4 $R/done.log; tail -2 $R/soak.jsonl 2>/dev/null | cut -c1-400; tail -2 $R/soak.log; tail -2 $R/synth.log 2>/dev/null
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime; free -g | head -2 ;;
    *) bash benchmarks/device_s13.sh "$mode" ;;
  esac
done
