#!/usr/bin/env bash
# The next device session's calls (written in session 13, not run yet). Usage:
#   run(command="bash benchmarks/device_s13.sh MODE...", carry=[the tree's tar])
#   v4bs1    the GPU cases of the one-h-row routed tile (faster at bs 1, not yet the default) and the
#            default-tiles rule
#   dec48b   48 layers resident: the default (v4, 2 h rows) beside onerow=1 and pdl=0 (the
#            pdl=0 arm's profile gives each kernel's own time: with PDL a kernel's time includes its
#            wait for the one before); 4K and 32K
#   verify60 one shard of issue 15's verify: 60 cold prompts x 256 tokens, audits every 64, 96
#            slots, --graph, on the demo model (SEED: the shard; 7 shards make the 420 prompts)
#   soak_start  issue 15's 15-minute soak (demo model, prefetch on), detached with setsid so it can
#            outlive the call (a call runs at most 600 s); untried: whether the machine keeps a
#            detached process between calls is not known. Then, within the 30 s idle window:
#   soak_wait   waits up to WAIT_S (default 560) for it, then prints its JSON lines so far
#   others   as device_s12.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
for mode in "$@"; do
  case $mode in
    v4bs1)
      timeout ${TESTS_S:-200} python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider \
        tests/gpu/test_kernels_gpu.py -k "v4 or routed_default_tiles_rule" > "$O/ptest_v4bs1.log" 2>&1
      echo "v4bs1 rc=$?: $(tail -1 "$O/ptest_v4bs1.log")" ;;
    dec48b)
      CTX=${CTX:-4k,32k} ARMS=${ARMS:-"resident;resident:onerow=1;resident:pdl=0"} DEC_S=${DEC_S:-240} \
        bash benchmarks/device_s12.sh dec48 ;;
    verify60)
      timeout ${VERIFY_S:-560} python3 -m ftchat.cli verify --prompts 60 --max-new-tokens 256 \
        --budget 4 --audit-every 64 --slots 96 --graph --prompt-seed ${SEED:-0} --json \
        > "$O/verify_seed${SEED:-0}.json" 2> "$O/verify_seed${SEED:-0}.err"
      echo "verify60 seed ${SEED:-0} rc=$?"; tail -c 600 "$O/verify_seed${SEED:-0}.json" ;;
    soak_start)
      setsid nohup python3 scripts/soak.py --minutes 15 --prefetch on --budget 4 --slots 96 \
        --out /tmp/soak.jsonl > /tmp/soak.log 2>&1 < /dev/null &
      echo "soak started, pid $!" ;;
    soak_wait)
      end=$((SECONDS + ${WAIT_S:-560}))
      while pgrep -f scripts/soak.py > /dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
      pgrep -f scripts/soak.py > /dev/null && echo "soak still running" || echo "soak done"
      cp /tmp/soak.jsonl /tmp/soak.log "$O/" 2>/dev/null; tail -3 /tmp/soak.jsonl; tail -2 /tmp/soak.log ;;
    *) bash benchmarks/device_s12.sh "$mode" ;;
  esac
done
