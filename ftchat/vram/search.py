"""What fits a budget (docs/design.md section 4.9): the slots of a bank sized to fit, the longest
context, the prefill call size, and the one-line refusal that names the item that does not fit
and what would make it fit."""

from __future__ import annotations

import dataclasses
import math

import torch

from ftchat.codecs.rows import RowLayout
from ftchat.errors import FtchatError, SettingsError
from ftchat.offload.backend import LEND_STAGING_FACTOR
from ftchat.sizes import PREFILL_CHUNK
from ftchat.vram.items import GIB, Item, VramPlan, Workload, gib_up, human
from ftchat.vram.plan import plan

# Prefill call sizes `choose_prefill_chunk` considers, largest first: a large chunk streams each
# layer's experts once for more tokens (prefill is link-bound: docs/performance.md), a small one
# leaves more VRAM to the slot cache
PREFILL_CHUNKS = (8192, 4096, 2048, 1024)
# a larger chunk is taken while it keeps this share of the most slots: an 8,192-token chunk
# prefilled 1.7x faster than 4,096 at 48 layers (4,295.7 against 2,530.2 tok/s,
# docs/performance.md) for ~0.9 GiB more workspace, ~11 % of the slots at 32K, ~20 % at 255K
# (where 4,096 is chosen)
CHUNK_SLOT_SHARE = 0.85


def slots_that_fit(a, layout: RowLayout, dtype: torch.dtype, w: Workload, budget: int) -> int:
    """Slots per auto-sized bank within `budget` bytes, at most N; 0 when not even an empty bank
    fits (or no bank is auto-sized). The plan is linear in the slots on each side of the count
    from which a bank lends its staging area (`lends_staging`): first the count with the staging
    lent, kept if it reaches that threshold; else the count with a staging buffer of its own
    (lower, so below the threshold as well)."""
    N = a.num_hidden_layers * a.num_experts

    def linear_from(s0: int) -> int | None:  # the count the line through s0, s0 + 1 reaches
        base = plan(a, layout, dtype, w, s0).total
        per = plan(a, layout, dtype, w, s0 + 1).total - base
        if per == 0 or budget < base:
            return None
        return s0 + (budget - base) // per

    lend_at = LEND_STAGING_FACTOR * (a.num_experts + 1)
    if w.cuda and lend_at <= N:
        lent = linear_from(lend_at)
        if lent is not None:
            return min(N, lent)
    own = linear_from(0)
    return 0 if own is None else min(N, own)


def max_context(a, layout: RowLayout, dtype: torch.dtype, w: Workload, budget: int,
                slots: int) -> int:
    """The longest context whose plan at `slots` slots fits `budget` (0: none)."""
    def fits(c: int) -> bool:
        v = dataclasses.replace(w, context=c)
        return plan(a, layout, dtype, v, slots).total <= budget

    lo, hi = 0, w.context  # fits(lo) or lo == 0; hi: the one asked (it does not fit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo if lo and fits(lo) else 0


def check(a, layout: RowLayout, dtype: torch.dtype, w: Workload, budget: int | None,
          flag: str = "--vram-budget") -> VramPlan:
    """The plan of a run, or FtchatError (one line) naming the item that does not fit and what
    would make it fit. Banks sized to fit get as many slots as the budget leaves; without a budget
    only given slot counts are checked (against batch x top-k).

    A given slot count below batch x top-k, or a budget below the dense weights alone, is a
    SettingsError (exit 2): that one flag value must change. A plan that passes the budget
    elsewhere stays a FtchatError (exit 1): budget, context, slots and batch trade off."""
    need, total = w.batch * a.num_experts_per_tok, a.num_hidden_layers * a.num_experts
    given = [s for s in w.banks if s is not None]
    for s in given:
        if s < need:
            raise SettingsError(f"{s} expert slots are fewer than batch size x top-k = {need} "
                                f"({w.batch} x {a.num_experts_per_tok}): give --slots {need} or "
                                "more (or more --expert-vram)")
    if budget is None:
        return plan(a, layout, dtype, w, total)
    auto = any(s is None for s in w.banks)
    p = plan(a, layout, dtype, w, need if auto else max(given, default=0))
    if p.total > budget:
        line = _refusal(a, layout, dtype, w, budget, p, flag)
        raise (SettingsError if _passing_item(p, budget)[0].dense else FtchatError)(line)
    if not auto:
        return p
    return plan(a, layout, dtype, w, slots_that_fit(a, layout, dtype, w, budget))


def _refusal(a, layout: RowLayout, dtype: torch.dtype, w: Workload, budget: int, p: VramPlan,
             flag: str) -> str:
    """The one line: the item where the running sum passes the budget, and the way out."""
    line = _refusal_line(a, layout, dtype, w, budget, p, flag)
    largest = max(p.items, key=lambda i: i.nbytes)
    if largest.nbytes > budget // 2 and f" {largest.name} " not in line:
        line += f"; the largest item: {largest.name}, {human(largest.nbytes)}"
    return line


def _passing_item(p: VramPlan, budget: int) -> tuple[Item, int]:
    """The item where the plan's running sum passes `budget` (the last one if none does), and
    the sum there."""
    run = 0
    for it in p.items:
        run += it.nbytes
        if run > budget:
            return it, run
    return p.items[-1], run


def _refusal_line(a, layout: RowLayout, dtype: torch.dtype, w: Workload, budget: int,
                  p: VramPlan, flag: str) -> str:
    gib = f"{flag} {budget / GIB:.4g} GiB".strip()  # flag "": a budget of `info --vram`
    item, run = _passing_item(p, budget)
    auto = any(s is None for s in w.banks)
    slots = p.slots if auto else 0
    bigger = f"raise {flag or 'the budget'} to {gib_up(p.total)}"
    if item.dense:
        return (f"{gib} is too small for the dense weights ({human(p.dense_bytes())}; the "
                f"sum passes the budget at {item.name}), which do not shrink with fewer slots or "
                f"a shorter context: {bigger} (the whole plan at --context {w.context:,} with "
                f"{p.need} slots)")
    c = max_context(a, layout, dtype, w, budget, slots)
    shorter = f"--context {c:,} or less fits" if c else "no --context fits"
    fit = slots_that_fit(a, layout, dtype, w, budget) if auto else 0
    if item.grows == "slots":
        given = [s for s in w.banks if s is not None]
        if not auto:
            most = slots_that_fit(a, layout, dtype, dataclasses.replace(
                w, banks=(None,) * len(w.banks)), budget)
            return (f"--slots {max(given):,} do not fit in {gib} (the plan needs "
                    f"{human(p.total)}): at most {most:,} fit (--slots {most}), or "
                    f"{shorter} with {max(given):,} slots, or {bigger}")
        return (f"{gib} leaves room for {fit:,} expert slots, fewer than batch size x top-k = "
                f"{p.need} (at --context {w.context:,}): {shorter} with {p.need} slots"
                + (", or a smaller --batch-size" if w.batch > 1 else "") + f", or {bigger}")
    why = f": {item.note}" if not item.exact else ""  # what an estimate is made of
    return (f"{gib} does not fit {item.name} at --context {w.context:,} ({human(item.nbytes)}"
            f"{why}; the plan reaches {human(run)} there): {shorter} with {p.need} "
            f"expert slots, or {bigger}")


def choose_prefill_chunk(a, layout: RowLayout, dtype: torch.dtype, w: Workload,
                         budget: int) -> int:
    """The prefill call size for a run under `budget` that left it unset: the largest of
    PREFILL_CHUNKS (at most the context) whose plan fits the budget and, for a bank sized to fit,
    keeps at least CHUNK_SLOT_SHARE of the slots the smallest chunk leaves (at 16 GiB, 48 layers
    and fp8 K/V: 8,192 at 32K, 2,783 slots against 3,130 at 1,024; 4,096 at 255K, 1,669 against
    1,778, where 8,192 would leave 1,431). PREFILL_CHUNK when none fits (the refusal then names
    what does not)."""
    sizes = sorted({min(c, w.context) for c in PREFILL_CHUNKS}, reverse=True)
    auto = any(s is None for s in w.banks)
    given = max((s for s in w.banks if s is not None), default=0)

    def slots_at(c: int) -> int:  # the slots the bank gets (auto) / fits (given) at chunk c
        v = dataclasses.replace(w, prefill_tokens=c)
        if auto:
            return slots_that_fit(a, layout, dtype, v, budget)
        return given if plan(a, layout, dtype, v, given).total <= budget else 0

    need = w.batch * a.num_experts_per_tok
    floor = max(need, math.ceil(CHUNK_SLOT_SHARE * slots_at(sizes[-1]))) if auto else given
    for c in sizes:
        if slots_at(c) >= max(floor, 1):
            return c
    return min(PREFILL_CHUNK, w.context)
