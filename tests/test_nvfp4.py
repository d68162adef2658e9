"""NVFP4 codec: expected values are written by hand from docs/model.md section 12, not produced by it."""

from __future__ import annotations

import pytest
import torch

from ftchat.errors import ModelError
from ftchat.codecs import nvfp4
from ftchat.codecs.nvfp4 import COMPRESSED_TENSORS, MODELOPT

# The E2M1 table, written out by hand (code -> value).
TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
E4M3 = torch.float8_e4m3fn


def _hand_pack(codes: list[int]) -> torch.Tensor:
    # byte j = code[2j] | code[2j+1] << 4, by plain integer arithmetic
    return torch.tensor([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)],
                        dtype=torch.uint8)


def _ones_scale(n: int, k: int) -> torch.Tensor:
    return torch.ones(n, k // 16).to(E4M3)


# ===== table, nibbles, scalar rounding =====


def test_table_values_and_negative_zero():
    assert nvfp4.E2M1_VALUES.dtype == torch.float32
    assert nvfp4.E2M1_VALUES.tolist() == TABLE
    assert torch.signbit(nvfp4.E2M1_VALUES[8]) and not torch.signbit(nvfp4.E2M1_VALUES[0])


def test_every_code_through_unpack_and_dequant():
    # 32 elements: codes 0..15, then 15..0; bytes written out by hand
    packed = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE,
                            0xEF, 0xCD, 0xAB, 0x89, 0x67, 0x45, 0x23, 0x01]], dtype=torch.uint8)
    out = nvfp4.dequantize(packed, _ones_scale(1, 32), torch.tensor(1.0))
    assert out.dtype == torch.float32 and out.shape == (1, 32)
    assert out[0].tolist() == TABLE + TABLE[::-1]
    assert torch.signbit(out[0, 8]) and torch.signbit(out[0, 23])  # -0 is code 8
    assert not torch.signbit(out[0, 0]) and not torch.signbit(out[0, 31])


def test_nibble_order():
    assert nvfp4.unpack_nibbles(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [1, 2]
    assert nvfp4.pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).tolist() == [0x21]
    assert nvfp4.pack_nibbles(torch.tensor([[15, 0, 0, 8]], dtype=torch.uint8)).tolist() == [
        [0x0F, 0x80]
    ]


def test_pack_unpack_round_trip_and_shapes():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=gen)
    packed = nvfp4.pack_nibbles(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(nvfp4.unpack_nibbles(packed), codes)


def test_pack_rejects_bad_codes():
    nvfp4.pack_nibbles(torch.tensor([15, 0], dtype=torch.uint8))  # negative control
    with pytest.raises(ValueError):
        nvfp4.pack_nibbles(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError):
        nvfp4.pack_nibbles(torch.tensor([1, 2, 3], dtype=torch.uint8))


def test_e2m1_rounding_ties_to_even_and_saturation():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 1e6,
                      -0.75, -0.1, -6.5, 0.0])
    want = [0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 10, 8, 15, 0]
    assert nvfp4.e2m1_codes(x).tolist() == want


def test_e4m3_saturates_never_nan():
    x = torch.tensor([447.0, 448.0, 500.0, 1e9, float("inf"), -1e9, 0.0])
    out = nvfp4.e4m3_saturate(x)
    assert out.dtype == E4M3
    assert out.float().tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0, 0.0]


# ===== dequantize =====


def test_dequant_multiply_order_value_times_scale_then_global():
    # code 5 (3.0), scale 0.875, g = fp32(1/3): (3 * 0.875) * g = 0.875 exactly in fp32, while
    # 3 * (0.875 * g) rounds to 0.87500006
    g = torch.tensor(1.0 / 3.0, dtype=torch.float32)
    packed = _hand_pack([5] + [0] * 15).reshape(1, 8)
    scale = torch.full((1, 1), 0.875).to(E4M3)
    out = nvfp4.dequantize(packed, scale, g)
    assert out[0, 0].item() == 0.875
    assert (torch.tensor(3.0) * (torch.tensor(0.875) * g)).item() != 0.875  # control


def test_dequant_block_scales_and_per_row_global():
    # row 0: codes 7 (6.0) in both blocks, scales 2 and 0.5; row 1: code 2 (1.0), scales 4, 1
    packed = torch.stack([_hand_pack([7] * 32), _hand_pack([2] * 32)])  # [2, 16]
    scale = torch.tensor([[2.0, 0.5], [4.0, 1.0]]).to(E4M3)
    out = nvfp4.dequantize(packed, scale, torch.tensor([1.0, 0.25]))  # per-row globals
    assert out[0].tolist() == [12.0] * 16 + [3.0] * 16
    assert out[1].tolist() == [1.0] * 16 + [0.25] * 16
    one = nvfp4.dequantize(packed, scale, torch.tensor([0.5]))  # [1] global
    assert one[1].tolist() == [2.0] * 16 + [0.5] * 16


# ===== quantize =====


def test_quantize_zero_block_and_all_zero_tensor():
    w = torch.zeros(1, 32)
    w[0, 16], w[0, 17] = 6.0, -3.0  # amax 6: global 6 / 2688, block 1 scale 1 / global = 448
    packed, scale, g = nvfp4.quantize(w)
    assert g.item() == pytest.approx(6.0 / 2688.0, rel=1e-7)
    assert scale.float().tolist() == [[0.0, 448.0]]
    assert packed[0, :8].tolist() == [0] * 8  # zero block: every code 0, never NaN
    assert packed[0, 8].item() == 0xD7  # 6 -> code 7 (low), -3 -> code 13 (high)
    out = nvfp4.dequantize(packed, scale, g)
    assert torch.isfinite(out).all() and out[0, :16].tolist() == [0.0] * 16

    packed, scale, g = nvfp4.quantize(torch.zeros(2, 32))
    assert g.item() == 1.0
    assert scale.float().abs().sum().item() == 0.0 and packed.sum().item() == 0
    assert nvfp4.dequantize(packed, scale, g).abs().sum().item() == 0.0


def test_quantize_underflowing_block_scale_gives_code_zero():
    # global 1 (amax 2688); block 1 amax 0.003: 0.003 / 6 = 5e-4 < 2^-10, so its e4m3 scale is 0
    # and every code is 0, also for the negative entries (not -0, code 8)
    w = torch.zeros(1, 32)
    w[0, 0] = 2688.0
    w[0, 16:] = torch.tensor([0.003, -0.003] * 8)
    packed, scale, g = nvfp4.quantize(w)
    assert g.item() == 1.0
    assert scale.float().tolist() == [[448.0, 0.0]]
    assert packed[0].tolist() == [0x07] + [0] * 15


def test_quantize_block_scale_saturates_at_448():
    # amax 1344 = 6 * 448 * 0.5: global 0.5, that block's scale 1344 / 6 / 0.5 = 448, code 7
    w = torch.zeros(2, 32)
    w[0, 3] = 1344.0
    w[1, 20] = -42.0  # 42 / 6 / 0.5 = 14 -> scale 14, code 15 (-6)
    packed, scale, g = nvfp4.quantize(w)
    assert g.item() == 0.5
    assert scale.float().tolist() == [[448.0, 0.0], [0.0, 14.0]]
    assert packed[0, 1].item() == 0x70  # element 3 is the high nibble of byte 1
    assert packed[1, 10].item() == 0x0F  # element 20 is the low nibble of byte 10
    out = nvfp4.dequantize(packed, scale, g)
    assert out[0, 3].item() == 1344.0 and out[1, 20].item() == -42.0


def test_quantize_dequantize_exact_on_representable_weights():
    # global 0.125 (amax 6 * 448 * 0.125 = 336); per-block scales exact in e4m3; every block holds
    # a +-6 code so its amax fixes the scale exactly
    gen = torch.Generator().manual_seed(1)
    g, block_scales = 0.125, [448.0, 1.5, 0.3125, 20.0, 0.875, 2.0, 104.0, 0.046875]
    N, K = 4, 32
    codes = torch.randint(0, 16, (N, K), generator=gen)
    codes[:, 0::16] = torch.tensor([7, 15, 7, 15]).unsqueeze(-1)  # first of each block
    scale = torch.tensor(block_scales).reshape(N, K // 16)
    table = torch.tensor(TABLE)
    w = table[codes] * scale.repeat_interleave(16, dim=-1) * g  # exact products in fp32
    packed, s_out, g_out = nvfp4.quantize(w)
    assert g_out.item() == g
    assert s_out.float().tolist() == scale.tolist()
    want = codes[:, 0::2] | (codes[:, 1::2] << 4)
    assert packed.tolist() == want.tolist()  # includes code 8 for -0 weights
    out = nvfp4.dequantize(packed, s_out, g_out)
    assert torch.equal(out, w) and torch.equal(torch.signbit(out), torch.signbit(w))


def test_quantize_error_bound_on_random_weights():
    gen = torch.Generator().manual_seed(2)
    N, K = 64, 256
    rows = 10 ** (torch.rand(N, 1, generator=gen) * 3 - 1.5)  # row magnitudes 0.03 .. 30
    w = torch.randn(N, K, generator=gen) * rows
    packed, scale, g = nvfp4.quantize(w)
    assert g.item() == pytest.approx(w.abs().max().item() / 2688.0, rel=1e-6)
    block_amax = w.reshape(N, K // 16, 16).abs().amax(-1)
    ideal = block_amax / 6.0  # what scale * global approximates
    got = scale.float() * g
    assert ((got - ideal).abs() <= ideal * 2.0**-4).all()  # e4m3: 3 mantissa bits, RNE
    # E2M1 RNE on x = w / d: |x - q| <= 0.25 below 2, 0.5 in [2, 4), 1 in [4, 6]; i.e.
    # <= max(0.25, |x| / 4); saturation above 6 stays under 6 * 2^-4 < 0.5
    d = (ideal * (1 + 2.0**-4)).repeat_interleave(16, dim=-1)  # upper bound on the step unit
    err = (nvfp4.dequantize(packed, scale, g) - w).abs()
    bound = torch.maximum(0.25 * d, w.abs() / 4) * (1 + 1e-5)
    assert (err <= bound).all()
    assert err.max() > 0  # the data is not accidentally representable


# ===== dialects =====


def test_tensor_names():
    p = "model.layers.0.mlp.experts.3.gate_proj"
    assert nvfp4.tensor_names(MODELOPT, p) == {
        "packed": p + ".weight", "block_scale": p + ".weight_scale",
        "global": p + ".weight_scale_2", "input_global": p + ".input_scale",
    }
    assert nvfp4.tensor_names(COMPRESSED_TENSORS, p) == {
        "packed": p + ".weight_packed", "block_scale": p + ".weight_scale",
        "global": p + ".weight_global_scale", "input_global": p + ".input_global_scale",
    }
    with pytest.raises(ModelError):
        nvfp4.tensor_names("nvfp4-awq", p)


def _weight() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (4, 16), dtype=torch.uint8, generator=gen)  # [N=4, K/2]
    scale = torch.tensor([[1.0, 2.0], [0.5, 448.0], [3.0, 0.0], [6.0, 0.125]]).to(E4M3)
    return packed, scale


def test_modelopt_round_trip():
    packed, scale = _weight()
    d = nvfp4.to_checkpoint(MODELOPT, "x", packed, scale, torch.tensor(0.25), torch.tensor(0.5))
    assert set(d) == {"x.weight", "x.weight_scale", "x.weight_scale_2", "x.input_scale"}
    assert d["x.weight_scale_2"].shape == () and d["x.weight_scale_2"].dtype == torch.float32
    assert d["x.weight_scale_2"].item() == 0.25 and d["x.input_scale"].item() == 0.5
    p2, s2, g2 = nvfp4.from_checkpoint(MODELOPT, d.__getitem__, "x")
    assert torch.equal(p2, packed) and torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))
    assert g2.dtype == torch.float32 and g2.item() == 0.25


def test_compressed_tensors_round_trip_stores_reciprocal():
    packed, scale = _weight()
    d = nvfp4.to_checkpoint(COMPRESSED_TENSORS, "x", packed, scale, torch.tensor(0.25),
                            torch.tensor(0.5))
    assert set(d) == {"x.weight_packed", "x.weight_scale", "x.weight_global_scale",
                      "x.input_global_scale"}
    gs = d["x.weight_global_scale"]
    assert gs.shape == (1,) and gs.dtype == torch.float32 and gs.item() == 4.0  # 1 / 0.25
    assert d["x.input_global_scale"].tolist() == [2.0]  # 1 / 0.5
    p2, s2, g2 = nvfp4.from_checkpoint(COMPRESSED_TENSORS, d.__getitem__, "x")
    assert torch.equal(p2, packed) and torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))
    assert g2.shape == () and g2.item() == 0.25
    # a stored 8.0 (quant side) means multiply by 0.125 on the dequant side
    d["x.weight_global_scale"] = torch.tensor([8.0])
    assert nvfp4.from_checkpoint(COMPRESSED_TENSORS, d.__getitem__, "x")[2].item() == 0.125


BAD = [  # (role, replacement or None for missing, tensor name that the error must carry)
    ("packed", torch.zeros(4, 16, dtype=torch.int8), "x.weight"),
    ("packed", torch.zeros(4, 12, dtype=torch.uint8), "x.weight"),  # K = 24, not % 16
    ("packed", torch.zeros(64, dtype=torch.uint8), "x.weight"),
    ("block_scale", torch.ones(4, 3).to(E4M3), "x.weight_scale"),
    ("block_scale", torch.ones(4, 2, dtype=torch.bfloat16), "x.weight_scale"),
    ("global", torch.ones(2), "x.weight_scale_2"),
    ("global", torch.tensor(float("nan")), "x.weight_scale_2"),
    ("global", torch.tensor(-1.0), "x.weight_scale_2"),
    ("global", None, "x.weight_scale_2"),
    ("packed", None, "x.weight"),
]


@pytest.mark.parametrize("dialect", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize("role,bad,name", BAD)
def test_from_checkpoint_rejects_bad_tensors(dialect, role, bad, name):
    packed, scale = _weight()
    d = nvfp4.to_checkpoint(dialect, "x", packed, scale, torch.tensor(0.25))
    nvfp4.from_checkpoint(dialect, d.__getitem__, "x")  # negative control: the good set loads
    key = nvfp4.tensor_names(dialect, "x")[role]
    if dialect == COMPRESSED_TENSORS:
        name = key
    if bad is None:
        del d[key]
    else:
        d[key] = bad
    with pytest.raises(ModelError, match=name.replace(".", r"\.") + r"\b"):
        nvfp4.from_checkpoint(dialect, d.__getitem__, "x")


def test_compressed_tensors_rejects_zero_stored_global():
    packed, scale = _weight()
    d = nvfp4.to_checkpoint(COMPRESSED_TENSORS, "x", packed, scale, torch.tensor(0.25))
    d["x.weight_global_scale"] = torch.tensor([0.0])  # would mean g = inf
    with pytest.raises(ModelError, match="x.weight_global_scale"):
        nvfp4.from_checkpoint(COMPRESSED_TENSORS, d.__getitem__, "x")


def test_detect_dialect():
    p = "model.layers.0.mlp.experts.0.down_proj"
    mo = [p + ".weight", p + ".weight_scale", p + ".weight_scale_2", p + ".input_scale"]
    ct = [p + ".weight_packed", p + ".weight_scale", p + ".weight_global_scale"]
    bf16 = [p + ".weight", "model.norm.weight"]
    assert nvfp4.detect_dialect(mo) == MODELOPT
    assert nvfp4.detect_dialect(ct) == COMPRESSED_TENSORS
    assert nvfp4.detect_dialect(bf16) is None
    assert nvfp4.detect_dialect(mo + bf16, prefix=p) == MODELOPT
    assert nvfp4.detect_dialect(mo, prefix="model.norm") is None
    assert nvfp4.detect_dialect([p + ".weight_scale_2"], prefix=p) is None  # no .weight
    assert nvfp4.detect_dialect([p + ".weight_scale_2"]) is None
    with pytest.raises(ModelError):
        nvfp4.detect_dialect(mo + ["a.weight_packed"])


# ===== quantization_config =====


def test_quant_config_dicts():
    assert nvfp4.quant_config_dict(MODELOPT, ["lm_head"]) == {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
        "exclude_modules": ["lm_head"],
    }
    ct = nvfp4.quant_config_dict(COMPRESSED_TENSORS, ["lm_head", "re:.*mlp.gate$"])
    assert ct["quant_method"] == "compressed-tensors" and ct["format"] == "nvfp4-pack-quantized"
    assert ct["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    assert ct["config_groups"]["group_0"] == {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                    "group_size": 16, "symmetric": True},
        "input_activations": None,
    }
    assert nvfp4.dialect_from_quant_config(nvfp4.quant_config_dict(MODELOPT, [])) == MODELOPT
    assert nvfp4.dialect_from_quant_config(ct) == COMPRESSED_TENSORS


def test_dialect_from_quant_config_recognises_variants():
    assert nvfp4.dialect_from_quant_config({}) is None
    assert nvfp4.dialect_from_quant_config(None) is None
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4",
                                                                   "group_size": 16}}
    assert nvfp4.dialect_from_quant_config(hf_quant) == MODELOPT
    mixed = {"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
        "g": {"format": "nvfp4-pack-quantized", "targets": ["Linear"],
              "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    assert nvfp4.dialect_from_quant_config(mixed) == COMPRESSED_TENSORS


UNSUPPORTED = [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "FP8"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "group_size": 128}}}},
     "pack-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}},
     "float-quantized"),
]


@pytest.mark.parametrize("qc,word", UNSUPPORTED)
def test_dialect_from_quant_config_rejects_others(qc, word):
    with pytest.raises(ModelError, match=word):
        nvfp4.dialect_from_quant_config(qc)


# ===== device =====


@pytest.mark.gpu
def test_cuda_matches_cpu_bitwise():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(4)) * 3
    cpu = nvfp4.quantize(w)
    gpu = nvfp4.quantize(w.cuda())
    assert all(t.device.type == "cuda" for t in gpu)
    assert torch.equal(gpu[0].cpu(), cpu[0])
    assert torch.equal(gpu[1].cpu().view(torch.uint8), cpu[1].view(torch.uint8))
    assert torch.equal(gpu[2].cpu(), cpu[2])
    out = nvfp4.dequantize(*gpu)
    assert out.device.type == "cuda" and torch.equal(out.cpu(), nvfp4.dequantize(*cpu))


def test_e2m1_values_is_the_table_without_a_host_tensor():
    # dequantize decodes by arithmetic (graph-capture safe); every code, the sign of -0 too
    codes = torch.arange(16, dtype=torch.uint8)
    got = nvfp4.e2m1_values(codes)
    assert got.dtype == torch.float32 and got.tolist() == TABLE
    assert torch.equal(torch.signbit(got), torch.signbit(nvfp4.E2M1_VALUES))
