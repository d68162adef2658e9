"""Per-request decode state of a batch of sequences (docs/model.md section 8), preallocated: one
typed cache per layer.

Row b of every tensor belongs to sequence b; the decoder advances rows in place, through the views
`rows(sl)` gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.model.config import ModelArgs
from ftchat.model.kv_cache import AttentionCache


@dataclass
class GdnCache:
    """A GDN layer's state (ftchat/model/gdn.py)."""

    conv: Tensor  # [B, C, Kc-1] the last pre-activation conv inputs
    recurrent: Tensor  # [B, Hv, dk, dv] fp32

    def rows(self, sl: slice) -> GdnCache:
        return GdnCache(self.conv[sl], self.recurrent[sl])

    def tensors(self) -> list[Tensor]:
        return [self.conv, self.recurrent]

    def zero_(self, sl: slice) -> None:
        for t in self.tensors():
            t[sl].zero_()


@dataclass
class PleCache:
    """A PLE layer's conv state (ftchat/model/ple.py); the n-gram context is the state's."""

    conv: Tensor  # [B, hc*D, (k-1)*dilation]

    def rows(self, sl: slice) -> PleCache:
        return PleCache(self.conv[sl])

    def tensors(self) -> list[Tensor]:
        return [self.conv]

    def zero_(self, sl: slice) -> None:
        self.conv[sl].zero_()


@dataclass
class DecodeState:
    max_len: int  # KV capacity per sequence
    mixers: list[AttentionCache | GdnCache]  # by layer: the cache of its attention or GDN mixer
    ple: list[PleCache | None]  # by layer: its PLE state (None: no PLE there)
    ple_ctx: Tensor  # [B, ngram-1] previous token ids (eos at the start)

    @property
    def batch(self) -> int:
        return self.ple_ctx.shape[0]

    @classmethod
    def create(cls, a: ModelArgs, batch: int, max_len: int, device, dtype,
               kv_dtype: torch.dtype | None = None) -> DecodeState:
        """Zeroed state; kv_dtype: how K and V are stored (None: the model dtype; FP8)."""
        z = lambda *shape, dt=dtype: torch.zeros(*shape, device=device, dtype=dt)  # noqa: E731
        conv_dim = 2 * a.linear_num_key_heads * a.linear_key_head_dim + (
            a.linear_num_value_heads * a.linear_value_head_dim
        )
        mixers: list[AttentionCache | GdnCache] = []
        for i in range(a.num_hidden_layers):
            if a.is_attention(i):
                mixers.append(AttentionCache.zeros(
                    batch, max_len, a.num_key_value_heads, a.head_dim, a.indexer_head_dim,
                    a.indexer_compress_ratio, device, dtype, kv_dtype))
            else:
                mixers.append(GdnCache(
                    z(batch, conv_dim, a.linear_conv_kernel_dim - 1),
                    z(batch, a.linear_num_value_heads, a.linear_key_head_dim,
                      a.linear_value_head_dim, dt=torch.float32)))
        hcD = a.hc_count * a.hidden_size
        cols = (a.ple_conv_kernel_size - 1) * a.ngram_size
        ple = [PleCache(z(batch, hcD, cols)) if i in a.ple_layers else None
               for i in range(a.num_hidden_layers)]
        eos = a.eos_token_id if a.eos_token_id is not None else 0
        ctx = torch.full((batch, a.ngram_size - 1), eos, device=device, dtype=torch.long)
        return cls(max_len, mixers, ple, ctx)

    def caches(self) -> list[AttentionCache | GdnCache | PleCache]:
        return [*self.mixers, *(c for c in self.ple if c is not None)]

    def tensors(self) -> list[Tensor]:
        """Every tensor of the state, once."""
        return [*(t for c in self.caches() for t in c.tensors()), self.ple_ctx]

    def reset(self, rows: slice, eos: int) -> None:
        """Clear rows for new sequences (every cache tensor, kbar included)."""
        for c in self.caches():
            c.zero_(rows)
        self.ple_ctx[rows].fill_(eos)
