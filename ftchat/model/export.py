"""Write a transformers-trained qwen4_exp text model as a checkpoint in the real layout.

The inverse of loading: the state dict of a `Qwen4ExpForCausalLM` (keys `model.*`, experts
stacked as `gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I], one n-gram table per PLE layer)
becomes the wrapper config.json, `model.language_model.*` tensors with per-expert projections
(NVFP4 in ModelOpt naming, or bf16), sharded safetensors with an index, and
generation_config.json. Tokenizer files are the caller's (they are written before the weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ftchat.errors import FtchatError
from ftchat.codecs import nvfp4
from ftchat.model.config import ModelArgs
from ftchat.model.spec import dense_specs, expert_name
from ftchat.model.synth import FORMATS, PREFIX, _ShardWriter, _unquantized_modules

NGRAM_SHARD = ".ple_embedding.ngram_embedding.shard_"


def _dense_tensor(name: str, sd: dict[str, Tensor], a: ModelArgs) -> tuple[Tensor, str]:
    """The state-dict tensor behind checkpoint name `name`, and the state-dict key it uses."""
    if NGRAM_SHARD not in name:
        key = "model." + name
        return sd[key], key
    # transformers keeps one [rows, d] table; the checkpoint splits it into equal row shards.
    head, tail = name.split(NGRAM_SHARD)
    part = int(tail.split(".")[0])
    key = f"model.{head}.ple_embedding.ngram_embedding.weight"
    table = sd[key]
    rows = table.shape[0] // a.split_ngram_parts
    if rows * a.split_ngram_parts != table.shape[0]:
        raise FtchatError(f"{key}: {table.shape[0]} rows do not split into "
                          f"{a.split_ngram_parts} shards")
    return table[part * rows:(part + 1) * rows], key


def export_checkpoint(sd: dict[str, Tensor], text_config: dict, out: str | Path,
                      fmt: str = nvfp4.MODELOPT, eos_ids: list[int] | None = None,
                      max_shard_bytes: int = 16 << 20,
                      generation: dict | None = None) -> int:
    """Write the weights of `sd` and the configs into folder `out` (created; may hold tokenizer
    files already). Returns the bytes of tensor data written.

    Args:
        sd: state dict of a transformers Qwen4ExpForCausalLM (any float dtype, any device).
        text_config: the text config dict the model was built from (model_type qwen4_exp_text).
        fmt: bf16 or an NVFP4 dialect; NVFP4 applies to the routed experts only.
        eos_ids: generation stop ids for generation_config.json (default: the config's eos).
        generation: more generation_config.json keys (the model's decoding defaults, such as
            repetition_penalty).
    Raises:
        FtchatError: unknown format, or a state-dict tensor the checkpoint would not hold.
    """
    if fmt not in FORMATS:
        raise FtchatError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    a = ModelArgs.from_hf(text_config)
    eos = text_config["eos_token_id"]
    hf = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
          "text_config": text_config, "tie_word_embeddings": False}
    if fmt != "bf16":
        hf["quantization_config"] = nvfp4.quant_config_dict(fmt, _unquantized_modules())
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    gen_cfg = {"bos_token_id": eos, "pad_token_id": eos, "eos_token_id": eos_ids or [eos],
               "do_sample": False, **(generation or {})}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))

    used: set[str] = set()
    w = _ShardWriter(out, max_shard_bytes)
    for name, spec in dense_specs(a).items():
        t, key = _dense_tensor(name, sd, a)
        used.add(key)
        if tuple(t.shape) != spec.shape:
            raise FtchatError(f"{key}: shape {tuple(t.shape)}, the checkpoint needs {spec.shape}")
        w.add(PREFIX + name, t.detach().cpu() if spec.init == "int64"
              else t.detach().to("cpu", torch.bfloat16))
        if name.endswith("mlp.shared_expert_gate.weight"):  # the experts follow their layer
            layer = int(name.split(".")[1])
            used |= _write_experts(w, sd, layer, a, fmt)
    w.add("lm_head.weight", sd["lm_head.weight"].detach().to("cpu", torch.bfloat16))
    used.add("lm_head.weight")
    # Anything left over would be silently lost: only the rotary tables may be (recomputed).
    left = sorted(k for k in set(sd) - used if "rotary" not in k)
    if left:
        raise FtchatError(f"state dict tensors with no place in the checkpoint: {left[:5]}")
    w.finish()
    return w.total


def _write_experts(w: _ShardWriter, sd: dict[str, Tensor], layer: int, a: ModelArgs,
                   fmt: str) -> set[str]:
    p = f"model.layers.{layer}.mlp.experts"
    gate_up, down = sd[f"{p}.gate_up_proj"].detach(), sd[f"{p}.down_proj"].detach()
    I = a.moe_intermediate_size
    for e in range(a.num_experts):
        # gate_up_proj[e] is [2I, D]: gate rows first, then up (transformers' concatenated layout)
        parts = {"gate_proj": gate_up[e, :I], "up_proj": gate_up[e, I:], "down_proj": down[e]}
        for proj, weight in parts.items():
            base = PREFIX + expert_name(layer, e, proj)
            if fmt == "bf16":
                w.add(base + ".weight", weight.to("cpu", torch.bfloat16))
                continue
            packed, scale, g = nvfp4.quantize(weight.float().cpu())
            for name, t in nvfp4.to_checkpoint(fmt, base, packed, scale, g).items():
                w.add(name, t)
    return {f"{p}.gate_up_proj", f"{p}.down_proj"}
