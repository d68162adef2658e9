"""The PLE row gather from the pinned host table (ftchat/kernels/ple_gather.py) against the torch
reference, and the decode step with a host table inside a CUDA graph (docs/model.md 7.4).

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_ple_gather_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_ple_gather_gpu.py
(TRITON_INTERPRET=1 alone also picks the CPU.) On CUDA every table is host memory registered
with cudaHostRegister (host_memory.pin) and the kernel reads it over UVA; in the interpreter it is a
CPU tensor and the decode test routes the model's gather through the kernel by hand. The graph
tests need the device.

Every comparison is bit for bit (bit patterns, so -0 and +0 differ): the kernel does what the
reference does (fp32 value, x fp32 scale rounded to nearest even, one rounding to the model
dtype). The synth scale 6/448 has a full fp32 significand, so the fp32 product rounds.
Controls: a scale one ulp off and the interpreter's truncating cast are seen as different;
with fused kernels off the host-table model is not captured; a table changed after capture
changes the replayed logits (the graph reads the pinned table on every replay).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

import ftchat.engine as engine
from ftchat.engine import Decoder, decode, generate, graph_safe, load_model, resident_backend
from ftchat.kernels import HAS_TRITON
from ftchat.kernels import ple_gather as pg
from ftchat.kernels.config import KernelConfig
from ftchat.model.ngram_table import HostTable, page_tensor
from ftchat.model.synth import PLE_FP8_SCALE, write_checkpoint

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE") or ("cpu" if INTERPRET else "cuda")
NAME = "layers.1.ple.ple_embedding.ngram_embedding.weight"
SCALE = float(torch.tensor(PLE_FP8_SCALE, dtype=torch.float32))
PROMPTS = [[3, 17, 99, 4, 250, 31, 7, 507, 12, 400], [9, 120, 44, 2, 300]]
STEPS = 12 if DEVICE == "cpu" else 40
needs_cuda = pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need the device")


@pytest.fixture(autouse=True)
def _triton():
    assert HAS_TRITON, "these tests need triton"
    if DEVICE == "cpu":
        assert INTERPRET, "FTCHAT_TEST_DEVICE=cpu needs TRITON_INTERPRET=1"
    else:
        assert torch.cuda.is_available(), "no CUDA: set FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1"


@contextlib.contextmanager
def host_table(table: torch.Tensor, copy: bool = True):
    """The table as the kernel sees it: pinned on CUDA (unregistered after), on pages of its own
    (a copy, unless copy=False for a page_tensor), as is on the CPU."""
    if DEVICE == "cpu":
        yield table
        return
    from ftchat.host_memory import pin

    t = table
    if copy:
        t = page_tensor(tuple(table.shape), table.dtype)
        t.copy_(table)
    pin(t)  # unregistered by pin's own finalizer when t is collected: unregistering here too
    try:    # made that finalizer's call fail, and its error surfaced in a later test's CUDA call
        yield t
    finally:
        torch.cuda.synchronize()  # no kernel reads t once it is collected


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().view(torch.int16 if x.element_size() == 2 else torch.int32)


# ===== the kernel alone =====


def _table(stored: str, N: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """[N, d] host table: every finite fp8 code, or bf16 bit patterns of N(0, 1) x 2^[-20, 20]."""
    if stored == "fp8":
        codes = torch.randint(0, 254, (N, d), dtype=torch.uint8, generator=gen)
        codes = codes + (codes >= 0x7F).to(torch.uint8)  # skip 0x7F (NaN); 0xFF is never drawn
        return codes.view(torch.float8_e4m3fn)
    v = torch.randn(N, d, generator=gen) * 2.0 ** torch.randint(-20, 21, (N, 1), generator=gen)
    return v.to(torch.bfloat16)


def _rows(lead: tuple[int, ...], nh: int, N: int, gen: torch.Generator) -> torch.Tensor:
    rows = torch.randint(0, N, (*lead, nh), generator=gen)
    rows.view(-1, nh)[0, :2] = torch.tensor([0, N - 1])  # the first and last rows
    return rows


GEOMETRIES = {"real": (16, 160, 40_000), "odd": (5, 24, 1_000)}  # nh, d, N: odd masks both dims
CASES = [("fp8", SCALE), ("fp8", None), ("bf16", None)]


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("stored,scale", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead", [(4, 1), (2, 7)])  # decode [B, 1] and a prefill chunk [B, T]
def test_kernel_equals_torch_gather(geo, stored, scale, dtype, lead):
    nh, d, N = GEOMETRIES[geo]
    gen = torch.Generator().manual_seed(sum(map(ord, f"{geo}{stored}{lead}")))  # fixed per case
    rows = _rows(lead, nh, N, gen)
    with host_table(_table(stored, N, d, gen)) as table:
        ref = pg.gather_ref(table, scale, rows, dtype)  # CPU: the reference
        got = pg.gather_triton(table, scale, rows.to(DEVICE), dtype)
        assert got.shape == (*lead, nh * d) and got.device.type == DEVICE
        assert torch.equal(_bits(got), _bits(ref))
        if scale is not None:  # control: a scale one ulp of the output dtype off is seen
            off = scale * (1 + torch.finfo(dtype).eps)
            assert not torch.equal(_bits(pg.gather_triton(table, off, rows.to(DEVICE), dtype)),
                                   _bits(ref))
        if dtype == torch.bfloat16 and stored == "fp8" and scale is not None:
            truncated = ((table[rows].float() * scale).view(torch.int32) & -65536).view(
                torch.float32).to(torch.bfloat16).flatten(-2)  # round toward zero: the wrong cast
            assert not torch.equal(_bits(truncated), _bits(ref))


def test_kernel_addresses_rows_past_2_to_the_31_elements():
    """int64 row offsets: rows whose element offset row*d exceeds 2^31 (the real table's are up
    to 5.1e10). A 2.1 GB fp8 table, only its first and last rows written."""
    nh, d = 16, 160
    N = (1 << 31) // d + 4096
    gen = torch.Generator().manual_seed(7)
    big = page_tensor((N, d), torch.float8_e4m3fn)
    ends = torch.cat([torch.arange(0, 8), torch.arange(N - 4088, N)])  # [4096]
    big[ends] = _table("fp8", ends.shape[0], d, gen)
    rows = ends[torch.randint(0, ends.shape[0], (3, 1, nh), generator=gen)]
    rows[0, 0, 0] = N - 1
    with host_table(big, copy=False) as table:
        ref = pg.gather_ref(table, SCALE, rows, torch.bfloat16)
        got = pg.gather_triton(table, SCALE, rows.to(DEVICE), torch.bfloat16)
        assert torch.equal(_bits(got), _bits(ref))


# ===== the decode step with a host table =====


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(host-table model, on-device-table model) of one fp8-table checkpoint, bf16, loaded once
    (the host table stays pinned for the process: do not load it twice)."""
    folder = write_checkpoint(tmp_path_factory.mktemp("ple") / "fp8", "tiny", fmt="bf16", seed=3,
                              ple_table="fp8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "PLE_ON_DEVICE_BYTES", 0)
        host = load_model(folder, DEVICE, torch.bfloat16, ple_table="host")
    return host, load_model(folder, DEVICE, torch.bfloat16)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts gather_triton calls; in the interpreter also routes the CPU model's gather through
    the kernel (KernelConfig.runs_fused is CUDA-only)."""
    calls = []
    real = pg.gather_triton

    def counted(*args, **kw):
        calls.append(args[2].shape)
        return real(*args, **kw)

    monkeypatch.setattr(pg, "gather_triton", counted)
    if DEVICE == "cpu":
        monkeypatch.setattr(pg, "fused", lambda table, rows, dtype, kc=None:
                            dtype in pg.OUT_DTYPES and table.device == rows.device)
    return calls


def _run(m, graph: bool):
    steps = list(generate(m, PROMPTS, STEPS, resident_backend(m), graph=graph))
    return [s.tokens for s in steps], torch.stack([s.logits for s in steps]).cpu()


def test_host_table_is_pinned_and_gathered_by_the_kernel(models, kernel_calls):
    host, dev = models
    t = host.weights[NAME]
    assert isinstance(t, HostTable) and t.data.dtype == torch.float8_e4m3fn and t.scale == SCALE
    assert t.data.device.type == "cpu" and isinstance(dev.weights[NAME], torch.Tensor)
    if DEVICE == "cuda":
        assert t.data.is_pinned() and dev.weights[NAME].is_cuda
    tok_h, log_h = _run(host, False)
    # the n-gram rows (16 heads a token) of each prefill and each decode step; on CUDA the token
    # embedding (one head, also a pinned host table) is gathered by the same kernel
    ngram = [c for c in kernel_calls if c[-1] > 1]
    assert len(ngram) == len(PROMPTS) + STEPS - 1
    tok_d, log_d = _run(dev, False)
    assert tok_h == tok_d and torch.equal(_bits(log_h), _bits(log_d))


@needs_cuda
def test_decode_step_with_a_host_table_is_captured(models, kernel_calls):
    host, dev = models
    assert graph_safe(host)
    dec = Decoder(host, resident_backend(host), len(PROMPTS), 64, graph=True)
    assert dec.graph is not None
    assert kernel_calls  # the capture ran the kernel (no host-sync fallback)
    (tok_g, log_g), (tok_e, _) = _run(host, True), _run(host, False)
    assert tok_g == tok_e
    assert torch.equal(_bits(log_g), _bits(_run(dev, True)[1]))  # same graph, device table


@needs_cuda
def test_controls_no_kernel_no_graph_and_a_changed_table_is_seen(models):
    host, _ = models
    # fused kernels off: the torch fallback syncs, the Decoder must not capture it
    off = dataclasses.replace(host, weights=host.weights.with_kernels(KernelConfig(fused=False)))
    assert not graph_safe(off)
    assert Decoder(off, resident_backend(off), 1, 32, graph=True).graph is None
    dec = Decoder(host, resident_backend(host), len(PROMPTS), 64, graph=True)
    data = host.weights[NAME].data.view(torch.uint8)

    def logits(flip: bool) -> list[torch.Tensor]:
        """Every step's logits; with flip, every table sign flipped after the prefill (the
        first logits), i.e. under the graph's replays only."""
        dec.reset()
        out = []
        try:
            for s in decode(dec, PROMPTS, [0] * len(PROMPTS), [STEPS] * len(PROMPTS)):
                out.append(s.logits.cpu())
                if flip and len(out) == 1:
                    data.bitwise_xor_(0x80)  # in the pinned table, after the capture
        finally:
            if flip:
                data.bitwise_xor_(0x80)
        return out

    before, after = logits(False), logits(True)
    assert torch.equal(after[0], before[0])  # the prefill saw the same table
    assert not torch.equal(after[1], before[1])  # the first replay read the changed table
    assert all(torch.equal(x, y) for x, y in zip(logits(False), before, strict=True))
