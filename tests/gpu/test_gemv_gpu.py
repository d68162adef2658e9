"""Decode GEMV kernel (ftchat/kernels/gemv.py) against F.linear, in float64 and in the same dtype.

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_gemv_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \
                                 pytest -m gpu tests/gpu/test_gemv_gpu.py
TRITON_INTERPRET=1 is read when the kernels are decorated, so set it on the command line. The
interpreter pays per operation and per element (bf16 most): there the real shapes run with large
tiles (few programs, still split-K where K allows) and fewer (dtype, rows) pairs; the default
tiles run on the smaller shapes. On CUDA every shape runs every pair with the default tiles.

Tolerances (the module docstring's): the kernel is F.linear's math with fp32 accumulation but
another summation order, rounded once to the output dtype, so
* fp32: |got - ref| <= 1e-5 * max|ref|; a K-term fp32 dot product summed in another order moves
  by ~sqrt(K) * 2^-24 of its terms' scale (~5e-6 at K = 6144), typically far less.
* bf16: |got - ref| <= 2^-7 * |ref| + 2^-8 * max|ref|: one bf16 ulp of each element (an fp32 sum
  in another order can land on the other side of a rounding boundary) plus a small fraction of
  the largest. The same check against float64 math; and on average the kernel is as accurate as
  torch's own bf16 F.linear (mean error within 1.25x torch's plus 2^-12 max).
On CUDA the reference's cuBLAS runs with fp32 reductions (the fixture turns off
allow_bf16_reduced_precision_reduction and TF32) so that it is the same math.
* Determinism: repeated calls are bit-identical; split-K 1 and > 1 agree within the tolerance; a
  CUDA-graph replay is bit-identical to eager.
* Gated input (`linear_gated_triton`: h = silu(g) * u computed in the GEMV from [g | u | ...]):
  bit-identical to `shared_act_triton` then `linear_triton` with the same tiles (the same
  roundings), and within the tolerances above of F.linear(F.silu(g) * u, w) (torch's h may
  differ from the kernels' by an exp / division ulp, rounded to bf16 or not: inside them).
* Negative control: one weight element changed by -8x of itself (at the largest product term of
  its row) fails the same check, while the other outputs still pass.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from ftchat.kernels import gemv, sync
from ftchat.kernels.config import KernelConfig
from ftchat.kernels.shared_expert import shared_act_triton
from tests.kernel_inputs import capture, kernel_device


pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
BF16, FP32 = torch.bfloat16, torch.float32
# N, K: the decode shapes (o_proj / out_proj, the MoE GEMV, the shared down, ...)
REAL = [(2560, 6144), (1281, 2560), (2560, 640), (512, 2560), (16480, 2560)]
ODD = [(37, 100), (1, 7), (130, 1000)]  # masked N tails and K tails, N = 1


@pytest.fixture(autouse=True)
def _device():
    yield from kernel_device(DEVICE, INTERPRET, gemv.HAS_TRITON)


# ===== inputs and checks =====


def _case(N, K, lead, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * K ** -0.5
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def _tiles(N, K):
    if INTERPRET and N * K >= 1 << 20:  # few big programs: seconds instead of minutes
        return gemv.GemvTiles(block_n=256, block_k=2048, split=4, warps=4)
    return None  # the defaults


def _tol(ref, dtype):
    ref = ref.double()
    scale = float(ref.abs().max())
    if dtype == FP32:
        return torch.full_like(ref, 1e-5 * scale)
    return 2**-7 * ref.abs() + 2**-8 * scale


def _ok(got, ref, dtype):
    # elementwise: within tolerance (bool tensor of got's shape)
    return (got.double() - ref.double()).abs() <= _tol(ref, dtype)


def _close(got, ref, dtype) -> bool:
    return bool(_ok(got, ref, dtype).all())


def _check(x, w, tiles=None):
    dtype = x.dtype
    got = gemv.linear_triton(x, w, tiles)
    ref = F.linear(x, w)
    exact = F.linear(x.double(), w.double())
    assert got.shape == ref.shape and got.dtype == dtype and got.device == x.device
    assert _close(got, ref, dtype), float((got.double() - ref.double()).abs().max())
    assert _close(got, exact, dtype), float((got.double() - exact).abs().max())
    if dtype == BF16:  # as accurate as torch's own bf16 evaluation, on average
        err = (got.double() - exact).abs().mean()
        err_torch = (ref.double() - exact).abs().mean()
        assert err <= 1.25 * err_torch + 2**-12 * exact.abs().max()
    return got


# ===== against F.linear =====

if INTERPRET:  # bf16 at one row, fp32 at two; three and eight rows on the smaller real shapes
    REAL_CASES = ([(nk, BF16, (1, 1)) for nk in REAL] + [(nk, FP32, (2,)) for nk in REAL]
                  + [(nk, BF16, lead) for nk in REAL[2:4] for lead in ((3,), (8, 1))])
else:
    REAL_CASES = [(nk, dt, lead) for nk in REAL for dt in (BF16, FP32)
                  for lead in ((1, 1), (2,), (3,), (8, 1))]


@pytest.mark.parametrize("nk,dtype,lead", REAL_CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_real_shapes_match_f_linear(nk, dtype, lead):
    N, K = nk
    x, w = _case(N, K, lead, dtype, seed=N + K + len(lead) + 7 * (dtype == BF16))
    _check(x, w, _tiles(N, K))


MID = [(300, 2560), (640, 640)]  # hundreds of programs with the default tiles
LEADS = [(1, 1), (2,), (3,), (8, 1)]  # rows 1, 2, 3, 8
DEFAULT_CASES = [(nk, dt, lead) for nk in ODD + ([] if INTERPRET else MID) for dt in (BF16, FP32)
                 for lead in LEADS]
if INTERPRET:  # the interpreter pays per program: the mid shapes at two (dtype, rows) pairs
    DEFAULT_CASES += [(nk, BF16, (2,)) for nk in MID] + [(nk, FP32, (8, 1)) for nk in MID]


@pytest.mark.parametrize("nk,dtype,lead", DEFAULT_CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_default_tiles_shapes_and_rows(nk, dtype, lead):
    N, K = nk
    x, w = _case(N, K, lead, dtype, seed=N * K + len(lead) + lead[0])
    _check(x, w)


@pytest.mark.parametrize("lead", [(), (1, 1), (2,), (3, 1), (2, 2, 2)], ids=str)
@pytest.mark.parametrize("tiles", [gemv.GemvTiles(8, 16, 3, 2), gemv.GemvTiles(4, 32, 2, 4),
                                   gemv.GemvTiles(64, 128, 1, 4), gemv.GemvTiles(2, 512, 8, 1)],
                         ids=["8x16s3", "4x32s2", "64x128s1", "2x512s8"])
def test_lead_shapes_tiles_and_masks(lead, tiles):
    # N = 37, K = 100: masked output blocks and a masked last chunk; splits leave the last
    # program of a block with fewer chunks; block_k above K is clamped
    x, w = _case(37, 100, lead, BF16, seed=len(lead) + tiles.block_k)
    got = _check(x, w, tiles)
    assert got.shape == (*lead, 37)


def test_default_tiles_rule():
    # the documented choices for the decode shapes (one warp, 4 rows, 512-column chunks, split 4
    # evened), and at least several hundred programs for N in 640..16480, K in 640..6144
    want = {(2560, 6144): (512, 4), (1281, 2560): (512, 3), (2560, 640): (1024, 1),
            (512, 2560): (512, 3), (16480, 2560): (512, 3), (12800, 2560): (512, 3),
            (2560, 2560): (512, 3)}
    for (N, K), (bk, split) in want.items():
        assert gemv.default_tiles(N, K, 1) == gemv.GemvTiles(4, bk, split, 1)
    for N in (640, 1281, 2560, 6144, 16480):
        for K in (640, 1000, 2560, 6144):
            for rows in (1, 2, 3, 8):
                t = gemv.default_tiles(N, K, rows)
                nk = -(-K // t.block_k)
                programs = -(-N // t.block_n) * t.split
                assert programs >= 160 * (2 if N * K >= 1 << 20 else 1), (N, K, t)
                assert t.split <= nk and -(-nk // t.split) <= 3, (N, K, t)  # few chunks each
                assert 256 <= t.block_k <= 1024 and gemv.launch_plan(K, t) == (t.block_k, t.split)


# ===== gated input: h = silu(g) * u computed by the GEMV =====

# N, I, gu's width: the shared expert's down GEMV of flash-next (gu = the fused MoE GEMV's output
# [gate | up | gate logit | router], 2I + 1 + E columns) and an odd shape (masked N and K tails)
GATED = [(2560, 640, 2 * 640 + 1 + 512), (37, 100, 203)]
GATED_CASES = [(g, dt, lead) for g in GATED for dt in (BF16, FP32) for lead in LEADS]


def _gated_case(N, I, width, lead, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    gu = torch.randn(*lead, width, generator=gen) * 3  # |g| up to ~12: silu's both regimes
    w = torch.randn(N, I, generator=gen) * I ** -0.5
    return gu.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def _act_then_linear(gu, w, tiles):
    # today's pair: the shared activation kernel, then the GEMV on its output h [rows, I]
    I = w.shape[1]
    h = shared_act_triton(gu.reshape(-1, gu.shape[-1]), I)
    return gemv.linear_triton(h, w, tiles).view(*gu.shape[:-1], w.shape[0])


def _check_gated(gu, w, tiles):
    I = w.shape[1]
    got = gemv.linear_gated_triton(gu, w, tiles)
    assert got.shape == (*gu.shape[:-1], w.shape[0]) and got.dtype == gu.dtype
    assert torch.equal(got, _act_then_linear(gu, w, tiles))  # the same roundings, bit for bit
    h = F.silu(gu[..., :I]) * gu[..., I:2 * I]  # torch's shared expert (shared_expert_ref)
    ref, exact = F.linear(h, w), F.linear(h.double(), w.double())
    assert _close(got, ref, gu.dtype), float((got.double() - ref.double()).abs().max())
    assert _close(got, exact, gu.dtype), float((got.double() - exact).abs().max())
    return got


@pytest.mark.parametrize("shape,dtype,lead", GATED_CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_gated_equals_act_then_linear(shape, dtype, lead):
    N, I, width = shape
    gu, w = _gated_case(N, I, width, lead, dtype, seed=N + I + len(lead) + lead[0])
    _check_gated(gu, w, _tiles(N, I))


@pytest.mark.parametrize("tiles", [None, gemv.GemvTiles(8, 16, 3, 2), gemv.GemvTiles(4, 32, 2, 4),
                                   gemv.GemvTiles(64, 128, 1, 4)],
                         ids=["default", "8x16s3", "4x32s2", "64x128s1"])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_gated_tiles_split_and_strided_rows(tiles, dtype):
    # split-K (the last program of a block sums the parts), masked chunks, and gu a column view
    # of a wider buffer (row stride 211, g from column 5), as proj's columns are
    N, I = 37, 100
    full, w = _gated_case(N, I, 211, (3,), dtype, seed=26 + (tiles.block_k if tiles else 0))
    gu = full[:, 5:5 + 2 * I + 1]
    assert gu.stride(0) == 211
    _check_gated(gu, w, tiles)


def test_gated_negative_control():
    # g and u swapped: silu(u) * g, a different input; the torch check must fail
    N, I = 37, 100
    gu, w = _gated_case(N, I, 2 * I, (2,), BF16, seed=27)
    swapped = torch.cat([gu[:, I:], gu[:, :I]], dim=-1)
    got = gemv.linear_gated_triton(swapped, w)
    ref = F.linear(F.silu(gu[:, :I]) * gu[:, I:], w)
    assert not _close(got, ref, BF16)
    assert _close(gemv.linear_gated_triton(gu, w), ref, BF16)


# ===== determinism, split-K and its counters =====


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_deterministic_and_split_invariant(dtype):
    # on CUDA the default tiles (split 5 here); the interpreter: fewer programs, split 5 too
    N, K = (64, 2560) if INTERPRET else (300, 2560)
    x, w = _case(N, K, (2,), dtype, seed=21)
    t = gemv.GemvTiles(16, 512, 5, 4) if INTERPRET else gemv.default_tiles(N, K, 2)
    assert t.split > 1
    first = gemv.linear_triton(x, w, t)
    for _ in range(3):
        assert torch.equal(gemv.linear_triton(x, w, t), first)
    whole = gemv.linear_triton(x, w, gemv.GemvTiles(16, 256, 1, 4))  # 10 chunks, one program
    split = gemv.linear_triton(x, w, gemv.GemvTiles(16, 256, 10, 4))  # 10 programs of 1 chunk
    uneven = gemv.linear_triton(x, w, gemv.GemvTiles(16, 256, 4, 4))  # 3 + 3 + 3 + 1 chunks
    ref = F.linear(x, w)
    for got in (first, whole, split, uneven):
        assert _close(got, ref, dtype)
    assert _close(split, whole, dtype) and _close(uneven, whole, dtype)


def test_counters_left_zero_and_owned():
    x, w = _case(37, 100, (3,), FP32, seed=22)
    gemv.linear_triton(x, w, gemv.GemvTiles(8, 16, 3, 2))
    gemv.linear_triton(x, w, gemv.GemvTiles(8, 16, 7, 2))
    ours = {k: c for k, c in sync._COUNTERS.items() if k[2] == "gemv"}
    assert (torch.device(x.device), 5, "gemv") in ours  # its own buffers, not the routed ones'
    assert all(int(c.abs().sum()) == 0 for c in ours.values())
    buf = sync.counters(x.device, 5, "gemv")
    assert sync.counters(x.device, 5, "gemv") is buf  # one buffer per (device, size, user)


# ===== negative control =====


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_negative_control(dtype):
    N, K = 1281, 2560
    x, w = _case(N, K, (2,), dtype, seed=23)
    ref = F.linear(x, w)
    n0 = 700
    k0 = int((x[0].double() * w[n0].double()).abs().argmax())  # its row's largest product
    bad = w.clone()
    bad[n0, k0] = w[n0, k0] * -7  # -8x of itself: moves output n0 by 8x its largest term
    got = gemv.linear_triton(x, bad, _tiles(N, K))
    ok = _ok(got, ref, dtype)
    assert not bool(ok[0, n0])  # caught ...
    assert not _close(got, ref, dtype)
    ok[:, n0] = True
    assert bool(ok.all())  # ... and nothing else moved


# ===== dispatch and graph capture =====


def test_dispatch_picks_the_path():
    x, w = _case(130, 1000, (2, 1), BF16, seed=24)
    fused = DEVICE == "cuda"  # CPU tensors always take F.linear
    want = gemv.linear_triton(x, w) if fused else F.linear(x, w)
    assert torch.equal(gemv.linear(x, w), want)
    assert torch.equal(gemv.linear(x, w, kc=KernelConfig(fused=False)), F.linear(x, w))
    x3 = _case(130, 1000, (3,), BF16, seed=25)[0]  # over DISPATCH_MAX_ROWS
    wt = w.t().contiguous().t()  # not contiguous
    for xx, ww in ((x3, w), (x, wt), (x.half(), w.half())):
        assert torch.equal(gemv.linear(xx, ww), F.linear(xx, ww))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA (the interpreter runs on CPU)")
def test_graph_replay_equals_eager():
    # decode is captured: static shapes, no host sync, split-K counters reset inside the graph;
    # replays follow new inputs and equal eager bit for bit
    shapes = [(2560, 6144), (1281, 2560), (16480, 2560), (37, 100)]
    cases = [_case(N, K, (2, 1), BF16, seed=30 + i) for i, (N, K) in enumerate(shapes)]

    def step():
        return [gemv.linear_triton(x, w) for x, w in cases]
    graph, out = capture(step)
    for seed in (40, 41, 42):
        gen = torch.Generator().manual_seed(seed)
        for x, _ in cases:
            x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        graph.replay()
        want = step()
        assert all(torch.equal(o, e) for o, e in zip(out, want))
        assert all(_close(o, F.linear(x, w), BF16) for o, (x, w) in zip(out, cases))
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for k, c in sync._COUNTERS.items() if k[2] == "gemv")
