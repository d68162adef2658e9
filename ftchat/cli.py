"""The `ftchat` command (typer): parse flags into Settings and hand over; no logic here.

Engine flags are module-level option types so that every command can take them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from ftchat.errors import FtchatError
from ftchat.settings import Settings, resolve_settings

_D = Settings()  # the defaults the help texts quote

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Local chat and greedy decode of Qwen3.8-Flash-Next, experts offloaded.")

# ===== engine flags (None: not given, so the environment or the default decides) =====
Model = Annotated[str | None, typer.Argument(
    help="Checkpoint folder or Hugging Face repo id; none: the built-in demo model.")]
Prefetch = Annotated[str | None, typer.Option(
    help="off|measure|on (env FREETOKEN_MOE_PREFETCH; default off)")]
Budget = Annotated[int | None, typer.Option(
    help="Prefetch budget before every layer (env FREETOKEN_MOE_PREFETCH_BUDGET)")]
BudgetGdn = Annotated[int | None, typer.Option(
    help=f"Budget before GDN layers (default {_D.budget_gdn})")]
BudgetAttn = Annotated[int | None, typer.Option(
    help=f"Budget before attention layers (default {_D.budget_attn})")]
Candidates = Annotated[int | None, typer.Option(
    help=f"Router-lookahead candidates (env FREETOKEN_MOE_PREFETCH_K; default {_D.candidates})")]
Slots = Annotated[int | None, typer.Option(help="Expert slots in VRAM (or --expert-vram)")]
ExpertVram = Annotated[float | None, typer.Option(
    "--expert-vram", metavar="GIB", help="VRAM for expert slots, GiB (or --slots)")]
Eviction = Annotated[str | None, typer.Option(help="rule|lru (default rule)")]
Overlap = Annotated[bool | None, typer.Option(
    "--overlap/--no-overlap", help="Shared expert overlaps the demand copy (default on)")]
Graph = Annotated[bool | None, typer.Option(
    "--graph/--eager", help="CUDA graphs (default: on CUDA)")]
MaxNew = Annotated[int | None, typer.Option(
    help=f"Tokens per reply at most (default {_D.max_new_tokens})")]
Context = Annotated[int | None, typer.Option(
    help="KV capacity in tokens (default: the model's, at most 32768)")]
Device = Annotated[str | None, typer.Option(help="auto|cuda|cpu (default auto)")]
Dtype = Annotated[str | None, typer.Option(
    help="auto|float32|bfloat16 (auto: bfloat16 on CUDA, float32 on CPU)")]
Verify = Annotated[str | None, typer.Option(
    help="meta|bytes slot checks (env FREETOKEN_MOE_PREFETCH_VERIFY=meta|1)")]
Audit = Annotated[int | None, typer.Option(
    metavar="N", help="Byte-check the slot cache every N steps (env FREETOKEN_MOE_SLOT_AUDIT)")]
CopyPrograms = Annotated[int | None, typer.Option(
    help="Copy-kernel programs, 0: cudaMemcpy (env FREETOKEN_MOE_SLIM_COPY; "
    f"default {_D.copy_programs})")]
RecordRouting = Annotated[str | None, typer.Option(
    metavar="FILE", help="Write the routed expert ids of every step to FILE")]


@app.command()
def run(
    model: Model = None,
    prefetch: Prefetch = None,
    budget: Budget = None,
    budget_gdn: BudgetGdn = None,
    budget_attn: BudgetAttn = None,
    candidates: Candidates = None,
    slots: Slots = None,
    expert_vram: ExpertVram = None,
    eviction: Eviction = None,
    overlap: Overlap = None,
    graph: Graph = None,
    max_new_tokens: MaxNew = None,
    system: Annotated[str | None, typer.Option(help="System message")] = None,
    prompt: Annotated[str | None, typer.Option(help="One prompt, one reply, exit")] = None,
    batch_size: Annotated[int | None, typer.Option(
        help="Piped prompts decoded together (default 1)")] = None,
    panel: Annotated[bool | None, typer.Option(
        "--panel/--no-panel", help="Live panel on stderr (default: when a terminal)")] = None,
    json: Annotated[bool | None, typer.Option(
        "--json", help="Piped mode: one JSON object per reply")] = None,
    context: Context = None,
    device: Device = None,
    dtype: Dtype = None,
    verify: Verify = None,
    audit: Audit = None,
    copy_programs: CopyPrograms = None,
    record_routing: RecordRouting = None,
) -> None:
    """Chat (stdin a terminal), or reply to each piped prompt (one per line, or JSON lines)."""
    flags = {k: v for k, v in locals().items() if k != "model"}
    settings = resolve_settings(flags, os.environ)
    from ftchat.ui.run import run as run_ui  # imports torch: after the flags are known good

    raise typer.Exit(run_ui(model, settings, os.environ, sys.stdin, sys.stdout, sys.stderr))


@app.command()
def synth(
    out: Annotated[Path, typer.Argument(help="New folder to write")],
    preset: Annotated[str, typer.Option(help="tiny|flash-next")] = "tiny",
    layers: Annotated[int | None, typer.Option(help="Decoder layers (preset's)")] = None,
    format: Annotated[str, typer.Option(help="bf16|nvfp4-modelopt|nvfp4-ct")] = "bf16",
    seed: Annotated[int, typer.Option(help="Random seed of the weights")] = 0,
) -> None:
    """Write a synthetic checkpoint (random weights) in the real model's HF layout."""
    from ftchat.model.synth import write_checkpoint
    from ftchat.ui.progress import progress_bar

    created = _new_folder_parents(out)
    try:
        with progress_bar(sys.stderr, "writing") as bar:
            path = write_checkpoint(out, preset, layers, format, seed,
                                    progress=lambda i, n: bar("layers", i, n))
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


@app.command()
def info(
    model: Model = None,
    vram: Annotated[list[float] | None, typer.Option(
        metavar="GIB", help="VRAM budget(s) for the slot count (16 24 32 80)")] = None,
) -> None:
    """Geometry, bytes and the expert slots that fit in VRAM, without loading the weights."""
    from ftchat.resolve import resolve_model
    from ftchat.ui.info import info_lines

    for gib in vram or []:
        if not gib > 0:
            raise FtchatError(f"--vram {gib}: expected a positive number of GiB")
    resolved = resolve_model(model, os.environ)
    typer.echo("\n".join(info_lines(resolved.path, vram)))


def _engine_flags(local: dict, skip: tuple[str, ...]) -> dict:
    return {k: v for k, v in local.items() if k not in skip}


@app.command("verify")
def verify_cmd(
    model: Model = None,
    mode: Annotated[str, typer.Option(help="meta|bytes")] = "meta",
    prompts: Annotated[int, typer.Option(help="Cold prompts (random nonce prefix)")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy tokens per prompt")] = 64,
    audit_every: Annotated[int, typer.Option(help="Slot audit interval (steps)")] = 64,
    json: Annotated[bool, typer.Option("--json", help="One JSON object")] = False,
    budget: Budget = None, budget_gdn: BudgetGdn = None, budget_attn: BudgetAttn = None,
    candidates: Candidates = None, slots: Slots = None, expert_vram: ExpertVram = None,
    eviction: Eviction = None, overlap: Overlap = None, context: Context = None,
    device: Device = None, dtype: Dtype = None, copy_programs: CopyPrograms = None,
) -> None:
    """Prefetch on vs off, token by token, over N cold prompts; exits 1 on any difference.

    The verifier and the slot audit watch the `on` arm: their findings fail the run too."""
    flags = _engine_flags(locals(), ("model", "mode", "prompts", "max_new_tokens", "audit_every",
                                     "json"))
    from ftchat.ui.debug import verify
    settings = resolve_settings(flags, os.environ)
    raise typer.Exit(verify(model, settings, os.environ, mode, prompts, max_new_tokens,
                            audit_every, json))


@app.command("audit")
def audit_cmd(
    model: Model = None,
    prompt: Annotated[list[str] | None, typer.Option(
        help="A prompt (repeatable); default: one per line on stdin")] = None,
    every: Annotated[int, typer.Option(help="Byte-check the whole cache every N steps")] = 64,
    max_new_tokens: Annotated[int, typer.Option(help="Greedy tokens per prompt")] = 128,
    json: Annotated[bool, typer.Option("--json", help="One JSON object")] = False,
    prefetch: Prefetch = None, budget: Budget = None, budget_gdn: BudgetGdn = None,
    budget_attn: BudgetAttn = None, candidates: Candidates = None, slots: Slots = None,
    expert_vram: ExpertVram = None, eviction: Eviction = None, overlap: Overlap = None,
    context: Context = None, device: Device = None, dtype: Dtype = None,
) -> None:
    """A decode run with the slot audit on; exits 1 if any held slot's bytes are wrong."""
    flags = _engine_flags(locals(), ("model", "prompt", "every", "max_new_tokens", "json"))
    from ftchat.ui.debug import audit
    settings = resolve_settings(flags, os.environ)
    texts = prompt or ([] if sys.stdin.isatty() else
                       [ln.strip() for ln in sys.stdin.read().splitlines() if ln.strip()])
    raise typer.Exit(audit(model, settings, os.environ, every, texts, max_new_tokens, json))


@app.command("bench")
def bench_cmd(
    model: Model = None,
    arms: Annotated[str, typer.Option(
        help="Arms separated by ';': resident, off, measure, on[:budget=4,eviction=lru,...]; "
             "fused=0 in an arm runs the torch decode path")]
    = "off;on;on:budget=4",
    context: Annotated[str, typer.Option(help="Context lengths, e.g. 4k,32k")] = "4k",
    steps: Annotated[int, typer.Option(help="Tokens per arm per round")] = 32,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds")] = 3,
    synthetic: Annotated[str | None, typer.Option(
        help="Build a random-weight model in memory instead of MODEL: tiny|flash-next")] = None,
    layers: Annotated[int | None, typer.Option(help="Decoder layers of --synthetic")] = None,
    format: Annotated[str, typer.Option(
        help="Expert format of --synthetic: bf16|nvfp4-modelopt|nvfp4-ct")] = "nvfp4-modelopt",
    json: Annotated[bool, typer.Option("--json", help="One JSON object")] = False,
    slots: Slots = None, expert_vram: ExpertVram = None, eviction: Eviction = None,
    graph: Graph = None, device: Device = None, dtype: Dtype = None,
    copy_programs: CopyPrograms = None,
) -> None:
    """Decode tok/s of several arms side by side in one process (ABAB interleaved)."""
    flags = _engine_flags(locals(), ("model", "arms", "context", "steps", "rounds", "json",
                                     "synthetic", "layers", "format"))
    from ftchat.ui.debug import Synthetic, bench
    settings = resolve_settings(flags, os.environ)
    if synthetic is not None and model is not None:
        raise FtchatError("give MODEL or --synthetic, not both")
    if synthetic is None and layers is not None:
        raise FtchatError("--layers needs --synthetic")
    synth = None if synthetic is None else Synthetic(synthetic, layers, format)
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
