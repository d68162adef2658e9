"""Prefill that scales with the prompt: the query-chunked sparse QSA prefill
(qsa.prefill_attention) and the chunked GDN prefill against their references.

(a) the per-query selections equal the dense mask `select_tokens` exactly, ties included;
(b) logits equal the dense prefill, token-by-token decode and the transformers reference, for
    any query chunk and any engine chunks (irregular ones included);
(c) memory: no op creates a T x L tensor (every op's new output is measured);
(d) GDN: the chunked rule equals T recurrence steps, output and state.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ftchat.engine import decode_step, load_model, prefill, resident_backend
from ftchat.model import gdn, qsa
from ftchat.model.state import DecodeState
from tests.reference import reference_full, reference_model
from tests.test_qsa_sparse import (TOL, fill_cache, highest_index_key, norm_weight, tie_input,
                                    tiny_args)


def prefill_mask(iq, ik, w, a, pos, tq: int) -> torch.Tensor:
    """The sparse prefill selection of queries iq [B, T, Hi, di] at pos [B, T] over raw keys
    ik [B, L, di] (k̄ cached as a prefill writes it), query chunks of tq, as a mask [B, T, L]."""
    B, L, _ = ik.shape
    cache = fill_cache(ik, w, a, L)
    parts = []
    with mock.patch.object(qsa, "prefill_query_chunk", lambda T, *_: min(T, tq)):
        chunks = qsa.prefill_chunks(pos, L, a)
    for part, span in chunks:
        idx, ok = qsa.select_blocks_rows(iq[:, part], cache.kbar, pos[:, part], span, a)
        assert idx.shape[-1] <= a.indexer_budget + a.indexer_compress_ratio - 1
        count = torch.zeros(B, idx.shape[1], L, dtype=torch.long).scatter_add_(-1, idx, ok.long())
        assert count.max() <= 1  # no token attended twice
        parts.append(count == 1)
    return torch.cat(parts, dim=1)


def mismatched_queries(iq, ik, w, a, pos, tq: int) -> list[int]:
    """Query indices (of row 0 or 1) whose sparse prefill selection differs from select_tokens."""
    want = qsa.select_tokens(iq, ik, pos, w, a)  # [B, T, L]
    bad = (prefill_mask(iq, ik, w, a, pos, tq) != want).any(-1).any(0)  # [T]
    return bad.nonzero().flatten().tolist()


# (a) -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("r, budget, tq", [(4, 8, 90), (2, 6, 7), (4, 16, 1)])
def test_prefill_selection_equals_dense_mask(r, budget, tq):
    """Random queries at every position of row 0 and at p // 3 in row 1 (its later blocks are
    incomplete), one chunk of all queries or irregular chunks."""
    a = tiny_args(r, budget)
    g = torch.Generator().manual_seed(r * 100 + budget)
    L = 90
    ik = torch.randn(2, L, a.indexer_head_dim, generator=g)
    iq = torch.randn(2, L, a.indexer_n_heads, a.indexer_head_dim, generator=g)
    pos = torch.stack([torch.arange(L), torch.arange(L) // 3])
    assert mismatched_queries(iq, ik, norm_weight(a), a, pos, tq) == []


def test_top_blocks_equal_a_stable_sort():
    """Scores full of ties (small integers; +0.0 and -0.0 among the zeros) and incomplete blocks
    (-1): top_blocks' K best, as a set, are the first K of a stable descending sort (the rule of
    select_tokens), for K from 1 to every block."""
    g = torch.Generator().manual_seed(7)
    s = torch.randint(0, 4, (2, 300, 40), generator=g).float()
    s = torch.where(torch.rand(s.shape, generator=g) < 0.5, s, -s)  # -0.0 for half the zeros
    s = s.masked_fill(torch.rand(s.shape, generator=g) < 0.2, -1.0)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    for K in (1, 2, 5, 39, 40):
        want = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, order[..., :K], True) & (s >= 0)
        idx, ok = qsa.top_blocks(s.clone(), K)
        got = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, ok)
        assert torch.equal(got, want), K


def tied_queries(budget: int):
    """tie_input's keys, its one query repeated at every position: exact-zero and equal
    positive scores, some queries tied at the top-k cut and some not, in one chunk."""
    a = tiny_args(4, budget)
    L = 80
    iq, ik, w = tie_input(a, L, positive={5, 9, 10, 14})
    return a, ik, w, iq[:, None].expand(1, L, -1, -1), torch.arange(L)[None]


@pytest.mark.parametrize("budget", [8, 16])
def test_prefill_ties_go_to_the_lowest_block(budget, monkeypatch):
    a, ik, w, iq, pos = tied_queries(budget)
    ranked = []  # queries the exact int64 ranking settled
    rank_key = qsa.rank_key
    monkeypatch.setattr(qsa, "rank_key", lambda s, c: ranked.append(s.shape[0]) or rank_key(s, c))
    assert mismatched_queries(iq, ik, w, a, pos, tq=80) == []
    assert 0 < sum(ranked) < pos.shape[1]  # the tied ones only, the float top-k the others


def test_prefill_control_ties_to_the_highest_block_fail(monkeypatch):
    """The check above can fail: with ties to the highest block the selections differ."""
    a, ik, w, iq, pos = tied_queries(8)
    monkeypatch.setattr(qsa, "rank_key", highest_index_key)
    assert len(mismatched_queries(iq, ik, w, a, pos, tq=80)) > pos.shape[1] // 2


# (b) -------------------------------------------------------------------------------------------

PROMPT = 100  # > budget 8 + r - 1: sparse from the 12th token


@pytest.fixture(scope="module")
def tiny(tiny_bf16):
    return load_model(tiny_bf16)


def run_prefill(m, ids: torch.Tensor, spans: list[int]) -> torch.Tensor:
    """Logits [len(ids), V]: ids[:sum(spans)] prefilled in engine chunks of `spans` (a chunk of
    1 runs the decode path), then teacher-forced decode steps over the rest."""
    st = DecodeState.create(m.args, 1, len(ids) + 1, "cpu", torch.float32)
    ex, out, p = resident_backend(m), [], 0
    for n in spans:
        out.append(prefill(m, st, 0, ids[p : p + n], p, ex))
        p += n
    for t in ids[p:]:
        out.append(decode_step(m, st, t[None], [p], ex))
        p += 1
    return torch.cat(out)


def prompt_ids(n: int = PROMPT, seed: int = 11) -> torch.Tensor:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_equal_dense_and_decode_for_any_query_chunk(tiny, monkeypatch):
    """Prefill of 100 tokens then 8 decode steps: the query-chunked sparse prefill (chunks of
    1, 3, 7 and all queries; engine chunks 37, 1, 50, 12) equals the dense prefill and
    token-by-token decode within TOL, so the state it leaves decodes alike."""
    ids = prompt_ids(PROMPT + 8)
    with monkeypatch.context() as mp:
        mp.setattr(qsa, "prefill_attention", qsa.dense_attention)
        dense = run_prefill(tiny, ids, [PROMPT])
    stepped = run_prefill(tiny, ids, [1] * PROMPT)
    worst = {"decode": (stepped - dense).abs().max().item()}
    chunk = qsa.prefill_query_chunk
    for tq in (1, 3, 7, None):
        if tq is not None:
            monkeypatch.setattr(qsa, "prefill_query_chunk", lambda T, *_, tq=tq: min(T, tq))
        for spans in ([PROMPT], [37, 1, 50, 12]):
            got = run_prefill(tiny, ids, spans)
            worst[f"tq {tq} spans {spans}"] = (got - dense).abs().max().item()
        monkeypatch.setattr(qsa, "prefill_query_chunk", chunk)
    print("\n[prefill] max abs logit diff vs dense prefill: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    # decode also runs the GDN recurrence, not the chunked form: more rounding (model.md 6.2)
    assert worst.pop("decode") < 2 * TOL
    assert max(worst.values()) < TOL


def test_prefill_in_irregular_chunks_matches_reference(tiny, tiny_bf16, monkeypatch):
    """The transformers reference on the same 100 tokens: engine chunks 29, 1, 41, 29 with query
    chunks of 6 (docs/model.md 4.3: the reference patched to lowest-index ties)."""
    ids = prompt_ids()
    monkeypatch.setattr(qsa, "prefill_query_chunk", lambda T, *_: min(T, 6))
    ours = run_prefill(tiny, ids, [29, 1, 41, 29])
    diff = (ours - reference_full(reference_model(tiny_bf16), ids.tolist())).abs().max().item()
    print(f"\n[prefill] irregular chunks vs transformers: max abs logit diff {diff:.2e}")
    assert diff < 1e-4  # test_oracle's TOL


# (c) -------------------------------------------------------------------------------------------

class LargestNewTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op creates (views and in-place results, which
    share an input's storage, are not new memory)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.numel = max(self.numel, t.numel())
        return out


def test_prefill_memory_is_bounded_by_the_query_chunk(monkeypatch):
    """64 queries at the end of a 4096-token context: every new tensor of the sparse prefill
    fits PREFILL_ELEMS (8192 here, 4 queries a chunk); the dense form makes [.., T, L]."""
    a = tiny_args(4, 8)
    L, T = 4096, 64
    g = torch.Generator().manual_seed(5)
    w = norm_weight(a)
    cache = fill_cache(torch.randn(1, L, a.indexer_head_dim, generator=g), w, a, L)
    cache.k = torch.randn(1, L, a.num_key_value_heads, a.head_dim, generator=g)
    cache.v = torch.randn(1, L, a.num_key_value_heads, a.head_dim, generator=g)
    q = torch.randn(1, T, a.num_attention_heads, a.head_dim, generator=g)
    iq = torch.randn(1, T, a.indexer_n_heads, a.indexer_head_dim, generator=g)
    pos = torch.arange(L - T, L)[None]
    monkeypatch.setitem(qsa.PREFILL_ELEMS, "cpu", 1 << 13)
    assert qsa.prefill_query_chunk(T, L, a) == 4
    sparse, dense = LargestNewTensor(), LargestNewTensor()
    with sparse:
        o = qsa.prefill_attention(q, iq, cache, pos, L, w, a)
    with dense:
        want = qsa.dense_attention(q, iq, cache, pos, L, w, a)
    assert (o - want).abs().max() < 1e-5
    assert sparse.numel <= 1 << 13 < T * L <= dense.numel


# (d) -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T, decay", [(2, 0.3), (63, 0.3), (64, 0.3), (65, 0.3), (200, 0.3),
                                      (200, 5.0)])
def test_gdn_chunked_equals_recurrence(T, decay):
    """delta_rule_chunked (the intra-chunk work for all chunks at once, the state chunk to
    chunk) against T delta_rule_step calls from the same nonzero state, batch 2; decay 5 takes
    the exponents within a chunk far below gdn.EXP_FLOOR."""
    B, H, dk, dv = 2, 3, 8, 12
    g0 = torch.Generator().manual_seed(T)
    q = F.normalize(torch.randn(B, H, T, dk, generator=g0), dim=-1) / dk**0.5
    k = F.normalize(torch.randn(B, H, T, dk, generator=g0), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g0)
    g = -torch.rand(B, H, T, generator=g0) * decay
    beta = torch.rand(B, H, T, generator=g0)
    S0 = torch.randn(B, H, dk, dv, generator=g0) * 0.3
    S_chunked, S_steps = S0.clone(), S0.clone()
    out = gdn.delta_rule_chunked(q, k, v, g, beta, S_chunked)
    want = torch.stack([gdn.delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t],
                                            beta[:, :, t], S_steps) for t in range(T)], dim=2)
    assert (out - want).abs().max() < 1e-5
    assert (S_chunked - S_steps).abs().max() < 1e-5
