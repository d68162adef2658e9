"""Offload and prefetch change no bit for the Qwen3 MoE line (the CPU identity tests of
test_offload.py and test_prefetch.py, over qwen3_5_moe, qwen3_next and qwen3_moe checkpoints
written by transformers): the expert backend does not know the family."""

from __future__ import annotations

import pytest
import torch

from tests.offload_util import InvariantChecker, model, reference, run
from tests.qwen3_checkpoints import FAMILIES

STEPS = 81


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("slots,policy", [("min", "lru"), (40, "rule")])
def test_offload_is_bit_identical_to_resident(family, bs, slots, policy, qwen3_folders):
    folder = qwen3_folders[family]
    a = model(folder).args
    n = bs * a.num_experts_per_tok if slots == "min" else slots
    checker = InvariantChecker()
    tokens, logits, ex = run(folder, bs, steps=STEPS, slots=n, eviction=policy, hooks=checker)
    ref_tokens, ref_logits = reference(folder, bs, STEPS)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    assert checker.steps == STEPS - 1 and checker.problems == []
    assert int(ex.maps.stats.misses.sum()) > 0  # the cache really worked: copies happened


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bs", [1, 2])
def test_prefetch_on_is_bit_identical_to_off(family, bs, qwen3_folders):
    folder = qwen3_folders[family]
    checker = InvariantChecker()
    slots = 2 * bs * model(folder).args.num_experts_per_tok + 8
    tokens, logits, ex = run(folder, bs, steps=STEPS, slots=slots, eviction="rule",
                             prefetch="on", budget_gdn=3, budget_attn=4, hooks=checker)
    ref_tokens, ref_logits = reference(folder, bs, STEPS)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    assert checker.problems == []
    st = ex.maps.stats
    assert int(st.prefetch_installs.sum()) > 0 and int(st.prefetch_useful.sum()) > 0


def test_a_corrupted_host_row_changes_the_output(qwen3_folders):
    """The control: the offloaded run reads the host rows, so garbage in one expert's row the
    run routes to shows up in the logits."""
    folder = qwen3_folders["qwen3_5_moe"]
    m = model(folder)
    _, ref_logits = reference(folder, 1, STEPS)
    saved = m.host_rows.clone()
    try:
        m.host_rows[:] = m.host_rows ^ 0x11  # every expert's bytes
        _, logits, _ = run(folder, 1, steps=STEPS, slots=4, eviction="lru")
    finally:
        m.host_rows.copy_(saved)
    assert not torch.equal(logits, ref_logits)
