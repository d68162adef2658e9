#!/usr/bin/env bash
# Session 22's device calls (written without a device; not yet run), from the repository root:
#   run(command="bash benchmarks/device_s22.sh MODE", timeout_s=600)
#   tests    benchmarks/l2_prefetch_probe.py first (does the prefetch land: a reader after a
#            prefetch and an idle gap, on vs off); then the session's switches on the GPU:
#            their identity tests (L2 prefetch and the GDN early state on == off bit for bit,
#            graph and eager, tiny and flash-next x4; the QSA GEMV graph == eager), the sm_90
#            compile tests with the device's Triton, and the test files of every kernel they
#            touched (HC, GEMV incl. [13952, 2560], GDN, QSA, MoE, PDL) and the fused PLE
#            decode's; four shards at once, each under a timeout
#   bench    48 layers resident (DENSE=nvfp4) at CTX (default 4k): `resident` beside the L2
#            prefetch at 8 / 16 / 32 MiB, the GDN state before the wait, the QSA projection
#            through the Triton GEMV, the fused PLE decode, and all four together (ARMS)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
stamp() { while IFS= read -r l; do echo "$(date +%T) $l"; done; }
case $1 in
  tests)
    timeout 180 python3 benchmarks/l2_prefetch_probe.py --out "$O/l2_prefetch_probe.json" 2>&1 \
      | stamp | tee "$O/probe.log"
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_l2_prefetch.py \
      tests/test_ple_decode.py 2>&1 \
      | stamp > "$O/compile.log"; tail -2 "$O/compile.log"
    # the GPU tests in four shards at once: device_s21.sh's runner, with this session's files
    TESTS=${TESTS:-"tests/gpu/test_decode_switches_gpu.py tests/gpu/test_pdl_gpu.py \
      tests/gpu/test_gemv_gpu.py tests/gpu/test_hyper_router_gpu.py tests/gpu/test_gdn_decode_gpu.py \
      tests/gpu/test_qsa_decode_gpu.py tests/gpu/test_moe_fused_gpu.py \
      tests/gpu/test_ple_decode_gpu.py"} TESTS_S=${TESTS_S:-420} bash benchmarks/device_s21.sh tests ;;
  bench)
    CTX=${CTX:-4k} DENSE=nvfp4 \
      ARMS=${ARMS:-"resident;resident:l2pf=8;resident:l2pf=16;resident:l2pf=32;resident:gdnearly=1;resident:qsagemv=1;resident:plefused=1;resident:l2pf=16,gdnearly=1,qsagemv=1,plefused=1"} \
      bash benchmarks/device_bench48.sh resident ;;
esac
