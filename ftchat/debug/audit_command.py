"""`ftchat audit`: a decode run with the slot audit on. The audit byte-checks the whole slot cache
every N decode steps and once more at the end of every prompt; a bad slot fails the run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import TextIO

from ftchat.commands.load import load_checked, pin_planned_slots
from ftchat.debug.slot_audit import SlotAudit
from ftchat.engine import LoadedModel, build_experts, generate, num_slots
from ftchat.errors import FtchatError, UsageError, check_positive
from ftchat.offload.hooks import BackendView
from ftchat.settings import Settings
from ftchat.vram.workloads import run_context, verify_workload

SHOWN_BAD_SLOTS = 20  # bad slots printed (and kept in the JSON) at most


def audit_prompts(m: LoadedModel, prompts: list[list[int]], settings: Settings, every: int,
                  max_new: int) -> SlotAudit:
    """Decode each prompt with the slot audit on (one backend across prompts)."""
    audit = SlotAudit(every, num_slots(m, settings), m.device)
    ex = build_experts(m, dataclasses.replace(settings, batch_size=1), hooks=audit)
    for ids in prompts:
        for _ in generate(m, [ids], max_new, ex, kv_dtype=settings.kv_torch_dtype()):
            pass
        audit.audit(BackendView(ex))  # the cache as the prompt left it
    return audit


def run_audit(model: str | None, settings: Settings, env: Mapping[str, str], *,
              prompts: list[str], every: int, max_new: int, as_json: bool, out: TextIO,
              err: TextIO) -> int:
    """`ftchat audit`: load, decode each prompt with the slot audit on (every `every` steps,
    `max_new` tokens a prompt), print what it found; the exit code (1: a bad slot, or no audit
    ran)."""
    check_positive(("--audit-every", every), ("--max-new-tokens", max_new))
    if not prompts:
        raise UsageError("no prompts: give them with --prompt/-p TEXT (repeatable), "
                         "--file/-f FILE or on stdin, one per line")
    for i, text in enumerate(prompts):
        if not text.strip():
            raise UsageError(f"prompt {i + 1} is empty: give a prompt with some text in it")
    m, tok, plan = load_checked(model, settings, env, err, lambda a, layout: verify_workload(
        a, layout, settings, max_new, 1))
    settings = pin_planned_slots(settings, plan)
    ids = [tok.encode(tok.render_chat([{"role": "user", "content": p}])) for p in prompts]
    context = run_context(m.args, settings)
    for i, p in enumerate(ids):
        room = context - len(p) - 1  # generate holds the prompt, the reply and one more
        if room < 1:  # no reply fits: the prompt is at fault (exit 1), as in `run`
            raise FtchatError(f"prompt {i + 1} has {len(p)} tokens, too many for the context "
                              f"({context}): shorten it or raise --context")
        if max_new > room:  # the prompt fits: the flag must change (exit 2)
            raise UsageError(f"--max-new-tokens {max_new}: with prompt {i + 1}'s {len(p)} "
                             f"tokens it exceeds the context ({context}); give {room} or "
                             "less, or raise --context")
    a = audit_prompts(m, ids, settings, every, max_new)
    shown = a.bad[:SHOWN_BAD_SLOTS]
    res = {"prompts": len(ids), "audits": a.audits, "bad_slots": len(a.bad), "bad": shown}
    out.write((json.dumps(res) if as_json else
               f"audits {a.audits}, bad slots {len(a.bad)}"
               + "".join(f"\n  {b}" for b in shown)) + "\n")
    why = (f"the slot audit found {len(a.bad)} bad slots" if a.bad else
           None if a.audits else "no slot audit ran")
    if why:
        err.write(f"error: {why}\n")
    return 1 if why else 0
