"""Qwen3-Next (HF qwen3_next): the qwen3_5_moe architecture (ftchat/model/qwen3_decoder.py:
GDN 3:1 with gated full attention, partial RoPE, zero-centred norms, a gated shared expert)
with a `norm_topk_prob` switch and the GDN input projections stored packed per key head:
`in_proj_qkvz` [2 Hk dk + 2 Hv dv, D] and `in_proj_ba` [2 Hv, D], regrouped at load into the
in_proj_qkv / z / b / a the GDN mixer reads (a row permutation: the same products).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.errors import ModelError
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.model import qwen3_decoder as dec

MODEL_TYPES = ("qwen3_next",)


@dataclass(frozen=True)
class Qwen3NextArgs(dec.Qwen3Args):
    @classmethod
    def from_hf(cls, cfg: object, where: str = "config.json") -> Qwen3NextArgs:
        t = dec.moe_only_text_config(cfg, where, MODEL_TYPES)
        fields = dec.parse_fields(t, where, partial_rotary=0.25, gdn=True, shared=True)
        return cls.build(fields, where, attention_gate=True, zero_centred_norms=True,
                         packed_gdn_inputs=True)


def unpack_gdn_inputs(w: dict[str, Tensor], prefix: str) -> None:
    """Replace w[prefix + in_proj_qkvz / in_proj_ba] by in_proj_qkv, _z, _b, _a.

    Rows of in_proj_qkvz come in Hk groups, one per key head g: [q_g (dk) | k_g (dk) |
    v of value heads g*r .. g*r + r-1 (r*dv) | z of the same heads (r*dv)], r = Hv / Hk; rows
    of in_proj_ba in Hk groups [b (r) | a (r)]. The mixer reads [q | k | v] by head (the conv's
    channel order), z, b and a by value head. The head counts come from the layer's shapes:
    Hv from A_log, dv = dk from the norm, Hk from the conv's channels 2 Hk dk + Hv dv."""
    qkvz = w.pop(prefix + "in_proj_qkvz.weight")
    ba = w.pop(prefix + "in_proj_ba.weight")
    if not isinstance(qkvz, Tensor):
        raise ModelError(f"{prefix}in_proj_qkvz: kept quantized; qwen3_next needs it dense")
    Hv, dv = w[prefix + "A_log"].shape[0], w[prefix + "norm.weight"].shape[0]
    dk = dv
    Hk = (w[prefix + "conv1d.weight"].shape[0] - Hv * dv) // (2 * dk)
    r, D = Hv // Hk, qkvz.shape[-1]
    g = qkvz.view(Hk, 2 * dk + 2 * r * dv, D)  # [Hk, rows of a group, D]
    q, k, v, z = g.split([dk, dk, r * dv, r * dv], dim=1)
    w[prefix + "in_proj_qkv.weight"] = torch.cat([q.reshape(-1, D), k.reshape(-1, D),
                                                  v.reshape(-1, D)])
    w[prefix + "in_proj_z.weight"] = z.reshape(-1, D).contiguous()
    b, a = ba.view(Hk, 2 * r, D).split([r, r], dim=1)
    w[prefix + "in_proj_b.weight"] = b.reshape(-1, D).contiguous()
    w[prefix + "in_proj_a.weight"] = a.reshape(-1, D).contiguous()


class Weights(dec.Weights):
    """qwen3_decoder.Weights after `unpack_gdn_inputs` on every GDN layer (the layers holding
    an in_proj_qkvz)."""

    def __init__(self, tensors: dict[str, Tensor], num_layers: int,
                 kernels: KernelConfig = DEFAULT):
        for i in range(num_layers):
            if f"layers.{i}.linear_attn.in_proj_qkvz.weight" in tensors:
                unpack_gdn_inputs(tensors, f"layers.{i}.linear_attn.")
        super().__init__(tensors, num_layers, kernels)
