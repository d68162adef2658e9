"""Full causal GQA attention of the Qwen3 MoE line (docs/model.md section 15.3): per-head q/k
RMSNorm, partial RoPE, and in qwen3_5_moe / qwen3_next an output gate read from the same
projection as the query (o * sigmoid(gate), the gate of qwen4_exp's attention without its QSA
indexer). K and V live in an AttentionCache (ftchat/model/kv_cache.py, model dtype or FP8) whose
index tensors are empty.

Legend: B batch, T query tokens, L = kv_len cached entries, Hq/Hkv query/kv heads, hd head dim.
This is the torch path on every device: the fused CUDA decode kernels of ftchat/kernels/qsa_*.py
need the indexer's block keys, so these families' attention does not take them (docs/design.md
"Model families"). Its shapes depend on kv_len only, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.model.kv_cache import AttentionCache, gather_kv, store_kv
from ftchat.model.layers import apply_rope, rms_norm, rope_cos_sin
from ftchat.model.qsa import attend, causal_query_chunk


def plain_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm with a plain weight (qwen3_moe): cast(x * rsqrt(mean(x^2) + eps)) * w, the
    statistic in fp32, the product in the weight's dtype."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm(x: Tensor, w: Tensor, a) -> Tensor:
    """The family's RMSNorm: zero-centred (1 + w) or plain (a.zero_centred_norms)."""
    if a.zero_centred_norms:
        return rms_norm(x, w, a.rms_norm_eps)
    return plain_rms_norm(x, w, a.rms_norm_eps)


def new_cache(a, batch: int, max_len: int, device, dtype: torch.dtype,
              kv_dtype: torch.dtype | None) -> AttentionCache:
    """A zeroed K/V cache of one attention layer (no index keys: width 0)."""
    return AttentionCache.zeros(batch, max_len, a.num_key_value_heads, a.head_dim, 0, 1, device,
                                dtype, kv_dtype)


def attention_mixer(x: Tensor, w: dict, cache: AttentionCache, pos: Tensor, kv_len: int,
                    a) -> Tensor:
    """x [B, T, D] at positions pos [B, T] -> [B, T, D]; writes K, V at pos and attends causally
    over the first kv_len cache entries (every position in pos is < kv_len), in query chunks
    (qsa.causal_query_chunk) so the scores stay bounded."""
    B, T, _ = x.shape
    Hq, Hkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    qg = F.linear(x, w["q_proj.weight"])
    gate = None
    if a.attention_gate:  # per head [query | gate]
        qg = qg.unflatten(-1, (Hq, 2 * hd))  # [B, T, Hq, 2hd]
        q, gate = qg[..., :hd], qg[..., hd:].flatten(-2)  # [B, T, Hq, hd], [B, T, Hq*hd]
    else:
        q = qg.unflatten(-1, (Hq, hd))
    k = F.linear(x, w["k_proj.weight"]).unflatten(-1, (Hkv, hd))  # [B, T, Hkv, hd]
    v = F.linear(x, w["v_proj.weight"]).unflatten(-1, (Hkv, hd))
    q, k = norm(q, w["q_norm.weight"], a), norm(k, w["k_norm.weight"], a)
    cos, sin = rope_cos_sin(pos, a.rotary_dim, a.rope_theta, x.dtype)  # [B, T, rd]
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    k = apply_rope(k, cos[:, :, None], sin[:, :, None])
    rows = torch.arange(B, device=x.device)[:, None].expand(B, T)
    store_kv(cache, (rows, pos), k, v)
    keys, vals = gather_kv(cache, (slice(None), slice(None, kv_len)), x.dtype)  # [B, L, Hkv, hd]
    causal = torch.arange(kv_len, device=x.device) <= pos[..., None]  # [B, T, L]
    tq = causal_query_chunk(T, kv_len, a)
    o = torch.cat([attend(q[:, i:i + tq], keys, vals, causal[:, i:i + tq], a)
                   for i in range(0, T, tq)], dim=1)  # [B, T, Hq*hd]
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return F.linear(o, w["o_proj.weight"])
