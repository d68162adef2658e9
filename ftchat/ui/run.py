"""`ftchat run`: pick the mode (interactive chat, --prompt, piped batch), load, and hand over."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import TextIO

import torch

from ftchat.errors import SettingsError
from ftchat.model.config import check_context
from ftchat.model.registry import load_args
from ftchat.resolve import demo_notice, ResolvedModel, resolve_model
from ftchat.output_file import check_outside, check_target
from ftchat.session import Session
from ftchat.generation_defaults import generation_defaults
from ftchat.settings import Settings, check_sampling_flags
from ftchat.ui.batch import Job, JobReader, LineSource, run_batch
from ftchat.ui.chat import run_chat
from ftchat.ui.panel import Screen, isatty
from ftchat.ui.progress import progress_bar
from ftchat.ui.tty import Terminal
from ftchat.vram.search import choose_prefill_chunk
from ftchat.vram.workloads import (budget_bytes, checkpoint_dense_nvfp4, checkpoint_inputs,
                                   preflight, run_workload)


def run(model: str | None, settings: Settings, env: Mapping[str, str], stdin: TextIO,
        stdout: TextIO, stderr: TextIO) -> int:
    """Chat when stdin is a terminal, else one reply per piped prompt; returns the exit code."""
    screen = Screen(stdout, stderr, settings.panel)
    resolved = resolve_model(model, env)
    # the model's generation_config.json fills the sampling settings no flag gave
    defaults = {field: value for field, value in generation_defaults(resolved.path).items()
                if getattr(settings, field) is None}
    given, settings = settings, settings.with_generation_defaults(defaults)
    check_sampling_flags(given, settings.temperature)  # the model's own may sample
    interactive = settings.prompt is None and isatty(stdin)
    jobs = None
    if settings.prompt is not None:
        jobs = JobReader(None, settings, [Job(settings.prompt, settings.system)])
    elif not interactive:
        jobs = JobReader(LineSource(stdin), settings)
        waiting = jobs.peek_ready()  # the lines already there
        if not waiting and jobs.ended:
            screen.note("ftchat: no prompts on stdin, nothing to do")
            return 0
    settings.check_graph()
    if settings.record_routing is not None:  # before loading: never truncate a file
        check_target(settings.record_routing, "--record-routing", settings.force)
        check_outside(settings.record_routing, resolved.path, "--record-routing")
    apply_threads(settings)
    session = open_session(resolved, settings, screen, interactive, defaults)
    try:
        if jobs is not None:
            code = run_batch(session, screen, jobs, settings.json,
                             one_shot=settings.prompt is not None)
        else:
            if not settings.quiet:
                screen.note("/help for commands, Ctrl-C stops a reply, Ctrl-D or /exit quits")
            code = run_chat(session, screen, settings.system, terminal=Terminal(stdin, stdout),
                            as_json=settings.json)
    except BaseException:  # an error or a signal: no result file is left half-written
        session.close(complete=False)
        raise
    session.close()
    return code


def apply_threads(settings: Settings) -> None:
    """--threads N: torch's CPU threads (intra-op), before any work; more than the machine's
    CPUs is refused (torch hangs or crashes on thousands of threads)."""
    if settings.threads is not None:
        cpus = usable_cpus()
        if settings.threads > cpus:
            raise SettingsError(f"--threads {settings.threads}: this machine gives ftchat "
                                f"{cpus} CPU{'s' if cpus > 1 else ''}; give 1 to {cpus}")
        torch.set_num_threads(settings.threads)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def plan_run(resolved: ResolvedModel, settings: Settings) -> Settings:
    """Before loading: refuse a --vram-budget the run's VRAM plan cannot fit, or a --slots
    below batch x top-k (one line), and cap the process at the budget on CUDA. Under a budget on
    CUDA with no --prefill-chunk, the chunk is chosen from the plan (`choose_prefill_chunk`);
    the settings returned carry it."""
    if settings.vram_budget_gib is None and settings.slots is None \
            and settings.expert_vram_gib is None:
        return settings  # nothing to check: slots are sized after loading (free VRAM, or CPU)
    a, layout = checkpoint_inputs(resolved.path)
    w = run_workload(a, layout, settings)
    w = dataclasses.replace(w, dense_nvfp4=checkpoint_dense_nvfp4(resolved.path))
    if settings.prefill_chunk is None and settings.vram_budget_gib is not None and w.cuda:
        chunk = choose_prefill_chunk(a, layout, settings.torch_dtype(), w, budget_bytes(settings))
        settings = dataclasses.replace(settings, prefill_chunk=chunk)
        w = dataclasses.replace(w, prefill_tokens=min(chunk, w.context))
    preflight(a, layout, settings, w)
    return settings


def open_session(resolved: ResolvedModel, settings: Settings, screen: Screen,
                 interactive: bool = True, defaults: Mapping[str, float] | None = None
                 ) -> Session:
    check_context(load_args(resolved.path), settings.context)  # before the KV cache is sized
    settings = plan_run(resolved, settings)
    quiet = settings.quiet
    if resolved.demo and not quiet:
        screen.note_words(demo_notice(resolved.path))
    t = time.perf_counter()
    with progress_bar(None if quiet else screen.err, "loading") as progress:
        session = Session.open(resolved.path, settings, progress)
    loaded = f"loaded in {time.perf_counter() - t:.1f} s"
    # warm the decoder the first reply uses: the chat's, or --prompt's one row (piped batches
    # size theirs by the lines waiting: a guess could allocate a second state for nothing)
    if session.warms_up() and (interactive or settings.prompt is not None):
        if not quiet:
            screen.note("ftchat: warming up (compiling kernels, capturing the decode graph)")
        try:
            loaded += f", warmed up in {session.warm_up(None if interactive else 1):.1f} s"
        except BaseException:
            session.close(complete=False)
            raise
    if not quiet:
        screen.note_words(f"ftchat: {resolved.name}: {session.describe()}; {loaded}")
        if defaults:  # where a reply's sampling came from when no flag chose it
            flags = {"temperature": "--temp"}
            screen.note_words("ftchat: from the model's generation_config.json: " + ", ".join(
                f"{flags.get(k, '--' + k.replace('_', '-'))} {v:g}" for k, v in defaults.items()))
    return session
