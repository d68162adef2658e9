"""`ftchat info`: geometry, bytes and how many expert slots fit, without loading any weights.

Everything comes from config.json, the safetensors headers and the row layout.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from ftchat.errors import ModelError
from ftchat.model.checkpoint import Checkpoint
from ftchat.model.spec import dense_specs

DEFAULT_VRAM_GIB = (16.0, 24.0, 32.0, 80.0)
GPU_DTYPE = torch.bfloat16  # what dense weights take on CUDA (--dtype auto)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError


def header_bytes(path: Path) -> dict[str, int]:
    """Tensor name -> stored bytes, from a safetensors header (8-byte length, then JSON)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            size = path.stat().st_size
            if n > size - 8:  # random bytes: a length that would read gigabytes
                raise ValueError(f"header length {n:,} B, but the file has {size:,} B")
            header = json.loads(f.read(n))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            struct.error) as e:
        raise ModelError(f"{path}: unreadable safetensors header ({e}); the file is damaged: "
                         "download it again") from None


def dense_gpu_bytes(ck: Checkpoint) -> tuple[int, int]:
    """(bytes on the GPU, bytes of the n-gram table kept in host memory) at GPU_DTYPE."""
    a, size = ck.args, torch.empty((), dtype=GPU_DTYPE).element_size()
    gpu = host = 0
    for name, spec in dense_specs(a).items():
        n = 1
        for s in spec.shape:
            n *= s
        if ".ngram_embedding.shard_" in name:
            host += n * size
        else:
            gpu += n * (8 if spec.init == "int64" else size)
    return gpu + a.vocab_size * a.hidden_size * size, host  # + lm_head


def slots_that_fit(vram_gib: float, dense: int, row: int, total: int) -> int:
    return max(0, min(total, int((vram_gib * 2**30 - dense) // row)))


def info_lines(folder: Path, vram_gib: list[float] | None = None) -> list[str]:
    """The report, one line per fact."""
    ck = Checkpoint(folder)
    ck.check_shapes()  # the figures below come from config.json: it must match the weights
    a, layout = ck.args, ck.row_layout()
    n_attn = sum(a.is_attention(i) for i in range(a.num_hidden_layers))
    pattern = "".join("A" if a.is_attention(i) else "G" for i in range(a.num_hidden_layers))
    row, n_rows = layout.nbytes, a.num_hidden_layers * a.num_experts
    dense, ngram = dense_gpu_bytes(ck)
    stored = {}
    for path in sorted(set(ck.files.values())):
        stored.update(header_bytes(path))
    disk_experts = sum(b for k, b in stored.items() if ".mlp.experts." in k)
    ple = ", ".join(str(i) for i in a.ple_layer_ids) or "none"
    lines = [
        f"model        {folder}",
        f"format       {ck.format} (model_type {ck.hf_config.get('model_type')})",
        f"layers       {a.num_hidden_layers}: {a.num_hidden_layers - n_attn} GDN (linear_attention)"
        f", {n_attn} attention (indexed_attention); PLE at layer(s) {ple}",
        f"pattern      {pattern}  (G = GDN, A = attention)",
        f"geometry     hidden {a.hidden_size}, vocab {a.vocab_size}, {a.num_experts} experts "
        f"top-{a.num_experts_per_tok}, expert inner {a.moe_intermediate_size}, shared expert "
        f"inner {a.shared_expert_intermediate_size}, {a.hc_count} hyper-connection streams",
        f"context      {a.max_position_embeddings} (max_position_embeddings)",
        f"expert row   {row:,} B ({layout.kind})",
        f"experts      {n_rows:,} rows = {human(n_rows * row)} in host memory",
        f"dense        {human(dense)} on the GPU at bfloat16, plus the n-gram table "
        f"{human(ngram)} in host memory",
        f"on disk      {human(sum(stored.values()))} in {len(set(ck.files.values()))} shard(s): "
        f"{human(disk_experts)} experts, {human(sum(stored.values()) - disk_experts)} dense",
    ]
    for gib in vram_gib or DEFAULT_VRAM_GIB:
        n = slots_that_fit(gib, dense, row, n_rows)
        note = "all experts fit" if n == n_rows else f"{n / n_rows:.1%} of the experts"
        lines.append(f"slots        {gib:g} GiB VRAM: {n:,} slots ({note}; after the dense "
                     "weights, before KV cache and activations)")
    return lines
