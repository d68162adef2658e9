"""Qwen3-MoE (HF qwen3_moe): the Qwen3 MoE line decoder (ftchat/model/qwen3_decoder.py) with
full attention in every layer (no output gate, full RoPE by default), plain-weight RMSNorms
(x * w), no shared expert, and a router that renormalises its top-k only with
`norm_topk_prob` (HF default false; the released checkpoints set it true). docs/model.md section 15.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftchat.errors import ModelError
from ftchat.model import qwen3_decoder as dec
from ftchat.model.config import _Fields

MODEL_TYPES = ("qwen3_moe",)


@dataclass(frozen=True)
class Qwen3MoeArgs(dec.Qwen3Args):
    @classmethod
    def from_hf(cls, cfg: object, where: str = "config.json") -> Qwen3MoeArgs:
        t = dec.moe_only_text_config(cfg, where, MODEL_TYPES)
        if t.get("num_experts") is None and t.get("num_local_experts") is not None:
            t = {**t, "num_experts": t["num_local_experts"]}  # transformers 5 writes this name
        f = _Fields(t, where)
        if f.bool("use_sliding_window", False) or f.bool("attention_bias", False):
            raise ModelError(f"{where}: sliding-window attention and attention biases are not "
                             "supported (no released Qwen3-MoE uses them)")
        fields = dec.parse_fields(t, where, partial_rotary=1.0, gdn=False, shared=False)
        fields["norm_topk_prob"] = f.bool("norm_topk_prob", False)
        return cls.build(fields, where, attention_gate=False, zero_centred_norms=False,
                         packed_gdn_inputs=False)
