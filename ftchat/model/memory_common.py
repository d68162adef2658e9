"""The terms of the VRAM plan (docs/design.md section 4.9) that both decoders share: their dense
weights by plan item, the GDN decode state, and the prefill peaks of the blocks they run alike
(an RMSNorm, a causal attention query chunk, the GDN mixer of ftchat/model/gdn.py). Each
family's file (qwen4_exp_memory.py, qwen3_decoder_memory.py) adds its own blocks and notes.

Legend: B rows, L KV capacity (context), T prefill tokens, D hidden, act = bytes of the model
dtype; fp32 intermediates are 4 B. `a` is a family's args (ModelArgs or Qwen3Args: the fields
read here have the same names in both).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ftchat.codecs.nvfp4 import nvfp4_bytes
from ftchat.model import gdn, qsa
from ftchat.model.family import Args
from ftchat.vram.items import Item

# the checkpoint-name parts of the dense tensors both decoders have, and their plan item
SHARED_PARTS = ((".linear_attn.", "GDN projections"), (".self_attn.", "attention projections"),
                (".mlp.", "router and shared expert"))


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ===== dense weights and decode state (exact) =====


def dense_kind(name: str, parts: tuple[tuple[str, str], ...] = SHARED_PARTS) -> str:
    """The plan item a dense tensor (checkpoint name, prefix stripped) belongs to: the
    embedding, lm_head, the norms, else the item of the first of `parts` in its name."""
    if name == "embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if "norm" in name.rsplit(".", 2)[-2]:
        return "norms"
    for part, kind in parts:
        if part in name:
            return kind
    raise AssertionError(name)


def dense_bytes(a: Args, specs: dict, kinds: tuple[str, ...], kind_of: Callable[[str], str],
                dtype: torch.dtype, cuda: bool, dense_nvfp4: bool,
                skip: Callable[[str], bool] = lambda name: False) -> tuple[dict[str, int], int]:
    """Bytes by plan item (`kinds`, each tensor's `kind_of` its name) of the dense tensors
    `specs` but those `skip` names, as load_model leaves them: every float at the model dtype,
    int64 buffers kept, with dense_nvfp4 the ones kept packed (spec.kept_nvfp4: the GDN qkv / z)
    in NVFP4; lm_head [V, D] at the model dtype; on CUDA the embedding in pinned host memory
    (ftchat/model/embedding.py: 0 B of VRAM). Returns (bytes by item, the embedding's bytes)."""
    act = dtype.itemsize
    by_kind = dict.fromkeys(kinds, 0)
    for name, spec in specs.items():
        if skip(name):
            continue
        if dense_nvfp4 and spec.kept_nvfp4:
            by_kind[kind_of(name)] += nvfp4_bytes(*spec.shape)
        else:
            by_kind[kind_of(name)] += numel(spec.shape) * (8 if spec.init == "int64" else act)
    by_kind["lm_head"] = a.vocab_size * a.hidden_size * act
    embed = by_kind["embedding"]
    if cuda:
        by_kind["embedding"] = 0
    return by_kind, embed


def gdn_state_items(a: Args, n_gdn: int, rows: int, act: int) -> list[Item]:
    """The recurrent state (fp32 [Hv, dk, dv]) and the conv state ([conv dim, kernel - 1] at
    act) of n_gdn GDN layers of `rows` rows (state.GdnCache)."""
    Hk, Hv, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                      a.linear_value_head_dim)
    conv_dim, Kc = 2 * Hk * dk + Hv * dv, a.linear_conv_kernel_dim
    return [Item("GDN recurrent state", n_gdn * rows * Hv * dk * dv * 4,
                 f"{n_gdn} GDN layers x {rows} x [{Hv}, {dk}, {dv}] fp32"),
            Item("GDN conv state", n_gdn * rows * conv_dim * (Kc - 1) * act,
                 f"{n_gdn} layers x {rows} x [{conv_dim}, {Kc - 1}] x {act} B")]


# ===== a prefill call: blocks both decoders run (docs/design.md 4.9) =====
#
# Bytes per token (T of one sequence) or per query chunk of the tensors a block's torch code
# holds at its peak, walked through that code (the files named). tests/test_prefill_memory.py
# and tests/test_qwen3_synth.py measure the same peaks on the CPU (the profiler's allocation
# events) and check the plan covers them.


def rms_norm_peak(n: int, act: int) -> int:
    """layers.rms_norm of n elements at its peak: x.float(), x * rsqrt(..), that times
    (1 + w) (fp32 each, the first two kept as locals) and the cast to the model dtype."""
    return n * (12 + act)


def causal_chunk_bytes(a: Args, act: int, T: int, L: int) -> int:
    """A causal attention over KV length L of T queries in chunks of qsa.causal_query_chunk
    queries: the K/V repeated over the query heads, and one chunk's inverted mask and scores
    (the masked ones, softmax's fp32 copy of them and its output, then the output cast to act),
    its q copy, output and transposed output."""
    Hq, hd = a.num_attention_heads, a.head_dim
    tq = qsa.causal_query_chunk(T, L, a)
    return 2 * Hq * L * hd * act + tq * (L + Hq * L * max(act + 8, 2 * act + 4)
                                         + 3 * Hq * hd * act)


def gdn_block_bytes(a: Args, act: int, t: int) -> int:
    """Peak bytes of gdn.gdn_core_block's prefill of t tokens (t padded to whole chunks), above
    its inputs: the max over its steps. Per token and value head, fp32: the conv output [conv
    dim] (act), q, k [dk], v [dv] heads first; in delta_rule_block the decay and L [C], kb [dk],
    rhs and the solve's output [dv + dk] each, k_decay [dk], the states [dk dv / C], q e^gamma
    [dk], the output [dv], q kᵀ [C] and its product [dv]; the gated norm's fp32 [dv] copies."""
    Hk, Hv, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                      a.linear_value_head_dim)
    C = gdn.CHUNK
    t = -(-t // C) * C
    conv = act * (2 * Hk * dk + Hv * dv)  # per token
    qkv = 4 * Hv * (2 * dk + dv)
    f = 4 * Hv  # one fp32 value per token and value head
    small = 5 * f  # g, beta (fp32), gamma, e^gamma, the exp of last - gamma
    rule = f * max(3 * C + dk,  # kb kᵀ and its product with the decay; L
                   2 * C + 2 * dk + dv,  # rhs filled (kb still alive)
                   2 * C + 2 * (dv + dk),  # the solve: rhs and its output
                   C + dv + 2 * dk + dk * dv // C,  # chunk_states: k_decay, the states
                   C + 2 * dv + 2 * dk + dk * dv // C,  # (q e^gamma) @ states
                   2 * dv + dk + 3 * C)  # q kᵀ times the decay
    steps = (3 * conv,  # causal_conv: the window, the conv output, its silu
             2 * conv,  # the padding copy of the conv output
             conv + 4 * Hv * 3 * dk,  # l2norm of k: q done, k's fp32 copy and its square
             conv + qkv,  # v's fp32 copy: the conv output is freed after it
             qkv + small + rule,  # delta_rule_block
             f * dv * 4 + act * Hv * dv * 3)  # gated_rms_norm: o, x.float(), x * r, z.float()
    return t * max(steps) + 4 * Hv * dk * dv  # + chunk_states' running state


def gdn_prefill_bytes(a: Args, act: int, T: int, dense_nvfp4: bool = False,
                      cuda: bool = True) -> int:
    """Peak bytes of gdn.gdn_mixer_ref's prefill of T > 1 tokens above its input x: the four
    projections u, z, b, a (kept until out_proj), the core's output [T, Hv*dv] when it runs in
    more than one sub-block, and one sub-block's transients (`gdn_block_bytes`, at most
    GDN_SUBBLOCK tokens: bounded whatever T); or out_proj's moment (the core output and y).
    With the GDN qkv / z kept in NVFP4 (dense_nvfp4) each projection's weight is dequantized
    for the call (gdn.dense: one kernel to the model dtype on CUDA; on the CPU nvfp4.dequantize's
    int32 codes and fp32 values, scales and products, ~30 B an element measured: 32 planned)."""
    D, Hv, dv = a.hidden_size, a.linear_num_value_heads, a.linear_value_head_dim
    conv_dim = 2 * a.linear_num_key_heads * a.linear_key_head_dim + Hv * dv
    proj = T * act * (conv_dim + Hv * dv + 2 * Hv)
    core_out = T * act * Hv * dv
    weight = 0
    if dense_nvfp4:
        weight = conv_dim * D * (act if cuda else 32 + act)
    sub = min(T, gdn.GDN_SUBBLOCK)
    return proj + max(weight,
                      (core_out if T > gdn.GDN_SUBBLOCK else 0) + gdn_block_bytes(a, act, sub),
                      core_out + T * act * D)
