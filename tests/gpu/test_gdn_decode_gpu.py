"""The fused GDN decode step (fused GEMV + Triton kernel) against the torch reference.

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_gdn_decode_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_gdn_decode_gpu.py
(TRITON_INTERPRET=1 alone also picks the CPU.) The interpreter runs fewer steps at the real
geometry (about 10 s a step); FTCHAT_GDN_STEPS overrides the step count everywhere.

Every test runs many consecutive steps from a random nonzero state (conv state and S) and
compares the output, the conv state and S after every step. Tolerances (`_excess`):
  * fp32: |got - ref| <= 1e-5 |ref| + 1e-5 max|ref|. Only summation order and the exp/rsqrt
    implementations differ (~1e-7 relative); the recurrence does not amplify it (e^g <= 1,
    |k^| = 1, 0 < beta < 1), so 1e-5 leaves 10-100x margin over many steps.
  * bf16 outputs are bf16: within 4 bf16 ulps of the reference, values under max|ref| / 64
    counting as that size. Both sides round the same fp32 quantities to bf16 at the same points
    (conv sum, silu, beta, o, the norm products), so almost every value is identical; a quantity
    that lands within ~1e-7 of a rounding boundary can round the other way (1 ulp), and one such
    flip upstream (say in v) moves a few downstream values by about an ulp. Small values get the
    floor because their error comes from the head-scale roundings, not their own ulp.
  * S (fp32) in the bf16 runs: within 2^-7 max|S|: a flipped upstream bf16 value (2^-8
    relative) enters S through beta u k^T (|k^| = 1, beta < 1).
  * conv state: exact (it only holds copies of model-dtype inputs), except in the full-mixer
    bf16 test, where the fused GEMV may round a projection differently than the four GEMVs.
  * full mixer (with out_proj), bf16: 2^-5 max|ref|, the GEMVs' own bf16 rounding, as in
    test_kernels_gpu.py.
Measured in the interpreter (CPU torch reference), as a fraction of the tolerance: fp32 out and
S <= 0.13; bf16 out <= 0.25 (at most 1 ulp), S <= 3e-4; conv state bit-identical. With -s
each test prints its worst fractions. The negative controls (state 2% off, conv window
reversed) exceed the tolerance by 1.3x to 1e5x.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ftchat.kernels import HAS_TRITON
from ftchat.kernels import gdn_decode as gk, sync
from ftchat.codecs import nvfp4
from ftchat.model import gdn
from ftchat.model.config import ModelArgs
from ftchat.model.spec import dense_specs
from ftchat.model.synth import _init, preset_config

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE") or ("cpu" if INTERPRET else "cuda")
BF16_ULPS = 4
FLOOR = 2**-6  # bf16: values under FLOOR * max|ref| are compared at that size


@pytest.fixture(autouse=True)
def _triton():
    assert HAS_TRITON, "these tests need triton"
    if DEVICE == "cpu":
        assert INTERPRET, "FTCHAT_TEST_DEVICE=cpu needs TRITON_INTERPRET=1"
    else:
        assert torch.cuda.is_available(), "no CUDA: set FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1"


# ===== geometries, weights, state =====


def _args(geo: str) -> ModelArgs:
    real = ModelArgs.from_hf(preset_config("flash-next", 4, eos=248044))
    if geo == "real":  # hidden 2560, Hk 16, Hv 48, dk = dv = 128, Kc 4, sigmoid gate
        return real
    small = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=6,
                 linear_key_head_dim=32, linear_value_head_dim=32)
    if geo == "small":  # 3 value heads per key head, as the real model
        return dataclasses.replace(real, **small)
    if geo == "odd":  # dk != dv, Kc 3 (masked conv taps), one key head, silu gate
        return dataclasses.replace(real, **{
            **small, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
            "linear_key_head_dim": 64, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 3,
            "output_gate_type": "silu"})
    if geo == "rep1":  # Hv == Hk: no key-head sharing
        return dataclasses.replace(real, **{**small, "linear_num_value_heads": 2})
    raise AssertionError(geo)


def _steps(geo: str) -> int:
    if "FTCHAT_GDN_STEPS" in os.environ:
        return int(os.environ["FTCHAT_GDN_STEPS"])
    return 2 if (geo == "real" and DEVICE == "cpu") else 24


def _layer(a: ModelArgs, dtype: torch.dtype, seed: int) -> dict:
    """One GDN layer's weights on DEVICE in dtype: the synthetic checkpoint's init, except
    dt_bias = softplus^-1(dt), dt ~ U(1e-3, 0.1) (HF's init): the decay e^g then spans ~0 to ~1,
    so the state carries over many steps (the synthetic dt_bias ~ 1 forgets it in one)."""
    gen = torch.Generator().manual_seed(seed)
    p = "layers.0.linear_attn."
    specs = {k[len(p):]: s for k, s in dense_specs(a).items() if k.startswith(p)}
    w = {k: _init(s.shape, s.init, gen) for k, s in specs.items()}
    dt = torch.empty(a.linear_num_value_heads).uniform_(1e-3, 0.1, generator=gen)
    w["dt_bias"] = torch.log(torch.expm1(dt))
    return {k: t.to(DEVICE, dtype) for k, t in w.items()}


def _dims(a: ModelArgs):
    return gdn._dims(a)


def _state(a: ModelArgs, B: int, dtype: torch.dtype, seed: int):
    """A random nonzero conv state [B, C, Kc-1] (dtype) and S [B, Hv, dk, dv] (fp32)."""
    Hk, Hv, dk, dv = _dims(a)
    gen = torch.Generator().manual_seed(seed)
    C = 2 * Hk * dk + Hv * dv
    conv = torch.randn(B, C, a.linear_conv_kernel_dim - 1, generator=gen).to(DEVICE, dtype)
    S = (torch.randn(B, Hv, dk, dv, generator=gen) * 0.3).to(DEVICE)
    return conv, S


def _width(a: ModelArgs) -> int:
    Hk, Hv, dk, dv = _dims(a)
    return 2 * Hk * dk + 2 * Hv * dv + 2 * Hv


# ===== tolerance =====


def _excess(got: torch.Tensor, ref: torch.Tensor, kind: str) -> float:
    """max |got - ref| / tolerance (<= 1 passes); kind: fp32, bf16 (ulps), S16, loose."""
    got, ref = got.double(), ref.double()
    err, mag = (got - ref).abs(), ref.abs()
    top = float(mag.max()) or 1.0
    if kind == "fp32":
        tol = 1e-5 * mag + 1e-5 * top
    elif kind == "bf16":
        _, e = torch.frexp(mag.clamp(min=FLOOR * top))
        tol = BF16_ULPS * torch.ldexp(torch.ones_like(mag), e - 8)  # ulp = 2^(floor(log2 x)-7)
    elif kind == "S16":
        tol = torch.full_like(mag, 2**-7 * top)
    elif kind == "loose":
        tol = torch.full_like(mag, 2**-5 * top)
    else:
        raise AssertionError(kind)
    return float((err / tol).max())


def _kind(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


# ===== the kernel alone: same projection output into both =====


def _kernel_step(a, w, proj, conv, S, block_v=None, num_warps=None):
    return gk.gdn_decode_step(proj, conv, S, w["conv1d.weight"], w["A_log"], w["dt_bias"],
                              w["norm.weight"], _dims(a), a.rms_norm_eps, a.output_gate_type,
                              block_v=block_v, num_warps=num_warps)


def _ref_step(a, w, proj, conv, S):
    Hk, Hv, dk, dv = _dims(a)
    u, z, b, g = proj[:, None].split([2 * Hk * dk + Hv * dv, Hv * dv, Hv, Hv], dim=-1)
    return gdn.gdn_core_ref(u, z, b, g, conv, S, w, a)[:, 0]


def _run_kernel(a, dtype, B, seed, steps, block_v=None, corrupt=None, num_warps=None):
    """Worst _excess over `steps` steps for (out, conv, S); corrupt(conv, S) edits the kernel's
    copy of the initial state (the negative control)."""
    w = _layer(a, dtype, seed)
    conv_r, S_r = _state(a, B, dtype, seed + 1)
    conv_k, S_k = conv_r.clone(), S_r.clone()
    if corrupt:
        corrupt(conv_k, S_k)
    gen = torch.Generator().manual_seed(seed + 2)
    worst = {"out": 0.0, "conv": 0.0, "S": 0.0}
    for _ in range(steps):
        proj = torch.randn(B, _width(a), generator=gen).to(DEVICE, dtype)
        ref = _ref_step(a, w, proj, conv_r, S_r)
        got = _kernel_step(a, w, proj, conv_k, S_k, block_v, num_warps)
        assert got.dtype == dtype and got.shape == ref.shape
        worst["out"] = max(worst["out"], _excess(got, ref, _kind(dtype)))
        worst["conv"] = max(worst["conv"], float((conv_k.double() - conv_r.double()).abs().max()))
        worst["S"] = max(worst["S"], _excess(S_k, S_r, "fp32" if dtype == torch.float32 else "S16"))
    return worst


def _assert_pass(worst):
    print(" ".join(f"{k}={v:.3g}" for k, v in worst.items()), end=" ")  # shown with -s
    assert worst["out"] <= 1 and worst["S"] <= 1 and worst["conv"] == 0, worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small"])
def test_kernel_matches_reference(geo, B, dtype):
    a = _args(geo)
    _assert_pass(_run_kernel(a, dtype, B, seed=B, steps=_steps(geo)))


@pytest.mark.parametrize("block_v", [None, 32, 16, 8])  # dv 32: 1, 2 and 4 programs per head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_dv_split(block_v, dtype):
    _assert_pass(_run_kernel(_args("small"), dtype, 2, seed=7, steps=_steps("small"),
                             block_v=block_v))


@pytest.mark.parametrize("block_v,num_warps", [(128, 16), (16, 2)])
def test_kernel_real_geometry_other_tiles(block_v, num_warps):
    # one program per head (the norm without a counter) and 8 per head with 2 warps
    _assert_pass(_run_kernel(_args("real"), torch.bfloat16, 1, seed=8, steps=_steps("real"),
                             block_v=block_v, num_warps=num_warps))


@pytest.mark.parametrize("geo", ["odd", "rep1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_other_geometries(geo, dtype):
    a = _args(geo)
    _assert_pass(_run_kernel(a, dtype, 2, seed=9, steps=_steps(geo), block_v=8))


def _bump_S(conv, S):
    S.mul_(1.02)  # the state 2% off


def _swap_conv(conv, S):
    conv[:] = conv.flip(-1)  # the window's columns in the wrong order


@pytest.mark.parametrize("corrupt", [_bump_S, _swap_conv], ids=["S", "conv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_negative_control_corrupted_state_fails(corrupt, dtype):
    worst = _run_kernel(_args("small"), dtype, 2, seed=3, steps=3, corrupt=corrupt)
    print(worst, end=" ")
    assert worst["out"] > 1 or worst["S"] > 1  # the tolerance catches a 2% state error


def test_counters_left_zero():
    _run_kernel(_args("small"), torch.bfloat16, 2, seed=5, steps=2, block_v=8)
    assert all(int(c.abs().sum()) == 0 for c in sync._COUNTERS.values())


# ===== the whole mixer: fused GEMV + kernel + out_proj vs gdn_mixer_ref =====


def _mixer_worst(a, w, geo, B, dtype, seed, kinds):
    """Worst _excess of (out, conv, S) over the geometry's steps, gdn_decode_fused against
    gdn_mixer_ref from the same random state; kinds: the _excess kind of each. Returns the worst
    fractions and the states (reference, fused) after the last step."""
    conv_r, S_r = _state(a, B, dtype, seed=seed)
    conv_k, S_k = conv_r.clone(), S_r.clone()
    gen = torch.Generator().manual_seed(seed + 1)
    worst = {"out": 0.0, "conv": 0.0, "S": 0.0}
    for _ in range(_steps(geo)):
        x = torch.randn(B, 1, a.hidden_size, generator=gen).to(DEVICE, dtype)
        ref = gdn.gdn_mixer_ref(x, w, conv_r, S_r, a)
        got = gdn.gdn_decode_fused(x, w, conv_k, S_k, a)
        assert got.shape == ref.shape == x.shape and got.dtype == dtype
        for name, (g, r) in {"out": (got, ref), "conv": (conv_k, conv_r), "S": (S_k, S_r)}.items():
            worst[name] = max(worst[name], _excess(g, r, kinds[name]))
    print(" ".join(f"{k}={v:.3g}" for k, v in worst.items()), end=" ")
    return worst, (conv_r, S_r), (conv_k, S_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small"])
def test_fused_mixer_matches_reference(geo, B, dtype):
    if geo == "real" and DEVICE == "cpu" and B == 2:
        pytest.skip("the kernel test covers it; the interpreter is slow at this size")
    a = _args(geo)
    w = _layer(a, dtype, seed=11)
    assert gdn.fuse_gdn_projections(w)
    fp32 = dtype == torch.float32
    kinds = {"out": "fp32" if fp32 else "loose", "conv": _kind(dtype),
             "S": "fp32" if fp32 else "S16"}
    worst, _, _ = _mixer_worst(a, w, geo, B, dtype, 12, kinds)
    assert max(worst.values()) <= 1, worst


def _kept_nvfp4(w: dict) -> dict:
    # qkv and z quantized and kept packed, as load_model keeps them from an NVFP4 checkpoint
    for name in gdn.PROJECTIONS[:2]:
        w[name] = nvfp4.Nvfp4Weight.of(*nvfp4.quantize(w[name].float().cpu())).to(DEVICE)
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("geo", ["real", "small"])
def test_fused_mixer_with_nvfp4_projections(geo, B, dtype):
    # the decode GEMV reads qkv | z packed (exact fp32 weights) with b | a as its bf16 tail; the
    # torch path dequantizes to the model dtype (load-time bits): fp32 as above; bf16 within the
    # full-mixer tolerance (2^-5 max|ref|) for the output, the conv state (it holds the
    # projection outputs, which differ by the weights' bf16 rounding, ~2^-9 of each weight) and
    # S (those differences enter S through k and v every step: measured 1.34 x 2^-7 max|S| on
    # the H200 at small / B 2, over the bf16-weight runs' S16 bound)
    if geo == "real" and DEVICE == "cpu" and B == 2:
        pytest.skip("the interpreter is slow at this size")
    a = _args(geo)
    w = _kept_nvfp4(_layer(a, dtype, seed=41))
    assert gdn.fuse_gdn_projections(w) and gdn.FUSED_NVFP4 in w and gdn.FUSED not in w
    kind = "fp32" if dtype == torch.float32 else "loose"
    worst, (conv_r, S_r), (conv_k, S_k) = _mixer_worst(
        a, w, geo, B, dtype, 42, {"out": kind, "conv": kind, "S": kind})
    assert max(worst.values()) <= 1, worst
    # negative control: every z block scale x4 moves the fused output out of tolerance
    bad = dict(w)
    q4 = w[gdn.FUSED_NVFP4]
    scale = q4.scale.clone()
    C = 2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads * \
        a.linear_value_head_dim
    scale[C:] = (scale[C:].float() * 4).clamp(max=448).to(scale.dtype)  # z's scales, x4
    bad[gdn.FUSED_NVFP4] = nvfp4.Nvfp4Weight(q4.packed, scale, q4.g)
    x = torch.randn(B, 1, a.hidden_size, generator=torch.Generator().manual_seed(44))
    x = x.to(DEVICE, dtype)
    ref = gdn.gdn_mixer_ref(x, w, conv_r.clone(), S_r.clone(), a)
    got = gdn.gdn_decode_fused(x, bad, conv_k.clone(), S_k.clone(), a)
    assert _excess(got, ref, kind) > 1


def test_dispatcher_picks_the_path():
    a = _args("small")
    w = _layer(a, torch.bfloat16, seed=21)
    gdn.fuse_gdn_projections(w)
    gen = torch.Generator().manual_seed(22)
    for T in (1, 3):
        x = torch.randn(2, T, a.hidden_size, generator=gen).to(DEVICE, torch.bfloat16)
        states = [_state(a, 2, torch.bfloat16, seed=23) for _ in range(2)]
        got = gdn.gdn_mixer(x, w, *states[0], a)
        fused = x.is_cuda and T == 1  # CPU tensors (interpreter) and prefill: the reference
        want = (gdn.gdn_decode_fused if fused else gdn.gdn_mixer_ref)(x, w, *states[1], a)
        assert torch.equal(got, want)
        assert all(torch.equal(s, t) for s, t in zip(states[0], states[1]))


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need the device")
def test_fused_step_replays_in_a_cuda_graph():
    a = _args("real")
    B, dtype = 2, torch.bfloat16
    w = _layer(a, dtype, seed=31)
    gdn.fuse_gdn_projections(w)
    conv_g, S_g = _state(a, B, dtype, seed=32)
    conv_e, S_e = conv_g.clone(), S_g.clone()
    x = torch.zeros(B, 1, a.hidden_size, device=DEVICE, dtype=dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) on scratch copies of the state
        gdn.gdn_mixer(x, w, conv_g.clone(), S_g.clone(), a)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gdn.gdn_mixer(x, w, conv_g, S_g, a)
    gen = torch.Generator().manual_seed(33)
    for _ in range(8):  # replays chain through the state and the counters, as decode does
        x.copy_(torch.randn(B, 1, a.hidden_size, generator=gen).to(DEVICE, dtype))
        graph.replay()
        want = gdn.gdn_decode_fused(x, w, conv_e, S_e, a)
        # the same kernels (no atomics on data): expected bit-identical; the tolerance only
        # allows cuBLAS picking another GEMV algorithm under capture
        assert _excess(y, want, "bf16") <= 1
        assert _excess(conv_g, conv_e, "bf16") <= 1 and _excess(S_g, S_e, "S16") <= 1
    print(f"graph == eager: {torch.equal(y, want) and torch.equal(S_g, S_e)}", end=" ")
    assert all(int(c.abs().sum()) == 0 for c in sync._COUNTERS.values())
