"""Session 22's decode-chain switches, off until measured: L2 prefetch of the next kernel's
weights (ftchat/kernels/l2_prefetch.py), the GDN state loaded before the PDL wait
(kernels.GDN_EARLY_STATE) and the QSA fused projection through the Triton GEMV
(kernels.QSA_PROJ_GEMV).

The first two change when bytes move, never which bytes a kernel reads, so decode must give the
same tokens and logits bit for bit with them on and off, in a captured graph and eagerly, on the
tiny model and on four flash-next layers (the real geometry takes every prefetching kernel: HC
read, NVFP4 GDN projection then the recurrence, QSA prep, the MoE GEMV, the shared down GEMV, the
v4 routed kernel 1). Non-vacuity: on flash-next, one decode step with the switch on prefetches
every site design.md 5.5 lists (the tensors `span` was asked for, and the expert-row launches),
and tests/test_l2_prefetch.py shows that L2PF compiles to the bulk prefetch instruction for
sm_90. The split of a range among programs and lanes (`piece`) is
checked in the interpreter too:
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
        pytest -m gpu tests/gpu/test_decode_switches_gpu.py -k pieces
The QSA GEMV changes the summation order of that projection (tests/gpu/test_gemv_gpu.py holds
its tolerance at [13952, 2560]): here the projection calls the GEMV (once, on the fused weight)
with the switch on and not without, and decode with it on replays its eager tokens and logits
bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from ftchat.engine import generate, resident_backend
from ftchat.kernels import (HAS_TRITON, gdn_early_state_kernels, gemv, jit as _jit,
                            l2_prefetch, l2_prefetch_kernels, qsa_proj_gemv_kernels, tl)
from ftchat.kernels.l2_prefetch import piece
from tests.kernel_inputs import kernel_device, needs_hopper as hopper_marker

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
needs_hopper = hopper_marker("the bulk prefetch")
PROMPTS = [[3, 17, 99, 4, 250, 31, 7, 507], [9, 120, 44, 2, 300, 8, 61, 5]]
STEPS = 16


@pytest.fixture(autouse=True)
def _device():
    yield from kernel_device(DEVICE, INTERPRET, HAS_TRITON)


@_jit
def _pieces_kernel(out_ptr, nbytes, nprog, PROGRAMS: tl.constexpr, LANES: tl.constexpr):
    # out [nprog, LANES, 2] int64: (start, size) of every lane of every program, 0 where the
    # program takes no part (as prefetch_l2 decides: the first PROGRAMS)
    pid = tl.program_id(0)
    n = tl.minimum(nprog, PROGRAMS)
    for i in tl.static_range(LANES):
        start, size = piece(nbytes, pid, n, i)
        take = pid < n
        tl.store(out_ptr + (pid * LANES + i) * 2, tl.where(take, start, 0).to(tl.int64))
        tl.store(out_ptr + (pid * LANES + i) * 2 + 1, tl.where(take, size, 0).to(tl.int64))


@pytest.mark.parametrize("nbytes,nprog", [(16, 1), (4096, 3), (6_553_600, 492), (160, 200),
                                          (16 << 20, 31), (931_840, 640), (48, 128)])
def test_pieces_tile_the_range_once_on_the_16_byte_grid(nbytes, nprog):
    lanes = l2_prefetch.L2_LANES
    out = torch.full((nprog, lanes, 2), -1, dtype=torch.int64, device=DEVICE)
    _pieces_kernel[(nprog,)](out, nbytes, nprog, PROGRAMS=l2_prefetch.L2_PROGRAMS, LANES=lanes)
    got = sorted((s, n) for s, n in out.view(-1, 2).tolist() if n > 0)
    assert all(s % 16 == 0 and n % 16 == 0 for s, n in got)
    pos = 0
    for s, n in got:  # sorted by start: contiguous, no gap, no overlap
        assert s == pos, (s, pos)
        pos += n
    assert pos == nbytes
    # the programs past L2_PROGRAMS issue nothing
    assert (out[l2_prefetch.L2_PROGRAMS:, :, 1] == 0).all()


def _run(m, batch, graph: bool, l2pf: int = 0, early: bool = False, qsagemv: bool = False):
    with (l2_prefetch_kernels(l2pf), gdn_early_state_kernels(early),  # fixed at capture
          qsa_proj_gemv_kernels(qsagemv)):
        steps = list(generate(m, batch, STEPS, resident_backend(m), graph=graph))
    return [s.tokens for s in steps], torch.stack([s.logits for s in steps]).cpu()


def _same(a, b):
    assert a[0] == b[0]
    assert torch.equal(a[1].view(torch.int16), b[1].view(torch.int16))


def _switches_reach_the_kernels(m):
    # non-vacuity: with the switch on, this GPU's kernels get the prefetch (and without, not)
    w = m.weights["lm_head.weight"]
    with l2_prefetch_kernels(16):
        assert l2_prefetch.target(w, w)["L2PF"] and 0 < l2_prefetch.span(w) <= 16 << 20
    assert not l2_prefetch.target(w, w)["L2PF"]


@needs_hopper
@pytest.mark.parametrize("rows", [1, 2])
def test_l2_prefetch_and_early_state_change_no_bit_tiny(rows):
    from ftchat.model.synth_memory import synthetic_model

    m = synthetic_model("tiny", 4, "nvfp4-modelopt", "cuda", torch.bfloat16, dense="nvfp4")
    _switches_reach_the_kernels(m)
    batch = PROMPTS[:rows]
    off = _run(m, batch, graph=True, l2pf=0, early=False)
    _same(_run(m, batch, graph=True, l2pf=16, early=True), off)
    _same(_run(m, batch, graph=True, l2pf=1, early=False), off)  # a cap below most weights
    _same(_run(m, batch, graph=False, l2pf=16, early=True), off)


def _prefetched(m, batch) -> tuple[set[int], int]:
    # over one eager decode with the prefetch on: the addresses of the tensors the kernels
    # asked L2 for (l2_prefetch.span > 0), and how many launches prefetched expert rows
    span, rows_target = l2_prefetch.span, l2_prefetch.rows_target
    seen, rows = set(), []

    def spy_span(t):
        n = span(t)
        if n:
            seen.add(t.data_ptr())
        return n

    def spy_rows(*args):
        out = rows_target(*args)
        rows.append(out["L2PF"])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(l2_prefetch, "span", spy_span)
        mp.setattr(l2_prefetch, "rows_target", spy_rows)
        _run(m, batch, graph=False, l2pf=16)
    return seen, sum(rows)


def _prefetch_sites(m) -> set[int]:
    # what design.md 5.5 says is prefetched: each HC read's W_up, the weight each block starts
    # with, out_proj / o_proj, the MoE GEMV's weight and the shared down weight, lm_head
    from ftchat.model import gdn, qsa
    from ftchat.model.layers import SHARED_FUSED

    W, a = m.weights, m.args
    want = {W["lm_head.weight"], W.final_mixer["input_mix_weight_up.weight"]}
    for i, lw in enumerate(W.layers):
        attention = a.is_attention(i)
        mixer = lw["self_attn"] if attention else lw["linear_attn"]
        first = (qsa if attention else gdn).decode_input_weight(mixer)
        want |= {lw[hc]["input_mix_weight_up.weight"]
                 for hc in ("attn_hyper_connection", "mlp_hyper_connection")}
        want |= {first, mixer["o_proj.weight" if attention else "out_proj.weight"],
                 lw["mlp"][SHARED_FUSED], lw["mlp"]["shared_expert.down_proj.weight"]}
    return {t.data_ptr() for t in want}


@needs_hopper
def test_l2_prefetch_and_early_state_change_no_bit_flash_next():
    from ftchat.model.synth_memory import synthetic_model

    # layers 0-3: three GDN layers (layer 1 with PLE) and a QSA layer at the real geometry
    m = synthetic_model("flash-next", 4, "nvfp4-modelopt", "cuda", torch.bfloat16, dense="nvfp4")
    _switches_reach_the_kernels(m)
    seen, rows = _prefetched(m, PROMPTS[:1])
    assert _prefetch_sites(m) <= seen  # every site of design.md 5.5 prefetched ...
    # ... and the routed rows (shared down GEMV, kernel 1) in each layer of each decode step
    # (STEPS tokens: the first from the prefill)
    assert rows >= 2 * m.args.num_hidden_layers * (STEPS - 1)
    off = _run(m, PROMPTS[:1], graph=True, l2pf=0, early=False)
    _same(_run(m, PROMPTS[:1], graph=True, l2pf=16, early=True), off)
    _same(_run(m, PROMPTS[:1], graph=False, l2pf=16, early=True), off)


@needs_hopper
def test_qsa_projection_takes_the_gemv_with_its_switch_and_decode_replays_eager():
    import torch.nn.functional as F

    from ftchat.model import qsa
    from ftchat.model.synth_memory import synthetic_model

    m = synthetic_model("tiny", 4, "nvfp4-modelopt", "cuda", torch.bfloat16, dense="nvfp4")
    i = next(i for i in range(m.args.num_hidden_layers) if m.args.is_attention(i))
    w = m.weights.layers[i]["self_attn"]
    x = torch.randn(1, m.args.hidden_size, device="cuda", dtype=torch.bfloat16)
    calls, real = [], gemv.linear_triton

    def spy(x, w, *args, **kwargs):  # which weights the Triton GEMV is called on
        calls.append(w.data_ptr())
        return real(x, w, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemv, "linear_triton", spy)
        assert torch.equal(qsa.fused_projection(x, w), F.linear(x, w[qsa.FUSED]))
        assert calls == []  # the control: off, cuBLAS
        with qsa_proj_gemv_kernels(True):
            got = qsa.fused_projection(x, w)
        assert calls == [w[qsa.FUSED].data_ptr()]  # on: the GEMV, once, on the fused weight
    assert torch.equal(got, gemv.linear_triton(x, w[qsa.FUSED]))
    _same(_run(m, PROMPTS[:1], graph=True, qsagemv=True),
          _run(m, PROMPTS[:1], graph=False, qsagemv=True))
