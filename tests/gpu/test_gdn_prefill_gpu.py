"""The GDN chunked prefill's scan kernel (ftchat/kernels/gdn_prefill.py, dispatched from
gdn.delta_rule_block) against the torch code it replaces.

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_gdn_prefill_gpu.py
    on CPU, Triton interpreter:  TRITON_INTERPRET=1 FTCHAT_TEST_DEVICE=cpu \\
                                 pytest -m gpu tests/gpu/test_gdn_prefill_gpu.py
The dispatcher's choice (`gdn._prefill_kernel`) is patched on where a test needs the kernel path
(the interpreter's CPU tensors included); the reference is the same code with it off, so both
arms share everything but the scan: the padding, q / k / v, the decay, L, the solve and
tril(q kᵀ) * decay (formed in torch on both paths, the same ops).
The real geometry (48 heads, 1,024 tokens and more) runs on CUDA only (minutes in the
interpreter); the interpreter runs the real head dims (128) with fewer heads and tokens.

Tolerances (`_excess` of test_gdn_decode_gpu):
  * rule output and final state, fp32: |got - ref| <= 1e-5 |ref| + 1e-5 max|ref|. Both arms
    compute the same sums in fp32; only the order differs (the kernel's tiles vs cuBLAS / the
    CPU BLAS) and, on CUDA, the dots' input precision: "ieee" is fp32 FMA, "tf32x3" splits each
    operand into two TF32 parts (~2^-22 relative per product, next to fp32's 2^-24). The scan
    does not amplify the rounding: e^g <= 1, |k| = 1, 0 < beta < 1 keep S bounded, and the
    state error after a chunk is the chunk's rounding plus the decayed earlier error. Measured in
    the interpreter: <= 0.023 of the tolerance (~2e-7 of max|ref|) for T up to 1,061 and every
    geometry; against an fp64 run of the torch code the kernel's error is the torch fp32 path's
    own (~2e-7 to 6e-6 of max|ref|). `test_tf32x3_rounding_model` runs the kernel's algorithm in
    torch with tf32x3's operand split emulated: <= 0.024 of the tolerance (plain TF32: 57-71x
    over it, the control). On CUDA each test prints its figures with -s.
  * the whole mixer (gdn_mixer_ref, tiny model): fp32 as above (measured <= 0.015); bf16 output
    within 2^-7 max|ref| (the rule's ~1e-7 differences can flip the bf16 rounding of a few o
    values by one ulp, 2^-8 relative, which the gated norm and out_proj spread over a row;
    measured: identical); the states are the same sums in both dtypes (q, k, v are identical on
    both arms): S fp32 as above, conv exact.
  * prefill then decode: the decode steps after a kernel prefill against the same steps after
    the torch prefill, fp32 as above (measured <= 0.054). With the kernel on, the decode is the
    fused decode kernel (gdn_decode_fused), so its own ~1e-6 differences are in it too.
  * memory: the kernel path's peak above its inputs (delta_rule_block, no padding) is
    `_kernel_rule_bytes` at most (the torch path's chunk states, q e^gamma, their product and
    k's decayed copy are never allocated; the decay is not alive during the solve), and at
    least the chunk states below the torch path's own peak. Measured on the CPU (interpreter):
    exactly the formula. On CUDA up to 15% over it is allowed: the CUDA solve may allocate
    copies the CPU one does not (unmeasured here).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from ftchat.kernels import gdn_prefill as gp
from ftchat.kernels.config import KernelConfig
from ftchat.model import gdn
from tests.gpu.test_gdn_decode_gpu import (
    DEVICE,
    _args,
    _excess,
    _layer,
    _state,
    _triton,  # noqa: F401 (autouse)
)
from tests.test_gdn_fused_projections import _args as _tiny_args

pytestmark = pytest.mark.gpu
CUDA = DEVICE != "cpu"
C = gdn.CHUNK
PRECISIONS = ["ieee", "tf32x3"] if CUDA else ["tf32x3"]  # the interpreter ignores the setting


@pytest.fixture
def kernel_on(monkeypatch):
    """`with kernel_on(True)`: delta_rule_block takes the kernel path on DEVICE (the interpreter's
    CPU tensors included); `kernel_on(False)`: the torch path."""
    @contextmanager
    def switch(on: bool):
        with monkeypatch.context() as m:
            m.setattr(gdn, "_prefill_kernel",
                      lambda t, dk, dv, kc: on and gp.gdn_prefill_supported(dk, dv))
            yield
    return switch


def _rule_inputs(B, H, T, dk, dv, seed, decay=0.3, device=DEVICE):
    """q, k, v, g, beta as gdn_core_block makes them (unit-norm k, q / sqrt(dk), g < 0, beta in
    (0, 1)) and a non-zero initial state S."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, dk, generator=gen), dim=-1) / dk**0.5
    k = F.normalize(torch.randn(B, H, T, dk, generator=gen), dim=-1)
    v = torch.randn(B, H, T, dv, generator=gen)
    g = -torch.rand(B, H, T, generator=gen) * decay
    beta = torch.rand(B, H, T, generator=gen)
    S = torch.randn(B, H, dk, dv, generator=gen) * 0.3
    return [t.to(device) for t in (q, k, v, g, beta, S)]


def _both(kernel_on, inputs, sub=None):
    """delta_rule_chunked on the torch and the kernel path from the same state:
    [(out, S) torch, (out, S) kernel]."""
    q, k, v, g, beta, S0 = inputs
    res = []
    for on in (False, True):
        S = S0.clone()
        with kernel_on(on):
            res.append((gdn.delta_rule_chunked(q, k, v, g, beta, S, sub=sub), S))
    return res


# ===== the rule: kernel vs the torch path =====

SMALL = [  # (B, H, T, dk, dv, decay, sub)
    (1, 2, 64, 16, 16, 0.3, None),  # one chunk
    (2, 3, 200, 16, 16, 0.3, None),  # padded to 256
    (2, 2, 3 * 128 + 37, 32, 64, 0.3, 128),  # several sub-blocks and a padded one
    (1, 2, 130, 64, 16, 5.0, None),  # dk != dv; strong decay: exponents reach the floor
    (2, 1, 96, 16, 32, 0.0, None),  # no decay (g = 0): the state only accumulates
    (1, 2, 200, 128, 128, 0.3, None),  # the real head dims
    (2, 1, 1024 + 37, 128, 128, 0.3, 512),  # the real head dims over sub-blocks
]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("B, H, T, dk, dv, decay, sub", SMALL)
def test_kernel_matches_the_torch_rule(B, H, T, dk, dv, decay, sub, precision, kernel_on,
                                       monkeypatch):
    monkeypatch.setattr(gp, "PRECISION", precision)
    inputs = _rule_inputs(B, H, T, dk, dv, seed=T + dk, decay=decay)
    (ref, S_ref), (got, S_got) = _both(kernel_on, inputs, sub=sub)
    assert got.shape == ref.shape == (B, H, T, dv)
    worst = {"out": _excess(got, ref, "fp32"), "S": _excess(S_got, S_ref, "fp32")}
    # context: both against the torch code in fp64 on the CPU
    q, k, v, g, beta, S0 = (t.cpu().double() for t in inputs)
    S64 = S0.clone()
    r64 = gdn.delta_rule_chunked(q, k, v, g, beta, S64, sub=sub)
    rel = lambda a, b: float((a.cpu().double() - b).abs().max() / b.abs().max())
    print(f"excess {worst}; vs fp64: kernel {rel(got, r64):.2g} / {rel(S_got, S64):.2g}, "
          f"torch {rel(ref, r64):.2g} / {rel(S_ref, S64):.2g}", end=" ")
    assert max(worst.values()) <= 1, worst


@pytest.mark.skipif(not CUDA, reason="48 heads x 8,192 tokens take minutes in the interpreter; "
                                     "the real head dims run above")
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("B, T", [(1, 1024), (2, 1000), (1, 8192)])
def test_kernel_real_geometry(B, T, precision, kernel_on, monkeypatch):
    monkeypatch.setattr(gp, "PRECISION", precision)
    inputs = _rule_inputs(B, 48, T, 128, 128, seed=T)
    (ref, S_ref), (got, S_got) = _both(kernel_on, inputs)
    worst = {"out": _excess(got, ref, "fp32"), "S": _excess(S_got, S_ref, "fp32")}
    print(worst, end=" ")
    assert max(worst.values()) <= 1, worst


@pytest.mark.parametrize("block_v, num_warps", [(16, 4), (32, 2), (64, 8)])
def test_kernel_dv_tiles(block_v, num_warps, kernel_on):
    """Other dv splits: 4, 2 and 1 programs per head of dv 64, each its own columns of S."""
    q, k, v, g, beta, S = _rule_inputs(2, 2, 150, 32, 64, seed=5)
    S_ref, S_got = S.clone(), S.clone()
    with kernel_on(False):
        ref = gdn.delta_rule_chunked(q, k, v, g, beta, S_ref)
    pad = (-150) % C
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    gamma, A, X = _torch_part(q, k, v, *(F.pad(t, (0, pad)) for t in (g, beta)))
    got = gp.chunk_scan(q, k, gamma.flatten(2, 3), A, X, S_got, block_v=block_v,
                        num_warps=num_warps)[:, :, :150]
    assert _excess(got, ref, "fp32") <= 1 and _excess(S_got, S_ref, "fp32") <= 1


def _torch_part(q, k, v, g, beta):
    """The torch part of delta_rule_block on the kernel path (T a multiple of C): gamma
    [B, H, n, C], A = tril(q kᵀ) * decay [B, H, n, C, C] and the solve's [U | Wk]
    [B, H, n, C, dv + dk]."""
    n = k.shape[2] // C
    q, k, v = (t.unflatten(2, (n, C)) for t in (q, k, v))
    g, beta = (t.unflatten(2, (n, C)) for t in (g, beta))
    gamma = g.cumsum(-1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).tril().clamp(min=gdn.EXP_FLOOR).exp().tril()
    kb = k * beta[..., None]
    L = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([v * beta[..., None], kb * gamma.clamp(min=gdn.EXP_FLOOR).exp()[..., None]], -1)
    A = (q @ k.transpose(-1, -2)) * decay
    return gamma, A, torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)


@pytest.mark.parametrize("layout", ["stacked", "transposed"])
def test_strided_state_in_place(layout, kernel_on):
    """S a strided view (one layer of a stacked state; or dk, dv transposed in memory): read and
    written through its strides, nothing around it touched."""
    q, k, v, g, beta, S0 = _rule_inputs(2, 3, 100, 16, 32, seed=6)
    if layout == "stacked":
        big = torch.randn(2, 3, 3, 16, 32, device=DEVICE)  # [B, layers, H, dk, dv]
        S = big[:, 1]
    else:
        big = torch.randn(2, 3, 32, 16, device=DEVICE)
        S = big.transpose(-1, -2)
    assert not S.is_contiguous()
    around = big.clone()
    S.copy_(S0)
    S_ref = S0.clone()
    with kernel_on(False):
        ref = gdn.delta_rule_chunked(q, k, v, g, beta, S_ref)
    with kernel_on(True):
        got = gdn.delta_rule_chunked(q, k, v, g, beta, S)
    assert _excess(got, ref, "fp32") <= 1 and _excess(S, S_ref, "fp32") <= 1
    if layout == "stacked":
        assert torch.equal(big[:, 0], around[:, 0]) and torch.equal(big[:, 2], around[:, 2])


def test_negative_control_state_off_fails(kernel_on):
    """The tolerance catches a 1% error in the initial state (one chunk: S keeps some of it)."""
    q, k, v, g, beta, S = _rule_inputs(1, 2, 64, 32, 32, seed=7, decay=0.05)
    S_ref, S_bad = S.clone(), S * 1.01
    with kernel_on(False):
        ref = gdn.delta_rule_chunked(q, k, v, g, beta, S_ref)
    with kernel_on(True):
        got = gdn.delta_rule_chunked(q, k, v, g, beta, S_bad)
    worst = (_excess(got, ref, "fp32"), _excess(S_bad, S_ref, "fp32"))
    print(worst, end=" ")
    assert min(worst) > 1, worst


def test_dispatch():
    """The kernel path only where the config runs fused kernels (CUDA + Triton) and the dims are
    supported; the CPU path is the torch code (tests/test_gdn_subblocks.py pins its bits)."""
    t = torch.empty(1, device=DEVICE)
    kc = KernelConfig()
    assert gdn._prefill_kernel(t, 16, 16, kc) == CUDA
    assert not gdn._prefill_kernel(t, 8, 16, kc) and not gdn._prefill_kernel(t, 16, 24, kc)
    assert not gdn._prefill_kernel(t, 128, 128, KernelConfig(fused=False))


# ===== tf32x3: its rounding modelled in torch (runs anywhere) =====


def _tf32(x, nearest: bool):
    """x rounded to TF32 (10 mantissa bits): to nearest, ties away (cvt.rna), or truncated (what
    the tensor cores do to an fp32 operand)."""
    bits = x.float().view(torch.int32)
    if nearest:
        bits = bits + 0x1000
    return (bits & -8192).view(torch.float32)


def _dot_tf32x3(a, b):
    """a @ b as Triton's tf32x3: a = big + small, each TF32; big b + big small + small big, the
    small x small term dropped; the products exact, summed in fp64 and rounded to fp32."""
    ab, bb = _tf32(a, True), _tf32(b, True)
    asm, bsm = _tf32(a - ab, False), _tf32(b - bb, False)
    return (ab.double() @ bb.double() + ab.double() @ bsm.double()
            + asm.double() @ bb.double()).float()


def _scan_model(q, k, gamma, A, X, S, dot):
    """The kernel's algorithm in torch, chunk by chunk, every product through dot: the rule's
    output [B, H, T', dv]; S advanced in place."""
    n, W = X.shape[2], X.shape[-1]
    dk = k.shape[-1]
    qs, ks = (t.unflatten(2, (n, C)) for t in (q, k))
    ex = lambda x: x.clamp(min=gdn.EXP_FLOOR).exp()
    out = []
    for i in range(n):
        qi, ki, gam = qs[:, :, i], ks[:, :, i], gamma[:, :, i]
        U, Wk = X[:, :, i].split([W - dk, dk], -1)
        last = gam[..., -1:]
        vp = U - dot(Wk, S)
        out.append(dot(qi * ex(gam)[..., None], S) + dot(A[:, :, i], vp))
        S.mul_(ex(last)[..., None]).add_(dot((ki * ex(last - gam)[..., None]).transpose(-1, -2),
                                              vp))
    return torch.cat(out, 2)


@pytest.mark.parametrize("dk, dv, T", [(128, 128, 512), (16, 16, 256)])
def test_tf32x3_rounding_model(dk, dv, T):
    """The kernel's algorithm with tf32x3 operands (emulated, CPU) against the torch rule: within
    the tolerance; the same with plain TF32 (one truncated product) is not (the control: why the
    kernel does not use it)."""
    q, k, v, g, beta, S0 = (t.cpu() for t in _rule_inputs(1, 2, T, dk, dv, seed=9, device="cpu"))
    S_ref = S0.clone()
    ref = gdn.delta_rule_chunked(q, k, v, g, beta, S_ref)
    gamma, A, X = _torch_part(q, k, v, g, beta)
    res = {}
    for name, dot in {"fp32": torch.matmul, "tf32x3": _dot_tf32x3,
                      "tf32": lambda a, b: _tf32(a, False) @ _tf32(b, False)}.items():
        S = S0.clone()
        o = _scan_model(q, k, gamma, A, X, S, dot)
        res[name] = max(_excess(o, ref, "fp32"), _excess(S, S_ref, "fp32"))
    print(res, end=" ")
    assert res["fp32"] <= 0.1 and res["tf32x3"] <= 0.2 and res["tf32"] > 1


# ===== the whole mixer and the decode after it =====


def _mixer_args(geo):
    return _tiny_args() if geo == "tiny" else _args(geo)


MIXERS = [("tiny", 1, 200, torch.float32), ("tiny", 2, 3 * 128 + 37, torch.float32),
          ("tiny", 2, 200, torch.bfloat16), ("small", 1, 130, torch.bfloat16)]


@pytest.mark.parametrize("geo, B, T, dtype", MIXERS, ids=lambda p: str(p))
def test_mixer_prefill(geo, B, T, dtype, kernel_on, monkeypatch):
    """gdn_mixer_ref of a prefill with the kernel against the same without (several sub-blocks
    when T > 128: GDN_SUBBLOCK patched to 128)."""
    monkeypatch.setattr(gdn, "GDN_SUBBLOCK", 128)
    a = _mixer_args(geo)
    w = _layer(a, dtype, seed=T)
    x = torch.randn(B, T, a.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(DEVICE, dtype)
    states = [_state(a, B, dtype, seed=2) for _ in range(2)]
    outs = []
    for on, (conv, S) in zip((False, True), states):
        with kernel_on(on):
            outs.append(gdn.gdn_mixer_ref(x, w, conv, S, a))
    (conv_r, S_r), (conv_k, S_k) = states
    fp32 = dtype == torch.float32
    worst = {"out": _excess(outs[1], outs[0], "fp32" if fp32 else "S16"),
             "S": _excess(S_k, S_r, "fp32")}
    print(worst, end=" ")
    assert max(worst.values()) <= 1, worst
    assert torch.equal(conv_k, conv_r)


@pytest.mark.parametrize("geo", ["tiny", "small"])
def test_prefill_then_decode(geo, kernel_on, monkeypatch):
    """A kernel prefill (T = 200: padded, two sub-blocks of 128) then 6 decode steps (gdn_mixer:
    on CUDA the fused decode kernel) against the torch prefill and torch steps, fp32; and the
    prefill's state against one longer torch prefill's continuation within the rule's 1e-5."""
    monkeypatch.setattr(gdn, "GDN_SUBBLOCK", 128)
    a = _mixer_args(geo)
    w = _layer(a, torch.float32, seed=3)
    T, steps = 200, 6
    x = torch.randn(2, T + steps, a.hidden_size, generator=torch.Generator().manual_seed(4))
    x = x.to(DEVICE)
    runs = []
    for on in (False, True):
        conv, S = _state(a, 2, torch.float32, seed=5)
        with kernel_on(on):
            pre = gdn.gdn_mixer(x[:, :T], w, conv, S, a)
            dec = [gdn.gdn_mixer(x[:, T + i:T + i + 1], w, conv, S, a) for i in range(steps)]
        runs.append((pre, torch.cat(dec, 1), conv, S))
    (pre_r, dec_r, conv_r, S_r), (pre_k, dec_k, conv_k, S_k) = runs
    worst = {"prefill": _excess(pre_k, pre_r, "fp32"), "decode": _excess(dec_k, dec_r, "fp32"),
             "S": _excess(S_k, S_r, "fp32"), "conv": _excess(conv_k, conv_r, "fp32")}
    print(worst, end=" ")
    assert max(worst.values()) <= 1, worst
    # the decode continues the sequence: one torch prefill of all T + steps tokens
    conv, S = _state(a, 2, torch.float32, seed=5)
    with kernel_on(False):
        whole = gdn.gdn_mixer_ref(x, w, conv, S, a)
    tail = whole[:, T:]
    assert (dec_k - tail).abs().max() <= 1e-5 * max(1.0, float(tail.abs().max()))


# ===== memory =====


def _kernel_rule_bytes(B, H, t, dk, dv):
    """delta_rule_block's peak on the kernel path above its inputs (t a multiple of C), the
    max over its steps, per token and head in fp32 values: gamma and e^gamma (2) throughout;
    decay, kb kᵀ and their product with kb (3 C + dk); then L, kb and rhs (C + 2 dk + dv); the
    solve: L, rhs and its output (C + 2 (dv + dk)); the solve's output X with the decay formed
    again, q kᵀ (then A, in place) (2 C + dv + dk); the kernel: X, A and o (C + 2 dv + dk)."""
    per = 2 + max(3 * C + dk, C + 2 * dk + dv, C + 2 * (dv + dk), 2 * C + dv + dk,
                  C + 2 * dv + dk)
    return 4 * B * H * t * per


def _chunk_states_bytes(B, H, t, dk, dv):
    return 4 * B * H * (t // C) * dk * dv


def _peak(fn) -> int:
    """The most bytes fn() holds at once above what was alive at its start: the CUDA allocator's
    peak, or (CPU) the profiler's allocation events (tests/test_prefill_memory.py)."""
    if not CUDA:
        from tests.test_prefill_memory import peak_bytes
        return peak_bytes(fn)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("B, H, t, dk, dv", [(1, 4, 256, 128, 128), (2, 3, 128, 16, 16)] + (
    [(1, 48, 1024, 128, 128)] if CUDA else []))
def test_kernel_path_memory(B, H, t, dk, dv, kernel_on):
    """The kernel path holds at most _kernel_rule_bytes (no chunk states) and at least 99 % of
    the chunk states less than the torch path (the two peaks fall at different steps, whose
    small tensors differ by a few KB: 1 KB and 12 KB on the H200)."""
    q, k, v, g, beta, S = _rule_inputs(B, H, t, dk, dv, seed=11)
    peaks = {}
    for on in (False, True):
        with kernel_on(on):
            s = S.clone()
            gdn.delta_rule_block(q, k, v, g, beta, s)  # warm-up (compile, cuBLAS workspace)
            peaks[on] = _peak(lambda s=s: gdn.delta_rule_block(q, k, v, g, beta, s))
    plan = _kernel_rule_bytes(B, H, t, dk, dv)
    states = _chunk_states_bytes(B, H, t, dk, dv)
    print(f"peak torch {peaks[False] / 2**20:.2f} MiB, kernel {peaks[True] / 2**20:.2f} MiB, "
          f"formula {plan / 2**20:.2f} MiB", end=" ")
    assert peaks[True] <= plan * (1.15 if CUDA else 1)  # CUDA: module docstring
    assert peaks[True] + 0.99 * states <= peaks[False]
