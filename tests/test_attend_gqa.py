"""qsa.attend (grouped-query attention, the kv heads grouped, not repeated) against the form it
replaced, written out here: K/V repeated over the query heads (repeat_interleave: query head h
reads kv head h // rep), scores per query head, the mask, softmax in fp32. CPU.

Seen on the CPU: bf16, and fp32 with T > 1, bit-identical; fp32 with T = 1 within ~2.4e-7
(the reference's per-head [1, hd] products can take another BLAS kernel than the grouped
[rep, hd] ones), hence the tolerance."""

from __future__ import annotations

import types

import pytest
import torch

from ftchat.model.qsa import attend, attend_heads_first, kv_heads_first


def _args(Hq: int, Hkv: int, hd: int):
    return types.SimpleNamespace(num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=hd)


def _repeated(q, keys, vals, mask, repeat):
    """o [B, T, Hq*hd] with K/V repeated to every query head by `repeat`."""
    hd = q.shape[-1]
    rep = q.shape[2] // keys.shape[2]
    keys, vals = (repeat(t, rep).transpose(1, 2) for t in (keys, vals))  # [B, Hq, L, hd]
    scores = (q.transpose(1, 2) @ keys.transpose(-1, -2)) * hd**-0.5  # [B, Hq, T, L]
    scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ vals).transpose(1, 2).flatten(-2)


def reference(q, keys, vals, mask):
    return _repeated(q, keys, vals, mask, lambda t, rep: t.repeat_interleave(rep, dim=2))


def _inputs(B, T, L, Hq, Hkv, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, hd, generator=g).to(dtype)
    keys, vals = (torch.randn(B, L, Hkv, hd, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(B, T, L, generator=g) < 0.6
    mask[..., 0] |= ~mask.any(-1)  # every row attends somewhere; fully masked rows: below
    return q, keys, vals, mask


SHAPES = [(B, T, L, Hq, Hkv) for B in (1, 2) for T in (1, 7) for L in (1, 45, 300)
          for Hq, Hkv in ((4, 4), (4, 2), (16, 2))]


@pytest.mark.parametrize("B, T, L, Hq, Hkv", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_matches_the_repeated_kv_form(B, T, L, Hq, Hkv, dtype):
    """fp32: within 1e-6 (bit-identical but for T = 1 with rep >= 8); bf16: within bf16's
    default tolerance (rtol 1.6e-2), bit-identical as measured on the CPU."""
    a = _args(Hq, Hkv, 64)
    q, keys, vals, mask = _inputs(B, T, L, Hq, Hkv, 64, dtype)
    out = attend(q, keys, vals, mask, a)
    assert out.shape == (B, T, Hq * 64) and out.dtype == dtype
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, reference(q, keys, vals, mask), **tol)


def test_the_comparison_sees_the_head_order():
    """Control: kv heads repeated whole (h reads kv head h % Hkv) give another output, so the
    comparison above checks the grouping order."""
    a = _args(16, 2, 64)
    q, keys, vals, mask = _inputs(2, 7, 45, 16, 2, 64, torch.float32)
    tiled = _repeated(q, keys, vals, mask, lambda t, rep: t.repeat(1, 1, rep, 1))
    assert (attend(q, keys, vals, mask, a) - tiled).abs().max() > 0.1


@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (16, 2)])
def test_a_fully_masked_row_averages_every_value(Hq, Hkv):
    """A query that may see nothing (every score at finfo.min) weighs all L tokens equally, as
    the repeated form did: its output is the mean of its kv head's values."""
    a = _args(Hq, Hkv, 64)
    q, keys, vals, mask = _inputs(2, 3, 45, Hq, Hkv, 64, torch.float32)
    mask[1, 2] = False
    out = attend(q, keys, vals, mask, a).unflatten(-1, (Hq, 64))
    mean = vals[1].mean(0).repeat_interleave(Hq // Hkv, dim=0)  # [Hq, hd]
    torch.testing.assert_close(out[1, 2], mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, reference(q, keys, vals, mask).unflatten(-1, (Hq, 64)),
                               atol=1e-6, rtol=1e-6)


def test_query_chunks_over_kv_prepared_once_equal_one_call():
    """The callers' pattern: kv_heads_first once, attend_heads_first per query chunk,
    concatenated: the one-call output, bit for bit (fp32, T > 1 chunks)."""
    a = _args(16, 2, 64)
    q, keys, vals, mask = _inputs(1, 12, 300, 16, 2, 64, torch.float32)
    kh, vh = kv_heads_first(keys, vals)
    assert kh.shape == (1, 2, 300, 64) and kh.is_contiguous() and vh.is_contiguous()
    chunks = torch.cat([attend_heads_first(q[:, i:i + 4], kh, vh, mask[:, i:i + 4], a)
                        for i in range(0, 12, 4)], dim=1)
    assert torch.equal(chunks, attend(q, keys, vals, mask, a))
