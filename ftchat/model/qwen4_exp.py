"""Qwen3.8-Flash-Next (HF qwen4_exp) text decoder: hyper-connections, GDN/QSA mixers, PLE, MoE.

Legend: B batch, T tokens, D hidden, hc streams, E experts, K top-k, V vocab.
Weights are a flat dict keyed by checkpoint names without the `model.language_model.` prefix;
per-request state (DecodeState) and the routed-expert backend come in as arguments.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import hyper
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.model.config import ModelArgs
from ftchat.model.expert_backend import ExpertBackend
from ftchat.model.embedding import EMBED, embed
from ftchat.model.gdn import fuse_gdn_layers, gdn_mixer
from ftchat.model.layers import ROUTER, fuse_moe_layers, rms_norm
from ftchat.model.moe import (moe_block, moe_decode_fused, route, route_ref,  # noqa: F401
                              runs_fused as _fused, shared_expert_parts)
from ftchat.model.ple import ple_residual
from ftchat.model.qsa import attention_mixer, fuse_qsa_layers
from ftchat.model.state import DecodeState

BLOCKS = ("ple", "attn_hyper_connection", "self_attn", "linear_attn", "mlp_hyper_connection", "mlp")


class Weights:
    """Dense weights by checkpoint name (routed experts live in rows elsewhere), grouped once:
    layers[i][block] holds `layers.{i}.{block}.*` with the prefix stripped. `kernels`: the
    kernel configuration every kernel of the forward pass runs with (ftchat/kernels/config.py)."""

    def __init__(self, tensors: dict[str, Tensor], num_layers: int,
                 kernels: KernelConfig = DEFAULT):
        self.tensors = tensors
        self.kernels = kernels
        self.layers = [
            {b: _sub(tensors, f"layers.{i}.{b}.") for b in BLOCKS} for i in range(num_layers)
        ]
        self.final_mixer = _sub(tensors, "hyper_connection_mixer.")
        fuse_gdn_layers(tensors, self.layers)  # GDN decode: one GEMV on [qkv | z | b | a]
        fuse_moe_layers(tensors, self.layers)  # one GEMV on [gate | up | gate logit | router]
        fuse_qsa_layers(tensors, self.layers)  # QSA decode: one GEMV on [q|gate | k | v | index]

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def with_kernels(self, kernels: KernelConfig) -> Weights:
        """The same weights (shared, not copied) run with another kernel configuration: a bench
        arm's."""
        view = copy.copy(self)
        view.kernels = kernels
        return view


def hc_read(R: Tensor, w: dict, a: ModelArgs, inject: bool = True, *,
            kc: KernelConfig = DEFAULT):
    """Hyper-connection mix: block input x [.., D] and injection weights s [.., hc] from
    R [.., hc*D]. Fused kernels (ftchat/kernels/hyper.py) for CUDA decode, else `hc_read_ref`."""
    if not _fused(R, hyper.HC_MAX_ROWS, kc):
        return hc_read_ref(R, w, a, inject)
    _, x, s = hyper.hc_mix_triton(R, w, a.hc_count, a.rms_norm_eps, inject=inject, kc=kc)
    return (x, s) if inject else x


# Tokens of a prefill the hyper-connection read forms at once: its fp32 RMSNorm of [T, hc*D]
# exists for one sub-block at a time (qwen4_exp_memory.py `hc_mix_bytes`); every op is per
# token
HC_SUBBLOCK = 1024


def hc_read_ref(R: Tensor, w: dict, a: ModelArgs, inject: bool = True):
    """The torch reference (and CPU path) of `hc_read`; every op in R's dtype, RMS in fp32.
    A prefill R [B, T, hc*D] runs in sub-blocks of HC_SUBBLOCK tokens (the same bits)."""
    if R.dim() == 3 and R.shape[1] > HC_SUBBLOCK:
        parts = [hc_read_block(R[:, t:t + HC_SUBBLOCK], w, a, inject)
                 for t in range(0, R.shape[1], HC_SUBBLOCK)]
        if not inject:
            return torch.cat(parts, dim=1)
        return torch.cat([x for x, _ in parts], dim=1), torch.cat([s for _, s in parts], dim=1)
    return hc_read_block(R, w, a, inject)


def hc_read_block(R: Tensor, w: dict, a: ModelArgs, inject: bool = True):
    """`hc_read_ref` of R [.., hc*D] at once."""
    D, hc = a.hidden_size, a.hc_count
    Rn = rms_norm(R, w["hc_norm.weight"], a.rms_norm_eps, group=D)
    m = F.silu(F.linear(Rn, w["input_mix_weight_down.weight"]) / hc)
    m = torch.sigmoid(F.linear(m, w["input_mix_weight_up.weight"]))
    x = (m.unflatten(-1, (hc, D)) * Rn.unflatten(-1, (hc, D))).mean(-2)  # [.., D]
    if not inject:
        return x
    s = 2 * torch.sigmoid(F.linear(Rn, w["block_inject_weight.weight"]) / hc)  # [.., hc]
    return x, s


def hc_write(R: Tensor, y: Tensor, s: Tensor, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """R_i += s_i * y for every stream i (out of place); one kernel on CUDA decode."""
    if _fused(R, hyper.HC_MAX_ROWS, kc):
        return hyper.hc_write_triton(R, y, s, kc=kc)
    return hc_write_ref(R, y, s)


def hc_write_ref(R: Tensor, y: Tensor, s: Tensor) -> Tensor:
    return R + (y[..., None, :] * s[..., :, None]).flatten(-2)


def hc_write_read(R: Tensor, y: Tensor | None, s: Tensor | None, w: dict, a: ModelArgs,
                  inject: bool = True, *, kc: KernelConfig = DEFAULT
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """The previous block's write then the next mix: (R', x, s') with R' = hc_write(R, y, s)
    (R when y is None) and x, s' = hc_read(R'); s' is None without inject. On CUDA decode the
    write rides in the read's two kernels (they read R anyway), so it costs no launch."""
    if _fused(R, hyper.HC_MAX_ROWS, kc):
        return hyper.hc_mix_triton(R, w, a.hc_count, a.rms_norm_eps, y, s, inject, kc=kc)
    if y is not None:
        R = hc_write_ref(R, y, s)
    out = hc_read_ref(R, w, a, inject)
    return (R, *out) if inject else (R, out, None)


def forward(tokens: Tensor, pos: Tensor, W: Weights, state: DecodeState, rows: slice,
            experts: ExpertBackend, a: ModelArgs, kv_len: int,
            logits_at: slice | None = slice(None)) -> Tensor | None:
    """Logits [B, n, V] for tokens [B, T] at positions pos [B, T] of state rows `rows` (B of them):
    the n positions of T that `logits_at` picks (every one by default; slice(-1, None): the last,
    all a prefill's sampler needs). None: no logits (an earlier prefill chunk), returns None.

    The state rows (views) advance in place: KV, conv, recurrent, PLE context. Attention reads
    the first kv_len cache entries (> every position in pos).
    """
    kc = W.kernels  # every kernel below runs with it
    x = embed(W[EMBED], tokens, kc=kc)  # [B, T, D]; the table may sit in pinned host memory
    R = x.repeat(1, 1, a.hc_count)  # [B, T, hc*D]
    y = s = None  # the last block's output and injection: its write R += s*y rides in the next read
    for i in range(a.num_hidden_layers):
        lw = W.layers[i]
        if i in a.ple_layers:
            if y is not None:
                R, y = hc_write(R, y, s, kc=kc), None
            R = ple_residual(R, tokens, lw["ple"], state.ple_ctx[rows], state.ple[i].conv[rows],
                             a, kc=kc)  # R + the PLE layer's update
        attention = a.is_attention(i)
        mixer_w = lw["self_attn"] if attention else lw["linear_attn"]
        R, h, s = hc_write_read(R, y, s, lw["attn_hyper_connection"], a, kc=kc)
        cache = state.mixers[i].rows(rows)  # AttentionCache or GdnCache
        if attention:
            y = attention_mixer(h, mixer_w, cache, pos, kv_len, a, kc=kc)
        else:
            y = gdn_mixer(h, mixer_w, cache.conv, cache.recurrent, a, kc=kc)
        R, h, s = hc_write_read(R, y, s, lw["mlp_hyper_connection"], a, kc=kc)
        y = moe_block(i, h, lw["mlp"], experts, a, kc=kc)
    n = a.ngram_size - 1
    ctx = state.ple_ctx[rows]
    ctx.copy_(torch.cat([ctx, tokens.to(ctx.dtype)], dim=1)[:, -n:])
    if logits_at is None:
        return None  # only the state advances: R feeds nothing but the logits
    # The pending write, the final mixer and lm_head are per token (docs/model.md 3: a grouped norm
    # and linears over each token's streams), so picking the rows first is the same math and a
    # long prefill chunk skips the [T, V] output. Bits may move by the summation order of a
    # GEMM of fewer rows, and on CUDA <= 8 rows take decode's fused mixer (within a bf16 ulp).
    R, y, s = R[:, logits_at], y[:, logits_at], s[:, logits_at]
    _, h, _ = hc_write_read(R, y, s, W.final_mixer, a, inject=False, kc=kc)
    return F.linear(h, W["lm_head.weight"])


def routers(W: Weights, a: ModelArgs) -> list[Tensor]:
    """The router weight [E, D] of every layer (the offload backend's lookahead reads them)."""
    return [W.layers[i]["mlp"][ROUTER] for i in range(a.num_hidden_layers)]


def _sub(w: dict, prefix: str) -> dict:
    n = len(prefix)
    return {k[n:]: v for k, v in w.items() if k.startswith(prefix)}


def describe(a: ModelArgs) -> list[str]:
    """`ftchat info`'s layers, pattern and geometry lines."""
    n_attn = sum(a.is_attention(i) for i in range(a.num_hidden_layers))
    pattern = "".join("A" if a.is_attention(i) else "G" for i in range(a.num_hidden_layers))
    ple = ", ".join(str(i) for i in a.ple_layer_ids) or "none"
    return [
        f"layers       {a.num_hidden_layers}: {a.num_hidden_layers - n_attn} GDN (linear_attention)"
        f", {n_attn} attention (indexed_attention); PLE at layer(s) {ple}",
        f"pattern      {pattern}  (G = GDN, A = attention)",
        f"geometry     hidden {a.hidden_size}, vocab {a.vocab_size}, {a.num_experts} experts "
        f"top-{a.num_experts_per_tok}, expert inner {a.moe_intermediate_size}, shared expert "
        f"inner {a.shared_expert_intermediate_size}, {a.hc_count} hyper-connection streams",
    ]
