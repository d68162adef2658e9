"""NVFP4 codec (docs/model.md section 12): E2M1 nibbles, e4m3 block scales of 16, one fp32 global.

For W [N, K] (K % 16 == 0): packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16], and a
dequant-side global g, so that W[n, k] = E2M1[code] * fp32(block_scale[n, k // 16]) * g.
Two checkpoint dialects name and store these differently: ModelOpt keeps g, compressed-tensors
keeps 1 / g. Pure torch; every result lives on the device of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ftchat.errors import ModelError

MODELOPT = "nvfp4-modelopt"
COMPRESSED_TENSORS = "nvfp4-ct"
DIALECTS = (MODELOPT, COMPRESSED_TENSORS)

GROUP = 16  # elements per block scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Code -> value; bit 3 is the sign, so code 8 is -0.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# Midpoints between neighbouring magnitudes; a tie goes to the even code (RNE, as cvt.rn does).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ===== nibbles and scalar conversions =====


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., K] (0..15) -> uint8 [..., K/2]; element 2j low nibble, 2j+1 high."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError(f"codes must be uint8 with an even last dim, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if bool((codes > 15).any()):
        raise ValueError("codes must be in 0..15")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> codes uint8 [..., K]."""
    pairs = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # [..., K/2, 2]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)  # [..., K]


def e4m3_saturate(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, clamped to +-448 first: e4m3fn has no inf, and overflow must not
    become NaN on any backend. Rounding is the cast's round-to-nearest-even."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> E2M1 codes uint8, same shape.

    Round to nearest, ties to the even code (as values: 0.25->0, 0.75->1, 1.25->1, 1.75->2,
    2.5->2, 3.5->4, 5->4), saturating at 6: the rule of PTX cvt.rn.satfinite.e2m1x2.f32.
    The sign follows the sign bit, so a small negative value gives -0 (code 8).
    """
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for j, m in enumerate(_MIDPOINTS):
        # above the midpoint -> round up; exactly on it -> up only when the lower code j is odd
        up = mag > m if j % 2 == 0 else mag >= m
        code += up.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


# ===== quantize / dequantize =====


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize w [N, K] with the ModelOpt recipe.

    Returns (packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16], global fp32 []), with
    global = amax|w| / 2688 (6 * 448; 1.0 if that is 0), block_scale = e4m3(block_amax / 6 /
    global), codes = e2m1_codes(w / (fp32(block_scale) * global)) and code 0 where the scale is 0.
    """
    if w.dim() != 2 or w.shape[-1] % GROUP:
        raise ValueError(f"quantize needs [N, K] with K % {GROUP} == 0, got {tuple(w.shape)}")
    w32 = w.float()
    if not bool(torch.isfinite(w32).all()):
        raise ValueError("quantize needs finite weights")
    N, K = w32.shape
    g = w32.abs().amax() / (E2M1_MAX * E4M3_MAX)
    g = torch.where(g > 0, g, torch.ones_like(g))  # all-zero (or underflowing) tensor
    blocks = w32.reshape(N, K // GROUP, GROUP)  # [N, K/16, 16]
    block_scale = e4m3_saturate(blocks.abs().amax(-1) / E2M1_MAX / g)  # [N, K/16]
    denom = (block_scale.float() * g).unsqueeze(-1)  # [N, K/16, 1]
    zero = denom == 0  # a zero block scale (or an underflowing product) gives code 0
    codes = e2m1_codes(blocks / torch.where(zero, 1.0, denom)).masked_fill_(zero, 0)
    return pack_nibbles(codes.reshape(N, K)), block_scale, g


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> their fp32 values (E2M1_VALUES[codes], -0 for code 8), by
    arithmetic on the codes' device: no host table, so it runs inside a CUDA-graph capture."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.ldexp(1.0 + 0.5 * m, e - 1))  # exact in fp32
    return torch.where((c & 8) != 0, -mag, mag)


def dequantize(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """packed uint8 [..., K/2], block_scale e4m3 [..., K/16], global fp32 ([] / [1] / [...])
    -> fp32 [..., K]. A global of shape packed.shape[:-1] is per row (RowLayout globals)."""
    values = e2m1_values(unpack_nibbles(packed))  # [..., K] fp32
    scale = block_scale.float().repeat_interleave(GROUP, dim=-1)  # [..., K]
    g = global_scale.float()
    g = g.reshape(()) if g.numel() == 1 else g.unsqueeze(-1)  # [] or [..., 1]
    # NOTE: kernels must follow this bit-exactly: two fp32 multiplies, (value * scale) * global;
    # folding global into the scale first rounds differently (and can underflow).
    return (values * scale) * g


# ===== checkpoint dialects =====


def _check_dialect(dialect: str) -> None:
    if dialect not in DIALECTS:
        raise ModelError(f"unknown NVFP4 dialect {dialect!r}; expected one of {DIALECTS}")


def tensor_names(dialect: str, prefix: str) -> dict[str, str]:
    """Role -> tensor name for weight `prefix` (e.g. '...experts.3.gate_proj')."""
    _check_dialect(dialect)
    if dialect == MODELOPT:
        suffixes = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    else:
        suffixes = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
    roles = ("packed", "block_scale", "global", "input_global")
    return {r: f"{prefix}.{s}" for r, s in zip(roles, suffixes)}


def _on_disk(dialect: str, g: torch.Tensor) -> torch.Tensor:
    g = g.float().reshape(())
    # ModelOpt: dequant-side scalar []; compressed-tensors: quant-side reciprocal [1]
    return g.clone() if dialect == MODELOPT else torch.reciprocal(g).reshape(1)


def to_checkpoint(
    dialect: str,
    prefix: str,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors for one weight; global_scale and input_scale are dequant-side."""
    names = tensor_names(dialect, prefix)
    out = {
        names["packed"]: packed.contiguous(),
        names["block_scale"]: block_scale.contiguous(),
        names["global"]: _on_disk(dialect, global_scale),
    }
    if input_scale is not None:
        out[names["input_global"]] = _on_disk(dialect, input_scale)
    return out


def _fetch(get: Callable[[str], torch.Tensor], name: str) -> torch.Tensor:
    try:
        return get(name)
    except KeyError:
        raise ModelError(f"NVFP4 tensor {name} is missing from the checkpoint") from None


def from_checkpoint(
    dialect: str, get: Callable[[str], torch.Tensor], prefix: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read and check one weight. Returns (packed uint8 [N, K/2], block_scale e4m3 [N, K/16],
    global fp32 [] dequant-side). Raises ModelError naming the offending tensor."""
    names = tensor_names(dialect, prefix)
    packed = _fetch(get, names["packed"])
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % (GROUP // 2):
        raise ModelError(f"{names['packed']}: expected uint8 [N, K/2] with K % {GROUP} == 0, "
                         f"got {packed.dtype} {list(packed.shape)}")
    N, K = packed.shape[0], packed.shape[1] * 2
    scale = _fetch(get, names["block_scale"])
    if scale.dtype != torch.float8_e4m3fn or list(scale.shape) != [N, K // GROUP]:
        raise ModelError(f"{names['block_scale']}: expected float8_e4m3fn {[N, K // GROUP]}, "
                         f"got {scale.dtype} {list(scale.shape)}")
    stored = _fetch(get, names["global"])
    if not stored.is_floating_point() or stored.numel() != 1:
        raise ModelError(f"{names['global']}: expected one float, got {stored.dtype} "
                         f"{list(stored.shape)}")
    stored = stored.float().reshape(())
    # ModelOpt stores g (>= 0, finite); compressed-tensors stores 1/g (> 0; inf means g = 0)
    ok = (stored >= 0) & torch.isfinite(stored) if dialect == MODELOPT else stored > 0
    if not bool(ok):
        raise ModelError(f"{names['global']}: invalid global scale {stored.item()}")
    g = stored if dialect == MODELOPT else torch.reciprocal(stored)
    return packed, scale, g


def detect_dialect(names: Iterable[str], prefix: str | None = None) -> str | None:
    """Dialect from tensor names: '.weight_packed' -> compressed-tensors, '.weight' next to
    '.weight_scale_2' -> ModelOpt, neither -> None. With `prefix`, only that weight is looked at."""
    names = set(names)
    if prefix is not None:
        ct = f"{prefix}.weight_packed" in names
        mo = {f"{prefix}.weight", f"{prefix}.weight_scale_2"} <= names
    else:
        ct = any(n.endswith(".weight_packed") for n in names)
        s2 = ".weight_scale_2"
        mo = any(n.endswith(s2) and n[: -len(s2)] + ".weight" in names for n in names)
    if ct and mo:
        raise ModelError("checkpoint mixes ModelOpt and compressed-tensors NVFP4 tensor names")
    return COMPRESSED_TENSORS if ct else MODELOPT if mo else None


# ===== config.json quantization_config =====


def quant_config_dict(dialect: str, ignore: list[str]) -> dict:
    """The `quantization_config` entry of config.json for a checkpoint in `dialect`."""
    _check_dialect(dialect)
    if dialect == MODELOPT:
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP,
                "exclude_modules": list(ignore)}
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP,
               "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
        },
        "ignore": list(ignore),
    }


def _ct_groups_ok(qc: dict) -> bool:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not groups or not isinstance(groups, dict):
        return False
    for grp in groups.values():
        w = grp.get("weights") if isinstance(grp, dict) else None
        if not isinstance(w, dict):  # a config of another shape: not one this reads
            return False
        if grp.get("format", fmt) != "nvfp4-pack-quantized":
            return False
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", GROUP):
            return False
    return True


def dialect_from_quant_config(qc: dict | None) -> str | None:
    """Dialect of a config.json `quantization_config` (or hf_quant_config.json); None if absent.
    Raises ModelError for any other quantization (fp8, int4 awq/gptq, mxfp4, ...)."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if not method and isinstance(qc.get("quantization"), dict):
        method, qc = "modelopt", qc["quantization"]  # hf_quant_config.json form
    if method == "modelopt":
        algo = str(qc.get("quant_algo", ""))
        if algo.upper() != "NVFP4" or qc.get("group_size", GROUP) != GROUP:
            raise ModelError(f"unsupported ModelOpt quantization (quant_algo {algo!r}, group_size "
                             f"{qc.get('group_size')}); ftchat reads NVFP4 with groups of 16")
        return MODELOPT
    if method == "compressed-tensors":
        if not _ct_groups_ok(qc):
            raise ModelError(f"unsupported compressed-tensors quantization (format "
                             f"{qc.get('format')!r}); ftchat reads nvfp4-pack-quantized, "
                             f"4-bit float weights in groups of 16")
        return COMPRESSED_TENSORS
    raise ModelError(f"unsupported quant_method {method or None!r}; ftchat reads bf16 or NVFP4 "
                     f"(modelopt NVFP4, compressed-tensors nvfp4-pack-quantized)")


# ===== a dense weight kept in NVFP4 =====


@dataclass(frozen=True)
class Nvfp4Weight:
    """A dense [N, K] weight kept as stored: packed uint8 [N, K/2], block scale e4m3 [N, K/16],
    global fp32 [N] (per row, so that projections with different globals concatenate).

    The GDN qkv and z projections of an NVFP4 checkpoint stay in this form (docs/model.md
    11.5): a decode GEMV reads 4.5 bits a weight instead of 16 (ftchat/kernels/nvfp4_gemv.py);
    the torch path dequantizes it per call (gdn.dense) to the bits load-time dequantization
    gave."""

    packed: torch.Tensor
    scale: torch.Tensor
    g: torch.Tensor

    @classmethod
    def of(cls, packed: torch.Tensor, scale: torch.Tensor, g: torch.Tensor) -> "Nvfp4Weight":
        """From a checkpoint's triple (global [] / [1] / [N])."""
        g = g.float().reshape(-1)
        return cls(packed, scale, g.expand(packed.shape[0]).contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], 2 * self.packed.shape[1])

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.g))

    def to(self, device: str | torch.device) -> "Nvfp4Weight":
        return Nvfp4Weight(*(t.to(device) for t in (self.packed, self.scale, self.g)))

    def rows(self, start: int, stop: int) -> "Nvfp4Weight":
        """Rows [start, stop) as views."""
        return Nvfp4Weight(self.packed[start:stop], self.scale[start:stop], self.g[start:stop])

    @staticmethod
    def cat(parts: "list[Nvfp4Weight]") -> "Nvfp4Weight":
        return Nvfp4Weight(torch.cat([p.packed for p in parts]),
                           torch.cat([p.scale for p in parts]), torch.cat([p.g for p in parts]))


def nvfp4_bytes(n: int, k: int) -> int:
    """Bytes of an [n, k] Nvfp4Weight: codes, block scales, per-row globals."""
    return n * k // 2 + n * k // GROUP + 4 * n
