"""The VRAM plan's prefill terms against the peak bytes a prefill really holds, measured on the
CPU (ftchat/vram/plan.py `prefill_workspace`, ftchat/model/qwen4_exp_memory.py and
memory_common.py, docs/design.md 4.9).

The measurement: torch.profiler with profile_memory records every allocation and free of the
c10 CPU allocator (sizes, in order); the peak of their running sum is the most bytes the call
held above what was alive when it started. It sees every tensor torch allocates, a kernel's
internal ones included (matmul's reshaped copies, the solve's output); not what BLAS or oneDNN
allocate on their own (the CUDA counterpart, cuBLAS's workspace, is its own plan item). The
allocator's rounding and caching are not in it (the plan's allocator slack covers those).

(a) GDN: the plan's term covers gdn_mixer_ref's prefill peak, for T inside one sub-block and
    across several, and is within 1.2x of it; controls: with the sub-blocks off the peak grows
    past it (the plan relies on them), the plan of one sub-block's T falls short of a longer T,
    and the old term 16 T (2 Hk dk + 2 Hv dk) falls short of the unblocked prefill (the plan
    that ran out of memory on the H200).
(b) the whole prefill call (engine.prefill, every block of every layer, the CPU path) of the
    tiny model: the plan's workspace covers the peak and is within 2x of it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ftchat import engine
from ftchat.model import gdn, ple, qsa
from ftchat.model import qwen4_exp as q
from ftchat.model.memory_common import gdn_prefill_bytes
from ftchat.model.qwen4_exp_memory import attention_prefill_bytes, hc_mix_bytes, ple_block_bytes
from ftchat.model.state import DecodeState
from ftchat.model.synth_memory import synthetic_model
from ftchat.vram.plan import prefill_workspace
from tests.test_gdn_fused_projections import _args, _layer, _state

SUB = 128  # GDN_SUBBLOCK for these tests: small, so a short T spans several


def peak_bytes(fn) -> int:
    """The most bytes fn() holds at once above what was alive at its start (CPU)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def test_the_measurement_sees_every_allocation():
    def fn():
        a = torch.empty(1000, 1000)  # 4 MB
        b = torch.empty(2000, 1000)  # 8 MB: 12 MB at once
        del a
        c = torch.empty(500, 1000)  # 2 MB in a's place
        del b, c

    assert peak_bytes(fn) == 12_000_000
    L, B = torch.eye(64).repeat(250, 1, 1), torch.ones(250, 64, 64)
    # a kernel's output (allocated inside the op)
    assert peak_bytes(lambda: torch.linalg.solve_triangular(L, B, upper=False)) == 4_096_000


def _geometries():
    wide = dataclasses.replace(_args(), linear_num_key_heads=1, linear_num_value_heads=3,
                               linear_key_head_dim=128, linear_value_head_dim=128)
    return {"dk 16 (C x C terms lead)": _args(), "dk 128 (flash-next's head dims)": wide}


def _gdn_peak(a, w, T: int, dtype) -> int:
    x = torch.randn(1, T, a.hidden_size, generator=torch.Generator().manual_seed(T)).to(dtype)
    state = _state(a, 1, dtype, 3)
    return peak_bytes(lambda: gdn.gdn_mixer_ref(x, w, *state, a))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("geometry", list(_geometries()))
def test_plan_covers_the_gdn_prefill(geometry, dtype, monkeypatch):
    a = _geometries()[geometry]
    w = _layer(a, dtype, seed=1)
    Hk, Hv, dk, _ = gdn._dims(a)
    monkeypatch.setattr(gdn, "GDN_SUBBLOCK", SUB)
    for T in (100, SUB, 3 * SUB + 37, 8 * SUB + 5):
        measured = _gdn_peak(a, w, T, dtype)
        planned = gdn_prefill_bytes(a, dtype.itemsize, T, cuda=False)
        assert measured <= planned <= 1.2 * measured, (T, measured, planned)
        if T > SUB:  # controls
            assert gdn_prefill_bytes(a, dtype.itemsize, SUB, cuda=False) < measured
            with monkeypatch.context() as m:
                m.setattr(gdn, "GDN_SUBBLOCK", 1 << 20)
                unblocked = _gdn_peak(a, w, T, dtype)
            assert planned < unblocked
            assert 16 * T * (2 * Hk * dk + 2 * Hv * dk) < unblocked  # the old term


@pytest.mark.parametrize("T, L, kv, dense, sub", [(300, 512, "auto", "bf16", 1024),
                                                  (700, 2048, "fp8", "bf16", SUB),
                                                  (200, 200, "fp8", "nvfp4", SUB)])
def test_plan_covers_a_whole_prefill_call(T, L, kv, dense, sub, monkeypatch):
    """engine.prefill of the last T tokens of a prompt filling L (the attention at its widest),
    the tiny model in bf16 on the CPU: the plan's workspace (cuda False: the CPU paths) covers
    the peak, within 2x (the sparse attention's bound assumes a full query chunk at L)."""
    monkeypatch.setattr(gdn, "GDN_SUBBLOCK", sub)
    m = synthetic_model("tiny", None, "nvfp4-modelopt", "cpu", torch.bfloat16, dense=dense)
    a, fp8 = m.args, kv == "fp8"
    state = DecodeState.create(a, 1, L, "cpu", torch.bfloat16,
                               kv_dtype=torch.float8_e4m3fn if fp8 else None)
    experts = engine.resident_backend(m)
    ids = torch.randint(0, a.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    measured = peak_bytes(lambda: engine.prefill(m, state, 0, ids, L - T, experts,
                                                 logits_at=slice(-1, None)))
    planned = sum(prefill_workspace(a, m.layout, 2, T, L, False, dense == "nvfp4",
                                       fp8).values())
    assert measured <= planned <= 2 * measured, (measured, planned)


def _ple_call(T: int, dtype=torch.bfloat16):
    """(args, a fresh decode state, the call of ple.ple_layer on T tokens of the tiny model's PLE
    layer with a state's PLE context and conv)."""
    m = synthetic_model("tiny", None, "nvfp4-modelopt", "cpu", dtype)
    a = m.args
    i = a.ple_layers[0]
    w = m.weights.layers[i]["ple"]
    g = torch.Generator().manual_seed(T)
    R = torch.randn(1, T, a.hc_count * a.hidden_size, generator=g).to(dtype)
    ids = torch.randint(0, a.vocab_size, (1, T), generator=g)

    def fresh() -> DecodeState:
        return DecodeState.create(a, 1, 4, "cpu", dtype)
    return a, fresh, lambda st: ple.ple_layer(R, ids, w, st.ple_ctx, st.ple[i].conv, a)


def test_ple_subblocks_change_no_bit(monkeypatch):
    """The PLE prefill in sub-blocks (the conv state passing on) gives the unblocked bits."""
    _, fresh, call = _ple_call(300)
    whole = call(fresh())
    monkeypatch.setattr(ple, "PLE_SUBBLOCK", 64)
    assert torch.equal(call(fresh()), whole)
    monkeypatch.setattr(ple, "PLE_SUBBLOCK", 7)  # sub-blocks shorter than the conv's reach
    assert torch.equal(call(fresh()), whole)


@pytest.mark.parametrize("T", [100, 600])
def test_plan_covers_the_ple_prefill(T, monkeypatch):
    """The plan's PLE term covers ple_layer's measured peak, within 1.5x, inside one sub-block
    (T 100) and across several (T 600 over sub-blocks of 128). Control: the sub-blocks off, the
    peak of the longer call exceeds the term (the plan relies on them)."""
    monkeypatch.setattr(ple, "PLE_SUBBLOCK", SUB)
    a, fresh, call = _ple_call(T)
    planned = ple_block_bytes(a, 2, T)
    st = fresh()
    measured = peak_bytes(lambda: call(st))
    assert measured <= planned <= 1.5 * measured, (measured, planned)
    if T > SUB:
        monkeypatch.setattr(ple, "PLE_SUBBLOCK", 1 << 20)
        st = fresh()
        assert peak_bytes(lambda: call(st)) > planned


def _hc_call(T: int, dtype=torch.bfloat16):
    """(args, the call of the prefill's hc_write_read on T tokens of the tiny model's first
    mixer: the pending write of a block output y with weights s, then the read)."""
    m = synthetic_model("tiny", None, "nvfp4-modelopt", "cpu", dtype)
    a = m.args
    w = m.weights.layers[0]["mlp_hyper_connection"]
    g = torch.Generator().manual_seed(T)
    R = torch.randn(1, T, a.hc_count * a.hidden_size, generator=g).to(dtype)
    y = torch.randn(1, T, a.hidden_size, generator=g).to(dtype)
    s = torch.rand(1, T, a.hc_count, generator=g).to(dtype)
    return a, lambda: q.hc_write_read(R, y, s, w, a)


def test_hc_subblocks_change_no_bit(monkeypatch):
    """The prefill's hyper-connection read in sub-blocks gives the unblocked bits."""
    _, call = _hc_call(300)
    whole = call()
    for sub in (64, 7):
        monkeypatch.setattr(q, "HC_SUBBLOCK", sub)
        assert all(torch.equal(u, v) for u, v in zip(call(), whole, strict=True))


@pytest.mark.parametrize("T", [100, 600])
def test_plan_covers_the_hc_prefill(T, monkeypatch):
    """The plan's hyper-connection term covers hc_write_read's measured peak, within 1.5x,
    inside one sub-block (T 100) and across several (T 600 over sub-blocks of 128). Control:
    the sub-blocks off, the longer call's peak exceeds the term."""
    monkeypatch.setattr(q, "HC_SUBBLOCK", SUB)
    a, call = _hc_call(T)
    planned = hc_mix_bytes(a, 2, T)
    measured = peak_bytes(call)
    assert measured <= planned <= 1.5 * measured, (measured, planned)
    if T > SUB:
        monkeypatch.setattr(q, "HC_SUBBLOCK", 1 << 20)
        assert peak_bytes(call) > planned


def _causal_call(T: int):
    """(args, the tiny model's engine.prefill of T tokens from position 0 in bf16 on the CPU:
    a context short enough that the QSA layers attend causally)."""
    m = synthetic_model("tiny", None, "nvfp4-modelopt", "cpu", torch.bfloat16)
    # a budget of 512 tokens (a selection parameter, no weight depends on it): causal up to it
    m = dataclasses.replace(m, args=dataclasses.replace(m.args, indexer_budget=512))
    a = m.args
    assert not qsa.sparse_prefill(T, a)
    experts = engine.resident_backend(m)
    ids = torch.randint(0, a.vocab_size, (T,), generator=torch.Generator().manual_seed(T))

    def call():
        state = DecodeState.create(a, 1, T, "cpu", torch.bfloat16)
        return engine.prefill(m, state, 0, ids, 0, experts, logits_at=slice(-1, None))
    return a, m, call


def test_causal_query_chunks_change_no_bit(monkeypatch):
    """The causal prefill attention in query chunks (qsa.CAUSAL_ELEMS small enough to split the
    tiny model's queries into 2..T chunks) gives the unchunked logits, bit for bit (CPU)."""
    a, _, call = _causal_call(200)
    whole = call()
    for tq in (64, 7, 1):
        monkeypatch.setattr(qsa, "CAUSAL_ELEMS", a.num_attention_heads * 200 * tq)
        assert qsa.causal_query_chunk(200, 200, a) == tq
        assert torch.equal(call(), whole), tq


def test_plan_covers_the_causal_prefill_in_query_chunks(monkeypatch):
    """The plan's attention term (attention_prefill_bytes) covers the measured peak of the
    tiny model's attention mixer on a causal prefill of T tokens whose attention runs in query
    chunks, within 2x; control: the same call unchunked holds more than that term (the chunks
    are what the plan relies on)."""
    T = 256
    a, m, _ = _causal_call(T)
    layer = next(i for i in range(a.num_hidden_layers) if a.is_attention(i))
    w = m.weights.layers[layer]["self_attn"]
    x = torch.randn(1, T, a.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    pos = torch.arange(T)[None]

    def call():
        state = DecodeState.create(a, 1, T, "cpu", torch.bfloat16)
        cache = state.mixers[layer].rows(slice(0, 1))
        return lambda: qsa.attention_mixer(x, w, cache, pos, T, a)

    monkeypatch.setattr(qsa, "CAUSAL_ELEMS", a.num_attention_heads * T * 16)
    planned = attention_prefill_bytes(a, 2, T, T, False, False, torch.bfloat16)
    measured = peak_bytes(call())
    assert measured <= planned <= 2 * measured, (measured, planned)
    monkeypatch.setattr(qsa, "CAUSAL_ELEMS", 1 << 40)
    assert peak_bytes(call()) > planned
