"""CPU tier of the copy and expert kernels: the torch paths, the torch mirror of the Triton math,
the dispatchers, and importing without Triton. The Triton kernels themselves are tested in
tests/gpu/test_kernels_gpu.py (on CUDA, or on CPU through the Triton interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ftchat.codecs.rows import RowLayout
from ftchat.kernels.row_copy import copy_rows_ref
from ftchat.offload.copy import copy_rows
from ftchat.offload.experts import routed_experts, routed_experts_any, routed_experts_decode_ref
from tests.kernel_inputs import (copy_plan, exact_rows, expected_copy, place, random_rows,
                                 routing)

N, S, R = 12, 8, 384


@pytest.mark.parametrize("count", [0, 3, 8])
@pytest.mark.parametrize("dup_src", [False, True])
def test_copy_torch_path_follows_the_plan(count, dup_src):
    gen = torch.Generator().manual_seed(count + 10 * dup_src)
    host = torch.randint(0, 256, (N, R), dtype=torch.uint8, generator=gen)
    bank = torch.randint(0, 256, (S + 1, R), dtype=torch.uint8, generator=gen)
    src, dst, cnt = copy_plan(10, count, N, S, gen, dup_src)
    want = expected_copy(host, bank, src, dst, count)
    copy_rows(host, bank, src, dst, cnt)  # CPU bank: the torch path
    assert torch.equal(bank[:S], want[:S])  # planned rows copied, every other slot untouched
    if count < 10:  # unused entries went to the sink, with host row 0 (never row N)
        assert torch.equal(bank[S], host[0])


def test_copy_count_is_read_not_the_plan_length():
    gen = torch.Generator().manual_seed(3)
    host = torch.randint(0, 256, (N, R), dtype=torch.uint8, generator=gen)
    bank = torch.zeros(S + 1, R, dtype=torch.uint8)
    src, dst, _ = copy_plan(6, 6, N, S, gen, dup_src=False)
    copy_rows_ref(host, bank, src, dst, torch.tensor([2], dtype=torch.int32))
    assert torch.equal(bank[dst[:2].long()], host[src[:2]])
    assert int(bank[dst[2:].long()].count_nonzero()) == 0  # entries 2.. are past the count


def _x(T: int, D: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(T, D, generator=gen).to(dtype)


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_decode_mirror_matches_reference(kind):
    # the torch mirror of the kernels (fp32 weights and h, k ascending) vs the reference
    gen = torch.Generator().manual_seed(1)
    layout = RowLayout(kind, 64, 32)
    bank, slot_of = place(random_rows(layout, 12, gen), 20, gen)
    ids, w = routing(2, 6, 12, gen)
    x = _x(2, 64, torch.float32, gen)
    ref = routed_experts(x, bank, layout, slot_of[ids], ids, w)
    mirror = routed_experts_decode_ref(x, bank, layout, slot_of[ids], w)
    # fp32 throughout: only the summation order differs (experts by id vs k; matmul blocking)
    torch.testing.assert_close(mirror, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_decode_mirror_exact_on_exact_inputs(kind):
    gen = torch.Generator().manual_seed(2)
    layout = RowLayout(kind, 64, 32)
    bank, slot_of = place(exact_rows(layout, 12, gen), 16, gen)
    ids, _ = routing(2, 4, 12, gen)
    w = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.375, 0.375, 0.25, 0.0]])
    x = torch.randint(1, 3, (2, 64), generator=gen).float()
    ref = routed_experts(x, bank, layout, slot_of[ids], ids, w)
    assert torch.equal(routed_experts_decode_ref(x, bank, layout, slot_of[ids], w), ref)


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_dispatcher_on_cpu_is_the_reference(kind):
    gen = torch.Generator().manual_seed(4)
    layout = RowLayout(kind, 64, 32)
    bank, slot_of = place(random_rows(layout, 8, gen), 10, gen)
    ids, w = routing(1, 4, 8, gen)
    x = _x(1, 64, torch.bfloat16, gen)
    ref = routed_experts(x, bank, layout, slot_of[ids], ids, w)
    assert torch.equal(routed_experts_any(x, bank, layout, slot_of[ids], ids, w), ref)


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_torch_path_dequantizes_a_group_at_a_time(kind, monkeypatch):
    # a prefill chunk routes to most experts of a layer: the torch path may hold only
    # EXPERT_GROUP of them dequantized at once, with the same result as all at once
    from ftchat.offload import experts

    gen = torch.Generator().manual_seed(5)
    layout = RowLayout(kind, 64, 32)
    bank, slot_of = place(random_rows(layout, 12, gen), 16, gen)
    ids, w = routing(9, 4, 12, gen)  # 9 tokens x 4 of 12 experts: most hit several times
    x = _x(9, 64, torch.bfloat16, gen)
    sizes = []
    real = experts.expert_weights
    monkeypatch.setattr(experts, "expert_weights",
                        lambda rows, *a: sizes.append(rows.shape[0]) or real(rows, *a))
    outs = {}
    for group in (1, 5, 12):
        monkeypatch.setattr(experts, "EXPERT_GROUP", group)
        sizes.clear()
        outs[group] = routed_experts(x, bank, layout, slot_of[ids], ids, w)
        used = len(torch.unique(ids))
        assert max(sizes) == min(group, used) and sum(sizes) == used
    assert torch.equal(outs[1], outs[12]) and torch.equal(outs[5], outs[12])
    mirror = routed_experts_decode_ref(x.float(), bank, layout, slot_of[ids], w)
    # the mirror keeps fp32 weights and h: bf16 roundings apart
    torch.testing.assert_close(outs[5].float(), mirror, rtol=2e-2,
                               atol=2e-2 * float(mirror.abs().max()))


_NO_TRITON = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch
from ftchat.codecs.rows import RowLayout
from ftchat.kernels import routed_experts
from ftchat.offload import copy, experts
assert not copy.HAS_TRITON and not routed_experts.HAS_TRITON
host = torch.arange(2 * 128, dtype=torch.int64).to(torch.uint8).view(2, 128)
bank = torch.zeros(3, 128, dtype=torch.uint8)
copy.copy_rows(host, bank, torch.tensor([1, 2]), torch.tensor([0, 2], dtype=torch.int32),
               torch.tensor([1], dtype=torch.int32))
assert torch.equal(bank[0], host[1]) and int(bank[1].count_nonzero()) == 0
layout = RowLayout("bf16", 32, 16)
bank = torch.zeros(2, layout.nbytes, dtype=torch.uint8)
out = experts.routed_experts_any(torch.ones(1, 32), bank, layout, torch.tensor([[0]]),
                                torch.tensor([[0]]), torch.ones(1, 1))
assert out.shape == (1, 32)
print("ok")
"""


def test_modules_import_and_run_without_triton():
    res = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
