"""The option types the `ftchat` commands share (typer `Annotated` aliases), by help panel.

Every engine option defaults to None (not given): `resolve_settings` then takes the environment
variable or the default. Nothing here imports torch, so `ftchat --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ftchat.settings import Settings

_D = Settings()  # the defaults the help texts quote

GEN, MODEL, KERNELS = "Generation", "Model and memory", "Kernels"
OFFLOAD, DEBUG = "Offload tuning", "Debug"


def _model_not_a_prompt(ctx: typer.Context, model: str | None) -> str | None:
    """MODEL with a space in it that names no file: a prompt typed where the model goes (a
    repo id has no space). A usage error that says where a prompt goes, before anything runs."""
    if model is not None and any(c.isspace() for c in model) \
            and not Path(model).expanduser().exists():
        takes_prompt = any(p.name == "prompt" for p in ctx.command.params)
        raise typer.BadParameter(f"{model!r}: no such model folder, and not a Hugging Face "
                                 "repo id" + (f"; {PROMPT_HINT}" if takes_prompt else ""))
    return model


PROMPT_HINT = "give a prompt with --prompt/-p TEXT, --file/-f FILE or on stdin"


def usage_message(e: typer.TyperException) -> str:
    """Click's message; for a word after MODEL in a command that takes a prompt, where the
    prompt goes (`ftchat audit MODEL "a prompt"`)."""
    message, ctx = e.format_message(), getattr(e, "ctx", None)
    if message.startswith("Got unexpected extra argument") and ctx is not None \
            and any(p.name == "prompt" for p in ctx.command.params):
        message += f"; MODEL is the only argument: {PROMPT_HINT}"
    return message

Model = Annotated[str | None, typer.Argument(
    metavar="MODEL", show_default=False, callback=_model_not_a_prompt,
    help="Checkpoint folder or Hugging Face repo id; none: the built-in demo model.")]

# ===== generation (run) =====
Prompt = Annotated[str | None, typer.Option(
    "--prompt", "-p", metavar="TEXT", rich_help_panel=GEN, help="One prompt, one reply, exit")]
PromptFile = Annotated[Path | None, typer.Option(
    "--file", "-f", metavar="FILE", rich_help_panel=GEN,
    help="Read the one prompt from FILE (as --prompt)")]
MaxNew = Annotated[int | None, typer.Option(
    "--max-new-tokens", "-n", metavar="N", rich_help_panel=GEN,
    help=f"Tokens per reply at most (default {_D.max_new_tokens})")]
System = Annotated[str | None, typer.Option(
    metavar="TEXT", rich_help_panel=GEN, help="System message")]
Temp = Annotated[float | None, typer.Option(
    "--temp", metavar="T", rich_help_panel=GEN,
    help="Sampling temperature; 0: greedy (default, unless the model's generation_config.json "
    "samples)")]
TopK = Annotated[int | None, typer.Option(
    metavar="K", rich_help_panel=GEN, help="Sample from the K likeliest tokens (0: off)")]
TopP = Annotated[float | None, typer.Option(
    metavar="P", rich_help_panel=GEN,
    help="Sample from the likeliest tokens holding mass P (1: off)")]
MinP = Annotated[float | None, typer.Option(
    "--min-p", metavar="P", rich_help_panel=GEN,
    help="Sample only tokens at least P times as likely as the likeliest (0: off)")]
RepeatPenalty = Annotated[float | None, typer.Option(
    metavar="X", rich_help_panel=GEN,
    help="Penalize the last 64 tokens' ids by X (1: off; also when greedy; default: the "
    "model's generation_config.json, else 1)")]
Seed = Annotated[int | None, typer.Option(
    "--seed", "-s", metavar="N", rich_help_panel=GEN,
    help="Sampling seed, per reply (default: random)")]
Stop = Annotated[list[str] | None, typer.Option(
    metavar="TEXT", rich_help_panel=GEN, help="End a reply before TEXT (repeatable)")]
Json = Annotated[bool | None, typer.Option(
    "--json", metavar="", rich_help_panel=GEN, help="One JSON object per reply")]
BatchSize = Annotated[int | None, typer.Option(
    metavar="B", rich_help_panel=GEN, help="Waiting piped prompts decoded together (default 1)")]
Quiet = Annotated[bool | None, typer.Option(
    "--quiet", "-q", metavar="", rich_help_panel=GEN,
    help="No banner, loading bar or timing lines")]
Think = Annotated[bool | None, typer.Option(
    "--think/--no-think", metavar="", rich_help_panel=GEN,
    help="Reason before answering, or not: the chat template's enable_thinking switch "
    "(default: the template's)")]
Panel = Annotated[bool | None, typer.Option(
    "--panel/--no-panel", metavar="", rich_help_panel=GEN,
    help="Live panel on stderr (default: when a terminal)")]
ServeQuiet = Annotated[bool | None, typer.Option(
    "--quiet", "-q", metavar="", help="No status line, demo notice or per-request lines")]
ServePanel = Annotated[bool | None, typer.Option(
    "--panel/--no-panel", metavar="",
    help="Live status line on stderr: requests, tok/s, prefix hits (default: when a terminal)")]

# ===== model and memory =====
Context = Annotated[int | None, typer.Option(
    "--context", "-c", metavar="N", rich_help_panel=MODEL,
    help="KV capacity in tokens (default: the model's, at most 32768)")]
PrefillChunk = Annotated[int | None, typer.Option(
    "--prefill-chunk", metavar="T", rich_help_panel=MODEL,
    help="Prompt tokens per prefill call (default 1024, or under --vram-budget on a GPU the "
         "plan's choice; larger: fewer expert copies, more VRAM)")]
Device = Annotated[str | None, typer.Option(
    metavar="auto|cuda|cpu", rich_help_panel=MODEL, help="Where to run (default auto)")]
# the flag named explicitly wherever the metavar is the parameter's name in capitals: typer
# 0.27 makes such an option `--DTYPE`
Dtype = Annotated[str | None, typer.Option(
    "--dtype", metavar="DTYPE", rich_help_panel=MODEL,
    help="auto (default): bfloat16 on CUDA, float32 on CPU; or float32, bfloat16")]
KvCacheDtype = Annotated[str | None, typer.Option(
    "--kv-cache-dtype", metavar="auto|fp8", rich_help_panel=MODEL,
    help="Attention K/V cache storage: auto (the model dtype, default) or fp8 (e4m3 with a "
    "scale per token and head: about half the bytes; changes the output slightly; env "
    "FTCHAT_KV_CACHE_DTYPE)")]
Threads = Annotated[int | None, typer.Option(
    "--threads", "-t", metavar="N", rich_help_panel=MODEL,
    help="CPU threads for torch (default: torch's, one per core)")]
Slots = Annotated[int | None, typer.Option(
    metavar="N", rich_help_panel=MODEL, help="Expert slots in VRAM (or --expert-vram)")]
ExpertVram = Annotated[float | None, typer.Option(
    "--expert-vram", metavar="GIB", rich_help_panel=MODEL,
    help="VRAM for expert slots, GiB (or --slots)")]
VramBudget = Annotated[float | None, typer.Option(
    "--vram-budget", metavar="GIB", rich_help_panel=MODEL,
    help="The whole run's VRAM, GiB: slots sized by the VRAM plan, a plan that cannot fit "
    "refused before loading, the process capped on CUDA (env FTCHAT_VRAM_BUDGET)")]
Graph = Annotated[bool | None, typer.Option(
    "--graph/--eager", metavar="", rich_help_panel=MODEL,
    help="CUDA graphs (default: on CUDA)")]

# ===== kernels =====
Kernels = Annotated[str | None, typer.Option(
    "--kernels", metavar="fused|torch", rich_help_panel=KERNELS,
    help="fused (default): the Triton decode kernels on CUDA; torch: the torch reference path "
    "the kernels are tested against")]
Pdl = Annotated[bool | None, typer.Option(
    "--pdl/--no-pdl", metavar="", rich_help_panel=KERNELS,
    help="Programmatic dependent launch: a fused kernel starts while the one before it "
    "finishes (Hopper and later; default on; env FTCHAT_PDL=1|0)")]

# ===== offload tuning =====
Prefetch = Annotated[str | None, typer.Option(
    metavar="MODE", rich_help_panel=OFFLOAD,
    help="Expert prefetch: auto (default: on where experts are offloaded on a GPU and an "
    "expert is at least 256 KiB, else off), off, measure (predict and count, copy nothing) or "
    "on (env FREETOKEN_MOE_PREFETCH)")]
Budget = Annotated[str | None, typer.Option(
    metavar="N|auto", rich_help_panel=OFFLOAD,
    help="Prefetch budget before every layer; auto (default): the rows the link carries under "
    "one layer's compute, measured at run time (env FREETOKEN_MOE_PREFETCH_BUDGET)")]
BudgetGdn = Annotated[int | None, typer.Option(
    metavar="N", rich_help_panel=OFFLOAD,
    help="Budget before GDN layers (default auto)")]
BudgetAttn = Annotated[int | None, typer.Option(
    metavar="N", rich_help_panel=OFFLOAD,
    help="Budget before attention layers (default auto)")]
Candidates = Annotated[int | None, typer.Option(
    metavar="K", rich_help_panel=OFFLOAD,
    help=f"Router-lookahead candidates (env FREETOKEN_MOE_PREFETCH_K; default {_D.candidates})")]
Eviction = Annotated[str | None, typer.Option(
    metavar="MODE", rich_help_panel=OFFLOAD,  # a short metavar: the panel's env names fit 80
    help="Slot eviction: rule (default), lru, or score (by the routers' averaged logits)")]
Overlap = Annotated[bool | None, typer.Option(
    "--overlap/--no-overlap", metavar="", rich_help_panel=OFFLOAD,
    help="Shared expert overlaps the demand copy (default on)")]
CopyPrograms = Annotated[int | None, typer.Option(
    metavar="N", rich_help_panel=OFFLOAD,
    help="Copy-kernel programs, 0: cudaMemcpy (env FREETOKEN_MOE_SLIM_COPY; "
    f"default {_D.copy_programs})")]

# ===== debug =====
Verify = Annotated[str | None, typer.Option(
    metavar="meta|bytes", rich_help_panel=DEBUG,
    help="Slot checks on every step (env FREETOKEN_MOE_PREFETCH_VERIFY=meta|1)")]
AuditEvery = Annotated[int | None, typer.Option(
    "--audit-every", metavar="N", rich_help_panel=DEBUG,
    help="Byte-check the whole slot cache every N steps (env FREETOKEN_MOE_SLOT_AUDIT)")]
OldName = Annotated[int | None, typer.Option(hidden=True)]  # a flag's old name, still accepted
RecordRouting = Annotated[str | None, typer.Option(
    metavar="FILE", rich_help_panel=DEBUG,
    help="Write the routed expert ids of every step to FILE (a new file; renamed into place "
    "when the run ends)")]
Force = Annotated[bool | None, typer.Option(
    "--force", metavar="", rich_help_panel=DEBUG,
    help="Let --record-routing replace an existing file")]

# ===== synthetic models (synth, info, bench) =====
Layers = Annotated[int | None, typer.Option(metavar="N", help="Decoder layers of --synthetic")]
Format = Annotated[str, typer.Option(
    "--format", metavar="FORMAT",
    help="Expert format of --synthetic: bf16, nvfp4-modelopt or nvfp4-ct")]
Dense = Annotated[str, typer.Option(
    metavar="bf16|nvfp4", help="Dense projections of --synthetic: bf16, or the GDN qkv and z "
    "kept in NVFP4 as the real checkpoint stores them")]
Synthetic = Annotated[str | None, typer.Option(
    metavar="tiny|flash-next", help="Build a random-weight model in memory instead of MODEL")]
JsonOut = Annotated[bool, typer.Option("--json", metavar="", help="One JSON object")]

# ===== bench: what a user compares; the arms' own grammar on a page of its own =====
BenchPrefetch = Annotated[str | None, typer.Option(
    "--prefetch", metavar="LIST", help="Prefetch modes to compare, one arm each: off, measure, "
    "on, resident (every expert in VRAM) (default off,on)")]
BenchBudget = Annotated[str | None, typer.Option(
    "--budget", metavar="LIST", help="Prefetch budgets of the measure and on arms, one arm "
    "each: N or auto (default auto,1)")]
BenchContexts = Annotated[str | None, typer.Option(
    "--context", "-c", metavar="LIST", help="Context lengths, e.g. 4k,32k (default 4k, less "
    "where the model's positions need it)")]
Routing = Annotated[str, typer.Option(
    "--routing", metavar="SOURCE", help="Who routes the decode steps: model (its routers), "
    "calibrated[:default|sticky|drifting] (a seeded generator fitted to the real model's "
    "counts, docs/routing.md) or trace:FILE (a --record-routing file)")]
ARMS = "Arms"


def _help_arms(value: bool) -> None:
    if value:
        from ftchat.commands.arms_help import arms_help

        typer.echo(arms_help(), nl=False)
        raise typer.Exit()


Arms = Annotated[str | None, typer.Option(
    "--arms", metavar="ARMS", rich_help_panel=ARMS, help="The arms in bench's own grammar "
    "(e.g. 'off;off:eviction=lru'), instead of --prefetch and --budget")]
HelpArms = Annotated[bool, typer.Option(
    "--help-arms", is_eager=True, callback=_help_arms, metavar="", rich_help_panel=ARMS,
    help="Print the --arms grammar and every key, and exit")]
