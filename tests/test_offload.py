"""Offloaded experts change no bit: slot cache vs all-resident, 200 decode steps (CPU path)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ftchat.engine import Decoder, build_experts, decode, generate, prefill, resident_backend
from ftchat.errors import FtchatError, SettingsError
from ftchat.model.state import DecodeState
from ftchat.offload import backend
from ftchat.offload import cache as sc
from ftchat.offload.backend import StagedExperts, lends_staging
from ftchat.offload.cache import check_invariants
from ftchat.offload.streams import CpuStreams
from ftchat.settings import Settings
from tests.offload_util import PROMPTS, STEPS, InvariantChecker, model, reference, run


@pytest.mark.parametrize("fmt", ["tiny_bf16", "tiny_nvfp4"])
@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("slots,policy", [("min", "lru"), (40, "rule"), ("all", "rule")])
def test_offload_is_bit_identical_to_resident(fmt, bs, slots, policy, request):
    folder = request.getfixturevalue(fmt)
    a = model(folder).args
    n = {"min": bs * a.num_experts_per_tok, "all": a.num_hidden_layers * a.num_experts}.get(
        slots, slots)
    checker = InvariantChecker()
    tokens, logits, ex = run(folder, bs, slots=n, eviction=policy, hooks=checker)
    ref_tokens, ref_logits = reference(folder, bs)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)
    assert checker.steps == STEPS - 1 == 200 and checker.problems == []
    st = ex.maps.stats
    assert int(st.misses.sum()) > 0  # the cache really worked: copies happened
    if slots == "all":  # everything fits: after the first touch, no expert is copied twice
        assert int(st.misses.sum()) <= a.num_hidden_layers * a.num_experts
    if slots == "min":
        assert int(st.hits.sum()) < int(st.misses.sum())  # thrashing, still exact


def test_rule_has_fewer_misses_than_lru_here_too(tiny_bf16):
    """Not a bound on real routing (random weights route almost uniformly), just that both
    policies run and differ in the cache they keep."""
    _, _, lru = run(tiny_bf16, 1, steps=60, slots=40, eviction="lru")
    _, _, rule = run(tiny_bf16, 1, steps=60, slots=40, eviction="rule")
    assert not torch.equal(lru.maps.key, rule.maps.key)


def test_too_few_slots_is_a_clear_error(tiny_bf16):
    with pytest.raises(SettingsError, match="fewer than batch size x top-k = 8"):  # --slots: 2
        run(tiny_bf16, 2, steps=1, slots=7)


def test_prefill_leaves_the_slot_cache_alone(tiny_bf16):
    """Decode, then a second prompt's prefill with the same backend: maps unchanged by prefill,
    and the second run still equals the resident one."""
    m = model(tiny_bf16)
    tokens, logits, ex = run(tiny_bf16, 1, steps=30, slots=20)
    before = [t.clone() for t in (ex.maps.slot_of, ex.maps.id_of, ex.maps.key, ex.maps.clock)]
    st = DecodeState.create(m.args, 1, 64, "cpu", torch.float32)
    prefill(m, st, 0, torch.tensor(PROMPTS[2][1]), 0, ex)
    after = (ex.maps.slot_of, ex.maps.id_of, ex.maps.key, ex.maps.clock)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    again = list(generate(m, PROMPTS[1], 30, ex))
    assert [s.tokens for s in again] == reference(tiny_bf16, 1, 30)[0]


def test_reset_empties_the_cache_in_place(tiny_bf16):
    _, _, ex = run(tiny_bf16, 1, steps=10, slots=20)
    ptrs = [t.data_ptr() for t in (ex.maps.slot_of, ex.maps.id_of, ex.maps.key, ex.maps.clock)]
    assert int((ex.maps.id_of[:20] >= 0).sum()) > 0
    ex.reset()
    assert ptrs == [t.data_ptr() for t in (ex.maps.slot_of, ex.maps.id_of, ex.maps.key,
                                           ex.maps.clock)]
    assert int((ex.maps.id_of[:20] >= 0).sum()) == 0 and int(ex.maps.clock) == 0
    assert int(ex.maps.stats.misses.sum()) == 0 and check_invariants(ex.maps) == []


def test_staged_prefill_equals_resident(tiny_nvfp4):
    """The CUDA prefill path (routed experts copied into a staging area, routed ids first) run
    on the CPU with the stream emulation: the same logits as reading the host rows directly."""
    m = model(tiny_nvfp4)
    ids = torch.tensor([3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81, 200, 1, 9])
    empty = build_experts(m, Settings(slots=24, batch_size=1))  # every row from the host
    staged = StagedExperts(m.host_rows, m.layout, m.args.num_experts, m.device, CpuStreams(), 8,
                           (empty.maps.slot_of, empty.bank))
    outs = []
    for experts in (staged, resident_backend(m)):
        st = DecodeState.create(m.args, 1, 32, "cpu", torch.float32)
        outs.append(prefill(m, st, 0, ids, 0, experts))
    assert torch.equal(outs[0], outs[1])
    assert int(staged.rows_from_slots) == 0 and int(staged.rows_from_host) > 0


def test_staged_prefill_reads_cached_experts_from_their_slots(tiny_nvfp4):
    """Experts the decode cache holds are copied into staging from their slots, not the host:
    with the host rows of every cached expert corrupted, prefill is still exact; corrupting the
    host rows of the experts it does not hold changes the logits (the control)."""
    m = model(tiny_nvfp4)
    ex = build_experts(m, Settings(slots=24, batch_size=1))
    list(generate(m, [[3, 17, 99, 4, 250]], 12, ex))  # fill the cache
    ids = torch.tensor([3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81, 200, 1, 9])
    ref_state = DecodeState.create(m.args, 1, 32, "cpu", torch.float32)
    ref = prefill(m, ref_state, 0, ids, 0, resident_backend(m))
    cached = (ex.maps.slot_of[:-1] >= 0).nonzero().flatten()  # global ids = layer * E + e
    assert 0 < len(cached) <= 24

    def staged_logits(host: torch.Tensor) -> tuple[torch.Tensor, StagedExperts]:
        staged = StagedExperts(host, m.layout, m.args.num_experts, m.device, CpuStreams(), 8,
                               (ex.maps.slot_of, ex.bank))
        st = DecodeState.create(m.args, 1, 32, "cpu", torch.float32)
        return prefill(m, st, 0, ids, 0, staged), staged

    host = m.host_rows.clone()
    host[cached] ^= 0x5A  # every cached expert's host row is garbage now
    logits, staged = staged_logits(host)
    assert torch.equal(logits, ref)
    assert int(staged.rows_from_slots) > 0 and int(staged.rows_from_host) > 0
    ex.staged = staged  # what for_prefill() keeps on CUDA: its counters reach stats()
    st = ex.stats()
    assert st["prefill_rows_from_slots"] == int(staged.rows_from_slots)
    assert st["prefill_copy_gb"] == int(staged.rows_from_host) * m.layout.nbytes / 1e9

    # control: the host rows of the experts the cache does not hold, corrupted
    E, layers = m.args.num_experts, m.args.num_hidden_layers
    absent = [g for g in range(E * layers) if g not in set(cached.tolist())]
    bad = host.clone()
    bad[absent] ^= 0x5A
    assert not torch.equal(staged_logits(bad)[0], ref)


def _streamed_prefill(m, host, slots, ids, monkeypatch, skip_wait: bool = False):
    """Prefill ids through a StagedExperts that streams whole layers ahead (the chunk threshold
    lowered to the tiny prompt); skip_wait: the MoE block does not wait for the streamed copy."""
    monkeypatch.setattr(backend, "STREAM_MIN_TOKENS", 8)
    staged = backend.StagedExperts(host, m.layout, m.args.num_experts, m.device, CpuStreams(), 8,
                                   slots)
    begin, streamed = staged.begin, []

    def begin_spy(layer, x, ids_):
        ahead = staged.ahead is not None and staged.ahead.layer == layer
        p = begin(layer, x, ids_)
        if ahead:
            streamed.append(layer)
            if skip_wait:
                p = dataclasses.replace(p, ready=None)
        return p

    staged.begin = begin_spy
    st = DecodeState.create(m.args, 1, 64, "cpu", torch.float32)
    return prefill(m, st, 0, ids, 0, staged), staged, streamed


def test_streamed_prefill_equals_resident(tiny_nvfp4, monkeypatch):
    """Layer streaming (every expert of layer L+1 copied once layer L's kernel is issued): the
    logits of reading the host rows directly; every layer but the first came from a streamed
    copy of the whole layer. Control: the MoE block not waiting for that copy reads the previous
    layer's experts (the CPU emulation runs the copy only when waited for) and the logits move."""
    m = model(tiny_nvfp4)
    E, L = m.args.num_experts, m.args.num_hidden_layers
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(3))
    empty = build_experts(m, Settings(slots=24, batch_size=1))
    ref = prefill(m, DecodeState.create(m.args, 1, 64, "cpu", torch.float32), 0, ids, 0,
                  resident_backend(m))
    slots = (empty.maps.slot_of, empty.bank)
    logits, staged, streamed = _streamed_prefill(m, m.host_rows, slots, ids, monkeypatch)
    assert torch.equal(logits, ref)
    assert streamed == list(range(1, L))
    n0 = int(staged.rows_from_host) - (L - 1) * E  # layer 0 copied on demand: its routed experts
    assert 0 < n0 <= E and int(staged.rows_from_slots) == 0

    bad, _, streamed = _streamed_prefill(m, m.host_rows, slots, ids, monkeypatch, skip_wait=True)
    assert streamed == list(range(1, L)) and not torch.equal(bad, ref)


def test_streamed_prefill_reads_cached_experts_from_their_slots(tiny_nvfp4, monkeypatch):
    """Streamed layers copy the experts the decode cache holds from their slots: with their host
    rows corrupted the prefill is still exact; corrupting the others' host rows is not (control)."""
    m = model(tiny_nvfp4)
    ex = build_experts(m, Settings(slots=24, batch_size=1))
    list(generate(m, [[3, 17, 99, 4, 250]], 12, ex))  # fill the cache
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(4))
    ref = prefill(m, DecodeState.create(m.args, 1, 64, "cpu", torch.float32), 0, ids, 0,
                  resident_backend(m))
    cached = (ex.maps.slot_of[:-1] >= 0).nonzero().flatten()
    host = m.host_rows.clone()
    host[cached] ^= 0x5A
    slots = (ex.maps.slot_of, ex.bank)
    logits, staged, streamed = _streamed_prefill(m, host, slots, ids, monkeypatch)
    assert torch.equal(logits, ref) and len(streamed) == m.args.num_hidden_layers - 1
    assert int(staged.rows_from_slots) > 0
    absent = torch.ones(host.shape[0], dtype=torch.bool)
    absent[cached] = False
    bad = host.clone()
    bad[absent] ^= 0x5A
    assert not torch.equal(_streamed_prefill(m, bad, slots, ids, monkeypatch)[0], ref)


def _lent_run(folder, monkeypatch, slots: int, empty: bool = True):
    """Two prompts decoded with one backend whose prefill takes the CUDA staging path (stream
    emulation), the staging lent from the bank's last E+1 slots; empty=False: the slots are
    not emptied before they are lent (the control)."""
    m = model(folder)
    ex = build_experts(m, Settings(slots=slots, batch_size=1))
    monkeypatch.setattr(ex, "for_prefill", ex.staged_prefill)
    if not empty:
        monkeypatch.setattr(sc, "empty_slots", lambda maps, lo, hi: None)
    out, held = [], []
    for _ in range(2):  # the second prefill lends slots that the first decode filled
        out += list(generate(m, PROMPTS[1], 30, ex))
        E = m.args.num_experts
        held.append(int((ex.maps.id_of[slots - E - 1:slots] >= 0).sum()))
    return [s.tokens for s in out], torch.stack([s.logits for s in out]), ex, held


def test_lent_staging_changes_no_bit(tiny_nvfp4, monkeypatch):
    """A bank of >= 2 x (E+1) slots lends its last E+1 slots to prefill's staging (no VRAM of
    its own): each prefill empties them on the compute stream, stages every layer's experts
    there, and decode refills them; two prompts in a row give the all-resident tokens and
    logits, the maps stay sound, and the staging is the bank's own rows. Control: lending the
    slots without emptying them leaves maps that point at staged bytes, and the logits move."""
    m = model(tiny_nvfp4)
    E, S = m.args.num_experts, 40
    assert lends_staging(S, E) and not lends_staging(2 * (E + 1) - 1, E)
    tokens, logits, ex, held = _lent_run(tiny_nvfp4, monkeypatch, S)
    ref_tokens, ref_logits = reference(tiny_nvfp4, 1, 30)
    assert tokens == ref_tokens * 2 and torch.equal(logits, torch.cat([ref_logits] * 2))
    assert held[0] > 0  # decode did use the lent slots between the two prefills
    assert check_invariants(ex.maps) == []
    staging, bank = ex.staged.staging, ex.bank
    assert staging.untyped_storage().data_ptr() == bank.untyped_storage().data_ptr()
    assert staging.data_ptr() == bank[S - E - 1].data_ptr() and staging.shape[0] == E + 1
    assert int(ex.staged.rows_from_host) > 0

    _, bad_logits, _, _ = _lent_run(tiny_nvfp4, monkeypatch, S, empty=False)
    assert not torch.equal(bad_logits, torch.cat([ref_logits] * 2))


def test_a_small_bank_keeps_its_own_staging(tiny_nvfp4):
    """Below 2 x (E+1) slots the staging is a buffer of its own and prefill leaves the maps
    untouched (the behaviour small caches had before lending)."""
    m = model(tiny_nvfp4)
    ex = build_experts(m, Settings(slots=24, batch_size=1))
    list(generate(m, PROMPTS[1], 12, ex))
    before = [t.clone() for t in (ex.maps.slot_of, ex.maps.id_of, ex.maps.key)]
    staged = ex.staged_prefill()
    assert not ex.lends_staging
    assert staged.staging.untyped_storage().data_ptr() != ex.bank.untyped_storage().data_ptr()
    st = DecodeState.create(m.args, 1, 32, "cpu", torch.float32)
    prefill(m, st, 0, torch.tensor(PROMPTS[1][0]), 0, staged)
    assert all(torch.equal(x, y) for x, y in
               zip(before, (ex.maps.slot_of, ex.maps.id_of, ex.maps.key)))


@pytest.mark.parametrize("prefetch", ["off", "on"])
def test_decode_after_a_streamed_prefill_is_the_resident_run(tiny_nvfp4, prefetch, monkeypatch):
    """A prompt prefilled with layer streaming (CUDA's staging path, here on the CPU's stream
    emulation, the chunk threshold lowered to the tiny prompt), then decoded from the slot cache
    with prefetch off and on: the resident run's tokens and logits, bit for bit. Control: the MoE
    block not waiting for the streamed copy (it reads the previous layer's experts) moves them."""
    monkeypatch.setattr(backend, "STREAM_MIN_TOKENS", 8)
    m = model(tiny_nvfp4)
    E, L = m.args.num_experts, m.args.num_hidden_layers
    prompt = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(8)).tolist()

    def run(experts):
        out = list(decode(Decoder(m, experts, 1, 64), [prompt], [0], [16]))
        return [s.tokens for s in out], torch.stack([s.logits for s in out])

    ref_tokens, ref_logits = run(resident_backend(m))
    ex = build_experts(m, Settings(slots=24, batch_size=1, prefetch=prefetch))
    staged = []
    monkeypatch.setattr(ex, "for_prefill", lambda: staged.append(ex.staged_prefill()) or staged[-1])
    tokens, logits = run(ex)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    assert len(staged) == 1 and int(staged[0].rows_from_host) >= (L - 1) * E  # layers streamed
    st = ex.stats()
    assert st["misses"] > 0 and (st["prefetch_installs"] > 0) == (prefetch == "on")

    begin = backend.StagedExperts.begin
    monkeypatch.setattr(backend.StagedExperts, "begin",
                        lambda self, *a: dataclasses.replace(begin(self, *a), ready=None))
    ex = build_experts(m, Settings(slots=24, batch_size=1, prefetch=prefetch))
    monkeypatch.setattr(ex, "for_prefill", ex.staged_prefill)
    try:
        moved = not torch.equal(run(ex)[1], ref_logits)
    except FtchatError as e:  # the stale experts' output reached the logits as NaN: the
        moved = "NaN or Inf" in str(e)  # decode stops there instead of returning them
    assert moved
