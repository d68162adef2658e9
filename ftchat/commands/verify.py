"""`ftchat verify` and `ftchat audit`: losslessness checks of prefetch on a model.

verify: N cold prompts (a random nonce prefix, so no cache is warm), each decoded greedily with
prefetch off and on (fresh caches, same settings otherwise), compared token by token; the
verifier and the slot audit watch the `on` arm. audit: a decode run with the slot audit on.
The audit byte-checks the whole cache every N decode steps and once more at the end of every
prompt, so every prompt is audited however short. Both run eagerly (the debug records read
Python-side step numbers).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from ftchat.debug import HookChain
from ftchat.debug.audit import SlotAudit
from ftchat.debug.verify import Verifier
from ftchat.engine import LoadedModel, build_experts, generate, num_slots
from ftchat.offload.hooks import BackendView
from ftchat.settings import Settings

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
    rng = random.Random(seed)
    return [f"[{rng.getrandbits(64):016x}] {QUESTIONS[i % len(QUESTIONS)]}" for i in range(n)]


@dataclass
class PromptVerdict:
    index: int
    tokens: int
    first_mismatch: int | None  # position of the first differing token, None if identical
    records: list[dict] = field(default_factory=list)
    audits: int = 0
    bad_slots: list[dict] = field(default_factory=list)


def _greedy(m: LoadedModel, ids: list[int], max_new: int, ex) -> list[int]:
    return [s.tokens[0] for s in generate(m, [ids], max_new, ex)]


def verify(m: LoadedModel, encode: Callable[[str], list[int]], settings: Settings, n: int,
           max_new: int, mode: str, audit_every: int = 64, seed: int = 0,
           progress: Callable[[int, int], None] | None = None) -> list[PromptVerdict]:
    """Prefetch off vs on over n cold prompts; returns one verdict per prompt."""
    a = m.args
    base = dataclasses.replace(settings, verify=None, audit_every=0, batch_size=1)
    off_settings = dataclasses.replace(base, prefetch="off")
    on_settings = base if base.prefetch == "on" else dataclasses.replace(base, prefetch="on")
    S = num_slots(m, on_settings)
    verdicts = []
    for i, text in enumerate(cold_prompts(n, seed)):
        ids = encode(text)
        off = _greedy(m, ids, max_new, build_experts(m, off_settings))
        verifier = Verifier(mode, a.num_hidden_layers, m.device)
        audit = SlotAudit(audit_every, S, m.device)
        ex = build_experts(m, on_settings, hooks=HookChain([verifier, audit]))
        on = _greedy(m, ids, max_new, ex)
        audit.audit(BackendView(ex))  # the cache as the prompt left it
        first = next((j for j, (x, y) in enumerate(zip(off, on)) if x != y), None)
        verdicts.append(PromptVerdict(i, len(on), first, verifier.report(), audit.audits,
                                      audit.bad))
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
        for _ in generate(m, [ids], max_new, ex):
            pass
        audit.audit(BackendView(ex))  # the cache as the prompt left it
    return audit


def summary(verdicts: list[PromptVerdict]) -> dict:
    mism = [v for v in verdicts if v.first_mismatch is not None]
    return {"prompts": len(verdicts), "mismatches": len(mism),
            "first_mismatch": min((v.first_mismatch for v in mism), default=None),
            "verifier_records": sum(len(v.records) for v in verdicts),
            "audits": sum(v.audits for v in verdicts),
            "bad_slots": sum(len(v.bad_slots) for v in verdicts)}


def failure(s: dict) -> str | None:
    """Why a verify summary fails, or None: a mismatch, a verifier record, a bad slot, or no
    audit at all (a check that did not run proves nothing)."""
    if s["mismatches"]:
        return f"{s['mismatches']} of {s['prompts']} prompts differ with prefetch on"
    if s["verifier_records"]:
        return f"the verifier recorded {s['verifier_records']} violations"
    if s["bad_slots"]:
        return f"the slot audit found {s['bad_slots']} bad slots"
    if not s["audits"]:
        return "no slot audit ran"
    return None
