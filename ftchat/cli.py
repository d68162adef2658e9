"""The `ftchat` command (typer): parse flags into Settings and hand over; no logic here.

Every command passes its engine flags to `resolve_settings` by name; the option types they share
are in cli_options.py. The commands import their modules (torch, rich) on use, after the flags
are known good: `ftchat --help` and a bad flag stay instant.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

# Before torch's CUDA allocator starts: segments that grow in place instead of fixed-size
# blocks, so the freed transients of a prefill chunk do not strand VRAM the next allocation
# cannot use (the slack a 16 GiB budget has no room for: docs/performance.md).
# A user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from ftchat import __version__
from ftchat.cli_options import (AuditEvery, BatchSize, Budget, BudgetAttn, BudgetGdn,
                                Candidates, Context, CopyPrograms, Dense, Device, Dtype,
                                Eviction, ExpertVram, Format, Graph, Json, JsonOut, Kernels,
                                KvCacheDtype, Layers, MaxNew, Model, OldName, Overlap, Panel, Pdl,
                                PrefillChunk, Prefetch, Prompt, PromptFile, Quiet,
                                RecordRouting, RepeatPenalty, Seed, Slots, Stop, Synthetic,
                                System, Temp, Threads, TopK, TopP, Verify, VramBudget)
from ftchat.cli_options import Force, MinP, Think, usage_message
from ftchat.cli_options import Arms, BenchBudget, BenchContexts, BenchPrefetch, HelpArms, Routing
from ftchat.cli_options import ServePanel, ServeQuiet
from ftchat.commands.user_files import new_folder_parents, read_prompt_file, remove_empty
from ftchat.errors import (FtchatError, StdoutError, Terminated, UsageError,
                           out_of_memory_message)
from ftchat.process_io import signal_name, standard_streams, stop_signals
from ftchat.settings import resolve_one, resolve_settings


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
        typer.echo(f"ftchat {__version__}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[bool, typer.Option(
        "--version", "-V", is_eager=True, callback=_version, metavar="",
        help="Print the version and exit")] = False,
) -> None:
    """Local chat and greedy decode of Qwen3.8-Flash-Next, experts offloaded."""


# typer keeps a paragraph's line breaks: each paragraph is one line, for the terminal to wrap
RUN_HELP = "\n\n".join((
    "Chat (stdin a terminal), or reply to each piped prompt (one per line, or JSON lines).",
    "Chat commands: /help, /stats (figures of the last reply), /reset or /clear (forget the "
    "conversation), /exit, /quit or /bye (also Ctrl-D). End a line with \\ to continue it, or "
    'put a message between """ lines. Ctrl-C stops a reply and keeps the conversation; at the '
    "prompt it quits. Keys typed while a reply streams wait for the next prompt.",
    "Piped input: one prompt per line, blank lines skipped; a line starting with { is a JSON "
    'object: "prompt" (required), and optionally "system", "max_new_tokens", "stop" (a string '
    'or a list), "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed". Each '
    "prompt is answered as it arrives (up to --batch-size waiting prompts decode together), one "
    "reply per line with control characters escaped; --json writes one object per reply: index, "
    "text (the answer), reasoning (the think block), tokens, stop (eos, length, context, "
    "stop_string or interrupted), prompt_tokens, timings, offload, vram_peak_bytes, and seed "
    "when sampled. A bad line (or one too long for the context) is an error line on stderr "
    'and, in its reply\'s place, an empty line (--json: an object with "error"); the other '
    "lines are answered, the exit status is 1.",
    "Decoding is greedy unless --temp is above 0. Sampling flags not given take the model's "
    "generation_config.json (repetition_penalty; with do_sample, temperature, top_k, top_p, "
    "min_p), else greedy's values.",
))


@app.command(cls=_Command, help=RUN_HELP)
def run(
    model: Model = None, prompt: Prompt = None, file: PromptFile = None,
    max_new_tokens: MaxNew = None, system: System = None, temp: Temp = None, top_k: TopK = None,
    top_p: TopP = None, repeat_penalty: RepeatPenalty = None, seed: Seed = None,
    stop: Stop = None, json: Json = None, batch_size: BatchSize = None, quiet: Quiet = None,
    panel: Panel = None, think: Think = None, min_p: MinP = None,
    context: Context = None, prefill_chunk: PrefillChunk = None, device: Device = None,
    dtype: Dtype = None, kv_cache_dtype: KvCacheDtype = None, threads: Threads = None,
    slots: Slots = None, expert_vram: ExpertVram = None, vram_budget: VramBudget = None,
    graph: Graph = None,
    kernels: Kernels = None, pdl: Pdl = None,
    prefetch: Prefetch = None, budget: Budget = None, budget_gdn: BudgetGdn = None,
    budget_attn: BudgetAttn = None, candidates: Candidates = None, eviction: Eviction = None,
    overlap: Overlap = None, copy_programs: CopyPrograms = None,
    verify: Verify = None, audit_every: AuditEvery = None, audit: OldName = None,
    record_routing: RecordRouting = None, force: Force = None,
) -> None:
    if file is not None:
        if prompt is not None:
            raise UsageError("give --prompt or --file, not both")
        prompt = read_prompt_file(file)
    settings = resolve_settings(dict(
        prompt=prompt, max_new_tokens=max_new_tokens, system=system, temp=temp, top_k=top_k,
        top_p=top_p, repeat_penalty=repeat_penalty, seed=seed, stop=stop, json=json,
        batch_size=batch_size, quiet=quiet, panel=panel,
        context=context, prefill_chunk=prefill_chunk, device=device, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, threads=threads, slots=slots, expert_vram=expert_vram,
        vram_budget=vram_budget, graph=graph,
        kernels=kernels, pdl=pdl,
        prefetch=prefetch, budget=budget, budget_gdn=budget_gdn, budget_attn=budget_attn,
        candidates=candidates, eviction=eviction, overlap=overlap, copy_programs=copy_programs,
        verify=verify, audit_every=audit_every, audit=audit, record_routing=record_routing,
        force=force, think=think, min_p=min_p,
    ), os.environ)
    from ftchat.ui.run import run as run_ui

    raise typer.Exit(run_ui(model, settings, os.environ, sys.stdin, sys.stdout, sys.stderr))


SERVE_HELP = "\n\n".join((
    "An OpenAI-compatible HTTP server: POST /v1/chat/completions (streamed or not), POST "
    "/v1/completions, GET /v1/models, GET /health (503 while loading) and GET /metrics "
    "(Prometheus text).",
    "One engine thread decodes up to --parallel requests together, in arrival order; up to "
    "--queue more wait, the next gets 503. A request that continues a kept conversation, or "
    "shares a checkpointed prefix with an earlier one, prefills only its new tokens.",
    "Ctrl-C, SIGTERM or SIGHUP stops the server: open requests get a second to finish, then "
    "it exits 0. A model that fails to load ends it with the error `run` would give.",
))
# what `ftchat serve` imports beyond ftchat's other commands: missing, the install is broken
SERVER_PACKAGES = frozenset({"fastapi", "starlette", "uvicorn", "pydantic"})


@app.command(cls=_Command, help=SERVE_HELP)
def serve(
    model: Model = None,
    host: Annotated[str, typer.Option(metavar="ADDR", help="Address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="N", help="Port to bind")] = 8080,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", metavar="KEY", help="Require 'Authorization: Bearer KEY' (env "
        "FTCHAT_API_KEY); /health stays open")] = None,
    queue: Annotated[int, typer.Option(
        "--queue", metavar="N", help="Requests that may wait while --parallel decode; more get 503")
    ] = 8,
    parallel: Annotated[int, typer.Option(
        "--parallel", metavar="B", help="Requests decoded together")] = 2,
    cache_ram: Annotated[float, typer.Option(
        "--cache-ram", metavar="GIB", help="Host memory for prefix-reuse checkpoints (0: off)")
    ] = 2.0,
    context: Context = None, prefill_chunk: PrefillChunk = None, device: Device = None,
    dtype: Dtype = None, kv_cache_dtype: KvCacheDtype = None, threads: Threads = None,
    slots: Slots = None, expert_vram: ExpertVram = None, vram_budget: VramBudget = None,
    graph: Graph = None, kernels: Kernels = None, pdl: Pdl = None,
    prefetch: Prefetch = None, budget: Budget = None, budget_gdn: BudgetGdn = None,
    budget_attn: BudgetAttn = None, candidates: Candidates = None, eviction: Eviction = None,
    overlap: Overlap = None, copy_programs: CopyPrograms = None,
    quiet: ServeQuiet = None, panel: ServePanel = None,
) -> None:
    settings = resolve_settings(dict(
        quiet=quiet, panel=panel,
        context=context, prefill_chunk=prefill_chunk, device=device, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, threads=threads, slots=slots, expert_vram=expert_vram,
        vram_budget=vram_budget, graph=graph, kernels=kernels, pdl=pdl,
        prefetch=prefetch, budget=budget, budget_gdn=budget_gdn, budget_attn=budget_attn,
        candidates=candidates, eviction=eviction, overlap=overlap, copy_programs=copy_programs,
    ), os.environ)
    try:
        from ftchat.server.serve import ServeOptions, serve as serve_http
    except ModuleNotFoundError as e:  # a declared dependency missing: a broken install
        if (e.name or "").split(".")[0] not in SERVER_PACKAGES:
            raise
        raise FtchatError(f"ftchat serve needs the package {e.name!r}, which is not installed; "
                          "reinstall ftchat (pip install -e .) to get fastapi and uvicorn") from e

    key = api_key if api_key is not None else os.environ.get("FTCHAT_API_KEY") or None
    options = ServeOptions(host, port, key, queue, parallel, cache_ram)
    raise typer.Exit(serve_http(model, settings, options, os.environ, sys.stderr))


@app.command(cls=_Command)
def synth(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="New folder to write")],
    preset: Annotated[str, typer.Option(
        "--preset", metavar="PRESET", help="Model geometry: tiny, flash-next, "
        "qwen3.5-moe[-tiny], qwen3-next[-tiny], qwen3-moe[-tiny]")] = "tiny",
    layers: Annotated[int | None, typer.Option(metavar="N", help="Decoder layers (preset's)")
                      ] = None,
    format: Annotated[str, typer.Option(
        "--format", metavar="FORMAT",
        help="Expert format: bf16, nvfp4-modelopt or nvfp4-ct")] = "bf16",
    seed: Annotated[int, typer.Option("--seed", "-s", metavar="N",
                                      help="Random seed of the weights")] = 0,
    dense: Annotated[str, typer.Option(
        metavar="bf16|nvfp4",
        help="Dense projections: bf16, or the GDN qkv and z in NVFP4 as the real checkpoint "
             "(needs an NVFP4 --format)")] = "bf16",
) -> None:
    """Write a synthetic checkpoint (random weights) in the real model's HF layout."""
    seed = resolve_one("seed", seed, os.environ)  # as run --seed: torch's generator takes no more
    from ftchat.model.synth import write_checkpoint
    from ftchat.ui.progress import progress_bar

    created = new_folder_parents(out)
    try:
        with progress_bar(sys.stderr, "writing") as bar:
            path = write_checkpoint(out, preset, layers, format, seed,
                                    progress=lambda i, n: bar("layers", i, n), dense=dense)
    except OSError as e:  # the checks passed, the file system still refused (read-only, full)
        remove_empty(created)
        raise FtchatError(f"{out}: cannot write the checkpoint in {out.absolute().parent} "
                          f"({e.strerror or e}); choose a folder on a writable disk") from None
    except BaseException:
        remove_empty(created)
        raise
    typer.echo(f"wrote {path}")


INFO_HELP = "\n\n".join((
    "Geometry, bytes and the expert slots that fit in VRAM, without loading the weights.",
    "With --context, --batch-size, --slots, --prefill, --synthetic or --kv-cache-dtype: the "
    "whole VRAM plan.",
))


@app.command(cls=_Command, help=INFO_HELP)
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
    layers: Layers = None,
    format: Format = "nvfp4-modelopt",
    dense: Dense = "bf16",
    kv_cache_dtype: Annotated[str | None, typer.Option(
        "--kv-cache-dtype", metavar="auto|fp8", help="Plan the K/V cache at the model dtype "
        "(auto) or fp8, as run --kv-cache-dtype (env FTCHAT_KV_CACHE_DTYPE)")] = None,
) -> None:
    kv = resolve_one("kv_cache_dtype", kv_cache_dtype, os.environ)  # a bad value: one line
    from ftchat.ui.info import info_command

    raise typer.Exit(info_command(model, vram, context, batch_size, slots, prefill, synthetic,
                                  layers, format, os.environ, sys.stdout, kv_cache_dtype=kv,
                                  kv_given=kv_cache_dtype is not None, dense=dense))


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
    json: JsonOut = False,
    graph: Annotated[bool, typer.Option(
        "--graph", metavar="", help="Also decode every prompt, prefetch off and on, as `run` "
        "does on CUDA (graph replay, no hooks), and compare with the eager arms")] = False,
    prompt_seed: Annotated[int, typer.Option(
        "--prompt-seed", metavar="S", help="Seed of the prompts' random nonces: another seed, "
        "other cold prompts (a long run split over several calls)")] = 0,
    batch: Annotated[int | None, typer.Option(
        "--batch", metavar="N", help="Prompts each arm decodes together (default: as many as "
        "the slots hold at top-k each, at most 16; 1: one at a time, as `run` chats)")] = None,
    context: Context = None, device: Device = None, dtype: Dtype = None,
    kv_cache_dtype: KvCacheDtype = None, threads: Threads = None, slots: Slots = None,
    expert_vram: ExpertVram = None, vram_budget: VramBudget = None,
    kernels: Kernels = None, pdl: Pdl = None,
    budget: Budget = None, budget_gdn: BudgetGdn = None, budget_attn: BudgetAttn = None,
    candidates: Candidates = None, eviction: Eviction = None, overlap: Overlap = None,
    copy_programs: CopyPrograms = None,
) -> None:
    """Prefetch on vs off, token by token, over N cold prompts; exits 1 on any difference.

    The verifier and the slot audit watch the `on` arm: their findings fail the run too."""
    settings = resolve_settings(dict(
        budget=budget, budget_gdn=budget_gdn, budget_attn=budget_attn, candidates=candidates,
        slots=slots, expert_vram=expert_vram, vram_budget=vram_budget, eviction=eviction,
        overlap=overlap, context=context, device=device, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, copy_programs=copy_programs, threads=threads,
        kernels=kernels, pdl=pdl,
        graph=True if graph else None,  # settings.graph True: add the graph arms
    ), os.environ)
    from ftchat.debug.verify_command import BatchTooLarge, graph_refusal, run_verify
    from ftchat.ui.run import apply_threads

    if graph and (why := graph_refusal(settings)):  # a usage error, before the model loads
        raise typer.BadParameter(why, param_hint="'--graph'")
    apply_threads(settings)
    try:
        code = run_verify(model, settings, os.environ, mode, prompts, max_new_tokens,
                          audit_every, json, sys.stdout, sys.stderr, prompt_seed=prompt_seed,
                          batch=batch)
    except BatchTooLarge as e:  # found once the model's top-k is known: still a usage error
        raise typer.BadParameter(str(e), param_hint="'--batch'") from None
    raise typer.Exit(code)


@app.command("audit", cls=_Command)
def audit_cmd(
    model: Model = None,
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", "-p", metavar="TEXT",
        help="A prompt (repeatable); default: one per line on stdin")] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", metavar="FILE", help="Read one prompt from FILE (as run -f)")] = None,
    audit_every: Annotated[int | None, typer.Option(
        "--audit-every", metavar="N", help="Byte-check the whole slot cache every N steps "
        "(default 64)")] = None,
    every: OldName = None,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", metavar="N", help="Greedy tokens per prompt")] = 128,
    json: JsonOut = False,
    context: Context = None, device: Device = None, dtype: Dtype = None,
    kv_cache_dtype: KvCacheDtype = None, threads: Threads = None, slots: Slots = None,
    expert_vram: ExpertVram = None, vram_budget: VramBudget = None,
    kernels: Kernels = None, pdl: Pdl = None,
    prefetch: Prefetch = None, budget: Budget = None, budget_gdn: BudgetGdn = None,
    budget_attn: BudgetAttn = None, candidates: Candidates = None, eviction: Eviction = None,
    overlap: Overlap = None,
) -> None:
    """A decode run with the slot audit on; exits 1 if any held slot's bytes are wrong.

    MODEL as for run; the prompts from -p (repeatable) and -f, else one per line on stdin."""
    settings = resolve_settings(dict(
        prefetch=prefetch, budget=budget, budget_gdn=budget_gdn, budget_attn=budget_attn,
        candidates=candidates, slots=slots, expert_vram=expert_vram, vram_budget=vram_budget,
        eviction=eviction, overlap=overlap, context=context, device=device, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, threads=threads, kernels=kernels, pdl=pdl,
    ), os.environ)
    if every is not None and audit_every is not None and every != audit_every:
        raise UsageError("--audit-every and its old name --every give different values: "
                         "give one")
    n = audit_every if audit_every is not None else every if every is not None else 64
    from ftchat.debug.audit_command import run_audit
    from ftchat.ui.run import apply_threads

    apply_threads(settings)
    texts = [*(prompt or []), *([] if file is None else [read_prompt_file(file)])]
    if not texts and not sys.stdin.isatty():
        from ftchat.ui.batch import LineSource  # as run reads it: a bad line is named

        source = LineSource(sys.stdin)
        texts = [t for line in iter(lambda: source.next(wait=True), None) if (t := line.strip())]
    raise typer.Exit(run_audit(model, settings, os.environ, prompts=texts, every=n,
                               max_new=max_new_tokens, as_json=json, out=sys.stdout,
                               err=sys.stderr))


BENCH_HELP = "\n\n".join((
    "Decode tok/s of several arms side by side in one process (ABAB interleaved).",
    "An arm is one configuration: a prefetch mode (--prefetch), at each budget (--budget) for "
    "the measure and on modes; --arms gives them in bench's own grammar (--help-arms).",
    "A warm-up round, not timed, runs first: --steps tokens, or 46 where an arm uses "
    "--budget auto, so that it has chosen its budget before the timed rounds.",
))


@app.command("bench", cls=_Command, help=BENCH_HELP)
def bench_cmd(
    model: Model = None,
    prefetch: BenchPrefetch = None, budget: BenchBudget = None,
    context: BenchContexts = None, routing: Routing = "model",
    steps: Annotated[int, typer.Option(metavar="N", help="Tokens per arm per round")] = 32,
    rounds: Annotated[int, typer.Option(metavar="N", help="Interleaved rounds")] = 3,
    json: JsonOut = False,
    arms: Arms = None, help_arms: HelpArms = False,
    synthetic: Synthetic = None, layers: Layers = None, format: Format = "nvfp4-modelopt",
    dense: Dense = "bf16",
    device: Device = None, dtype: Dtype = None, kv_cache_dtype: KvCacheDtype = None,
    threads: Threads = None, slots: Slots = None, expert_vram: ExpertVram = None,
    vram_budget: VramBudget = None, graph: Graph = None,
    kernels: Kernels = None, pdl: Pdl = None,
    eviction: Eviction = None, copy_programs: CopyPrograms = None,
) -> None:
    settings = resolve_settings(dict(
        slots=slots, expert_vram=expert_vram, vram_budget=vram_budget, eviction=eviction,
        graph=graph, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        copy_programs=copy_programs, threads=threads, kernels=kernels, pdl=pdl,
    ), os.environ)
    if synthetic is not None and model is not None:
        raise UsageError("give MODEL or --synthetic, not both")
    if synthetic is None and (layers is not None or dense != "bf16"):
        raise UsageError("--layers and --dense need --synthetic")
    if arms is not None and (prefetch is not None or budget is not None):
        raise UsageError("give --arms, or --prefetch and --budget, not both")
    from ftchat.commands import bench_ui
    from ftchat.commands.arms_help import arms_of_choices
    from ftchat.ui.run import apply_threads

    apply_threads(settings)
    synth = None if synthetic is None else bench_ui.Synthetic(synthetic, layers, format, dense)
    if arms is None:
        arms = arms_of_choices(prefetch, budget)
    raise typer.Exit(bench_ui.run_bench(model, settings, os.environ, arms, context, steps,
                                        rounds, json, sys.stdout, sys.stderr, synthetic=synth,
                                        routing=routing))


def main(argv: list[str] | None = None) -> int:
    """Console entry point: errors are one `error: ...` line on stderr, never a traceback."""
    try:
        standard_streams()  # a closed stdin/stderr made harmless, a closed stdout refused
        with stop_signals():  # SIGTERM, SIGHUP: unwind as Ctrl-C does (temporary output removed)
            code = app(args=argv, prog_name="ftchat", standalone_mode=False)
            sys.stdout.flush()  # a full disk or a closed pipe reported here, not at exit
    except Terminated as e:
        return _fail(f"stopped by {signal_name(e.signum)}", 128 + e.signum)
    except StdoutError as e:  # /dev/full: what is still buffered must not fail again at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        return _fail(str(e), 1)
    except UsageError as e:
        return _fail(str(e), 2)
    except FtchatError as e:
        return _fail(str(e), 1)
    except typer.TyperException as e:  # usage errors: bad flag, bad value, missing argument
        if not e.format_message().strip():  # `ftchat` alone: the help is printed, nothing failed
            return 0
        return _fail(usage_message(e), e.exit_code)
    except typer.Abort:  # EOF where input was needed
        return _fail("aborted", 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:
        # The reader went away (`| head`): silence the final flush of stdout too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # a file the user named: one line naming it
        if os.environ.get("FTCHAT_DEBUG"):
            raise
        where = f"{e.filename}: " if e.filename is not None else ""
        return _fail(f"{where}{e.strerror or e}", 1)
    except Exception as e:  # a bug or a device error: one line, the traceback on request
        if os.environ.get("FTCHAT_DEBUG"):
            raise
        oom = out_of_memory_message(e)
        if oom is not None:
            return _fail(oom, 1)
        first = (str(e).strip().splitlines() or [""])[0]
        return _fail(f"internal error: {type(e).__name__}: {first} (FTCHAT_DEBUG=1 shows the "
                     "traceback)", 1)
    return code if isinstance(code, int) else 0


def _fail(message: str, code: int) -> int:
    first = (message.strip().splitlines() or [""])[0]
    try:
        print(f"error: {first}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr gone too (a hung-up terminal): the status tells
        pass
    return code


if __name__ == "__main__":
    sys.exit(main())
