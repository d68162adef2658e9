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
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
O=${OUT:-/tmp/out}; R=/tmp/vres; mkdir -p "$O" $R
shard() {  # shard TAG SEED: one verify process, its JSON written whole or not at all
  local tag=$1 seed=$2 f=$R/verify_$1_seed$2.json m s n
  if [ "$tag" = demo ]; then m=""; s=96; else m=/tmp/fn4; s=137; fi; n=6
  python3 -m ftchat.cli verify $m --prompts $n --max-new-tokens 256 --budget 4 \
    --audit-every 64 --slots $s --graph --prompt-seed "$seed" --json > "$f.part" 2> "$R/verify_$1_seed$2.err"
  echo "$tag seed $seed rc=$? $(date +%T)" >> $R/done.log
  [ -s "$f.part" ] && mv "$f.part" "$f"
}
worker() {  # worker TAG SHARDS: claim and run shards until none is left
  for seed in $(seq 0 $(($2 - 1))); do
    mkdir $R/claim_$1_$seed 2> /dev/null && shard $1 $seed
  done
}
export -f shard worker; export R
case $1 in
  start)
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    if nvidia-cuda-mps-control -d 2> $R/mps.err && \
        timeout 90 python3 -c "import torch; assert torch.ones(4, device='cuda').sum().item() == 4"; then
      echo "MPS on" | tee $R/mps.log
    else
      echo quit | nvidia-cuda-mps-control 2> /dev/null
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      echo "MPS off: $(cat $R/mps.err)" | tee $R/mps.log
    fi
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
    python3 - $R <<'PY'
import glob, json, sys
for tag in ("demo", "fn4"):
    v = [json.load(open(f)) for f in glob.glob(f"{sys.argv[1]}/verify_{tag}_seed*.json")]
    if not v:
        continue
    keys = ("prompts", "mismatches", "graph_mismatches", "graph_prefetch_mismatches",
            "verifier_records", "audits", "bad_slots")
    tot = {k: sum(x.get(k) or 0 for x in v) for k in keys}
    arms = {}
    for x in v:
        for p in x["per_prompt"]:
            for a, s in p["seconds"].items():
                arms.setdefault(a, []).append(s)
    print(tag, tot, {a: round(sum(s) / len(s), 2) for a, s in arms.items()})
PY
    tail -3 $R/pytest.log; tail -1 $R/synth.log 2> /dev/null | cut -c1-200
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime ;;
esac
