"""`ftchat bench`: decode throughput of arms run side by side in one process, interleaved ABAB.

Each arm (e.g. `off`, `on`, `on:budget=4`, `resident`, `off:eviction=lru`, `off:graph=0`,
`resident:fused=0`) gets its own expert backend and decode state over the same loaded weights;
every round runs every arm once. An arm is `resident`, `off`, `measure` or `on` (the prefetch
mode; resident: every expert in VRAM), then `:key=value,...`:
* kernel keys (any arm), its KernelConfig (ftchat/kernels/config.py; default: the settings'):
  `fused=0|1` (0: the torch path on CUDA, the before of a kernel's before/after), `pdl=0|1`
  (programmatic dependent launch of the fused kernels);
* `skip=FAMILY[+FAMILY...]|all` (resident arms only; ftchat/kernels/skip.py): the step with
  those kernel families left out (hc, gemv, nvfp4, routed, router, gdn, qsa); beside `resident`
  the difference is their marginal cost (its tokens are not the model's);
* settings keys (offload arms; the flags' names and checks): `budget`, `eviction`, `overlap`,
  `graph`, `kv_cache_dtype`, ... (`off:kv_cache_dtype=fp8` stores that arm's K/V cache as FP8).
After the rounds one more step of each arm is profiled: kernels per step and the device's busy
time. Each arm decodes through engine.decode, the loop chat uses, from one token prefilled at
the context length over a zero KV cache: the figures are the step cost at that context, not
model quality.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ftchat import engine
from ftchat.engine import Decoder, LoadedModel, build_experts, resident_backend
from ftchat.errors import FtchatError, UsageError, check_positive
from ftchat.kernels.config import KernelConfig
from ftchat.kernels.skip import Skip, parse_skip
from ftchat.model.expert_backend import ExpertBackend
from ftchat.offload.backend import ResidentExperts, StagedExperts
from ftchat.offload.budget import SETTLE_STEPS
from ftchat.profile import profile_call
from ftchat.routing.calibrated import Geometry
from ftchat.routing.forced import ForcedRouting, RoutingSource
from ftchat.settings import Settings, override
from ftchat.vram.workloads import budget_bytes, peak_report

COUNTERS = ("misses", "prefetch_installs", "prefetch_useful")
START_TOKEN = 7  # the prefilled token the arms decode from


MODEL_ROUTING = RoutingSource("model")
KERNEL_KEYS = ("fused", "pdl")  # an arm's KernelConfig switches, 1 or 0


@dataclass(frozen=True)
class ArmSpec:
    settings: Settings | None  # None: every expert resident
    kernels: KernelConfig  # the arm's kernel configuration (fused=, pdl=, skip=)


def arm_kernels(flags: dict[str, str], base: Settings) -> KernelConfig:
    """The KernelConfig of an arm's kernel keys (popped from flags): the settings' by default,
    each of fused= / pdl= 1 or 0, skip= families (a Skip of the arm's own)."""
    if "kernels" in flags:  # the setting the flag --kernels sets: an arm spells it fused=
        raise FtchatError("kernels= is spelled fused=1 (fused) or fused=0 (torch) in an arm")
    kc = KernelConfig.from_settings(base)
    switches = {k: flags.pop(k) for k in KERNEL_KEYS if k in flags}
    for k, v in switches.items():
        if v not in ("0", "1"):
            raise FtchatError(f"{k}={v!r}: expected 1 or 0")
    skip = flags.pop("skip", None)
    return dataclasses.replace(kc, **{k: v == "1" for k, v in switches.items()},
                               skip=None if skip is None else Skip(parse_skip(skip)))


def parse_arm(spec: str, base: Settings) -> ArmSpec:
    """`on:budget=4,eviction=lru` -> its settings; `resident[:fused=0]` -> every expert in VRAM.
    Values are checked as the flags are (`eviction=foo` names --eviction)."""
    head, _, rest = spec.strip().partition(":")
    if head not in ("resident", "off", "measure", "on"):
        raise FtchatError(f"arm {spec!r}: expected resident, off, measure or on[:k=v,...]")
    flags = {}
    for item in filter(None, rest.replace(";", ",").split(",")):
        k, eq, v = item.partition("=")
        if not eq or not v.strip():
            raise FtchatError(f"arm {spec!r}: {item!r} is not key=value")
        flags[k.strip()] = v.strip()
    if "skip" in flags and head != "resident":
        raise FtchatError(f"arm {spec!r}: skip= is for resident arms (the offload arms' "
                          "cache and prefetch would see kept outputs)")
    try:
        kernels = arm_kernels(flags, base)
    except FtchatError as e:
        raise FtchatError(f"arm {spec!r}: {e}") from None
    if head == "resident" and flags:
        raise FtchatError(f"arm {spec!r}: resident takes only fused=, pdl= (1 or 0) and "
                          "skip=")
    try:
        s = None if head == "resident" else override(dataclasses.replace(base, prefetch=head),
                                                      flags)
    except FtchatError as e:
        raise FtchatError(f"arm {spec!r}: {e}") from None
    return ArmSpec(s, kernels)


def parse_arms(arms: str, base: Settings) -> dict[str, ArmSpec]:
    """'off;on;on:budget=4' -> {name: settings}; at least one arm, each named once."""
    names = [a.strip() for a in arms.split(";") if a.strip()]
    if not names:
        raise UsageError("--arms: no arm given (e.g. 'off;on;on:budget=4')")
    if len(set(names)) != len(names):
        raise UsageError(f"--arms {arms!r}: an arm is given twice")
    try:
        return {name: parse_arm(name, base) for name in names}
    except FtchatError as e:  # a flag's bad value in an arm: a usage error of --arms
        raise UsageError(f"--arms: {e}") from None


@dataclass
class Arm:
    name: str
    device: torch.device
    spec: ArmSpec
    experts: ExpertBackend
    steps: object  # the arm's engine.decode iterator
    extra_vram: int  # bytes its decoder and own backend allocated (not the shared resident rows)
    setup_s: float  # backend, decoder, graph capture (Triton compiles on first use) and prefill
    times: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    tokens: int = 0


def make_arm(m: LoadedModel, name: str, spec: ArmSpec, base: Settings, ctx: int,
             max_len: int, resident: ResidentExperts | None,
             routing: RoutingSource = MODEL_ROUTING) -> Arm:
    """An arm's backend and decode iterator over a view of the weights that holds the arm's
    kernel configuration; resident arms share `resident`'s rows (the real model's fill most of
    the GPU once). A routing source other than the model's routes its decode steps (each arm
    from the source's first step)."""
    s, kc = spec.settings, spec.kernels
    if kc.skip is not None and not kc.runs_fused(torch.empty(0, device=m.device)):
        raise UsageError(f"bench arm {name!r}: skip= leaves out fused CUDA kernels, and on "
                         f"{m.device} the decode step runs none")
    before, t = _allocated(m), time.perf_counter()
    am = dataclasses.replace(m, weights=m.weights.with_kernels(kc))
    if s is None:
        ex = ResidentExperts(resident.rows, resident.layout, resident.num_experts, kc)
    else:
        ex = build_experts(am, s)
    if routing.kind != "model":
        a = m.args
        geo = Geometry(a.num_hidden_layers, a.num_experts, a.num_experts_per_tok,
                       min((s or base).candidates, a.num_experts))
        ex = ForcedRouting(ex, routing.steps(geo), geo, 1, m.dtype, m.device)
    cfg = base if s is None else s
    dec = Decoder(am, ex, 1, max_len, graph=cfg.use_graph(), kv_dtype=cfg.kv_torch_dtype())
    steps = engine.decode(dec, [[START_TOKEN]], [ctx], [max_len])
    next(steps)  # the prefill of the start token
    _sync(m.device)
    return Arm(name, m.device, spec, ex, steps, _allocated(m) - before,
               time.perf_counter() - t)


def run_round(arm: Arm, steps: int) -> None:
    """`steps` decode steps of one arm, timed, with its backend's counters."""
    before = arm.experts.stats()
    _sync(arm.device)
    t = time.perf_counter()
    for _ in range(steps):
        next(arm.steps)
    _sync(arm.device)
    arm.times.append(time.perf_counter() - t)
    after = arm.experts.stats()
    for k in COUNTERS:
        arm.counts[k] += int(after.get(k, 0)) - int(before.get(k, 0))  # {} when resident
    arm.tokens += steps


def uses_auto_budget(spec: ArmSpec) -> bool:
    s = spec.settings
    return s is not None and s.prefetch == "on" and None in (s.budget_gdn, s.budget_attn)


def warm_up_steps(arms: dict[str, ArmSpec], steps: int) -> int:
    """The warm-up round's steps: `steps`, or, where an arm uses --budget auto, enough for its
    window and trials, so that the timed rounds run the budget it chose."""
    return max(steps, SETTLE_STEPS) if any(map(uses_auto_budget, arms.values())) else steps


def bench_tokens(arms: dict[str, ArmSpec], steps: int, rounds: int) -> int:
    """Tokens each arm decodes past the context in its warm-up and rounds (the KV cache holds
    two more: the start token and the profiled step)."""
    return warm_up_steps(arms, steps) + rounds * steps


def bench_context(m: LoadedModel, arms: dict[str, ArmSpec], ctx: int, base: Settings,
                  steps: int, rounds: int,
                  progress: Callable[[int, int], None] | None = None,
                  routing: RoutingSource = MODEL_ROUTING) -> dict:
    """Interleaved arms at one context length; per arm tok/s, misses, prefetch figures.
    `progress(done, total)` after each round (the warm-up round included)."""
    check_positive(("--steps", steps), ("--rounds", rounds))
    warm = warm_up_steps(arms, steps)
    tokens = bench_tokens(arms, steps, rounds)
    max_len = ctx + tokens + 2
    if max_len > m.args.max_position_embeddings:
        raise UsageError(f"--context {ctx} + {tokens} bench tokens (warm-up and rounds) exceeds "
                         f"the model's {m.args.max_position_embeddings} positions")
    resident = resident_backend(m) if any(a.settings is None for a in arms.values()) else None
    built = [make_arm(m, name, spec, base, ctx, max_len, resident, routing)
             for name, spec in arms.items()]
    for arm in built:  # warm-up round (fills the caches, settles --budget auto), not counted
        run_round(arm, warm)
        arm.times, arm.tokens, arm.counts = [], 0, dict.fromkeys(COUNTERS, 0)
    if progress:
        progress(1, rounds + 1)
    for r in range(rounds):  # ABAB: every round runs every arm once
        for arm in built:
            run_round(arm, steps)
        if progress:
            progress(r + 2, rounds + 1)
    L = m.args.num_hidden_layers
    out = {}
    for a in built:
        prof = profile_call(lambda: next(a.steps), m.device)  # None off CUDA
        c, total = a.counts, a.experts.stats()
        out[a.name] = {
            "tok_s": a.tokens / sum(a.times), "round_tok_s": [steps / t for t in a.times],
            "ms_per_layer": sum(a.times) / a.tokens / L * 1e3,
            "misses_per_token": c["misses"] / a.tokens,
            "prefetch_installs_per_token": c["prefetch_installs"] / a.tokens,
            "useful_per_layer": c["prefetch_useful"] / a.tokens / L,
            # over the arm's whole run: a prefetch is credited when first used, which can be a
            # round after its install, so a window's ratio could pass 1
            "precision": (total["prefetch_useful"] / total["prefetch_installs"]
                          if total.get("prefetch_installs") else None),
            # --budget auto: the budget it chose, the link's measured time a row and the
            # compute a layer it measured (their ratio sets the budget)
            "budget_auto": total.get("budget_auto"), "link_row_us": total.get("link_row_us"),
            "auto_compute_us": total.get("auto_compute_us"),
            "auto_trial_ms": total.get("auto_trial_ms"),
            "extra_vram_mib": a.extra_vram / 2**20, "setup_s": a.setup_s,
            "routing": str(routing), "rows_per_token":
                (c["misses"] + c["prefetch_installs"]) / a.tokens,
            "kernels_per_step": prof.kernels if prof else None,
            "kernels_per_layer": prof.kernels / L if prof else None,
            "busy_us_per_layer": prof.busy_us / L if prof else None,
            "top_kernels": prof.top() if prof else None}
    off = out.get("off", {}).get("tok_s")
    peak = peak_report(m.device, budget_bytes(base))  # process peaks: every arm ran by now
    for v in out.values():
        v["vs_off"] = v["tok_s"] / off if off else None
        v.update(peak)
    for a in built:
        a.steps.close()
        a.experts.close()
    del built, resident
    if m.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_prefill(m: LoadedModel, base: Settings, lengths: list[int],
                  stream_layers: bool = True, copied: dict | None = None) -> dict:
    """Prefill tok/s with offloaded experts (staging area on CUDA), in chunks of
    base.prefill_chunk tokens; stream_layers False turns the layer streaming off (an arm).
    copied: filled with each length's host-to-device bytes of the timed prefill (staging)."""
    ex = build_experts(m, dataclasses.replace(base, prefetch="off"))
    staged = ex.for_prefill()
    if isinstance(staged, StagedExperts):
        staged.stream_layers = stream_layers
    out = {}
    for n in lengths:
        dec = Decoder(m, ex, 1, n + 2, prefill_chunk=base.prefill_chunk,
                      kv_dtype=base.kv_torch_dtype())
        ids = torch.randint(0, min(1000, m.args.vocab_size), (n,))
        dec.prefill(0, ids[:256], 0)  # warm-up
        dec.reset()
        _sync(m.device)
        rows = int(staged.rows_from_host) if isinstance(staged, StagedExperts) else 0
        t = time.perf_counter()
        dec.prefill(0, ids, 0)
        _sync(m.device)
        out[n] = n / (time.perf_counter() - t)
        if copied is not None and isinstance(staged, StagedExperts):
            copied[n] = (int(staged.rows_from_host) - rows) * m.layout.nbytes
        del dec
    return out


def _allocated(m: LoadedModel) -> int:
    return torch.cuda.memory_allocated(m.device) if m.device.type == "cuda" else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
