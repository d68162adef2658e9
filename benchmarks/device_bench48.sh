#!/usr/bin/env bash
# The 48-layer decode figures (docs/performance.md): a flash-next-geometry model built in memory
# (random weights, NVFP4 experts: ~68 GB of rows in host memory), arms side by side per context.
#   run(command="bash benchmarks/device_bench48.sh resident|offload", timeout_s=600)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
case ${1:-resident} in
  resident) arms="resident;resident:fused=0"; ctx=4k,32k,128k,255k; extra=() ;;
  offload) arms="resident;off;on;on:budget=4"; ctx=32k,255k; extra=(--slots 1650) ;;
esac
/usr/bin/time -v python3 -m ftchat.cli bench --synthetic flash-next --layers 48 \
  --arms "$arms" --context "$ctx" --steps 16 --rounds 3 "${extra[@]}" --json \
  > "$O/bench48_$1.json" 2> "$O/bench48_$1.err"
echo "bench48 $1 rc=$?"; tail -3 "$O/bench48_$1.err"
python3 - "$O/bench48_$1.json" <<'PY'
import json, sys
res = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
for ctx, arms in res.items():
    for name, v in arms.items():
        print(f"{ctx:>7} {name:<22} {v['tok_s']:8.1f} tok/s  {v['ms_per_layer']*1e3:7.1f} us/layer  "
              f"kernels/layer {v['kernels_per_layer']:.1f}  busy {v['busy_us_per_layer']:.1f} us/layer  "
              f"misses/tok {v['misses_per_token']:.1f}  setup {v['setup_s']:.1f} s")
        if ctx == list(res)[0]:
            for kname, count, us in v["top_kernels"][:10]:
                print(f"            {us / 48:8.1f} us/layer {count:6d}x  {kname}")
PY
