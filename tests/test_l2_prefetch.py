"""L2 prefetch (ftchat/kernels/l2_prefetch.py): where it is on, and what the kernels compile to.

Off the GPU, with the switch off, or for a range off the 16-byte grid, no kernel prefetches
(`target` / `rows_target` give L2PF False). With the switch on, each prefetching wrapper hands
its kernel a range, and that kernel compiles for sm_90 (ptxas included) to the bulk prefetch
instruction, once per lane (L2_LANES) and per call site; the same launch with L2PF False has
none (the control). The compile needs Triton but no GPU, so this runs wherever Triton is
installed (a CPU-only install without Triton skips it; the GPU tier runs the kernels:
tests/gpu/test_decode_switches_gpu.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ftchat.kernels import L2_PREFETCH, l2_prefetch, l2_prefetch_kernels
from tests.kernel_compile import Recorder, compile_ptx

INSTRUCTION = "cp.async.bulk.prefetch.L2.global"


def test_nothing_is_prefetched_off_the_gpu_or_with_the_switch_off():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert L2_PREFETCH.value == 0  # the default until measured
    assert l2_prefetch.target(w, w) == {"pf_ptr": w, "pf_bytes": 0, "L2PF": False}
    with l2_prefetch_kernels(16):  # on, but a CPU tensor
        assert l2_prefetch.span(w) == 0 and not l2_prefetch.rows_target(w, 0, 4096)["L2PF"]
    assert l2_prefetch.target(None, w)["L2PF"] is False


def test_span_is_capped_aligned_and_skips_what_the_instruction_cannot_take(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "enabled", lambda device: True)
    big = torch.zeros(3 << 20, dtype=torch.bfloat16)  # 6 MiB
    with l2_prefetch_kernels(4):
        assert l2_prefetch.span(big) == 4 << 20  # capped at the switch's MiB
        assert l2_prefetch.span(big[:1000]) == 2000  # whole, rounded down to 16 bytes: 2000
        assert l2_prefetch.span(big[:1001]) == 2000
        assert l2_prefetch.span(big[1:]) == 0  # starts off the 16-byte grid
        assert l2_prefetch.span(big.view(-1, 2).t()) == 0  # not contiguous
        assert l2_prefetch.rows_target(big, 128, 10_008) == {"pf_off": 128, "pf_bytes": 10_000,
                                                               "L2PF": True}
        assert not l2_prefetch.rows_target(big, 8, 10_000)["L2PF"]  # offset off the grid
    assert l2_prefetch.span(big) == 0  # the switch back off


# ===== what the kernels compile to (Triton, no GPU) =====


@pytest.fixture
def launches(monkeypatch):
    """Kernel launches of the wrappers called in the test, recorded instead of run, with the
    switch on (16 MiB) and the GPU check passed."""
    pytest.importorskip("triton")
    from ftchat.kernels import gdn_decode, gemv, hyper, qsa_decode
    from ftchat.offload import expert_kernels

    rec: list = []
    for mod, name in ((hyper, "_down_split_kernel"), (hyper, "_up_split_kernel"),
                      (gemv, "_gemv_kernel"), (gdn_decode, "_gdn_decode_kernel"),
                      (qsa_decode, "_prep_kernel"), (expert_kernels, "_gate_up_v4_kernel"),
                      (expert_kernels, "_down_combine_kernel")):
        monkeypatch.setattr(mod, name, Recorder(getattr(mod, name), rec))
    monkeypatch.setattr(l2_prefetch, "enabled", lambda device: True)
    with l2_prefetch_kernels(16):
        yield rec


def _count(ptx: str) -> int:
    return sum(INSTRUCTION in line for line in ptx.splitlines())


def _check(rec: list, expect: dict[str, int]):
    # each recorded kernel: L2PF as expected, and that many prefetch instructions in its PTX
    got = {}
    for fn, args, kwargs in rec:
        name = fn.fn.__name__
        assert kwargs.get("L2PF", False) == (expect[name] > 0), name
        got[name] = _count(compile_ptx(fn, args, kwargs))
    assert got == {k: v * l2_prefetch.L2_LANES for k, v in expect.items()}


def test_hc_read_kernels_compile_to_the_prefetch(launches):
    from ftchat.kernels import hyper

    D, hc, L = 256, 4, 64
    w = {"hc_norm.weight": torch.zeros(hc * D, dtype=torch.bfloat16),
         "input_mix_weight_down.weight": torch.zeros(L, hc * D, dtype=torch.bfloat16),
         "input_mix_weight_up.weight": torch.zeros(hc * D, L, dtype=torch.bfloat16),
         "block_inject_weight.weight": torch.zeros(hc, hc * D, dtype=torch.bfloat16)}
    R = torch.zeros(1, hc * D, dtype=torch.bfloat16)
    nxt = torch.zeros(512, D, dtype=torch.bfloat16)
    hyper.hc_mix_triton(R, w, hc, 1e-6, R[:, :D].clone(), R[:, :hc].clone(), prefetch=nxt)
    _check(launches, {"_down_split_kernel": 1, "_up_split_kernel": 1})


def test_hc_read_without_a_next_weight_prefetches_only_w_up(launches):
    from ftchat.kernels import hyper

    D, hc, L = 256, 4, 64
    w = {"hc_norm.weight": torch.zeros(hc * D, dtype=torch.bfloat16),
         "input_mix_weight_down.weight": torch.zeros(L, hc * D, dtype=torch.bfloat16),
         "input_mix_weight_up.weight": torch.zeros(hc * D, L, dtype=torch.bfloat16)}
    hyper.hc_mix_triton(torch.zeros(1, hc * D, dtype=torch.bfloat16), w, hc, 1e-6, inject=False)
    _check(launches, {"_down_split_kernel": 1, "_up_split_kernel": 0})


def test_gemv_compiles_to_the_prefetch_and_its_control_without(launches):
    from ftchat.kernels import gemv

    x, w = torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(256, 512, dtype=torch.bfloat16)
    gemv.linear_triton(x, w, prefetch=torch.zeros(1024, dtype=torch.bfloat16))
    gemv.linear_triton(x, w)  # the control: no next weight, no instruction
    (f1, a1, k1), (f2, a2, k2) = launches
    assert k1["L2PF"] and not k2["L2PF"]
    assert _count(compile_ptx(f1, a1, k1)) == l2_prefetch.L2_LANES
    assert _count(compile_ptx(f2, a2, k2)) == 0


@pytest.mark.parametrize("early", [False, True])
def test_gdn_recurrence_compiles_to_the_prefetch(launches, early):
    from ftchat.kernels import GDN_EARLY_STATE, gdn_decode

    Hk, Hv, dk, dv, Kc = 2, 4, 32, 32, 4
    C = 2 * Hk * dk + Hv * dv
    N = C + Hv * dv + 2 * Hv
    bf = dict(dtype=torch.bfloat16)
    with GDN_EARLY_STATE.set(early):
        gdn_decode.gdn_decode_step(
            torch.zeros(1, N, **bf), torch.zeros(1, C, Kc - 1, **bf),
            torch.zeros(1, Hv, dk, dv), torch.zeros(C, 1, Kc, **bf), torch.zeros(Hv),
            torch.zeros(Hv), torch.zeros(dv, **bf), (Hk, Hv, dk, dv), 1e-6, "sigmoid",
            prefetch=torch.zeros(256, Hv * dv, **bf))
    assert launches[0][2]["EARLY"] is early
    _check(launches, {"_gdn_decode_kernel": 1})


def test_qsa_prep_compiles_to_the_prefetch(launches):
    from ftchat.kernels import qsa_decode as qd

    dims = qd.QsaDims(heads=4, kv_heads=2, head_dim=64, index_heads=2, index_dim=64,
                      rotary_dim=16, ratio=4)
    L, bf = 64, dict(dtype=torch.bfloat16)
    cache = {"k": torch.zeros(1, L, 2, 64, **bf), "v": torch.zeros(1, L, 2, 64, **bf),
             "ik": torch.zeros(1, L, 64, **bf), "kbar": torch.zeros(1, L // 4, 64, **bf)}
    norms = (torch.zeros(64, **bf), torch.zeros(64, **bf), torch.zeros(64, **bf),
             torch.zeros(64, **bf))
    qd.qsa_prep(torch.zeros(1, dims.proj_width, **bf), torch.zeros(1, 1, dtype=torch.int64),
                cache, norms, dims, 1e-6, 1e7, prefetch=torch.zeros(256, 256, **bf))
    _check(launches, {"_prep_kernel": 1})


def test_routed_kernel_1_compiles_to_the_prefetch_of_its_down_rows(launches):
    from ftchat.codecs.rows import RowLayout
    from ftchat.offload import expert_kernels as ek

    layout = RowLayout("nvfp4", 512, 64)
    tiles = dataclasses.replace(ek.V4_TILES_BS1)
    assert ek.v4_applies(layout, tiles)
    bank = torch.zeros(4, layout.nbytes, dtype=torch.uint8)
    slots = torch.tensor([[0, 2]], dtype=torch.int32)
    ek.routed_experts_triton(torch.zeros(1, 512, dtype=torch.bfloat16), bank, layout, slots,
                             torch.zeros(1, 2, dtype=torch.bfloat16), tiles=tiles)
    k1 = launches[0][2]
    down = next(p.offset for p in layout.parts if p.name == "down")
    assert (k1["pf_off"], k1["pf_bytes"]) == (down, layout.nbytes - down)
    _check(launches, {"_gate_up_v4_kernel": 1, "_down_combine_kernel": 0})


def test_shared_down_gemv_compiles_to_the_prefetch_of_the_routed_rows(launches):
    from ftchat.kernels import gemv
    from ftchat.codecs.rows import RowLayout

    layout = RowLayout("nvfp4", 512, 64)
    bank = torch.zeros(4, layout.nbytes, dtype=torch.uint8)
    slots = torch.tensor([[0, 2]], dtype=torch.int32)
    gu, w = torch.zeros(1, 129, dtype=torch.bfloat16), torch.zeros(512, 64, dtype=torch.bfloat16)
    rows = l2_prefetch.Rows(bank, slots, 0, 4096)
    gemv.linear_gated_triton(gu, w, prefetch_rows=rows)
    gemv.linear_gated_triton(gu, w)  # the control
    (f1, a1, k1), (f2, a2, k2) = launches
    assert k1["L2ROWS"] and (k1["PR_N"], k1["pr_row"], k1["pr_bytes"]) == (2, layout.nbytes, 4096)
    assert not k2["L2ROWS"] and not k1["L2PF"]
    assert _count(compile_ptx(f1, a1, k1)) == l2_prefetch.L2_LANES
    assert _count(compile_ptx(f2, a2, k2)) == 0
    # more rows than programs to share them: none
    many = l2_prefetch.Rows(bank, torch.zeros(1, l2_prefetch.L2_PROGRAMS + 1, dtype=torch.int32),
                            0, 4096)
    assert not l2_prefetch.rows_args(many, gu)["L2ROWS"]
