"""Triton kernels (slot copy, routed experts) against their torch references.

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_kernels_gpu.py
    on CPU, Triton interpreter:  TRITON_INTERPRET=1 pytest -m gpu tests/gpu/test_kernels_gpu.py
TRITON_INTERPRET=1 (read when the kernels are decorated, so set it on the command line) runs
every tensor on the CPU; otherwise everything runs on CUDA, with the host store pinned.
Tolerances: fp32 activations within rtol 1e-5 / atol 1e-5 * max|ref| of the torch reference
(only summation order differs); bf16 activations within 1 bf16 ulp (rtol 2^-7) of the torch
mirror (fp32 math, one rounding at the end) and within 2^-5 * max|ref| of the reference, which
rounds weights and every stage to bf16 (measured here: <= 0.009 * max|ref| over 8 seeds).
On exact inputs (every partial sum exact) the kernels equal both references bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from ftchat.codecs.rows import RowLayout
from ftchat.kernels import HAS_TRITON, row_copy
from ftchat.kernels import routed_experts as rk
from ftchat.offload.experts import routed_experts, routed_experts_any, routed_experts_decode_ref
from tests.kernel_inputs import (copy_plan, exact_rows, expected_copy, place, random_rows,
                                 routing)

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture(autouse=True)
def _triton():
    assert rk.HAS_TRITON and HAS_TRITON, "these tests need triton"
    assert INTERPRET or torch.cuda.is_available(), "no CUDA: set TRITON_INTERPRET=1 to run on CPU"


# ===== copy kernel =====


def _host(rows: torch.Tensor) -> torch.Tensor:
    return rows if INTERPRET else rows.pin_memory()  # the kernel reads it through UVA


@pytest.mark.parametrize("R", [640, 200, 203])  # int32 words (two sizes), bytes (R % 4 != 0)
@pytest.mark.parametrize("count", [0, 3, 7])
def test_copy_kernel_follows_the_plan(R, count):
    N, S, M = 9, 7, 7
    gen = torch.Generator().manual_seed(R + count)
    host = torch.randint(0, 256, (N, R), dtype=torch.uint8, generator=gen)
    bank = torch.randint(0, 256, (S + 1, R), dtype=torch.uint8, generator=gen)
    src, dst, cnt = copy_plan(M, count, N, S, gen, dup_src=count == 3)
    want = expected_copy(host, bank, src, dst, count)
    got = bank.clone().to(DEVICE)  # clone: on CPU .to() would alias `bank`
    # 3 programs and 256-byte blocks: several work items per row, a partial last block
    row_copy.copy_rows_triton(_host(host), got, src.to(DEVICE), dst.to(DEVICE), cnt.to(DEVICE),
                              programs=3, block_bytes=256)
    assert torch.equal(got.cpu()[:S], want[:S])
    assert torch.equal(got.cpu()[S], bank[S])  # the kernel skips entries past the count


@pytest.mark.parametrize("programs", [1, 8])
def test_copy_kernel_equals_torch_path(programs):
    N, S, M, R = 16, 12, 10, 1024
    gen = torch.Generator().manual_seed(programs)
    host = _host(torch.randint(0, 256, (N, R), dtype=torch.uint8, generator=gen))
    bank = torch.randint(0, 256, (S + 1, R), dtype=torch.uint8, generator=gen).to(DEVICE)
    for count in (0, 4, M):  # one bank, several plans in sequence
        src, dst, cnt = (t.to(DEVICE) for t in copy_plan(M, count, N, S, gen, dup_src=True))
        ref = bank.clone()
        row_copy.copy_rows_ref(host, ref, src, dst, cnt)
        row_copy.copy_rows_triton(host, bank, src, dst, cnt, programs=programs)
        assert torch.equal(bank[:S], ref[:S])
        bank[S] = ref[S]  # the sink's bytes are not specified


# ===== routed expert kernels =====


def _case(kind: str, T: int, K: int, exact: bool, seed: int, D: int = 64, I: int = 32):
    gen = torch.Generator().manual_seed(seed)
    layout = RowLayout(kind, D, I)
    E = max(12, K + 2)
    rows = (exact_rows if exact else random_rows)(layout, E, gen)
    bank, slot_of = place(rows, E + 6, gen)
    ids, w = routing(T, K, E, gen)
    if exact:  # dyadic weights and x in {1, 2}: see exact_rows
        w = torch.tensor([0.5, 0.25] + [0.25 / (K - 2)] * (K - 2))[:K].expand(T, K).clone()
        x = torch.randint(1, 3, (T, D), generator=gen).float()
    else:
        x = torch.randn(T, D, generator=gen)
    return layout, bank, slot_of, ids, w, x


def _on(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
@pytest.mark.parametrize("T,K", [(1, 4), (2, 10)])
def test_experts_fp32_match_reference(kind, T, K):
    layout, bank, slot_of, ids, w, x = _case(kind, T, K, exact=False, seed=T * K)
    ref = routed_experts(x, bank, layout, slot_of[ids], ids, w)
    bank_d, slots_d, w_d, x_d = _on(bank, slot_of[ids].int(), w, x)
    got = rk.routed_experts_triton(x_d, bank_d, layout, slots_d, w_d).cpu()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_experts_bf16_match_mirror_and_reference(kind):
    layout, bank, slot_of, ids, w, x = _case(kind, 2, 6, exact=False, seed=5, D=128, I=64)
    x = x.bfloat16()
    slots = slot_of[ids]
    ref = routed_experts(x, bank, layout, slots, ids, w).float()
    mirror = routed_experts_decode_ref(x, bank, layout, slots, w).float()
    got = rk.routed_experts_triton(*_on(x, bank), layout, *_on(slots, w)).cpu()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), mirror, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(got.float(), ref, rtol=0, atol=2**-5 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_exact_inputs_bit_identical(kind, dtype):
    layout, bank, slot_of, ids, w, x = _case(kind, 2, 4, exact=True, seed=7)
    slots = slot_of[ids]
    ref = routed_experts(x, bank, layout, slots, ids, w)  # fp32: exact on these inputs
    assert torch.equal(ref.double(), _exact_f64(x, bank, layout, slots, w))  # the premise
    got = rk.routed_experts_triton(*_on(x.to(dtype), bank), layout, *_on(slots, w)).cpu()
    assert torch.equal(got, ref.to(dtype))


def _exact_f64(x, bank, layout, slots, w):
    # the routed output in float64 from the fp32 dequantized weights (exact on exact inputs)
    from ftchat.offload.experts import expert_weights

    gate_up, down = (t.double() for t in expert_weights(bank[slots.flatten()], layout,
                                                         torch.float32))
    xk = x.double().repeat_interleave(slots.shape[1], dim=0)  # [T*K, D]
    g, u = torch.einsum("nod,nd->no", gate_up, xk).chunk(2, dim=-1)
    y = torch.einsum("ndi,ni->nd", down, g * torch.sigmoid(g) * u)
    return (y.view(*slots.shape, -1) * w.double()[..., None]).sum(1)


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_experts_do_not_depend_on_the_slot(kind):
    layout, bank, slot_of, ids, w, x = _case(kind, 2, 5, exact=False, seed=11)
    x = x.bfloat16()
    got = rk.routed_experts_triton(*_on(x, bank), layout, *_on(slot_of[ids], w))
    # the same experts at other slots, other garbage in the free slots and the sink
    gen = torch.Generator().manual_seed(12)
    rows = bank[slot_of]
    bank2, slot_of2 = place(rows, bank.shape[0] - 1, gen)
    assert not torch.equal(slot_of2, slot_of)
    got2 = rk.routed_experts_triton(*_on(x, bank2), layout, *_on(slot_of2[ids], w))
    assert torch.equal(got.cpu(), got2.cpu())


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_experts_tiles_and_masked_steps(kind):
    # D = 80 (10 NVFP4 words): no large power-of-two step divides it, so kernel 1's last step
    # is masked; more rows than I = 48 in kernel 1, two-word steps in kernel 2, other warps
    layout, bank, slot_of, ids, w, x = _case(kind, 1, 3, exact=False, seed=13, D=80, I=48)
    ref = routed_experts(x, bank, layout, slot_of[ids], ids, w)
    tiles = rk.DecodeTiles(gate_up_rows=64, gate_up_k=128, gate_up_warps=2, down_rows=16,
                           down_k=16, down_warps=8, combine_rows=32)
    assert not rk._gemv_args(layout, "gate_up", 80, 128)["EVEN"]
    got = rk.routed_experts_triton(*_on(x, bank), layout, *_on(slot_of[ids], w), tiles=tiles)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_dispatcher_picks_the_path_for_the_device():
    layout, bank, slot_of, ids, w, x = _case("nvfp4", 1, 4, exact=False, seed=17)
    x = x.bfloat16()
    args = (*_on(x, bank), layout, *_on(slot_of[ids], ids, w))
    got = routed_experts_any(*args)
    if INTERPRET:  # CPU tensors: the torch reference
        want = routed_experts(*args)
    else:
        want = rk.routed_experts_triton(*args[:4], args[5])
    assert torch.equal(got, want)


# ----- v4: kernel 1 in the row-loop form -----

V4_CASES = [  # (D, I, gate_up_k, gate_up_rows): chunks a program, groups a lane
    (128, 32, 64, 4),  # 2 chunks of 4 groups (groups replicated across the warp's lanes)
    (512, 64, 512, 2),  # 1 chunk, a group a lane, 2 h rows (the default tile)
    (512, 64, 512, 1),  # one h row a program (the default at bs 1)
    (1024, 48, 512, 8),  # 2 chunks, 8 h rows a program (16 rows in the loop)
]


def _v4(D, k, n):
    del D  # the tile does not depend on it; v4_applies checks the pair
    return rk.DecodeTiles(gate_up_rows=n, gate_up_k=k, gate_up_warps=1, down_rows=32,
                          down_k=128, down_warps=4, variant="v4")


@pytest.mark.parametrize("D,I,k,n", V4_CASES)
@pytest.mark.parametrize("T", [1, 2])
def test_experts_v4_match_reference_and_v2(D, I, k, n, T):
    layout, bank, slot_of, ids, w, x = _case("nvfp4", T, 5, exact=False, seed=D + T, D=D, I=I)
    tiles = _v4(D, k, n)
    assert rk.v4_applies(layout, tiles)
    slots = slot_of[ids]
    ref = routed_experts(x, bank, layout, slots, ids, w)
    got = rk.routed_experts_triton(*_on(x, bank), layout, *_on(slots, w), tiles=tiles).cpu()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    xb = x.bfloat16()
    mirror = routed_experts_decode_ref(xb, bank, layout, slots, w).float()
    got_b = rk.routed_experts_triton(*_on(xb, bank), layout, *_on(slots, w), tiles=tiles).cpu()
    v2 = rk.routed_experts_triton(*_on(xb, bank), layout, *_on(slots, w)).cpu()
    torch.testing.assert_close(got_b.float(), mirror, rtol=2**-7, atol=1e-6)
    # two fp32 orders each within half an ulp of their own sum: one bf16 ulp apart at most
    torch.testing.assert_close(got_b.float(), v2.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_v4_exact_inputs_bit_identical(dtype):
    layout, bank, slot_of, ids, w, x = _case("nvfp4", 2, 4, exact=True, seed=7, D=128, I=32)
    slots = slot_of[ids]
    ref = routed_experts(x, bank, layout, slots, ids, w)
    assert torch.equal(ref.double(), _exact_f64(x, bank, layout, slots, w))  # the premise
    got = rk.routed_experts_triton(*_on(x.to(dtype), bank), layout, *_on(slots, w),
                                   tiles=_v4(128, 64, 4)).cpu()
    assert torch.equal(got, ref.to(dtype))


def test_experts_v4_do_not_depend_on_the_slot():
    layout, bank, slot_of, ids, w, x = _case("nvfp4", 2, 5, exact=False, seed=11, D=512, I=64)
    x, tiles = x.bfloat16(), _v4(512, 512, 4)
    got = rk.routed_experts_triton(*_on(x, bank), layout, *_on(slot_of[ids], w), tiles=tiles)
    bank2, slot_of2 = place(bank[slot_of], bank.shape[0] - 1, torch.Generator().manual_seed(12))
    assert not torch.equal(slot_of2, slot_of)
    got2 = rk.routed_experts_triton(*_on(x, bank2), layout, *_on(slot_of2[ids], w), tiles=tiles)
    assert torch.equal(got.cpu(), got2.cpu())


def test_v4_applies_only_to_whole_nvfp4_tiles():
    assert not rk.v4_applies(RowLayout("bf16", 512, 64), _v4(512, 512, 4))
    assert not rk.v4_applies(RowLayout("nvfp4", 640, 64), _v4(512, 512, 4))  # D % 512
    assert not rk.v4_applies(RowLayout("nvfp4", 512, 36), _v4(512, 512, 8))  # I % 8
    assert rk.v4_applies(RowLayout("nvfp4", 2560, 640), _v4(2560, 512, 4))


def test_routed_default_tiles_rule():
    # the H200 picks (docs/performance.md): v4 at 2 h rows a program, one at bs 1; v2 where v4
    # does not divide the shape; dense rows v1
    real = RowLayout("nvfp4", 2560, 640)
    assert rk.default_tiles(real) == rk.V4_TILES and rk.V4_TILES.gate_up_rows == 2
    assert rk.default_tiles(RowLayout("nvfp4", 640, 64)).variant == "v2"  # D % 512
    assert rk.default_tiles(RowLayout("bf16", 2560, 640)).variant == "v1"
    # the one-h-row tile: bs 1 only
    assert rk.default_tiles(real, 1) == rk.V4_TILES_BS1 and rk.V4_TILES_BS1.gate_up_rows == 1
    assert rk.default_tiles(real, 2) == rk.V4_TILES
