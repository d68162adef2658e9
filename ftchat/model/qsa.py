"""Gated GQA attention with the QSA block indexer (docs/model.md section 4).

Legend: B batch, T query tokens, L cached kv length, Hq/Hkv query/kv heads, hd head dim,
Hi index heads, di index head dim, r compress ratio, N blocks, K chosen blocks, S selected tokens,
NP fused projection width (Hq*2hd + 2*Hkv*hd + (Hi+1)*di).
Ties between equal block scores (exact 0.0 is common: sums of ReLUs) go to the lowest block index.

Prefill (T > 1) builds the dense [B, T, L] selection mask (`select_tokens`, also the reference).
Decode (T == 1) is O(budget): block scores from the cached compressed keys k̄ (cache['kbar'],
written once per block when its last token arrives), a fixed-size top-k and a gather of at most
budget + r - 1 tokens. Its shapes depend on kv_len only, never on the data, so it can be
captured in a CUDA graph (there kv_len is the whole capacity and the positions live on the device).

`attention_mixer_ref` is the torch path (CPU, prefill) and the reference. A CUDA decode step runs
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

from ftchat.kernels import use_fused
from ftchat.kernels.qsa_decode import (QsaDims, qsa_attention, qsa_decode_supported, qsa_prep,
                                       qsa_rank_keys)
from ftchat.model.config import ModelArgs
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


def write_block_keys(cache: dict, pos: Tensor, w: dict, a: ModelArgs) -> None:
    """Store k̄ of every block completed by the tokens at pos [B, T] (their raw ik already cached)
    in cache['kbar'] [B, Lmax // r, di]: block b completes with its last token r*b + r - 1."""
    ik, kbar = cache["ik"], cache["kbar"]
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


def select_blocks(iq: Tensor, kbar: Tensor, pos: Tensor, kv_len: int, a: ModelArgs
                  ) -> tuple[Tensor, Tensor]:
    """Selected token indices [B, S] and validity [B, S] of one query per row, S = K*r + r - 1
    (docs/model.md 4.5).

    iq [B, Hi, di] at positions pos [B]; kbar [B, Nmax, di] cached block keys. The K = min(top, N)
    best complete blocks of the first N = kv_len // r, then the open tail [r*floor((p+1)/r), p].
    Invalid entries (incomplete blocks, fewer complete blocks than K, tail past p) point at p.
    """
    r, top = a.indexer_compress_ratio, a.indexer_budget // a.indexer_compress_ratio
    N = min(kv_len // r, kbar.shape[1])
    K = min(top, N)
    dev = pos.device
    s = block_scores(iq[:, None], kbar[:, :N])[:, 0]  # [B, N]
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


def dense_attention(q: Tensor, iq: Tensor, cache: dict, pos: Tensor, kv_len: int, w: dict,
                    a: ModelArgs) -> Tensor:
    """o [B, T, Hq*hd] over the first kv_len cache entries under the dense selection mask."""
    mask = select_tokens(iq, cache["ik"][:, :kv_len], pos, w, a)  # [B, T, L]
    return attend(q, cache["k"][:, :kv_len], cache["v"][:, :kv_len], mask, a)


def sparse_attention(q: Tensor, iq: Tensor, cache: dict, pos: Tensor, kv_len: int, w: dict,
                     a: ModelArgs) -> Tensor:
    """o [B, 1, Hq*hd] of one query per row over its <= budget + r - 1 selected tokens only."""
    idx, ok = select_blocks(iq[:, 0], cache["kbar"], pos[:, 0], kv_len, a)  # [B, S]
    rows = torch.arange(idx.shape[0], device=idx.device)[:, None]
    keys, vals = cache["k"][rows, idx], cache["v"][rows, idx]  # [B, S, Hkv, hd]
    return attend(q, keys, vals, ok[:, None], a)


# The fused decode has passed its tests under the Triton interpreter only: it is off until
# tests/gpu/test_qsa_decode_gpu.py has passed on the device (the GPU tests switch it on).
FUSED_DECODE = False


def attention_mixer(x: Tensor, w: dict, cache: dict, pos: Tensor, kv_len: int, a: ModelArgs) -> Tensor:
    """x [B, T, D] at positions pos [B, T] -> [B, T, D]; appends to cache['k'|'v'|'ik']
    [B, Lmax, ...] and cache['kbar'] [B, Lmax // r, di] (blocks it completes).

    Attends over the first kv_len cache entries (every query's own position is < kv_len):
    dense for T > 1, sparse for T == 1. A CUDA decode step runs `attention_decode_fused`; the CPU,
    prefill and unsupported geometries `attention_mixer_ref`."""
    if (FUSED_DECODE and x.shape[1] == 1 and use_fused(x)
            and qsa_decode_supported(qsa_dims(a), x.dtype, x.shape[0])):
        return attention_decode_fused(x, w, cache, pos, kv_len, a)
    return attention_mixer_ref(x, w, cache, pos, kv_len, a)


# ===== fused decode (CUDA, T == 1) =====


def qsa_dims(a: ModelArgs) -> QsaDims:
    return QsaDims(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.indexer_n_heads,
                   a.indexer_head_dim, a.rotary_dim, a.indexer_compress_ratio)


def fused_projection(x: Tensor, w: dict) -> Tensor:
    """proj [B, NP] = [q|gate | k | v | index q|k] of x [B, D]: one GEMV on w[FUSED] when the
    load fused the four weights (`fuse_qsa_projections`), else four."""
    if FUSED in w:
        return F.linear(x, w[FUSED])
    return torch.cat([F.linear(x, w[n]) for n in PROJECTIONS], dim=-1)


def select_blocks_fused(iq: Tensor, kbar: Tensor, pos: Tensor, kv_len: int, a: ModelArgs
                        ) -> tuple[Tensor, Tensor]:
    """(block indices [B, K], ranking keys [B, K]; a key < 0 marks no block) of `select_blocks`:
    scores and keys in one kernel, the same torch.topk over the same keys (unsorted: the attention
    does not care about the order). iq [B, Hi, di]; kbar [B, Nmax, di]; pos [B, 1]."""
    r, top = a.indexer_compress_ratio, a.indexer_budget // a.indexer_compress_ratio
    N = min(kv_len // r, kbar.shape[1])
    keys = qsa_rank_keys(iq, kbar, pos, N, r)  # [B, N]
    best = torch.topk(keys, min(top, N), dim=-1, sorted=False)
    return best.indices, best.values


def attention_decode_fused(x: Tensor, w: dict, cache: dict, pos: Tensor, kv_len: int,
                           a: ModelArgs) -> Tensor:
    """One decode step x [B, 1, D] -> [B, 1, D] (docs/model.md 4.5): the fused projection GEMV,
    norms + RoPE + cache and k̄ writes (one kernel), block keys + torch.topk, split attention and
    the gated combine (two kernels), o_proj. Static shapes (kv_len only), no host sync."""
    dims = qsa_dims(a)
    proj = fused_projection(x[:, 0], w)  # [B, NP]
    norms = tuple(w[n] for n in ("q_norm.weight", "k_norm.weight", "indexer.q_layernorm.weight",
                                 "indexer.k_layernorm.weight"))
    q, iq = qsa_prep(proj, pos, cache, norms, dims, a.rms_norm_eps, a.rope_theta)
    blocks, keys = select_blocks_fused(iq, cache["kbar"], pos, kv_len, a)
    hd = a.head_dim
    gate = proj[:, : dims.heads * 2 * hd].unflatten(-1, (dims.heads, 2 * hd))[..., hd:]  # [B, Hq, hd]
    o = qsa_attention(q, gate, cache["k"], cache["v"], pos, dims, blocks=blocks, block_keys=keys)
    return F.linear(o, w["o_proj.weight"])[:, None]


# ===== torch path and reference =====


def attention_inputs_ref(qg: Tensor, k: Tensor, v: Tensor, iqk: Tensor, w: dict, cache: dict,
                         pos: Tensor, a: ModelArgs) -> tuple[Tensor, Tensor, Tensor]:
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
    cache["k"][rows, pos] = k
    cache["v"][rows, pos] = v
    cache["ik"][rows, pos] = iqk[..., Hi * di :]
    write_block_keys(cache, pos, w, a)
    return q, gate, iq


def attention_mixer_ref(x: Tensor, w: dict, cache: dict, pos: Tensor, kv_len: int,
                        a: ModelArgs) -> Tensor:
    """`attention_mixer` in torch (CPU, prefill; the reference of the fused decode)."""
    T = x.shape[1]
    qg = F.linear(x, w["q_proj.weight"])  # [B, T, Hq*2hd]
    k = F.linear(x, w["k_proj.weight"])
    v = F.linear(x, w["v_proj.weight"])
    iqk = F.linear(x, w["indexer.index_qk_proj.weight"])  # [B, T, (Hi+1)*di]
    q, gate, iq = attention_inputs_ref(qg, k, v, iqk, w, cache, pos, a)
    mix = sparse_attention if T == 1 else dense_attention
    o = mix(q, iq, cache, pos, kv_len, w, a)  # [B, T, Hq*hd]
    return F.linear(o * torch.sigmoid(gate), w["o_proj.weight"])


# ===== load-time fusion of the input projections =====

PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "indexer.index_qk_proj.weight")
FUSED = "qkv_index_fused.weight"  # [NP, D]; the four PROJECTIONS entries are row views of it


def fuse_qsa_projections(w: dict) -> dict[str, Tensor]:
    """The four input projections as one weight w[FUSED] (row views; layers.fuse_rows)."""
    return fuse_rows(w, PROJECTIONS, FUSED)


def fuse_qsa_layers(tensors: dict[str, Tensor], layers: list[dict]) -> None:
    fuse_layers(tensors, layers, "self_attn", PROJECTIONS, FUSED)
