#!/usr/bin/env bash
# The verify queue of the device scripts (device_s16.sh, device_s17.sh), sourced by them from
# the repository root: shards of `ftchat verify` claimed by workers, MPS, the totals.
#   shard TAG SEED   one verify process (demo: the trained demo model, 96 slots, DEMO_N
#                    prompts; fn4: /tmp/fn4, 137 slots, FN_N prompts), its JSON whole or absent
#   worker TAG N     claims (mkdir) and runs shards of seeds 0..N-1 until none is left
#   mps_on           starts MPS (the processes' small kernels share one GPU context), or falls
#                    back to plain sharing; says which in $R/mps.log
#   queue_totals     per tag: summed counts and the mean seconds of each arm a prompt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
export R=/tmp/vres DEMO_N=${DEMO_N:-6} FN_N=${FN_N:-6}
O=${OUT:-/tmp/out}; mkdir -p "$O" $R
shard() {
  local tag=$1 seed=$2 f=$R/verify_$1_seed$2.json m s n
  if [ "$tag" = demo ]; then m=""; s=96; n=$DEMO_N; else m=/tmp/fn4; s=137; n=$FN_N; fi
  python3 -m ftchat.cli verify $m --prompts $n --max-new-tokens 256 --budget 4 \
    --audit-every 64 --slots $s --graph --prompt-seed "$seed" --json > "$f.part" 2> "$R/verify_$1_seed$2.err"
  echo "$tag seed $seed rc=$? $(date +%T)" >> $R/done.log
  [ -s "$f.part" ] && mv "$f.part" "$f"
}
worker() {
  for seed in $(seq 0 $(($2 - 1))); do
    mkdir $R/claim_$1_$seed 2> /dev/null && shard $1 $seed
  done
}
export -f shard worker
mps_on() {
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  if nvidia-cuda-mps-control -d 2> $R/mps.err && \
      timeout 90 python3 -c "import torch; assert torch.ones(4, device='cuda').sum().item() == 4"; then
    echo "MPS on" | tee $R/mps.log
  else
    echo quit | nvidia-cuda-mps-control 2> /dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "MPS off: $(cat $R/mps.err)" | tee $R/mps.log
  fi
}
queue_totals() {
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
}
