"""NVFP4 decode GEMV (ftchat/kernels/nvfp4_gemv.py) against float64 math on the dequantized weights.

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_nvfp4_gemv_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \
                                 pytest -m gpu tests/gpu/test_nvfp4_gemv_gpu.py
TRITON_INTERPRET=1 is read when the kernels are decorated, so set it on the command line. The
interpreter pays per program and per operation: there the real shape (N4 = 16384 NVFP4 rows as
qkv 10240 + z 6144, each with its own global, a 96-row bf16 tail, K = 2560) runs with large
tiles (few programs, still split-K) and at fewer (dtype, rows, tail) triples, the default tiles
on the smaller shapes.

The weights are random normals quantized by `nvfp4.quantize` (two row groups, two globals). The
reference is computed here, independently of the kernel: y64 = float64 x @ W^T with W =
nvfp4.dequantize(...) (and the tail in float64). Tolerances (the module docstring's): the kernel
is the exact-weight math summed in fp32 in another order, rounded once, so
* bf16: |got - y64| <= 2^-8 * |y64| + 2^-12 * max|y64| (half an ulp plus a small margin);
* fp32: |got - y64| <= 1e-5 * max|y64|.
Two kernel evaluations in different orders (split 1 against split > 1) agree within one bf16 ulp
(2^-7 |y64|) plus the margin, fp32 within the fp32 tolerance. Determinism: repeated calls are
bit-identical, a CUDA-graph replay equals eager, the counters are left zero. Negative controls:
one packed code (its sign flipped, at its row's largest product) or one block scale (doubled, at
its row's largest group) changed: that output column fails the check, every other one passes,
and the changed column matches the float64 math of the changed weights.
The row-loop tiles (Nvfp4Tiles.rowloop, the bs-1 default) run the same checks at bs 1, 2, 3, 8,
with bf16 and fp32 x, split 1 and > 1, K inside and overhanging the last chunk, N4 not a multiple
of block_n, the tail on and off; the E2M1 decode is checked exhaustively (every byte value at
every byte of a word, every code at every position) against the E2M1 table written out here.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from ftchat.kernels import HAS_TRITON, fp4, nvfp4_gemv as ng, sync, tl, triton
from ftchat.kernels.config import KernelConfig
from ftchat.codecs import nvfp4
from tests.kernel_inputs import capture, kernel_device


pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
BF16, FP32 = torch.bfloat16, torch.float32
REAL = (16384, 96, 2560)  # N4 (qkv 10240 | z 6144), Nt (b 48 | a 48), K
REAL_GROUPS = (10240, 6144)  # rows sharing one global
ODD = [(37, 5, 48), (130, 0, 1040), (1, 3, 16), (300, 24, 2560)]  # masked rows / K, N4 = 1


@pytest.fixture(autouse=True)
def _device():
    yield from kernel_device(DEVICE, INTERPRET, ng.HAS_TRITON)


# ===== inputs and checks =====


@functools.lru_cache(maxsize=8)
def _weights(N4: int, Nt: int, K: int, seed: int):
    # (packed, scale, g [N4], tail or None, W64 [N4 + Nt, K]) on the CPU: two row groups
    # quantized apart (each its own global, as qkv and z), the second 4x larger
    gen = torch.Generator().manual_seed(seed)
    groups = REAL_GROUPS if (N4, K) == REAL[::2] else ((N4 + 1) // 2, N4 // 2)
    qs = []
    for i, rows in enumerate(r for r in groups if r):
        qs.append(nvfp4.quantize(torch.randn(rows, K, generator=gen) * (4**i * K**-0.5)))
    packed = torch.cat([p for p, _, _ in qs])
    scale = torch.cat([s for _, s, _ in qs])
    g = torch.cat([gl.expand(p.shape[0]) for p, _, gl in qs]).contiguous()
    tail = (torch.randn(Nt, K, generator=gen) * K**-0.5).to(BF16) if Nt else None
    w64 = nvfp4.dequantize(packed, scale, g).double()  # [N4, K], the exact NVFP4 weights
    if tail is not None:
        w64 = torch.cat([w64, tail.double()])
    return packed, scale, g, tail, w64


def _case(shape, lead, dtype, seed, tail=True):
    # x [*lead, K] of dtype, the weights on DEVICE, y64 [*lead, N4 (+ Nt)]
    N4, Nt, K = shape
    packed, scale, g, t, w64 = _weights(N4, Nt, K, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, K, generator=gen).to(dtype)
    if not tail or t is None:
        t, w64 = None, w64[:N4]
    y64 = x.double() @ w64.T
    dev = [v.to(DEVICE) for v in (x, packed, scale, g)]
    return (*dev, None if t is None else t.to(DEVICE)), y64


def _tiles(shape):
    N4, Nt, K = shape
    if INTERPRET and N4 * K >= 1 << 20:  # few big programs: seconds instead of minutes
        return ng.Nvfp4Tiles(block_n=1024, block_k=512, split=5, warps=4, tail_n=32)
    if INTERPRET and N4 * K >= 1 << 19:  # mid shapes: 40 programs instead of 220
        return ng.Nvfp4Tiles(block_n=64, block_k=512, split=5, warps=2, tail_n=8)
    return None  # the defaults


def _tol(ref, dtype, ulps=0.5):
    # ulps: bf16 ulps of each element (0.5: against y64; 1: two kernel evaluations)
    ref = ref.double()
    scale = float(ref.abs().max())
    if dtype == FP32:
        return torch.full_like(ref, 1e-5 * scale)
    return ulps * 2**-7 * ref.abs() + 2**-12 * scale


def _ok(got, ref, dtype, ulps=0.5):
    return (got.double().cpu() - ref.double().cpu()).abs() <= _tol(ref.cpu(), dtype, ulps)


def _close(got, ref, dtype, ulps=0.5) -> bool:
    return bool(_ok(got, ref, dtype, ulps).all())


def _err(got, ref) -> str:
    d = (got.double().cpu() - ref.double().cpu()).abs()
    return f"max|diff| {float(d.max()):.3g} of max|ref| {float(ref.abs().max()):.3g}"


def _check(args, y64, tiles=None):
    x = args[0]
    got = ng.nvfp4_linear_triton(*args, tiles=tiles)
    assert got.shape == y64.shape and got.dtype == x.dtype and got.device == x.device
    assert _close(got, y64, x.dtype), _err(got, y64)
    ref = ng.nvfp4_linear_ref(*args)  # the torch path agrees with the same math too
    assert ref.shape == got.shape and _close(ref, y64, x.dtype), _err(ref, y64)
    return got


def _ids(v):
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


# ===== against float64 =====

if INTERPRET:  # each ~5-15 s there
    REAL_CASES = [(BF16, (1, 1), True), (FP32, (2,), True), (BF16, (2,), False),
                  (BF16, (5,), True)]
else:
    REAL_CASES = [(dt, lead, tail) for dt in (BF16, FP32) for lead in ((1, 1), (2,), (5,), (8,))
                  for tail in (True, False)]


@pytest.mark.parametrize("dtype,lead,tail", REAL_CASES, ids=_ids)
def test_real_shape_matches_float64(dtype, lead, tail):
    args, y64 = _case(REAL, lead, dtype, seed=1, tail=tail)
    got = _check(args, y64, _tiles(REAL))
    assert got.shape[-1] == REAL[0] + (REAL[1] if tail else 0)


ODD_CASES = [(shape, dt, lead) for shape in ODD for dt in (BF16, FP32)
             for lead in ((1,), (2,), (3, 1), (8,))]
if INTERPRET:  # the 2560-wide one at one pair (220 programs), eight rows at one dtype
    ODD_CASES = [c for c in ODD_CASES if (c[0][2] < 2560 and (c[2] != (8,) or c[1] == FP32))
                 or c[1:] == (BF16, (2,))]


@pytest.mark.parametrize("shape,dtype,lead", ODD_CASES, ids=_ids)
def test_default_tiles_odd_shapes(shape, dtype, lead):
    # N4 not a multiple of BLOCK_N, Nt not one of BLOCK_T, K not one of BLOCK_K (48, 1040), K =
    # 16 (one group), one NVFP4 row, no tail
    args, y64 = _case(shape, lead, dtype, seed=sum(shape) + len(lead))
    _check(args, y64)


TILES = [ng.Nvfp4Tiles(8, 16, 3, 1, 4), ng.Nvfp4Tiles(4, 32, 2, 2, 8),
         ng.Nvfp4Tiles(16, 64, 1, 4, 2), ng.Nvfp4Tiles(2, 256, 8, 1, 16),
         ng.Nvfp4Tiles(32, 128, 4, 2, 4),
         # the tensor-core path: one group a chunk (several a program), a split, a whole-K chunk
         ng.Nvfp4Tiles(16, 32, 3, 1, 4, tc=True), ng.Nvfp4Tiles(32, 32, 2, 2, 8, tc=True),
         ng.Nvfp4Tiles(64, 64, 1, 4, 2, tc=True)]


@pytest.mark.parametrize("lead", [(), (1, 1), (2,), (3, 1), (2, 2, 2)], ids=str)
@pytest.mark.parametrize("tiles", TILES, ids=["8x16s3", "4x32s2", "16x64s1", "2x256s8",
                                              "32x128s4w2", "16x32s3tc", "32x32s2tc",
                                              "64x64s1tc"])
def test_lead_shapes_tiles_and_masks(lead, tiles):
    # N4 = 37, Nt = 5, K = 48 (3 groups): masked row blocks and tail blocks, chunks of one group
    # (several a program: the prefetch), splits leaving the last program short or with one
    # chunk, block_k above K clamped; any lead shape of x
    args, y64 = _case((37, 5, 48), lead, BF16, seed=3 + len(lead))
    got = _check(args, y64, tiles)
    assert got.shape == (*lead, 42)


@pytest.mark.parametrize("shape,tiles", [((130, 0, 1040), ng.Nvfp4Tiles(8, 256, 2, 1)),
                                         ((40, 7, 1040), ng.Nvfp4Tiles(8, 64, 3, 1, 4)),
                                         ((40, 7, 1040), ng.Nvfp4Tiles(16, 512, 1, 2, 4)),
                                         ((40, 7, 1040), ng.Nvfp4Tiles(16, 64, 3, 1, 4, tc=True))],
                         ids=["130x1040s2", "40x1040cpp", "40x1040whole", "40x1040cpp_tc"])
def test_masked_k_chunks(shape, tiles):
    # K = 1040 = 65 groups: the last chunk of the last program is partly outside K (bf16 x for
    # the tensor-core tiles: fp32 x keeps the ALU path)
    args, y64 = _case(shape, (2,), BF16 if tiles.tc else FP32, seed=5)
    bk, _, cpp = ng.launch_plan(shape[2], tiles)
    assert shape[2] % (bk * cpp), "a program's chunks must overhang K here"
    _check(args, y64, tiles)


def test_scalar_global_and_mixed_tail_dtype():
    # one global for all rows ([] or [1]) equals the same value per row; an fp32 tail with bf16 x
    # and a bf16 tail with fp32 x
    x, packed, scale, g, tail = _case((37, 5, 48), (2,), BF16, seed=7)[0]
    one = g[:1].clone()
    per_row = ng.nvfp4_linear_triton(x, packed, scale, one.expand(37).contiguous(), tail)
    for gs in (one, one.reshape(())):
        assert torch.equal(ng.nvfp4_linear_triton(x, packed, scale, gs, tail), per_row)
    w64 = torch.cat([nvfp4.dequantize(packed.cpu(), scale.cpu(), one.cpu()).double(),
                     tail.double().cpu()])
    for xx, tt in ((x, tail.float()), (x.float(), tail)):
        got = ng.nvfp4_linear_triton(xx, packed, scale, one, tt)
        want = xx.double().cpu() @ w64.T
        assert _close(got, want, xx.dtype), _err(got, want)


def test_wrapper_rejects_what_it_cannot_take():
    x, packed, scale, g, tail = _case((37, 5, 48), (2,), BF16, seed=8)[0]
    bad = [
        (x[:, :40], packed[:, :20].contiguous(), scale[:, :2].contiguous(), g, None),  # K = 40
        (x, packed, scale, g, tail[:, :32]),  # tail of another K
        (x, packed, scale.float(), g, tail),  # scales not e4m3
        (x, packed, scale, g[:5], tail),  # neither one global nor one a row
        (x.half(), packed, scale, g, tail.half()),  # fp16 x
        (torch.zeros(9, 48, dtype=BF16, device=x.device), packed, scale, g, tail),  # 9 rows
        (x, packed.t().contiguous().t(), scale, g, tail),  # not contiguous (its transpose view)
    ]
    for args in bad:
        with pytest.raises(AssertionError):
            ng.nvfp4_linear_triton(*args)
    with pytest.raises(AssertionError):
        ng.nvfp4_linear_triton(x, packed, scale, g, tail, ng.Nvfp4Tiles(8, 8, 1, 1))  # < group
    with pytest.raises(AssertionError):  # tensor-core tiles of one group a chunk
        ng.nvfp4_linear_triton(x, packed, scale, g, tail, ng.Nvfp4Tiles(16, 16, 1, 1, tc=True))


def test_default_tiles_rule():
    # the documented default at the decode shape, bs 1: the row loop, one-warp programs of 8 rows
    # over 5 chunks of 512 columns (split 1); narrower outputs and fp32 x: 8 x 512 split 5
    assert ng.default_tiles(*REAL, 1) == ng.Nvfp4Tiles(8, 512, 1, 1, 4, rowloop=True)
    assert ng.launch_plan(2560, ng.default_tiles(*REAL)) == (512, 1, 5)
    assert ng.default_tiles(*REAL, 1, bf16=False) == ng.Nvfp4Tiles(8, 512, 5, 1, 4)
    assert ng.default_tiles(4096, 96, 2560, 1) == ng.Nvfp4Tiles(8, 512, 5, 1, 4)
    # from two bf16 rows the tensor-core tiles, one 256-column chunk a program; fp32 x keeps
    # the one-warp tiles
    assert ng.default_tiles(*REAL, 2) == ng.Nvfp4Tiles(64, 256, 10, 4, 4, tc=True)
    assert ng.default_tiles(*REAL, 8) == ng.default_tiles(*REAL, 2)
    assert ng.default_tiles(*REAL, 2, bf16=False) == ng.default_tiles(*REAL, 1, bf16=False)
    for N4, K in ((16384, 2560), (10240, 2560), (6144, 2560), (2560, 6144), (4096, 1024)):
        t = ng.default_tiles(N4, 96, K, bf16=False)  # the split tiles: thousands of programs
        bk, split, cpp = ng.launch_plan(K, t)
        assert (bk, split) == (t.block_k, t.split) and cpp <= 2 and K % (bk * cpp) == 0
        assert t.warps == 1 and t.block_n == 8 and bk == 512
        assert -(-N4 // t.block_n) * split >= 1000, (N4, K, t)
    for rows in (1, 2):  # what the defaults pick at the decode shape: no mask along K there
        t = ng.default_tiles(*REAL, rows)
        bk, split, cpp = ng.launch_plan(2560, t)
        assert 2560 % (bk * cpp) == 0, t
        assert not t.rowloop or (bk == 512 and t.warps == 1), t  # a group a lane (Nvfp4Tiles)


# ===== the row loop (x read once a chunk) =====

# (tiles, its id): at K = 48 (3 groups) block_k 16 is one group a chunk (split 3: a program
# each), 32 two programs' worth in one (split 1: the second chunk overhangs K), 64 one masked
# chunk
X_TILES = [
    (ng.Nvfp4Tiles(8, 16, 3, 1, 4, rowloop=True), "rows-8x16s3"),
    (ng.Nvfp4Tiles(4, 32, 1, 1, 8, rowloop=True), "rows-4x32s1"),
    (ng.Nvfp4Tiles(16, 64, 2, 2, 2, rowloop=True), "rows-16x64s2w2"),
]
X_LEADS = [(1,), (2,), (3, 1), (8,)]


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("lead", X_LEADS, ids=_ids)
@pytest.mark.parametrize("tiles", [t for t, _ in X_TILES], ids=[i for _, i in X_TILES])
def test_rowloop_tiles_match_float64(tiles, lead, dtype):
    # N4 = 37 (masked row blocks: 37 is no multiple of 4, 8 or 16), Nt = 5, K = 48; the tail on
    # for bf16, off for fp32
    tail = dtype == BF16
    args, y64 = _case((37, 5, 48), lead, dtype, seed=40 + len(lead), tail=tail)
    got = _check(args, y64, tiles)
    assert got.shape == (*lead, 42 if tail else 37)


X_SHAPES = [  # (shape, tiles, id): K = 1040 (65 groups) overhangs a program's chunks; K = 2560
    ((40, 7, 1040), ng.Nvfp4Tiles(8, 256, 2, 1, 4, rowloop=True), "rows-1040s2"),
    ((32, 4, 2560), ng.Nvfp4Tiles(8, 512, 1, 1, rowloop=True), "rows-2560s1"),
    ((32, 4, 2560), ng.Nvfp4Tiles(8, 512, 5, 1, rowloop=True), "rows-2560s5"),
]


@pytest.mark.parametrize("shape,tiles", [(s, t) for s, t, _ in X_SHAPES],
                         ids=[i for _, _, i in X_SHAPES])
@pytest.mark.parametrize("dtype,lead", [(BF16, (1,)), (FP32, (2,)), (BF16, (3,))], ids=_ids)
def test_rowloop_tiles_masked_k_and_decode_k(shape, tiles, dtype, lead):
    bk, _, cpp = ng.launch_plan(shape[2], tiles)
    assert (shape[2] % (bk * cpp) != 0) == (shape[2] == 1040)  # 1040: the last chunk is masked
    args, y64 = _case(shape, lead, dtype, seed=sum(shape))
    _check(args, y64, tiles)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_rowloop_split_invariant(dtype):
    # split 1 against split 5 (another order of the same fp32 sums) within one bf16 ulp / the
    # fp32 tolerance; the tiled defaults within the same
    shape = (16, 4, 2560) if INTERPRET else (300, 24, 2560)
    args, y64 = _case(shape, (2,), dtype, seed=43)
    outs = [ng.nvfp4_linear_triton(*args, tiles=ng.Nvfp4Tiles(8, 512, s, 1, rowloop=True))
            for s in (1, 5)]
    for got in outs:
        assert _close(got, y64, dtype), _err(got, y64)
    assert _close(outs[0], outs[1], dtype, ulps=1), _err(outs[0], outs[1])
    ref = ng.nvfp4_linear_triton(*args)
    assert _close(outs[0], ref, dtype, ulps=1), _err(outs[0], ref)


def test_rowloop_tiles_unaligned_x_and_bad_combinations():
    # bf16 x whose rows start 2 bytes off a 4-byte boundary (the int32 pair loads): copied first,
    # the same result; rowloop with tc is refused
    (x, packed, scale, g, tail), y64 = _case((37, 5, 48), (2,), BF16, seed=44)
    flat = torch.zeros(2 * 48 + 1, dtype=BF16, device=x.device)
    flat[1:].copy_(x.reshape(-1))
    xs = flat[1:].view(2, 48)
    assert xs.data_ptr() % 4 == 2
    t = ng.Nvfp4Tiles(8, 16, 3, 1, rowloop=True)
    got = ng.nvfp4_linear_triton(xs, packed, scale, g, tail, t)
    assert torch.equal(got, ng.nvfp4_linear_triton(x, packed, scale, g, tail, t))
    assert _close(got, y64, BF16), _err(got, y64)
    with pytest.raises(AssertionError):
        ng.nvfp4_linear_triton(x, packed, scale, g, tail,
                               ng.Nvfp4Tiles(16, 32, 1, 1, tc=True, rowloop=True))


# E2M1 code -> value, written out (docs/model.md section 12), then times the decodes' 2^-14
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

if HAS_TRITON:
    @triton.jit
    def _decode_kernel(w_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
        # out[j, i] = code j of word i as fp32, by the kernels' decode (fp4._codes)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < N
        w = tl.load(w_ptr + i, mask=ok, other=0)
        c0, c1, c2, c3, c4, c5, c6, c7 = fp4._codes(w)
        tl.store(out_ptr + 0 * N + i, c0, mask=ok)
        tl.store(out_ptr + 1 * N + i, c1, mask=ok)
        tl.store(out_ptr + 2 * N + i, c2, mask=ok)
        tl.store(out_ptr + 3 * N + i, c3, mask=ok)
        tl.store(out_ptr + 4 * N + i, c4, mask=ok)
        tl.store(out_ptr + 5 * N + i, c5, mask=ok)
        tl.store(out_ptr + 6 * N + i, c6, mask=ok)
        tl.store(out_ptr + 7 * N + i, c7, mask=ok)


def _all_byte_words() -> torch.Tensor:
    # int32 words where each of the 4 bytes takes all 256 values (the other bytes random), and
    # each of the 8 nibbles all 16 codes next to every code of its neighbours: 4 x 256 words for
    # the bytes, then all 65536 values of each 16-bit half (the other half random)
    gen = torch.Generator().manual_seed(45)
    def rnd(n):
        return torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64)
    v = torch.arange(256, dtype=torch.int64)
    words = [(rnd(256) & ~(0xFF << (8 * b))) | (v << (8 * b)) for b in range(4)]
    h = torch.arange(65536, dtype=torch.int64)
    words += [(rnd(65536) & ~0xFFFF) | h, (rnd(65536) & 0xFFFF) | (h << 16)]
    u = torch.cat(words)
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)


def test_decode_exhaustive():
    # the decode gives E2M1 * 2^-14 bit for bit (-0 included) for every code at every position
    words = _all_byte_words()
    N = words.numel()
    out = torch.empty(8, N, dtype=FP32, device=DEVICE)
    _decode_kernel[(triton.cdiv(N, 1024),)](words.to(DEVICE), out, N=N, BLOCK=1024)
    u = words.to(torch.int64) & 0xFFFFFFFF
    table = torch.tensor(E2M1, dtype=FP32) * 2.0**-14
    want = torch.stack([table[(u >> (4 * j)) & 15] for j in range(8)])  # [8, N]
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))


# ===== determinism, split-K and its counters =====


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_deterministic_and_split_invariant(dtype):
    shape = (32, 4, 2560) if INTERPRET else (300, 24, 2560)
    args, y64 = _case(shape, (2,), dtype, seed=21)
    t = ng.default_tiles(*shape)
    assert ng.launch_plan(2560, t)[1] > 1
    first = ng.nvfp4_linear_triton(*args, tiles=t)
    for _ in range(3):
        assert torch.equal(ng.nvfp4_linear_triton(*args, tiles=t), first)
    whole = ng.nvfp4_linear_triton(*args, tiles=ng.Nvfp4Tiles(16, 512, 1, 1))  # 5 chunks
    split = ng.nvfp4_linear_triton(*args, tiles=ng.Nvfp4Tiles(16, 256, 10, 1))  # 10 programs
    uneven = ng.nvfp4_linear_triton(*args, tiles=ng.Nvfp4Tiles(16, 256, 4, 1))  # 3+3+3+1 chunks
    for got in (first, whole, split, uneven):
        assert _close(got, y64, dtype), _err(got, y64)
    for got in (first, split, uneven):
        assert _close(got, whole, dtype, ulps=1), _err(got, whole)


def test_counters_left_zero_and_owned():
    args, _ = _case((37, 5, 48), (3,), FP32, seed=23)
    ng.nvfp4_linear_triton(*args, tiles=ng.Nvfp4Tiles(8, 16, 3, 1, 4))  # 5 + 2 blocks
    ng.nvfp4_linear_triton(*args, tiles=ng.Nvfp4Tiles(4, 16, 2, 1, 2))  # 10 + 3 blocks
    ours = {k: c for k, c in sync._COUNTERS.items() if k[2] == "nvfp4_gemv"}
    dev = torch.device(args[0].device)
    assert (dev, 7, "nvfp4_gemv") in ours and (dev, 13, "nvfp4_gemv") in ours
    assert all(int(c.abs().sum()) == 0 for c in ours.values())
    assert sync.counters(dev, 7, "nvfp4_gemv") is ours[(dev, 7, "nvfp4_gemv")]
    assert sync.counters(dev, 7, "gemv") is not ours[(dev, 7, "nvfp4_gemv")]  # not gemv's


# ===== negative controls =====


@pytest.mark.parametrize("what", ["code", "scale"])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_negative_control(what, dtype):
    shape = (300, 24, 2560)
    (x, packed, scale, g, tail), y64 = _case(shape, (2,), dtype, seed=24)
    n0 = 217
    w = nvfp4.dequantize(packed.cpu(), scale.cpu(), g.cpu()).double()  # [N4, K]
    terms = w[n0] * x[0].double().cpu()  # [K] row n0's products for row 0 of x
    packed_bad, scale_bad = packed.clone(), scale.clone()
    if what == "code":  # flip the sign of the largest product's code: moves it by 2x itself
        k0 = int(terms.abs().argmax())
        byte = packed_bad[n0, k0 // 2]
        packed_bad[n0, k0 // 2] = byte ^ (0x08 if k0 % 2 == 0 else 0x80)
    else:  # halve the block scale of the largest group (exact in e4m3 at these magnitudes)
        g0 = int(terms.view(-1, 16).sum(1).abs().argmax())
        s = scale_bad[n0, g0].float()
        assert float(s) >= 2**-5
        scale_bad[n0, g0] = (s / 2).to(torch.float8_e4m3fn)
    w_bad = nvfp4.dequantize(packed_bad.cpu(), scale_bad.cpu(), g.cpu()).double()
    assert 1 <= int((w_bad != w).sum()) <= (1 if what == "code" else 16)
    want = x.double().cpu() @ w_bad[n0]  # [2] what the changed weights give
    assert abs(float(want[0] - y64[0, n0])) > 4 * float(_tol(y64, dtype)[0, n0])  # a real move
    got = ng.nvfp4_linear_triton(x, packed_bad, scale_bad, g, tail, _tiles(shape))
    ok = _ok(got, y64, dtype)
    assert not bool(ok[0, n0])  # caught ...
    ok[:, n0] = True
    assert bool(ok.all())  # ... and nothing else moved
    assert _close(got[:, n0], want, dtype), _err(got[:, n0], want)  # the changed weights' math


# ===== dispatch and graph capture =====


def test_dispatch_picks_the_path():
    args, _ = _case((37, 5, 48), (2, 1), BF16, seed=25)
    fused = DEVICE == "cuda"  # CPU tensors always take the ref
    ref = ng.nvfp4_linear_ref(*args)
    want = ng.nvfp4_linear_triton(*args) if fused else ref
    assert torch.equal(ng.linear(*args), want)
    assert torch.equal(ng.linear(*args, kc=KernelConfig(fused=False)), ref)
    x, packed, scale, g, tail = args
    x3 = torch.cat([x.reshape(2, -1), x.reshape(2, -1)[:1]])  # 3 rows: still the kernel
    want3 = ng.nvfp4_linear_triton(x3, packed, scale, g, tail) if fused else \
        ng.nvfp4_linear_ref(x3, packed, scale, g, tail)
    assert torch.equal(ng.linear(x3, packed, scale, g, tail), want3)
    x9 = x.reshape(2, -1)[torch.arange(9) % 2]  # 9 rows: over DISPATCH_MAX_ROWS, the ref
    for a in ((x9, packed, scale, g, tail), (x.half(), packed, scale, g, tail.half()),
              (x, packed, scale, g, tail.t().contiguous().t())):  # fp16; a strided tail
        assert torch.equal(ng.linear(*a), ng.nvfp4_linear_ref(*a))
    no_tail = (x, packed, scale, g)
    want = ng.nvfp4_linear_triton(*no_tail) if fused else ng.nvfp4_linear_ref(*no_tail)
    assert torch.equal(ng.linear(*no_tail), want)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA (the interpreter runs on CPU)")
def test_graph_replay_equals_eager():
    # decode is captured: static shapes, no host sync, split-K counters reset inside the graph;
    # replays follow new inputs and equal eager bit for bit
    cases = [_case(REAL, (2, 1), BF16, seed=1)[0], _case(REAL, (1,), FP32, seed=1)[0],
             _case((37, 5, 48), (2,), BF16, seed=31)[0],
             _case((130, 0, 1040), (2,), BF16, seed=32, tail=False)[0]]

    def step():
        return [ng.nvfp4_linear_triton(*a) for a in cases]
    graph, out = capture(step)
    for seed in (40, 41, 42):
        gen = torch.Generator().manual_seed(seed)
        for a in cases:
            a[0].copy_(torch.randn(a[0].shape, generator=gen).to(a[0].dtype))
        graph.replay()
        want = step()
        assert all(torch.equal(o, e) for o, e in zip(out, want))
        assert all(_close(o, ng.nvfp4_linear_ref(*a).float(), a[0].dtype, ulps=1)
                   for o, a in zip(out, cases))
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for k, c in sync._COUNTERS.items()
               if k[2] == "nvfp4_gemv")
