"""Tiny qwen3_5_moe / qwen3_next / qwen3_moe checkpoints written by transformers itself
(save_pretrained of a randomly initialised model, fp32), with the synthetic ChatML tokenizer;
and the transformers model read back from such a folder (the reference of the oracle tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from ftchat.model.tokenizer import write_synthetic_tokenizer

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
              max_position_embeddings=4096, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 10000.0})
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
           linear_value_head_dim=16, shared_expert_intermediate_size=32, num_hidden_layers=4)
FAMILIES = ("qwen3_5_moe", "qwen3_next", "qwen3_moe")


def hf_classes(family: str):
    """(config class, causal-LM class, the tiny config's fields) of a family."""
    import transformers as tf

    if family == "qwen3_5_moe":  # layers G G G A; partial RoPE (the config's default 0.25)
        rope = dict(COMMON["rope_parameters"], partial_rotary_factor=0.25)
        return tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, dict(
            COMMON, **GDN, rope_parameters=rope)
    if family == "qwen3_next":
        rope = dict(COMMON["rope_parameters"], partial_rotary_factor=0.25)
        return tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, dict(
            COMMON, **GDN, rope_parameters=rope, norm_topk_prob=True)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
            COMMON, num_hidden_layers=3, norm_topk_prob=True)
    raise AssertionError(family)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of a trained model's scale: matrices N(0, 1/fan_in) (HF's init is N(0, 0.02²),
    which makes every logit ~0), norm weights moved off their init; A_log, dt_bias and the
    conv as initialised (drawn under the seed too)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        elif p.dim() >= 2 and "conv1d" not in name:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def write_hf_checkpoint(folder: Path, family: str, seed: int = 0) -> Path:
    cfg_cls, model_cls, fields = hf_classes(family)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**fields)).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    write_synthetic_tokenizer(Path(folder), VOCAB)
    return Path(folder)


def reference_model(folder: Path):
    """The transformers model of a folder, fp32, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


FP8_BLOCK = (48, 48)  # not a divisor of 64 or 32: full and partial blocks both occur


def dequantize_blocks_loop(codes: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """Block-FP8 [N, K] -> fp32, block by block (the test's own reading of the layout)."""
    out = codes.float()
    bn, bk = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scale[i, j].item()
    return out


def quantize_blocks(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]): each block
    divided by its scale, as Qwen's FP8 checkpoints store them."""
    bn, bk = block
    N, K = w.shape
    scale = torch.empty(-(-N // bn), -(-K // bk))
    codes = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            # a power of two >= amax / 448: codes x scale is then exact in bf16, the expert
            # rows' dtype (a real export's scale is any fp32; the product rounds there)
            scale[i, j] = 2.0 ** torch.ceil(torch.log2(blk.abs().max().clamp(min=1e-12) / 448))
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / scale[i, j]).to(
                torch.float8_e4m3fn)
    return codes, scale


def reference_from_synthetic(folder: Path):
    """The transformers model of a synthetic checkpoint (`ftchat synth --preset qwen3*-tiny`),
    or of a block-FP8 one (test_qwen3_fp8.py), fp32, its NVFP4 experts and FP8 weights
    dequantized by the test's own code (tests/reference.py, `dequantize_blocks_loop`) and
    stacked as transformers holds them ([E, 2I, D] gate|up, [E, D, I] down)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.reference import _dequant, _read_all

    cfg = AutoConfig.from_pretrained(folder)
    if hasattr(cfg, "quantization_config"):  # the weights come dequantized below
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    raw = _read_all(Path(folder))
    sd = {}
    for k, v in raw.items():
        if k.endswith((".weight_scale", ".weight_scale_2", ".weight_global_scale",
                       ".weight_scale_inv")):
            continue
        if v.dtype == torch.float8_e4m3fn:  # block-FP8 (test_qwen3_fp8.py's writer)
            v = dequantize_blocks_loop(v, raw[k + "_scale_inv"], FP8_BLOCK)
        if v.dtype == torch.uint8:  # an NVFP4 expert projection (either dialect)
            base = k.rsplit(".", 1)[0]
            g = (1.0 / raw[base + ".weight_global_scale"].float() if k.endswith("_packed")
                 else raw[base + ".weight_scale_2"].float())
            v, k = _dequant(v, raw[base + ".weight_scale"], g), base + ".weight"
        sd[k] = v.float()
    E = cfg.num_experts if hasattr(cfg, "num_experts") else cfg.num_local_experts
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        proj = {n: [sd.pop(f"{p}.{e}.{n}.weight") for e in range(E)]
                for n in ("gate_proj", "up_proj", "down_proj")}
        sd[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in
                                               zip(proj["gate_proj"], proj["up_proj"])])
        sd[f"{p}.down_proj"] = torch.stack(proj["down_proj"])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not [k for k in missing if "rotary" not in k] and not unexpected, (missing,
                                                                             unexpected)
    return model
