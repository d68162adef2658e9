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
from ftchat.model.config import MODEL_TYPES, ModelArgs, hf_config_object, read_config_json
from ftchat.model.family import Family, MemoryFormulas
from ftchat.model.state import DecodeState


def _family(name: str, args_type: type, model_types: tuple[str, ...], memory,
            **parts) -> Family:
    """A Family reading config.json with args_type.from_hf, the routed experts named and shaped
    as every family stores them (spec.expert_specs), the VRAM plan terms of the `memory` module
    (MemoryFormulas.of); `parts`: the rest of Family's fields."""
    return Family(name=name, model_types=model_types, args_type=args_type,
                  parse_config=args_type.from_hf, expert_specs=spec.expert_specs,
                  expert_name=spec.expert_name, memory=MemoryFormulas.of(memory), **parts)


QWEN4_EXP = _family(
    "qwen4_exp", ModelArgs, MODEL_TYPES, qwen4_exp_memory,  # qwen4_exp (the wrapper), its text
    dense_specs=spec.dense_specs, weights=qwen4_exp.Weights, forward=qwen4_exp.forward,
    new_state=DecodeState.create, routers=qwen4_exp.routers,
    attention_layers=ModelArgs.attention_layers, describe=qwen4_exp.describe)

# the Qwen3 MoE line: one decoder (ftchat/model/qwen3_decoder.py) and its VRAM plan terms, a file
# per family for its config (and qwen3_next's regrouped GDN inputs: its Weights)


def _qwen3_family(name: str, module, args_type: type, weights=qwen3_decoder.Weights) -> Family:
    return _family(name, args_type, module.MODEL_TYPES, qwen3_decoder_memory,
                   dense_specs=qwen3_decoder.dense_specs, weights=weights,
                   forward=qwen3_decoder.forward, new_state=qwen3_decoder.new_state,
                   routers=qwen3_decoder.routers, attention_layers=qwen3_decoder.attention_layers,
                   describe=qwen3_decoder.describe)


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
    model_type = hf_config_object(cfg, where).get("model_type")
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
