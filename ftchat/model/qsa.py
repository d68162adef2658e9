"""Gated GQA attention with the QSA block indexer (ARCH.md section 4).

Legend: B batch, T query tokens, L cached kv length, Hq/Hkv query/kv heads, hd head dim,
Hi index heads, di index head dim, r compress ratio, N blocks.
Ties between equal block scores (exact 0.0 is common: sums of ReLUs) go to the lowest block index.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.model.config import ModelArgs
from ftchat.model.layers import apply_rope, rms_norm, rope_cos_sin


def select_tokens(iq: Tensor, ik: Tensor, pos: Tensor, w: dict, a: ModelArgs) -> Tensor:
    """QSA selection mask [B, T, L] (bool) for queries at positions pos [B, T].

    iq [B, T, Hi, di] normed + roped index queries; ik [B, L, di] raw index keys (cache).
    """
    B, L, di = ik.shape
    r, top = a.indexer_compress_ratio, a.indexer_budget // a.indexer_compress_ratio
    N = L // r
    j = torch.arange(L, device=pos.device)
    causal = j <= pos[..., None]  # [B, T, L]
    if N == 0:
        return causal
    pooled = ik[:, : N * r].float().unflatten(1, (N, r)).mean(2).to(ik.dtype)  # [B, N, di]
    kbar = rms_norm(pooled, w["indexer.k_layernorm.weight"], a.rms_norm_eps)
    cos, sin = rope_cos_sin(torch.arange(N, device=pos.device) * r, a.rotary_dim, a.rope_theta, ik.dtype)
    kbar = apply_rope(kbar, cos, sin)  # [B, N, di]
    s = torch.einsum("bthd,bnd->bthn", iq.float(), kbar.float())
    s = s.relu().sum(2) / math.sqrt(di)  # [B, T, N]
    complete = (torch.arange(N, device=pos.device) + 1) * r <= pos[..., None] + 1  # [B, T, N]
    s = torch.where(complete, s, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # stable: lowest index wins ties
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(N, device=pos.device).expand_as(order))
    chosen = complete & (rank < top)  # [B, T, N]
    tail = j >= (pos[..., None] + 1) // r * r  # the open block of each query: always kept
    in_block = chosen.repeat_interleave(r, dim=-1)
    in_block = F.pad(in_block, (0, L - N * r))
    return causal & (in_block | tail)


def attention_mixer(x: Tensor, w: dict, cache: dict, pos: Tensor, kv_len: int, a: ModelArgs) -> Tensor:
    """x [B, T, D] at positions pos [B, T]; appends to cache['k'|'v'|'ik'] [B, Lmax, ...].

    Attends over the first kv_len cache entries (every query's own position is < kv_len).
    """
    B, T, _ = x.shape
    Hq, Hkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    Hi, di = a.indexer_n_heads, a.indexer_head_dim
    eps = a.rms_norm_eps
    qg = F.linear(x, w["q_proj.weight"]).unflatten(-1, (Hq, 2 * hd))  # [B, T, Hq, 2hd]
    q, gate = qg[..., :hd], qg[..., hd:].flatten(-2)
    q = rms_norm(q, w["q_norm.weight"], eps)
    k = rms_norm(F.linear(x, w["k_proj.weight"]).unflatten(-1, (Hkv, hd)), w["k_norm.weight"], eps)
    v = F.linear(x, w["v_proj.weight"]).unflatten(-1, (Hkv, hd))
    cos, sin = rope_cos_sin(pos, a.rotary_dim, a.rope_theta, x.dtype)  # [B, T, rd]
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    k = apply_rope(k, cos[:, :, None], sin[:, :, None])
    iqk = F.linear(x, w["indexer.index_qk_proj.weight"])  # [B, T, (Hi+1)*di]
    iq = rms_norm(iqk[..., : Hi * di].unflatten(-1, (Hi, di)), w["indexer.q_layernorm.weight"], eps)
    iq = apply_rope(iq, cos[:, :, None], sin[:, :, None])
    rows = torch.arange(B, device=x.device)[:, None].expand(B, T)
    cache["k"][rows, pos] = k
    cache["v"][rows, pos] = v
    cache["ik"][rows, pos] = iqk[..., Hi * di :]

    keys, vals = cache["k"][:, :kv_len], cache["v"][:, :kv_len]  # [B, L, Hkv, hd]
    mask = select_tokens(iq, cache["ik"][:, :kv_len], pos, w, a)  # [B, T, L]
    rep = Hq // Hkv
    keys = keys.repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, Hq, L, hd]
    vals = vals.repeat_interleave(rep, dim=2).transpose(1, 2)
    scores = (q.transpose(1, 2) @ keys.transpose(-1, -2)) * hd**-0.5  # [B, Hq, T, L]
    scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
    o = (probs @ vals).transpose(1, 2).flatten(-2)  # [B, T, Hq*hd]
    return F.linear(o * torch.sigmoid(gate), w["o_proj.weight"])
