"""The fused PLE decode (ftchat/kernels/ple_decode.py, the CUDA decode path of
ple.ple_residual): where it runs, and that its kernels compile for sm_90.

The kernels' numbers are checked against the torch path in tests/gpu/test_ple_decode_gpu.py
(CUDA, or the Triton interpreter on CPU). Here: the CPU takes the torch path (R + ple_layer);
`ple_block` is `ple_mix` after its two GEMVs and the key's norm; and the two kernels compile for
sm_90 at the flash-next geometry (Triton with its ptxas, no GPU; skipped where Triton is not
installed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftchat.model import ple
from ftchat.model.layers import rms_norm
from ftchat.model.synth import model_args
from ftchat.model.synth_memory import synthetic_model
from tests.kernel_compile import Recorder, compile_ptx


def _tiny_ple(dtype=torch.float32):
    m = synthetic_model("tiny", 4, "bf16", "cpu", dtype)
    a = m.args
    i = a.ple_layers[0]
    return m, a, m.weights.layers[i]["ple"]


def _state(a, B: int, dtype):
    C, ST = a.hc_count * a.hidden_size, (a.ple_conv_kernel_size - 1) * a.ngram_size
    gen = torch.Generator().manual_seed(3)
    return {"ctx": torch.full((B, a.ngram_size - 1), a.eos_token_id, dtype=torch.long),
            "conv": torch.randn(B, C, ST, generator=gen).to(dtype)}


def test_the_cpu_takes_the_torch_path():
    _, a, w = _tiny_ple()
    gen = torch.Generator().manual_seed(1)
    R = torch.randn(2, 1, a.hc_count * a.hidden_size, generator=gen)
    ids = torch.tensor([[5], [17]])
    st0, st1 = _state(a, 2, R.dtype), _state(a, 2, R.dtype)
    want = R + ple.ple_layer(R, ids, w, st0["ctx"], st0["conv"], a)
    got = ple.ple_residual(R, ids, w, st1["ctx"], st1["conv"], a)  # fused kernels on: CPU
    assert torch.equal(got, want) and torch.equal(st1["conv"], st0["conv"])


def test_ple_block_is_ple_mix_after_its_gemvs_and_the_key_norm():
    _, a, w = _tiny_ple()
    gen = torch.Generator().manual_seed(2)
    R = torch.randn(1, 3, a.hc_count * a.hidden_size, generator=gen)
    rows = ple.ngram_rows(torch.tensor([[4, 9, 11]]), torch.tensor([[1, 2]]),
                          w["ple_embedding.layer_multipliers"],
                          w["ple_embedding.ngram_heads_vocab_sizes"],
                          w["ple_embedding.ngram_heads_offsets"], a.eos_token_id,
                          a.heads_per_ngram)
    s1, s2 = _state(a, 1, R.dtype), _state(a, 1, R.dtype)
    E = ple.embedding(w["ple_embedding.ngram_embedding.weight"], rows, R)
    key = rms_norm(F.linear(E, w["key_proj.weight"]), w["norm_key.weight"], a.rms_norm_eps,
                   a.hidden_size)
    want = ple.ple_mix(R, key, F.linear(E, w["value_proj.weight"]), w, s1["conv"], a)
    assert torch.equal(ple.ple_block(R, rows, w, s2["conv"], a), want)
    assert torch.equal(s1["conv"], s2["conv"])


def test_the_kernels_compile_for_sm90_at_the_flash_next_geometry(monkeypatch):
    pytest.importorskip("triton")
    from ftchat.kernels import ple_decode

    rec: list = []
    for name in ("_rows_kernel", "_block_kernel"):
        monkeypatch.setattr(ple_decode, name, Recorder(getattr(ple_decode, name), rec))
    a = model_args("flash-next", 2, "bf16")
    C, D, bf = a.hc_count * a.hidden_size, a.hidden_size, {"dtype": torch.bfloat16}
    nh = (a.ngram_size - 1) * a.heads_per_ngram
    ple_decode.ngram_rows_decode(torch.zeros(1, 1, dtype=torch.long),
                                 torch.zeros(1, a.ngram_size - 1, dtype=torch.long),
                                 torch.ones(a.ngram_size, dtype=torch.long),
                                 torch.ones(nh, dtype=torch.long),
                                 torch.zeros(nh, dtype=torch.long), a.eos_token_id,
                                 a.heads_per_ngram)
    w = {"norm_key.weight": torch.zeros(C, **bf), "norm_query.weight": torch.zeros(C, **bf),
         "norm_conv.weight": torch.zeros(C, **bf),
         "conv1d.weight": torch.zeros(C, 1, a.ple_conv_kernel_size, **bf)}
    ST = (a.ple_conv_kernel_size - 1) * a.ngram_size
    ple_decode.ple_block_decode(torch.zeros(1, 1, C, **bf), torch.zeros(1, 1, C, **bf),
                                torch.zeros(1, 1, D, **bf), w, torch.zeros(1, C, ST, **bf),
                                a.rms_norm_eps, a.ngram_size)
    assert [f.fn.__name__ for f, _, _ in rec] == ["_rows_kernel", "_block_kernel"]
    for fn, args, kwargs in rec:
        assert compile_ptx(fn, args, kwargs)
