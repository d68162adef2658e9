"""Per-layer hashed n-gram embedding (PLE, docs/model.md section 7).

Legend: B batch, T tokens, D hidden, hc streams, nh n-gram heads, dh row width.
State per sequence: ctx [2] previous token ids (eos at the start), conv [hc*D, 9] of the conv input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import ple_decode
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.model.config import ModelArgs
from ftchat.model.layers import rms_norm
from ftchat.model.ngram_table import HostTable, NGramTable

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def splitmix64(v: int) -> int:
    v = (v + GAMMA) & MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & MASK64
    return v ^ (v >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [2 * (splitmix64((base + GAMMA * (i + 1)) & MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_primes(base: int, count: int, first: int = 0) -> list[int]:
    """The (first+1)-th .. (first+count)-th primes >= base (one table per hash head)."""
    out, p = [], base - 1
    while len(out) < first + count:
        p += 1
        while not _is_prime(p):
            p += 1
        out.append(p)
    return out[first:]


def table_rows(a: ModelArgs, ple_index: int) -> tuple[list[int], list[int], int]:
    """(primes, offsets, padded row count) of one PLE layer's n-gram table."""
    nh = (a.ngram_size - 1) * a.heads_per_ngram
    primes = head_primes(a.ngram_vocab_size_base, nh, first=ple_index * nh)
    offsets = [sum(primes[:i]) for i in range(nh)]
    div = a.make_ngram_vocab_size_divisible_by
    return primes, offsets, -(-sum(primes) // div) * div


def ngram_rows(ids: Tensor, ctx: Tensor, mult: Tensor, primes: Tensor, offsets: Tensor,
               eos: int, heads_per_ngram: int) -> Tensor:
    """Table rows [B, T, nh] for tokens ids [B, T] after context ctx [B, n-1] (n = ngram size)."""
    hist = torch.cat([ctx, ids], dim=1).long()  # [B, n-1+T]
    n = mult.shape[0]
    T = ids.shape[1]
    cur = hist[:, n - 1 :]  # [B, T]
    mixed = cur * mult[0]
    blocks, cut = [], torch.zeros_like(cur, dtype=torch.bool)
    for s in range(1, n):
        prev = hist[:, n - 1 - s : n - 1 - s + T]  # token at distance s
        # an eos strictly between the token at distance s and the current one hides it
        if s > 1:
            cut = cut | (hist[:, n - s : n - s + T] == eos)
        prev = torch.where(cut, torch.full_like(prev, eos), prev)
        mixed = mixed ^ (prev * mult[s])
        h = slice((s - 1) * heads_per_ngram, s * heads_per_ngram)
        blocks.append(torch.remainder(mixed[..., None], primes[h]) + offsets[h])
    return torch.cat(blocks, dim=-1)  # [B, T, nh]


# Tokens of a prefill the PLE layer forms at once: its [T, hc*D] transients (key, query, G and
# their fp32 norms) exist for one sub-block at a time, not for the whole prefill call
# (qwen4_exp_memory.py `ple_block_bytes`); every op is per token but the conv, whose state carries
PLE_SUBBLOCK = 1024


def ple_residual(R: Tensor, ids: Tensor, w: dict, ctx: Tensor, conv: Tensor, a: ModelArgs, *,
                 kc: KernelConfig = DEFAULT) -> Tensor:
    """R + ple_layer(R, ids, w, ctx, conv, a): the residual stream after the PLE layer. A CUDA
    decode step (fused kernels on in kc) runs the rows and the block in two kernels around the
    GEMVs (ftchat/kernels/ple_decode.py; within a few bf16 ulps of this path)."""
    if kc.runs_fused(R) and ple_decode.supported(R):
        rows = ple_decode.ngram_rows_decode(
            ids, ctx, w["ple_embedding.layer_multipliers"],
            w["ple_embedding.ngram_heads_vocab_sizes"], w["ple_embedding.ngram_heads_offsets"],
            a.eos_token_id, a.heads_per_ngram, kc=kc)  # [B, 1, nh]
        E = embedding(w["ple_embedding.ngram_embedding.weight"], rows, R, kc=kc)  # [B, 1, nh*dh]
        key, value = F.linear(E, w["key_proj.weight"]), F.linear(E, w["value_proj.weight"])
        return ple_decode.ple_block_decode(R, key, value, w, conv, a.rms_norm_eps,
                                           a.ngram_size, kc=kc)
    return R + ple_layer(R, ids, w, ctx, conv, a, kc=kc)


def ple_layer(R: Tensor, ids: Tensor, w: dict, ctx: Tensor, conv: Tensor, a: ModelArgs, *,
              kc: KernelConfig = DEFAULT) -> Tensor:
    """Returns the PLE residual update [B, T, hc*D] for R [B, T, hc*D] after the context ctx
    [B, n-1] (token ids); advances conv [B, hc*D, (k-1)*dilation] in place.
    A prefill runs in sub-blocks of PLE_SUBBLOCK tokens (the same bits: per-token ops, and the
    conv's state passes from one sub-block to the next)."""
    rows = ngram_rows(ids, ctx, w["ple_embedding.layer_multipliers"],
                      w["ple_embedding.ngram_heads_vocab_sizes"], w["ple_embedding.ngram_heads_offsets"],
                      a.eos_token_id, a.heads_per_ngram)  # [B, T, nh]
    T = R.shape[1]
    if T <= PLE_SUBBLOCK:
        return ple_block(R, rows, w, conv, a, kc=kc)
    out = torch.empty_like(R)
    for t0 in range(0, T, PLE_SUBBLOCK):
        p = slice(t0, t0 + PLE_SUBBLOCK)
        out[:, p] = ple_block(R[:, p], rows[:, p], w, conv, a, kc=kc)
    return out


def ple_block(R: Tensor, rows: Tensor, w: dict, conv: Tensor, a: ModelArgs, *,
              kc: KernelConfig = DEFAULT) -> Tensor:
    """`ple_layer` of R [B, t, hc*D] with its table rows [B, t, nh]; advances conv in place."""
    E = embedding(w["ple_embedding.ngram_embedding.weight"], rows, R, kc=kc)  # [B, t, nh*dh]
    key = rms_norm(F.linear(E, w["key_proj.weight"]), w["norm_key.weight"], a.rms_norm_eps,
                   a.hidden_size)  # the projection is freed at once (the VRAM plan's peak)
    value = F.linear(E, w["value_proj.weight"])  # [B, t, D]
    return ple_mix(R, key, value, w, conv, a)


def ple_mix(R: Tensor, key: Tensor, value: Tensor, w: dict, conv: Tensor, a: ModelArgs
            ) -> Tensor:
    """`ple_block` after its GEMVs and the key's norm: key [B, t, hc*D] (normed), value [B, t,
    D]; with the key norm, the reference of ftchat/kernels/ple_decode.py's block kernel.
    Advances conv in place."""
    D, hc = a.hidden_size, a.hc_count
    query = rms_norm(R, w["norm_query.weight"], a.rms_norm_eps, D)
    u = (key.unflatten(-1, (hc, D)) * query.unflatten(-1, (hc, D))).sum(-1, keepdim=True) / math.sqrt(D)
    u = u.abs().clamp_min(1e-6).sqrt() * u.sign()  # [B, t, hc, 1]
    G = (torch.sigmoid(u) * value[:, :, None]).flatten(-2)  # [B, t, hc*D]
    N = rms_norm(G, w["norm_conv.weight"], a.rms_norm_eps, D)
    return G + dilated_conv(N, conv, w["conv1d.weight"].squeeze(1), a.ngram_size)


def embedding(emb: Tensor | NGramTable | HostTable, rows: Tensor, R: Tensor, *,
              kc: KernelConfig = DEFAULT) -> Tensor:
    """E [B, T, nh*dh] in R's dtype on R's device: the table's rows [B, T, nh] concatenated
    (section 7.1), dequantized (7.4). A pinned host table on CUDA is gathered by the Triton
    kernel (no host sync: graph-capturable); files read in place (NGramTable) cost one."""
    if isinstance(emb, HostTable):
        return emb.gather(rows, R.dtype, kc=kc)
    return emb[rows.to(emb.device)].to(R.device, R.dtype).flatten(-2)


def dilated_conv(N: Tensor, conv_state: Tensor, w: Tensor, dilation: int) -> Tensor:
    """silu(depthwise conv, dilation) over N [B, T, C]; conv_state [B, C, (k-1)*dilation] in place."""
    T = N.shape[1]
    window = torch.cat([conv_state.to(N.dtype), N.transpose(1, 2)], dim=-1)
    conv_state.copy_(window[..., -conv_state.shape[-1] :])
    out = F.conv1d(window, w.unsqueeze(1).to(N.dtype), groups=w.shape[0], dilation=dilation)
    return F.silu(out[..., -T:]).transpose(1, 2)
