"""The qwen4_exp text config, parsed from an HF config.json (wrapper or text-only); the
config.json helpers every family shares (reading it, the context check)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ftchat.errors import ModelError, SettingsError

MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")  # the wrapper (text_config inside), the text model


@dataclass(frozen=True)
class ModelArgs:
    """Text-tower geometry; HF config.json field names, unchanged."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]  # one-indexed, as in HF
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    split_ngram_parts: int
    seed: int
    indexer_n_heads: int
    indexer_kv_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    hidden_act: str
    output_gate_type: str
    eos_token_id: int | None  # PLE hash boundary (first element if a list)
    max_position_embeddings: int
    tie_word_embeddings: bool = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """Zero-based decoder indices of the PLE layers."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "indexed_attention"

    def attention_layers(self) -> frozenset[int]:
        return frozenset(i for i in range(self.num_hidden_layers) if self.is_attention(i))

    @classmethod
    def from_hf(cls, cfg: object, where: str = "config.json") -> "ModelArgs":
        """Parse an HF config (the `qwen4_exp` wrapper or a `qwen4_exp_text` config).

        Raises ModelError naming `where` (the file) and the field for anything missing, of the
        wrong JSON type or out of range. Any other model_type is the registry's to refuse
        (ftchat/model/registry.py)."""
        model_type = hf_config_object(cfg, where).get("model_type")
        if model_type not in MODEL_TYPES:
            raise ModelError(f"{where}: model_type {model_type!r} is not a qwen4_exp config")
        text = cfg.get("text_config", cfg) if model_type == "qwen4_exp" else cfg
        if not isinstance(text, dict):
            raise ModelError(f"{where}: \"text_config\" must be a JSON object, got "
                             f"{json_kind(text)}")
        return _parse_text(text, where)


# Fields with no default: the model's size. transformers' Qwen4ExpTextConfig has constructor
# defaults for most of them (docs/model.md section 1.1), but those describe no released checkpoint (hidden 2048
# and 40 layers, where Qwen3.8-Flash-Next has 2560 and 48), so a config.json without one does
# not say which model it is: guessing gave wrong figures. The QSA fields have no HF default at
# all. Every other field keeps its HF default: architecture constants and switches whose default
# is what the model uses (the real config leaves out norm_topk_prob, for one).
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "shared_expert_intermediate_size", "indexer_n_heads",
            "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
_MISSING = object()


def hf_config_object(cfg: object, where: str) -> dict:
    """cfg, the JSON value of an HF config.json; ModelError naming `where` unless an object."""
    if not isinstance(cfg, dict):
        raise ModelError(f"{where}: expected a JSON object (the model's HF config), got "
                         f"{json_kind(cfg)}")
    return cfg


def parse_eos_token_id(f: _Fields) -> int | None:
    """The config's eos_token_id (the first of a list; None when absent or an empty list)."""
    eos = f.t.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or eos < 0):
        raise f.fail("eos_token_id", f"must be a token id or a list of them, got "
                     f"{json_kind(f.t.get('eos_token_id'))}")
    return eos


def json_kind(v: object) -> str:
    """A JSON value as an error message shows it: its type, and the value when short."""
    kind = ("null" if v is None else "true/false" if isinstance(v, bool) else
            "a number" if isinstance(v, (int, float)) else "a string" if isinstance(v, str) else
            "a list" if isinstance(v, list) else "an object" if isinstance(v, dict) else
            type(v).__name__)
    shown = json.dumps(v) if not isinstance(v, (list, dict)) else ""
    return f"{shown} ({kind})" if shown and len(shown) <= 40 else kind


class _Fields:
    """Typed reads of one config dict; JSON null counts as absent (HF: use the default)."""

    def __init__(self, t: dict, where: str):
        self.t, self.where = t, where

    def fail(self, name: str, msg: str) -> ModelError:
        return ModelError(f"{self.where}: \"{name}\" {msg}")

    def raw(self, name: str, default: object) -> object:
        v = self.t.get(name)
        if v is None:
            if default is _MISSING:
                raise ModelError(f"{self.where}: required field \"{name}\" is missing (it gives "
                                 "the model's size); use the config.json that came with the "
                                 "checkpoint")
            return default
        return v

    def int(self, name: str, default: object = _MISSING, minimum: int | None = 1) -> int:
        v = self.raw(name, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(name, f"must be an integer, got {json_kind(v)}")
        if minimum is not None and v < minimum:
            raise self.fail(name, f"must be at least {minimum}, got {v}")
        return v

    def float(self, name: str, default: float, src: dict | None = None) -> float:
        v = (src if src is not None else self.t).get(name)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(name, f"must be a number, got {json_kind(v)}")
        return float(v)

    def str(self, name: str, default: str | None) -> str | None:
        v = self.raw(name, default)
        if v is not None and not isinstance(v, str):
            raise self.fail(name, f"must be a string, got {json_kind(v)}")
        return v

    def bool(self, name: str, default: bool) -> bool:
        v = self.raw(name, default)
        if not isinstance(v, bool):
            raise self.fail(name, f"must be true or false, got {json_kind(v)}")
        return v

    def list(self, name: str, item: type, what: str) -> list | None:
        v = self.t.get(name)
        if v is None:
            return None
        if not isinstance(v, list) or not all(
                isinstance(x, item) and not isinstance(x, bool) for x in v):
            raise self.fail(name, f"must be a list of {what}, got {json_kind(v)}")
        return v


def _parse_text(t: dict, where: str = "config.json") -> ModelArgs:
    f = _Fields(t, where)
    n_layers = f.int("num_hidden_layers")
    layer_types = f.list("layer_types", str, "strings")
    if layer_types is None:
        interval = f.int("full_attention_interval", 4)
        layer_types = [
            "linear_attention" if (i + 1) % interval else "indexed_attention"
            for i in range(n_layers)
        ]
    layer_types = tuple(
        "indexed_attention" if lt == "full_attention" else lt for lt in layer_types
    )
    bad = sorted(set(layer_types) - {"linear_attention", "indexed_attention"})
    if bad or len(layer_types) != n_layers:
        raise ModelError(f"{where}: bad layer_types {list(layer_types)}")
    rope = t.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise f.fail("rope_parameters", f"must be a JSON object, got {json_kind(rope)}")
    rope = dict(rope or {})
    if "partial_rotary_factor" in t and "partial_rotary_factor" not in rope:
        rope["partial_rotary_factor"] = t["partial_rotary_factor"]
    eos = parse_eos_token_id(f)
    hidden = f.int("hidden_size")
    hidden_act = f.str("hidden_act", "silu")
    args = ModelArgs(
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=f.int("num_attention_heads"),
        num_key_value_heads=f.int("num_key_value_heads"),
        head_dim=f.int("head_dim"),
        layer_types=layer_types,
        linear_conv_kernel_dim=f.int("linear_conv_kernel_dim", 4),
        linear_key_head_dim=f.int("linear_key_head_dim"),
        linear_value_head_dim=f.int("linear_value_head_dim"),
        linear_num_key_heads=f.int("linear_num_key_heads"),
        linear_num_value_heads=f.int("linear_num_value_heads"),
        num_experts=f.int("num_experts"),
        num_experts_per_tok=f.int("num_experts_per_tok"),
        moe_intermediate_size=f.int("moe_intermediate_size"),
        shared_expert_intermediate_size=f.int("shared_expert_intermediate_size"),
        norm_topk_prob=f.bool("norm_topk_prob", True),
        hc_count=f.int("hc_count", 4),
        hc_lowrank=f.int("hc_lowrank", 320),
        ple_layer_ids=tuple(sorted(set(f.list("ple_layer_ids", int, "layer numbers") or []))),
        ple_embed_dim=f.int("ple_embed_dim", hidden),
        ple_conv_kernel_size=f.int("ple_conv_kernel_size", 4),
        ngram_size=f.int("ngram_size", 3),
        heads_per_ngram=f.int("heads_per_ngram", 8),
        ngram_vocab_size_base=f.int("ngram_vocab_size_base", 20_000_000),
        make_ngram_vocab_size_divisible_by=f.int("make_ngram_vocab_size_divisible_by", 128),
        split_ngram_parts=f.int("split_ngram_parts", 512),
        seed=f.int("seed", 1234, minimum=None),
        indexer_n_heads=f.int("indexer_n_heads"),
        indexer_kv_heads=f.int("indexer_kv_heads"),
        indexer_head_dim=f.int("indexer_head_dim"),
        indexer_budget=f.int("indexer_budget"),
        indexer_compress_ratio=f.int("indexer_compress_ratio"),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope_theta=f.float("rope_theta", 10000.0, rope),
        partial_rotary_factor=f.float("partial_rotary_factor", 1.0, rope),
        hidden_act=hidden_act,
        output_gate_type=f.str("output_gate_type", hidden_act),
        eos_token_id=eos,
        max_position_embeddings=f.int("max_position_embeddings", 32768),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
    )
    _validate(args, where)
    return args


def _validate(a: ModelArgs, where: str = "config.json") -> None:
    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise ModelError(f"{where}: {msg}")

    check(a.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {a.rms_norm_eps}")
    check(a.rope_theta > 0, f"rope_theta must be > 0, got {a.rope_theta}")
    check(0 < a.partial_rotary_factor <= 1,
          f"partial_rotary_factor must be in (0, 1], got {a.partial_rotary_factor}")
    check(a.hidden_act == "silu", f"hidden_act {a.hidden_act!r} unsupported (silu only)")
    check(a.output_gate_type in ("sigmoid", "silu"), f"output_gate_type {a.output_gate_type!r}")
    check(a.hc_count > 1, "hc_count must be > 1")
    check(0 < a.num_experts_per_tok <= a.num_experts, "num_experts_per_tok out of range")
    check(a.indexer_kv_heads == 1, "QSA needs indexer_kv_heads == 1")
    check(a.indexer_budget % a.indexer_compress_ratio == 0,
          "indexer_budget must be a multiple of indexer_compress_ratio")
    check(a.rotary_dim <= a.indexer_head_dim, "rotary dim must fit the QSA index head")
    check(a.rotary_dim % 2 == 0, "rotary dim must be even")
    check(a.linear_key_head_dim == a.linear_value_head_dim, "GDN needs key and value head dims equal")
    check(a.linear_num_value_heads % a.linear_num_key_heads == 0,
          "linear_num_value_heads must be a multiple of linear_num_key_heads")
    check(a.num_attention_heads % a.num_key_value_heads == 0,
          "num_attention_heads must be a multiple of num_key_value_heads")
    if a.ple_layer_ids:
        heads = (a.ngram_size - 1) * a.heads_per_ngram
        check(heads > 0 and a.ple_embed_dim % heads == 0, "ple_embed_dim must divide by n-gram heads")
        check(all(1 <= i <= a.num_hidden_layers for i in a.ple_layer_ids), "ple_layer_ids out of range")
        check(all(a.layer_types[i - 1] == "linear_attention" for i in a.ple_layer_ids),
              "PLE is only allowed on linear_attention layers")
        check(a.eos_token_id is not None, "eos_token_id must be set when PLE is on")


def not_a_model_folder(folder: Path | str) -> ModelError:
    """The one error for a folder without config.json (`run`, `info` and the rest say the same)."""
    return ModelError(f"{folder}: not a model folder (config.json: missing); MODEL is a "
                      "checkpoint folder (config.json, *.safetensors, tokenizer.json) or a "
                      "Hugging Face repo id")


def read_config_json(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise not_a_model_folder(folder)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None


def check_context(a: ModelArgs, context: int | None, flag: str = "--context") -> None:
    """Refuse a KV capacity beyond what the model was trained for, before anything is allocated
    for it (a huge --context otherwise fails deep in an allocation, or runs past the limit)."""
    limit = a.max_position_embeddings
    if context is not None and context > limit:
        raise SettingsError(f"{flag} {context}: more than this model's limit of {limit:,} tokens "
                         f"(max_position_embeddings); pass {flag} {limit} or less")
