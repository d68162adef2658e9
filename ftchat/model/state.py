"""Per-request decode state of a batch of sequences (docs/model.md section 8), preallocated.

Row b of every tensor belongs to sequence b; the decoder advances rows in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.model.config import ModelArgs
from ftchat.model.kv_cache import FP8, layer_kv


@dataclass
class DecodeState:
    max_len: int  # KV capacity per sequence
    # attention layer -> k/v [B, L, Hkv, hd] (model dtype, or FP8 codes with k_scale/v_scale
    # [B, L, Hkv] fp32: model/kv_cache.py), raw index keys ik [B, L, di] (the open block is
    # pooled from them) and compressed block keys kbar [B, L // r, di] (post-norm, post-RoPE;
    # block b is written when its last token r*b + r - 1 is, and read only by queries that see
    # it complete)
    kv: dict[int, dict[str, Tensor]]
    conv: dict[int, Tensor]  # GDN layer -> [B, C, Kc-1]
    recurrent: dict[int, Tensor]  # GDN layer -> [B, Hv, dk, dv] fp32
    ple_conv: dict[int, Tensor]  # PLE layer -> [B, hc*D, (k-1)*dilation]
    ple_ctx: Tensor  # [B, ngram-1] previous token ids (eos at the start)

    @classmethod
    def create(cls, a: ModelArgs, batch: int, max_len: int, device, dtype,
               kv_dtype: torch.dtype | None = None) -> "DecodeState":
        """Zeroed state; kv_dtype: how K and V are stored (None: the model dtype; FP8)."""
        z = lambda *shape, dt=dtype: torch.zeros(*shape, device=device, dtype=dt)  # noqa: E731
        conv_dim = 2 * a.linear_num_key_heads * a.linear_key_head_dim + (
            a.linear_num_value_heads * a.linear_value_head_dim
        )
        kv, conv, rec = {}, {}, {}
        for i in range(a.num_hidden_layers):
            if a.is_attention(i):
                kv[i] = {
                    **layer_kv(batch, max_len, a.num_key_value_heads, a.head_dim, device, dtype,
                               kv_dtype),
                    "ik": z(batch, max_len, a.indexer_head_dim),
                    "kbar": z(batch, max_len // a.indexer_compress_ratio, a.indexer_head_dim),
                }
            else:
                conv[i] = z(batch, conv_dim, a.linear_conv_kernel_dim - 1)
                rec[i] = z(batch, a.linear_num_value_heads, a.linear_key_head_dim,
                           a.linear_value_head_dim, dt=torch.float32)
        hcD = a.hc_count * a.hidden_size
        ple_conv = {i: z(batch, hcD, (a.ple_conv_kernel_size - 1) * a.ngram_size) for i in a.ple_layers}
        eos = a.eos_token_id if a.eos_token_id is not None else 0
        ctx = torch.full((batch, a.ngram_size - 1), eos, device=device, dtype=torch.long)
        return cls(max_len, kv, conv, rec, ple_conv, ctx)

    def reset(self, rows: slice, eos: int) -> None:
        """Clear rows for new sequences (every kv tensor, kbar included)."""
        for d in self.kv.values():
            for t in d.values():
                # FP8 codes through their bytes (torch's fill has not covered float8 everywhere)
                (t.view(torch.uint8) if t.dtype == FP8 else t)[rows].zero_()
        for t in (*self.conv.values(), *self.recurrent.values(), *self.ple_conv.values()):
            t[rows].zero_()
        self.ple_ctx[rows].fill_(eos)
