#!/usr/bin/env bash
# Session 9's device calls. Usage: run(command="bash benchmarks/device_s9.sh MODE...", timeout_s=600)
#   probe  Triton / PDL support on the device, and one PDL GEMV in a CUDA graph against eager
#   tier   the GPU test tier in parallel groups (as device_s8.sh tier); logs joined in one file
#   pdl48  the 48-layer resident decode, PDL on vs off, same process (CTX, default 4k,255k)
#   gemv4  the NVFP4 GEMV's tile sweep at bs 1, 2 (the tensor-core tiles included)
#   fixes  the GPU files changed after the tier call (parallel groups; the PLE test also without PDL)
#   moe    the grouped-GEMM prefill experts: bench_moe_prefill.py (old torch path vs the kernels)
#   offload48  decode at 48 layers, 1,650 slots: resident / off / on / on:budget=4 (CTX 32k,255k)
#   prefill48  prefill tok/s at 48 layers, 1,650 slots (CHUNKS, LENGTHS; dense NVFP4)
#   last   the session's last changes: the PLE test, the prefill paths (identity grid, grouped
#          experts, the tiny model's GPU tests), side by side, 150 s
#   e2e    a 261,000-token prompt prefilled and decoded at 48 layers under --vram-budget 15.9
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
L=/tmp/s9logs; mkdir -p $L
T=${TIER_S:-300}
gpu() {  # name, seconds, pytest args... (background)
  local name=$1 secs=$2; shift 2
  ( timeout "$secs" python3 -m pytest -m gpu -q -rf -p no:cacheprovider "$@" > "$L/gpu_$name.log" 2>&1
    echo "gpu $name rc=$?: $(tail -1 "$L/gpu_$name.log")" ) &
}
for mode in "$@"; do
  case $mode in
    probe)
      python3 - <<'PY' 2>&1 | tail -20
import torch, triton
import ftchat.kernels as k
from ftchat.kernels import gemv
print("torch", torch.__version__, "triton", triton.__version__, "HAS_GDC", k.HAS_GDC,
      "cap", torch.cuda.get_device_capability())
x = torch.randn(1, 6144, device="cuda", dtype=torch.bfloat16)
ws = [torch.randn(2560 if i % 2 == 0 else 6144, 6144 if i % 2 == 0 else 2560, device="cuda",
                  dtype=torch.bfloat16) / 50 for i in range(8)]
def chain():
    h = x
    for w in ws:
        h = gemv.linear_triton(h, w)
    return h
with k.pdl_kernels(False):
    ref = chain()
print("pdl args", k.pdl_launch(x))
eager = chain()
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    chain(); torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=s):
        out = chain()
g.replay(); torch.cuda.synchronize()
print("eager pdl == no pdl:", torch.equal(eager, ref), " graph pdl == no pdl:", torch.equal(out, ref))
PY
      ;;
    tier)
      g=tests/gpu
      gpu offload $T $g/test_offload_gpu.py
      gpu qsa $T $g/test_qsa_decode_gpu.py $g/test_qsa_kv_fp8_gpu.py
      gpu gdn_moe $T $g/test_gdn_decode_gpu.py $g/test_moe_fused_gpu.py tests/test_nvfp4.py
      gpu hyper_gemv $T $g/test_hyper_router_gpu.py $g/test_gemv_gpu.py
      gpu topk_emb_verify $T $g/test_qsa_topk_gpu.py $g/test_embedding_gpu.py $g/test_verify_graph_gpu.py
      gpu kernels $T $g/test_kernels_gpu.py $g/test_cache_gpu.py $g/test_cache_kernels_graph_gpu.py \
        $g/test_profile_gpu.py $g/test_synth_memory_gpu.py $g/test_ple_gather_gpu.py
      gpu cache_kernels $T $g/test_cache_kernels_gpu.py
      gpu nvfp4 $T $g/test_nvfp4_gemv_gpu.py $g/test_nvfp4_dequant_gpu.py
      [ -f $g/test_moe_prefill_gpu.py ] && gpu moe_prefill $T $g/test_moe_prefill_gpu.py
      wait
      for f in $L/gpu_*.log; do echo "=== $f"; grep -E "FAILED|Error|passed|failed" "$f" | tail -15; done > "$O/tier.log"
      grep -B2 -A30 "FAILED\|Error" $L/gpu_*.log | head -150 >> "$O/tier.log" ;;
    gemv4)
      timeout ${GEMV_S:-150} python3 benchmarks/bench_gemv.py --arms nvfp4 --bs 1,2 --sweep \
        --out "$O/bench_gemv_nvfp4.json" > "$L/bench_gemv_nvfp4.log" 2>&1
      echo "bench_gemv nvfp4 rc=$?"; grep -v "^ *$" "$L/bench_gemv_nvfp4.log" | cut -c1-220 | tail -40 ;;
    fixes)
      g=tests/gpu
      gpu nvfp4_gemv $T $g/test_nvfp4_gemv_gpu.py
      gpu topk $T $g/test_qsa_topk_gpu.py
      gpu gdn $T $g/test_gdn_decode_gpu.py
      gpu pdl $T $g/test_pdl_gpu.py
      ( timeout 200 python3 -m pytest -m gpu -q -x -vv -p no:cacheprovider $g/test_ple_gather_gpu.py > $L/ple.log 2>&1
        echo "ple rc=$?"; FTCHAT_PDL=0 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider $g/test_ple_gather_gpu.py -k pinned_and_gathered > $L/ple_nopdl.log 2>&1
        echo "ple without PDL rc=$?: $(tail -1 $L/ple_nopdl.log)" ) &
      [ -f $g/test_moe_prefill_gpu.py ] && gpu moe_prefill $T $g/test_moe_prefill_gpu.py
      wait
      for f in $L/gpu_*.log; do echo "=== $f"; grep -E "FAILED|Error|passed|failed" "$f" | tail -15; done > "$O/fixes.log"
      grep -B5 -A25 "FAILED\|Error\|assert" $L/gpu_*.log | head -120 >> "$O/fixes.log"
      grep -B30 -A10 "Error\|assert" $L/ple.log | head -100 >> "$O/fixes.log"; tail -3 $L/ple.log >> "$O/fixes.log" ;;
    last)
      g=tests/gpu
      gpu ple 150 $g/test_ple_gather_gpu.py
      gpu offload 150 $g/test_offload_gpu.py
      gpu moe_prefill 150 $g/test_moe_prefill_gpu.py
      gpu kernels 150 $g/test_kernels_gpu.py $g/test_pdl_gpu.py
      wait
      for f in $L/gpu_*.log; do echo "=== $f"; grep -E "FAILED|Error|passed|failed" "$f" | tail -8; done > "$O/last.log"
      grep -B5 -A25 "FAILED\|Error" $L/gpu_*.log | head -80 >> "$O/last.log" ;;
    moe)
      timeout ${MOE_S:-200} python3 benchmarks/bench_moe_prefill.py ${MOE_ARGS:---sweep} > "$O/bench_moe_prefill.json" 2> "$L/moe.err"
      echo "bench_moe_prefill rc=$?"; tail -20 "$L/moe.err" | cut -c1-200; cut -c1-3000 "$O/bench_moe_prefill.json" ;;
    offload48)
      CTX=${CTX:-32k,255k} DENSE=nvfp4 bash benchmarks/device_bench48.sh offload ;;
    prefill48)
      CHUNKS=${CHUNKS:-8192} LENGTHS=${LENGTHS:-32768} DENSE=nvfp4 timeout ${PREFILL_S:-300} bash benchmarks/device_prefill48.sh ;;
    e2e)
      timeout ${E2E_S:-500} python3 benchmarks/e2e48.py --tokens ${TOKENS:-261000} --budget ${BUDGET:-15.9} \
        --chunk ${CHUNK:-8192} ${SLOTS:+--slots $SLOTS} ${CONTEXT:+--context $CONTEXT} > "$O/e2e48.json" 2> "$L/e2e48.err"
      echo "e2e48 rc=$?"; grep -v "^prefill" "$L/e2e48.err" | tail -15 | cut -c1-300; grep "^prefill" "$L/e2e48.err" | awk 'NR % 8 == 1' | tail -8; tail -2 "$L/e2e48.err"; cat "$O/e2e48.json" ;;
    pdl48)
      CTX=${CTX:-4k,255k} DENSE=nvfp4 ARMS="resident;resident:pdl=0" bash benchmarks/device_bench48.sh resident ;;
  esac
done
