"""The grouped routed-expert prefill kernels (ftchat/kernels/moe_prefill.py) against a float64
reference with the module's error bound, against the torch path (experts.routed_experts_torch),
and for determinism; with negative controls.

    on the device (CUDA):        pytest -m gpu tests/gpu/test_moe_prefill_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_moe_prefill_gpu.py

Small geometry (D 64, I 32 or 64, E 24 experts at random slots of a bank with garbage elsewhere,
K 4, T up to 40): empty experts, an expert with more pairs than BLOCK_M (several M-blocks), one
program per tile and persistent programs over several tiles, several N-blocks and k steps, rows
of random bytes (every code, subnormal block scales), both row kinds; exact inputs pin the
rounding points bit for bit; the same bits whatever the slots, grid or batch around a pair.
The real geometry (D 2560, I 640, E 512, K 10, T 1024, one expert with 200 pairs) runs on CUDA
only (skipped when TRITON_INTERPRET=1 or FTCHAT_TEST_DEVICE != cuda): in the interpreter a call
would take hours (it pays per operation and tile). ~35 s in the interpreter on 2 cores.

Tolerance (the module docstring): per element |out - ref| <= 2^-7 (1 + 2^-4) A + 2^-8
(1 + 2^-4) B, ref the float64 sum of w_k * down(silu(g) * up) from the exact weights, A = sum_k
|w_k| (|W_down| |h64_k|) and B = sum of the partial sums |P_j| (j >= 2) in ascending expert id.
Measured in the interpreter: at most 0.40 of the bound (the torch path itself: 0.66). Against the
torch path (it rounds the weights and every op to bf16): within 2^-5 * max|ref|, the decode
kernels' tolerance against it (tests/gpu/test_kernels_gpu.py). Negative controls: one byte of
an expert's weights (gate_up or down) flipped must break the bound, only where that expert
reaches.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

from ftchat.kernels import moe_prefill as mp
from ftchat.kernels.config import KernelConfig
from ftchat.codecs import nvfp4
from ftchat.codecs.rows import RowLayout
from ftchat.offload.experts import routed_experts, routed_experts_torch
from tests.kernel_inputs import exact_rows, kernel_device, place, random_rows

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
SMALL = dict(D=64, I=32, E=24, K=4)
REAL = dict(D=2560, I=640, E=512, K=10)
# interpreter-sized tiles: one N-block and one k step a tile (it pays per operation)
BIG = mp.PrefillTiles(block_m=16, gate_up_n=32, gate_up_k=64, down_n=64, down_k=32,
                      combine_rows=64, combine_cols=64)
# several N-blocks and k steps, one program per tile of the bound
SPLIT = mp.PrefillTiles(block_m=16, gate_up_n=16, gate_up_k=32, down_n=32, down_k=32,
                        per_sm=0, combine_rows=64, combine_cols=64)


@pytest.fixture(autouse=True)
def _device():
    yield from kernel_device(DEVICE, INTERPRET, mp.HAS_TRITON)


# ===== inputs and the float64 reference =====


def _random_codes(layout: RowLayout, n: int, gen: torch.Generator) -> torch.Tensor:
    # NVFP4 rows of random bytes (every code, -0 included), block scales over e4m3's range
    # (subnormal ones included) and globals giving weights of about 1/sqrt(fan-in)
    rows = torch.randint(0, 256, (n, layout.nbytes), dtype=torch.uint8, generator=gen)
    for part, fan_in in (("gate_up", layout.hidden), ("down", layout.inter)):
        sc = layout.view(rows, part + "_scale")
        exps = torch.randint(-9, 9, sc.shape, generator=gen).float()
        sc.copy_((torch.rand(sc.shape, generator=gen) + 1).mul(2.0 ** exps).clamp(max=448))
        glob = layout.view(rows, part + "_global")
        glob.copy_(fan_in ** -0.5 / (2.1 * sc.float().mean(-1)))
    return rows


def _routing(T: int, K: int, E: int, gen: torch.Generator, hot: int | None):
    # distinct ids per token; `hot`: expert 3 in that many tokens (more pairs than BLOCK_M)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    if hot:
        for t in range(hot):
            if not (ids[t] == 3).any():
                ids[t, t % K] = 3
    w = torch.softmax(torch.randn(T, K, generator=gen), dim=-1)
    return ids, w


@functools.lru_cache(maxsize=8)
def _case(kind: str, T: int, seed: int, hot: int | None = None, codes: bool = False,
          inter: int = SMALL["I"]):
    D, _, E, K = SMALL.values()
    I = inter
    gen = torch.Generator().manual_seed(seed)
    layout = RowLayout(kind, D, I)
    rows = (_random_codes if codes else random_rows)(layout, E, gen)
    bank, slot_of = place(rows, E + 3, gen)
    ids, w = _routing(T, K, E, gen, hot)
    x = torch.randn(T, D, generator=gen).bfloat16()
    on = [t.to(DEVICE) for t in (x, bank, slot_of[ids], ids, w.bfloat16())]
    return layout, on


def _exact(rows: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    # gate_up [n, 2I, D], down [n, D, I] in float64, exactly E2M1 * scale * global
    if layout.kind != "nvfp4":
        return layout.view(rows, "gate_up").double(), layout.view(rows, "down").double()
    out = []
    for p in ("gate_up", "down"):
        v = nvfp4.e2m1_values(nvfp4.unpack_nibbles(layout.view(rows, p)))
        s = layout.view(rows, p + "_scale").float().repeat_interleave(nvfp4.GROUP, dim=-1)
        out.append((v * s).double() * layout.view(rows, p + "_global").double()[..., None])
    return out[0], out[1]


def _reference(x, bank, layout, slots, ids, w):
    """(ref, A, B) [T, D] float64 (module docstring); one expert (slot) at a time."""
    T, K = ids.shape
    D = x.shape[1]
    y = torch.zeros(T, K, D, dtype=torch.float64, device=x.device)
    y_abs = torch.zeros_like(y)
    for s in slots.unique().tolist():
        t, k = (slots == s).nonzero(as_tuple=True)
        gate_up, down = _exact(bank[s:s + 1], layout)
        g, up = (x[t].double() @ gate_up[0].T).chunk(2, dim=-1)
        h = F.silu(g) * up
        y[t, k] = h @ down[0].T
        y_abs[t, k] = h.abs() @ down[0].abs().T
    wk = w.double()[..., None]  # [T, K, 1]
    by_id = ids.argsort(dim=1)[..., None].expand(-1, -1, D)
    partial = (wk * y).gather(1, by_id).cumsum(dim=1)  # [T, K, D] in ascending expert id
    return partial[:, -1], (wk.abs() * y_abs).sum(1), partial[:, 1:].abs().sum(1)


def _outside(got, ref, A, B) -> torch.Tensor:
    """Elements outside the error bound [T, D] (bool)."""
    tol = 2**-7 * (1 + 2**-4) * A + 2**-8 * (1 + 2**-4) * B
    return (got.double() - ref).abs() > tol


def _check(layout, args, tiles=None):
    x, bank, slots, ids, w = args
    got = mp.routed_experts_grouped(x, bank, layout, slots, ids, w, tiles)
    ref, A, B = _reference(x, bank, layout, slots, ids, w)
    bad = _outside(got, ref, A, B)
    assert got.dtype == torch.bfloat16 and not bad.any(), int(bad.sum())
    torch_path = routed_experts_torch(x, bank, layout, slots, ids, w)
    scale = float(ref.abs().max())
    assert float((got.double() - torch_path.double()).abs().max()) <= 2**-5 * scale
    return got


# ===== the small geometry (interpreter and device) =====


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_hot_expert_over_several_blocks(kind):
    # expert 3 gets 30 pairs (> BLOCK_M 16: two blocks, the last partial); most experts a few
    layout, args = _case(kind, 40, seed=1, hot=30)
    assert int((args[3] == 3).sum()) >= 30 > BIG.block_m
    _check(layout, args, BIG)


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_one_token_most_experts_empty(kind):
    # default tiles: every N / K tile cut to the small dims, 20 of 24 experts without pairs
    layout, args = _case(kind, 1, seed=2)
    _check(layout, args)


def test_several_n_blocks_and_steps_one_program_per_tile():
    # I = 64: kernel 1 has 4 N-blocks and 2 k steps, kernel 2 2 N-blocks and 2 k steps
    layout, args = _case("nvfp4", 24, seed=3, hot=20, inter=64)
    assert mp._step(64, SPLIT.gate_up_k, 32) < 64 and mp._cols(64, SPLIT.gate_up_n) < 64
    assert mp._step(64, SPLIT.down_k, 32) < 64 and mp._cols(64, SPLIT.down_n) < 64
    _check(layout, args, SPLIT)


def test_every_code_and_subnormal_scales():
    layout, args = _case("nvfp4", 16, seed=4, codes=True)
    scales = layout.view(args[1], "gate_up_scale").float()
    assert bool((scales < 2**-6).any()) and bool((scales > 64).any())  # subnormal and large
    _check(layout, args, BIG)


def test_same_bits_for_any_slot_tiles_and_batch():
    # each pair's product depends only on its x row and its expert's bytes: the same experts
    # at other slots, persistent or one-program tiles, and a prefix of the batch give the same bits
    layout, (x, bank, slots, ids, w) = _case("nvfp4", 40, seed=1, hot=30)
    got = mp.routed_experts_grouped(x, bank, layout, slots, ids, w, BIG)
    gen = torch.Generator().manual_seed(5)
    used = slots.unique()
    bank2, slot_of2 = place(bank[used].cpu(), bank.shape[0] - 1, gen)
    remap = torch.full((bank.shape[0],), -1, dtype=torch.long)
    remap[used.cpu()] = slot_of2
    slots2 = remap[slots.cpu()].to(DEVICE)
    assert not torch.equal(slots2, slots)
    tiles = mp.PrefillTiles(**{**BIG.__dict__, "per_sm": 0, "combine_rows": 4})
    got2 = mp.routed_experts_grouped(x, bank2.to(DEVICE), layout, slots2, ids, w, tiles)
    assert torch.equal(got2, got)
    head = mp.routed_experts_grouped(x[:13], bank, layout, slots[:13], ids[:13], w[:13], BIG)
    assert torch.equal(head, got[:13])


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_exact_inputs_round_where_the_docstring_says(kind):
    # exact_rows with x in {1, 2} and power-of-two routing weights: g >= 32 (silu(g) == g in
    # fp32), and every sum is a short dyadic number, exact in fp32 in any order. The output is
    # then fixed by the rounding points alone: h = bf16(g * up), y = bf16(down . h * w), the bf16
    # adds in ascending id; a mirror rounding there gives the same bits
    D, I, E, K = SMALL.values()
    T = 6
    gen = torch.Generator().manual_seed(10)
    layout = RowLayout(kind, D, I)
    bank, slot_of = place(exact_rows(layout, E, gen), E + 3, gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.tensor([0.5, 0.25, 0.125, 0.125]).expand(T, K).bfloat16()
    x = torch.randint(1, 3, (T, D), generator=gen).bfloat16()
    slots = slot_of[ids]
    y = torch.zeros(T, K, D, dtype=torch.bfloat16)
    for t in range(T):
        for k in range(K):
            gate_up, down = _exact(bank[int(slots[t, k])][None], layout)
            g, up = (gate_up[0] @ x[t].double()).chunk(2)
            assert float(g.min()) >= 32
            h = (g * up).bfloat16()  # silu(g) == g
            y[t, k] = ((down[0] @ h.double()) * float(w[t, k])).bfloat16()
    want = torch.zeros(T, D, dtype=torch.bfloat16)
    for j in range(K):
        want = want + y[torch.arange(T), ids.argsort(dim=1)[:, j]]
    on = [v.to(DEVICE) for v in (x, bank, slots, ids, w)]
    got = mp.routed_experts_grouped(on[0], on[1], layout, *on[2:], tiles=BIG)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("part", ["down", "gate_up"])
def test_negative_control_one_weight_byte(part):
    # one byte of expert 3's row (two codes: magnitudes flipped) must break the bound, and only
    # in the outputs that expert reaches (one column for down, the tokens' rows for gate_up)
    layout, (x, bank, slots, ids, w) = _case("nvfp4", 40, seed=1, hot=30)
    ref, A, B = _reference(x, bank, layout, slots, ids, w)
    slot = int(slots[ids == 3][0])
    bad = bank.clone()
    row, byte = 5, 3  # output row 5 of the part (down: column 5 of out), byte 3 of it
    packed = layout.view(bad[slot:slot + 1], part)[0]
    packed[row, byte] ^= 0x77
    got = mp.routed_experts_grouped(x, bad, layout, slots, ids, w, BIG)
    outside = _outside(got, ref, A, B)
    assert outside.any()
    tokens = (ids == 3).any(1)
    assert not outside[~tokens].any()
    if part == "down":
        assert outside.nonzero()[:, 1].eq(row).all()


def test_combine_is_the_torch_sum_bit_for_bit():
    gen = torch.Generator().manual_seed(6)
    T, K, D = 9, 4, 96
    ids = torch.stack([torch.randperm(24, generator=gen)[:K] for _ in range(T)]).to(DEVICE)
    y = (torch.randn(T * K, D, generator=gen) * 4).bfloat16().to(DEVICE)
    want = torch.zeros(T, D, dtype=torch.bfloat16, device=DEVICE)
    for j in range(K):  # routed_experts_torch's loop
        want = want + y[torch.arange(T, device=DEVICE) * K + ids.argsort(dim=1)[:, j]]
    assert torch.equal(mp.combine(y, ids, 4, 32), want)


def test_plan_blocks_cover_each_slot_once():
    gen = torch.Generator().manual_seed(7)
    slots = torch.randint(0, 30, (50, 4), generator=gen)
    slots[:25, 0] = 7  # a run of > 16 pairs
    table, count, order = (t.cpu() for t in mp.plan(slots.to(DEVICE), 31, 16))
    n = int(count)
    start, end, slot = table[:, :n]  # end: the end of the block's run (its slot's pairs)
    assert (end - start).min() >= 1
    covered = torch.cat([torch.arange(a, min(a + 16, b)) for a, b in zip(start.tolist(),
                                                                          end.tolist())])
    assert torch.equal(covered, torch.arange(200))  # every sorted position once, in order
    flat = slots.flatten()
    for a, b, s in zip(start.tolist(), end.tolist(), slot.tolist()):
        assert (flat[order[a:b]] == s).all()
    assert torch.equal(order, torch.sort(flat, stable=True).indices)
    assert n == sum(-(-int((flat == s).sum()) // 16) for s in range(31))
    assert table.shape[1] >= n


def test_dispatch():
    layout, args = _case("nvfp4", 5, seed=8)
    x, bank, slots, ids, w = args
    got = routed_experts(x, bank, layout, slots, ids, w)
    torch_path = routed_experts_torch(x, bank, layout, slots, ids, w)
    if x.is_cuda:  # the kernels; fused kernels off: the torch path
        assert torch.equal(got, mp.routed_experts_grouped(x, bank, layout, slots, ids, w))
        off = KernelConfig(fused=False)
        assert torch.equal(routed_experts(x, bank, layout, slots, ids, w, kc=off), torch_path)
    else:  # CPU tensors: the torch path
        assert torch.equal(got, torch_path)
    assert not mp.supports(x.float(), layout)  # fp32 activations stay on the torch path


@pytest.mark.skipif(DEVICE != "cuda", reason="host syncs are a CUDA notion")
def test_no_host_sync():
    layout, (x, bank, slots, ids, w) = _case("nvfp4", 40, seed=1, hot=30)
    want = mp.routed_experts_grouped(x, bank, layout, slots, ids, w, BIG)  # compiles outside
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing torch call raises
    try:
        got = mp.routed_experts_grouped(x, bank, layout, slots, ids, w, BIG)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)


# ===== the real geometry (device only) =====


@pytest.mark.skipif(INTERPRET or DEVICE != "cuda",
                    reason="real geometry: CUDA only (hours in the interpreter)")
@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_real_geometry(kind):
    D, I, E, K = REAL.values()
    T = 1024
    layout = RowLayout(kind, D, I)
    gen = torch.Generator(device="cuda").manual_seed(9)
    if kind == "nvfp4":
        rows = torch.randint(0, 256, (E, layout.nbytes), dtype=torch.uint8, device="cuda",
                             generator=gen)
        for part, fan_in in (("gate_up", D), ("down", I)):
            sc = layout.view(rows, part + "_scale")
            sc.copy_((1 + 447 * torch.rand(sc.shape, device="cuda", generator=gen)).to(sc.dtype))
            layout.view(rows, part + "_global").fill_(fan_in ** -0.5 / (2.1 * 224))
    else:
        rows = torch.zeros(E, layout.nbytes, dtype=torch.uint8, device="cuda")
        layout.view(rows, "gate_up").copy_(
            torch.randn(E, 2 * I, D, device="cuda", generator=gen) * D ** -0.5)
        layout.view(rows, "down").copy_(
            torch.randn(E, D, I, device="cuda", generator=gen) * I ** -0.5)
    slot_of = torch.randperm(E + 7, device="cuda", generator=gen)[:E]
    bank = torch.zeros(E + 8, layout.nbytes, dtype=torch.uint8, device="cuda")
    bank[slot_of] = rows
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices
    has = (ids[:200] == 7).any(1)  # expert 7 in the first 200 tokens: > BLOCK_M 64 pairs
    ids[:200, -1] = torch.where(has, ids[:200, -1], 7)
    assert int((ids == 7).sum()) >= 200
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=gen), -1).bfloat16()
    x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
    _check(layout, (x, bank, slot_of[ids].int(), ids, w))
