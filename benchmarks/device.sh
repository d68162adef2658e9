#!/usr/bin/env bash
# The device machine's one entry point: the GPU tests and the figures docs/performance.md and
# docs/reliability.md cite. Each mode writes $OUT/NAME.json (OUT defaults to /tmp/out) and its
# log, then prints a short summary. From the repository root:
#
#   run(command="bash benchmarks/device.sh MODE[,MODE...] [FILES...]", timeout_s=600)
#
# Modes (settings are environment variables, default after '='):
#   gpu-tests [FILES]  `pytest -m gpu` over FILES (default tests/gpu): the collected tests dealt
#              round robin to SHARDS=4 processes at once, each under TESTS_S=540 s; per shard
#              passed / failed / errors / skipped / not run, then the failures
#              -> gpu_tests.json, gpu_tests_shard<i>.log
#   decode48   decode tok/s at 48 layers, every expert resident: `ftchat bench` on the
#              flash-next model built in memory (random weights, NVFP4 experts, GDN qkv / z in
#              NVFP4), arms side by side in one process [ARMS='resident;resident:fused=0',
#              CTX=4k,32k, STEPS=16, ROUNDS=3, DECODE_S=540] -> decode48_resident.json
#   offload48  the same offloaded at SLOTS=1650 [ARMS='resident;off;on;on:budget=4',
#              CTX=32k,255k, ROUTING=model (or calibrated[:FIT], trace:FILE: bench --routing)]
#              -> decode48_offload.json
#   offload-demo  the same on the trained demo model (8 layers, 64 experts top-8) offloaded at
#              SLOTS=96, its own routing and a trace recorded from it, one process each
#              [ARMS='resident;off;on:budget=1;on:budget=auto', CTX=3k, DEMO_ROUTING=model,
#              trace:docs/results/routing_trace_demo_with_logits.jsonl (it carries the router
#              logits: eviction score replays it)] -> offload_demo_<source>.json
#   prefill48  prompt prefill tok/s at 48 layers, offloaded at 1,650 slots (staging, layer
#              streaming) and resident: benchmarks/profile_prefill.py [LENGTHS=32768 (a comma
#              list: one process each), CHUNKS=8192, PREFILL_ARMS=offload,resident,
#              PREFILL_S=540] -> prefill48_<tokens>.json
#   families   each family preset at its real geometry (random weights, NVFP4 experts, bf16
#              dense), [FAMILIES=qwen3.5-moe:5783,qwen3-moe:3467,qwen3-next:5573, each PRESET:SLOTS
#              with SLOTS the 16 GiB plan's at 32K (`ftchat info --synthetic PRESET --vram 16
#              --context 32k`)]: `ftchat bench --synthetic PRESET` resident and offloaded at SLOTS
#              [FAMILY_ARMS='off;on;on:budget=4', CTX=4k; the resident arm in its own process:
#              every expert and the offloaded arms' banks do not fit one card beside each other],
#              then profile_prefill.py --preset PRESET [FAMILY_TOKENS=32768, CHUNKS=8192]
#              -> family_<preset>_{resident,offload}.json, family_<preset>_prefill.json
#   e2e48      one long prompt end to end at 48 layers under --vram-budget, as `ftchat run`
#              runs it (the 16 GB configuration): benchmarks/e2e48.py [E2E_TOKENS=261000,
#              BUDGET=15.9, E2E_CHUNK=3072, SLOTS=1650, E2E_S=540] -> e2e48.json
#   verify     `ftchat verify` prefetch on vs off, eager and CUDA-graph replay, audit every 64,
#              budget 4: one process per prompt seed, WORKERS at once [MODEL=demo (or fn4: the
#              4-layer flash-next checkpoint, written by `ftchat synth` first; or a folder),
#              SEEDS=0 (e.g. 0-34 or 0,3,5), WORKERS=1, MPS=0 (1: an MPS daemon for the
#              workers, stopped after), PROMPTS=6, TOKENS=256, SLOTS (demo 96, fn4 137),
#              BATCH (prompts decoded together, verify --batch; empty: verify's auto),
#              VERIFY_S=560 a process] -> verify_<model>.json (totals and every shard)
#   agent-soak `ftchat serve` on the demo model (--parallel PARALLEL=4), then scripts/agent_soak.py
#              (the openai package) against it for MINUTES=2 once per SIDES=0,1,3 side calls
#              fired beside each main turn, one JSON line every INTERVAL=30 s; runs longer than
#              a call (SOAK_FG_S=540 s) start detached, and `agent-soak-wait` [WAIT_S=540]
#              collects them in a later call -> agent_soak_demo.jsonl, agent_soak_serve.log
#   serve-latency  `ftchat serve` on MODEL=demo (SLOTS=96, HISTORY=3500) or fn4 (the 4-layer
#              flash-next checkpoint, SLOTS=137, CONTEXT=40960, HISTORY=4000,32000), then
#              benchmarks/serve_latency.py: a second turn's time to first token reused vs cold,
#              main-turn decode beside SIDES=0,1,3 side calls [TOKENS=256, REPS=3,
#              PARALLEL=4] -> serve_latency_<model>.json, its log and the server's
#   soak       scripts/soak.py on the demo model, prefetch on, budget 4, 96 slots [MINUTES=15];
#              one that cannot finish within the call starts detached, and `soak-wait`
#              [WAIT_S=540] collects it in a later call -> soak_demo.jsonl
# BASE=DIR (decode48, offload48, offload-demo): each bench again from the tree in DIR, in its own
#              process right after: `bash benchmarks/export_base.sh REV DIR` writes it, run's
#              carry takes it along -> NAME_base.json beside NAME.json
# NAME renames the output of a one-output mode (e.g. NAME=decode48_skip ARMS=... decode48).
# Every step runs under a timeout; a failed step is named and the next one runs.
# Exit status: 0 all passed, 1 a step failed, 2 usage, 3 a detached soak is still running.
set -u
# a caller's PYTHONPATH after the tree: packages the device lacks, carried (serve, openai)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
W=/tmp/ftchat_device  # scratch: shard lists, per-process outputs (not returned)
MODES="gpu-tests decode48 offload48 offload-demo prefill48 families e2e48 verify soak soak-wait"
MODES+=" agent-soak agent-soak-wait serve-latency"
FAILED=()
PENDING=0

usage() {
  echo "usage: bash benchmarks/device.sh MODE[,MODE...] [FILES...]   MODE: ${MODES// / | }" >&2
  echo "       (settings as environment variables: see the comment at the top of $0)" >&2
  exit 2
}

# run_step NAME SECONDS STDOUT STDERR CMD...: CMD under a timeout; a failure is recorded
run_step() {
  local name=$1 secs=$2 out=$3 err=$4 rc t0=$SECONDS
  shift 4
  timeout --kill-after=20 "$secs" "$@" > "$out" 2> "$err"
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "[$name] ok in $((SECONDS - t0)) s"
  else
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      echo "[$name] timed out after $secs s"
    else
      echo "[$name] failed: exit $rc after $((SECONDS - t0)) s"
    fi
    FAILED+=("$name")
    tail -n 15 "$err" | cut -c1-300 | sed 's/^/    /'
  fi
  return $rc
}

# summarize KIND FILE...: reads the files a mode wrote and prints its summary (reads only)
summarize() {
  python3 - "$@" <<'PY'
import json, sys

kind, files = sys.argv[1], sys.argv[2:]


def last_json(path):
    with open(path) as f:
        lines = [l for l in f.read().splitlines() if l.strip()]
    return json.loads(lines[-1])


def f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


if kind == "bench":  # ftchat bench --json: {context: {arm: figures}}
    res = last_json(files[0])
    layers = int(files[1])
    print(f"{'context':>8} {'arm':<26} {'tok/s':>8} {'us/layer':>9} {'kern/layer':>10} "
          f"{'busy us/l':>9} {'misses/tok':>10} {'installs/tok':>12} {'precision':>9} {'setup s':>7}")
    for i, (ctx, arms) in enumerate(res.items()):
        for name, v in arms.items():
            g = v.get
            print(f"{ctx:>8} {name:<26} {f(g('tok_s')):>8} {f(g('ms_per_layer', 0) * 1e3):>9} "
                  f"{f(g('kernels_per_layer')):>10} {f(g('busy_us_per_layer')):>9} "
                  f"{f(g('misses_per_token')):>10} {f(g('prefetch_installs_per_token')):>12} "
                  f"{f(g('precision'), '{:.2f}'):>9} {f(g('setup_s')):>7}")
        peak = next(iter(arms.values()))
        print(f"{'':>8} VRAM peak reserved {f(peak.get('vram_peak_reserved_mib'), '{:,.0f}')} MiB")
    ctx, arms = next(iter(res.items()))
    name, v = next(iter(arms.items()))
    if v.get("top_kernels"):
        print(f"top kernels of {name} at {ctx} (us a layer, launches a step):")
        for kname, count, us in v["top_kernels"][:10]:
            print(f"  {us / layers:8.1f} {count:6d}x  {kname[:90]}")

elif kind == "e2e":  # benchmarks/e2e48.py: one JSON line
    r = last_json(files[0])
    print(f"{r['tokens']} tokens, {r['layers']} layers, {r['slots']} slots, budget "
          f"{r['budget_gib']} GiB, chunk {r['chunk']}: prefill {r.get('prefill_s')} s = "
          f"{r.get('prefill_tok_s')} tok/s; decode {r.get('decode_tok_s')} tok/s over "
          f"{r.get('decoded')} tokens")
    print("peaks:", {k: v for k, v in r.items() if k.startswith("vram_")})
    for g, v in (r.get("per_item_mib") or {}).items():
        print(f"  {g:<52} planned {v['planned']:>9} MiB, measured {v['measured']} MiB")

elif kind == "prefill":  # benchmarks/profile_prefill.py --out
    for path in files:
        r = json.load(open(path))
        print(f"{r['tokens']} tokens, {r['layers']} layers (model built in {r['build_s']} s):")
        for name, v in r["runs"].items():
            print(f"  {name:<24} {v['tok_s']:10.1f} tok/s  {v['ms_per_chunk_layer']:8.2f} ms a "
                  f"chunk-layer  copied {v['copy_gb']:8.2f} GB (link alone "
                  f"{v['link_ms_per_chunk_layer']:.2f} ms a chunk-layer)")

elif kind == "verify":  # shard JSONs -> one file with totals; argv: out, tag, tree, shard files
    out, tag, tree, shard_files = files[0], files[1], files[2], files[3:]
    keys = ("prompts", "mismatches", "graph_mismatches", "graph_prefetch_mismatches",
            "verifier_records", "audits", "bad_slots")
    shards, lost = [], {}
    for path in shard_files:
        seed = path.rsplit("seed", 1)[1].split(".")[0]
        try:
            shards.append(last_json(path))
        except (OSError, ValueError, IndexError):
            lost[seed] = "no JSON (see the log)"
    total = {k: sum(s.get(k) or 0 for s in shards) for k in keys}
    secs = {}
    for s in shards:
        for p in s.get("per_prompt", []):
            for arm, t in (p.get("seconds") or {}).items():
                secs.setdefault(arm, []).append(t)
    total["mean_seconds_per_prompt"] = {a: round(sum(t) / len(t), 2) for a, t in secs.items()}
    total.update(shards=len(shards), prompt_seeds=sorted(s.get("prompt_seed") for s in shards),
                 batch=sorted({s.get("batch") or 1 for s in shards}),  # rows decoded together
                 tree=tree, model=tag)
    if lost:
        total["lost_shards"] = lost
    json.dump({"total": total, "shards": shards}, open(out, "w"))
    print(f"verify {tag}: " + ", ".join(f"{k} {v}" for k, v in total.items()
                                        if k not in ("prompt_seeds",)))

elif kind == "soak":  # scripts/soak.py JSON lines
    rows = [json.loads(l) for l in open(files[0]) if l.strip()]
    iv = [r for r in rows if r.get("kind") == "interval"]
    if iv:
        print(f"soak: {len(iv)} intervals, tok/s {min(r['tok_s'] for r in iv)}-"
              f"{max(r['tok_s'] for r in iv)}, worst gap {max(r['worst_gap_ms'] for r in iv)} ms, "
              f"RSS {min(r['rss'] for r in iv) / 2**20:.0f}-{max(r['rss'] for r in iv) / 2**20:.0f}"
              f" MiB, VRAM reserved {max(r['vram_reserved'] for r in iv) / 2**20:.0f} MiB")
    for r in rows:
        if r.get("kind") != "interval":
            print("soak", json.dumps(r)[:400])

elif kind == "gpu-tests":  # argv: out json, then per shard: log, rc file, ids file
    import re
    out, rest = files[0], files[1:]
    line = re.compile(r"^(\S+::.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")  # ids may hold spaces
    shards, failures = [], []
    for i in range(0, len(rest), 3):
        log, rc_file, ids = rest[i : i + 3]
        counts = dict.fromkeys(("passed", "failed", "errors", "skipped", "xfail", "xpass"), 0)
        seen = set()
        for l in open(log, errors="replace"):
            m = line.match(l)
            if not m:
                continue
            word = {"ERROR": "errors"}.get(m[2], m[2].lower())
            counts[word] += 1
            seen.add(m[1])
            if m[2] in ("FAILED", "ERROR"):
                failures.append(f"{m[1]} {m[2]}")
        assigned = sum(1 for l in open(ids) if l.strip())
        rc = int(open(rc_file).read().strip() or -1)
        shards.append({"shard": i // 3, "rc": rc, "timed_out": rc in (124, 137),
                       "assigned": assigned, "not_run": assigned - len(seen), **counts})
        print(f"shard {i // 3}: rc {rc}{' (timed out)' if rc in (124, 137) else ''}, "
              + ", ".join(f"{k} {v}" for k, v in counts.items() if v or k in ("passed", "failed"))
              + f", not run {assigned - len(seen)} of {assigned}")
    total = {k: sum(s[k] for s in shards) for k in ("assigned", "passed", "failed", "errors",
                                                    "skipped", "not_run")}
    json.dump({"total": total, "shards": shards, "failures": failures}, open(out, "w"), indent=1)
    print("total: " + ", ".join(f"{k} {v}" for k, v in total.items()))
    for x in failures[:40]:
        print("  " + x)
PY
}

device_info() {  # what ran where: $OUT/device.txt
  {
    date -u +%FT%TZ
    echo "tree $TREE"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
    python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  } > "$O/device.txt"
  cat "$O/device.txt"
}

gpu_tests() {  # FILES...
  local files=("$@") n=${SHARDS:-4} secs=${TESTS_S:-540} s count ids=()
  [ ${#files[@]} -eq 0 ] && files=(tests/gpu)
  mkdir -p "$W/gpu_tests" && rm -f "$W"/gpu_tests/*
  python3 -m pytest -o addopts= -p no:cacheprovider -m gpu --collect-only -q "${files[@]}" \
    > "$O/gpu_tests_collect.log" 2>&1 || { echo "[gpu-tests] collection failed:"; FAILED+=(gpu-tests-collect)
      grep -E "^(ERROR|E )" "$O/gpu_tests_collect.log" | head -20 | sed 's/^/    /'; }
  grep '::' "$O/gpu_tests_collect.log" > "$W/gpu_tests/ids.txt"
  count=$(wc -l < "$W/gpu_tests/ids.txt")
  [ "$count" -gt 0 ] || { echo "[gpu-tests] no test collected"; FAILED+=(gpu-tests); return; }
  [ "$n" -le "$count" ] || n=$count  # no empty shard: pytest without ids would run everything
  echo "[gpu-tests] $count tests in ${files[*]}, $n shards, $secs s each"
  for ((s = 0; s < n; s++)); do
    awk -v s=$s -v n=$n 'NR % n == s' "$W/gpu_tests/ids.txt" > "$W/gpu_tests/ids_$s.txt"
    (
      mapfile -t ids < "$W/gpu_tests/ids_$s.txt"
      timeout --kill-after=20 "$secs" python3 -m pytest -o addopts= -p no:cacheprovider -m gpu \
        -v -rfE --tb=short "${ids[@]}" > "$O/gpu_tests_shard$s.log" 2>&1
      echo $? > "$W/gpu_tests/rc_$s"
    ) &
  done
  wait
  local args=()
  for ((s = 0; s < n; s++)); do
    args+=("$O/gpu_tests_shard$s.log" "$W/gpu_tests/rc_$s" "$W/gpu_tests/ids_$s.txt")
    [ "$(cat "$W/gpu_tests/rc_$s")" = 0 ] || FAILED+=("gpu-tests shard $s")
  done
  summarize gpu-tests "$O/gpu_tests.json" "${args[@]}"
}

bench_run() {  # NAME LAYERS BENCH-ARGS...: `ftchat bench` -> $O/NAME.json; with BASE=DIR (a
  # tree written by benchmarks/export_base.sh and carried) the same bench again from DIR's code,
  # right after in its own process -> $O/NAME_base.json: the before and after of a code change
  local name=$1 layers=$2
  shift 2
  run_step "$name" "${DECODE_S:-540}" "$O/$name.json" "$O/$name.log" \
    python3 -m ftchat.cli bench "$@" && summarize bench "$O/$name.json" "$layers"
  [ -n "${BASE:-}" ] || return 0
  run_step "${name}_base" "${DECODE_S:-540}" "$O/${name}_base.json" "$O/${name}_base.log" \
    env -C "$BASE" python3 -m ftchat.cli bench "$@" \
    && summarize bench "$O/${name}_base.json" "$layers"
}

bench48() {  # NAME ARMS CTX [more bench flags]
  local name=${NAME:-$1} arms=$2 ctx=$3
  shift 3
  bench_run "$name" 48 --synthetic flash-next --layers 48 --dense nvfp4 --json \
    --arms "$arms" --context "$ctx" --steps "${STEPS:-16}" --rounds "${ROUNDS:-3}" "$@"
}

offload_demo() {  # the demo model's cells: its routers, then its recorded trace
  local src tag
  local list=${DEMO_ROUTING:-model,trace:$PWD/docs/results/routing_trace_demo_with_logits.jsonl}
  for src in ${list//,/ }; do
    tag=${src%%:*}
    bench_run "offload_demo_$tag" 8 --json --slots "${SLOTS:-96}" \
      --arms "${ARMS:-resident;off;on:budget=1;on:budget=auto}" --context "${CTX:-3k}" \
      --steps "${STEPS:-32}" --rounds "${ROUNDS:-3}" --routing "$src"
  done
}

prefill48() {
  local t lengths=${LENGTHS:-32768} outs=()
  for t in ${lengths//,/ }; do
    run_step "prefill48_$t" "${PREFILL_S:-540}" "$O/prefill48_$t.log" "$O/prefill48_$t.err" \
      python3 benchmarks/profile_prefill.py --layers 48 --tokens "$t" --chunk "${CHUNKS:-8192}" \
      --slots "${SLOTS:-1650}" --dense nvfp4 --arms "${PREFILL_ARMS:-offload,resident}" \
      --out "$O/prefill48_$t.json" && outs+=("$O/prefill48_$t.json")
  done
  [ ${#outs[@]} -gt 0 ] && summarize prefill "${outs[@]}"
}

families() {
  local item preset slots name layers
  local list=${FAMILIES:-qwen3.5-moe:5783,qwen3-moe:3467,qwen3-next:5573}
  for item in ${list//,/ }; do
    preset=${item%%:*} slots=${item#*:}
    name=family_${preset}
    layers=$(python3 -c "from ftchat.vram.workloads import synthetic_inputs as s
print(s('$preset', None, 'nvfp4-modelopt')[0].num_hidden_layers)") || layers=1
    run_step "${name}_resident" "${DECODE_S:-300}" "$O/${name}_resident.json" \
      "$O/${name}_resident.log" python3 -m ftchat.cli bench --synthetic "$preset" --json \
      --arms resident --context "${CTX:-4k}" --steps "${STEPS:-16}" --rounds "${ROUNDS:-3}" \
      && summarize bench "$O/${name}_resident.json" "$layers"
    run_step "${name}_offload" "${DECODE_S:-300}" "$O/${name}_offload.json" \
      "$O/${name}_offload.log" python3 -m ftchat.cli bench --synthetic "$preset" --json \
      --arms "${FAMILY_ARMS:-off;on;on:budget=4}" --slots "$slots" --context "${CTX:-4k}" \
      --steps "${STEPS:-16}" --rounds "${ROUNDS:-3}" \
      && summarize bench "$O/${name}_offload.json" "$layers"
    run_step "${name}_prefill" "${PREFILL_S:-300}" "$O/${name}_prefill.log" \
      "$O/${name}_prefill.err" python3 benchmarks/profile_prefill.py --preset "$preset" \
      --tokens "${FAMILY_TOKENS:-32768}" --chunk "${CHUNKS:-8192}" --slots "$slots" \
      --arms offload,resident --no-profile --out "$O/${name}_prefill.json" \
      && summarize prefill "$O/${name}_prefill.json"
  done
}

e2e48() {
  local name=${NAME:-e2e48} t=${E2E_TOKENS:-261000}
  run_step "$name" "${E2E_S:-540}" "$O/$name.json" "$O/$name.log" \
    python3 benchmarks/e2e48.py --tokens "$t" --context $((t + 120)) --budget "${BUDGET:-15.9}" \
    --chunk "${E2E_CHUNK:-3072}" --slots "${SLOTS:-1650}" && summarize e2e "$O/$name.json"
}

seeds_of() {  # "0-3,7" -> 0 1 2 3 7
  local part
  for part in ${1//,/ }; do
    [[ $part =~ ^[0-9]+(-[0-9]+)?$ ]] || { echo "SEEDS: $part is not N or N-M" >&2; return 2; }
    if [[ $part == *-* ]]; then seq "${part%-*}" "${part#*-}"; else echo "$part"; fi
  done
}

synth_fn4() {  # the 4-layer flash-next checkpoint at /tmp/fn4, written once a machine
  [ -f /tmp/fn4/config.json ] && return
  rm -rf /tmp/fn4
  run_step synth-fn4 300 "$O/synth_fn4.log" "$O/synth_fn4.log.err" python3 -m ftchat.cli \
    synth /tmp/fn4 --preset flash-next --layers 4 --format nvfp4-modelopt --dense nvfp4
}

verify() {
  local tag=${MODEL:-demo} model=() slots seeds seed files=() mps=0 batch=()
  case $tag in
    demo) slots=${SLOTS:-96} ;;
    fn4) slots=${SLOTS:-137} model=(/tmp/fn4); synth_fn4 || return ;;
    *)
      [ -n "${SLOTS:-}" ] || { echo "[verify] MODEL=$tag needs SLOTS" >&2; FAILED+=(verify); return; }
      slots=$SLOTS model=("$tag") tag=$(basename "$tag") ;;
  esac
  seeds=$(seeds_of "${SEEDS:-0}") || { FAILED+=(verify); return; }
  [ -n "${BATCH:-}" ] && batch=(--batch "$BATCH")
  mkdir -p "$W/verify" && rm -f "$W/verify/${tag}"_*
  if [ "${MPS:-0}" = 1 ]; then
    export CUDA_MPS_PIPE_DIRECTORY=$W/mps_pipe CUDA_MPS_LOG_DIRECTORY=$W/mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then mps=1; echo "[verify] MPS on"
    else unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; echo "[verify] MPS did not start"; fi
  fi
  echo "[verify] $tag: seeds $(echo $seeds), ${WORKERS:-1} at once, ${PROMPTS:-6} prompts x ${TOKENS:-256} tokens, $slots slots, batch ${BATCH:-auto}"
  for seed in $seeds; do
    while [ "$(jobs -rp | wc -l)" -ge "${WORKERS:-1}" ]; do wait -n; done
    files+=("$W/verify/${tag}_seed$seed.json")
    (
      t0=$SECONDS
      OMP_NUM_THREADS=2 timeout --kill-after=20 "${VERIFY_S:-560}" python3 -m ftchat.cli verify \
        "${model[@]}" --prompts "${PROMPTS:-6}" --max-new-tokens "${TOKENS:-256}" --budget 4 \
        --audit-every 64 --slots "$slots" --graph --prompt-seed "$seed" "${batch[@]}" --json \
        > "$W/verify/${tag}_seed$seed.json" 2> "$W/verify/${tag}_seed$seed.err"
      echo "seed $seed: exit $? in $((SECONDS - t0)) s" >> "$W/verify/${tag}_done.log"
    ) &
  done
  wait
  [ $mps = 1 ] && echo quit | nvidia-cuda-mps-control
  for seed in $seeds; do  # one log: each process's exit and the tail of its stderr
    grep "^seed $seed:" "$W/verify/${tag}_done.log"
    tail -n 5 "$W/verify/${tag}_seed$seed.err" | sed 's/^/    /'
  done > "$O/verify_$tag.log"
  grep -v "exit 0 " "$W/verify/${tag}_done.log" | sed 's/^/[verify] /'
  grep -q -v "exit 0 " "$W/verify/${tag}_done.log" && FAILED+=("verify $tag")
  summarize verify "$O/verify_$tag.json" "$tag" "$TREE" "${files[@]}"
}

soak_collect() {  # the soak's JSON lines and log into $OUT, its exit status recorded
  local dir=$W/soak
  cp "$dir/soak.jsonl" "$O/soak_demo.jsonl" 2> /dev/null
  cp "$dir/soak.log" "$O/soak_demo.log" 2> /dev/null
  [ -s "$O/soak_demo.jsonl" ] && summarize soak "$O/soak_demo.jsonl"
  if [ ! -f "$dir/rc" ]; then
    echo "[soak] still running: collect it with soak-wait"; PENDING=1
  elif [ "$(cat "$dir/rc")" != 0 ]; then
    echo "[soak] failed: exit $(cat "$dir/rc")"; tail -n 5 "$dir/soak.log"; FAILED+=(soak)
  else
    echo "[soak] passed"
  fi
}

soak() {
  local dir=$W/soak minutes=${MINUTES:-15} secs
  secs=$(awk -v m="$minutes" 'BEGIN { print int(m * 60 + 0.999) }')
  if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2> /dev/null; then
    echo "[soak] one is running already (pid $(cat "$dir/pid")): soak-wait collects it"
    PENDING=1; return
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  local cmd=(python3 scripts/soak.py --minutes "$minutes" --prefetch on --budget 4
             --slots "${SLOTS:-96}" --out "$dir/soak.jsonl")
  if [ $((secs + 90)) -le "${SOAK_FG_S:-540}" ]; then  # it fits in this call
    timeout --kill-after=20 $((secs + 120)) "${cmd[@]}" > "$dir/soak.log" 2>&1
    echo $? > "$dir/rc"
    soak_collect
  else  # its own session, so it outlives this call while the machine stays held
    setsid nohup bash -c '"$@" > "$0/soak.log" 2>&1; echo $? > "$0/rc"' "$dir" "${cmd[@]}" \
      < /dev/null > /dev/null 2>&1 &
    echo $! > "$dir/pid"
    echo "[soak] started detached (pid $!, $minutes min): run soak-wait before the machine idles out"
    PENDING=1
  fi
}

soak_wait() {
  local dir=$W/soak end=$((SECONDS + ${WAIT_S:-540}))
  [ -d "$dir" ] || { echo "[soak-wait] no soak was started on this machine"; FAILED+=(soak); return; }
  while [ ! -f "$dir/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
  soak_collect
}

# start_serve LOG ARGS...: `ftchat serve` in the background on $PORT; SERVE_PID once /health
# answers 200 (the model loaded, within LOAD_S=240 s), else a message and status 1
start_serve() {
  local log=$1 i up=0
  shift
  python3 -m ftchat.cli serve --port "${PORT:-8089}" "$@" > /dev/null 2> "$log" &
  SERVE_PID=$!
  for ((i = 0; i < 2 * ${LOAD_S:-240}; i++)); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:${PORT:-8089}/health', timeout=2)" \
      2> /dev/null && { up=1; break; }
    kill -0 $SERVE_PID 2> /dev/null || break
    sleep 0.5
  done
  [ $up = 1 ] && return 0
  echo "[serve] the server did not come up:"; tail -n 5 "$log" | sed 's/^/    /'
  kill $SERVE_PID 2> /dev/null; wait $SERVE_PID 2> /dev/null
  return 1
}

stop_serve() {  # NAME: SIGINT, as a user's Ctrl-C; a non-zero exit is a failure of NAME
  local rc
  kill -INT $SERVE_PID 2> /dev/null; wait $SERVE_PID
  rc=$?
  echo "[$1] serve exit $rc"
  [ $rc = 0 ] || FAILED+=("$1 serve")
}

agent_soak() {  # ftchat serve on the demo model, scripts/agent_soak.py against it once per SIDES
  local dir=$W/agent_soak sides=${SIDES:-0,1,3} side secs runs bg=$W/agent_soak_bg
  local url=http://127.0.0.1:${PORT:-8089}/v1 out=$O/agent_soak_demo.jsonl
  secs=$(awk -v m="${MINUTES:-2}" 'BEGIN { print int(m * 60 + 60) }')
  runs=$(echo "${sides//,/ }" | wc -w)
  if [ "${AGENT_DETACHED:-0}" = 0 ] && [ $((secs * runs + 120)) -gt "${SOAK_FG_S:-540}" ]; then
    # longer than a call: this script again in its own session, from a copy (the next call
    # rewrites the tree, and bash reads a script as it runs), collected by agent-soak-wait
    if [ -f "$bg/pid" ] && kill -0 "$(cat "$bg/pid")" 2> /dev/null; then
      echo "[agent-soak] one is running already: agent-soak-wait collects it"; PENDING=1; return
    fi
    rm -rf "$bg" && mkdir -p "$bg/out" && cp "$0" "$bg/device.sh"
    setsid nohup env AGENT_DETACHED=1 OUT="$bg/out" TREE="$TREE" bash -c \
      'bash "$0/device.sh" agent-soak > "$0/device.log" 2>&1; echo $? > "$0/rc"' "$bg" \
      < /dev/null > /dev/null 2>&1 &
    echo $! > "$bg/pid"
    echo "[agent-soak] started detached ($runs x ${MINUTES:-2} min): run agent-soak-wait before the machine idles out"
    PENDING=1; return
  fi
  rm -rf "$dir" && mkdir -p "$dir" && rm -f "$out"
  start_serve "$O/agent_soak_serve.log" --parallel "${PARALLEL:-4}" \
    || { FAILED+=(agent-soak); return; }
  for side in ${sides//,/ }; do
    run_step "agent-soak side $side" "$secs" "$dir/side$side.out" "$dir/side$side.err" \
      python3 scripts/agent_soak.py --url "$url" --minutes "${MINUTES:-2}" --side "$side" \
      --server-pid $SERVE_PID --interval "${INTERVAL:-30}" --out "$out" \
      && tail -n 1 "$dir/side$side.out"
  done
  stop_serve agent-soak
}

agent_soak_wait() {
  local bg=$W/agent_soak_bg end=$((SECONDS + ${WAIT_S:-540}))
  [ -d "$bg" ] || { echo "[agent-soak-wait] none was started on this machine"; FAILED+=(agent-soak); return; }
  while [ ! -f "$bg/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
  cp "$bg"/out/agent_soak_* "$O/" 2> /dev/null
  tail -n 3 "$O/agent_soak_demo.jsonl" 2> /dev/null | cut -c1-400
  if [ ! -f "$bg/rc" ]; then
    echo "[agent-soak-wait] still running: call agent-soak-wait again"; PENDING=1
  else
    grep -v '^tree\|^20' "$bg/device.log" | tail -n 12
    [ "$(cat "$bg/rc")" = 0 ] || FAILED+=(agent-soak)
  fi
}

serve_latency() {  # ftchat serve on MODEL (demo or fn4), benchmarks/serve_latency.py against it
  local tag=${MODEL:-demo} args=() history name
  case $tag in
    demo) args=(--slots "${SLOTS:-96}"); history=${HISTORY:-3500} ;;
    fn4) synth_fn4 || return
         args=(/tmp/fn4 --slots "${SLOTS:-137}" --context "${CONTEXT:-40960}")
         history=${HISTORY:-4000,32000} ;;
    *) echo "[serve-latency] MODEL is demo or fn4" >&2; FAILED+=(serve-latency); return ;;
  esac
  name=serve_latency_$tag
  start_serve "$O/${name}_serve.log" "${args[@]}" --parallel "${PARALLEL:-4}" \
    || { FAILED+=("$name"); return; }
  run_step "$name" "${LATENCY_S:-400}" "$O/$name.json" "$O/$name.log" \
    python3 benchmarks/serve_latency.py --url "http://127.0.0.1:${PORT:-8089}/v1" \
    --history "$history" --sides "${SIDES:-0,1,3}" --main-tokens "${TOKENS:-256}" \
    --reps "${REPS:-3}" && cat "$O/$name.log"
  stop_serve "$name"
}

[ $# -ge 1 ] || usage
mode_list=${1//,/ }
shift
for m in $mode_list; do [[ " $MODES " == *" $m "* ]] || usage; done
mkdir -p "$O" "$W"
# the device's copy carries this tree's files over an older checkout's .git: a commit id alone
# would name that checkout, so a tree with changes says so
TREE=${TREE:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)$(git diff --quiet HEAD 2> /dev/null || echo "+changes")}
device_info
for m in $mode_list; do
  echo "=== $m"
  case $m in
    gpu-tests) gpu_tests "$@" ;;
    decode48) bench48 decode48_resident "${ARMS:-resident;resident:fused=0}" "${CTX:-4k,32k}" ;;
    offload48) bench48 decode48_offload "${ARMS:-resident;off;on;on:budget=4}" "${CTX:-32k,255k}" \
                 --slots "${SLOTS:-1650}" --routing "${ROUTING:-model}" ;;
    offload-demo) offload_demo ;;
    prefill48) prefill48 ;;
    families) families ;;
    e2e48) e2e48 ;;
    verify) verify ;;
    soak) soak ;;
    soak-wait) soak_wait ;;
    agent-soak) agent_soak ;;
    agent-soak-wait) agent_soak_wait ;;
    serve-latency) serve_latency ;;
  esac
done
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED: ${FAILED[*]}"
  exit 1
fi
[ $PENDING = 1 ] && exit 3
echo "all passed"
