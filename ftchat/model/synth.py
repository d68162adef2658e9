"""Synthetic qwen4_exp checkpoints in the exact real layout (`ftchat synth`).

Wrapper config.json with `text_config`, `model.language_model.*` tensors in sharded safetensors
with an index, per-expert `mlp.experts.{e}.{gate,up,down}_proj` (bf16 or NVFP4 in either dialect),
tokenizer.json + tokenizer_config.json (ChatML), generation_config.json. Deterministic per seed.

Every tensor comes from `generate`, one torch.Generator drawn in checkpoint order: the writer here
and the in-memory builder (ftchat.model.synth_memory) consume the same stream, so they agree bit
for bit when they draw from the same generator.
"""

from __future__ import annotations

import json
import os
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from ftchat.errors import FtchatError, UsageError
from ftchat.codecs import nvfp4
from ftchat.codecs.rows import RowLayout
from ftchat.model import synth_qwen3
from ftchat.model.config import ModelArgs
from ftchat.model.ple import layer_multipliers, table_rows
from ftchat.model.registry import family_of, parse_config
from ftchat.model.tokenizer import SPECIAL_OFFSETS, write_synthetic_tokenizer

PREFIX = "model.language_model."  # qwen4_exp's text prefix; the Qwen3 MoE line's is "model."
FORMATS = ("bf16", nvfp4.MODELOPT, nvfp4.COMPRESSED_TENSORS)
STORED_DTYPE = torch.bfloat16  # every float tensor of a synthetic checkpoint (experts too, in bf16)
LM_HEAD = "lm_head.weight"  # the one name outside the text prefix
DENSE = ("bf16", "nvfp4")  # the dense projections as stored: bf16, or NVFP4_DENSE in NVFP4
NVFP4_DENSE = (".linear_attn.in_proj_qkv.weight", ".linear_attn.in_proj_z.weight")  # model.md 11.5
PLE_TABLES = ("bf16", "fp8")  # the n-gram table as stored: bf16, or fp8 e4m3 with a scalar scale
PLE_FP8_SCALE = 6 / 448  # as fp32: |x| <= 6 sigma of the N(0, 1) table fits e4m3 (max 448)
SHARD = ".ngram_embedding.shard_"
MAX_LAYERS = 512  # --layers of a synthetic model (the real one has 48)


def preset_config(preset: str, layers: int | None, eos: int, vocab: int | None = None) -> dict:
    """The text_config of a preset. `tiny` covers every layer type in a few MB; `flash-next` has
    the real geometry except a smaller n-gram table (ngram_vocab_size_base 20 000, not 20 M)."""
    if layers is not None and not 2 <= layers <= MAX_LAYERS:
        raise UsageError(f"--layers {layers}: expected 2 to {MAX_LAYERS} (the PLE layer is "
                         "layer 2)")
    if preset == "tiny":
        n = 6 if layers is None else layers
        cfg = dict(vocab_size=vocab or 512, hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, hc_lowrank=16, ple_embed_dim=64,
                   ngram_vocab_size_base=1000, split_ngram_parts=4, indexer_n_heads=2,
                   indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
                   max_position_embeddings=4096, rope_theta=10000.0)
        types = ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"]
    elif preset == "flash-next":
        n = 48 if layers is None else layers
        cfg = dict(vocab_size=vocab or 248320, hidden_size=2560, num_attention_heads=24,
                   num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                   linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                   num_experts=512, num_experts_per_tok=10, moe_intermediate_size=640,
                   shared_expert_intermediate_size=640, hc_lowrank=320, ple_embed_dim=2560,
                   ngram_vocab_size_base=20_000, split_ngram_parts=128, indexer_n_heads=4,
                   indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
                   max_position_embeddings=262144, rope_theta=1e7)
        types = ["linear_attention"] * 3 + ["indexed_attention"]
    else:
        raise UsageError(f"unknown preset {preset!r}: use tiny, flash-next or one of "
                         f"{', '.join(synth_qwen3.PRESETS)}")
    theta = cfg.pop("rope_theta")
    cfg.update(
        model_type="qwen4_exp_text", num_hidden_layers=n,
        layer_types=[types[i % 4] for i in range(n)], hidden_act="silu",
        output_gate_type="sigmoid", rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
        hc_count=4, ple_layer_ids=[2], ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8,
        make_ngram_vocab_size_divisible_by=128, seed=1234, indexer_kv_heads=1,
        norm_topk_prob=True, tie_word_embeddings=False, eos_token_id=eos,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    return cfg


# ===== the config a preset writes (no tokenizer needed) =====


def preset_vocab(preset: str) -> tuple[int, int | None]:
    """(vocab size, id of <|endoftext|> or None for "the top of the range") of a preset."""
    if synth_qwen3.is_preset(preset):
        return synth_qwen3.preset_vocab(preset)
    return (512, None) if preset == "tiny" else (248320, 248044)


def special_ids(preset: str) -> dict[str, int]:
    """Token -> id of the five specials, as write_synthetic_tokenizer places them (without
    building the tokenizer: bench needs the eos id, not the tokenizer)."""
    vocab, base = preset_vocab(preset)
    if base is None:
        return {tok: vocab - 5 + i for i, tok in enumerate(SPECIAL_OFFSETS)}
    return {tok: base + off for tok, off in SPECIAL_OFFSETS.items()}


def hf_config(preset: str, layers: int | None, fmt: str, dense: str = "bf16") -> dict:
    """The config.json of a synthetic checkpoint (wrapper with text_config)."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    check_dense(dense, fmt)
    vocab, _ = preset_vocab(preset)
    if synth_qwen3.is_preset(preset):  # a text-only config, prefix "model."
        hf = synth_qwen3.hf_config(preset, layers, special_ids(preset)["<|endoftext|>"])
        if fmt != "bf16":
            hf["quantization_config"] = nvfp4.quant_config_dict(
                fmt, _unquantized_modules(dense, "model."))
        return hf
    text = preset_config(preset, layers, special_ids(preset)["<|endoftext|>"], vocab)
    hf = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
          "text_config": text, "tie_word_embeddings": False,
          "image_token_id": 248056, "video_token_id": 248057,
          "vision_start_token_id": 248053, "vision_end_token_id": 248054}
    if fmt != "bf16":
        hf["quantization_config"] = nvfp4.quant_config_dict(fmt, _unquantized_modules(dense))
    return hf


def model_args(preset: str, layers: int | None, fmt: str):
    """The family's args as read back from the checkpoint's config.json (a JSON round trip)."""
    return parse_config(json.loads(json.dumps(hf_config(preset, layers, fmt))))


def prefix_of(a) -> str:
    """The text-model prefix a synthetic checkpoint of a's family writes."""
    return PREFIX if isinstance(a, ModelArgs) else "model."


def row_layout(a: ModelArgs, fmt: str) -> RowLayout:
    """Checkpoint.row_layout() of a synthetic checkpoint: bf16 experts are stored as bf16."""
    if fmt == "bf16":
        return RowLayout("bf16", a.hidden_size, a.moe_intermediate_size, STORED_DTYPE)
    return RowLayout("nvfp4", a.hidden_size, a.moe_intermediate_size)


def generation_config(preset: str) -> dict:
    ids = special_ids(preset)
    eos = ids["<|endoftext|>"]
    return {"bos_token_id": eos, "pad_token_id": eos,
            "eos_token_id": [ids["<|im_end|>"], eos], "do_sample": False}


# ===== the tensor stream =====


def _init(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> Tensor:
    """fp32 [shape] on gen's device, drawn from gen."""
    dev = gen.device
    if kind == "linear":
        return torch.randn(shape, generator=gen, device=dev) / math.sqrt(shape[-1])
    if kind == "norm":  # zero-centred: (1 + w)
        return torch.randn(shape, generator=gen, device=dev) * 0.1
    if kind == "plain_norm":
        return 1 + torch.randn(shape, generator=gen, device=dev) * 0.1
    if kind == "conv":
        return torch.randn(shape, generator=gen, device=dev) * 0.5
    if kind == "a_log":
        return torch.empty(shape, device=dev).uniform_(1, 16, generator=gen).log()
    if kind == "dt_bias":
        return 1 + torch.randn(shape, generator=gen, device=dev) * 0.1
    if kind == "embed":
        return torch.randn(shape, generator=gen, device=dev)
    raise AssertionError(kind)


def _random_nvfp4(n: int, k: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Random codes with block scales sized so the weights have std ~ 1/sqrt(k): packed uint8
    [n, k/2] and e4m3 scales [n, k/16] on gen's device, the global fp32 [] (CPU)."""
    dev = gen.device
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    g = torch.tensor(2.0**-8)
    target = 1 / (2.93 * math.sqrt(k))  # 2.93 = RMS of the E2M1 magnitudes
    scale = torch.empty(n, k // 16, device=dev).uniform_(0.5, 1.5, generator=gen) * target / g
    return packed, scale.to(torch.float8_e4m3fn), g


Fix = Callable[[str, Tensor], Tensor]


def _keep(name: str, t: Tensor) -> Tensor:
    return t


@dataclass(frozen=True)
class DenseTensor:
    """One non-expert tensor as stored: bf16, or int64 (PLE buffers); with ple_table fp8 the
    n-gram shards are fp8 and their scale fp32. name is relative to PREFIX, except LM_HEAD."""

    name: str
    tensor: Tensor


@dataclass(frozen=True)
class ExpertTensors:
    """One routed expert, proj -> bf16 [n, k] (fmt bf16) or NVFP4 (packed, scale, global)."""

    layer: int
    index: int
    parts: dict[str, Tensor | tuple[Tensor, Tensor, Tensor]]


def generate(a: ModelArgs, fmt: str, gen: torch.Generator, fix: Fix | None = None,
             ple_table: str = "bf16") -> Iterator[DenseTensor | ExpertTensors]:
    """Every tensor of the synthetic model, in checkpoint order: the dense tensors of layer i,
    then its experts, ..., then lm_head. The order is part of the output (one generator).

    fix, if given, may replace each float tensor before it is stored (tests use it).
    ple_table "fp8": the n-gram shards (the same draws) stored as fp8 e4m3 codes of
    value / PLE_FP8_SCALE, the scale after the last shard (docs/model.md 7.4).
    """
    fix = fix or _keep
    fam = family_of(a)
    ple = {i: a.ple_layers.index(i) for i in getattr(a, "ple_layers", ())}
    specs = fam.dense_specs(a)
    last_mlp = {}  # layer -> its last MoE tensor: the layer's experts follow it
    for name in specs:
        if name.startswith("layers.") and ".mlp." in name:
            last_mlp[int(name.split(".")[1])] = name
    for name, spec in specs.items():
        if spec.init == "int64":
            t = _ple_buffer(name, a, ple)
        else:
            t = fix(name, _init(spec.shape, spec.init, gen)).to(STORED_DTYPE)
        if ple_table == "fp8" and SHARD in name:
            yield from _fp8_shard(name, t, a)
            continue
        yield DenseTensor(name, t)
        if name.startswith("layers.") and last_mlp.get(int(name.split(".")[1])) == name:
            layer = int(name.split(".")[1])
            for e in range(a.num_experts):
                yield ExpertTensors(layer, e, _expert(layer, e, a, fmt, gen, fix))
    head = _init((a.vocab_size, a.hidden_size), "linear", gen)
    yield DenseTensor(LM_HEAD, fix(LM_HEAD, head).to(STORED_DTYPE))


def _fp8_shard(name: str, t: Tensor, a: ModelArgs) -> Iterator[DenseTensor]:
    """A bf16 table shard as saturated fp8 e4m3 codes of t / scale; after the last shard, the
    scale (fp32 scalar `...ngram_embedding.weight_scale`)."""
    scale = torch.tensor(PLE_FP8_SCALE, dtype=torch.float32)
    codes = (t.float() / scale.to(t.device)).clamp(-448, 448).to(torch.float8_e4m3fn)
    yield DenseTensor(name, codes)
    table, j = name.split(SHARD)
    if j == f"{a.split_ngram_parts - 1}.weight":
        yield DenseTensor(table + ".ngram_embedding.weight_scale", scale)


def _ple_buffer(name: str, a: ModelArgs, ple: dict[int, int]) -> Tensor:
    layer = int(name.split(".")[1])
    primes, offsets, _ = table_rows(a, ple[layer])
    if name.endswith("layer_multipliers"):
        vals = layer_multipliers(a.vocab_size, a.ngram_size, ple[layer], a.seed)
    else:
        vals = primes if name.endswith("vocab_sizes") else offsets
    return torch.tensor(vals, dtype=torch.int64)


def _expert(layer: int, e: int, a: ModelArgs, fmt: str, gen: torch.Generator, fix: Fix
            ) -> dict[str, Tensor | tuple[Tensor, Tensor, Tensor]]:
    parts: dict[str, Tensor | tuple[Tensor, Tensor, Tensor]] = {}
    fam = family_of(a)
    for proj, (n, k) in fam.expert_specs(a).items():
        if fmt == "bf16":
            base = prefix_of(a) + fam.expert_name(layer, e, proj)
            parts[proj] = fix(base, _init((n, k), "linear", gen)).to(STORED_DTYPE)
        else:
            parts[proj] = _random_nvfp4(n, k, gen)
    return parts


# ===== the checkpoint writer =====


def _file_mode() -> int:
    """The mode a new file gets under the process umask (os.umask reads it only by setting it)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


class _ShardWriter:
    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.mode = _file_mode()  # safetensors writes 0600; the shards match the other files
        self.pending: dict[str, Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.size + nbytes > self.max_bytes:  # a shard's payload stays within max_bytes
            self.flush()
        self.pending[name] = t.contiguous()
        self.size += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        (self.folder / name).chmod(self.mode)
        self.files.append((name, list(self.pending)))
        self.total += self.size
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        n, weight_map = len(self.files), {}
        for i, (tmp, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / tmp).rename(self.folder / final)
            weight_map.update({t: final for t in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_checkpoint(out: str | Path, preset: str = "tiny", layers: int | None = None,
                     fmt: str = "bf16", seed: int = 0, max_shard_bytes: int | None = None,
                     progress: Callable[[int, int], None] | None = None,
                     weights_fn: Callable[[str, Tensor], Tensor] | None = None,
                     ple_table: str = "bf16", dense: str = "bf16") -> Path:
    """Write a complete synthetic checkpoint to `out` (a new folder; replaced only on success).

    weights_fn, if given, may replace each float tensor before it is written (tests use it).
    ple_table: the n-gram table as stored, bf16 (the default) or fp8 with a scale (`generate`).
    dense: "nvfp4" stores the GDN qkv and z projections (NVFP4_DENSE) quantized in fmt's
    dialect, as the real checkpoint does (docs/model.md 11.5; the loader keeps them NVFP4).
    """
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    check_dense(dense, fmt)
    if ple_table not in PLE_TABLES:
        raise UsageError(f"unknown PLE table {ple_table!r}: use one of {', '.join(PLE_TABLES)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FtchatError(f"{out}: exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".synth-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        _write(tmp, preset, layers, fmt, seed, max_shard_bytes, progress, weights_fn, ple_table,
               dense)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(folder: Path, preset: str, layers: int | None, fmt: str, seed: int,
           max_shard_bytes: int | None, progress, weights_fn, ple_table: str = "bf16",
           dense: str = "bf16") -> None:
    vocab, special_base = preset_vocab(preset)
    specials = write_synthetic_tokenizer(folder, vocab, special_base)
    # special_ids is what the in-memory model uses for eos: it must place them the same way
    assert specials == special_ids(preset), (specials, special_ids(preset))
    hf = hf_config(preset, layers, fmt, dense)
    a = parse_config(hf)
    prefix = prefix_of(a)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(generation_config(preset), indent=2))

    limit = max_shard_bytes or (1 << 20 if preset.endswith("tiny") else 4 << 30)
    w = _ShardWriter(folder, limit)
    gen = torch.Generator().manual_seed(seed)
    for item in generate(a, fmt, gen, weights_fn, ple_table):
        if isinstance(item, DenseTensor) and quantized_dense(item.name, dense):
            base = prefix + item.name[: -len(".weight")]
            for name, x in nvfp4.to_checkpoint(fmt, base, *nvfp4.quantize(item.tensor.float())
                                               ).items():
                w.add(name, x)
            continue
        if isinstance(item, DenseTensor):
            w.add(item.name if item.name == LM_HEAD else prefix + item.name, item.tensor)
            continue
        _add_expert(w, item, fmt, prefix, family_of(a).expert_name)
        if progress and item.index == a.num_experts - 1:
            progress(item.layer + 1, a.num_hidden_layers)
    w.finish()


def _add_expert(w: _ShardWriter, item: ExpertTensors, fmt: str, prefix: str,
                expert_name: Callable[[int, int, str], str]) -> None:
    for proj, t in item.parts.items():
        base = prefix + expert_name(item.layer, item.index, proj)
        if fmt == "bf16":
            w.add(base + ".weight", t)
        else:
            for name, x in nvfp4.to_checkpoint(fmt, base, *t).items():
                w.add(name, x)


def check_dense(dense: str, fmt: str) -> None:
    if dense not in DENSE:
        raise UsageError(f"unknown dense format {dense!r}: use one of {', '.join(DENSE)}")
    if dense == "nvfp4" and fmt == "bf16":
        raise UsageError("NVFP4 dense projections need an NVFP4 format: give --format "
                         f"{nvfp4.MODELOPT} or {nvfp4.COMPRESSED_TENSORS}")


def quantized_dense(name: str, dense: str) -> bool:
    return dense == "nvfp4" and name.startswith("layers.") and name.endswith(NVFP4_DENSE)


def _unquantized_modules(dense: str = "bf16", m: str = PREFIX) -> list[str]:
    """What stays bf16 in synthetic NVFP4 checkpoints (text prefix m): everything but the routed
    experts, or (dense "nvfp4") also but the GDN qkv and z projections, as the real checkpoint
    stores them."""
    gdn = ([f"{m}*.linear_attn.{n}" for n in ("in_proj_b", "in_proj_a", "out_proj", "conv1d",
                                              "norm")]
           if dense == "nvfp4" else [f"{m}*.linear_attn*"])
    return ["lm_head", f"{m}embed_tokens", *gdn, f"{m}*.self_attn*", f"{m}*.ple*",
            f"{m}*hyper_connection*", f"{m}*.mlp.gate", f"{m}*.mlp.shared_expert*"]
