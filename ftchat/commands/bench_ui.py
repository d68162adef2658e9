"""`ftchat bench` as the user sees it: load (or build --synthetic) the model, run the arms of
commands/bench.py at each context, print a table per context or one JSON object."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.table import Table

from ftchat.commands.arms_help import list_items
from ftchat.commands.bench import ArmSpec, bench_context, bench_tokens, parse_arms
from ftchat.routing.forced import RoutingSource
from ftchat.commands.load import load_checked, pin_planned_slots, preflight
from ftchat.engine import LoadedModel
from ftchat.errors import FtchatError, UsageError, check_positive
from ftchat.kernels.config import KernelConfig
from ftchat.model.synth import FORMATS, MAX_LAYERS
from ftchat.model.registry import load_args
from ftchat.model.synth_memory import synthetic_model
from ftchat.resolve import resolve_model
from ftchat.settings import Settings, context_tokens
from ftchat.ui.progress import progress_bar
from ftchat.vram.items import VramPlan, Workload
from ftchat.vram.workloads import bench_workload, synthetic_inputs

DEFAULT_CONTEXT = 4096  # --context when none is given (less where the model has fewer positions)
COLUMNS = ("arm", "tok/s", "vs off", "ms/layer", "misses/token", "useful/layer", "precision")


@dataclass(frozen=True)
class Synthetic:
    """A random-weight model bench builds in memory (`--synthetic`), as `ftchat synth` would."""

    preset: str
    layers: int | None
    fmt: str
    dense: str = "bf16"  # "nvfp4": the GDN qkv / z in NVFP4, as the real checkpoint stores them

    def load(self, settings: Settings, err: TextIO) -> LoadedModel:
        if self.fmt not in FORMATS:
            raise UsageError(f"--format {self.fmt!r}: expected {', '.join(FORMATS)}")
        if self.layers is not None and not 2 <= self.layers <= MAX_LAYERS:
            raise UsageError(f"--layers {self.layers}: expected 2 to {MAX_LAYERS}")
        with progress_bar(err, "building") as bar:
            return synthetic_model(self.preset, self.layers, self.fmt,
                                   settings.torch_device(), settings.torch_dtype(), progress=bar,
                                   dense=self.dense, kernels=KernelConfig.from_settings(settings))


def run_bench(model: str | None, settings: Settings, env: Mapping[str, str], arms: str,
              contexts: str | None, steps: int, rounds: int, as_json: bool, out: TextIO,
              err: TextIO, synthetic: Synthetic | None = None, routing: str = "model") -> int:
    """`ftchat bench`: decode tok/s of the arms side by side at each context; the exit code."""
    check_positive(("--steps", steps), ("--rounds", rounds))
    source = RoutingSource.parse(routing)  # usage errors before the model loads
    settings.check_graph()
    arm_specs = parse_arms(arms, settings)  # usage errors before the model loads
    given = None if contexts is None else context_list(contexts)
    a0 = (synthetic_inputs(synthetic.preset, synthetic.layers, synthetic.fmt)[0] if synthetic
          else load_args(resolve_model(model, env).path))
    tokens = bench_tokens(arm_specs, steps, rounds)
    ctxs = bench_contexts(given, a0.max_position_embeddings, tokens)
    max_len = max(ctxs) + tokens + 2  # bench_context's KV capacity

    def work(a, layout) -> Workload:
        return bench_workload(a, layout, settings, [s.settings for s in arm_specs.values()],
                                 max_len)

    if synthetic:
        a, layout = synthetic_inputs(synthetic.preset, synthetic.layers, synthetic.fmt,
                                        synthetic.dense)
        w = dataclasses.replace(work(a, layout), dense_nvfp4=synthetic.dense == "nvfp4")
        plan = preflight(a, layout, settings, w)
        m = synthetic.load(settings, err)
    else:
        m, _, plan = load_checked(model, settings, env, err, work)
    arm_specs = {name: _arm_pinned(spec, plan) for name, spec in arm_specs.items()}
    res = {}
    for ctx in ctxs:
        with progress_bar(err, f"context {ctx}:") as bar:  # on a terminal only
            res[ctx] = bench_context(m, arm_specs, ctx, settings, steps, rounds,
                                     progress=lambda i, n: bar("rounds", i, n), routing=source)
        if not as_json:
            _print_context(out, ctx, res[ctx], steps, rounds, source)
    if as_json:
        out.write(json.dumps(res) + "\n")
    return 0


def context_list(contexts: str) -> list[int]:
    """--context LIST in tokens (`4k,32k` -> [4096, 32768]); a bad item is a usage error."""
    items = list_items(contexts, "--context", "4k,32k")
    try:
        return [context_tokens(c) for c in items]
    except FtchatError as e:
        raise UsageError(str(e)) from None


def bench_contexts(contexts: list[int] | None, positions: int, tokens: int) -> list[int]:
    """The --context list (context_list), each checked against the model's positions before
    loading; none given: DEFAULT_CONTEXT, or less where the model's positions leave no room
    for the `tokens` each arm decodes (bench_tokens; the demo model has 4,096 positions)."""
    room = positions - tokens - 2  # bench_context's KV capacity beyond ctx
    if contexts is None:
        if room < 1:
            raise UsageError(f"{tokens} bench tokens (warm-up and rounds) do not fit the model's "
                             f"{positions} positions: give fewer --steps or --rounds")
        return [min(DEFAULT_CONTEXT, room)]
    for ctx in contexts:
        if ctx > room:
            raise UsageError(f"--context {ctx}: with {tokens} bench tokens (warm-up and rounds) "
                             f"it exceeds the model's {positions} positions; give "
                             f"{max(room, 1)} or less")
    return contexts


def _print_context(out: TextIO, ctx: int, arms: dict[str, dict], steps: int,
                   rounds: int, routing: RoutingSource) -> None:
    table = Table(title=f"context {ctx}: {rounds} interleaved rounds of {steps} tokens, "
                  f"routing {routing}")
    # the budget --budget auto measured and chose, beside the arm's name
    names = {name: name if v.get("budget_auto") is None else f"{name} (auto {v['budget_auto']})"
             for name, v in arms.items()}
    rows = [(names[name], f"{v['tok_s']:.2f}", _f(v["vs_off"], "{:.3f}"),
             f"{v['ms_per_layer']:.3f}", f"{v['misses_per_token']:.1f}",
             f"{v['useful_per_layer']:.2f}", _f(v["precision"], "{:.2f}"))
            for name, v in arms.items()]
    console = Console(file=out)
    # the arm names whole (two budgets must not both read `on:budget…`); where the one-line
    # headers do not fit the terminal (80 columns), each figure's header wraps at its spaces
    cells = [max([len(r[i]) for r in rows], default=0) for i in range(len(COLUMNS))]
    one_line = sum(max(len(c), w) for c, w in zip(COLUMNS, cells)) + 3 * len(COLUMNS) + 1
    for i, col in enumerate(COLUMNS):
        if i == 0:
            table.add_column(col, no_wrap=True, min_width=cells[0])
        elif one_line <= console.width:
            table.add_column(col)
        else:
            header = col if len(col) <= max(cells[i], 6) else col.replace("/", "/ ")
            words = [header] if header == col else header.split()
            table.add_column(header, width=max(cells[i], *map(len, words)))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    peak = next(iter(arms.values()), {})
    if peak.get("vram_peak_reserved_mib") is not None:  # CUDA only
        budget = _f(peak["vram_budget_mib"], "{:,.0f} MiB")
        out.write(f"VRAM peak since start: allocated {peak['vram_peak_allocated_mib']:,.0f} MiB, "
                  f"reserved {peak['vram_peak_reserved_mib']:,.0f} MiB (graph pools included); "
                  f"budget {budget}\n")


def _arm_pinned(spec: ArmSpec, plan: VramPlan | None) -> ArmSpec:
    """A bench arm with the planned slots (every offloaded arm holds its own bank)."""
    if spec.settings is None:
        return spec
    return dataclasses.replace(spec, settings=pin_planned_slots(spec.settings, plan))


def _f(x, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)
