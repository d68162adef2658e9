"""Gated GQA attention with the QSA block indexer (docs/model.md section 4).

Legend: B batch, T query tokens, L cached kv length, Hq/Hkv query/kv heads, hd head dim,
Hi index heads, di index head dim, r compress ratio, N blocks, K chosen blocks, S selected tokens,
NP fused projection width (Hq*2hd + 2*Hkv*hd + (Hi+1)*di).
Ties between equal block scores (exact 0.0 is common: sums of ReLUs) go to the lowest block index.

Prefill (T > 1) runs in query chunks (`prefill_attention`): per chunk the block scores against
the cached k̄, the top-k with decode's order (`top_blocks`), a gather of each query's selected
tokens and the attention over them; memory O(chunk * (L/r + budget)), never [T, L]. On CUDA
(one row, the fused decode's conditions) `prefill_attention_fused` keeps that selection and
runs the decode's attention kernels with the chunk's queries as their rows, reading each
query's selected tokens from the cache: no gather, chunks bounded by the block scores. The dense
[B, T, L] selection mask (`select_tokens`, `dense_attention`) is the reference of both.
Decode (T == 1) is O(budget): block scores from the cached compressed keys k̄ (cache.kbar,
written once per block when its last token arrives), a fixed-size top-k and a gather of
budget + r - 1 token slots. The block scores' shape depends on kv_len only, never on the data,
so it can be captured in a CUDA graph (there kv_len is the whole capacity and the positions
live on the device); the selection's shape on the budget only (`decode_blocks`), so eager and
captured steps give the same bits.

K and V are stored in the model dtype or, opt-in, as FP8 codes with a scale per token and kv head
(model/kv_cache.py: written by `store_kv`, read by `gather_kv`); index and block keys stay in the
model dtype.

`attention_mixer_ref` is the torch path (CPU, prefill; on CUDA its sparse prefill attention is
`prefill_attention_fused`) and the reference. A CUDA decode step runs
`attention_decode_fused`: one GEMV on the load-time concatenation of the four input projections
(`fuse_qsa_projections`), then ftchat/kernels/qsa_decode.py (norms, RoPE and the cache writes in
one kernel; block scores and ranking keys in one; torch.topk; split attention and the gated
combine in two), then o_proj.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import gemv
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.qsa_attention import qsa_attention
from ftchat.kernels.qsa_decode import (QsaDims, qsa_decode_supported, qsa_prep,
                                       qsa_rank_keys)
from ftchat.kernels.topk_select import topk_keys
from ftchat.model.config import ModelArgs
from ftchat.model.kv_cache import AttentionCache, gather_kv, store_kv
from ftchat.model.layers import apply_rope, fuse_layers, fuse_rows, rms_norm, rope_cos_sin


def block_keys(raw: Tensor, start: Tensor, w: dict, a: ModelArgs) -> Tensor:
    """k̄ [..., di] of blocks with raw index keys raw [..., r, di] starting at positions
    start [...]: RoPE_start(RMSNorm(mean_fp32(raw) in the model dtype)): pool first, then norm
    (docs/model.md 4.4)."""
    pooled = raw.float().mean(-2).to(raw.dtype)
    kbar = rms_norm(pooled, w["indexer.k_layernorm.weight"], a.rms_norm_eps)
    cos, sin = rope_cos_sin(start, a.rotary_dim, a.rope_theta, raw.dtype)
    return apply_rope(kbar, cos, sin)


def block_scores(iq: Tensor, kbar: Tensor) -> Tensor:
    """score [B, T, N] fp32 = sum_h ReLU(<iq_h, k̄_b>) / sqrt(di) of iq [B, T, Hi, di] and
    kbar [B, N, di]. Used only to rank blocks."""
    s = torch.einsum("bthd,bnd->bthn", iq.float(), kbar.float())
    return s.relu().sum(2) / math.sqrt(kbar.shape[-1])


def select_tokens(iq: Tensor, ik: Tensor, pos: Tensor, w: dict, a: ModelArgs) -> Tensor:
    """QSA selection mask [B, T, L] (bool) for queries at positions pos [B, T], dense form.

    iq [B, T, Hi, di] normed + roped index queries; ik [B, L, di] raw index keys (cache).
    Re-pools every block: O(T * L). The reference for `select_blocks`.
    """
    B, L, di = ik.shape
    r, top = a.indexer_compress_ratio, a.indexer_budget // a.indexer_compress_ratio
    N = L // r
    j = torch.arange(L, device=pos.device)
    causal = j <= pos[..., None]  # [B, T, L]
    if N == 0:
        return causal
    starts = torch.arange(N, device=pos.device) * r
    kbar = block_keys(ik[:, : N * r].unflatten(1, (N, r)), starts, w, a)  # [B, N, di]
    s = block_scores(iq, kbar)  # [B, T, N]
    complete = (torch.arange(N, device=pos.device) + 1) * r <= pos[..., None] + 1  # [B, T, N]
    s = torch.where(complete, s, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # stable: lowest index wins ties
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(N, device=pos.device).expand_as(order))
    chosen = complete & (rank < top)  # [B, T, N]
    tail = j >= (pos[..., None] + 1) // r * r  # the open block of each query: always kept
    in_block = chosen.repeat_interleave(r, dim=-1)
    in_block = F.pad(in_block, (0, L - N * r))
    return causal & (in_block | tail)


def write_block_keys(cache: AttentionCache, pos: Tensor, w: dict, a: ModelArgs) -> None:
    """Store k̄ of every block completed by the tokens at pos [B, T] (their raw ik already cached)
    in cache.kbar [B, Lmax // r, di]: block b completes with its last token r*b + r - 1."""
    ik, kbar = cache.ik, cache.kbar
    r, Nmax = a.indexer_compress_ratio, kbar.shape[1]
    if Nmax == 0:
        return
    B, T = pos.shape
    rows = torch.arange(B, device=pos.device)[:, None].expand(B, T)
    offs = torch.arange(r, device=pos.device)
    done = (pos + 1) % r == 0  # [B, T]
    if T > 1:  # prefill (eager): pick the completing tokens by value; each block once
        p, rw = pos[done], rows[done]  # [M]  SYNC: the count M goes to the host
        start = p + 1 - r
        kbar[rw, p // r] = block_keys(ik[rw[:, None], start[:, None] + offs], start, w, a)
        return
    # decode: static shapes; pool the open block and keep the old entry unless it just completed
    p, rw = pos[:, 0], rows[:, 0]  # [B]
    b = (p // r).clamp(max=Nmax - 1)  # a capacity not divisible by r ends in an open block
    start = b * r
    raw = ik[rw[:, None], (start[:, None] + offs).clamp(max=ik.shape[1] - 1)]  # [B, r, di]
    kbar[rw, b] = torch.where(done[:, :1], block_keys(raw, start, w, a), kbar[rw, b])


def rank_key(s: Tensor, complete: Tensor) -> Tensor:
    """int64 ranking key [B, N] from block scores s [B, N] (fp32, >= 0) and completeness [B, N].

    Non-negative fp32 values order like their bit patterns, so key = bits << 32 | (N - 1 - b) orders
    by score, then lowest block first, and every complete block's key is distinct: torch.topk's
    unspecified order among ties (CUDA) cannot matter. Incomplete blocks get -1, below all others.
    """
    N = s.shape[-1]
    bits = torch.where(s > 0, s, 0.0).view(torch.int32).long()  # -0.0 -> +0.0
    low = N - 1 - torch.arange(N, device=s.device)
    return torch.where(complete, (bits << 32) | low, -1)


def decode_blocks(kv_len: int, a: ModelArgs) -> tuple[int, int]:
    """(N, K): a decode step ranks N block slots and keeps the K = top best.

    N = max(kv_len // r, top): past kv_len // r (and past the cache's blocks) every block is
    incomplete, ranked -1. K is the top count whatever the span and the cache capacity are:
    the eager step (kv_len = longest sequence + 1, a cache sized to the prompt) and the
    captured one (kv_len = capacity) then attend over the same S = K*r + r - 1 slots in the
    same order, and the split attention reduces them identically (bit for bit)."""
    top = a.indexer_budget // a.indexer_compress_ratio
    return max(kv_len // a.indexer_compress_ratio, top), top


def select_blocks(iq: Tensor, kbar: Tensor, pos: Tensor, kv_len: int, a: ModelArgs
                  ) -> tuple[Tensor, Tensor]:
    """Selected token indices [B, S] and validity [B, S] of one query per row, S = K*r + r - 1
    (docs/model.md 4.5).

    iq [B, Hi, di] at positions pos [B] < kv_len; kbar [B, Nmax, di] cached block keys. The K
    best complete blocks of N block slots (`decode_blocks`), then the open tail
    [r*floor((p+1)/r), p]. Invalid entries (incomplete blocks, fewer complete blocks than K,
    tail past p) point at p.
    """
    r = a.indexer_compress_ratio
    N, K = decode_blocks(kv_len, a)
    dev = pos.device
    kbar = F.pad(kbar[:, :N], (0, 0, 0, N - min(N, kbar.shape[1])))  # past the cache: incomplete
    s = block_scores(iq[:, None], kbar)[:, 0]  # [B, N]
    complete = (torch.arange(N, device=dev) + 1) * r <= pos[:, None] + 1  # [B, N]
    best = torch.topk(rank_key(s, complete), K, dim=-1)  # [B, K]
    offs = torch.arange(r, device=dev)
    blk = (best.indices[..., None] * r + offs).flatten(1)  # [B, K*r]
    blk_ok = (best.values >= 0)[..., None].expand(-1, -1, r).flatten(1)
    tail = ((pos + 1) // r * r)[:, None] + offs[: r - 1]  # [B, r-1]
    tail_ok = tail <= pos[:, None]
    ok = torch.cat([blk_ok, tail_ok], dim=-1)
    idx = torch.where(ok, torch.cat([blk, tail], dim=-1), pos[:, None])
    return idx, ok


def attend(q: Tensor, keys: Tensor, vals: Tensor, mask: Tensor, a: ModelArgs) -> Tensor:
    """GQA softmax attention: q [B, T, Hq, hd] over keys/vals [B, L, Hkv, hd] where mask [B, T, L];
    o [B, T, Hq*hd]."""
    Hq, Hkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    rep = Hq // Hkv
    keys = keys.repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, Hq, L, hd]
    vals = vals.repeat_interleave(rep, dim=2).transpose(1, 2)
    scores = (q.transpose(1, 2) @ keys.transpose(-1, -2)) * hd**-0.5  # [B, Hq, T, L]
    scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ vals).transpose(1, 2).flatten(-2)


def dense_attention(q: Tensor, iq: Tensor, cache: AttentionCache, pos: Tensor, kv_len: int,
                    w: dict,
                    a: ModelArgs) -> Tensor:
    """o [B, T, Hq*hd] over the first kv_len cache entries under the dense selection mask."""
    mask = select_tokens(iq, cache.ik[:, :kv_len], pos, w, a)  # [B, T, L]
    return attend(q, *gather_kv(cache, (slice(None), slice(None, kv_len)), q.dtype), mask, a)


# ===== prefill: the sparse selection per query chunk =====

# Elements of the largest per-chunk intermediate of the sparse prefill, by path; they set the
# query chunk tq. The torch path (block scores [B, tq, Hi, N], gathered keys [B, tq, S, Hkv, hd])
# by device type: CPU 2 MB of fp32, the fastest in a sweep (2^16..2^21 on the tiny model at 32K:
# smaller chunks pay per-op overhead, larger ones fall out of cache); a GPU: large enough to
# fill it. The CUDA kernel path (`prefill_attention_fused`) gathers nothing; its largest are the
# block scores [tq, Hi, N] fp32: 64 MiB a tensor at 2^24 (64 queries at 255K, 1,024 at 16K) keeps
# the attention below the other blocks of a prefill call (the VRAM plan) and still fills the GPU
# (tq * Hkv programs or more, at least 2 per SM).
PREFILL_ELEMS = {"cpu": 1 << 19, "cuda": 1 << 26, "kernel": 1 << 24}


def top_blocks(s: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """The K best complete blocks of each query under `rank_key`'s order (score, then lowest
    index), as a set: indices [B, T, K] and validity [B, T, K] (False: fewer complete blocks
    than K) from scores s [B, T, N] (fp32: >= 0 for a complete block, -1 for an incomplete one).

    A float top-(K+1) settles every query whose K-th and (K+1)-th scores differ: then its K best
    are one set, whatever order topk gives ties inside it. Queries tied at the cut (the
    zero-score regime, docs/model.md 4.3) are ranked again by the tie-free int64 `rank_key`,
    which costs ~5x the float path per block on the CPU."""
    N = s.shape[-1]
    best = torch.topk(s, min(K + 1, N), dim=-1)  # values descending
    idx, val = best.indices[..., :K], best.values[..., :K]
    if 0 < K < N:
        cut = val[..., -1]
        tied = (best.values[..., K] == cut) & (cut >= 0)  # [B, T]  (-0.0 == 0.0: tied too)
        if tied.any():  # SYNC: which queries need the exact ranking
            st = s[tied]  # [M, N]
            exact = torch.topk(rank_key(st, st >= 0), K, dim=-1).indices  # [M, K]
            idx, val = idx.clone(), val.clone()
            idx[tied], val[tied] = exact, st.gather(-1, exact)
    return idx, val >= 0


def select_blocks_rows(iq: Tensor, kbar: Tensor, pos: Tensor, span: tuple[int, int],
                       a: ModelArgs) -> tuple[Tensor, Tensor]:
    """`select_blocks` for T queries per row: indices [B, T, S] and validity [B, T, S],
    S = K*r + r - 1. iq [B, T, Hi, di] at positions pos [B, T], whose lowest and highest are
    span (host ints); kbar [B, Nmax, di] cached k̄.

    The same rule as `select_tokens` (a query ranks only the blocks complete for itself, the
    tail of its open block is always kept; ties to the lowest block, `top_blocks`). Only the
    blocks complete for the highest position are scored, and only those past the lowest
    position's are masked."""
    r, top = a.indexer_compress_ratio, a.indexer_budget // a.indexer_compress_ratio
    N = min((span[1] + 1) // r, kbar.shape[1])  # complete for some query
    n_all = min((span[0] + 1) // r, N)  # complete for every query
    dev = pos.device
    s = block_scores(iq, kbar[:, :N])  # [B, T, N]
    late = torch.arange(n_all, N, device=dev)
    s[..., n_all:].masked_fill_((late + 1) * r > pos[..., None] + 1, -1.0)  # incomplete
    best, best_ok = top_blocks(s, min(top, N))  # [B, T, K]
    offs = torch.arange(r, device=dev)
    blk = (best[..., None] * r + offs).flatten(-2)  # [B, T, K*r]
    blk_ok = best_ok[..., None].expand(-1, -1, -1, r).flatten(-2)
    tail = ((pos + 1) // r * r)[..., None] + offs[: r - 1]  # [B, T, r-1]
    tail_ok = tail <= pos[..., None]
    ok = torch.cat([blk_ok, tail_ok], dim=-1)
    idx = torch.where(ok, torch.cat([blk, tail], dim=-1), pos[..., None])
    return idx, ok


def attend_rows(q: Tensor, keys: Tensor, vals: Tensor, ok: Tensor) -> Tensor:
    """GQA softmax attention of each query over its own tokens: q [B, T, Hq, hd], keys/vals
    [B, T, S, Hkv, hd], ok [B, T, S] -> o [B, T, Hq*hd]. The dtypes of `attend`; the kv heads are
    grouped, not repeated (query head h reads kv head h // rep)."""
    Hq, hd, Hkv = q.shape[2], q.shape[3], keys.shape[3]
    qg = q.unflatten(2, (Hkv, Hq // Hkv))  # [B, T, Hkv, rep, hd]
    scores = (qg @ keys.permute(0, 1, 3, 4, 2)) * hd**-0.5  # [B, T, Hkv, rep, S]
    scores = scores.masked_fill(~ok[:, :, None, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ vals.transpose(2, 3)).flatten(2)  # [B, T, Hkv, rep, hd] -> [B, T, Hq*hd]


# Scores [Hq, tq, L] of the causal prefill (short contexts) per query chunk: 2^24 elements keep
# its softmax (fp32) at 64 MiB and the attention block below the sparse one at 3,072-token calls
# (the VRAM plan), where 2,048 queries at once over 2,051 keys ran out of memory on the H200 under a
# 15.9 GiB budget (a ~0.9 GiB block); the CPU's tests never reach it
CAUSAL_ELEMS = 1 << 24


def causal_query_chunk(T: int, kv_len: int, a: ModelArgs) -> int:
    """Queries per chunk of the causal prefill: Hq x tq x kv_len <= CAUSAL_ELEMS."""
    return max(1, min(T, CAUSAL_ELEMS // (a.num_attention_heads * kv_len)))


def prefill_query_chunk(T: int, kv_len: int, a: ModelArgs, device: str = "cpu",
                        kernel: bool = False) -> int:
    """Queries per chunk of the sparse prefill: its largest intermediate stays within
    PREFILL_ELEMS, whatever the context. The torch path (PREFILL_ELEMS[device]): block scores,
    gathered keys or attention scores; the kernel path (`prefill_attention_fused`,
    PREFILL_ELEMS['kernel']): block scores, the token indices or one split's partial o."""
    r, top = a.indexer_compress_ratio, a.indexer_budget // a.indexer_compress_ratio
    N = kv_len // r
    S = min(top, N) * r + r - 1
    if kernel:
        per_query = max(a.indexer_n_heads * N, S, a.num_attention_heads * a.head_dim)
        return max(1, min(T, PREFILL_ELEMS["kernel"] // per_query))
    per_query = max(a.indexer_n_heads * N, S * a.num_key_value_heads * a.head_dim,
                    a.num_attention_heads * S)
    elems = PREFILL_ELEMS["cpu" if device == "cpu" else "cuda"]
    return max(1, min(T, elems // per_query))


def prefill_chunks(pos: Tensor, kv_len: int, a: ModelArgs, kernel: bool = False
                   ) -> list[tuple[slice, tuple[int, int]]]:
    """The query chunks of the sparse prefill of queries at pos [B, T]: (queries, (lowest,
    highest position among them)), in order; kernel: the chunks of `prefill_attention_fused`."""
    tq = prefill_query_chunk(pos.shape[1], kv_len, a, pos.device.type, kernel)
    lo, hi = pos.amin(0).tolist(), pos.amax(0).tolist()  # SYNC: the blocks each chunk can see
    return [(slice(i, i + tq), (min(lo[i : i + tq]), max(hi[i : i + tq])))
            for i in range(0, len(lo), tq)]


def prefill_attention(q: Tensor, iq: Tensor, cache: AttentionCache, pos: Tensor, kv_len: int,
                      w: dict, a: ModelArgs) -> Tensor:
    """o [B, T, Hq*hd] of T > 1 queries over the first kv_len cache entries, k̄ of every block
    the queries complete already cached. Short contexts (every complete block selected) are
    plain causal attention over L <= budget + r - 1; longer ones run in the chunks of queries of
    `prefill_chunks`, each query over its <= budget + r - 1 selected tokens only."""
    if not sparse_prefill(kv_len, a):  # select_tokens would give the causal mask (model.md 4.2)
        causal = torch.arange(kv_len, device=pos.device) <= pos[..., None]  # [B, T, L]
        keys, vals = gather_kv(cache, (slice(None), slice(None, kv_len)), q.dtype)
        tq = causal_query_chunk(q.shape[1], kv_len, a)
        return torch.cat([attend(q[:, i:i + tq], keys, vals, causal[:, i:i + tq], a)
                          for i in range(0, q.shape[1], tq)], dim=1)
    rows = torch.arange(q.shape[0], device=q.device)[:, None, None]
    out = []
    for part, span in prefill_chunks(pos, kv_len, a):
        idx, ok = select_blocks_rows(iq[:, part], cache.kbar, pos[:, part], span, a)
        keys, vals = gather_kv(cache, (rows, idx), q.dtype)  # [B, tq, S, Hkv, hd]
        out.append(attend_rows(q[:, part], keys, vals, ok))
    return torch.cat(out, dim=1)


def sparse_prefill(kv_len: int, a: ModelArgs) -> bool:
    """Whether a prefill over kv_len entries selects (more complete blocks than the top-k);
    else every query attends causally over all of them."""
    return kv_len // a.indexer_compress_ratio > a.indexer_budget // a.indexer_compress_ratio


def prefill_attention_fused(q: Tensor, gate: Tensor, iq: Tensor, cache: AttentionCache,
                            pos: Tensor, kv_len: int, a: ModelArgs, *,
                            kc: KernelConfig = DEFAULT) -> Tensor:
    """`prefill_attention` times sigmoid(gate) for one row (B = 1) and a sparse kv_len, with
    the attention in the decode's kernels: og [1, T, Hq*hd] of q [1, T, Hq, hd], gate
    [1, T, Hq*hd], iq [1, T, Hi, di]. Per query chunk (`prefill_chunks`, kernel sizes) the
    same selection (`select_blocks_rows`), then `qsa_attention` with the chunk's queries as its
    rows over the one cache row (stride 0): each program reads its query's selected K/V from the
    cache, nothing is gathered. Numerics: the decode's (qsa_attention module docstring)."""
    Hq, hd = a.num_attention_heads, a.head_dim
    dims = qsa_dims(a)
    out = []
    for part, span in prefill_chunks(pos, kv_len, a, True):
        idx, ok = select_blocks_rows(iq[:, part], cache.kbar, pos[:, part], span, a)
        tq = idx.shape[1]  # idx, ok [1, tq, S]
        k, v, *scales = (t[:1].expand(tq, *t.shape[1:])  # [tq, L, ..]
                         for t in (cache.k, cache.v, *(cache.kv_scales() or ())))
        out.append(qsa_attention(q[0, part], gate[0, part].unflatten(-1, (Hq, hd)), k, v,
                                 pos[0, part], dims, idx=idx[0], ok=ok[0],
                                 kv_scales=tuple(scales) or None, kc=kc))  # [tq, Hq*hd]
    return torch.cat(out)[None]


def prefill_kernel_supported(a: ModelArgs, dtype: torch.dtype, rows: int) -> bool:
    """Whether a CUDA prefill of `rows` rows over a sparse kv_len runs `prefill_attention_fused`:
    one row, a geometry and dtype the decode kernels take."""
    return rows == 1 and qsa_decode_supported(qsa_dims(a), dtype, rows)


def prefill_kernel(x: Tensor, kv_len: int, a: ModelArgs, kc: KernelConfig) -> bool:
    """Whether the prefill of x [B, T, D] over kv_len entries runs its attention in the decode's
    kernels (`prefill_attention_fused`): T > 1, a sparse kv_len, fused kernels on for x's device
    (kc), a row and geometry they take."""
    return (x.shape[1] > 1 and sparse_prefill(kv_len, a) and kc.runs_fused(x)
            and prefill_kernel_supported(a, x.dtype, x.shape[0]))


def sparse_attention(q: Tensor, iq: Tensor, cache: AttentionCache, pos: Tensor, kv_len: int,
                     w: dict, a: ModelArgs) -> Tensor:
    """o [B, 1, Hq*hd] of one query per row over its <= budget + r - 1 selected tokens only."""
    idx, ok = select_blocks(iq[:, 0], cache.kbar, pos[:, 0], kv_len, a)  # [B, S]
    rows = torch.arange(idx.shape[0], device=idx.device)[:, None]
    keys, vals = gather_kv(cache, (rows, idx), q.dtype)  # [B, S, Hkv, hd]
    return attend(q, keys, vals, ok[:, None], a)


def attention_mixer(x: Tensor, w: dict, cache: AttentionCache, pos: Tensor, kv_len: int,
                    a: ModelArgs, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """x [B, T, D] at positions pos [B, T] -> [B, T, D]; appends to cache.k, v, ik
    [B, Lmax, ...] and cache.kbar [B, Lmax // r, di] (blocks it completes).

    Attends over the first kv_len cache entries (every query's own position is < kv_len):
    sparse per query chunk for T > 1 (`prefill_attention`), sparse for T == 1. A CUDA decode step
    runs `attention_decode_fused` (fused kernels on in kc); the CPU, prefill and unsupported
    geometries `attention_mixer_ref`."""
    if (x.shape[1] == 1 and kc.runs_fused(x)
            and qsa_decode_supported(qsa_dims(a), x.dtype, x.shape[0])):
        return attention_decode_fused(x, w, cache, pos, kv_len, a, kc=kc)
    return attention_mixer_ref(x, w, cache, pos, kv_len, a, kc=kc)


# ===== fused decode (CUDA, T == 1) =====


def qsa_dims(a: ModelArgs) -> QsaDims:
    return QsaDims(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.indexer_n_heads,
                   a.indexer_head_dim, a.rotary_dim, a.indexer_compress_ratio)


def fused_projection(x: Tensor, w: dict) -> Tensor:
    """proj [B, NP] = [q|gate | k | v | index q|k] of x [B, D]: one cuBLAS GEMV on w[FUSED] when
    the load fused the four weights (`fuse_qsa_projections`), else four."""
    if FUSED in w:
        return F.linear(x, w[FUSED])
    return torch.cat([F.linear(x, w[n]) for n in PROJECTIONS], dim=-1)


def select_blocks_fused(iq: Tensor, kbar: Tensor, pos: Tensor, kv_len: int, a: ModelArgs, *,
                        kc: KernelConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """(block indices [B, K], ranking keys [B, K]; a key < 0 marks no block) of `select_blocks`:
    scores and keys in one kernel, then the exact top-k of the same keys (the set torch.topk
    gives, in ascending block order: ftchat/kernels/topk_select.py). iq [B, Hi, di]; kbar
    [B, Nmax, di]; pos [B, 1]."""
    r = a.indexer_compress_ratio
    N, K = decode_blocks(kv_len, a)
    keys = qsa_rank_keys(iq, kbar, pos, N, r, kc=kc)  # [B, N]; N may pass kbar's rows (-1)
    return topk_keys(keys, K, kc=kc)  # the radix select (ascending block index)


def attention_decode_fused(x: Tensor, w: dict, cache: AttentionCache, pos: Tensor, kv_len: int,
                           a: ModelArgs, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """One decode step x [B, 1, D] -> [B, 1, D] (docs/model.md 4.5): the fused projection GEMV,
    norms + RoPE + cache and k̄ writes (one kernel), block keys and their top-k, split attention
    and the gated combine (two kernels), o_proj. Static shapes (kv_len only), no host sync."""
    dims = qsa_dims(a)
    proj = fused_projection(x[:, 0], w)  # [B, NP]
    norms = tuple(w[n] for n in ("q_norm.weight", "k_norm.weight", "indexer.q_layernorm.weight",
                                 "indexer.k_layernorm.weight"))
    q, iq = qsa_prep(proj, pos, cache.k, cache.v, cache.ik, cache.kbar, norms, dims,
                     a.rms_norm_eps, a.rope_theta, cache.kv_scales(), kc=kc)
    blocks, keys = select_blocks_fused(iq, cache.kbar, pos, kv_len, a, kc=kc)
    hd = a.head_dim
    gate = proj[:, : dims.heads * 2 * hd].unflatten(-1, (dims.heads, 2 * hd))[..., hd:]  # [B, Hq, hd]
    o = qsa_attention(q, gate, cache.k, cache.v, pos, dims, blocks=blocks, block_keys=keys,
                      kv_scales=cache.kv_scales(), kc=kc)
    return gemv.linear(o, w["o_proj.weight"], kc=kc)[:, None]


# ===== torch path and reference =====


def attention_inputs_ref(qg: Tensor, k: Tensor, v: Tensor, iqk: Tensor, w: dict,
                         cache: AttentionCache, pos: Tensor, a: ModelArgs
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """The work between the projections and the attention, in torch: qg [B, T, Hq*2hd],
    k, v [B, T, Hkv*hd], iqk [B, T, (Hi+1)*di] -> q [B, T, Hq, hd], gate [B, T, Hq*hd],
    iq [B, T, Hi, di] (normed, roped); k, v, the raw ik and k̄ written to the cache at pos."""
    B, T, _ = qg.shape
    Hq, Hkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    Hi, di = a.indexer_n_heads, a.indexer_head_dim
    eps = a.rms_norm_eps
    qg = qg.unflatten(-1, (Hq, 2 * hd))  # [B, T, Hq, 2hd]
    q, gate = qg[..., :hd], qg[..., hd:].flatten(-2)
    q = rms_norm(q, w["q_norm.weight"], eps)
    k = rms_norm(k.unflatten(-1, (Hkv, hd)), w["k_norm.weight"], eps)
    v = v.unflatten(-1, (Hkv, hd))
    cos, sin = rope_cos_sin(pos, a.rotary_dim, a.rope_theta, qg.dtype)  # [B, T, rd]
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    k = apply_rope(k, cos[:, :, None], sin[:, :, None])
    iq = rms_norm(iqk[..., : Hi * di].unflatten(-1, (Hi, di)), w["indexer.q_layernorm.weight"], eps)
    iq = apply_rope(iq, cos[:, :, None], sin[:, :, None])
    rows = torch.arange(B, device=qg.device)[:, None].expand(B, T)
    store_kv(cache, (rows, pos), k, v)  # model dtype, or FP8 codes and scales
    cache.ik[rows, pos] = iqk[..., Hi * di :]
    write_block_keys(cache, pos, w, a)
    return q, gate, iq


def attention_mixer_ref(x: Tensor, w: dict, cache: AttentionCache, pos: Tensor, kv_len: int,
                        a: ModelArgs, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """`attention_mixer` in torch (CPU, prefill; the reference of the fused decode). A CUDA
    prefill of one row past the budget runs its attention and gate in the decode's kernels
    (`prefill_attention_fused`), the rest as here."""
    T = x.shape[1]
    qg = F.linear(x, w["q_proj.weight"])  # [B, T, Hq*2hd]
    k = F.linear(x, w["k_proj.weight"])
    v = F.linear(x, w["v_proj.weight"])
    iqk = F.linear(x, w["indexer.index_qk_proj.weight"])  # [B, T, (Hi+1)*di]
    q, gate, iq = attention_inputs_ref(qg, k, v, iqk, w, cache, pos, a)
    if prefill_kernel(x, kv_len, a, kc):
        og = prefill_attention_fused(q, gate, iq, cache, pos, kv_len, a, kc=kc)  # o*sigmoid(g)
        return F.linear(og, w["o_proj.weight"])
    mix = sparse_attention if T == 1 else prefill_attention
    o = mix(q, iq, cache, pos, kv_len, w, a)  # [B, T, Hq*hd]
    return F.linear(o * torch.sigmoid(gate), w["o_proj.weight"])


# ===== load-time fusion of the input projections =====

PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "indexer.index_qk_proj.weight")
FUSED = "qkv_index_fused.weight"  # [NP, D]; the four PROJECTIONS entries are row views of it


def fuse_qsa_projections(w: dict) -> dict[str, Tensor]:
    """The four input projections as one weight w[FUSED] (row views; layers.fuse_rows)."""
    return fuse_rows(w, PROJECTIONS, FUSED)


def fuse_qsa_layers(tensors: dict[str, Tensor], layers: list[dict]) -> None:
    fuse_layers(tensors, layers, "self_attn", fuse_qsa_projections)
