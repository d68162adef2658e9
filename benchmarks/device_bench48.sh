#!/usr/bin/env bash
# The 48-layer decode figures (docs/performance.md): a flash-next-geometry model built in memory
# (random weights, NVFP4 experts: ~68 GB of rows in host memory), arms side by side per context.
#   run(command="bash benchmarks/device_bench48.sh resident|offload", timeout_s=600)
# env: CTX (resident contexts), ARMS (the arms; default per mode), DENSE=nvfp4 (the GDN qkv / z kept in NVFP4, as the real
# checkpoint stores them; default bf16)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
case ${1:-resident} in
  resident) arms=${ARMS:-"resident;resident:fused=0"}; ctx=${CTX:-4k,32k,128k,255k}; extra=() ;;
  offload) arms=${ARMS:-"resident;off;on;on:budget=4"}; ctx=${CTX:-32k,255k}; extra=(--slots 1650) ;;
esac
python3 -m ftchat.cli bench --help > "$O/bench_help.txt" 2>&1
# the bench command's own function, called directly (the same code `ftchat bench` runs)
/usr/bin/time -v python3 - "$arms" "$ctx" "${extra[@]}" > "$O/bench48_$1.json" 2> "$O/bench48_$1.err" <<'PY'
import os, sys
from ftchat.settings import resolve_settings
from ftchat.ui.debug import Synthetic, bench
arms, ctx, *rest = sys.argv[1:]
flags = {"slots": int(rest[1])} if rest else {}
s = resolve_settings(flags, os.environ)
sys.exit(bench(None, s, os.environ, arms, ctx, 16, 3, True,
               synthetic=Synthetic("flash-next", 48, "nvfp4-modelopt",
                                   os.environ.get("DENSE", "bf16"))))
PY
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
