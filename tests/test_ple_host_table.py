"""The PLE n-gram table loaded whole into one host tensor (docs/model.md 7.4; the CUDA path's
placement, forced here on the CPU with PLE_ON_DEVICE_BYTES = 0 and ple_table="host").

The host table keeps the stored dtype (fp8 e4m3 with its scale, or bf16), equals the shard
contents byte for byte, and the decode reads the same values as the on-device (concatenated)
table: tokens and logits identical. Controls: a changed table byte changes the logits; a hash
buffer that points past the table is refused at load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ftchat.engine as engine
from ftchat.engine import generate, graph_safe, load_model, resident_backend
from ftchat.errors import FtchatError, ModelError
from ftchat.kernels.ple_gather import dequantize
from ftchat.model.checkpoint import Checkpoint
from ftchat.model.ngram_table import HostTable, NGramTable
from ftchat.model.synth import PLE_FP8_SCALE, write_checkpoint

NAME = "layers.1.ple.ple_embedding.ngram_embedding.weight"
FULL = "model.language_model." + NAME[: -len(".weight")]
PROMPTS = [[3, 17, 99, 4, 250, 31, 7, 507, 12], [9, 120, 44]]
STEPS = 6


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-fp8", "tiny", fmt="bf16", seed=0,
                            ple_table="fp8")


@pytest.fixture(params=["fp8", "bf16"])
def folder(request, tiny_fp8, tiny_bf16):
    return tiny_fp8 if request.param == "fp8" else tiny_bf16


def _shards(folder):
    """The table's shards as stored, in row order, and the scale (None for bf16)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    names = sorted((k for k in index if k.startswith(FULL + ".shard_")),
                   key=lambda k: int(k.split(".shard_")[1].split(".")[0]))
    parts = [load_file(str(folder / index[k]))[k] for k in names]
    scale = None
    if FULL + ".weight_scale" in index:
        with safe_open(str(folder / index[FULL + ".weight_scale"]), "pt") as f:
            scale = float(f.get_tensor(FULL + ".weight_scale"))
    return parts, scale


def _host_model(folder, monkeypatch, dtype=torch.float32, ple_table="host"):
    monkeypatch.setattr(engine, "PLE_ON_DEVICE_BYTES", 0)
    return load_model(folder, dtype=dtype, ple_table=ple_table)


def _run(m):
    steps = list(generate(m, PROMPTS, STEPS, resident_backend(m)))
    return [s.tokens for s in steps], torch.stack([s.logits for s in steps])


def test_synth_fp8_table_is_the_bf16_draws_quantized(tiny_fp8, tiny_bf16):
    (q, scale), (b, none) = _shards(tiny_fp8), _shards(tiny_bf16)
    assert none is None and scale == float(torch.tensor(PLE_FP8_SCALE, dtype=torch.float32))
    assert q[0].dtype == torch.float8_e4m3fn and b[0].dtype == torch.bfloat16
    for qi, bi in zip(q, b, strict=True):
        want = (bi.float() / torch.tensor(PLE_FP8_SCALE)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(qi.view(torch.uint8), want.view(torch.uint8))


def test_host_table_equals_the_shards(folder):
    parts, scale = _shards(folder)
    progress = []
    t = Checkpoint(folder).dense(torch.float32, table_in_place_bytes=0, table_host=True,
                                 table_progress=lambda i, n: progress.append((i, n)))[NAME]
    assert isinstance(t, HostTable) and t.scale == scale
    assert t.data.dtype == parts[0].dtype and t.data.is_contiguous()  # the stored dtype, one tensor
    stored = torch.cat(parts)
    assert torch.equal(t.data.view(torch.uint8), stored.view(torch.uint8))  # byte for byte
    assert progress == [(i + 1, len(parts)) for i in range(len(parts))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_gather_equals_the_concatenated_table(folder, dtype):
    ck = Checkpoint(folder)
    whole = ck.dense(dtype)[NAME]  # the on-device form: dequantized, concatenated
    host = ck.dense(dtype, table_in_place_bytes=0, table_host=True)[NAME]
    in_place = ck.dense(dtype, table_in_place_bytes=0)[NAME]
    rows = torch.randint(0, whole.shape[0], (3, 2, 16), generator=torch.Generator().manual_seed(0))
    rows[0, 0, 0], rows[0, 0, 1] = 0, whole.shape[0] - 1  # the first and last rows
    want = whole[rows]  # [3, 2, 16, d]
    assert torch.equal(host[rows], want) and torch.equal(in_place[rows], want)
    assert torch.equal(host.gather(rows, dtype), want.flatten(-2))
    parts, scale = _shards(folder)
    by_hand = torch.cat(parts).float()
    by_hand = (by_hand * scale if scale is not None else by_hand).to(dtype)
    assert torch.equal(whole, by_hand)  # what the reference does: fp32, x scale, one cast


def test_decode_with_the_host_table_is_the_on_device_tables(folder, monkeypatch):
    ref = load_model(folder)
    assert isinstance(ref.weights[NAME], torch.Tensor)
    host = _host_model(folder, monkeypatch)
    assert isinstance(host.weights[NAME], HostTable)
    assert graph_safe(host)  # CPU: the gather needs no host sync
    (tok_r, log_r), (tok_h, log_h) = _run(ref), _run(host)
    assert tok_h == tok_r and torch.equal(log_h, log_r)


def test_the_comparison_sees_one_changed_table_row(tiny_fp8, monkeypatch):
    """Control: the rows the first prompt token hashes to, changed by one code, change logits."""
    ref = load_model(tiny_fp8)
    host = _host_model(tiny_fp8, monkeypatch)
    t = host.weights[NAME]
    from ftchat.model.ple import ngram_rows

    w = host.weights.layers[1]["ple"]
    eos = host.args.eos_token_id
    ctx = torch.full((1, 2), eos, dtype=torch.long)
    rows = ngram_rows(torch.tensor([[PROMPTS[0][0]]]), ctx, w["ple_embedding.layer_multipliers"],
                      w["ple_embedding.ngram_heads_vocab_sizes"],
                      w["ple_embedding.ngram_heads_offsets"], eos, host.args.heads_per_ngram)
    t.data.view(torch.uint8)[rows[0, 0, 0], 0] ^= 0x08  # one mantissa bit of one value
    assert not torch.equal(_run(host)[1], _run(ref)[1])


def test_cpu_keeps_a_big_table_in_its_files(tiny_bf16, monkeypatch):
    """The CPU default (decision): memory-mapped in place, so the real table's 48 GiB never
    need RAM on a CPU run; still no graph (its gather reads files)."""
    monkeypatch.setattr(engine, "PLE_ON_DEVICE_BYTES", 0)
    m = load_model(tiny_bf16)
    assert isinstance(m.weights[NAME], NGramTable) and not graph_safe(m)
    with pytest.raises(ValueError):
        load_model(tiny_bf16, ple_table="disk")


def test_load_model_reports_table_progress(tiny_fp8, monkeypatch):
    seen = []
    monkeypatch.setattr(engine, "PLE_ON_DEVICE_BYTES", 0)
    load_model(tiny_fp8, ple_table="host", progress=lambda s, i, n: seen.append((s, i, n)))
    table = [(i, n) for s, i, n in seen if s == "ple table"]
    assert table and table == [(i + 1, table[0][1]) for i in range(table[0][1])]


def test_dequantize_is_fp32_times_scale_then_one_cast():
    """The reference's order, element by element: fp32 value, times the fp32 scale (the synth
    scale has a full significand, so the fp32 product rounds: the GPU test exercises that
    rounding), then one cast to the model dtype."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes != 0x7F) & (codes != 0xFF)].view(torch.float8_e4m3fn)  # no NaN codes
    scale = float(torch.tensor(PLE_FP8_SCALE, dtype=torch.float32))
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize(codes, scale, dtype)
        want = (codes.float() * torch.tensor(scale, dtype=torch.float32)).to(dtype)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    prod = codes.float() * scale
    assert (prod.double() != codes.double() * scale).any()  # the fp32 product is rounded


def test_hash_rows_past_the_table_are_refused(tiny_bf16, tmp_path):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(tiny_bf16, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.language_model.layers.1.ple.ple_embedding.ngram_heads_offsets"
    tensors = load_file(str(folder / index[key]))
    tensors[key] = tensors[key] + 1000  # the last head's rows run past the table's end
    save_file(tensors, str(folder / index[key]))
    with pytest.raises(ModelError, match="outside the n-gram table"):
        Checkpoint(folder).dense(torch.float32)
    with pytest.raises(FtchatError):
        load_model(folder)
