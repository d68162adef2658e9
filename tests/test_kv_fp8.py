"""The opt-in FP8 K/V cache (ftchat/model/kv_cache.py, docs/model.md 4.6).

(a) quantize / dequantize rows: codes are the nearest e4m3fn values (ties to even), within the
    e4m3 bound below; zero rows; the scale layout; store / gather through a DecodeState.
(b) decode on the tiny synthetic model: prefill + 64 steps with FP8 K/V against the model-dtype
    K/V, the logits within stated bounds; negative controls (a dequantization that ignores the
    scale, or reads the other kv head's) break the bounds.
(c) auto (the default) is the model-dtype path, bit for bit.
(d) the setting: flag > environment > default; a bad value is one error line, exit 1; --help;
    `info --kv-cache-dtype fp8` plans the FP8 bytes, equal to what DecodeState allocates.
The fused CUDA kernels have their own tests (tests/gpu/test_qsa_kv_fp8_gpu.py).

The round-trip bound. A row x [hd] is stored as codes c = e4m3(y), y = x / s, s = amax|x| / 448,
so |y| <= 448. float8_e4m3fn has 3 mantissa bits: for normal |y| >= 2^-6, y in [2^e, 2^(e+1))
lies on a grid of step 2^(e-3), and rounding to nearest errs by at most half a step,
2^(e-4) <= 2^-4 |y|; below 2^-6 (subnormals) the step is 2^-9, the error at most 2^-10. Back in
x's units (times s): |x^ - x| <= 2^-4 |x| + 2^-10 s. The fp32 division and product each add at
most 2^-24 relative: 2^-22 |x| covers both. A bf16 result adds its own rounding, 2^-9 |x^|.
"""

from __future__ import annotations

import pytest
import torch

from ftchat.engine import Decoder, load_model, resident_backend
from ftchat.errors import SettingsError
from ftchat.model import kv_cache as kc
from ftchat.model.config import ModelArgs
from ftchat.model.kv_cache import AttentionCache
from ftchat.model.state import DecodeState
from ftchat.model.synth import preset_config
from ftchat.session import Session
from ftchat.settings import Settings, override, resolve_settings
from ftchat.vram.items import Workload
from ftchat.vram.plan import plan
from ftchat.vram.workloads import (bench_workload, checkpoint_inputs, run_workload,
                                   synthetic_inputs, verify_workload)
from tests.kv_compare import decode_arm, kv_difference
from tests.test_cli_errors import _main, one_error

F32, BF16, FP8 = torch.float32, torch.bfloat16, kc.FP8


# ===== (a) quantize / dequantize =====


def _rows(n: int, hd: int, seed: int) -> torch.Tensor:
    """Rows with a wide dynamic range (each element times 10^U(-6, 0)): many land on the e4m3
    subnormals relative to their row's scale."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, hd, generator=g) * 10.0 ** (-6 * torch.rand(n, hd, generator=g))


def _nearest_e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """The e4m3fn codes (uint8) nearest to y (|y| <= 448), ties to the even code: by search
    over the 127 non-negative finite values, independent of torch's cast."""
    grid = torch.arange(127, dtype=torch.uint8).view(FP8).float()  # codes 0x00..0x7E, ascending
    d = (y.abs().flatten()[:, None] - grid[None]).abs()
    best = d.min(-1, keepdim=True).values
    cand = d == best  # one code, or two adjacent ones at a tie
    even = cand & (torch.arange(127) % 2 == 0)
    code = torch.where(even.any(-1), even.int().argmax(-1), cand.int().argmax(-1))
    sign = (y.flatten() < 0) | ((y.flatten() == 0) & torch.signbit(y.flatten()))
    return (code | (sign.int() << 7)).to(torch.uint8).view(y.shape)


def test_codes_are_the_nearest_e4m3_values_ties_to_even():
    x = _rows(64, 128, seed=0)
    codes, scale = kc.quantize_rows(x)
    y = (x / scale[:, None]).clamp(-448, 448)
    assert torch.equal(codes.view(torch.uint8), _nearest_e4m3_codes(y))
    # exact ties at scale 1 (amax 448): 1 + 1/16 -> 1 (even), 1 + 3/16 -> 1.25 (even), and in the
    # subnormals 2^-10 -> 0, 3 * 2^-10 -> 2^-8
    t = torch.tensor([448.0, 1.0625, 1.1875, -1.1875, 2**-10, 3 * 2**-10, -0.0, 0.0])
    codes, scale = kc.quantize_rows(t)
    assert float(scale) == 1.0
    assert codes.float().tolist() == [448.0, 1.0, 1.25, -1.25, 0.0, 2**-8, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_round_trip_within_the_e4m3_bound(dtype):
    x = _rows(256, 256, seed=1).to(dtype)
    codes, scale = kc.quantize_rows(x)
    back = kc.dequantize_rows(codes, scale, dtype)
    assert back.dtype == dtype and codes.dtype == FP8 and scale.dtype == F32
    xd, bd = x.double(), back.double()
    bound = (2**-4 + 2**-22) * xd.abs() + 2**-10 * scale.double()[:, None]
    if dtype == BF16:
        bound = bound + 2**-9 * bd.abs()
    ratio = (bd - xd).abs() / bound
    print(f"worst error / bound {float(ratio.max()):.3f}", end=" ")
    assert float(ratio.max()) <= 1
    if dtype == F32:  # the bound is tight: some element errs by nearly all of it
        assert float(ratio.max()) > 0.9
        sub = (xd / scale.double()[:, None]).abs() < 2**-6
        assert sub.float().mean() > 0.05  # the subnormal term is exercised


def test_zero_rows_store_zeros_with_scale_one():
    x = _rows(4, 32, seed=2)
    x[1] = 0
    x[3, :16] = 0  # zeros inside a row: plain zero codes
    codes, scale = kc.quantize_rows(x)
    assert float(scale[1]) == 1.0 and not codes[1].view(torch.uint8).any()
    assert not kc.dequantize_rows(codes, scale, F32)[1].any()
    assert not kc.dequantize_rows(codes, scale, F32)[3, :16].any()


def test_scale_layout_one_per_sequence_token_and_kv_head():
    x = torch.randn(2, 5, 3, 32, generator=torch.Generator().manual_seed(3))  # [B, L, Hkv, hd]
    codes, scale = kc.quantize_rows(x)
    assert codes.shape == x.shape and scale.shape == (2, 5, 3)
    amax = x.abs().amax(-1)
    assert torch.equal(scale, (amax.double() / 448).float())  # one IEEE division
    assert torch.equal(codes.float().abs().amax(-1), torch.full((2, 5, 3), 448.0))


def _attention(state: DecodeState) -> AttentionCache:
    return next(c for c in state.mixers if isinstance(c, AttentionCache))


def test_decode_state_layout_and_store_gather():
    a = ModelArgs.from_hf(preset_config("tiny", None, eos=0))
    auto = _attention(DecodeState.create(a, 2, 16, "cpu", F32))
    same = _attention(DecodeState.create(a, 2, 16, "cpu", F32, kv_dtype=F32))
    fp8 = DecodeState.create(a, 2, 16, "cpu", F32, kv_dtype=FP8)
    c = _attention(fp8)
    for model_dtype in (auto, same):
        assert model_dtype.k.dtype == F32 and not model_dtype.fp8
        assert model_dtype.k_scale is None and model_dtype.kv_scales() is None
        assert len(model_dtype.tensors()) == 4  # k, v, ik, kbar
    assert c.fp8 and len(c.tensors()) == 6 and c.kv_scales() == (c.k_scale, c.v_scale)
    Hkv, hd = a.num_key_value_heads, a.head_dim
    assert c.k.shape == (2, 16, Hkv, hd) and c.k.dtype == c.v.dtype == FP8
    assert c.k_scale.shape == (2, 16, Hkv) and c.v_scale.dtype == F32
    assert c.ik.dtype == c.kbar.dtype == F32  # index and block keys: the model dtype
    with pytest.raises(ValueError):
        DecodeState.create(a, 1, 8, "cpu", F32, kv_dtype=torch.float16)
    # store at (rows, positions), gather back: the round trip of quantize/dequantize
    k, v = torch.randn(2, 3, Hkv, hd), torch.randn(2, 3, Hkv, hd)
    rows, pos = torch.arange(2)[:, None].expand(2, 3), torch.tensor([[0, 1, 2], [5, 6, 7]])
    kc.store_kv(c, (rows, pos), k, v)
    keys, vals = kc.gather_kv(c, (rows, pos), F32)
    assert torch.equal(keys, kc.dequantize_rows(*kc.quantize_rows(k), F32))
    assert torch.equal(vals, kc.dequantize_rows(*kc.quantize_rows(v), F32))
    unwritten = kc.gather_kv(c, (slice(None), slice(8, 16)), F32)[0]
    assert not unwritten.any()  # codes 0, scale 0: reads as 0, as the model-dtype zeros
    written = [bool((t.view(torch.uint8) if t.dtype == FP8 else t).any()) for t in c.tensors()]
    fp8.reset(slice(0, 2), eos=0)  # FP8 codes zeroed through their bytes
    assert written[:2] == [True, True]  # k and v held codes before
    assert not any(t.view(torch.uint8).any() if t.dtype == FP8 else t.any() for t in c.tensors())


# ===== (b) decode on the tiny synthetic model =====

STEPS = 64
PROMPT = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(0)).tolist()
# fp32 model, FP8 vs fp32 K/V, prompt + 64 steps (teacher-forced, tests/kv_compare.py). Measured
# (benchmarks/kv_fp8_cpu.py, 3 prompts; logit std 0.475): max|d| 0.018, 0.037, 0.061; mean|d|
# 0.0013, 0.0013, 0.0017; every forced argmax the reference's; greedy tokens all equal. The
# bounds: ~2.5x the worst max and ~3x the worst mean of the three.
MAX_F32, MEAN_F32 = 0.15, 0.005
# bf16 model, FP8 vs bf16 K/V, 16 steps (bf16 on the CPU is slow). Measured over 64 steps and the
# same 3 prompts: max|d| 0.137, 0.075, 0.086, mean|d| 0.0042, 0.0034, 0.0038; this prompt over
# 16 steps: 0.031 and 0.0030. The bounds: ~2x the worst 64-step max, ~3x its mean.
BF16_STEPS, MAX_BF16, MEAN_BF16 = 16, 0.3, 0.012


@pytest.fixture(scope="module")
def tiny(tiny_bf16):
    return {dt: load_model(tiny_bf16, dtype=dt) for dt in (F32, BF16)}


@pytest.fixture(scope="module")
def reference(tiny):
    """The fp32 model's greedy decode with fp32 K/V: (tokens, logits [65, V])."""
    return decode_arm(tiny[F32], PROMPT, STEPS, None)


def _forced_diff(m, reference) -> tuple[float, float]:
    tokens, ref = reference
    _, got = decode_arm(m, PROMPT, len(tokens), FP8, forced=tokens)
    d = (got - ref).abs()
    return float(d.max()), float(d.mean())


def test_fp8_decode_stays_close_to_the_fp32_cache(tiny):
    r = kv_difference(tiny[F32], PROMPT, STEPS)
    print(r.line(), end=" ")
    assert r.positions == STEPS + 1
    assert r.max_abs <= MAX_F32 and r.mean_abs <= MEAN_F32, r
    assert r.argmax_agree >= 0.95, r  # a near tie may flip; measured: none
    assert r.max_abs > 0  # it is a different cache


def test_fp8_decode_stays_close_to_the_bf16_cache(tiny):
    m = tiny[BF16]
    tokens, ref = decode_arm(m, PROMPT, BF16_STEPS, None)
    _, got = decode_arm(m, PROMPT, BF16_STEPS, FP8, forced=tokens)
    d = (got - ref).abs()
    print(f"max|d| {float(d.max()):.4g} mean|d| {float(d.mean()):.4g}", end=" ")
    assert float(d.max()) <= MAX_BF16 and float(d.mean()) <= MEAN_BF16


@pytest.mark.parametrize("broken", ["scale ignored", "other kv head's scale"])
def test_negative_control_a_broken_dequantization_fails_the_bounds(tiny, reference, broken,
                                                                   monkeypatch):
    right = kc.dequantize_rows
    wrong = {"scale ignored": lambda c, s, dt: c.float().to(dt),
             "other kv head's scale": lambda c, s, dt: right(c, s.flip(-1), dt)}[broken]
    monkeypatch.setattr(kc, "dequantize_rows", wrong)
    mx, mean = _forced_diff(tiny[F32], reference)
    print(f"{broken}: max|d| {mx:.4g} mean|d| {mean:.4g}", end=" ")
    assert mx > MAX_F32 or mean > MEAN_F32  # measured: 3.16 / 0.53 and 0.28 / 0.017


# ===== (c) auto is the model-dtype path =====


def test_auto_is_the_model_dtype_cache_bit_for_bit(tiny, reference):
    m = tiny[F32]
    s = resolve_settings({"kv_cache_dtype": "auto"}, {})
    assert s.kv_torch_dtype() is None and Settings().kv_cache_dtype == "auto"
    for kv in (s.kv_torch_dtype(), F32):  # the explicit setting, and the model dtype itself
        tokens, logits = decode_arm(m, PROMPT, STEPS, kv, forced=reference[0])
        assert torch.equal(logits, reference[1])
    dec = Decoder(m, resident_backend(m), 1, 32)
    caches = [c for c in dec.state.mixers if isinstance(c, AttentionCache)]
    assert caches and all(c.k.dtype == F32 and not c.fp8 for c in caches)


# ===== (d) the setting, the CLI, the plan =====


def test_setting_flag_environment_default_and_bench_override():
    env = {"FTCHAT_KV_CACHE_DTYPE": "fp8"}
    assert resolve_settings({}, {}).kv_cache_dtype == "auto"
    assert resolve_settings({}, env).kv_cache_dtype == "fp8"
    assert resolve_settings({"kv_cache_dtype": "auto"}, env).kv_cache_dtype == "auto"
    assert resolve_settings({"kv_cache_dtype": "FP8"}, {}).kv_torch_dtype() == FP8
    assert override(Settings(), {"kv_cache_dtype": "fp8"}).kv_cache_dtype == "fp8"
    with pytest.raises(SettingsError, match="--kv-cache-dtype 'fp16': expected auto or fp8"):
        resolve_settings({"kv_cache_dtype": "fp16"}, {})
    with pytest.raises(SettingsError, match="FTCHAT_KV_CACHE_DTYPE='e5m2'"):
        resolve_settings({}, {"FTCHAT_KV_CACHE_DTYPE": "e5m2"})


@pytest.mark.parametrize("argv", [
    ["run", "--kv-cache-dtype", "fp16", "--prompt", "hi"],
    ["bench", "--kv-cache-dtype", "int8"],
    ["verify", "--kv-cache-dtype", "bf16"],
    ["audit", "--kv-cache-dtype", "e5m2", "--prompt", "hi"],
    ["info", "--synthetic", "tiny", "--kv-cache-dtype", "half"],
])
def test_a_bad_value_is_one_error_line(argv, capsys, monkeypatch):
    code, out, err = _main(argv, capsys, monkeypatch)
    one_error(code, out, err, "--kv-cache-dtype", "expected auto or fp8", status=2)


def test_a_bad_environment_value_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("FTCHAT_KV_CACHE_DTYPE", "fp4")
    code, out, err = _main(["run", "--prompt", "hi"], capsys, monkeypatch)
    one_error(code, out, err, "FTCHAT_KV_CACHE_DTYPE", "expected auto or fp8", status=2)


@pytest.mark.parametrize("command", ["run", "bench", "verify", "audit", "info"])
def test_help_shows_the_option(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = _main([command, "--help"], capsys, monkeypatch)
    assert code == 0 and "--kv-cache-dtype" in out and "auto|fp8" in out


def test_info_plans_the_fp8_bytes(capsys, monkeypatch):
    argv = ["info", "--synthetic", "flash-next", "--layers", "48", "--vram", "16", "--context",
            "255k"]
    a, _ = synthetic_inputs("flash-next", 48, "nvfp4-modelopt")
    L, Hkv, hd, n_attn = 255 * 1024, a.num_key_value_heads, a.head_dim, 12
    code, out, _ = _main(argv, capsys, monkeypatch)
    assert code == 0 and f"{n_attn * L * 2 * Hkv * hd * 2:,}" in out
    code, out, _ = _main([*argv, "--kv-cache-dtype", "fp8"], capsys, monkeypatch)
    kv_line = next(ln for ln in out.splitlines() if "KV cache (K and V)" in ln)
    assert code == 0 and f"{n_attn * L * 2 * Hkv * (hd + 4):,}" in kv_line  # codes + scales
    assert "fp8" in kv_line and "K/V cache fp8" in out
    assert "16 GiB: " in out and "slots fit" in out  # at 255K it now fits 16 GiB
    code, out, _ = _main(["info", "--synthetic", "tiny", "--kv-cache-dtype", "fp8"], capsys,
                         monkeypatch)
    assert code == 0 and "VRAM plan" in out  # the option alone prints the plan


@pytest.mark.parametrize("rows,context", [((1,), 64), ((1, 2, 3), 37)])
def test_the_fp8_plan_item_is_the_decode_state(tiny_bf16, rows, context):
    a, layout = checkpoint_inputs(tiny_bf16)
    w = Workload(context, rows, cuda=False, kv_cache_dtype="fp8")
    item = next(i for i in plan(a, layout, BF16, w, 20).items if i.name == "KV cache (K and V)")
    real = sum(t.nbytes for b in rows
               for c in DecodeState.create(a, b, context, "cpu", BF16, kv_dtype=FP8).mixers
               if isinstance(c, AttentionCache) for t in (c.k, c.v, c.k_scale, c.v_scale))
    assert item.nbytes == real and item.exact
    auto = plan(a, layout, BF16, Workload(context, rows, cuda=False), 20)
    # only the KV item changes, and the prefill's transients (fp8 K/V are dequantized through
    # fp32 when the attention gathers them: more than model-dtype ones)
    act = "activations and workspaces (estimate)"
    others = [(i.name, i.nbytes) for i in auto.items if i.name not in (item.name, act)]
    fp8 = plan(a, layout, BF16, w, 20).items
    assert others == [(i.name, i.nbytes) for i in fp8 if i.name not in (item.name, act)]
    assert next(i.nbytes for i in fp8 if i.name == act) >= next(
        i.nbytes for i in auto.items if i.name == act)


def test_workloads_carry_the_setting(tiny_bf16):
    a, layout = checkpoint_inputs(tiny_bf16)
    fp8, auto = Settings(kv_cache_dtype="fp8", device="cpu"), Settings(device="cpu")
    assert run_workload(a, layout, fp8).kv_cache_dtype == "fp8"
    assert verify_workload(a, layout, fp8, 8).kv_cache_dtype == "fp8"
    assert bench_workload(a, layout, fp8, [fp8, None], 64).kv_cache_dtype == "fp8"
    # mixed arms (an auto arm): planned at the larger, model-dtype cache
    assert bench_workload(a, layout, fp8, [fp8, auto], 64).kv_cache_dtype == "auto"


def test_a_session_decodes_with_the_fp8_cache(tiny_nvfp4, capsys, monkeypatch):
    s = Session.open(tiny_nvfp4, Settings(kv_cache_dtype="fp8", device="cpu"))
    dec = s._new_decoder(1)
    caches = [c for c in dec.state.mixers if isinstance(c, AttentionCache)]
    assert caches and all(c.fp8 for c in caches)
    assert "(K/V cache fp8)" in s.describe()  # the load line says so
    code, out, err = _main(["run", str(tiny_nvfp4), "--kv-cache-dtype", "fp8", "--prompt",
                            "hello", "-n", "8", "--quiet"], capsys, monkeypatch)
    assert code == 0 and out.strip(), err
