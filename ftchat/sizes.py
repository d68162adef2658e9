"""Sizes of a run that both the engine and the VRAM plan use (here, so neither imports the other
for them)."""

PREFILL_CHUNK = 1024  # tokens of one prefill call unless --prefill-chunk or the plan chooses
DEFAULT_CONTEXT = 32768  # KV capacity when --context is not given (and the model allows it)
# An n-gram table up to this size (at the model dtype) goes to the device; a larger one (the real
# model's, 48 GiB) stays in host memory (docs/model.md 7.4)
PLE_ON_DEVICE_BYTES = 2 << 30
MAX_LINE_BYTES = 256 << 20  # a prompt line on stdin (or a --file) past this: refused as it is read
