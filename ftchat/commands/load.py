"""Loading a model for a measuring command (`verify`, `audit`, `bench`): its VRAM plan checked
before the weights load, and the planned slot count pinned for the backends built after."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TextIO

from ftchat.codecs.rows import RowLayout
from ftchat.engine import LoadedModel, load_model
from ftchat.kernels.config import KernelConfig
from ftchat.model.config import ModelArgs, check_context
from ftchat.model.registry import load_args
from ftchat.model.tokenizer import Tokenizer
from ftchat.resolve import demo_notice, resolve_model
from ftchat.settings import Settings
from ftchat.ui.progress import progress_bar
from ftchat.vram import workloads
from ftchat.vram.items import VramPlan, Workload

# (model args, expert row layout) -> the Workload the VRAM plan checks
WorkloadOf = Callable[[ModelArgs, RowLayout], Workload]


def preflight(a: ModelArgs, layout: RowLayout, settings: Settings,
              w: Workload) -> VramPlan | None:
    """The VRAM plan checked before loading, when something is asked of it (a budget, a slot
    count); None otherwise (slots are sized after loading)."""
    if settings.vram_budget_gib is None and all(s is None for s in w.banks):
        return None
    return workloads.preflight(a, layout, settings, w)


def pin_planned_slots(settings: Settings, plan: VramPlan | None) -> Settings:
    """Under a budget, the planned slot count: the backends built later hold several banks at
    once, which engine.num_slots (one bank) does not know."""
    if plan is None or settings.vram_budget_gib is None or settings.slots is not None \
            or settings.expert_vram_gib is not None:
        return settings
    return dataclasses.replace(settings, slots=plan.slots)


def load_checked(model: str | None, settings: Settings, env: Mapping[str, str], err: TextIO,
                 work: WorkloadOf | None = None
                 ) -> tuple[LoadedModel, Tokenizer, VramPlan | None]:
    """(model, tokenizer, plan): `work` gives the Workload the VRAM plan checks before the
    weights load (None: no plan). The weights hold the settings' KernelConfig."""
    resolved = resolve_model(model, env)
    check_context(load_args(resolved.path), settings.context)
    plan = None
    if work is not None:
        a, layout = workloads.checkpoint_inputs(resolved.path)
        w = dataclasses.replace(work(a, layout),
                                dense_nvfp4=workloads.checkpoint_dense_nvfp4(resolved.path))
        plan = preflight(a, layout, settings, w)
    if resolved.demo:
        print(demo_notice(resolved.path), file=err)
    tok = Tokenizer.from_folder(resolved.path)
    tok.check_vocab(load_args(resolved.path).vocab_size, resolved.path)
    with progress_bar(err, "loading") as bar:
        m = load_model(resolved.path, str(settings.torch_device()), settings.torch_dtype(), bar,
                       kernels=KernelConfig.from_settings(settings))
    return m, tok, plan
