"""The tensor inventory of a qwen4_exp checkpoint (docs/model.md section 1.2), derived from ModelArgs,
and of the blocks the Qwen3 MoE line's decoder shares with it (attention, GDN, the MoE block's
dense tensors: qwen3_decoder.layer_specs).

Names are relative to the text-model prefix (`model.language_model.` in the real checkpoint,
`model.` in a transformers save), except `lm_head.weight`. Used to validate what the reader finds
and to write synthetic checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftchat.model.config import ModelArgs
from ftchat.model.ple import table_rows

# How a tensor is initialised in a synthetic checkpoint.
LINEAR, NORM, PLAIN_NORM, CONV, A_LOG, DT_BIAS, EMBED, INT64 = (
    "linear", "norm", "plain_norm", "conv", "a_log", "dt_bias", "embed", "int64")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    init: str
    quantizable: bool = False  # an NVFP4 export may quantize it
    kept_nvfp4: bool = False  # stored NVFP4, it stays so in memory (nvfp4.Nvfp4Weight)


def hc_specs(prefix: str, a: ModelArgs, inject: bool = True) -> dict[str, TensorSpec]:
    C = a.hc_count * a.hidden_size
    out = {
        f"{prefix}.hc_norm.weight": TensorSpec((C,), NORM),
        f"{prefix}.input_mix_weight_down.weight": TensorSpec((a.hc_lowrank, C), LINEAR),
        f"{prefix}.input_mix_weight_up.weight": TensorSpec((C, a.hc_lowrank), LINEAR),
    }
    if inject:
        out[f"{prefix}.block_inject_weight.weight"] = TensorSpec((a.hc_count, C), LINEAR)
    return out


def attention_specs(q: str, a: ModelArgs, q_rows: int, norm: str) -> dict[str, TensorSpec]:
    """The q/k/v/o projections and q/k RMSNorms (init `norm`) of the attention block `q` (its
    name prefix); q_rows: q_proj's rows (2 Hq hd with a per-head output gate)."""
    D, hd, Hq, Hkv = a.hidden_size, a.head_dim, a.num_attention_heads, a.num_key_value_heads
    return {
        f"{q}.q_proj.weight": TensorSpec((q_rows, D), LINEAR, True),
        f"{q}.k_proj.weight": TensorSpec((Hkv * hd, D), LINEAR, True),
        f"{q}.v_proj.weight": TensorSpec((Hkv * hd, D), LINEAR, True),
        f"{q}.o_proj.weight": TensorSpec((D, Hq * hd), LINEAR, True),
        f"{q}.q_norm.weight": TensorSpec((hd,), norm),
        f"{q}.k_norm.weight": TensorSpec((hd,), norm),
    }


def gdn_specs(g: str, a: ModelArgs, packed: bool = False) -> dict[str, TensorSpec]:
    """The Gated DeltaNet block `g`: its input projections, then the conv, A_log, dt_bias, the
    gated norm and out_proj. packed: qwen3_next's in_proj_qkvz / in_proj_ba (regrouped at load,
    qwen3_next.unpack_gdn_inputs); else in_proj_qkv, _z (a checkpoint may store these two NVFP4,
    model.md 11.5: a decode GEMV reads them so), _b, _a."""
    D = a.hidden_size
    Hk, Hv, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads,
                      a.linear_key_head_dim, a.linear_value_head_dim)
    conv_dim = 2 * Hk * dk + Hv * dv
    if packed:
        s = {f"{g}.in_proj_qkvz.weight": TensorSpec((conv_dim + Hv * dv, D), LINEAR, True),
             f"{g}.in_proj_ba.weight": TensorSpec((2 * Hv, D), LINEAR)}
    else:
        s = {f"{g}.in_proj_qkv.weight": TensorSpec((conv_dim, D), LINEAR, True, True),
             f"{g}.in_proj_z.weight": TensorSpec((Hv * dv, D), LINEAR, True, True),
             f"{g}.in_proj_b.weight": TensorSpec((Hv, D), LINEAR),
             f"{g}.in_proj_a.weight": TensorSpec((Hv, D), LINEAR)}
    s.update({
        f"{g}.conv1d.weight": TensorSpec((conv_dim, 1, a.linear_conv_kernel_dim), CONV),
        f"{g}.A_log": TensorSpec((Hv,), A_LOG),
        f"{g}.dt_bias": TensorSpec((Hv,), DT_BIAS),
        f"{g}.norm.weight": TensorSpec((dv,), PLAIN_NORM),
        f"{g}.out_proj.weight": TensorSpec((D, Hv * dv), LINEAR, True),
    })
    return s


def moe_specs(m: str, a: ModelArgs, shared: bool = True) -> dict[str, TensorSpec]:
    """The dense tensors of the MoE block `m`: the router [E, D] and, with `shared`, the shared
    expert and its sigmoid gate (the routed experts are `expert_specs`)."""
    D, Is = a.hidden_size, a.shared_expert_intermediate_size
    s = {f"{m}.gate.weight": TensorSpec((a.num_experts, D), LINEAR)}
    if shared:
        s.update({
            f"{m}.shared_expert.gate_proj.weight": TensorSpec((Is, D), LINEAR, True),
            f"{m}.shared_expert.up_proj.weight": TensorSpec((Is, D), LINEAR, True),
            f"{m}.shared_expert.down_proj.weight": TensorSpec((D, Is), LINEAR, True),
            f"{m}.shared_expert_gate.weight": TensorSpec((1, D), LINEAR),
        })
    return s


def layer_specs(i: int, a: ModelArgs) -> dict[str, TensorSpec]:
    D, p = a.hidden_size, f"layers.{i}"
    s: dict[str, TensorSpec] = {}
    s.update(hc_specs(f"{p}.attn_hyper_connection", a))
    s.update(hc_specs(f"{p}.mlp_hyper_connection", a))
    if a.is_attention(i):
        Hi, di = a.indexer_n_heads, a.indexer_head_dim
        q = f"{p}.self_attn"
        s.update(attention_specs(q, a, a.num_attention_heads * a.head_dim * 2, NORM))
        s.update({
            f"{q}.indexer.index_qk_proj.weight": TensorSpec(((Hi + 1) * di, D), LINEAR),
            f"{q}.indexer.q_layernorm.weight": TensorSpec((di,), NORM),
            f"{q}.indexer.k_layernorm.weight": TensorSpec((di,), NORM),
        })
    else:
        s.update(gdn_specs(f"{p}.linear_attn", a))
    if i in a.ple_layers:
        C = a.hc_count * D
        e = f"{p}.ple"
        nh = (a.ngram_size - 1) * a.heads_per_ngram
        rows = table_rows(a, a.ple_layers.index(i))[2]
        shard_rows = rows // a.split_ngram_parts
        s.update({
            f"{e}.key_proj.weight": TensorSpec((C, a.ple_embed_dim), LINEAR),
            f"{e}.value_proj.weight": TensorSpec((D, a.ple_embed_dim), LINEAR),
            f"{e}.norm_key.weight": TensorSpec((C,), NORM),
            f"{e}.norm_query.weight": TensorSpec((C,), NORM),
            f"{e}.norm_conv.weight": TensorSpec((C,), NORM),
            f"{e}.conv1d.weight": TensorSpec((C, 1, a.ple_conv_kernel_size), CONV),
            f"{e}.ple_embedding.layer_multipliers": TensorSpec((a.ngram_size,), INT64),
            f"{e}.ple_embedding.ngram_heads_vocab_sizes": TensorSpec((nh,), INT64),
            f"{e}.ple_embedding.ngram_heads_offsets": TensorSpec((nh,), INT64),
        })
        for j in range(a.split_ngram_parts):
            s[f"{e}.ple_embedding.ngram_embedding.shard_{j}.weight"] = TensorSpec(
                (shard_rows, a.ple_embed_dim // nh), EMBED)
    s.update(moe_specs(f"{p}.mlp", a))
    return s


def dense_specs(a: ModelArgs) -> dict[str, TensorSpec]:
    """Every tensor but the routed experts, in checkpoint order."""
    s = {"embed_tokens.weight": TensorSpec((a.vocab_size, a.hidden_size), EMBED)}
    for i in range(a.num_hidden_layers):
        s.update(layer_specs(i, a))
    s.update(hc_specs("hyper_connection_mixer", a, inject=False))
    return s


def expert_specs(a: ModelArgs) -> dict[str, tuple[int, int]]:
    """Shape [out, in] of each per-expert projection."""
    D, I = a.hidden_size, a.moe_intermediate_size
    return {"gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I)}


def expert_name(layer: int, e: int, proj: str) -> str:
    return f"layers.{layer}.mlp.experts.{e}.{proj}"
