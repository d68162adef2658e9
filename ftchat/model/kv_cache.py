"""An attention layer's cache (docs/model.md 4.6): K and V in the model dtype (the default,
`--kv-cache-dtype auto`), or opt-in FP8 (`fp8`) at about half the bytes; the QSA index keys ik
and block keys kbar always in the model dtype.

FP8 layout, per attention layer (B rows, L capacity, Hkv kv heads, hd head dim):
  k, v                [B, L, Hkv, hd] float8_e4m3fn codes
  k_scale, v_scale    [B, L, Hkv] fp32, one scale per (sequence, token, kv head)
A row x [hd] (one token's key or value of one kv head, model dtype) is stored as
  scale = amax|x| / 448 (fp32; 1 for an all-zero row), codes = e4m3(clamp(x / scale, +-448))
rounded to nearest even, and read back as fp32(codes) * scale, cast to the model dtype. An
unwritten slot (codes 0, scale 0) reads as 0, as the model-dtype cache's zeros.

The torch path (qsa.attention_mixer_ref: CPU, prefill) writes with `store_kv` and reads with
`gather_kv`, indexing the codes through their bytes (uint8 views: torch's index, index_put and
fill kernels have not covered float8 on every device and version). The fused CUDA decode
(ftchat/kernels/qsa_decode.py) does the same arithmetic: its prep kernel quantizes (the e4m3
rounding in bits), its split kernel dequantizes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ftchat.codecs.fp8 import FP8, dequantize_rows, quantize_rows

KV_DTYPES = {"auto": None, "fp8": FP8}  # --kv-cache-dtype -> storage dtype (None: the model's)


@dataclass
class AttentionCache:
    """One attention layer's cache of B rows (sequences). Row b of every tensor is sequence b;
    `rows` views a slice of them. Block b of kbar is written when its last token r*b + r - 1 is,
    and read only by queries that see it complete (post-norm, post-RoPE)."""

    k: Tensor  # [B, L, Hkv, hd] model dtype, or FP8 codes
    v: Tensor  # [B, L, Hkv, hd]
    ik: Tensor  # [B, L, di] raw index keys (the open block is pooled from them)
    kbar: Tensor  # [B, L // r, di] compressed block keys
    k_scale: Tensor | None = None  # [B, L, Hkv] fp32, FP8 only
    v_scale: Tensor | None = None  # [B, L, Hkv] fp32, FP8 only

    @classmethod
    def zeros(cls, batch: int, max_len: int, kv_heads: int, head_dim: int, index_dim: int,
              ratio: int, device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
              ) -> AttentionCache:
        """A zeroed cache; kv_dtype: how K and V are stored (None or dtype: the model dtype; FP8:
        codes and scales)."""
        shape = (batch, max_len, kv_heads, head_dim)
        z = lambda *s: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
        index = (z(batch, max_len, index_dim), z(batch, max_len // ratio, index_dim))
        if kv_dtype is None or kv_dtype == dtype:
            return cls(z(*shape), z(*shape), *index)
        if kv_dtype != FP8:
            raise ValueError(f"KV cache dtype {kv_dtype}: expected the model dtype or {FP8}")
        codes = [torch.zeros(shape, device=device, dtype=torch.uint8).view(FP8) for _ in "kv"]
        scales = [torch.zeros(shape[:3], device=device, dtype=torch.float32) for _ in "kv"]
        return cls(*codes, *index, *scales)

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    def kv_scales(self) -> tuple[Tensor, Tensor] | None:
        """(k_scale, v_scale) of an FP8 cache, else None (what the fused kernels take)."""
        return (self.k_scale, self.v_scale) if self.fp8 else None

    def tensors(self) -> list[Tensor]:
        return [t for f in fields(self) if (t := getattr(self, f.name)) is not None]

    def rows(self, sl: slice) -> AttentionCache:
        """The cache of rows `sl` (views: writes land in this cache)."""
        return AttentionCache(*(None if t is None else t[sl] for t in
                                (getattr(self, f.name) for f in fields(self))))

    def zero_(self, sl: slice) -> None:
        for t in self.tensors():
            # FP8 codes through their bytes (torch's fill has not covered float8 everywhere)
            (t.view(torch.uint8) if t.dtype == FP8 else t)[sl].zero_()


def store_kv(cache: AttentionCache, index: tuple, k: Tensor, v: Tensor) -> None:
    """cache.k, cache.v [index] = k, v [..., Hkv, hd] (model dtype); index picks rows and
    positions (the first two dims), so it also picks their scales."""
    if not cache.fp8:
        cache.k[index] = k
        cache.v[index] = v
        return
    for codes_to, scale_to, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        codes, scale = quantize_rows(x)
        codes_to.view(torch.uint8)[index] = codes.view(torch.uint8)
        scale_to[index] = scale


def gather_kv(cache: AttentionCache, index: tuple, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(keys, values) = cache.k, cache.v [index] in dtype (dequantized when FP8); index as in
    `store_kv`. The model-dtype cache returns the indexed tensors themselves."""
    if not cache.fp8:
        return cache.k[index], cache.v[index]
    k, v = (t.view(torch.uint8)[index].view(FP8) for t in (cache.k, cache.v))
    return (dequantize_rows(k, cache.k_scale[index], dtype),
            dequantize_rows(v, cache.v_scale[index], dtype))
