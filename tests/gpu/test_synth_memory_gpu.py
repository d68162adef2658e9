"""GPU tier (`pytest -m gpu`): the in-memory synthetic model on CUDA. With rng="cpu" it is the
loaded checkpoint bit for bit; drawn on the device it has the same tensors and other values,
decodes, and generates fast enough for 48 flash-next layers."""

from __future__ import annotations

import time

import pytest
import torch

from ftchat.engine import generate, load_model, resident_backend
from ftchat.model.synth_memory import synthetic_model
from tests.test_synth_memory import FIXTURES, differences

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.mark.parametrize("fmt,seed", [("bf16", 0), ("nvfp4-modelopt", 1)])
def test_cpu_rng_on_cuda_is_the_loaded_checkpoint(fmt, seed, request):
    ref = load_model(request.getfixturevalue(FIXTURES[fmt, seed]), "cuda", torch.bfloat16)
    m = synthetic_model("tiny", None, fmt, "cuda", torch.bfloat16, seed, rng="cpu")
    assert differences(m, ref) == []


def test_device_rng_same_tensors_other_values_and_it_decodes():
    cpu = synthetic_model("tiny", None, "nvfp4-modelopt", "cuda", torch.bfloat16, 1, rng="cpu")
    a = synthetic_model("tiny", None, "nvfp4-modelopt", "cuda", torch.bfloat16, 1)
    b = synthetic_model("tiny", None, "nvfp4-modelopt", "cuda", torch.bfloat16, 1)
    assert differences(a, b) == []  # deterministic per seed
    diff = differences(a, cpu)
    assert "embed_tokens.weight" in diff and "row 0" in diff  # other values ...
    assert all(n in a.weights.tensors for n in cpu.weights.tensors)  # ... same tensors
    for name, t in cpu.weights.tensors.items():
        u = a.weights.tensors[name]
        assert (u.dtype, u.shape, u.device) == (t.dtype, t.shape, t.device), name
    steps = list(generate(a, [[3, 141, 59, 26]], 6, resident_backend(a)))
    assert all(torch.isfinite(s.logits).all() for s in steps)


def test_flash_next_generation_rate():
    """Two flash-next layers drawn on the device; 48 layers must take minutes, not an hour."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    m = synthetic_model("flash-next", 2, "nvfp4-modelopt", "cuda", torch.bfloat16, 0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    rows = m.host_rows.shape[0]
    print(f"\nflash-next x2 on {torch.cuda.get_device_name()}: {dt:.1f} s, {rows / dt:.0f} rows/s "
          f"incl. dense; 48 layers ~ {48 * 512 / (rows / dt) / 60:.1f} min")
    assert m.host_rows.shape == (1024, 2_780_160)
    assert rows / dt > 100
