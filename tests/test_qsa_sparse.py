"""The O(budget) QSA decode (docs/model.md 4.5) against the dense form `select_tokens`.

(a) the cached block keys k̄ equal a from-scratch pooling of the raw keys, bit for bit;
(b) the sparse selection equals the dense mask at every position, ties to the lowest block;
(c) decode logits equal the dense path's within TOL over a context far past the budget;
(d) a control: with ties to the highest block the comparison of (b) fails.
The query-chunked sparse prefill has its own tests (tests/test_prefill_sparse.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from ftchat.engine import decode_step, load_model, prefill, resident_backend
from ftchat.model import qsa
from ftchat.model.config import ModelArgs
from ftchat.model.kv_cache import AttentionCache
from ftchat.model.layers import apply_rope, rms_norm, rope_cos_sin
from ftchat.model.qwen4_exp import forward
from ftchat.model.state import DecodeState
from ftchat.model.synth import preset_config
from tests.kernel_inputs import old_decode_blocks

# fp32 logits (magnitude ~2-10). The sparse softmax runs over the selected tokens only, the dense
# one over all with the rest at finfo.min, whose exp(min - max) is exactly 0: the same terms,
# summed in another order (and the GEMMs blocked differently), so only rounding differs: ~1e-6.
TOL = 1e-5


def tiny_args(r: int = 4, budget: int = 8) -> ModelArgs:
    return dataclasses.replace(ModelArgs.from_hf(preset_config("tiny", None, eos=0)),
                               indexer_compress_ratio=r, indexer_budget=budget)


def norm_weight(a: ModelArgs, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"indexer.k_layernorm.weight": torch.randn(a.indexer_head_dim, generator=g) * 0.1}


def fill_cache(ik: Tensor, w: dict, a: ModelArgs, prefill_len: int) -> AttentionCache:
    """A layer cache holding raw keys ik [B, L, di], k̄ written as the model does: tokens
    [0, prefill_len) in one prefill write, then one decode write per token (K, V zero)."""
    B, L, di = ik.shape
    cache = AttentionCache.zeros(B, L, a.num_key_value_heads, a.head_dim, di,
                                 a.indexer_compress_ratio, "cpu", ik.dtype)
    pos = torch.arange(L).expand(B, L)
    spans = [(0, prefill_len)] + [(p, p + 1) for p in range(prefill_len, L)]
    for s, e in spans:
        if e > s:
            cache.ik[:, s:e] = ik[:, s:e]
            qsa.write_block_keys(cache, pos[:, s:e], w, a)
    return cache


def pooled_from_scratch(ik: Tensor, w: dict, a: ModelArgs, n: int) -> Tensor:
    """k̄ [B, n // r, di] of the complete blocks of the first n raw keys ik [B, L, di], written
    out from the spec (not through qsa.block_keys): mean in fp32, norm, RoPE at r*b."""
    r = a.indexer_compress_ratio
    N = n // r
    pooled = ik[:, : N * r].float().unflatten(1, (N, r)).mean(2).to(ik.dtype)
    kbar = rms_norm(pooled, w["indexer.k_layernorm.weight"], a.rms_norm_eps)
    cos, sin = rope_cos_sin(torch.arange(N) * r, a.rotary_dim, a.rope_theta, ik.dtype)
    return apply_rope(kbar, cos, sin)


def sparse_mask(iq: Tensor, kbar: Tensor, pos: Tensor, kv_len: int, a: ModelArgs, L: int) -> Tensor:
    """The sparse selection of queries iq [B, Hi, di] at pos [B] as a mask [B, L]."""
    idx, ok = qsa.select_blocks(iq, kbar, pos, kv_len, a)
    assert idx.shape[1] <= a.indexer_budget + a.indexer_compress_ratio - 1
    count = torch.zeros(idx.shape[0], L, dtype=torch.long).scatter_add_(1, idx, ok.long())
    assert count.max() <= 1  # no token attended twice
    return count == 1


def mismatches(iq: Tensor, ik: Tensor, w: dict, a: ModelArgs, positions, prefill_len: int = 5):
    """Positions (row-0 p) where the sparse selection differs from select_tokens, for every
    kv_len the engine uses: eager max(p)+1 and the graph's whole capacity."""
    B, L, _ = ik.shape
    cache = fill_cache(ik, w, a, prefill_len)
    bad = []
    for p in positions:
        pos = torch.tensor([p, p // 3][:B])  # row 1 shorter: its later blocks are incomplete
        want = torch.zeros(B, L, dtype=torch.bool)
        kv_len = p + 1
        want[:, :kv_len] = qsa.select_tokens(iq[:, None], ik[:, :kv_len], pos[:, None], w, a)[:, 0]
        for n in (kv_len, L):
            if not torch.equal(sparse_mask(iq, cache.kbar, pos, n, a, L), want):
                bad.append(p)
    return bad


def tie_input(a: ModelArgs, L: int, positive: set[int]):
    """Raw keys whose blocks all pool to the same k̄ up to sign, and queries = -k̄: every block's
    score is exactly 0.0 except the blocks in `positive`, whose scores are equal and > 0."""
    assert 0 not in positive
    r, di, rd = a.indexer_compress_ratio, a.indexer_head_dim, a.rotary_dim
    u = torch.randn(di, generator=torch.Generator().manual_seed(3))
    u[:rd] = 0  # nothing to rotate: every block's k̄ is the same vector, wherever it starts
    sign = torch.tensor([1.0 if b in positive else -1.0 for b in range(L // r)])
    ik = (sign[:, None] * -u).repeat_interleave(r, 0)[None]  # [1, L, di]
    w = norm_weight(a)
    kneg = pooled_from_scratch(ik, w, a, L)[0, 0]  # k̄ of a zero-score block; -kneg on the others
    iq = -kneg.expand(1, a.indexer_n_heads, -1).clone()  # <iq_h, -kneg> = |kneg|^2 > 0
    return iq, ik, w


def highest_index_key(s, complete):
    """The control: ties to the highest block index."""
    bits = torch.where(s > 0, s, 0.0).view(torch.int32).long()
    return torch.where(complete, (bits << 32) | torch.arange(s.shape[-1]), -1)


# (a) -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_block_keys_equal_pooling_from_scratch(tiny_bf16, dtype):
    m = load_model(tiny_bf16, dtype=dtype)
    a, ex = m.args, resident_backend(m)
    r = a.indexer_compress_ratio
    st = DecodeState.create(a, 1, 64, "cpu", dtype)
    layers = [i for i in range(a.num_hidden_layers) if a.is_attention(i)]
    assert layers

    def check(n: int) -> None:  # after n tokens: exactly the n // r complete blocks are pooled
        for i in layers:
            cache = st.mixers[i]
            want = pooled_from_scratch(cache.ik, m.weights.layers[i]["self_attn"], a, n)
            assert torch.equal(cache.kbar[:, : n // r], want)
            assert not cache.kbar[:, n // r :].any()  # the open block and beyond: not yet

    ids = torch.randint(0, 500, (45,), generator=torch.Generator().manual_seed(0))
    pos = 0
    for n in (6, 7, 1, 9):  # chunks ending inside blocks, and a single token through prefill
        prefill(m, st, 0, ids[pos : pos + n], pos, ex)
        pos += n
        check(pos)
    for t in ids[pos:]:
        decode_step(m, st, t[None], [pos], ex)
        pos += 1
        check(pos)
    assert pos % r != 0  # ends with an open block
    st.reset(slice(0, 1), a.eos_token_id)
    assert not any(st.mixers[i].kbar.any() for i in layers)


# (b) -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("r, budget", [(4, 8), (2, 6), (4, 16)])
def test_sparse_selection_equals_dense_mask(r, budget):
    """Random keys and queries, batch 2 of different lengths; positions 0..L-1 cover n % r == 0,
    fewer complete blocks than the budget, and the many exact-zero scores of random queries."""
    a = tiny_args(r, budget)
    g = torch.Generator().manual_seed(r * 100 + budget)
    L = 90
    ik = torch.randn(2, L, a.indexer_head_dim, generator=g)
    iq = torch.randn(2, a.indexer_n_heads, a.indexer_head_dim, generator=g)
    assert mismatches(iq, ik, norm_weight(a), a, range(L)) == []


@pytest.mark.parametrize("budget", [8, 16])
def test_exact_zero_ties_go_to_the_lowest_block(budget):
    a = tiny_args(4, budget)
    L = 80
    iq, ik, w = tie_input(a, L, positive={5, 9, 10, 14})
    kbar = pooled_from_scratch(ik, w, a, L)
    s = qsa.block_scores(iq[:, None], kbar)[0, 0]
    assert (s[[5, 9, 10, 14]] > 0).all() and len(set(s.tolist())) == 2  # engineered: two values
    assert mismatches(iq, ik, w, a, range(L)) == []
    # at p = 31 (n % r == 0: no tail) only positive block 5 is complete: the zero ties go to 0, 1..
    top, r = budget // 4, 4
    idx, ok = qsa.select_blocks(iq, kbar, torch.tensor([31]), L, a)
    blocks = {5, *range(top - 1)}
    assert sorted(idx[ok].tolist()) == sorted(b * r + j for b in blocks for j in range(r))


# (d) -------------------------------------------------------------------------------------------

def spans_differ(a: ModelArgs, L: int) -> list[int]:
    """Positions p where select_blocks' (idx, ok) of the eager step (kv_len p + 1, a cache of
    a few blocks more, as verify's eager arms size it) is not the captured step's (kv_len and
    cache the capacity L), shape and every entry."""
    g = torch.Generator().manual_seed(7)
    ik = torch.randn(2, L, a.indexer_head_dim, generator=g)
    iq = torch.randn(2, a.indexer_n_heads, a.indexer_head_dim, generator=g)
    kbar = fill_cache(ik, norm_weight(a), a, 5).kbar
    bad = []
    for p in range(L):
        pos = torch.tensor([p, p // 3])
        eager = qsa.select_blocks(iq, kbar[:, : (p + 6) // a.indexer_compress_ratio], pos, p + 1, a)
        graph = qsa.select_blocks(iq, kbar, pos, L, a)
        if not all(e.shape == c.shape and torch.equal(e, c) for e, c in zip(eager, graph)):
            bad.append(p)
    return bad


@pytest.mark.parametrize("r, budget", [(4, 8), (4, 64)])
def test_selection_does_not_depend_on_the_span(r, budget):
    """Eager and graph decode select the same slots in the same order (the split attention's
    reduction order follows them), before the context and the cache reach the budget too."""
    assert spans_differ(tiny_args(r, budget), 90) == []


@pytest.mark.parametrize("rule", ["span", "cache"])
def test_control_selection_sized_by_span_or_cache_differs(rule, monkeypatch):
    """The check above can fail: under either old rule (tests/kernel_inputs.old_decode_blocks)
    short contexts select fewer slots eagerly than in the graph."""
    L = 90  # spans_differ's eager cache holds kv_len + 5 tokens
    sized = old_decode_blocks(rule, lambda kv_len: kv_len + 5, L)
    monkeypatch.setattr(qsa, "decode_blocks", sized)
    # each p whose eager K is below the top count of 16: 63 (span), 58 (cache)
    assert len(spans_differ(tiny_args(4, 64), L)) > 50


def test_control_ties_to_the_highest_block_fail(monkeypatch):
    """The check of test_exact_zero_ties_go_to_the_lowest_block can fail: flipped ties differ."""
    a = tiny_args(4, 8)
    L = 80
    iq, ik, w = tie_input(a, L, positive={5, 9, 10, 14})
    monkeypatch.setattr(qsa, "rank_key", highest_index_key)
    bad = set(mismatches(iq, ik, w, a, range(L)))
    assert len(bad) > L // 2


# (c) -------------------------------------------------------------------------------------------

def decode_run(m, ids: Tensor, lengths: list[int], steps: int, static: bool = False):
    """Logits [steps, B, V] of teacher-forced decode steps after prefilling ids[b, :lengths[b]]:
    the eager engine step (span max(lengths)+1) or, static, the graph's span (the capacity)."""
    a, ex = m.args, resident_backend(m)
    max_len = max(lengths) + steps + 1
    st = DecodeState.create(a, len(lengths), max_len, "cpu", torch.float32)
    for b, n in enumerate(lengths):
        prefill(m, st, b, ids[b, :n], 0, ex)
    out, lengths = [], list(lengths)
    for _ in range(steps):
        tok = ids[torch.arange(len(lengths)), lengths]
        if not static:
            out.append(decode_step(m, st, tok, lengths, ex))
        else:
            pos = torch.tensor(lengths)[:, None]
            out.append(forward(tok[:, None], pos, m.weights, st, slice(0, len(lengths)), ex, a,
                               max_len)[:, 0])
        lengths = [n + 1 for n in lengths]
    return torch.stack(out)


def test_sparse_decode_matches_dense_over_a_long_context(tiny_bf16, monkeypatch):
    m = load_model(tiny_bf16)
    a = m.args
    steps, lengths = 220, [3, 17]
    assert max(lengths) + steps > 16 * (a.indexer_budget + a.indexer_compress_ratio - 1)  # sparse
    ids = torch.randint(0, 500, (2, max(lengths) + steps + 1),
                        generator=torch.Generator().manual_seed(1))
    sparse = decode_run(m, ids, lengths, steps)
    static = decode_run(m, ids, lengths, steps, static=True)
    monkeypatch.setattr(qsa, "sparse_attention", qsa.dense_attention)
    monkeypatch.setattr(qsa, "prefill_attention", qsa.dense_attention)  # the prefills too
    dense = decode_run(m, ids, lengths, steps)
    d = (sparse - dense).abs().max().item()
    ds = (static - dense).abs().max().item()
    print(f"\n[qsa] sparse vs dense decode, {steps} steps: max abs logit diff {d:.2e} "
          f"(capacity span {ds:.2e})")
    assert d < TOL and ds < TOL
    assert torch.equal(sparse, static)  # the graph's span changes no bit (decode_blocks)
