"""The `ftchat` command (typer): parse flags into Settings and hand over; no logic here.

Engine flags are module-level option types so that every command can take them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

# Before torch's CUDA allocator starts: segments that grow in place instead of fixed-size
# blocks, so the freed transients of a prefill chunk do not strand VRAM the next allocation
# cannot use (the slack a 16 GiB budget has no room for: docs/performance.md, session 10).
# A user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from ftchat.errors import FtchatError
from ftchat.settings import Settings, resolve_settings

_D = Settings()  # the defaults the help texts quote

GEN, MODEL, OFFLOAD, DEBUG = "Generation", "Model and memory", "Offload tuning", "Debug"


class _Command(typer.core.TyperCommand):
    """A command whose --help switch shows no type label (as every switch here)."""

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.metavar = ""
        return opt


class _Group(typer.core.TyperGroup):
    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.metavar = ""
        return opt


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode="rich",
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Local chat and greedy decode of Qwen3.8-Flash-Next, experts offloaded.")


def _version(value: bool) -> None:
    if value:
        from ftchat import __version__

        typer.echo(f"ftchat {__version__}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[bool, typer.Option(
        "--version", "-V", is_eager=True, callback=_version, metavar="",
        help="Print the version and exit")] = False,
) -> None:
    """Local chat and greedy decode of Qwen3.8-Flash-Next, experts offloaded."""


# ===== engine flags (None: not given, so the environment or the default decides) =====
Model = Annotated[str | None, typer.Argument(
    metavar="MODEL", show_default=False,
    help="Checkpoint folder or Hugging Face repo id; none: the built-in demo model.")]
# --- model and memory
Context = Annotated[int | None, typer.Option(
    "--context", "-c", metavar="N", rich_help_panel=MODEL,
    help="KV capacity in tokens (default: the model's, at most 32768)")]
PrefillChunk = Annotated[int | None, typer.Option(
    "--prefill-chunk", metavar="T", rich_help_panel=MODEL,
    help="Prompt tokens per prefill call (default 1024, or under --vram-budget on a GPU the "
         "plan's choice; larger: fewer expert copies, more VRAM)")]
Device = Annotated[str | None, typer.Option(
    metavar="auto|cuda|cpu", rich_help_panel=MODEL, help="Where to run (default auto)")]
Dtype = Annotated[str | None, typer.Option(
    metavar="auto|float32|bfloat16", rich_help_panel=MODEL,
    help="auto: bfloat16 on CUDA, float32 on CPU")]
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
# --- offload tuning
Prefetch = Annotated[str | None, typer.Option(
    metavar="off|measure|on", rich_help_panel=OFFLOAD,
    help="Expert prefetch (env FREETOKEN_MOE_PREFETCH; default off)")]
Budget = Annotated[int | None, typer.Option(
    metavar="N", rich_help_panel=OFFLOAD,
    help="Prefetch budget before every layer (env FREETOKEN_MOE_PREFETCH_BUDGET)")]
BudgetGdn = Annotated[int | None, typer.Option(
    metavar="N", rich_help_panel=OFFLOAD,
    help=f"Budget before GDN layers (default {_D.budget_gdn})")]
BudgetAttn = Annotated[int | None, typer.Option(
    metavar="N", rich_help_panel=OFFLOAD,
    help=f"Budget before attention layers (default {_D.budget_attn})")]
Candidates = Annotated[int | None, typer.Option(
    metavar="K", rich_help_panel=OFFLOAD,
    help=f"Router-lookahead candidates (env FREETOKEN_MOE_PREFETCH_K; default {_D.candidates})")]
Eviction = Annotated[str | None, typer.Option(
    metavar="rule|lru", rich_help_panel=OFFLOAD, help="Slot eviction (default rule)")]
Overlap = Annotated[bool | None, typer.Option(
    "--overlap/--no-overlap", metavar="", rich_help_panel=OFFLOAD,
    help="Shared expert overlaps the demand copy (default on)")]
CopyPrograms = Annotated[int | None, typer.Option(
    metavar="N", rich_help_panel=OFFLOAD,
    help="Copy-kernel programs, 0: cudaMemcpy (env FREETOKEN_MOE_SLIM_COPY; "
    f"default {_D.copy_programs})")]
# --- debug
Verify = Annotated[str | None, typer.Option(
    metavar="meta|bytes", rich_help_panel=DEBUG,
    help="Slot checks on every step (env FREETOKEN_MOE_PREFETCH_VERIFY=meta|1)")]
AuditEvery = Annotated[int | None, typer.Option(
    "--audit-every", metavar="N", rich_help_panel=DEBUG,
    help="Byte-check the whole slot cache every N steps (env FREETOKEN_MOE_SLOT_AUDIT)")]
RecordRouting = Annotated[str | None, typer.Option(
    metavar="FILE", rich_help_panel=DEBUG,
    help="Write the routed expert ids of every step to FILE")]
# --- generation
MaxNew = Annotated[int | None, typer.Option(
    "--max-new-tokens", "-n", metavar="N", rich_help_panel=GEN,
    help=f"Tokens per reply at most (default {_D.max_new_tokens})")]

RUN_HELP = """Chat (stdin a terminal), or reply to each piped prompt (one per line, or JSON lines).

Chat commands: /help, /stats (figures of the last reply), /reset or /clear (forget the
conversation), /exit, /quit or /bye (also Ctrl-D). End a line with \\ to continue it, or put a
message between \"\"\" lines. Ctrl-C stops a reply and keeps the conversation; at the prompt it
quits. Keys typed while a reply streams wait for the next prompt.

Piped input: one prompt per line, blank lines skipped; a line starting with { is a JSON object:
"prompt" (required), and optionally "system", "max_new_tokens", "stop" (a string or a list),
"temperature", "top_k", "top_p", "repeat_penalty", "seed". Each prompt is answered as it arrives
(up to --batch-size waiting prompts decode together), one reply per line with control characters
escaped; --json writes one object per reply: index, text, tokens, stop (eos, length, context,
stop_string or interrupted), prompt_tokens, timings, offload, vram_peak_bytes, and seed when
sampled. A bad JSON line is an object with "error" under --json, else an error that stops the
run.

Decoding is greedy unless --temp is above 0."""


@app.command(cls=_Command, help=RUN_HELP)
def run(
    model: Model = None,
    prompt: Annotated[str | None, typer.Option(
        "--prompt", "-p", metavar="TEXT", rich_help_panel=GEN,
        help="One prompt, one reply, exit")] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", metavar="FILE", rich_help_panel=GEN,
        help="Read the one prompt from FILE (as --prompt)")] = None,
    max_new_tokens: MaxNew = None,
    system: Annotated[str | None, typer.Option(
        metavar="TEXT", rich_help_panel=GEN, help="System message")] = None,
    temp: Annotated[float | None, typer.Option(
        "--temp", metavar="T", rich_help_panel=GEN,
        help="Sampling temperature; 0 (default): greedy")] = None,
    top_k: Annotated[int | None, typer.Option(
        metavar="K", rich_help_panel=GEN, help="Sample from the K likeliest tokens (0: off)")
    ] = None,
    top_p: Annotated[float | None, typer.Option(
        metavar="P", rich_help_panel=GEN,
        help="Sample from the likeliest tokens holding mass P (1: off)")] = None,
    repeat_penalty: Annotated[float | None, typer.Option(
        metavar="X", rich_help_panel=GEN,
        help="Penalize the last 64 tokens' ids by X (1: off; also when greedy)")] = None,
    seed: Annotated[int | None, typer.Option(
        "--seed", "-s", metavar="N", rich_help_panel=GEN,
        help="Sampling seed, per reply (default: random)")] = None,
    stop: Annotated[list[str] | None, typer.Option(
        metavar="TEXT", rich_help_panel=GEN,
        help="End a reply before TEXT (repeatable)")] = None,
    json: Annotated[bool | None, typer.Option(
        "--json", metavar="", rich_help_panel=GEN, help="One JSON object per reply")] = None,
    batch_size: Annotated[int | None, typer.Option(
        metavar="B", rich_help_panel=GEN,
        help="Waiting piped prompts decoded together (default 1)")] = None,
    quiet: Annotated[bool | None, typer.Option(
        "--quiet", "-q", metavar="", rich_help_panel=GEN,
        help="No banner, loading bar or timing lines")] = None,
    panel: Annotated[bool | None, typer.Option(
        "--panel/--no-panel", metavar="", rich_help_panel=GEN,
        help="Live panel on stderr (default: when a terminal)")] = None,
    context: Context = None,
    prefill_chunk: PrefillChunk = None,
    device: Device = None,
    dtype: Dtype = None,
    kv_cache_dtype: KvCacheDtype = None,
    threads: Threads = None,
    slots: Slots = None,
    expert_vram: ExpertVram = None,
    vram_budget: VramBudget = None,
    graph: Graph = None,
    prefetch: Prefetch = None,
    budget: Budget = None,
    budget_gdn: BudgetGdn = None,
    budget_attn: BudgetAttn = None,
    candidates: Candidates = None,
    eviction: Eviction = None,
    overlap: Overlap = None,
    copy_programs: CopyPrograms = None,
    verify: Verify = None,
    audit_every: AuditEvery = None,
    audit: Annotated[int | None, typer.Option(hidden=True)] = None,  # the old name
    record_routing: RecordRouting = None,
) -> None:
    flags = {k: v for k, v in locals().items() if k not in ("model", "file")}
    if file is not None:
        if prompt is not None:
            raise FtchatError("give --prompt or --file, not both")
        flags["prompt"] = _read_prompt_file(file)
    settings = resolve_settings(flags, os.environ)
    from ftchat.ui.run import run as run_ui  # imports torch: after the flags are known good

    raise typer.Exit(run_ui(model, settings, os.environ, sys.stdin, sys.stdout, sys.stderr))


def _read_prompt_file(path: Path) -> str:
    where = f"--file {path}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FtchatError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise FtchatError(f"{where}: is a folder, not a file") from None
    except OSError as e:
        raise FtchatError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FtchatError(f"{where}: not UTF-8 text ({e})") from None
    return text.removesuffix("\n")


@app.command(cls=_Command)
def synth(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="New folder to write")],
    preset: Annotated[str, typer.Option(metavar="tiny|flash-next", help="Model geometry")
                      ] = "tiny",
    layers: Annotated[int | None, typer.Option(metavar="N", help="Decoder layers (preset's)")
                      ] = None,
    format: Annotated[str, typer.Option(metavar="bf16|nvfp4-modelopt|nvfp4-ct",
                                        help="Expert format")] = "bf16",
    seed: Annotated[int, typer.Option("--seed", "-s", metavar="N",
                                      help="Random seed of the weights")] = 0,
    dense: Annotated[str, typer.Option(
        metavar="bf16|nvfp4",
        help="Dense projections: bf16, or the GDN qkv and z in NVFP4 as the real checkpoint "
             "(needs an NVFP4 --format)")] = "bf16",
) -> None:
    """Write a synthetic checkpoint (random weights) in the real model's HF layout."""
    from ftchat.model.synth import write_checkpoint
    from ftchat.ui.progress import progress_bar

    created = _new_folder_parents(out)
    try:
        with progress_bar(sys.stderr, "writing") as bar:
            path = write_checkpoint(out, preset, layers, format, seed,
                                    progress=lambda i, n: bar("layers", i, n), dense=dense)
    except OSError as e:  # the checks passed, the file system still refused (read-only, full)
        _remove_empty(created)
        raise FtchatError(f"{out}: cannot write the checkpoint in {out.absolute().parent} "
                          f"({e.strerror or e}); choose a folder on a writable disk") from None
    except BaseException:
        _remove_empty(created)
        raise
    typer.echo(f"wrote {path}")


def _new_folder_parents(out: Path) -> list[Path]:
    """Check that `out` can become a new folder; create its missing parents and return them
    (outermost first), so that a failed write can remove them again."""
    new = "synth writes a new folder: give a path that does not exist yet"
    if out.is_symlink() or out.exists():
        if not out.is_dir():
            raise FtchatError(f"{out}: exists and is not a folder; {new}")
        if any(out.iterdir()):
            raise FtchatError(f"{out}: exists and is not empty; {new}")
        return []
    missing = []
    parent = out.absolute().parent
    while not parent.exists() and not parent.is_symlink():
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise FtchatError(f"{out}: {parent} is not a folder; give a path inside a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FtchatError(f"{out}: no permission to write in {parent}; choose another folder")
    created: list[Path] = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except OSError as e:
            _remove_empty(created)
            raise FtchatError(f"{out}: cannot create the folder {folder} ({e.strerror or e}); "
                              "choose a folder on a writable disk") from None
        created.append(folder)
    return created


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            pass


@app.command(cls=_Command)
def info(
    model: Model = None,
    vram: Annotated[list[float] | None, typer.Option(
        metavar="GIB", help="VRAM budget for the slot count (repeatable; default 16, 24, 32 "
        "and 80)")] = None,
    context: Annotated[str | None, typer.Option(
        "--context", "-c", metavar="N",
        help="Print the VRAM plan at this KV capacity (e.g. 255k, k = 1024 tokens)")] = None,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", "--batch", metavar="B", help="Plan for B sequences decoded together")
    ] = None,
    slots: Annotated[int | None, typer.Option(
        metavar="N", help="Plan with N expert slots (default: as many as fit)")] = None,
    prefill: Annotated[int | None, typer.Option(
        metavar="T", help="Tokens per prefill call in the plan (default 1024, as run; bench "
        "prefills 1)")] = None,
    synthetic: Annotated[str | None, typer.Option(
        metavar="tiny|flash-next", help="Plan a synthetic layout (as bench --synthetic) "
        "instead of MODEL")] = None,
    layers: Annotated[int | None, typer.Option(metavar="N", help="Decoder layers of --synthetic")
                      ] = None,
    format: Annotated[str, typer.Option(
        metavar="bf16|nvfp4-modelopt|nvfp4-ct", help="Expert format of --synthetic")
    ] = "nvfp4-modelopt",
    dense: Annotated[str, typer.Option(
        metavar="bf16|nvfp4", help="Dense projections of --synthetic: bf16, or the GDN qkv and z "
        "kept in NVFP4 as the real checkpoint stores them")] = "bf16",
    kv_cache_dtype: Annotated[str | None, typer.Option(
        "--kv-cache-dtype", metavar="auto|fp8", help="Plan the K/V cache at the model dtype "
        "(auto) or fp8, as run --kv-cache-dtype (env FTCHAT_KV_CACHE_DTYPE)")] = None,
) -> None:
    """Geometry, bytes and the expert slots that fit in VRAM, without loading the weights;
    with --context, --batch-size, --slots, --prefill, --synthetic or --kv-cache-dtype, the whole
    VRAM plan."""
    from ftchat.settings import resolve_one

    kv = resolve_one("kv_cache_dtype", kv_cache_dtype, os.environ)  # a bad value: one line
    from ftchat.ui.info import info_command

    raise typer.Exit(info_command(model, vram, context, batch_size, slots, prefill, synthetic,
                                  layers, format, os.environ, sys.stdout, kv_cache_dtype=kv,
                                  kv_given=kv_cache_dtype is not None, dense=dense))


def _engine_flags(local: dict, skip: tuple[str, ...]) -> dict:
    return {k: v for k, v in local.items() if k not in skip}


@app.command("verify", cls=_Command)
def verify_cmd(
    model: Model = None,
    mode: Annotated[str, typer.Option(metavar="meta|bytes", help="Slot checks")] = "meta",
    prompts: Annotated[int, typer.Option(metavar="N", help="Cold prompts (random nonce prefix)")
                       ] = 8,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", metavar="N", help="Greedy tokens per prompt")] = 64,
    audit_every: Annotated[int, typer.Option(
        "--audit-every", metavar="N", help="Byte-check the whole slot cache every N steps")] = 64,
    json: Annotated[bool, typer.Option("--json", metavar="", help="One JSON object")] = False,
    graph: Annotated[bool, typer.Option(
        "--graph", metavar="", help="Also decode every prompt, prefetch off and on, as `run` "
        "does on CUDA (graph replay, no hooks), and compare with the eager arms")] = False,
    prompt_seed: Annotated[int, typer.Option(
        "--prompt-seed", metavar="S", help="Seed of the prompts' random nonces: another seed, "
        "other cold prompts (a long run split over several calls)")] = 0,
    budget: Budget = None, budget_gdn: BudgetGdn = None, budget_attn: BudgetAttn = None,
    candidates: Candidates = None, slots: Slots = None, expert_vram: ExpertVram = None,
    vram_budget: VramBudget = None,
    eviction: Eviction = None, overlap: Overlap = None, context: Context = None,
    device: Device = None, dtype: Dtype = None, kv_cache_dtype: KvCacheDtype = None,
    copy_programs: CopyPrograms = None, threads: Threads = None,
) -> None:
    """Prefetch on vs off, token by token, over N cold prompts; exits 1 on any difference.

    The verifier and the slot audit watch the `on` arm: their findings fail the run too."""
    flags = _engine_flags(locals(), ("model", "mode", "prompts", "max_new_tokens", "audit_every",
                                     "json", "prompt_seed"))
    flags["graph"] = True if graph else None  # settings.graph True: add the graph arms
    from ftchat.ui.debug import verify
    from ftchat.ui.run import apply_threads
    settings = resolve_settings(flags, os.environ)
    if graph:
        from ftchat.commands.verify import graph_refusal  # imports torch: the flags are good

        if why := graph_refusal(settings):  # a usage error, before the model loads
            raise typer.BadParameter(why, param_hint="'--graph'")
    apply_threads(settings)
    raise typer.Exit(verify(model, settings, os.environ, mode, prompts, max_new_tokens,
                            audit_every, json, prompt_seed=prompt_seed))


@app.command("audit", cls=_Command)
def audit_cmd(
    model: Model = None,
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", "-p", metavar="TEXT",
        help="A prompt (repeatable); default: one per line on stdin")] = None,
    audit_every: Annotated[int | None, typer.Option(
        "--audit-every", metavar="N", help="Byte-check the whole slot cache every N steps "
        "(default 64)")] = None,
    every: Annotated[int | None, typer.Option(hidden=True)] = None,  # the old name
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", metavar="N", help="Greedy tokens per prompt")] = 128,
    json: Annotated[bool, typer.Option("--json", metavar="", help="One JSON object")] = False,
    prefetch: Prefetch = None, budget: Budget = None, budget_gdn: BudgetGdn = None,
    budget_attn: BudgetAttn = None, candidates: Candidates = None, slots: Slots = None,
    expert_vram: ExpertVram = None, vram_budget: VramBudget = None, eviction: Eviction = None,
    overlap: Overlap = None, context: Context = None, device: Device = None, dtype: Dtype = None,
    kv_cache_dtype: KvCacheDtype = None, threads: Threads = None,
) -> None:
    """A decode run with the slot audit on; exits 1 if any held slot's bytes are wrong."""
    flags = _engine_flags(locals(), ("model", "prompt", "audit_every", "every", "max_new_tokens",
                                     "json"))
    from ftchat.ui.debug import audit
    from ftchat.ui.run import apply_threads
    settings = resolve_settings(flags, os.environ)
    if every is not None and audit_every is not None and every != audit_every:
        raise FtchatError("--audit-every and its old name --every give different values: "
                          "give one")
    n = audit_every if audit_every is not None else every if every is not None else 64
    if n < 1:
        raise FtchatError(f"--audit-every {n}: expected a positive integer")
    apply_threads(settings)
    texts = prompt or ([] if sys.stdin.isatty() else
                       [ln.strip() for ln in sys.stdin.read().splitlines() if ln.strip()])
    raise typer.Exit(audit(model, settings, os.environ, n, texts, max_new_tokens, json))


@app.command("bench", cls=_Command)
def bench_cmd(
    model: Model = None,
    arms: Annotated[str, typer.Option(
        "--arms", metavar="ARMS",
        help="Arms separated by ';': resident, off, measure, on[:budget=4,eviction=lru,...]; "
             "fused=0 in an arm runs the torch decode path, pdl=0 launches without "
             "programmatic dependent launch, rowloop=0 takes the tiled NVFP4 kernels, "
             "onerow=0 the routed experts' 2-h-row tile at bs 1, hc1=1 the HC read in one "
             "launch, fold=1 the shared down GEMV inside the routed kernel, slotview=0 resident slots "
             "from two torch kernels a layer, l2pf=16 kernels ask L2 for up to 16 MiB of the next "
             "kernel's weights, gdnearly=1 the GDN state loaded before the PDL wait, "
             "qsagemv=1 the QSA projection through the Triton GEMV, plefused=1 the PLE layer "
             "in two kernels; "
             "resident:skip=hc+gemv "
             "leaves kernel families out (their marginal cost; not the model's tokens)")]
    = "off;on;on:budget=4",
    context: Annotated[str, typer.Option(
        "--context", "-c", metavar="LIST", help="Context lengths, e.g. 4k,32k")] = "4k",
    steps: Annotated[int, typer.Option(metavar="N", help="Tokens per arm per round")] = 32,
    rounds: Annotated[int, typer.Option(metavar="N", help="Interleaved rounds")] = 3,
    synthetic: Annotated[str | None, typer.Option(
        metavar="tiny|flash-next",
        help="Build a random-weight model in memory instead of MODEL")] = None,
    layers: Annotated[int | None, typer.Option(metavar="N", help="Decoder layers of --synthetic")
                      ] = None,
    format: Annotated[str, typer.Option(
        metavar="bf16|nvfp4-modelopt|nvfp4-ct", help="Expert format of --synthetic")
    ] = "nvfp4-modelopt",
    dense: Annotated[str, typer.Option(
        metavar="bf16|nvfp4", help="Dense projections of --synthetic: bf16, or the GDN qkv and z "
        "kept in NVFP4 as the real checkpoint stores them")] = "bf16",
    json: Annotated[bool, typer.Option("--json", metavar="", help="One JSON object")] = False,
    slots: Slots = None, expert_vram: ExpertVram = None, vram_budget: VramBudget = None,
    eviction: Eviction = None, graph: Graph = None, device: Device = None, dtype: Dtype = None,
    kv_cache_dtype: KvCacheDtype = None, copy_programs: CopyPrograms = None,
    threads: Threads = None,
) -> None:
    """Decode tok/s of several arms side by side in one process (ABAB interleaved)."""
    flags = _engine_flags(locals(), ("model", "arms", "context", "steps", "rounds", "json",
                                     "synthetic", "layers", "format", "dense"))
    from ftchat.ui.debug import Synthetic, bench
    from ftchat.ui.run import apply_threads
    settings = resolve_settings(flags, os.environ)
    if synthetic is not None and model is not None:
        raise FtchatError("give MODEL or --synthetic, not both")
    if synthetic is None and (layers is not None or dense != "bf16"):
        raise FtchatError("--layers and --dense need --synthetic")
    apply_threads(settings)
    synth = None if synthetic is None else Synthetic(synthetic, layers, format, dense)
    raise typer.Exit(bench(model, settings, os.environ, arms, context, steps, rounds, json,
                           synthetic=synth))


def main(argv: list[str] | None = None) -> int:
    """Console entry point: errors are one `error: ...` line on stderr, never a traceback."""
    try:
        code = app(args=argv, prog_name="ftchat", standalone_mode=False)
    except FtchatError as e:
        return _fail(str(e), 1)
    except typer.TyperException as e:  # usage errors: bad flag, bad value, missing argument
        if not e.format_message().strip():  # `ftchat` alone: the help is printed, nothing failed
            return 0
        return _fail(e.format_message(), e.exit_code)
    except typer.Abort:  # EOF where input was needed
        return _fail("aborted", 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:
        # The reader went away (`| head`): silence the final flush of stdout too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # a bug or a device error: one line, the traceback on request
        if os.environ.get("FTCHAT_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        return _fail(f"internal error: {type(e).__name__}: {first} (FTCHAT_DEBUG=1 shows the "
                     "traceback)", 1)
    return code if isinstance(code, int) else 0


def _fail(message: str, code: int) -> int:
    first = (message.strip().splitlines() or [""])[0]
    print(f"error: {first}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
