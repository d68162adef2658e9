"""Qwen3.5-MoE (HF qwen3_5_moe; its text model qwen3_5_moe_text): the Qwen3 MoE line decoder
(ftchat/model/qwen3_decoder.py) with Gated DeltaNet layers 3:1 with gated full attention,
partial RoPE (factor 0.25 by default), zero-centred RMSNorms, a shared expert with a sigmoid
gate, and a router that always renormalises its top-k (docs/model.md section 15).

A `Qwen3_5MoeForConditionalGeneration` checkpoint keeps the text model under
`model.language_model.` beside a vision tower (`model.visual.*`) and an MTP head (`mtp.*`):
ftchat reads the text model and ignores the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftchat.model import qwen3_decoder as dec

WRAPPER, TEXT = "qwen3_5_moe", "qwen3_5_moe_text"
MODEL_TYPES = (WRAPPER, TEXT)


@dataclass(frozen=True)
class Qwen35MoeArgs(dec.Qwen3Args):
    @classmethod
    def from_hf(cls, cfg: object, where: str = "config.json") -> Qwen35MoeArgs:
        t = dec.text_config(cfg, where, WRAPPER, (TEXT,))
        fields = dec.parse_fields(t, where, partial_rotary=0.25, gdn=True, shared=True)
        # the HF router has no norm_topk_prob switch: its top-k is always renormalised
        fields["norm_topk_prob"] = True
        return cls.build(fields, where, attention_gate=True, zero_centred_norms=True,
                         packed_gdn_inputs=False)
