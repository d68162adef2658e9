"""`ftchat verify` and `ftchat audit`: losslessness checks of prefetch on a model.

verify: N cold prompts (a random nonce prefix, so no cache is warm), each decoded greedily with
prefetch off and on (fresh caches, same settings otherwise), compared token by token; the
verifier and the slot audit watch the `on` arm. audit: a decode run with the slot audit on.
The audit byte-checks the whole cache every N decode steps and once more at the end of every
prompt, so every prompt is audited however short. Both run eagerly (the debug records read
Python-side step numbers).

verify --graph adds the production path the hooked arms cannot watch: every prompt decoded with
prefetch off and on by the same loop `ftchat run` uses, the step replayed from a CUDA graph, no
hooks, and its tokens compared with the eager arm of the same prefetch setting and with each
other (prefetch on vs off in replay, which holds even where replay and eager decode part).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ftchat.debug import HookChain
from ftchat.debug.audit import SlotAudit
from ftchat.debug.verify import Verifier
from ftchat.engine import Decoder, LoadedModel, build_experts, decode, generate, num_slots
from ftchat.errors import FtchatError
from ftchat.offload.hooks import BackendView
from ftchat.settings import Settings

GRAPH_DEVICES = ("cuda",)  # where DecodeGraph can capture a step: CUDA graphs have no CPU twin

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
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each arm
    # the prompt's tokens: the eager arms size their KV cache to it, the graph arms to the
    # longest prompt of the run (a replay-vs-eager difference that follows it shows here)
    prompt_tokens: int = 0


def _greedy(m: LoadedModel, ids: list[int], max_new: int, ex, settings: Settings) -> list[int]:
    return [s.tokens[0] for s in generate(m, [ids], max_new, ex,
                                          kv_dtype=settings.kv_torch_dtype())]


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
    CUDA graph captured once and reused for every prompt (state and cache emptied in place
    between prompts, as a session reuses its decoder), through `engine.decode`."""

    def __init__(self, m: LoadedModel, settings: Settings, max_len: int):
        self.dec = Decoder(m, build_experts(m, settings), 1, max_len, graph=True,
                           kv_dtype=settings.kv_torch_dtype())
        if self.dec.graph is None:  # Decoder falls back to eager: that would not be graph replay
            raise FtchatError("--graph: this model's decode step cannot be captured in a CUDA "
                              "graph (its n-gram table is read from host files each step)")

    def __call__(self, ids: list[int], max_new: int) -> list[int]:
        self.dec.reset()  # a cold cache, as the eager arms' fresh backends
        return [s.tokens[0] for s in decode(self.dec, [ids], [0], [max_new])]


class _ArmClock:
    """Wall seconds of each arm of one prompt (each arm ends in a host read of its tokens, so
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


def verify(m: LoadedModel, encode: Callable[[str], list[int]], settings: Settings, n: int,
           max_new: int, mode: str, audit_every: int = 64, seed: int = 0,
           progress: Callable[[int, int], None] | None = None) -> list[PromptVerdict]:
    """Prefetch off vs on over n cold prompts; returns one verdict per prompt. An explicit
    settings.graph (`verify --graph`) adds the graph arms (GraphArm), prefetch off and on."""
    a = m.args
    base = dataclasses.replace(settings, verify=None, audit_every=0, batch_size=1)
    off_settings = dataclasses.replace(base, prefetch="off")
    on_settings = base if base.prefetch == "on" else dataclasses.replace(base, prefetch="on")
    S = num_slots(m, on_settings)
    prompts = [encode(text) for text in cold_prompts(n, seed)]
    graphs = None
    if settings.graph is True:
        if m.device.type not in GRAPH_DEVICES:
            raise FtchatError(f"--graph: no CUDA graphs on {m.device.type}")
        # the KV capacity a run would give (--context), at least what the eager arms use
        max_len = max(settings.context or 0, max(map(len, prompts)) + max_new + 1)
        graphs = {"off": GraphArm(m, off_settings, max_len),
                  "on": GraphArm(m, on_settings, max_len)}
    verdicts = []
    for i, ids in enumerate(prompts):
        clock = _ArmClock()
        with clock("off"):
            off = _greedy(m, ids, max_new, build_experts(m, off_settings), off_settings)
        verifier = Verifier(mode, a.num_hidden_layers, m.device)
        audit = SlotAudit(audit_every, S, m.device)
        with clock("on"):
            ex = build_experts(m, on_settings, hooks=HookChain([verifier, audit]))
            on = _greedy(m, ids, max_new, ex, on_settings)
            audit.audit(BackendView(ex))  # the cache as the prompt left it
        first = next((j for j, (x, y) in enumerate(zip(off, on)) if x != y), None)
        graph_first = graph_prefetch = None
        if graphs is not None:
            replayed = {}
            for name in ("off", "on"):
                with clock(f"graph_{name}"):
                    replayed[name] = graphs[name](ids, max_new)
            graph_first = {"off": _first_diff(off, replayed["off"]),
                           "on": _first_diff(on, replayed["on"])}
            graph_prefetch = _first_diff(replayed["off"], replayed["on"])
        verdicts.append(PromptVerdict(i, len(on), first, verifier.report(), audit.audits,
                                      audit.bad, graph_first, graph_prefetch, clock.seconds,
                                      len(ids)))
        if progress:
            progress(i + 1, n)
    return verdicts


def audit_run(m: LoadedModel, prompts: list[list[int]], settings: Settings, every: int,
              max_new: int) -> SlotAudit:
    """Decode each prompt with the slot audit on (one backend across prompts)."""
    S = num_slots(m, settings)
    audit = SlotAudit(every, S, m.device)
    ex = build_experts(m, dataclasses.replace(settings, batch_size=1), hooks=audit)
    for ids in prompts:
        for _ in generate(m, [ids], max_new, ex, kv_dtype=settings.kv_torch_dtype()):
            pass
        audit.audit(BackendView(ex))  # the cache as the prompt left it
    return audit


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
