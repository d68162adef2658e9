"""Debug modes: each injected fault is caught by the mode meant for it; clean runs report zero.

Faults are injected from the tests only (hooks and monkeypatching), never from ftchat's code.
"""

from __future__ import annotations

import pytest
import torch

from ftchat.debug.slot_audit import SlotAudit
from ftchat.debug.verifier import Verifier
from ftchat.debug.watchers import HookChain
from ftchat.engine import build_experts, generate
from ftchat.offload.hooks import Hooks
from ftchat.settings import Settings
from tests.offload_util import PROMPTS, model, reference

SLOTS = 20


def debug_run(folder, steps, mode="bytes", audit_every=4, fault: Hooks | None = None,
              patch=None, prefetch="on", bs=1):
    m = model(folder)
    a = m.args
    verifier = Verifier(mode, a.num_hidden_layers, m.device)
    audit = SlotAudit(audit_every, SLOTS, m.device)
    chain = HookChain(([fault] if fault else []) + [verifier, audit])
    ex = build_experts(m, Settings(slots=SLOTS, prefetch=prefetch, batch_size=bs, budget_gdn=4),
                       hooks=chain)
    if patch:
        patch(ex)
    out = list(generate(m, PROMPTS[bs], steps, ex))
    return torch.stack([s.logits for s in out]), verifier.report(), audit


def whats(records):
    return {r["what"] for r in records}


@pytest.fixture(scope="module")
def clean(tiny_nvfp4):
    return {mode: debug_run(tiny_nvfp4, 40, mode=mode) for mode in ("meta", "bytes")}


def test_clean_short_runs_report_nothing(clean, tiny_nvfp4):
    for mode, (logits, records, audit) in clean.items():
        assert records == [] and audit.bad == [] and audit.audits >= 9, mode
        assert torch.equal(logits, reference(tiny_nvfp4, 1, 40)[1])


def test_clean_batch_of_two_reports_nothing(tiny_nvfp4):
    logits, records, audit = debug_run(tiny_nvfp4, 40, bs=2)
    assert records == [] and audit.bad == [] and audit.audits >= 9
    assert torch.equal(logits, reference(tiny_nvfp4, 2, 40)[1])


def test_clean_run_of_1000_steps_reports_zero(tiny_bf16):
    _, records, audit = debug_run(tiny_bf16, 1001, mode="bytes", audit_every=64)
    assert records == [] and audit.bad == [] and audit.audits == 1000 // 64


class _Once(Hooks):
    """Injects `fn(backend, x)` once, at the given decode step and layer."""

    def __init__(self, when: str, step: int, layer: int, fn):
        self.when, self.step, self.layer, self.fn, self.fired = when, step, layer, fn, 0

    def _maybe(self, b, layer, x):
        if b.step == self.step and layer == self.layer and not self.fired:
            self.fn(b, x)
            self.fired += 1

    def after_copy(self, b, plan, layer, kind):
        if self.when == "after_copy" and kind == "demand":
            self._maybe(b, layer, plan)

    def before_kernel(self, b, p):
        if self.when == "before_kernel":
            self._maybe(b, p.layer, p)

    def after_kernel(self, b, p):
        if self.when == "after_kernel":
            self._maybe(b, p.layer, p)


def _corrupt_routed_slot(b, p):
    b.bank[p.slots.flatten()[0].long(), 100] ^= 0xFF


def test_corrupt_bytes_caught_by_bytes_not_meta(tiny_nvfp4):
    fault = lambda: _Once("before_kernel", 5, 2, _corrupt_routed_slot)  # noqa: E731
    _, meta, _ = debug_run(tiny_nvfp4, 12, mode="meta", fault=fault())
    _, rec, audit = debug_run(tiny_nvfp4, 12, mode="bytes", fault=fault())
    assert meta == []  # meta checks maps, not bytes
    assert "slot bytes differ from the host row before the kernel" in whats(rec)
    assert rec[0]["step"] == 5 and rec[0]["layer"] == 2


def test_stale_map_entry_caught_by_meta(tiny_nvfp4):
    def stale(b, p):  # point the routed id's slot_of at another slot
        gid = int(p.ids.flatten()[0]) + p.layer * b.num_experts
        b.maps.slot_of[gid] = (b.maps.slot_of[gid] + 1) % SLOTS

    _, rec, _ = debug_run(tiny_nvfp4, 12, mode="meta", fault=_Once("before_kernel", 4, 1, stale))
    assert whats(rec) == {"slot maps disagree"}


class _StaleSharedExpert(Hooks):
    """At the first kernel where both rows of a batch of two route one expert, points that
    expert's slot_of at another slot, or (row_1_only) row 1's slot for it (once)."""

    hit = None  # (step, layer, global expert id)

    def __init__(self, row_1_only: bool = False):
        self.row_1_only = row_1_only

    def before_kernel(self, b, p):
        shared = set(p.ids[0].tolist()) & set(p.ids[1].tolist())
        if self.hit is None and shared:
            e = min(shared)
            gid = e + p.layer * b.num_experts
            if self.row_1_only:
                k = p.ids[1].tolist().index(e)
                p.slots[1, k] = (p.slots[1, k] + 1) % SLOTS
            else:
                b.maps.slot_of[gid] = (b.maps.slot_of[gid] + 1) % SLOTS
            self.hit = (b.step, p.layer, gid)


@pytest.mark.parametrize("row_1_only", [False, True], ids=["same-slot", "other-slot"])
def test_a_shared_expert_read_through_a_stale_slot_is_one_record(tiny_nvfp4, row_1_only):
    # same-slot: both rows read the expert through one slot: one pair, one record (not one per
    # row). other-slot: row 0 reads it through its slot, row 1 through another: two pairs, only
    # the second wrong (a check that kept one place per expert id would drop it)
    fault = _StaleSharedExpert(row_1_only=row_1_only)
    _, rec, _ = debug_run(tiny_nvfp4, 12, mode="meta", fault=fault, bs=2)
    assert fault.hit is not None, "the two rows never shared an expert"
    step, layer, gid = fault.hit
    there = [r for r in rec if (r["step"], r["layer"], r["expert"]) == (step, layer, gid)]
    assert [r["what"] for r in there] == ["slot maps disagree"]


def test_write_during_the_expert_kernel_caught_by_bytes(tiny_nvfp4):
    _, rec, _ = debug_run(tiny_nvfp4, 12, mode="bytes",
                          fault=_Once("after_kernel", 6, 3, _corrupt_routed_slot))
    assert "slot bytes differ from the host row after the kernel" in whats(rec)
    assert "slot bytes differ from the host row before the kernel" not in {
        r["what"] for r in rec if r["step"] == 6 and r["layer"] == 3}


def test_skipped_copy_caught_by_bytes_and_audit(tiny_nvfp4):
    def skip_one_demand_copy(ex):
        orig = ex._copy

        def copy(plan, layer, kind):
            if not (ex.step == 3 and layer == 2 and kind == "demand"):
                orig(plan, layer, kind)
        ex._copy = copy

    logits, rec, audit = debug_run(tiny_nvfp4, 12, mode="bytes", patch=skip_one_demand_copy,
                                   prefetch="off")
    assert "slot bytes differ from the host row before the kernel" in whats(rec)
    assert audit.bad  # the stale slot stays in the cache until evicted
    assert audit.bad[0]["writer"] is None or audit.bad[0]["writer"]["step"] != 3
    assert not torch.equal(logits, reference(tiny_nvfp4, 1, 12)[1])  # the output is wrong


def test_missing_join_caught_by_meta_and_changes_output(tiny_nvfp4):
    """Without the join, the routed kernel reads prefetched slots whose copy has not run."""
    def no_join(ex):
        ex._join = lambda layer: None

    logits, rec, _ = debug_run(tiny_nvfp4, 20, mode="meta", patch=no_join)
    assert "a copy into the slot is still in flight" in whats(rec)
    assert not torch.equal(logits, reference(tiny_nvfp4, 1, 20)[1])


def test_audit_reports_the_last_writer(tiny_nvfp4):
    def corrupt_after_prefetch_copy(b, plan):
        live = int(plan.count)
        if live:
            b.bank[plan.dst[0].long(), 7] ^= 0x55

    class AfterPrefetch(Hooks):
        fired = False

        def after_copy(self, b, plan, layer, kind):
            if kind == "prefetch" and b.step == 2 and not self.fired and int(plan.count):
                corrupt_after_prefetch_copy(b, plan)
                self.fired = True

    _, _, audit = debug_run(tiny_nvfp4, 9, mode="meta", audit_every=1, fault=AfterPrefetch())
    assert audit.bad, "the corrupted prefetched slot is found by the audit"
    w = audit.bad[0]["writer"]
    assert w["kind"] == "prefetch" and w["stream"] == "prefetch" and w["step"] == 2


def _debug_ops_in_one_decode_step(folder, **settings) -> tuple[int, int]:
    """(all aten ops, ops issued from ftchat/debug code) of one decode step: the CPU stand-in
    for counting kernel launches."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from ftchat.engine import Decoder
    from ftchat.session import build_experts as build_with_debug

    class Count(TorchDispatchMode):
        total = debug = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.total += 1
            Count.debug += any("ftchat/debug/" in f.filename for f in traceback.extract_stack())
            return func(*args, **(kwargs or {}))

    m = model(folder)
    ex = build_with_debug(m, Settings(slots=SLOTS, **settings))
    dec = Decoder(m, ex, 1, 32)
    n = len(PROMPTS[1][0])
    tok = dec.prefill(0, torch.tensor(PROMPTS[1][0]), 0)[-1:].argmax(-1)
    dec.step(tok, [n])
    with Count():
        dec.step(tok, [n + 1])
    return Count.total, Count.debug


def test_debug_modes_off_add_no_work(tiny_bf16):
    total_off, debug_off = _debug_ops_in_one_decode_step(tiny_bf16, prefetch="on")
    total_on, debug_on = _debug_ops_in_one_decode_step(tiny_bf16, prefetch="on", verify="bytes",
                                                       audit_every=1)
    assert debug_off == 0  # modes off: no op comes from the debug code
    assert debug_on > 0 and total_on - total_off >= debug_on  # control: the counter sees it
