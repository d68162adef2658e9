"""The PLE layer's decode kernels (ftchat/kernels/ple_decode.py) against the torch path.

    on the device (CUDA):        pytest -m gpu tests/gpu/test_ple_decode_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_ple_decode_gpu.py

* The rows kernel equals `ple.ngram_rows` exactly, on the flash-next multipliers and primes,
  with eos tokens in the context, and with ids past the vocabulary whose hash products wrap to
  negative int64 (where C's remainder and torch.remainder differ; checked to occur: valid ids
  never get there).
* The block kernel against `R + ple.ple_mix` after the key's norm (the torch path after the
  GEMVs) at the tiny and
  the flash-next geometry: fp32 within 1e-5 of the largest |R'|; bf16 within one bf16 ulp of
  each element of R' plus one of the update (G + conv). Why that much: the kernel rounds where
  torch does, but its sums run in another order and CUDA torch divides by sqrt(D) as a
  product with the reciprocal, so u can land one bf16 ulp away, which moves sigmoid(u) * value
  by about an ulp of G, and R' = R + (G + conv) can then round the other way. In the
  interpreter the bf16 results equal the CPU torch path bit for bit; fp32 differs by <= 1e-6.
  The conv state's shifted columns are exact; its new column (N) is within the same bound.
  Negative control: one channel's conv taps moved by 1 fail the same check.
* On CUDA: decode with the fused PLE replays its eager tokens and logits bit for bit in a
  graph, and the fp32 logits of the first decode step match the torch PLE path's (`supported`
  patched false) within 1e-4 of the largest, but not bit for bit (so the fused path ran).
"""

from __future__ import annotations

import os

import pytest
import torch

from ftchat.kernels import HAS_TRITON, ple_decode
from ftchat.model import ple
from ftchat.model.layers import rms_norm
from ftchat.model.synth import model_args
from tests.kernel_inputs import kernel_device

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
CUDA = torch.cuda.is_available() and not INTERPRET
needs_cuda = pytest.mark.skipif(not CUDA, reason="decode through the engine on a CUDA GPU")


@pytest.fixture(autouse=True)
def _device(monkeypatch):
    # the fp32 reference's depthwise conv in fp32, not TF32 (cuDNN's default allows it)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    yield from kernel_device(DEVICE, INTERPRET, HAS_TRITON)


def _ple_weights(a, dtype, gen) -> dict:
    # the layer's weights as ple_mix reads them: zero-centred norms, conv [hc*D, 1, KC], and
    # the hash tables of the first PLE layer (the checkpoint's int64 tensors)
    C, KC = a.hc_count * a.hidden_size, a.ple_conv_kernel_size
    primes, offsets, _ = ple.table_rows(a, 0)
    w = {"norm_key.weight": 0.1 * torch.randn(C, generator=gen),
         "norm_query.weight": 0.1 * torch.randn(C, generator=gen),
         "norm_conv.weight": 0.1 * torch.randn(C, generator=gen),
         "conv1d.weight": torch.randn(C, 1, KC, generator=gen) * KC ** -0.5}
    w = {k: v.to(dtype).to(DEVICE) for k, v in w.items()}
    w["ple_embedding.layer_multipliers"] = torch.tensor(
        ple.layer_multipliers(a.vocab_size, a.ngram_size, 0, a.seed), device=DEVICE)
    w["ple_embedding.ngram_heads_vocab_sizes"] = torch.tensor(primes, device=DEVICE)
    w["ple_embedding.ngram_heads_offsets"] = torch.tensor(offsets, device=DEVICE)
    return w


@pytest.mark.parametrize("rows", [1, 3])
def test_rows_kernel_equals_ngram_rows(rows):
    a = model_args("flash-next", 2, "bf16")
    w = _ple_weights(a, torch.float32, torch.Generator().manual_seed(rows))
    gen = torch.Generator().manual_seed(7 + rows)
    n, eos = a.ngram_size, a.eos_token_id
    mult = w["ple_embedding.layer_multipliers"]
    primes, offs = w["ple_embedding.ngram_heads_vocab_sizes"], w["ple_embedding.ngram_heads_offsets"]
    cases = 0
    negative = False
    for trial in range(9):
        # trials 6-8: ids past the vocabulary (to 2^40), whose products wrap to negative int64:
        # the multipliers keep every valid id's product below 2^63, so only these reach the
        # remainder's sign case, where the kernel must still give torch.remainder's rows
        top = a.vocab_size if trial < 6 else 2**40
        ids = torch.randint(0, top, (rows, 1), generator=gen)
        ctx = torch.randint(0, top, (rows, n - 1), generator=gen)
        if trial >= 6:  # the first id whose product passes 2^63
            ids[0, 0] = 2**63 // int(mult[0]) + 1 + trial
        if trial % 3 == 1:
            ctx[:, -1] = eos  # the nearer context token is eos: the farther one is hidden
        if trial % 3 == 2:
            ctx[:, 0] = eos
        ids, ctx = ids.to(DEVICE), ctx.to(DEVICE)
        want = ple.ngram_rows(ids, ctx, mult, primes, offs, eos, a.heads_per_ngram)
        got = ple_decode.ngram_rows_decode(ids, ctx, mult, primes, offs, eos, a.heads_per_ngram)
        assert got.shape == want.shape == (rows, 1, (n - 1) * a.heads_per_ngram)
        assert torch.equal(got, want), trial
        negative |= bool(((ids.cpu() * mult[0].cpu()) < 0).any())  # int64 products wrapped
        cases += 1
    assert cases == 9 and negative  # the remainder's sign case was exercised


def _block_case(geo: str, rows: int, dtype, seed: int):
    a = model_args(geo, 2, "bf16")
    gen = torch.Generator().manual_seed(seed)
    D, C = a.hidden_size, a.hc_count * a.hidden_size
    w = _ple_weights(a, dtype, gen)
    R = torch.randn(rows, 1, C, generator=gen).to(dtype).to(DEVICE)
    k = (2 * torch.randn(rows, 1, C, generator=gen)).to(dtype).to(DEVICE)
    v = torch.randn(rows, 1, D, generator=gen).to(dtype).to(DEVICE)
    ST = (a.ple_conv_kernel_size - 1) * a.ngram_size
    conv = torch.randn(rows, C, ST, generator=gen).to(dtype).to(DEVICE)
    return a, w, R, k, v, conv


def _close(got: torch.Tensor, ref: torch.Tensor, update: torch.Tensor, dtype) -> bool:
    # ref = R + update: fp32 within 1e-5 of the largest |ref|; bf16 within an ulp of ref and
    # an ulp of the update, element by element (an ulp <= 2^-7 of a bf16 value)
    diff = (got.double() - ref.double()).abs()
    if dtype == torch.float32:
        return bool((diff <= 1e-5 * ref.double().abs().max()).all())
    return bool((diff <= 2**-7 * (ref.double().abs() + update.double().abs())).all())


@pytest.mark.parametrize("geo", ["tiny", "flash-next"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_kernel_matches_the_torch_path(geo, rows, dtype):
    a, w, R, k, v, conv = _block_case(geo, rows, dtype, seed=rows + 10 * len(geo))
    conv_ref, conv_got = conv.clone(), conv.clone()
    key = rms_norm(k, w["norm_key.weight"], a.rms_norm_eps, a.hidden_size)
    update = ple.ple_mix(R, key, v, w, conv_ref, a)
    want = R + update
    got = ple_decode.ple_block_decode(R, k, v, w, conv_got, a.rms_norm_eps, a.ngram_size)
    assert got.shape == want.shape and got.dtype == dtype
    assert _close(got, want, update, dtype), float((got.double() - want.double()).abs().max())
    assert torch.equal(conv_got[..., :-1], conv_ref[..., :-1])  # the shift: exact
    assert torch.equal(conv_got[..., :-1], conv[..., 1:])
    N = conv_ref[..., -1]
    assert _close(conv_got[..., -1], N, torch.zeros_like(N), dtype)  # the new column, N
    # negative control: one channel of stream 1 with its conv taps moved by 1: the check fails
    w_bad = dict(w)
    w_bad["conv1d.weight"] = w["conv1d.weight"].clone()
    w_bad["conv1d.weight"][a.hidden_size + 5] += 1
    bad = ple_decode.ple_block_decode(R, k, v, w_bad, conv.clone(), a.rms_norm_eps, a.ngram_size)
    assert not _close(bad, want, update, dtype)


@needs_cuda
def test_decode_with_the_fused_ple_replays_eager_and_matches_the_torch_path(monkeypatch):
    from ftchat.engine import generate, resident_backend
    from ftchat.model.synth_memory import synthetic_model

    def run(m, graph: bool, on: bool):
        with monkeypatch.context() as mp:
            if not on:  # the torch PLE path, every other kernel as it is
                mp.setattr(ple_decode, "supported", lambda R: False)
            steps = list(generate(m, [[3, 17, 99, 4, 250]], 12, resident_backend(m), graph=graph))
        return [s.tokens for s in steps], torch.stack([s.logits for s in steps]).cpu()

    m = synthetic_model("tiny", 4, "bf16", "cuda", torch.bfloat16)
    assert m.args.ple_layers  # the tiny preset has a PLE layer
    (tg, lg), (te, le) = run(m, graph=True, on=True), run(m, graph=False, on=True)
    assert tg == te and torch.equal(lg.view(torch.int16), le.view(torch.int16))
    m32 = synthetic_model("tiny", 4, "bf16", "cuda", torch.float32)
    (t_on, on), (t_off, off) = run(m32, graph=False, on=True), run(m32, graph=False, on=False)
    # step 0 is the prefill (T = 5: the torch path on both arms, the same bits); step 1 is the
    # first decode step, the fused path's first use, from the same token on both arms
    assert torch.equal(on[0], off[0]) and t_on[0] == t_off[0]
    diff = (on[1] - off[1]).abs().max()
    assert 0 < diff <= 1e-4 * off[1].abs().max()  # > 0: the fused path ran (its sums' order)
