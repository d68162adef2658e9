"""`ftchat verify`: prefetch's losslessness on a model, checked over cold prompts.

N cold prompts (a random nonce prefix, so no cache is warm), each decoded greedily with prefetch
off and on (fresh caches, same settings otherwise), compared token by token; the verifier and the
slot audit watch the `on` arm. The audit byte-checks the whole cache every N decode steps and once
more at the end of every group of prompts, so every prompt is audited however short. The hooked
arms run eagerly (the debug records read Python-side step numbers).

The prompts are decoded in groups of G (`--batch`; auto: as many as the slots hold, at most
AUTO_BATCH_CAP): each arm decodes a group as one batch of G rows (each row prefilled on its own,
ragged lengths allowed) from a fresh backend, so a group starts cold as a single prompt did (the
eager step is bound by Python overhead, not by its rows: the point of a group). The tokens
are compared row by row and the verdicts stay per prompt, but the verifier and the audit watch a
backend, which a whole group shares: a group's records, audits and bad slots are carried by its
first prompt's verdict (the others' are empty; `group` names the group of each). G = 1 is the
chat path (`ftchat run` decodes one row), prompt by prompt.

verify --graph adds the production path the hooked arms cannot watch: every prompt decoded with
prefetch off and on by the same loop `ftchat run` uses, the step replayed from a CUDA graph, no
hooks, and its tokens compared with the eager arm of the same prefetch setting and with each
other (prefetch on vs off in replay, which holds even where replay and eager decode part). Each
graph arm is captured for G rows; a smaller last group gets a pair captured at its own size (the
larger pair freed first), so every replayed batch is the batch its eager arms decoded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

from rich.console import Console
from rich.table import Table

from ftchat.commands.load import load_checked, pin_planned_slots
from ftchat.debug.slot_audit import SlotAudit
from ftchat.debug.verifier import Verifier
from ftchat.debug.watchers import HookChain
from ftchat.engine import Decoder, LoadedModel, build_experts, decode, generate, num_slots
from ftchat.errors import FtchatError, UsageError, check_positive
from ftchat.kernels.routed_experts import DECODE_MAX_TOKENS
from ftchat.offload.hooks import BackendView
from ftchat.settings import Settings
from ftchat.ui.progress import progress_bar
from ftchat.vram.workloads import given_slots, verify_workload


GRAPH_DEVICES = ("cuda",)  # where DecodeGraph can capture a step: CUDA graphs have no CPU twin
AUTO_BATCH_CAP = 16  # the most prompts a group takes when --batch is not given
MAX_PROMPTS = 100_000  # --prompts: days of decoding already, and all held in memory

QUESTIONS = (
    "Write a Python function that merges two sorted lists.",
    "Explain what a hash table is in two sentences.",
    "What does the `with` statement do in Python?",
    "List three uses of a priority queue.",
    "How do I reverse a string in Python?",
    "Describe the difference between a process and a thread.",
    "Write a SQL query that counts rows per customer.",
    "What is the time complexity of binary search?",
)


def cold_prompts(n: int, seed: int) -> list[str]:
    """n prompts, each a fresh random nonce and a question; the questions cycle from the seed's
    place, so runs split by seed (shards of a few prompts) still ask every question."""
    rng = random.Random(seed)
    return [f"[{rng.getrandbits(64):016x}] {QUESTIONS[(seed + i) % len(QUESTIONS)]}"
            for i in range(n)]


class BatchTooLarge(FtchatError):
    """--batch N needs more expert slots than the run has: a usage error (the CLI exits 2)."""


def group_size(batch: int | None, prompts: int, slots: int | None, top_k: int,
               graph: bool = False) -> int:
    """Prompts decoded together: --batch N (at most the prompts), or auto (None): as many as the
    slots hold (every row's top-k experts are resident at once, as engine.num_slots requires),
    at most AUTO_BATCH_CAP. slots None: not known yet (sized at load), so not checked; auto then
    assumes the cap. With graph (`--graph`) at most DECODE_MAX_TOKENS rows: a larger batch takes
    the prefill expert path, which a CUDA graph cannot capture (measured: the capture fails)."""
    cap = min(AUTO_BATCH_CAP, DECODE_MAX_TOKENS) if graph else AUTO_BATCH_CAP
    if batch is None:
        fit = cap if slots is None else slots // top_k
        return max(1, min(prompts, fit, cap))
    if graph and batch > DECODE_MAX_TOKENS:
        raise BatchTooLarge(f"--batch {batch}: --graph replays decode steps of at most "
                            f"{DECODE_MAX_TOKENS} rows; give --batch {DECODE_MAX_TOKENS} or less")
    g = min(batch, prompts)
    if slots is not None and g * top_k > slots:
        need = g * top_k
        fits = f"give --batch {slots // top_k} or less, or " if slots >= top_k else "give "
        raise BatchTooLarge(f"--batch {batch}: {g} prompts decoded together need {need} expert "
                            f"slots ({g} x top-k {top_k}), more than the {slots} the run has; "
                            f"{fits}--slots {need} or more")
    return g


@dataclass
class PromptVerdict:
    index: int
    tokens: int
    first_mismatch: int | None  # position of the first differing token, None if identical
    records: list[dict] = field(default_factory=list)
    audits: int = 0
    bad_slots: list[dict] = field(default_factory=list)
    # --graph: {"off": p, "on": p}, p the first position where graph replay differs from the eager
    # arm of the same prefetch setting (None: identical); None: no graph arms ran
    graph_first_mismatch: dict[str, int | None] | None = None
    # --graph: the first position where the prefetch-on graph arm differs from the prefetch-off
    # graph arm (None: identical, or no graph arms): prefetch's losslessness on the replayed path,
    # whether or not replay itself matches eager decode
    graph_prefetch_first_mismatch: int | None = None
    # wall time of each arm: the prompt's share of its group's (divided evenly), so a mean over
    # prompts is seconds per prompt at the run's batch
    seconds: dict[str, float] = field(default_factory=dict)
    # the prompt's tokens: the eager arms size their KV cache to it, the graph arms to the
    # longest prompt of the run (a replay-vs-eager difference that follows it shows here)
    prompt_tokens: int = 0
    group: int = 0  # the group the prompt was decoded in (its first prompt carries its findings)


def _greedy(m: LoadedModel, prompts: list[list[int]], max_new: int, ex,
            settings: Settings) -> list[list[int]]:
    """The tokens of each row of one batch, decoded eagerly from the backend ex."""
    steps = generate(m, prompts, max_new, ex, kv_dtype=settings.kv_torch_dtype())
    return _rows(steps, len(prompts))


def _rows(steps, batch: int) -> list[list[int]]:
    rows: list[list[int]] = [[] for _ in range(batch)]
    for s in steps:
        for row, t in zip(rows, s.tokens, strict=True):
            row.append(t)
    return rows


def graph_refusal(settings: Settings) -> str | None:
    """Why `verify --graph` cannot run with these settings, or None."""
    device = settings.torch_device().type
    if device not in GRAPH_DEVICES:
        return (f"CUDA-graph replay needs a CUDA device and this run is on {device}; there is "
                "no CPU equivalent (drop --graph)")
    if settings.slots is None and settings.expert_vram_gib is None \
            and settings.vram_budget_gib is None:
        # two graph arms keep their slot caches all run: each cannot take the free VRAM (a
        # --vram-budget plan counts the four arms' banks)
        return ("give --slots, --expert-vram or --vram-budget: the graph arms hold their slot "
                "caches all run")
    return None


class GraphArm:
    """One prefetch setting decoded as `ftchat run` decodes: no hooks, the step replayed from a
    CUDA graph captured once for `batch` rows and reused for every group of that size (state and
    cache emptied in place between groups, as a session reuses its decoder), through
    `engine.decode`."""

    def __init__(self, m: LoadedModel, settings: Settings, max_len: int, batch: int = 1):
        self.batch = batch
        self.dec = Decoder(m, build_experts(m, settings), batch, max_len, graph=True,
                           kv_dtype=settings.kv_torch_dtype())
        if self.dec.graph is None:  # Decoder falls back to eager: that would not be graph replay
            raise UsageError("--graph: this model's decode step cannot be captured in a CUDA "
                             "graph (its n-gram table is read from host files each step)")

    def __call__(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        self.dec.reset()  # a cold cache, as the eager arms' fresh backends
        B = len(prompts)
        return _rows(decode(self.dec, prompts, [0] * B, [max_new] * B), B)


class _ArmClock:
    """Wall seconds of each arm of one group (each arm ends in a host read of its tokens, so
    its device work is done when the block ends)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, arm: str):
        t = time.perf_counter()
        yield
        self.seconds[arm] = round(time.perf_counter() - t, 3)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if first is None and len(a) != len(b) else first


def verify_prompts(m: LoadedModel, encode: Callable[[str], list[int]], settings: Settings,
                   n: int, max_new: int, mode: str, audit_every: int = 64, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None,
                   batch: int | None = None) -> list[PromptVerdict]:
    """Prefetch off vs on over n cold prompts, decoded in groups of `batch` (None: auto,
    `group_size`); returns one verdict per prompt. An explicit settings.graph (`verify
    --graph`) adds the graph arms (GraphArm), prefetch off and on. `progress(done, n)` counts
    prompts, after each group."""
    a = m.args
    base = dataclasses.replace(settings, verify=None, audit_every=0, batch_size=1)
    G = group_size(batch, n, num_slots(m, base), a.num_experts_per_tok, settings.graph is True)
    base = dataclasses.replace(base, batch_size=G)  # the backends check their slots for G rows
    off_settings = dataclasses.replace(base, prefetch="off")
    on_settings = base if base.prefetch == "on" else dataclasses.replace(base, prefetch="on")
    S = num_slots(m, on_settings)
    prompts = [encode(text) for text in cold_prompts(n, seed)]
    longest = max(map(len, prompts))
    if longest + max_new + 1 > a.max_position_embeddings:
        raise UsageError(f"--max-new-tokens {max_new}: with prompts of up to {longest} tokens "
                         f"it exceeds the model's {a.max_position_embeddings} positions; give "
                         f"{max(a.max_position_embeddings - longest - 1, 1)} or less")
    groups = [list(range(i, min(i + G, n))) for i in range(0, n, G)]
    graphs = None
    if settings.graph is True:
        if m.device.type not in GRAPH_DEVICES:
            raise UsageError(f"--graph: no CUDA graphs on {m.device.type}")
        # the KV capacity a run would give (--context), at least what the eager arms use
        max_len = max(settings.context or 0, max(map(len, prompts)) + max_new + 1)

        def capture(rows: int) -> dict[str, GraphArm]:
            return {"off": GraphArm(m, off_settings, max_len, rows),
                    "on": GraphArm(m, on_settings, max_len, rows)}
        graphs = capture(G)
    verdicts = []
    for g, rows in enumerate(groups):
        group = [prompts[i] for i in rows]
        if graphs is not None and graphs["off"].batch != len(group):
            # the last group is smaller: capture at its size (the same batch as its eager arms,
            # so the same kernels), after the larger pair's slot banks are freed
            graphs = None
            gc.collect()  # a backend and its view refer to each other: free the banks now
            graphs = capture(len(group))
        clock = _ArmClock()
        with clock("off"):
            off = _greedy(m, group, max_new, build_experts(m, off_settings), off_settings)
        verifier = Verifier(mode, a.num_hidden_layers, m.device)
        audit = SlotAudit(audit_every, S, m.device)
        with clock("on"):
            ex = build_experts(m, on_settings, hooks=HookChain([verifier, audit]))
            on = _greedy(m, group, max_new, ex, on_settings)
            audit.audit(BackendView(ex))  # the cache as the group left it
        replayed = {}
        if graphs is not None:
            for name in ("off", "on"):
                with clock(f"graph_{name}"):
                    replayed[name] = graphs[name](group, max_new)
        # each prompt's share of the group's wall time: the mean stays seconds per prompt
        share = {arm: round(t / len(group), 3) for arm, t in clock.seconds.items()}
        records = verifier.report()
        for r, i in enumerate(rows):
            first = next((j for j, (x, y) in enumerate(zip(off[r], on[r])) if x != y), None)
            graph_first = graph_prefetch = None
            if replayed:
                graph_first = {"off": _first_diff(off[r], replayed["off"][r]),
                               "on": _first_diff(on[r], replayed["on"][r])}
                graph_prefetch = _first_diff(replayed["off"][r], replayed["on"][r])
            lead = r == 0  # the group's watchers' findings go to its first prompt
            verdicts.append(PromptVerdict(i, len(on[r]), first, records if lead else [],
                                          audit.audits if lead else 0,
                                          audit.bad if lead else [], graph_first,
                                          graph_prefetch, dict(share), len(group[r]), g))
        if progress:
            progress(len(verdicts), n)
    return verdicts


def summary(verdicts: list[PromptVerdict]) -> dict:
    mism = [v for v in verdicts if v.first_mismatch is not None]
    out = {"prompts": len(verdicts), "mismatches": len(mism),
           "first_mismatch": min((v.first_mismatch for v in mism), default=None),
           "verifier_records": sum(len(v.records) for v in verdicts),
           "audits": sum(v.audits for v in verdicts),
           "bad_slots": sum(len(v.bad_slots) for v in verdicts)}
    graph = [v.graph_first_mismatch for v in verdicts if v.graph_first_mismatch is not None]
    if graph:  # only a --graph run has these columns
        firsts = [p for g in graph for p in g.values() if p is not None]
        out["graph_mismatches"] = sum(any(p is not None for p in g.values()) for g in graph)
        out["graph_first_mismatch"] = min(firsts, default=None)
        out["graph_prefetch_mismatches"] = sum(v.graph_prefetch_first_mismatch is not None
                                               for v in verdicts)
    return out


def failure(s: dict) -> str | None:
    """Why a verify summary fails, or None: a mismatch, a verifier record, a bad slot, or no
    audit at all (a check that did not run proves nothing)."""
    if s["mismatches"]:
        return f"{s['mismatches']} of {s['prompts']} prompts differ with prefetch on"
    if s.get("graph_prefetch_mismatches"):
        return (f"{s['graph_prefetch_mismatches']} of {s['prompts']} prompts differ with "
                "prefetch on in CUDA-graph replay")
    if s.get("graph_mismatches"):
        return (f"{s['graph_mismatches']} of {s['prompts']} prompts differ between CUDA-graph "
                "replay and eager decode")
    if s["verifier_records"]:
        return f"the verifier recorded {s['verifier_records']} violations"
    if s["bad_slots"]:
        return f"the slot audit found {s['bad_slots']} bad slots"
    if not s["audits"]:
        return "no slot audit ran"
    return None


def run_verify(model: str | None, settings: Settings, env: Mapping[str, str], mode: str,
               prompts: int, max_new: int, audit_every: int, as_json: bool, out: TextIO,
               err: TextIO, prompt_seed: int = 0, batch: int | None = None) -> int:
    """`ftchat verify`: load, check prefetch on vs off over cold prompts (nonces seeded by
    prompt_seed, decoded `batch` at a time; None: auto) with the verifier and audit on the `on`
    arm, print the verdict; the exit code. A --batch the slots cannot hold raises
    BatchTooLarge, before the weights load where --slots or --expert-vram gives the count."""
    if mode not in ("meta", "bytes"):
        raise UsageError(f"--mode {mode!r}: expected meta or bytes")
    check_positive(("--prompts", prompts), ("--max-new-tokens", max_new),
                   ("--audit-every", audit_every), ("--batch", batch))
    if prompts > MAX_PROMPTS:  # they are made and encoded up front: memory
        raise UsageError(f"--prompts {prompts}: expected at most {MAX_PROMPTS:,}; split a longer "
                         "run over calls with --prompt-seed")
    arms = 4 if settings.graph is True else 2  # verify --graph keeps two more backends

    def workload(a, layout):
        rows = group_size(batch, prompts, given_slots(settings, layout), a.num_experts_per_tok,
                          settings.graph is True)
        return verify_workload(a, layout, settings, max_new, arms, rows)

    m, tok, plan = load_checked(model, settings, env, err, workload)
    settings = pin_planned_slots(settings, plan)

    def encode(text: str) -> list[int]:
        return tok.encode(tok.render_chat([{"role": "user", "content": text}]))

    with progress_bar(err, "verifying") as bar:
        verdicts = verify_prompts(m, encode, settings, prompts, max_new, mode, audit_every,
                                  seed=prompt_seed, progress=lambda i, n: bar("prompts", i, n),
                                  batch=batch)
    s = summary(verdicts)
    rows = max(Counter(v.group for v in verdicts).values())  # the group size the run took
    if as_json:
        out.write(json.dumps({**s, "prompt_seed": prompt_seed, "batch": rows,
                              "per_prompt": [vars(v) for v in verdicts]}) + "\n")
    else:
        table = Table(title=f"prefetch on vs off, verify={mode}, audit every {audit_every}")
        for col in s:
            table.add_column(col.replace("_", " "))
        table.add_row(*["-" if v is None else str(v) for v in s.values()])
        Console(file=out).print(table)
        flagged = [v for v in verdicts
                   if v.first_mismatch is not None or v.records or v.bad_slots]
        for v in flagged:
            where = f" (group {v.group})" if rows > 1 else ""
            out.write(f"prompt {v.index}{where}: first mismatch {v.first_mismatch}, "
                      f"{len(v.records)} records, {len(v.bad_slots)} bad slots; "
                      f"first record {v.records[:1]}\n")
        if flagged and rows > 1:
            out.write("(a group's records and bad slots are listed on its first prompt)\n")
    why = failure(s)
    if not as_json:  # the verdict, last: one line a reader (or a script) looks for
        out.write(f"FAIL: {why}\n" if why else
                  f"PASS: prefetch on matched off over {prompts} prompts x {max_new} tokens, "
                  "no verifier record, no bad slot\n")
    if why:
        err.write(f"error: {why}\n")
    return 1 if why else 0
