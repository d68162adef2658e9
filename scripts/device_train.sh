#!/usr/bin/env bash
# Train the demo model on the GPU machine over two device calls (docs/training.md):
#   run(command="bash scripts/device_train.sh start", carry=[".corpus", ".whl"], timeout_s=600)
#   run(command="bash scripts/device_train.sh collect", timeout_s=600)   # within the 30 s idle
# `start` launches scripts/train_demo.py in its own session (setsid), so it outlives the call
# that started it; other GPU work may follow `start` in the same command (it shares the GPU).
# `collect` waits for it, then returns the log, the shards (<= 14 MiB each) and meta.tar.
set -u
MINUTES=${MINUTES:-11}  # pretraining wall clock; data, fine-tuning, export and checks add ~3 min
case "${1:-}" in
start)
  # a private copy: a later call re-syncs the working tree under the running job
  rm -rf /tmp/ftchat-train /tmp/demo && cp -r "$PWD" /tmp/ftchat-train || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  cd /tmp/ftchat-train || exit 1
  PYTHONPATH=/tmp/site:/tmp/ftchat-train PYTHONUNBUFFERED=1 setsid nohup python3 \
    scripts/train_demo.py --out /tmp/demo --corpus /tmp/ftchat-train/.corpus \
    --minutes "$MINUTES" > /tmp/train.log 2>&1 < /dev/null &
  sleep 60; tail -3 /tmp/train.log ;;
collect)
  while pgrep -f scripts/train_demo.py > /dev/null && [ "$SECONDS" -lt "${WAIT_S:-560}" ]; do
    sleep 5
  done
  cp /tmp/train.log "${OUT:?}/"; tail -12 /tmp/train.log
  if pgrep -f scripts/train_demo.py > /dev/null; then echo "still training: collect again"; exit 3; fi
  [ -f /tmp/demo/config.json ] || { echo "no export in /tmp/demo" >&2; exit 1; }
  cp /tmp/demo/*.safetensors "$OUT/" && tar -C /tmp/demo -cf "$OUT/meta.tar" --exclude='*.safetensors' . ;;
*) echo "usage: $0 start|collect" >&2; exit 2 ;;
esac
