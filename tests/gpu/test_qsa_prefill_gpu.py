"""The CUDA sparse prefill attention (qsa.prefill_attention_fused: the selection of
qsa.select_blocks_rows, then the decode's split attention and gated combine of
ftchat/kernels/qsa_attention.py with a chunk's queries as its rows, reading the selected K/V from
the cache row) against the torch prefill (qsa.prefill_attention times sigmoid(gate)),
docs/model.md 4.2.

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_qsa_prefill_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_qsa_prefill_gpu.py
In the interpreter (CPU tensors) the dispatcher's choice (`qsa.prefill_kernel`) is patched on
where a test needs the kernel path; the real geometry runs 2 queries there (~5 s each), 300 on
CUDA.

Inputs: test_qsa_decode_gpu's geometries (small, odd, real) and caches (random K, V, raw index
keys and the k̄ pooled from them; slots past the context NaN, so a read of one shows), random
q, gate and iq for the last T positions of the context, or for every position from 0 (the early
queries see fewer complete blocks than the top-k: invalid block slots). Query chunks: the
kernel path's own (`prefill_query_chunk(kernel=True)`) and irregular ones (T not a multiple).

Tolerances:
  * o * sigmoid(gate): test_qsa_decode_gpu's "rows" rule (fp32 1e-5 relative; bf16 8 ulps of
    max(|ref|, rms of the query's row)). The arithmetic is the decode's: attend_rows is
    `attend` with grouped heads (scores rounded to the model dtype, times 1/sqrt(hd) rounded,
    fp32 softmax), the FP8 K/V dequantized alike; the reference rounds each probability to the
    model dtype before P.V and the kernel does not, which adds up to errors of a row's rms
    size, not of each element's (decode tests: measured <= 3 ulps). The gate's sigmoid and the
    product are rounded at the same points.
  * selection: identical. Both paths run select_blocks_rows on the same query chunks (the
    reference is run with the kernel path's chunk size: equal shapes, so equal block scores
    even where a GPU matmul's summation order could depend on the chunk).
  * model logits (tiny model, bf16, one attention layer of six): |got - ref| <= 2^-4 max|ref|.
    The attention output's few-ulp errors (2^-9 relative at a row's rms) pass through o_proj,
    the hyper-connection write and three more layers (two GDN, the MoE router, whose top-k can
    flip at a near tie and move a token's output by an expert's share) and lm_head. Measured
    in the interpreter: most positions within 2^-8 max|ref| (about one bf16 ulp of the
    largest logit), the worst 2^-5.3 (0.42 of the tolerance). A control: the kernel path missing
    one selected token of 11 per query (the first block's first) exceeds it.
  * memory (CUDA): one attention prefill call's max_memory_allocated increase <= the VRAM plan's
    attention term and within 2x of it; control: the gather path (`qsa.prefill_kernel` off)
    exceeds the term.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from ftchat.engine import load_model, prefill, resident_backend
from ftchat.kernels.config import KernelConfig
from ftchat.model import qsa
from ftchat.model.qwen4_exp_memory import attention_prefill_bytes
from ftchat.model.state import DecodeState
from tests.gpu.test_qsa_decode_gpu import (DEVICE, DTYPES, _args, _cache, _clone, _excess, _kind,
                                           _layer, _triton)  # noqa: F401 (autouse)
from tests.gpu.test_qsa_kv_fp8_gpu import _fp8

pytestmark = pytest.mark.gpu
LOGIT_TOL = 2**-4  # of max|ref| (module docstring)
KV = pytest.mark.parametrize("kv", ["auto", "fp8"])


def _kernel_path_anywhere(x, kv_len, a, kc) -> bool:
    # qsa.prefill_kernel without its device check (the interpreter's CPU tensors included)
    return (x.shape[1] > 1 and qsa.sparse_prefill(kv_len, a)
            and qsa.prefill_kernel_supported(a, x.dtype, x.shape[0]))


@pytest.fixture
def kernel_path(monkeypatch):
    """The dispatcher's conditions for the kernel path met on DEVICE (the interpreter's CPU
    tensors included)."""
    if DEVICE == "cpu":
        monkeypatch.setattr(qsa, "prefill_kernel", _kernel_path_anywhere)


class _Selections:
    """Wraps qsa.select_blocks_rows and keeps every (idx, ok) it returns, in call order."""

    def __init__(self, fn):
        self.fn, self.out = fn, []

    def __call__(self, *args):
        res = self.fn(*args)
        self.out.append(res)
        return res


# ===== the attention against the torch prefill =====


def _inputs(a, kv_len: int, T: int, dtype, kv: str, seed: int):
    """Layer weights, a cache holding kv_len tokens (capacity kv_len + 5), and q [1, T, Hq, hd],
    gate [1, T, Hq*hd], iq [1, T, Hi, di] at the positions pos [1, T] = the last T."""
    w = _layer(a, dtype, seed)
    c = _cache(a, [kv_len], kv_len + 5, w, dtype, seed + 1)
    c = _fp8(c) if kv == "fp8" else c
    gen = torch.Generator().manual_seed(seed + 2)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE, dtype)  # noqa: E731
    Hq, hd = a.num_attention_heads, a.head_dim
    q, gate = rnd(1, T, Hq, hd), rnd(1, T, Hq * hd)
    iq = rnd(1, T, a.indexer_n_heads, a.indexer_head_dim)
    pos = torch.arange(kv_len - T, kv_len, device=DEVICE)[None]
    return w, c, q, gate, iq, pos


def _compare(a, kv_len, T, dtype, kv, seed, monkeypatch, tq=None) -> float:
    """_excess of the kernel path's o * sigmoid(gate) against the torch prefill's, query chunks
    of tq (None: the kernel path's), after checking both selected the same tokens."""
    w, c, q, gate, iq, pos = _inputs(a, kv_len, T, dtype, kv, seed)
    chunk = qsa.prefill_query_chunk
    size = (lambda T_, kv_, a_, *_: chunk(T_, kv_, a_, "cuda", True)) if tq is None else (
        lambda T_, *_: min(T_, tq))
    sels, select = {}, qsa.select_blocks_rows
    with monkeypatch.context() as m:
        m.setattr(qsa, "prefill_query_chunk", size)  # both paths: the same chunks
        for name in ("ref", "got"):
            sels[name] = _Selections(select)
            m.setattr(qsa, "select_blocks_rows", sels[name])
            if name == "ref":
                ref = qsa.prefill_attention(q, iq, c, pos, kv_len, w, a) * torch.sigmoid(gate)
            else:
                got = qsa.prefill_attention_fused(q, gate, iq, c, pos, kv_len, a)
    assert len(sels["got"].out) == len(sels["ref"].out) >= (1 if tq is None else -(-T // tq))
    for (gi, go), (ri, ro) in zip(sels["got"].out, sels["ref"].out):
        assert torch.equal(gi, ri) and torch.equal(go, ro)
    assert got.shape == ref.shape == (1, T, a.num_attention_heads * a.head_dim)
    assert got.dtype == dtype
    return _excess(got[0], ref[0], _kind(dtype, "rows"))


def _cases(a) -> list[tuple[int, int, int | None]]:
    """(kv_len, T, tq): every position from 0 (early queries below the budget) in chunks of 7;
    the last 13 of a long context in the kernel's chunks and in chunks of 5; the last 5 of the
    shortest sparse context (one block more than the top-k)."""
    r, top = a.indexer_compress_ratio, a.indexer_budget // a.indexer_compress_ratio
    return [(30, 30, 7), (120, 13, None), (120, 13, 5), ((top + 1) * r, 5, None)]


@KV
@DTYPES
@pytest.mark.parametrize("geo", ["small", "odd"])
def test_prefill_attention_matches_reference(geo, dtype, kv, monkeypatch):
    a = _args(geo)
    worst = {}
    for i, (kv_len, T, tq) in enumerate(_cases(a)):
        assert qsa.sparse_prefill(kv_len, a)
        worst[f"L{kv_len} T{T} tq{tq}"] = _compare(a, kv_len, T, dtype, kv, 10 * i, monkeypatch, tq)
    print(" ".join(f"{k}={v:.3g}" for k, v in worst.items()), end=" ")  # shown with -s
    assert max(worst.values()) <= 1, worst


@KV
def test_prefill_attention_at_the_real_geometry(kv, monkeypatch):
    """flash-next's attention (Hq 24, Hkv 2, hd 256, Hi 4, di 128, budget 2048) at a 12K
    context, bf16: 2051 selected tokens a query. CUDA: 300 queries, in the kernel's chunks and
    in chunks of 97; the interpreter: 2 queries (~5 s each)."""
    a = _args("real")
    kv_len = 12 * 1024 + 3  # an open block at the end
    T, chunks = (2, (None,)) if DEVICE == "cpu" else (300, (None, 97))
    worst = {f"tq{tq}": _compare(a, kv_len, T, torch.bfloat16, kv, 40, monkeypatch, tq)
             for tq in chunks}
    print(" ".join(f"{k}={v:.3g}" for k, v in worst.items()), end=" ")
    assert max(worst.values()) <= 1, worst


def _drop_first_token(monkeypatch):
    """The kernel path with every query's first selected slot marked invalid."""
    attention = qsa.qsa_attention

    def dropped(*args, ok, **kw):
        ok = ok.clone()
        ok[:, 0] = False
        return attention(*args, ok=ok, **kw)

    monkeypatch.setattr(qsa, "qsa_attention", dropped)


def test_negative_control_a_missing_token_is_caught(monkeypatch):
    a = _args("small")
    kv_len, T, tq = _cases(a)[1]
    _drop_first_token(monkeypatch)
    e = _compare(a, kv_len, T, torch.bfloat16, "auto", 0, monkeypatch, tq)
    print(f"excess={e:.3g}", end=" ")
    assert e > 1


# ===== the dispatcher =====


def test_dispatcher_picks_the_prefill_path(kernel_path, monkeypatch):
    """The kernel path for one row past the budget; the torch path for a short context (every
    block selected), two rows and (CUDA) the fused kernels off."""
    a = _args("small")
    dtype = torch.bfloat16
    w = _layer(a, dtype, seed=60)
    calls = []
    fused = qsa.prefill_attention_fused
    monkeypatch.setattr(qsa, "prefill_attention_fused",
                        lambda *args, **kw: calls.append(1) or fused(*args, **kw))
    gen = torch.Generator().manual_seed(61)
    cases = [(1, 40, True, True), (1, 11, False, True), (2, 40, False, True)]
    if DEVICE == "cuda":
        cases.append((1, 40, False, False))
    for B, kv_len, want, fused_on in cases:
        T = 6
        pos = torch.arange(kv_len - T, kv_len, device=DEVICE)[None].expand(B, T)
        x = torch.randn(B, T, a.hidden_size, generator=gen).to(DEVICE, dtype)
        c = _cache(a, [kv_len - T] * B, kv_len + 2, w, dtype, seed=62)
        calls.clear()
        y = qsa.attention_mixer(x, w, c, pos, kv_len, a, kc=KernelConfig(fused=fused_on))
        assert y.shape == x.shape and not y.isnan().any()
        assert bool(calls) == want, (B, kv_len, fused_on)


# ===== the whole model =====


def _logits(m, ids: Tensor, spans: list[int]) -> Tensor:
    """Logits [len(ids), V] of ids prefilled in engine chunks of `spans` (none of length 1: the
    decode path)."""
    st = DecodeState.create(m.args, 1, len(ids) + 1, DEVICE, torch.bfloat16)
    ex, out, p = resident_backend(m), [], 0
    for n in spans:
        out.append(prefill(m, st, 0, ids[p : p + n], p, ex))
        p += n
    return torch.cat(out).float()


@pytest.fixture(scope="module")
def tiny(tiny_bf16):
    return load_model(tiny_bf16, DEVICE, torch.bfloat16)


def _model_excess(tiny, monkeypatch, control: bool = False) -> float:
    ids = torch.randint(0, 500, (100,), generator=torch.Generator().manual_seed(11))
    spans = [37, 51, 12]  # every chunk past the budget (8 + 3): the sparse prefill
    with monkeypatch.context() as m:
        m.setattr(qsa, "prefill_kernel", lambda *args: False)  # the torch path
        ref = _logits(tiny, ids, spans)
    calls = []
    fused = qsa.prefill_attention_fused
    monkeypatch.setattr(qsa, "prefill_attention_fused",
                        lambda *args, **kw: calls.append(1) or fused(*args, **kw))
    if control:
        _drop_first_token(monkeypatch)
    got = _logits(tiny, ids, spans)
    assert len(calls) == len(spans)  # the one attention layer, each chunk
    return float((got - ref).abs().max() / (LOGIT_TOL * ref.abs().max()))


def test_model_prefill_logits_match_the_torch_path(tiny, kernel_path, monkeypatch):
    e = _model_excess(tiny, monkeypatch)
    print(f"excess={e:.3g}", end=" ")
    assert e <= 1


def test_model_negative_control_a_missing_token_is_caught(tiny, kernel_path, monkeypatch):
    e = _model_excess(tiny, monkeypatch, control=True)
    print(f"excess={e:.3g}", end=" ")
    assert e > 1


# ===== memory =====


def _attention_peak(a, w, c, x, pos, kv_len) -> int:
    """max_memory_allocated's increase over one attention_mixer call (after a warm-up call on
    a copy of the cache: compiles, cuBLAS's workspace)."""
    qsa.attention_mixer(x, w, _clone(c), pos, kv_len, a)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = qsa.attention_mixer(x, w, c, pos, kv_len, a)
    torch.cuda.synchronize()
    del y
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA memory statistics need the device")
@KV
def test_prefill_attention_memory_within_the_plan(kv, monkeypatch):
    """A 1,024-token prefill call at a 16K context, flash-next's attention in bf16."""
    a = _args("real")
    dtype, L, T = torch.bfloat16, 16384, 1024
    w = _layer(a, dtype, seed=80)
    c = _cache(a, [L - T], L, w, dtype, seed=81, empty=0.0)
    c = _fp8(c) if kv == "fp8" else c
    x = torch.randn(1, T, a.hidden_size, generator=torch.Generator().manual_seed(82))
    x = x.to(DEVICE, dtype)
    pos = torch.arange(L - T, L, device=DEVICE)[None]
    planned = attention_prefill_bytes(a, dtype.itemsize, T, L, True, kv == "fp8", dtype)
    measured = _attention_peak(a, w, _clone(c), x, pos, L)
    print(f"measured={measured / 2**20:.1f} MiB planned={planned / 2**20:.1f} MiB", end=" ")
    assert measured <= planned <= 2 * measured
    monkeypatch.setattr(qsa, "prefill_kernel", lambda *args: False)  # control: the gather path
    gathered = _attention_peak(a, w, _clone(c), x, pos, L)
    print(f"gather path={gathered / 2**20:.1f} MiB", end=" ")
    assert gathered > planned
