"""`ftchat synth` presets of the Qwen3 MoE line: a tiny one per family (every layer type in a
few MB) and one at the released model's geometry (docs/model.md 15.5 says where each figure
comes from). Text-only configs as transformers writes them (`model.` prefix, per-expert
tensors); the checkpoint writer is ftchat/model/synth.py's.
"""

from __future__ import annotations

ROPE = {"rope_type": "default"}
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
            max_position_embeddings=4096)
TINY_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, shared_expert_intermediate_size=32)
# Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B, Qwen3-30B-A3B
QWEN35 = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8,
              moe_intermediate_size=512, shared_expert_intermediate_size=512,
              max_position_embeddings=262144)
QWEN3_NEXT = dict(QWEN35, num_experts=512, num_experts_per_tok=10)
QWEN3_MOE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                 max_position_embeddings=40960)

# preset -> (model_type, default layers, fields, rope_theta, partial rotary factor or None)
PRESETS = {
    "qwen3.5-moe-tiny": ("qwen3_5_moe_text", 4, {**TINY, **TINY_GDN}, 1e4, 0.25),
    "qwen3.5-moe": ("qwen3_5_moe_text", 40, QWEN35, 1e7, 0.25),
    "qwen3-next-tiny": ("qwen3_next", 4, {**TINY, **TINY_GDN}, 1e4, 0.25),
    "qwen3-next": ("qwen3_next", 48, QWEN3_NEXT, 1e7, 0.25),
    "qwen3-moe-tiny": ("qwen3_moe", 3, TINY, 1e4, None),
    "qwen3-moe": ("qwen3_moe", 48, QWEN3_MOE, 1e6, None),
}
VOCAB = {"qwen3.5-moe": (248320, 248044), "qwen3-next": (151936, 151643),
         "qwen3-moe": (151936, 151643)}  # (vocab size, id of <|endoftext|>)


def is_preset(preset: str) -> bool:
    return preset in PRESETS


def preset_vocab(preset: str) -> tuple[int, int | None]:
    """(vocab size, id of <|endoftext|>, None: the top of the range) of a preset."""
    return VOCAB.get(preset, (512, None))


def hf_config(preset: str, layers: int | None, eos: int) -> dict:
    """The config.json of a preset with `layers` decoder layers (None: the preset's)."""
    model_type, n, fields, theta, partial = PRESETS[preset]
    n = layers or n
    rope = dict(ROPE, rope_theta=theta)
    if partial is not None:
        rope["partial_rotary_factor"] = partial
    cfg = dict(fields, model_type=model_type, vocab_size=preset_vocab(preset)[0],
               num_hidden_layers=n, hidden_act="silu", rms_norm_eps=1e-6,
               tie_word_embeddings=False, eos_token_id=eos, rope_parameters=rope)
    if model_type != "qwen3_moe":
        cfg.update(linear_conv_kernel_dim=4, layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)])
    if model_type != "qwen3_5_moe_text":
        cfg.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return cfg
