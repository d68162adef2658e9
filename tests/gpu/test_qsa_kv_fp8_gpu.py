"""The fused QSA decode with an FP8 K/V cache (ftchat/model/kv_cache.py; the FP8 switch of
ftchat/kernels/qsa_decode.py) against the torch path with the same FP8 cache.

Run as tests/gpu/test_qsa_decode_gpu.py, whose geometries, inputs, helpers and tolerances these
tests reuse (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_qsa_kv_fp8_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_qsa_kv_fp8_gpu.py
The interpreter runs fewer decode steps (FTCHAT_QSA_STEPS overrides the count everywhere).

The FP8 caches start as the bf16 tests' random caches quantized by `kv_cache.quantize_rows`
(unwritten slots NaN: their codes are NaN, so a read of one still shows as NaN).

Tolerances:
  * q, iq, ik, k̄: those of the bf16 tests (fp32 1e-5 relative; bf16 4 ulps).
  * the scales: the same (amax / 448 of the same model-dtype row, one IEEE division).
  * the codes: identical where both paths computed the same model-dtype k (measured: every code
    on CPU). Where k differs by an ulp (the GPU's rsqrt/cos/sin) the division by the scale can
    land on the other side of an e4m3 rounding boundary: then the dequantized value may differ
    by one e4m3 step, 2^-3 of max(|x|, 2^-6 amax of its row) (the subnormal steps are finer).
    At most 1% of the codes may differ at all.
  * the attention output ("rows", 8 ulps) and the whole step (12 ulps): as the bf16 tests. Both
    paths attend over the same dequantized K/V (fp32(code) * scale, rounded to the model dtype).
A control: the kernel reading the codes with every scale 1 (the scale ignored) fails "rows".
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch import Tensor

from ftchat.codecs import fp8 as kc
from ftchat.kernels import qsa_attention as qa
from ftchat.model import qsa
from ftchat.model.kv_cache import AttentionCache, gather_kv
from tests.gpu.test_qsa_decode_gpu import (DEVICE, DTYPES, NORMS, _args, _attn_inputs, _cache,
                                           _clone, _excess, _index_inputs, _kind, _layer,
                                           _lengths, _prep, _split, _tensors,
                                           _triton)  # noqa: F401 (autouse)
from tests.gpu.test_qsa_decode_gpu import _run_decode as _run_decode_bf16

pytestmark = pytest.mark.gpu
MAX_FLIPS = 0.01  # codes that may differ between the paths (fraction)


def _steps(geo: str) -> int:
    if "FTCHAT_QSA_STEPS" in os.environ:
        return int(os.environ["FTCHAT_QSA_STEPS"])
    if DEVICE == "cpu":  # the interpreter: every block phase a few times
        return {"real": 2, "small": 24, "odd": 16}[geo]
    return {"real": 24, "small": 200, "odd": 80}[geo]


def _fp8(c: AttentionCache) -> AttentionCache:
    """The layer cache c with k and v as FP8 codes and scales (codecs.fp8.quantize_rows)."""
    (k, k_scale), (v, v_scale) = kc.quantize_rows(c.k), kc.quantize_rows(c.v)
    return dataclasses.replace(c, k=k, v=v, k_scale=k_scale, v_scale=v_scale)


def _cache_excess(got: AttentionCache, ref: AttentionCache, dtype: torch.dtype
                  ) -> dict[str, float]:
    """Worst excess per cache tensor (<= 1 passes): the codes by their dequantized values (one
    e4m3 step, module docstring) and the fraction of differing codes against MAX_FLIPS."""
    out = {}
    got, ref = _tensors(got), _tensors(ref)
    for n in ref:
        if ref[n].dtype != kc.FP8:
            out[n] = _excess(got[n], ref[n], _kind(dtype))
            continue
        g = kc.dequantize_rows(got[n], got[f"{n}_scale"], torch.float32).double()
        r = kc.dequantize_rows(ref[n], ref[f"{n}_scale"], torch.float32).double()
        nan = r.isnan()
        assert torch.equal(g.isnan(), nan), f"{n}: NaN where the reference has none (or back)"
        g, r = g.masked_fill(nan, 0.0), r.masked_fill(nan, 0.0)
        row = r.abs().amax(-1, keepdim=True)
        tol = 2**-3 * torch.maximum(r.abs(), 2**-6 * row).clamp(min=1e-30)
        out[n] = float(((g - r).abs() / tol).max())
        flips = (got[n].view(torch.uint8) != ref[n].view(torch.uint8)) & ~nan
        out[f"{n} flips"] = float(flips.float().mean()) / MAX_FLIPS
    return out


def _assert_pass(worst: dict[str, float]) -> None:
    print(" ".join(f"{k}={v:.3g}" for k, v in worst.items()), end=" ")  # shown with -s
    assert max(worst.values()) <= 1, worst


# ===== kernel 1: the FP8 cache writes =====


@DTYPES
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small", "odd"])
def test_prep_writes_the_fp8_cache_of_the_reference(geo, B, dtype):
    a = _args(geo)
    w = _layer(a, dtype, seed=B)
    lengths = _lengths(geo, B)
    steps = 2 * a.indexer_compress_ratio + 1  # every block phase, two completions per row
    ref_c = _fp8(_cache(a, lengths, max(lengths) + steps + 3, w, dtype, seed=B + 1))
    got_c = _clone(ref_c)
    dims, norms = qsa.qsa_dims(a), tuple(w[n] for n in NORMS)
    gen = torch.Generator().manual_seed(B + 2)
    worst: dict[str, float] = {}
    for t in range(steps):
        pos = torch.tensor(lengths, device=DEVICE)[:, None] + t
        proj = torch.randn(B, dims.proj_width, generator=gen).to(DEVICE, dtype)
        q_r, _, iq_r = qsa.attention_inputs_ref(*_split(proj, a), w, ref_c, pos, a)
        q_k, iq_k = _prep(proj, pos, got_c, norms, dims, a)
        for n, g, r in (("q", q_k, q_r[:, 0]), ("iq", iq_k, iq_r[:, 0])):
            worst[n] = max(worst.get(n, 0.0), _excess(g, r, _kind(dtype)))
    assert got_c.k.dtype == kc.FP8 and got_c.k_scale.dtype == torch.float32
    _assert_pass({**worst, **_cache_excess(got_c, ref_c, dtype)})


def test_prep_quantizes_zero_rows_to_zero_codes_and_scale_one():
    """A zero v row (its projection slice zero): codes 0, scale 1, as quantize_rows."""
    a = _args("small")
    dtype = torch.bfloat16
    w = _layer(a, dtype, seed=3)
    c = _fp8(_cache(a, [20], 32, w, dtype, seed=4))
    dims = qsa.qsa_dims(a)
    proj = torch.randn(1, dims.proj_width, generator=torch.Generator().manual_seed(5))
    hd, Hkv = a.head_dim, a.num_key_value_heads
    v0 = 2 * a.num_attention_heads * hd + Hkv * hd  # v of kv head 0
    proj[:, v0 : v0 + hd] = 0
    pos = torch.tensor([[20]], device=DEVICE)
    _prep(proj.to(DEVICE, dtype), pos, c, tuple(w[n] for n in NORMS), dims, a)
    assert not c.v[0, 20, 0].view(torch.uint8).any() and float(c.v_scale[0, 20, 0]) == 1.0
    assert c.v[0, 20, 1].float().abs().max() == kc.FP8_MAX  # the other head: its amax code


# ===== kernels 3 + 4: attention over FP8 codes =====


def _fp8_kv(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    (kq, ks), (vq, vs) = kc.quantize_rows(k), kc.quantize_rows(v)
    return kq, vq, ks, vs


def _attend_fp8_ref(q, gate, kq, vq, ks, vs, idx, ok, a):
    """The torch path's attention over the dequantized gathered slots (qsa.sparse_attention)."""
    cache = AttentionCache(kq, vq, kq, kq, ks, vs)  # ik, kbar: not read here
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    keys, vals = gather_kv(cache, (rows, idx), q.dtype)
    o = qsa.attend(q[:, None], keys, vals, ok[:, None], a)[:, 0]
    return o * torch.sigmoid(gate.flatten(1))


def _attention_case(geo, B, dtype, seed):
    a = _args(geo)
    L = 3072 if geo == "real" else 256
    lengths = [L - 6, L - 60][:B]
    pos = torch.tensor(lengths, device=DEVICE)[:, None]
    iq, kbar = _index_inputs(a, B, L, lengths, dtype, seed=seed)
    q, gate, k, v = _attn_inputs(a, B, L, lengths, dtype, seed=seed + 10)
    return a, L, pos, iq, kbar, q, gate, _fp8_kv(k, v)


@DTYPES
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small", "odd"])
def test_attention_over_fp8_codes_matches_reference(geo, B, dtype):
    if geo == "real" and DEVICE == "cpu" and B == 2:
        pytest.skip("the interpreter: ~5 s a call at this size; B 1 and the small geometries "
                    "cover it")
    a, L, pos, iq, kbar, q, gate, (kq, vq, ks, vs) = _attention_case(geo, B, dtype, 70 + B)
    dims = qsa.qsa_dims(a)
    worst = {}
    slow = geo == "real" and DEVICE == "cpu"
    for kv_len in (max(pos[:, 0].tolist()) + 1, L)[slow:]:  # eager span, graph span
        idx, ok = qsa.select_blocks(iq, kbar, pos[:, 0], kv_len, a)
        ref = _attend_fp8_ref(q, gate, kq, vq, ks, vs, idx, ok, a)
        blocks, keys = qsa.select_blocks_fused(iq, kbar, pos, kv_len, a)
        for tiles in (None,) if slow else (None, 1, 3):
            got = qa.qsa_attention(q, gate, kq, vq, pos, dims, blocks=blocks, block_keys=keys,
                                   tiles=tiles, kv_scales=(ks, vs))
            assert got.shape == ref.shape and got.dtype == dtype
            worst[f"blocks{tiles}"] = max(worst.get(f"blocks{tiles}", 0.0),
                                          _excess(got, ref, _kind(dtype, "rows")))
        got = qa.qsa_attention(q, gate, kq, vq, pos, dims, idx=idx, ok=ok, kv_scales=(ks, vs))
        worst["tokens"] = max(worst.get("tokens", 0.0), _excess(got, ref, _kind(dtype, "rows")))
    _assert_pass(worst)


@DTYPES
def test_attention_negative_control_scale_ignored(dtype):
    """Every scale 1 (codes read as values): the "rows" tolerance fails by far."""
    a, L, pos, iq, kbar, q, gate, (kq, vq, ks, vs) = _attention_case("small", 1, dtype, 80)
    idx, ok = qsa.select_blocks(iq, kbar, pos[:, 0], L, a)
    ref = _attend_fp8_ref(q, gate, kq, vq, ks, vs, idx, ok, a)
    ones = torch.ones_like(ks)
    got = qa.qsa_attention(q, gate, kq, vq, pos, qsa.qsa_dims(a), idx=idx, ok=ok,
                           kv_scales=(ones, ones))
    e = _excess(got, ref, _kind(dtype, "rows"))
    print(f"excess={e:.3g}", end=" ")
    assert e > 1


# ===== the whole decode step =====


def _run_decode(geo, dtype, B, steps, seed, monkeypatch):
    """test_qsa_decode_gpu's decode run, both paths on FP8 caches: worst excess of the step
    output (steps without a selection flip) and of the caches after the steps; the flips."""
    return _run_decode_bf16(geo, dtype, B, steps, seed, monkeypatch, prepare=_fp8,
                            cache_excess=_cache_excess)


@DTYPES
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small", "odd"])
def test_fused_decode_over_fp8_matches_reference(geo, B, dtype, monkeypatch):
    if geo == "real" and DEVICE == "cpu" and (B == 2 or dtype == torch.float32):
        pytest.skip("the kernel tests cover it; the interpreter is slow at this size")
    steps = _steps(geo)
    worst, flips = _run_decode(geo, dtype, B, steps, seed=90 + B, monkeypatch=monkeypatch)
    print(" ".join(f"{k}={v:.3g}" for k, v in worst.items()), f"flips={flips}", end=" ")
    assert flips <= steps // 4, flips
    assert max(worst.values()) <= 1, worst


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need the device")
def test_fused_fp8_step_replays_in_a_cuda_graph():
    a = _args("real")
    B, dtype = 2, torch.bfloat16
    w = _layer(a, dtype, seed=100)
    qsa.fuse_qsa_projections(w)
    lengths = _lengths("real", B)
    L = 4096
    c_g = _fp8(_cache(a, lengths, L, w, dtype, seed=101))
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
        y = qsa.attention_mixer(x, w, c_g, pos, L, a)
    gen = torch.Generator().manual_seed(102)
    for t in range(8):
        x.copy_(torch.randn(B, 1, a.hidden_size, generator=gen).to(DEVICE, dtype))
        pos.copy_(torch.tensor(lengths, device=DEVICE)[:, None] + t)
        graph.replay()
        want = qsa.attention_decode_fused(x, w, c_e, pos, L, a)
        assert torch.equal(y, want)
    c_e = _tensors(c_e)
    for n, g in _tensors(c_g).items():
        e = c_e[n]
        if g.dtype == kc.FP8:
            g, e = g.view(torch.uint8), e.view(torch.uint8)
        assert torch.equal(g.nan_to_num(7.0) if g.is_floating_point() else g,
                           e.nan_to_num(7.0) if e.is_floating_point() else e)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need the device")
def test_whole_model_fp8_graph_replay_equals_eager():
    """The tiny model on CUDA with the FP8 cache (CUDA prefill on the torch path, the fused
    decode): graph replay gives eager's tokens and logits, and the cache is really FP8."""
    from ftchat.engine import Decoder, decode, resident_backend
    from ftchat.model.synth_memory import synthetic_model

    m = synthetic_model("tiny", 8, "nvfp4-modelopt", "cuda", torch.bfloat16)
    prompts, steps = [[3, 17, 99, 4, 250, 31, 7, 8, 9, 10, 11, 12, 13, 14], [9, 120, 44, 2]], 40

    def run(graph: bool) -> tuple[list, Tensor]:
        dec = Decoder(m, resident_backend(m), len(prompts), 64, graph=graph, kv_dtype=kc.FP8)
        assert (dec.graph is not None) == graph
        attention = [c for c in dec.state.mixers if isinstance(c, AttentionCache)]
        assert attention and all(c.fp8 for c in attention)
        out = list(decode(dec, prompts, [0] * len(prompts), [steps] * len(prompts)))
        return [s.tokens for s in out], torch.stack([s.logits for s in out])

    (tok_e, log_e), (tok_g, log_g) = run(False), run(True)
    assert tok_g == tok_e and torch.equal(log_g, log_e)
