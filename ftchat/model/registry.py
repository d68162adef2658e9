"""The model families ftchat runs, by config.json `model_type` (one module per family, as mlx-lm
and mini-sglang keep them). The engine, the checkpoint reader and the VRAM plan ask here; none of
them imports a family.

    cfg = read_config_json(folder)
    family = family_for_config(cfg, "config.json")  # ModelError for any other model_type
    args = family.parse_config(cfg, "config.json")  # and then family_of(args) is family
"""

from __future__ import annotations

from pathlib import Path

from ftchat.errors import ModelError
from ftchat.model import (qwen3_5_moe, qwen3_decoder, qwen3_decoder_memory, qwen3_moe,
                          qwen3_next, qwen4_exp, qwen4_exp_memory, spec)
from ftchat.model.config import MODEL_TYPES, ModelArgs, json_kind, read_config_json
from ftchat.model.family import Family, MemoryFormulas
from ftchat.model.state import DecodeState

QWEN4_EXP = Family(
    name="qwen4_exp",
    model_types=MODEL_TYPES,  # qwen4_exp (the wrapper), qwen4_exp_text
    args_type=ModelArgs,
    parse_config=ModelArgs.from_hf,
    dense_specs=spec.dense_specs,
    expert_specs=spec.expert_specs,
    expert_name=spec.expert_name,
    weights=qwen4_exp.Weights,
    forward=qwen4_exp.forward,
    new_state=DecodeState.create,
    routers=qwen4_exp.routers,
    attention_layers=ModelArgs.attention_layers,
    memory=MemoryFormulas(
        dense_items=qwen4_exp_memory.dense_items,
        state_items=qwen4_exp_memory.state_items,
        decode_terms=qwen4_exp_memory.decode_terms,
        prefill_blocks=qwen4_exp_memory.prefill_blocks,
        stream_bytes=qwen4_exp_memory.stream_bytes,
        prefill_lengths=qwen4_exp_memory.prefill_lengths,
    ),
    describe=qwen4_exp.describe,
)

# the Qwen3 MoE line: one decoder (ftchat/model/qwen3_decoder.py), a file per family for its
# config and tensor names
QWEN3_MEMORY = MemoryFormulas(
    dense_items=qwen3_decoder_memory.dense_items,
    state_items=qwen3_decoder_memory.state_items,
    decode_terms=qwen3_decoder_memory.decode_terms,
    prefill_blocks=qwen3_decoder_memory.prefill_blocks,
    stream_bytes=qwen3_decoder_memory.stream_bytes,
    prefill_lengths=qwen3_decoder_memory.prefill_lengths,
)


def _qwen3_family(name: str, module, args_type: type, weights=qwen3_decoder.Weights) -> Family:
    return Family(
        name=name,
        model_types=module.MODEL_TYPES,
        args_type=args_type,
        parse_config=args_type.from_hf,
        dense_specs=qwen3_decoder.dense_specs,
        expert_specs=spec.expert_specs,
        expert_name=spec.expert_name,
        weights=weights,
        forward=qwen3_decoder.forward,
        new_state=qwen3_decoder.new_state,
        routers=qwen3_decoder.routers,
        attention_layers=qwen3_decoder.attention_layers,
        memory=QWEN3_MEMORY,
        describe=qwen3_decoder.describe,
    )


QWEN3_5_MOE = _qwen3_family("qwen3_5_moe", qwen3_5_moe, qwen3_5_moe.Qwen35MoeArgs)
QWEN3_NEXT = _qwen3_family("qwen3_next", qwen3_next, qwen3_next.Qwen3NextArgs,
                           qwen3_next.Weights)
QWEN3_MOE = _qwen3_family("qwen3_moe", qwen3_moe, qwen3_moe.Qwen3MoeArgs)

FAMILIES = (QWEN4_EXP, QWEN3_5_MOE, QWEN3_NEXT, QWEN3_MOE)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_ARGS = {f.args_type: f for f in FAMILIES}


def supported_types() -> tuple[str, ...]:
    return tuple(_BY_TYPE)


def family_for_config(cfg: object, where: str = "config.json") -> Family:
    """The family of an HF config (config.json's object), by its model_type; ModelError (one
    line, naming the supported types) for any other."""
    if not isinstance(cfg, dict):
        raise ModelError(f"{where}: expected a JSON object (the model's HF config), got "
                         f"{json_kind(cfg)}")
    model_type = cfg.get("model_type")
    family = _BY_TYPE.get(model_type)
    if family is None:
        raise ModelError(f"{where}: unsupported model_type {model_type!r}; ftchat runs "
                         f"{', '.join(supported_types())}")
    return family


def family_of(args: object) -> Family:
    """The family whose parse_config made `args`."""
    return _BY_ARGS[type(args)]


def parse_config(cfg: object, where: str = "config.json"):
    """The args of an HF config, parsed by its family (ModelError for anything else)."""
    return family_for_config(cfg, where).parse_config(cfg, where)


def load_args(folder: str | Path):
    """The args of a checkpoint folder's config.json."""
    where = str(Path(folder) / "config.json")
    return parse_config(read_config_json(Path(folder)), where)
