"""`ftchat verify`, `ftchat audit` and `ftchat bench`: load, run, print a verdict."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.table import Table

from ftchat.errors import FtchatError
from ftchat.model.config import check_context, load_args
from ftchat.resolve import demo_notice, resolve_model
from ftchat.settings import Settings, context_tokens
from ftchat.ui.progress import progress_bar

if TYPE_CHECKING:  # vram_plan imports the engine (torch): on use, after the flags are good
    from ftchat import vram_plan as vp


def _preflight(a, layout, settings: Settings, w: vp.Workload) -> vp.VramPlan | None:
    """The VRAM plan checked before loading, when something is asked of it (a budget, a slot
    count); None otherwise (slots are sized after loading, as before)."""
    from ftchat.vram_plan import preflight

    if settings.vram_budget_gib is None and all(s is None for s in w.banks):
        return None
    return preflight(a, layout, settings, w)


def _pinned(settings: Settings, plan: vp.VramPlan | None) -> Settings:
    """Under a budget, the planned slot count: the backends built later hold several banks at
    once, which engine.num_slots (one bank) does not know."""
    if plan is None or settings.vram_budget_gib is None or settings.slots is not None \
            or settings.expert_vram_gib is not None:
        return settings
    return dataclasses.replace(settings, slots=plan.slots)


def _load(model: str | None, settings: Settings, env: Mapping[str, str], err: TextIO,
          work=None):
    """(model, tokenizer, plan): `work(args, layout)` is the Workload the VRAM plan checks
    before the weights load (None: no plan)."""
    from ftchat.engine import load_model
    from ftchat.model.tokenizer import Tokenizer

    resolved = resolve_model(model, env)
    check_context(load_args(resolved.path), settings.context)
    plan = None
    if work is not None:
        from ftchat.vram_plan import checkpoint_dense_nvfp4, checkpoint_inputs

        a, layout = checkpoint_inputs(resolved.path)
        w = dataclasses.replace(work(a, layout),
                                dense_nvfp4=checkpoint_dense_nvfp4(resolved.path))
        plan = _preflight(a, layout, settings, w)
    if resolved.demo:
        print(demo_notice(resolved.path), file=err)
    tok = Tokenizer.from_folder(resolved.path)
    with progress_bar(err, "loading") as bar:
        m = load_model(resolved.path, str(settings.torch_device()), settings.torch_dtype(), bar)
    return m, tok, plan


def verify(model: str | None, settings: Settings, env: Mapping[str, str], mode: str,
           prompts: int, max_new: int, audit_every: int, as_json: bool,
           out: TextIO | None = None, err: TextIO | None = None, prompt_seed: int = 0) -> int:
    """Prefetch on vs off over cold prompts (nonces seeded by prompt_seed) with the verifier
    and audit on the `on` arm."""
    from ftchat.commands import verify as commands

    out, err = out or sys.stdout, err or sys.stderr
    if mode not in ("meta", "bytes"):
        raise FtchatError(f"--mode {mode!r}: expected meta or bytes")
    if prompts < 1 or max_new < 1 or audit_every < 1:
        raise FtchatError("--prompts, --max-new-tokens and --audit-every must be >= 1")
    from ftchat.vram_plan import verify_workload

    arms = 4 if settings.graph is True else 2  # verify --graph keeps two more backends
    m, tok, plan = _load(model, settings, env, err, lambda a, layout: verify_workload(
        a, layout, settings, max_new, arms))
    settings = _pinned(settings, plan)
    encode = lambda text: tok.encode(tok.render_chat([{"role": "user", "content": text}]))  # noqa: E731
    with progress_bar(err, "verifying") as bar:
        verdicts = commands.verify(m, encode, settings, prompts, max_new, mode, audit_every,
                                   seed=prompt_seed, progress=lambda i, n: bar("prompts", i, n))
    s = commands.summary(verdicts)
    if as_json:
        out.write(json.dumps({**s, "prompt_seed": prompt_seed,
                              "per_prompt": [vars(v) for v in verdicts]}) + "\n")
    else:
        table = Table(title=f"prefetch on vs off, verify={mode}, audit every {audit_every}")
        for col in s:
            table.add_column(col.replace("_", " "))
        table.add_row(*["-" if v is None else str(v) for v in s.values()])
        Console(file=out).print(table)
        for v in verdicts:
            if v.first_mismatch is not None or v.records or v.bad_slots:
                out.write(f"prompt {v.index}: first mismatch {v.first_mismatch}, "
                          f"{len(v.records)} records, {len(v.bad_slots)} bad slots; "
                          f"first record {v.records[:1]}\n")
    why = commands.failure(s)
    if why:
        err.write(f"error: {why}\n")
    return 1 if why else 0


def audit(model: str | None, settings: Settings, env: Mapping[str, str], every: int,
          prompt_texts: list[str], max_new: int, as_json: bool,
          out: TextIO | None = None, err: TextIO | None = None) -> int:
    from ftchat.commands import verify as commands

    out, err = out or sys.stdout, err or sys.stderr
    if every < 1:
        raise FtchatError("--every must be >= 1")
    if not prompt_texts:
        raise FtchatError("no prompts: give them as arguments or on stdin, one per line")
    from ftchat.vram_plan import verify_workload

    m, tok, plan = _load(model, settings, env, err, lambda a, layout: verify_workload(
        a, layout, settings, max_new, 1))
    settings = _pinned(settings, plan)
    ids = [tok.encode(tok.render_chat([{"role": "user", "content": p}])) for p in prompt_texts]
    a = commands.audit_run(m, ids, settings, every, max_new)
    res = {"prompts": len(ids), "audits": a.audits, "bad_slots": len(a.bad), "bad": a.bad[:20]}
    out.write((json.dumps(res) if as_json else
               f"audits {a.audits}, bad slots {len(a.bad)}"
               + "".join(f"\n  {b}" for b in a.bad[:20])) + "\n")
    why = (f"the slot audit found {len(a.bad)} bad slots" if a.bad else
           None if a.audits else "no slot audit ran")
    if why:
        err.write(f"error: {why}\n")
    return 1 if why else 0


@dataclass(frozen=True)
class Synthetic:
    """A random-weight model bench builds in memory (`--synthetic`), as `ftchat synth` would."""

    preset: str
    layers: int | None
    fmt: str
    dense: str = "bf16"  # "nvfp4": the GDN qkv / z in NVFP4, as the real checkpoint stores them

    def load(self, settings: Settings, err: TextIO):
        from ftchat.model.synth import FORMATS
        from ftchat.model.synth_memory import synthetic_model

        if self.fmt not in FORMATS:
            raise FtchatError(f"--format {self.fmt!r}: expected {', '.join(FORMATS)}")
        if self.layers is not None and self.layers < 2:
            raise FtchatError("--layers must be at least 2")
        with progress_bar(err, "building") as bar:
            return synthetic_model(self.preset, self.layers, self.fmt,
                                   settings.torch_device(), settings.torch_dtype(), progress=bar,
                                   dense=self.dense)


def bench(model: str | None, settings: Settings, env: Mapping[str, str], arms: str,
          contexts: str, steps: int, rounds: int, as_json: bool,
          out: TextIO | None = None, err: TextIO | None = None,
          synthetic: Synthetic | None = None) -> int:
    from ftchat.commands.bench import bench_context, parse_arms

    out, err = out or sys.stdout, err or sys.stderr
    if steps < 1 or rounds < 1:
        raise FtchatError("--steps and --rounds must be >= 1")
    from ftchat import vram_plan as vp

    arm_settings = parse_arms(arms, settings)  # usage errors before the model loads
    ctxs = [context_tokens(c) for c in contexts.split(",")]
    max_len = max(ctxs) + (rounds + 1) * steps + 2  # bench_context's KV capacity

    def work(a, layout) -> vp.Workload:
        return vp.bench_workload(a, layout, settings,
                                 [s.settings for s in arm_settings.values()], max_len)

    if synthetic:
        a, layout = vp.synthetic_inputs(synthetic.preset, synthetic.layers, synthetic.fmt,
                                        synthetic.dense)
        w = dataclasses.replace(work(a, layout), dense_nvfp4=synthetic.dense == "nvfp4")
        plan = _preflight(a, layout, settings, w)
        m = synthetic.load(settings, err)
    else:
        m, _, plan = _load(model, settings, env, err, work)
    arm_settings = {name: _arm_pinned(spec, plan) for name, spec in arm_settings.items()}
    res = {}
    for ctx in ctxs:
        res[ctx] = bench_context(m, arm_settings, ctx, settings, steps, rounds)
        if not as_json:
            table = Table(title=f"context {ctx}: {rounds} interleaved rounds of {steps} tokens")
            for col in ("arm", "tok/s", "vs off", "ms/layer", "misses/token", "useful/layer",
                        "precision"):
                table.add_column(col)
            for name, v in res[ctx].items():
                table.add_row(name, f"{v['tok_s']:.2f}", _f(v["vs_off"], "{:.3f}"),
                              f"{v['ms_per_layer']:.3f}",
                              f"{v['misses_per_token']:.1f}", f"{v['useful_per_layer']:.2f}",
                              _f(v["precision"], "{:.2f}"))
            Console(file=out).print(table)
            peak = next(iter(res[ctx].values()), {})
            if peak.get("vram_peak_reserved_mib") is not None:  # CUDA only
                budget = _f(peak["vram_budget_mib"], "{:,.0f} MiB")
                out.write(f"VRAM peak since start: allocated {peak['vram_peak_allocated_mib']:,.0f}"
                          f" MiB, reserved {peak['vram_peak_reserved_mib']:,.0f} MiB (graph "
                          f"pools included); budget {budget}\n")
    if as_json:
        out.write(json.dumps(res) + "\n")
    return 0


def _arm_pinned(spec, plan: vp.VramPlan | None):
    """A bench arm with the planned slots (every offloaded arm holds its own bank)."""
    if spec.settings is None:
        return spec
    return dataclasses.replace(spec, settings=_pinned(spec.settings, plan))


def _f(x, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)
