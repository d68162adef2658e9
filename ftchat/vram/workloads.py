"""What a command allocates, from its settings (run, verify, bench), the plan's inputs (a
checkpoint's headers, a synthetic preset), and the budget on CUDA: the process cap before
loading, the peak report after."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ftchat.codecs.rows import RowLayout
from ftchat.errors import SettingsError, UsageError
from ftchat.model import synth
from ftchat.model.checkpoint import Checkpoint
from ftchat.settings import Settings
from ftchat.sizes import DEFAULT_CONTEXT, PREFILL_CHUNK
from ftchat.vram.items import GIB, MIB, VramPlan, Workload
from ftchat.vram.search import check

PROMPT_BOUND = 512  # verify's cold prompts (a nonce and a short question) are far shorter


# ===== inputs: a checkpoint folder, a synthetic preset =====


def checkpoint_inputs(folder: str | Path) -> tuple[object, RowLayout]:
    """Args and row layout from config.json and the safetensors headers (no tensor read)."""
    ck = Checkpoint(folder)
    ck.check_shapes()  # the plan comes from config.json: it must describe these weights
    return ck.args, ck.row_layout()


def checkpoint_dense_nvfp4(folder: str | Path) -> bool:
    """Whether loading `folder` keeps the GDN qkv / z in NVFP4 (Workload.dense_nvfp4), from the
    safetensors headers."""
    return Checkpoint(folder).kept_nvfp4()


def synthetic_inputs(preset: str, layers: int | None, fmt: str, dense: str = "bf16"
                     ) -> tuple[object, RowLayout]:
    """Args and row layout of the model `ftchat synth` (or bench --synthetic) would build."""
    if fmt not in synth.FORMATS:
        raise UsageError(f"--format {fmt!r}: expected {', '.join(synth.FORMATS)}")
    synth.check_dense(dense, fmt)
    a = synth.model_args(preset, layers, fmt)
    return a, synth.row_layout(a, fmt)


# ===== settings -> workload =====


def run_context(a, settings: Settings | None) -> int:
    """The KV capacity a session gives: --context, else the model's maximum up to
    DEFAULT_CONTEXT."""
    given = settings.context if settings is not None else None
    return given or min(a.max_position_embeddings, DEFAULT_CONTEXT)


def given_slots(settings: Settings, layout: RowLayout) -> int | None:
    """--slots, or the slots --expert-vram buys; None: sized to fit."""
    if settings.slots is not None:
        return settings.slots
    if settings.expert_vram_gib is not None:
        return int(settings.expert_vram_gib * GIB // layout.nbytes)
    return None


def run_workload(a, layout: RowLayout, settings: Settings) -> Workload:
    """What `ftchat run` (a Session) allocates: one decoder per batch size a chunk of piped
    prompts takes, each kept (1..B rows), one slot bank, prefill in chunks of --prefill-chunk."""
    cuda = settings.torch_device().type == "cuda"
    L = run_context(a, settings)
    T = min(settings.prefill_chunk or PREFILL_CHUNK, L)
    return Workload(L, tuple(range(1, settings.batch_size + 1)), (given_slots(settings, layout),),
                    T, cuda, cuda and settings.use_graph(),
                    candidates=settings.candidates, kv_cache_dtype=settings.kv_cache_dtype)


def verify_workload(a, layout: RowLayout, settings: Settings, max_new: int,
                    arms: int = 2, batch: int = 1) -> Workload:
    """verify: a backend per arm alive together (the last group's `on` while the next `off` is
    built; verify --graph adds two kept arms), short sequences of `batch` rows, eager."""
    cuda = settings.torch_device().type == "cuda"
    L = settings.context or max_new + PROMPT_BOUND
    return Workload(L, (batch,), (given_slots(settings, layout),) * arms, min(PREFILL_CHUNK, L),
                    cuda, cuda and settings.graph is True, candidates=settings.candidates,
                    kv_cache_dtype=settings.kv_cache_dtype)


def bench_workload(a, layout: RowLayout, base: Settings,
                   arms: list[Settings | None], max_len: int) -> Workload:
    """bench: every arm's decoder (1 row) and backend alive together, each decoding from one
    token prefilled at the context; resident arms (None) share every row on the device."""
    cuda = base.torch_device().type == "cuda"
    offload = [s for s in arms if s is not None]
    return Workload(max_len, (1,) * len(arms), tuple(given_slots(s, layout) for s in offload), 1,
                    cuda, cuda and any((s or base).use_graph() for s in arms),
                    resident_rows=cuda and len(offload) < len(arms),
                    candidates=max((s.candidates for s in offload), default=base.candidates),
                    # fp8 only when every arm stores fp8 (mixed arms: planned at the larger)
                    kv_cache_dtype="fp8" if all((s or base).kv_cache_dtype == "fp8" for s in arms)
                    else "auto")


# ===== the budget =====


def budget_bytes(settings: Settings) -> int | None:
    return None if settings.vram_budget_gib is None else int(settings.vram_budget_gib * GIB)


def preflight(a, layout: RowLayout, settings: Settings, w: Workload) -> VramPlan:
    """Before loading: refuse what cannot fit (FtchatError) and, on CUDA, cap the process at the
    budget, so that every later allocation stays inside it."""
    p = check(a, layout, settings.torch_dtype(), w, budget_bytes(settings))
    if settings.vram_budget_gib is not None and w.cuda:
        cap_process(settings.torch_device(), budget_bytes(settings))
    return p


def budget_slots(a, layout: RowLayout, dtype: torch.dtype, device: torch.device,
                 dense_nvfp4: bool, settings: Settings) -> int:
    """engine.num_slots under --vram-budget: the run plan's slots for a model loaded on `device`
    (dense_nvfp4: with the GDN qkv / z kept in NVFP4)."""
    cuda = device.type == "cuda"
    w = run_workload(a, layout, settings)
    w = dataclasses.replace(w, cuda=cuda, graphs=w.graphs and cuda, dense_nvfp4=dense_nvfp4)
    return check(a, layout, dtype, w, budget_bytes(settings)).slots


# ===== CUDA only (tested with torch.cuda stubbed: no GPU in CI) =====


def cap_process(device: torch.device, budget: int) -> None:
    """Every allocation of the caching allocator (graph pools included) stays inside `budget`."""
    # "cuda" names the current device; set_per_process_memory_fraction wants its index
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if budget > total:
        raise SettingsError(f"--vram-budget {budget / GIB:.4g} GiB: more than the device's "
                            f"{total / GIB:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(budget / total, index)


PEAK_KEYS = ("vram_peak_allocated_mib", "vram_peak_reserved_mib", "vram_budget_mib")


def peak_report(device: torch.device, budget: int | None) -> dict[str, float | None]:
    """Peak allocated and reserved since the start (graph pools are reserved memory) in MiB,
    against the budget; every value None off CUDA."""
    if device.type != "cuda":
        return dict.fromkeys(PEAK_KEYS)
    return {"vram_peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
            "vram_peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB,
            "vram_budget_mib": None if budget is None else budget / MIB}
