"""The qwen4_exp text config, parsed from an HF config.json (wrapper or text-only)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ftchat.errors import ModelError

SUPPORTED_MODEL_TYPES = {"qwen4_exp", "qwen4_exp_text"}


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
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """Zero-based decoder indices of the PLE layers."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "indexed_attention"

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"unsupported model_type {model_type!r}: ftchat runs qwen4_exp (Qwen3.8-Flash-Next)"
            )
        text = cfg.get("text_config", cfg) if model_type == "qwen4_exp" else cfg
        return _parse_text(text)


def _parse_text(t: dict) -> ModelArgs:
    def get(name, default=None):
        return t.get(name, default)

    n_layers = get("num_hidden_layers", 40)
    layer_types = get("layer_types")
    if layer_types is None:
        interval = get("full_attention_interval", 4)
        layer_types = [
            "linear_attention" if (i + 1) % interval else "indexed_attention"
            for i in range(n_layers)
        ]
    layer_types = tuple(
        "indexed_attention" if lt == "full_attention" else lt for lt in layer_types
    )
    bad = sorted(set(layer_types) - {"linear_attention", "indexed_attention"})
    if bad or len(layer_types) != n_layers:
        raise ModelError(f"config.json: bad layer_types {list(layer_types)}")
    rope = dict(get("rope_parameters") or {})
    if "partial_rotary_factor" in t and "partial_rotary_factor" not in rope:
        rope["partial_rotary_factor"] = t["partial_rotary_factor"]
    eos = get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    hidden = get("hidden_size", 2048)
    qsa = {k: get(k) for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
                                "indexer_budget", "indexer_compress_ratio")}
    missing = [k for k, v in qsa.items() if v is None]
    if missing:
        raise ModelError(f"config.json: QSA fields missing: {', '.join(missing)}")
    ple_ids = tuple(sorted(set(get("ple_layer_ids") or [])))
    args = ModelArgs(
        vocab_size=get("vocab_size", 248320),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=get("num_attention_heads", 16),
        num_key_value_heads=get("num_key_value_heads", 2),
        head_dim=get("head_dim", 256),
        layer_types=layer_types,
        linear_conv_kernel_dim=get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=get("linear_key_head_dim", 128),
        linear_value_head_dim=get("linear_value_head_dim", 128),
        linear_num_key_heads=get("linear_num_key_heads", 16),
        linear_num_value_heads=get("linear_num_value_heads", 32),
        num_experts=get("num_experts", 512),
        num_experts_per_tok=get("num_experts_per_tok", 10),
        moe_intermediate_size=get("moe_intermediate_size", 512),
        shared_expert_intermediate_size=get("shared_expert_intermediate_size", 512),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        hc_count=get("hc_count", 4),
        hc_lowrank=get("hc_lowrank", 320),
        ple_layer_ids=ple_ids,
        ple_embed_dim=get("ple_embed_dim") or hidden,
        ple_conv_kernel_size=get("ple_conv_kernel_size", 4),
        ngram_size=get("ngram_size", 3),
        heads_per_ngram=get("heads_per_ngram", 8),
        ngram_vocab_size_base=get("ngram_vocab_size_base", 20_000_000),
        make_ngram_vocab_size_divisible_by=get("make_ngram_vocab_size_divisible_by", 128),
        split_ngram_parts=get("split_ngram_parts", 512),
        seed=get("seed", 1234),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        hidden_act=get("hidden_act", "silu"),
        output_gate_type=get("output_gate_type") or get("hidden_act", "silu"),
        eos_token_id=eos,
        max_position_embeddings=get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        **{k: int(v) for k, v in qsa.items()},
    )
    _validate(args)
    return args


def _validate(a: ModelArgs) -> None:
    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise ModelError(f"config.json: {msg}")

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


def read_config_json(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelError(f"{path}: missing (not a model folder?)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None


def load_args(folder: Path) -> ModelArgs:
    return ModelArgs.from_hf(read_config_json(folder))
