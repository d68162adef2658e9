"""The token embedding in pinned host memory (ftchat/model/embedding.py): the lookup kernel (the
PLE gather with one head) against indexing, the loaders' placement on CUDA, and decode with the
host table, eager and inside a CUDA graph, against the same model with the table on the device.

    on the device (CUDA):        pytest -m gpu tests/gpu/test_embedding_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_embedding_gpu.py
(the interpreter runs the kernel test only; the others need CUDA). Every comparison is bit for
bit: the kernel copies the table's values (no scale; a cast to the same dtype).
Controls: a changed host row changes that token's logits, also under graph replay.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ftchat.engine import Decoder, decode, generate, graph_safe, load_model, resident_backend
from ftchat.kernels import HAS_TRITON, ple_gather
from ftchat.model import embedding
from ftchat.model.qwen4_exp import Weights
from ftchat.model.synth_memory import synthetic_model

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE") or ("cpu" if INTERPRET else "cuda")
needs_cuda = pytest.mark.skipif(DEVICE == "cpu", reason="host placement and graphs need CUDA")
PROMPTS = [[3, 17, 99, 4, 250, 31, 7], [9, 120, 44, 2]]
STEPS = 16


@pytest.fixture(autouse=True)
def _triton():
    assert HAS_TRITON, "these tests need triton"
    if DEVICE == "cpu":
        assert INTERPRET, "FTCHAT_TEST_DEVICE=cpu needs TRITON_INTERPRET=1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3,), (2, 5), (1, 1)])
@pytest.mark.parametrize("D", [48, 2560])
def test_lookup_kernel_equals_indexing(dtype, shape, D):
    gen = torch.Generator().manual_seed(D + len(shape))
    table = torch.randn(1000, D, generator=gen).to(dtype)
    tokens = torch.randint(0, 1000, shape, generator=gen)
    tokens[..., 0] = 999  # the last row
    want = table[tokens]
    if DEVICE == "cuda":
        host, tokens = embedding.to_host(table), tokens.cuda()
        assert host.is_pinned() and host.device.type == "cpu"
        got = embedding.embed(host, tokens.int())  # int32 tokens too
        assert got.is_cuda
    else:  # the interpreter: the kernel on CPU tensors
        got = ple_gather.gather_triton(table, None, tokens[..., None], dtype)
    assert got.shape == (*shape, D) and torch.equal(got.cpu(), want)


def _device_copy(m):
    # the same model with the embedding on the device (other tensors shared)
    t = dict(m.weights.tensors)
    t[embedding.EMBED] = t[embedding.EMBED].to(m.device)
    return dataclasses.replace(m, weights=Weights(t, m.args.num_hidden_layers))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from ftchat.model.synth import write_checkpoint

    folder = write_checkpoint(tmp_path_factory.mktemp("emb") / "ck", "tiny", fmt="bf16", seed=4)
    host = load_model(folder, DEVICE, torch.bfloat16)
    return host, _device_copy(host)


def _run(m, graph: bool):
    steps = list(generate(m, PROMPTS, STEPS, resident_backend(m), graph=graph))
    return [s.tokens for s in steps], torch.stack([s.logits for s in steps]).cpu()


@needs_cuda
def test_loaders_keep_the_embedding_pinned_on_the_host(models):
    host, dev = models
    for m in (host, synthetic_model("tiny", 2, "nvfp4-modelopt", "cuda", torch.bfloat16)):
        t = m.weights[embedding.EMBED]
        assert t.device.type == "cpu" and t.is_pinned()
        assert m.weights["lm_head.weight"].is_cuda  # the rest stays on the device
    assert dev.weights[embedding.EMBED].is_cuda


@needs_cuda
def test_decode_with_the_host_embedding_equals_the_device_one(models):
    host, dev = models
    assert graph_safe(host)
    (tok_h, log_h), (tok_d, log_d) = _run(host, False), _run(dev, False)
    assert tok_h == tok_d and torch.equal(log_h, log_d)
    dec = Decoder(host, resident_backend(host), len(PROMPTS), 64, graph=True)
    assert dec.graph is not None
    tok_g, log_g = _run(host, True)
    assert tok_g == tok_h and torch.equal(log_g, _run(dev, True)[1])


@needs_cuda
def test_control_a_changed_host_row_is_seen_under_replay(models):
    host, _ = models
    dec = Decoder(host, resident_backend(host), len(PROMPTS), 64, graph=True)
    table = host.weights[embedding.EMBED]

    def logits(change: bool) -> list[torch.Tensor]:
        # every step's logits; with change, every row negated after the prefill (replays only)
        dec.reset()
        out = []
        try:
            for s in decode(dec, PROMPTS, [0] * len(PROMPTS), [STEPS] * len(PROMPTS)):
                out.append(s.logits.cpu())
                if change and len(out) == 1:
                    table.neg_()
        finally:
            if change:
                table.neg_()
        return out

    before, after = logits(False), logits(True)
    assert torch.equal(after[0], before[0])
    assert not torch.equal(after[1], before[1])  # the replay read the changed host table
    assert all(torch.equal(x, y) for x, y in zip(logits(False), before, strict=True))
