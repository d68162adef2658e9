"""`ftchat info`: geometry, bytes and how many expert slots fit, without loading any weights.

Everything comes from config.json, the safetensors headers and the row layout.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

import torch
from rich.console import Console
from rich.table import Table

from ftchat.codecs.rows import RowLayout
from ftchat.errors import FtchatError, ModelError, UsageError, check_positive
from ftchat.model.checkpoint import Checkpoint
from ftchat.model.config import ModelArgs, check_context
from ftchat.model.registry import family_of
from ftchat.resolve import resolve_model
from ftchat.settings import MAX_BATCH, MAX_GIB, context_tokens
from ftchat.sizes import PREFILL_CHUNK
from ftchat.vram import search
from ftchat.vram.items import GIB, Workload
from ftchat.vram.plan import plan
from ftchat.vram.workloads import (checkpoint_dense_nvfp4, checkpoint_inputs, run_context,
                                   synthetic_inputs)

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
    for name, spec in ck.family.dense_specs(a).items():
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


def info_lines(folder: Path, vram_gib: list[float] | None = None,
               slot_lines: bool = True) -> list[str]:
    """The report, one line per fact; slot_lines: the slots per budget after the dense weights
    (the VRAM plan replaces them)."""
    ck = Checkpoint(folder)
    ck.check_shapes()  # the figures below come from config.json: it must match the weights
    a, layout = ck.args, ck.row_layout()
    row, n_rows = layout.nbytes, a.num_hidden_layers * a.num_experts
    dense, ngram = dense_gpu_bytes(ck)
    stored = {}
    for path in sorted(set(ck.files.values())):
        stored.update(header_bytes(path))
    disk_experts = sum(b for k, b in stored.items() if ".mlp.experts." in k)
    lines = [
        f"model        {folder}",
        f"format       {ck.format} (model_type {ck.hf_config.get('model_type')})",
        *ck.family.describe(a),
        f"context      {a.max_position_embeddings} (max_position_embeddings)",
        f"expert row   {row:,} B ({layout.kind})",
        f"experts      {n_rows:,} rows = {human(n_rows * row)} in host memory",
        f"dense        {human(dense)} on the GPU at bfloat16"
        + (f", plus the n-gram table {human(ngram)} in host memory" if ngram else ""),
        f"on disk      {human(sum(stored.values()))} in {len(set(ck.files.values()))} shard(s): "
        f"{human(disk_experts)} experts, {human(sum(stored.values()) - disk_experts)} dense",
    ]
    for gib in (vram_gib or DEFAULT_VRAM_GIB) if slot_lines else ():
        n = slots_that_fit(gib, dense, row, n_rows)
        note = "all experts fit" if n == n_rows else f"{n / n_rows:.1%} of the experts"
        lines.append(f"slots        {gib:g} GiB VRAM: {n:,} slots ({note}; after the dense "
                     "weights, before KV cache and activations)")
    return lines


# ===== the VRAM plan (`info --context/--batch-size/--slots/--prefill`, docs/design.md 4.9) =====


def info_command(model: str | None, vram: list[float] | None, context: str | None,
                 batch: int | None, slots: int | None, prefill: int | None,
                 synthetic: str | None, layers: int | None, fmt: str, env: Mapping[str, str],
                 out: TextIO, kv_cache_dtype: str = "auto", kv_given: bool = False,
                 dense: str = "bf16") -> int:
    """`ftchat info`: the report, and the VRAM plan when a plan option is given (kv_given:
    --kv-cache-dtype was; kv_cache_dtype: the resolved setting, auto or fp8)."""
    for gib in vram or []:
        if not 0 < gib <= MAX_GIB:  # nan and inf too; past it, the bytes overflow
            raise UsageError(f"--vram {gib}: expected a positive number of GiB, at most "
                             f"{MAX_GIB:,}")
    check_positive(("--batch-size", batch), ("--slots", slots), ("--prefill", prefill))
    if batch is not None and batch > MAX_BATCH:
        raise UsageError(f"--batch-size {batch}: expected 1 to {MAX_BATCH:,}")
    if synthetic is not None and model is not None:
        raise UsageError("give MODEL or --synthetic, not both")
    if synthetic is None and (layers is not None or dense != "bf16"):
        raise UsageError("--layers and --dense need --synthetic")
    planned = kv_given or synthetic is not None or any(x is not None for x in (
        context, batch, slots, prefill))
    # a bad value ("" too) before any output
    L = context_tokens(context) if context is not None else None
    if synthetic is not None:
        a, layout = synthetic_inputs(synthetic, layers, fmt, dense)
        lines = synthetic_lines(a, layout, synthetic, fmt)
        dense_nvfp4 = dense == "nvfp4"
    else:
        path = resolve_model(model, env).path
        lines = info_lines(path, vram, slot_lines=not planned)
        a, layout = checkpoint_inputs(path) if planned else (None, None)
        dense_nvfp4 = planned and checkpoint_dense_nvfp4(path)
    if planned:
        L = L or run_context(a, None)
        check_context(a, L)
    out.write("\n".join(lines) + "\n")
    if planned:
        w = Workload(L, tuple(range(1, (batch or 1) + 1)), (slots,),
                        min(prefill or PREFILL_CHUNK, L), kv_cache_dtype=kv_cache_dtype,
                        dense_nvfp4=dense_nvfp4)
        print_plan(a, layout, vram or list(DEFAULT_VRAM_GIB), w, out)
    return 0


def synthetic_lines(a, layout: RowLayout, preset: str, fmt: str) -> list[str]:
    """The geometry lines of a synthetic layout (`info --synthetic`): nothing is on disk."""
    n_rows = a.num_hidden_layers * a.num_experts
    return [
        f"model        synthetic {preset}, {a.num_hidden_layers} layers, {fmt} experts (in "
        "memory, as bench --synthetic builds it)",
        *family_of(a).describe(a),
        f"context      {a.max_position_embeddings} (max_position_embeddings)",
        f"expert row   {layout.nbytes:,} B ({layout.kind})",
        f"experts      {n_rows:,} rows = {human(n_rows * layout.nbytes)} in host memory",
    ]


def print_plan(a: ModelArgs, layout: RowLayout, vram_gib: list[float], w: Workload,
               out: TextIO) -> None:
    """The plan's items as a rich table (bf16 on CUDA, as `run` there), then one line per
    budget: the slots that fit, or the item that does not."""
    given = w.banks[0]
    shown = given  # the slot count the table is at: given, else the first budget's (if any fit)
    if given is None and vram_gib:
        shown = search.slots_that_fit(a, layout, GPU_DTYPE, w, int(vram_gib[0] * GIB)) or None
    p = plan(a, layout, GPU_DTYPE, w, shown or 0)
    rows = ", ".join(map(str, w.decoders))
    kv = ", K/V cache fp8" if w.kv_cache_dtype == "fp8" else ""
    table = Table(title=f"VRAM plan: context {w.context:,}, decoder rows {rows}, prefill "
                  f"{min(w.prefill_tokens, w.context):,} tokens per call, bfloat16{kv}, CUDA "
                  f"graphs {'on' if w.graphs else 'off'}; GiB = 2^30 B", title_justify="left")
    for col, just in (("item", "left"), ("GiB", "right"), ("bytes", "right"), ("how", "left"),
                      ("note", "left")):
        table.add_column(col, justify=just)
    for it in p.items[:-1]:
        table.add_row(it.name, f"{it.nbytes / GIB:.3f}", f"{it.nbytes:,}",
                      "exact" if it.exact else "estimate", it.note)
    bank = p.items[-1]
    per = plan(a, layout, GPU_DTYPE, w, 1).total - plan(a, layout, GPU_DTYPE, w, 0).total
    if shown is None:
        table.add_row("total before the slots", f"{p.total / GIB:.3f}", f"{p.total:,}", "",
                      f"everything above, plus the slot bank's sink row ({layout.nbytes:,} B)")
    else:
        table.add_row(bank.name, f"{bank.nbytes / GIB:.3f}", f"{bank.nbytes:,}", "exact",
                      bank.note)
        table.add_row("total", f"{p.total / GIB:.3f}", f"{p.total:,}", "",
                      "" if given is not None else f"at the slots that fit {vram_gib[0]:g} GiB")
    if given is None:
        table.add_row("per expert slot", f"{per / GIB:.5f}", f"{per:,}", "exact",
                      f"one {layout.kind} row ({layout.nbytes:,} B) + its id_of/key entries")
    Console(file=out, width=None if out.isatty() else 170).print(table)
    for gib in vram_gib:
        out.write(_budget_line(a, layout, w, gib) + "\n")


def _budget_line(a: ModelArgs, layout: RowLayout, w: Workload, gib: float) -> str:
    budget = int(gib * GIB)
    try:
        p = search.check(a, layout, GPU_DTYPE, w, budget, flag="")
    except FtchatError as e:
        return str(e)  # "16 GiB does not fit ...", or a refused --slots
    n_rows = a.num_hidden_layers * a.num_experts
    left = (budget - p.total) / GIB
    if w.banks[0] is not None:
        return (f"{gib:g} GiB: {p.slots:,} slots fit ({left:.2f} GiB left over), plan total "
                f"{p.total / GIB:.2f} GiB")
    share = "all experts fit" if p.slots == n_rows else f"{p.slots / n_rows:.1%} of the experts"
    return (f"{gib:g} GiB: {p.slots:,} slots fit ({share}; slot bank "
            f"{p.items[-1].nbytes / GIB:.2f} GiB, plan total {p.total / GIB:.2f} GiB, "
            f"{left:.2f} GiB left over)")
