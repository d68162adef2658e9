"""The tensor inventory of a qwen4_exp checkpoint (docs/model.md section 1.2), derived from ModelArgs.

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


def layer_specs(i: int, a: ModelArgs) -> dict[str, TensorSpec]:
    D, p = a.hidden_size, f"layers.{i}"
    s: dict[str, TensorSpec] = {}
    s.update(hc_specs(f"{p}.attn_hyper_connection", a))
    s.update(hc_specs(f"{p}.mlp_hyper_connection", a))
    if a.is_attention(i):
        hd, Hq, Hkv = a.head_dim, a.num_attention_heads, a.num_key_value_heads
        Hi, di = a.indexer_n_heads, a.indexer_head_dim
        q = f"{p}.self_attn"
        s.update({
            f"{q}.q_proj.weight": TensorSpec((Hq * hd * 2, D), LINEAR, True),
            f"{q}.k_proj.weight": TensorSpec((Hkv * hd, D), LINEAR, True),
            f"{q}.v_proj.weight": TensorSpec((Hkv * hd, D), LINEAR, True),
            f"{q}.o_proj.weight": TensorSpec((D, Hq * hd), LINEAR, True),
            f"{q}.q_norm.weight": TensorSpec((hd,), NORM),
            f"{q}.k_norm.weight": TensorSpec((hd,), NORM),
            f"{q}.indexer.index_qk_proj.weight": TensorSpec(((Hi + 1) * di, D), LINEAR),
            f"{q}.indexer.q_layernorm.weight": TensorSpec((di,), NORM),
            f"{q}.indexer.k_layernorm.weight": TensorSpec((di,), NORM),
        })
    else:
        Hk, Hv, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads,
                          a.linear_key_head_dim, a.linear_value_head_dim)
        conv_dim = 2 * Hk * dk + Hv * dv
        g = f"{p}.linear_attn"
        s.update({
            # the real checkpoint stores these two NVFP4 (model.md 11.5): a decode GEMV reads them so
            f"{g}.in_proj_qkv.weight": TensorSpec((conv_dim, D), LINEAR, True, True),
            f"{g}.in_proj_z.weight": TensorSpec((Hv * dv, D), LINEAR, True, True),
            f"{g}.in_proj_b.weight": TensorSpec((Hv, D), LINEAR),
            f"{g}.in_proj_a.weight": TensorSpec((Hv, D), LINEAR),
            f"{g}.conv1d.weight": TensorSpec((conv_dim, 1, a.linear_conv_kernel_dim), CONV),
            f"{g}.A_log": TensorSpec((Hv,), A_LOG),
            f"{g}.dt_bias": TensorSpec((Hv,), DT_BIAS),
            f"{g}.norm.weight": TensorSpec((dv,), PLAIN_NORM),
            f"{g}.out_proj.weight": TensorSpec((D, Hv * dv), LINEAR, True),
        })
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
    m = f"{p}.mlp"
    Is = a.shared_expert_intermediate_size
    s.update({
        f"{m}.gate.weight": TensorSpec((a.num_experts, D), LINEAR),
        f"{m}.shared_expert.gate_proj.weight": TensorSpec((Is, D), LINEAR, True),
        f"{m}.shared_expert.up_proj.weight": TensorSpec((Is, D), LINEAR, True),
        f"{m}.shared_expert.down_proj.weight": TensorSpec((D, Is), LINEAR, True),
        f"{m}.shared_expert_gate.weight": TensorSpec((1, D), LINEAR),
    })
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
