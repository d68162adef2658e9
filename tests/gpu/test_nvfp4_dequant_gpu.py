"""The NVFP4 dequantization kernel (ftchat/kernels/nvfp4_dequant.py) against the torch form
(nvfp4.dequantize, then the cast): bit-identical, on slot-row views (blocks at a row stride) and
plain [N, K/2] weights, bf16 and fp32, every code and a spread of block scales (subnormal e4m3
ones included), with a negative control.

    on the device (CUDA):        pytest -m gpu tests/gpu/test_nvfp4_dequant_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_nvfp4_dequant_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch

from ftchat.kernels import nvfp4_dequant as nd
from ftchat.kernels.config import KernelConfig
from ftchat.codecs.rows import RowLayout
from tests.kernel_inputs import kernel_device, random_rows

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _device():
    yield from kernel_device(DEVICE, INTERPRET, nd.HAS_TRITON)


def _weight(N, K, seed):
    # every code, block scales over e4m3's range (normal and subnormal), per-row globals
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
    exps = torch.randint(-9, 9, (N, K // 16), generator=gen).float()
    scale = (torch.rand(N, K // 16, generator=gen) + 1).mul(2.0 ** exps).clamp(max=448)
    g = torch.rand(N, generator=gen) * 3e-3 + 1e-4
    return (packed.to(DEVICE), scale.to(torch.float8_e4m3fn).to(DEVICE), g.to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("N,K", [(64, 256), (37, 2560), (1, 16)])
def test_plain_weight_bit_identical(N, K, dtype):
    p, s, g = _weight(N, K, seed=N + K)
    assert torch.equal(nd.dequantize_triton(p, s, g, dtype), nd.dequantize_ref(p, s, g, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_slot_row_views_bit_identical(dtype):
    # the routed experts' parts: blocks at the row stride of a slot bank, as expert_weights reads
    layout = RowLayout("nvfp4", 256 if INTERPRET else 2560, 64 if INTERPRET else 640)
    rows = random_rows(layout, 3, torch.Generator().manual_seed(1)).to(DEVICE)
    for part in ("gate_up", "down"):
        args = [layout.view(rows, part + sfx) for sfx in ("", "_scale", "_global")]
        got = nd.dequantize_triton(*args, dtype)
        assert got.shape == (3, *layout.view(rows, part).shape[1:-1], 2 * args[0].shape[-1])
        assert torch.equal(got, nd.dequantize_ref(*args, dtype)), part


def test_dispatch_and_negative_control():
    p, s, g = _weight(16, 64, seed=5)
    want = nd.dequantize_ref(p, s, g, torch.bfloat16)
    assert torch.equal(nd.dequantize(p, s, g, torch.bfloat16), want)
    off = KernelConfig(fused=False)  # the torch form
    assert torch.equal(nd.dequantize(p, s, g, torch.bfloat16, kc=off), want)
    bad = p.clone()
    bad[3, 5] ^= 0x11  # one bit of both nibbles of one byte
    got = nd.dequantize_triton(bad, s, g, torch.bfloat16)
    diff = (got != want).nonzero().tolist()
    assert diff and all(r == 3 and c in (10, 11) for r, c in diff), diff
