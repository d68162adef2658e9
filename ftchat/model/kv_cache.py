"""How the attention layers store K and V (docs/model.md 4.6): in the model dtype (the default,
`--kv-cache-dtype auto`), or opt-in FP8 (`fp8`) at about half the bytes.

FP8 layout, per attention layer (B rows, L capacity, Hkv kv heads, hd head dim):
  cache['k'], cache['v']              [B, L, Hkv, hd] float8_e4m3fn codes
  cache['k_scale'], cache['v_scale']  [B, L, Hkv] fp32, one scale per (sequence, token, kv head)
A row x [hd] (one token's key or value of one kv head, model dtype) is stored as
  scale = amax|x| / 448 (fp32; 1 for an all-zero row), codes = e4m3(clamp(x / scale, +-448))
rounded to nearest even, and read back as fp32(codes) * scale, cast to the model dtype. An
unwritten slot (codes 0, scale 0) reads as 0, as the model-dtype cache's zeros. The index keys
ik and the block keys kbar always stay in the model dtype.

The torch path (qsa.attention_mixer_ref: CPU, prefill) writes with `store_kv` and reads with
`gather_kv`, indexing the codes through their bytes (uint8 views: torch's index, index_put and
fill kernels have not covered float8 on every device and version). The fused CUDA decode
(ftchat/kernels/qsa_decode.py) does the same arithmetic: its prep kernel quantizes (the e4m3
rounding in bits), its split kernel dequantizes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ftchat.codecs.fp8 import FP8, dequantize_rows, is_fp8, quantize_rows

KV_DTYPES = {"auto": None, "fp8": FP8}  # --kv-cache-dtype -> storage dtype (None: the model's)


def layer_kv(batch: int, max_len: int, kv_heads: int, head_dim: int, device,
             dtype: torch.dtype, kv_dtype: torch.dtype | None) -> dict[str, Tensor]:
    """A layer's zeroed K/V tensors (with their scales when kv_dtype is FP8)."""
    shape = (batch, max_len, kv_heads, head_dim)
    if kv_dtype is None or kv_dtype == dtype:
        return {n: torch.zeros(shape, device=device, dtype=dtype) for n in ("k", "v")}
    if kv_dtype != FP8:
        raise ValueError(f"KV cache dtype {kv_dtype}: expected the model dtype or {FP8}")
    out = {n: torch.zeros(shape, device=device, dtype=torch.uint8).view(FP8) for n in ("k", "v")}
    out.update({f"{n}_scale": torch.zeros(shape[:3], device=device, dtype=torch.float32)
                for n in ("k", "v")})
    return out


def store_kv(cache: Mapping[str, Tensor], index: tuple, k: Tensor, v: Tensor) -> None:
    """cache['k'|'v'][index] = k, v [..., Hkv, hd] (model dtype); index picks rows and
    positions (the first two dims), so it also picks their scales."""
    if not is_fp8(cache):
        cache["k"][index] = k
        cache["v"][index] = v
        return
    for name, x in (("k", k), ("v", v)):
        codes, scale = quantize_rows(x)
        cache[name].view(torch.uint8)[index] = codes.view(torch.uint8)
        cache[f"{name}_scale"][index] = scale


def gather_kv(cache: Mapping[str, Tensor], index: tuple, dtype: torch.dtype
              ) -> tuple[Tensor, Tensor]:
    """(keys, values) = cache['k'|'v'][index] in dtype (dequantized when FP8); index as in
    `store_kv`. The model-dtype cache returns the indexed tensors themselves."""
    if not is_fp8(cache):
        return cache["k"][index], cache["v"][index]
    k, v = (cache[n].view(torch.uint8)[index].view(FP8) for n in ("k", "v"))
    return (dequantize_rows(k, cache["k_scale"][index], dtype),
            dequantize_rows(v, cache["v_scale"][index], dtype))
