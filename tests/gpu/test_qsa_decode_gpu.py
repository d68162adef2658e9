"""The fused QSA attention decode (ftchat/kernels/qsa_decode.py, qsa.attention_decode_fused)
against the torch reference (qsa.attention_mixer_ref and its parts), docs/model.md 4.5.

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_qsa_decode_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_qsa_decode_gpu.py
(TRITON_INTERPRET=1 alone also picks the CPU.) The interpreter runs fewer decode steps at the
real geometry (several seconds a step); FTCHAT_QSA_STEPS overrides the step count everywhere.

Geometries: real (Hq 24, Hkv 2, hd 256, rd 64, Hi 4, di 128, r 4, budget 2048), small (Hq 6,
Hkv 2: 3 query heads per kv head, padded to 16 in the kernel; hd 32, rd 8, Hi 2, di 16, r 4,
budget 8: two blocks chosen), odd (r 2, budget 6, one query head per kv head, Hi 3). Contexts
are long enough that the selection is sparse (real: ~3000 positions > 2051; small: 200 > 11).
Cache slots no one has written are NaN, so a read of one shows as NaN in the output.

Tolerances (`_excess`):
  * fp32: |got - ref| <= 1e-5 |ref| + 1e-5 max|ref|: both paths round nothing; summation
    orders and the rsqrt/exp/cos/sin implementations differ (~1e-7 relative, measured <= 7e-7
    absolute on O(1) values).
  * bf16 q, k, iq, k̄, v, ik (the prep kernel): within 4 bf16 ulps of the reference, values
    under 2^-6 max|ref| counting as that size. Both paths round the same fp32 quantities at the
    same points (norm output, cos, sin, each RoPE product and sum, pooled key), so almost every
    value is identical (measured: all, on CPU); a value within ~1e-7 of a rounding boundary can
    round the other way (1 ulp), and the RoPE sum of two such values moves by about an ulp more.
  * bf16 attention output ("rows"): within 8 ulps of max(|ref|, rms of its row). The reference
    rounds every softmax probability to bf16 (2^-9 relative, random signs) before P.V while the
    kernel keeps them fp32; those errors add up to an error of the row's typical magnitude
    (std ~2^-9 rms, i.e. up to an ulp of the rms), not of each (possibly tiny) element: the
    largest of ~10^4 such values is ~4 std. Measured <= 3 ulps; per-element ulps would be ~20.
    A missing block (4 of 2051 tokens) is still caught (test_attention_negative_control_...).
  * whole decode step in bf16 (after o_proj, and with the one fused GEMV instead of four): the
    same "rows" rule with 12 ulps: the o_proj GEMV carries o's error over (measured <= 3.3
    ulps on CPU) and the fused GEMV may round a projection the other way on the GPU.
  * block scores: fp32 within 1e-5 relative (exact products, another summation order); the
    index half of every key and every -1 exactly.
  * selection in the whole decode: the chosen blocks may differ only at a near tie of the
    reference's own scores (|s - s_K| <= 2^-5 max s in bf16, 1e-5 in fp32): the paths' iq and k̄
    can differ by an ulp (GEMV), and a top-k is discontinuous (docs/model.md 10). Such steps
    are not compared (at most a quarter of them); the caches always are.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON
from ftchat.kernels import qsa_attention as qa
from ftchat.kernels import qsa_decode as qd
from ftchat.kernels.config import KernelConfig
from ftchat.model import qsa
from ftchat.model.kv_cache import AttentionCache
from ftchat.model.config import ModelArgs
from ftchat.model.spec import dense_specs
from ftchat.model.synth import _init, preset_config
from tests.kernel_inputs import old_decode_blocks

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE") or ("cpu" if INTERPRET else "cuda")
BF16_ULPS = 4  # prep outputs and caches
ROWS_ULPS = 8  # the attention output, at its row's rms
STEP_ULPS = 12  # the whole step's output
FLOOR = 2**-6  # bf16 prep outputs: values under FLOOR * max|ref| are compared at that size
NORMS = ("q_norm.weight", "k_norm.weight", "indexer.q_layernorm.weight", "indexer.k_layernorm.weight")


@pytest.fixture(autouse=True)
def _triton():
    assert HAS_TRITON, "these tests need triton"
    if DEVICE == "cpu":
        assert INTERPRET, "FTCHAT_TEST_DEVICE=cpu needs TRITON_INTERPRET=1"
    else:
        assert torch.cuda.is_available(), "no CUDA: set FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1"


# ===== geometries, weights, caches =====


def _args(geo: str) -> ModelArgs:
    real = ModelArgs.from_hf(preset_config("flash-next", 4, eos=248044))
    if geo == "real":
        return real
    small = dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                 indexer_n_heads=2, indexer_head_dim=16, indexer_budget=8)
    if geo == "small":
        return dataclasses.replace(real, **small)
    if geo == "odd":  # r 2, one query head per kv head, 3 index heads, rd 16
        return dataclasses.replace(real, **{
            **small, "num_attention_heads": 2, "head_dim": 64, "indexer_n_heads": 3,
            "indexer_head_dim": 32, "indexer_budget": 6, "indexer_compress_ratio": 2})
    raise AssertionError(geo)


def _steps(geo: str) -> int:
    if "FTCHAT_QSA_STEPS" in os.environ:
        return int(os.environ["FTCHAT_QSA_STEPS"])
    if geo == "real":
        return 4 if DEVICE == "cpu" else 24
    return 200 if geo == "small" else 80


def _lengths(geo: str, B: int) -> list[int]:
    """Each row's context before the first step (row 1 shorter, another block phase)."""
    base = [3001, 2811] if geo == "real" else [0, 13]
    return base[:B]


def _layer(a: ModelArgs, dtype: torch.dtype, seed: int) -> dict:
    """One attention layer's weights on DEVICE (the synthetic checkpoint's init)."""
    i = next(i for i in range(a.num_hidden_layers) if a.is_attention(i))
    p = f"layers.{i}.self_attn."
    gen = torch.Generator().manual_seed(seed)
    specs = {k[len(p):]: s for k, s in dense_specs(a).items() if k.startswith(p)}
    return {k: _init(s.shape, s.init, gen).to(DEVICE, dtype) for k, s in specs.items()}


def _cache(a: ModelArgs, lengths: list[int], L: int, w: dict, dtype: torch.dtype, seed: int,
           empty: float = float("nan")) -> AttentionCache:
    """A layer cache of capacity L whose row b holds lengths[b] tokens: random k, v and raw ik,
    k̄ of the complete blocks pooled from them (qsa.block_keys, as the prefill writes it). Every
    other slot holds `empty`, NaN by default: nothing may read it before the decode writes it."""
    B, r = len(lengths), a.indexer_compress_ratio
    Hkv, hd, di = a.num_key_value_heads, a.head_dim, a.indexer_head_dim
    gen = torch.Generator().manual_seed(seed)
    nan = lambda *s: torch.full(s, empty, dtype=dtype, device=DEVICE)  # noqa: E731
    c = AttentionCache(nan(B, L, Hkv, hd), nan(B, L, Hkv, hd), nan(B, L, di), nan(B, L // r, di))
    for b, n in enumerate(lengths):
        for t in (c.k, c.v, c.ik):
            t[b, :n] = torch.randn(n, *t.shape[2:], generator=gen).to(DEVICE, dtype)
        nb = n // r
        if nb:
            raw = c.ik[b, : nb * r].unflatten(0, (nb, r))
            start = torch.arange(nb, device=DEVICE) * r
            c.kbar[b, :nb] = qsa.block_keys(raw, start, w, a)
    return c


def _tensors(c: AttentionCache) -> dict[str, Tensor]:
    """The cache's tensors by field name (k, v, ik, kbar; FP8: the scales too)."""
    return {f.name: getattr(c, f.name) for f in dataclasses.fields(c)
            if getattr(c, f.name) is not None}


def _clone(c: AttentionCache) -> AttentionCache:
    return dataclasses.replace(c, **{n: t.clone() for n, t in _tensors(c).items()})


def _prep(proj: Tensor, pos: Tensor, c: AttentionCache, norms, dims, a: ModelArgs):
    """qsa_prep of proj into the cache c (the fused decode's call)."""
    return qd.qsa_prep(proj, pos, c.k, c.v, c.ik, c.kbar, norms, dims, a.rms_norm_eps,
                       a.rope_theta, c.kv_scales())


def _split(proj: Tensor, a: ModelArgs):
    """The reference's four projection outputs [B, 1, *] from a fused proj [B, NP]."""
    Hq, Hkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    sizes = [2 * Hq * hd, Hkv * hd, Hkv * hd, (a.indexer_n_heads + 1) * a.indexer_head_dim]
    return [t[:, None] for t in proj.split(sizes, dim=-1)]


def _gate(proj: Tensor, a: ModelArgs) -> Tensor:
    hd = a.head_dim
    return proj[:, : a.num_attention_heads * 2 * hd].unflatten(-1, (-1, 2 * hd))[..., hd:]


# ===== tolerance =====


def _ulp(x: Tensor) -> Tensor:
    _, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), e - 8)  # bf16: 2^(floor(log2 x) - 7)


def _excess(got: Tensor, ref: Tensor, kind: str, ulps: int | None = None) -> float:
    """max |got - ref| / tolerance (<= 1 passes); NaN must sit at the same places in both.
    kind: fp32, bf16 (ulps, floor FLOOR * max), rows (ulps of max(|ref|, rms of the row))."""
    got, ref = got.double(), ref.double()
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan), "NaN where the reference has none (or the reverse)"
    got, ref = got.masked_fill(nan, 0.0), ref.masked_fill(nan, 0.0)
    err, mag = (got - ref).abs(), ref.abs()
    top = float(mag.max()) if mag.numel() else 1.0
    top = top or 1.0
    if kind == "fp32":
        tol = 1e-5 * mag + 1e-5 * top
    elif kind == "bf16":
        tol = (ulps or BF16_ULPS) * _ulp(mag.clamp(min=FLOOR * top))
    elif kind == "rows":
        rms = ref.flatten(1).pow(2).mean(-1).sqrt().view(-1, *[1] * (ref.dim() - 1))
        tol = (ulps or ROWS_ULPS) * _ulp(torch.maximum(mag, rms).clamp(min=1e-30))
    else:
        raise AssertionError(kind)
    return float((err / tol).max()) if err.numel() else 0.0


def _kind(dtype: torch.dtype, bf16: str = "bf16") -> str:
    return "fp32" if dtype == torch.float32 else bf16


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


# ===== kernel 1: norms, RoPE, cache and k̄ writes =====


def _run_prep(a, dtype, lengths, steps, seed, L=None, shift=0):
    """Worst _excess of q, iq over `steps` steps of random projections (the same into both) and
    of the four caches after them; shift moves the kernel's positions (the negative control)."""
    w = _layer(a, dtype, seed)
    L = L or max(lengths) + steps + 3
    ref_c = _cache(a, lengths, L, w, dtype, seed + 1)
    got_c = _clone(ref_c)
    dims = qsa.qsa_dims(a)
    norms = tuple(w[n] for n in NORMS)
    gen = torch.Generator().manual_seed(seed + 2)
    worst: dict[str, float] = {}
    kind = _kind(dtype)
    for t in range(steps):
        pos = torch.tensor(lengths, device=DEVICE)[:, None] + t  # [B, 1]
        proj = torch.randn(len(lengths), dims.proj_width, generator=gen).to(DEVICE, dtype)
        q_r, _, iq_r = qsa.attention_inputs_ref(*_split(proj, a), w, ref_c, pos, a)
        q_k, iq_k = _prep(proj, pos + shift, got_c, norms, dims, a)
        if shift:  # only q: the caches were written elsewhere
            return {"q": _excess(q_k, q_r[:, 0], kind)}
        for n, g, r in (("q", q_k, q_r[:, 0]), ("iq", iq_k, iq_r[:, 0])):
            assert g.dtype == dtype and g.shape == r.shape
            worst[n] = max(worst.get(n, 0.0), _excess(g, r, kind))
    got_t = _tensors(got_c)
    worst.update({n: _excess(got_t[n], t, kind) for n, t in _tensors(ref_c).items()})  # all slots
    return worst


def _assert_pass(worst):
    print(" ".join(f"{k}={v:.3g}" for k, v in worst.items()), end=" ")  # shown with -s
    assert max(worst.values()) <= 1, worst


@DTYPES
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small", "odd"])
def test_prep_matches_reference(geo, B, dtype):
    a = _args(geo)
    steps = 2 * a.indexer_compress_ratio + 1  # every block phase, two completions per row
    _assert_pass(_run_prep(a, dtype, _lengths(geo, B), steps, seed=B))


@DTYPES
def test_prep_at_the_largest_positions(dtype):
    """RoPE angles up to 262143 rad (the model's last position): the fp32 inv_freq, cos and sin
    must agree with torch's at large arguments (a low-accuracy cos would not)."""
    a = _args("small")
    n = a.max_position_embeddings
    _assert_pass(_run_prep(a, dtype, [n - 12, n - 9], 9, seed=5, L=n))


@DTYPES
def test_prep_negative_control_shifted_position(dtype):
    worst = _run_prep(_args("small"), dtype, [40, 61], 1, seed=6, shift=1)
    print(worst, end=" ")
    assert worst["q"] > 1  # RoPE one position off is caught


# ===== kernel 2 (+ torch.topk): block scores, ranking keys, selection =====


def _index_inputs(a, B, L, lengths, dtype, seed):
    """iq [B, Hi, di] and k̄ [B, L // r, di]: random, NaN past each row's complete blocks."""
    gen = torch.Generator().manual_seed(seed)
    r = a.indexer_compress_ratio
    iq = torch.randn(B, a.indexer_n_heads, a.indexer_head_dim, generator=gen).to(DEVICE, dtype)
    kbar = torch.randn(B, L // r, a.indexer_head_dim, generator=gen).to(DEVICE, dtype)
    for b, n in enumerate(lengths):
        kbar[b, (n + 1) // r :] = float("nan")
    return iq, kbar


def _chosen(idx: Tensor, ok: Tensor, r: int) -> list[set[int]]:
    """Chosen blocks per row of select_blocks' (idx, ok): the valid slots' blocks."""
    return [set((i[o] // r).tolist()) for i, o in zip(idx, ok)]


def _chosen_fused(blocks: Tensor, keys: Tensor) -> list[set[int]]:
    return [set(b[k >= 0].tolist()) for b, k in zip(blocks, keys)]


def _ref_chosen(iq, kbar, pos, kv_len, a) -> list[set[int]]:
    """The reference's chosen blocks (its tail slots excluded)."""
    r, top = a.indexer_compress_ratio, a.indexer_budget // a.indexer_compress_ratio
    idx, ok = qsa.select_blocks(iq, kbar, pos, kv_len, a)
    K = min(top, min(kv_len // r, kbar.shape[1]))
    return _chosen(idx[:, : K * r], ok[:, : K * r], r)


@DTYPES
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small", "odd"])
def test_rank_keys_and_selection_match_reference(geo, B, dtype):
    a = _args(geo)
    r = a.indexer_compress_ratio
    L = 3072 if geo == "real" else 256
    lengths = [L - 7, L // 3][:B]  # row 1: most blocks incomplete
    iq, kbar = _index_inputs(a, B, L, lengths, dtype, seed=B)
    pos = torch.tensor(lengths, device=DEVICE)[:, None]
    for kv_len in (max(lengths) + 1, L):  # eager span, graph span
        N = min(kv_len // r, kbar.shape[1])
        keys = qd.qsa_rank_keys(iq, kbar, pos, N, r)
        s = qsa.block_scores(iq[:, None], kbar[:, :N])[:, 0]
        complete = (torch.arange(N, device=DEVICE) + 1) * r <= pos + 1
        want = qsa.rank_key(s, complete)
        assert torch.equal(keys < 0, want < 0)  # exactly the incomplete blocks
        assert torch.equal(keys & 0xFFFFFFFF, want & 0xFFFFFFFF)  # the index half
        got_s = (keys >> 32).to(torch.int32).view(torch.float32)
        err = _excess(got_s.masked_fill(keys < 0, 0), s.nan_to_num(0).masked_fill(want < 0, 0), "fp32")
        assert err <= 1, err
        blocks, bkeys = qsa.select_blocks_fused(iq, kbar, pos, kv_len, a)
        assert _chosen_fused(blocks, bkeys) == _ref_chosen(iq, kbar, pos[:, 0], kv_len, a)


def _tie_inputs(a, L, positive):
    """k̄ = +u on the blocks in `positive`, -u elsewhere, and iq_h = u: every score is exactly
    0.0 except the positive blocks' (equal, > 0), so the zero ties decide the rest."""
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(a.indexer_head_dim, generator=gen)
    sign = torch.tensor([1.0 if b in positive else -1.0 for b in range(L // a.indexer_compress_ratio)])
    kbar = (sign[:, None] * u)[None].to(DEVICE, torch.float32)
    iq = u.expand(1, a.indexer_n_heads, -1).contiguous().to(DEVICE)
    return iq, kbar


def test_zero_score_ties_go_to_the_lowest_block():
    a = _args("small")  # top 2 blocks
    iq, kbar = _tie_inputs(a, 80, positive={5, 9})
    pos = torch.tensor([[79]], device=DEVICE)
    blocks, keys = qsa.select_blocks_fused(iq, kbar, pos, 80, a)
    assert _chosen_fused(blocks, keys) == [{5, 9}]
    iq, kbar = _tie_inputs(a, 80, positive={9})  # one positive, then the lowest zero block
    blocks, keys = qsa.select_blocks_fused(iq, kbar, pos, 80, a)
    assert _chosen_fused(blocks, keys) == [{0, 9}] == _ref_chosen(iq, kbar, pos[:, 0], 80, a)


def test_control_ties_to_the_highest_block_differ(monkeypatch):
    """The tie check can fail: the reference with the highest-index rule picks another block."""
    a = _args("small")
    iq, kbar = _tie_inputs(a, 80, positive={9})
    pos = torch.tensor([[79]], device=DEVICE)
    blocks, keys = qsa.select_blocks_fused(iq, kbar, pos, 80, a)

    def highest(s, complete):
        bits = torch.where(s > 0, s, 0.0).view(torch.int32).long()
        return torch.where(complete, (bits << 32) | torch.arange(s.shape[-1], device=s.device), -1)

    monkeypatch.setattr(qsa, "rank_key", highest)
    assert _chosen_fused(blocks, keys) != _ref_chosen(iq, kbar, pos[:, 0], 80, a)


# ===== kernels 3 + 4: split attention and the gated combine =====


def _attn_inputs(a, B, L, lengths, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    Hq, Hkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE, dtype)  # noqa: E731
    k, v = rnd(B, L, Hkv, hd), rnd(B, L, Hkv, hd)
    for b, n in enumerate(lengths):  # past the position: never read
        k[b, n + 1 :] = float("nan")
        v[b, n + 1 :] = float("nan")
    return rnd(B, Hq, hd), rnd(B, Hq, hd), k, v


def _attend_ref(q, gate, k, v, idx, ok, a):
    """The reference: qsa.attend over the gathered slots, then the sigmoid gate."""
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    o = qsa.attend(q[:, None], k[rows, idx], v[rows, idx], ok[:, None], a)[:, 0]
    return o * torch.sigmoid(gate.flatten(1))


@DTYPES
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small", "odd"])
def test_attention_matches_reference(geo, B, dtype):
    a = _args(geo)
    L = 3072 if geo == "real" else 256
    lengths = [L - 6, L - 60][:B]
    pos = torch.tensor(lengths, device=DEVICE)[:, None]
    iq, kbar = _index_inputs(a, B, L, lengths, dtype, seed=10 + B)
    q, gate, k, v = _attn_inputs(a, B, L, lengths, dtype, seed=20 + B)
    dims = qsa.qsa_dims(a)
    worst = {}
    slow = geo == "real" and DEVICE == "cpu"  # the interpreter: ~5 s a call; small covers the rest
    for kv_len in (max(lengths) + 1, L)[slow:]:
        idx, ok = qsa.select_blocks(iq, kbar, pos[:, 0], kv_len, a)
        ref = _attend_ref(q, gate, k, v, idx, ok, a)
        blocks, keys = qsa.select_blocks_fused(iq, kbar, pos, kv_len, a)
        # default, one tile per split, 3 (the last split part-full), a single split
        for tiles in (None,) if slow else (None, 1, 3, 10**6):
            got = qa.qsa_attention(q, gate, k, v, pos, dims, blocks=blocks, block_keys=keys,
                                   tiles=tiles)
            assert got.shape == ref.shape and got.dtype == dtype
            worst[f"blocks{tiles}"] = max(worst.get(f"blocks{tiles}", 0.0),
                                          _excess(got, ref, _kind(dtype, "rows")))
        got = qa.qsa_attention(q, gate, k, v, pos, dims, idx=idx, ok=ok)
        worst["tokens"] = max(worst.get("tokens", 0.0), _excess(got, ref, _kind(dtype, "rows")))
    _assert_pass(worst)


@DTYPES
def test_masked_slots_contribute_nothing(dtype):
    """Explicit slot lists: a third of the slots invalid and pointing at NaN rows, and the
    first 2 * 16 slots invalid (whole splits without a valid slot at tiles=1, block_n=16)."""
    a = _args("small")
    B, L = 2, 256
    lengths = [200, 150]
    q, gate, k, v = _attn_inputs(a, B, L, lengths, dtype, seed=30)
    gen = torch.Generator().manual_seed(31)
    S = 100
    idx = torch.stack([torch.randperm(n + 1, generator=gen)[:S] for n in lengths]).to(DEVICE)
    ok = torch.rand(B, S, generator=gen).to(DEVICE) > 1 / 3
    ok[:, :32] = False
    idx = torch.where(ok, idx, L - 1)  # invalid slots: NaN rows
    pos = torch.tensor(lengths, device=DEVICE)[:, None]
    ref = _attend_ref(q, gate, k, v, torch.where(ok, idx, 0), ok, a)  # the reference reads row 0
    dims = qsa.qsa_dims(a)
    for tiles in (1, 2, None):
        got = qa.qsa_attention(q, gate, k, v, pos, dims, idx=idx, ok=ok, tiles=tiles, block_n=16)
        assert not got.isnan().any()
        e = _excess(got, ref, _kind(dtype, "rows"))
        assert e <= 1, (tiles, e)


@DTYPES
@pytest.mark.parametrize("geo, drop", [("small", 1), ("real", 4)])
def test_attention_negative_control_dropped_tokens(geo, drop, dtype):
    """The tolerance catches a missing token (small: 1 of <= 11) or block (real: 4 of 2051)."""
    a = _args(geo)
    L = 3072 if geo == "real" else 256
    lengths = [L - 6]
    pos = torch.tensor(lengths, device=DEVICE)[:, None]
    iq, kbar = _index_inputs(a, 1, L, lengths, dtype, seed=40)
    q, gate, k, v = _attn_inputs(a, 1, L, lengths, dtype, seed=41)
    idx, ok = qsa.select_blocks(iq, kbar, pos[:, 0], L, a)
    ref = _attend_ref(q, gate, k, v, idx, ok, a)
    bad = ok.clone()
    bad[:, :drop] = False  # the first chosen block's first tokens
    got = qa.qsa_attention(q, gate, k, v, pos, qsa.qsa_dims(a), idx=idx, ok=bad)
    e = _excess(got, ref, _kind(dtype, "rows"))
    print(f"excess={e:.3g}", end=" ")
    assert e > 1


# ===== the whole decode step =====


class _Record:
    """Wraps a function and keeps its last positional arguments and result."""

    def __init__(self, fn):
        self.fn, self.args, self.out = fn, None, None

    def __call__(self, *args, **kw):
        self.args, self.out = args, self.fn(*args, **kw)
        return self.out


def _near_tie(ref_sel: _Record, got: list[set[int]], want: list[set[int]], a, dtype) -> bool:
    """Whether every block chosen by one path only is a near tie of the K-th best reference
    score (the reference's own scores, from its recorded select_blocks inputs)."""
    iq, kbar, pos, kv_len, _ = ref_sel.args
    r = a.indexer_compress_ratio
    N = min(kv_len // r, kbar.shape[1])
    s = qsa.block_scores(iq[:, None], kbar[:, :N])[:, 0].nan_to_num(0)  # [B, N]
    for b, (g, wnt) in enumerate(zip(got, want)):
        if g == wnt:
            continue
        kth = min(float(s[b, i]) for i in wnt)
        tol = (2**-5 if dtype == torch.bfloat16 else 1e-5) * max(float(s[b].max()), 1e-30)
        if any(abs(float(s[b, i]) - kth) > tol for i in g ^ wnt):
            return False
    return True


def _run_decode(geo, dtype, B, steps, seed, monkeypatch, prepare=None, cache_excess=None):
    """Worst _excess of the step output (steps without a selection flip) and of the caches after
    `steps` decode steps of both paths from the same context; and the number of flips.
    prepare(cache) turns the context's cache into the one both paths start from (e.g. FP8),
    cache_excess(got, ref, dtype) -> {name: excess} compares the caches after the steps."""
    a = _args(geo)
    w = _layer(a, dtype, seed)
    w_fused = dict(w)
    assert qsa.fuse_qsa_projections(w_fused)
    lengths = _lengths(geo, B)
    L = max(lengths) + steps + 4
    ref_c = _cache(a, lengths, L, w, dtype, seed + 1)
    ref_c = prepare(ref_c) if prepare else ref_c
    got_c = _clone(ref_c)
    ref_sel, got_sel = _Record(qsa.select_blocks), _Record(qsa.select_blocks_fused)
    monkeypatch.setattr(qsa, "select_blocks", ref_sel)
    monkeypatch.setattr(qsa, "select_blocks_fused", got_sel)
    gen = torch.Generator().manual_seed(seed + 2)
    worst, flips = 0.0, 0
    for t in range(steps):
        pos = torch.tensor(lengths, device=DEVICE)[:, None] + t
        kv_len = L if t % 2 else int(pos.max()) + 1  # graph span and eager span in turn
        x = torch.randn(B, 1, a.hidden_size, generator=gen).to(DEVICE, dtype)
        ref = qsa.attention_mixer_ref(x, w, ref_c, pos, kv_len, a)
        got = qsa.attention_decode_fused(x, w_fused, got_c, pos, kv_len, a)
        assert got.shape == ref.shape == x.shape and got.dtype == dtype
        want_b = _ref_chosen(*ref_sel.args[:4], a)
        got_b = _chosen_fused(*got_sel.out)
        if got_b != want_b:
            assert _near_tie(ref_sel, got_b, want_b, a, dtype), (t, got_b, want_b)
            flips += 1
        else:
            worst = max(worst, _excess(got, ref, _kind(dtype, "rows"), ulps=STEP_ULPS))
    got_t = _tensors(got_c)
    caches = (cache_excess(got_c, ref_c, dtype) if cache_excess else
              {n: _excess(got_t[n], t, _kind(dtype)) for n, t in _tensors(ref_c).items()})
    return {"out": worst, **caches}, flips


@DTYPES
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small", "odd"])
def test_fused_decode_matches_reference(geo, B, dtype, monkeypatch):
    if geo == "real" and DEVICE == "cpu" and B == 2 and dtype == torch.float32:
        pytest.skip("the kernel tests cover it; the interpreter is slow at this size")
    steps = _steps(geo)
    worst, flips = _run_decode(geo, dtype, B, steps, seed=50 + B, monkeypatch=monkeypatch)
    print(" ".join(f"{k}={v:.3g}" for k, v in worst.items()), f"flips={flips}", end=" ")
    assert flips <= steps // 4, flips
    assert max(worst.values()) <= 1, worst


def test_dispatcher_picks_the_path():
    a = _args("small")
    dtype = torch.bfloat16
    w = _layer(a, dtype, seed=60)
    qsa.fuse_qsa_projections(w)
    gen = torch.Generator().manual_seed(61)
    for T, on in ((1, True), (1, False), (3, True)):
        x = torch.randn(2, T, a.hidden_size, generator=gen).to(DEVICE, dtype)
        pos = torch.tensor([[20], [33]], device=DEVICE) + torch.arange(T, device=DEVICE)
        caches = [_cache(a, [20, 33], 64, w, dtype, seed=62, empty=0.0) for _ in range(2)]
        got = qsa.attention_mixer(x, w, caches[0], pos, 40, a, kc=KernelConfig(fused=on))
        fused = x.is_cuda and T == 1 and on  # CPU tensors (interpreter), prefill, off: the reference
        fn = qsa.attention_decode_fused if fused else qsa.attention_mixer_ref
        want = fn(x, w, caches[1], pos, 40, a)
        assert torch.equal(got, want)
        mine, theirs = _tensors(caches[0]), _tensors(caches[1])
        assert all(torch.equal(t, theirs[n]) for n, t in mine.items())


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need the device")
def test_fused_step_replays_in_a_cuda_graph():
    a = _args("real")
    B, dtype = 2, torch.bfloat16
    w = _layer(a, dtype, seed=70)
    qsa.fuse_qsa_projections(w)
    lengths = _lengths("real", B)
    L = 4096
    c_g = _cache(a, lengths, L, w, dtype, seed=71)
    c_e = _clone(c_g)
    x = torch.zeros(B, 1, a.hidden_size, device=DEVICE, dtype=dtype)
    pos = torch.tensor(lengths, device=DEVICE)[:, None]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, inv_freq) on scratch copies
        qsa.attention_mixer(x, w, _clone(c_g), pos, L, a)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qsa.attention_mixer(x, w, c_g, pos, L, a)  # kv_len: the whole capacity
    gen = torch.Generator().manual_seed(72)
    for t in range(8):
        x.copy_(torch.randn(B, 1, a.hidden_size, generator=gen).to(DEVICE, dtype))
        pos.copy_(torch.tensor(lengths, device=DEVICE)[:, None] + t)
        graph.replay()
        want = qsa.attention_decode_fused(x, w, c_e, pos, L, a)
        assert torch.equal(y, want)  # deterministic: no atomics, the same kernels
    e = _tensors(c_e)
    for n, t in _tensors(c_g).items():
        assert torch.equal(t.nan_to_num(7.0), e[n].nan_to_num(7.0))


def _span_runs(a, lengths: list[int], steps: int, L: int) -> tuple[list[Tensor], list[Tensor]]:
    """Fused decode outputs of `steps` steps from the same context: the eager step's (kv_len
    max(pos) + 1, a cache sized to the run, as verify's eager arms) and the captured step's
    (kv_len and cache the capacity L); the caches' common part checked equal."""
    dtype = torch.bfloat16
    w = _layer(a, dtype, seed=80)
    qsa.fuse_qsa_projections(w)
    c_g = _cache(a, lengths, L, w, dtype, seed=81)
    L_e = max(lengths) + steps + 1
    rows = {"k": L_e, "v": L_e, "ik": L_e, "kbar": L_e // a.indexer_compress_ratio}
    c_e = AttentionCache(**{n: t[:, : rows[n]].clone() for n, t in _tensors(c_g).items()})
    gen = torch.Generator().manual_seed(82)
    eager, graph = [], []
    for t in range(steps):
        pos = torch.tensor(lengths, device=DEVICE)[:, None] + t
        x = torch.randn(len(lengths), 1, a.hidden_size, generator=gen).to(DEVICE, dtype)
        eager.append(qsa.attention_decode_fused(x, w, c_e, pos, int(pos.max()) + 1, a))
        graph.append(qsa.attention_decode_fused(x, w, c_g, pos, L, a))
    g = _tensors(c_g)
    for n, t in _tensors(c_e).items():
        assert torch.equal(t.nan_to_num(7.0), g[n][:, : rows[n]].nan_to_num(7.0)), n
    return eager, graph


def test_eager_span_and_graph_span_agree_bit_for_bit():
    """Below the budget (here 2048 tokens) the eager step and the captured step once chose
    different K (by span, then by cache capacity) and so put the open tail in other splits:
    verify --graph found flash-next tokens differing. Now neither changes a bit
    (qsa.decode_blocks)."""
    eager, graph = _span_runs(_args("real"), [37, 110], steps=_steps("real"), L=4096)
    bad = [t for t, (e, g) in enumerate(zip(eager, graph)) if not torch.equal(e, g)]
    assert bad == []


@pytest.mark.parametrize("rule", ["span", "cache"])
def test_control_selection_sized_by_span_or_cache_changes_bits(rule, monkeypatch):
    """The check above can fail: under either old rule (tests/kernel_inputs.old_decode_blocks)
    the two steps' outputs differ."""
    lengths, steps, L = [37, 110], _steps("real"), 4096
    L_e = max(lengths) + steps + 1  # _span_runs' eager cache; its steps' kv_len are <= L_e
    sized = old_decode_blocks(rule, lambda kv_len: L_e, L)
    monkeypatch.setattr(qsa, "decode_blocks", sized)
    eager, graph = _span_runs(_args("real"), lengths, steps, L)
    assert sum(not torch.equal(e, g) for e, g in zip(eager, graph)) > 0
