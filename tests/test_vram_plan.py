"""The VRAM plan: its exact items equal what the loader, DecodeState and the offload
backend really allocate for a tiny synthetic model (CPU), and a plan that cannot fit a
--vram-budget is refused before loading, in one line naming the item, with a control that fits.
"""

from __future__ import annotations

import dataclasses
import io
import re
import sys
from collections import defaultdict

import pytest
import torch

from ftchat.cli import main
from ftchat.engine import build_experts, load_model
from ftchat.errors import SettingsError
from ftchat.model.kv_cache import AttentionCache
from ftchat.model.qwen4_exp_memory import DENSE_KINDS, dense_kind
from ftchat.model.state import DecodeState, GdnCache
from ftchat.model.synth_memory import synthetic_model
from ftchat.offload.backend import StagedExperts
from ftchat.offload.budget import SETTLE_STEPS
from ftchat.offload.streams import make_streams
from ftchat.settings import Settings
from ftchat.vram.items import GIB, VramPlan, Workload
from ftchat.vram.plan import plan
from ftchat.vram.search import (CHUNK_SLOT_SHARE, PREFILL_CHUNKS, choose_prefill_chunk,
                                slots_that_fit)
from ftchat.vram.workloads import (PEAK_KEYS, cap_process, checkpoint_inputs, peak_report,
                                   synthetic_inputs)
from tests.test_cli_errors import one_error

F32 = torch.float32


def _main(argv, capsys, monkeypatch):
    capsys.readouterr()
    monkeypatch.delenv("FTCHAT_DEBUG", raising=False)
    monkeypatch.delenv("FTCHAT_VRAM_BUDGET", raising=False)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    code = main([str(a) for a in argv])
    return (code, *capsys.readouterr())


def items(p: VramPlan) -> dict[str, int]:
    return {i.name: i.nbytes for i in p.items}


def storage_bytes(tensors: dict[str, torch.Tensor], kind=lambda name: "all") -> dict[str, int]:
    """Bytes of the distinct storages behind `tensors` (views of one fused weight count once),
    by kind(name)."""
    seen, out = set(), defaultdict(int)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue  # a table left in its files (not the case at this size)
        key = (kind(name), t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            out[key[0]] += t.untyped_storage().nbytes()
    return dict(out)


# ===== exact items = real allocations =====


@pytest.mark.parametrize("fixture", ["tiny_bf16", "tiny_nvfp4"])
def test_dense_items_are_the_loaders_tensors(fixture, request):
    folder = request.getfixturevalue(fixture)
    a, layout = checkpoint_inputs(folder)  # headers only
    p = plan(a, layout, F32, Workload(64, cuda=False), 20)
    m = load_model(folder, "cpu", F32)
    assert layout == m.layout
    real = storage_bytes(m.weights.tensors, dense_kind)
    planned = {i.name: i.nbytes for i in p.items if i.dense}
    assert real == planned and set(planned) <= set(DENSE_KINDS)
    assert sum(real.values()) == p.dense_bytes()


def test_dense_items_of_the_in_memory_synthetic_model():
    a, layout = synthetic_inputs("tiny", 4, "nvfp4-modelopt")
    m = synthetic_model("tiny", 4, "nvfp4-modelopt", "cpu", torch.bfloat16)
    p = plan(a, layout, torch.bfloat16, Workload(64, cuda=False), 20)
    assert storage_bytes(m.weights.tensors, dense_kind) == {
        i.name: i.nbytes for i in p.items if i.dense}


def test_on_cuda_the_embedding_takes_no_vram(tiny_bf16):
    # load_model keeps it in pinned host memory on CUDA (tests/gpu/test_embedding_gpu.py)
    a, layout = checkpoint_inputs(tiny_bf16)
    cpu, cuda = (items(plan(a, layout, F32, Workload(64, cuda=c), 20)) for c in (False, True))
    assert cpu["embedding"] == a.vocab_size * a.hidden_size * 4 and cuda["embedding"] == 0
    others = [k for k in DENSE_KINDS if k != "embedding" and k in cpu]
    assert others and all(cpu[k] == cuda[k] for k in others)  # the other weights do not move


def test_dense_items_control_a_wrong_dtype_is_seen(tiny_bf16):
    # control: the comparison sees a plan made for the wrong dtype
    a, layout = checkpoint_inputs(tiny_bf16)
    p = plan(a, layout, torch.bfloat16, Workload(64, cuda=False), 20)
    real = storage_bytes(load_model(tiny_bf16, "cpu", F32).weights.tensors)["all"]
    assert real != p.dense_bytes()


@pytest.mark.parametrize("rows,context", [((1,), 64), ((2,), 100), ((1, 2, 3), 37)])
def test_state_items_are_the_decode_states(tiny_bf16, rows, context):
    a, layout = checkpoint_inputs(tiny_bf16)
    p = items(plan(a, layout, F32, Workload(context, rows, cuda=False), 20))
    real, every = defaultdict(int), 0
    for b in rows:
        s = DecodeState.create(a, b, context, "cpu", F32)
        every += sum(t.nbytes for t in s.tensors())
        for c in s.mixers:
            if isinstance(c, AttentionCache):
                real["KV cache (K and V)"] += c.k.nbytes + c.v.nbytes
                real["QSA index keys"] += c.ik.nbytes
                real["QSA block keys"] += c.kbar.nbytes
            else:
                assert isinstance(c, GdnCache)
                real["GDN recurrent state"] += c.recurrent.nbytes
                real["GDN conv state"] += c.conv.nbytes
        real["PLE state"] += sum(c.conv.nbytes for c in s.ple if c is not None) + s.ple_ctx.nbytes
    assert sum(real.values()) == every  # every tensor of the states is in one item
    assert dict(real) == {k: p[k] for k in real}


def test_slot_items_are_the_offload_backends(tiny_nvfp4):
    m = load_model(tiny_nvfp4, "cpu", F32)
    a = m.args
    ex = build_experts(m, Settings(slots=20, device="cpu", prefetch="on", candidates=6))
    w = Workload(64, cuda=False, candidates=6)
    p = items(plan(a, m.layout, F32, w, 20))
    maps = [ex.maps.slot_of, ex.maps.id_of, ex.maps.key, ex.maps.clock, ex.measured, ex.cands,
            *vars(ex.maps.stats).values()]
    assert ex.bank.nbytes == p["expert slot bank"]
    assert sum(t.nbytes for t in maps) == p["slot maps"]
    # the prefill staging area exists on CUDA only; its allocation is the same on the CPU
    staged = StagedExperts(m.host_rows, m.layout, a.num_experts, torch.device("cpu"),
                           make_streams(torch.device("cpu")), 0, (ex.maps.slot_of, ex.bank))
    cuda = items(plan(a, m.layout, F32, Workload(64, cuda=True, candidates=6), 20))
    real = staged.staging.nbytes + staged.rows_from_host.nbytes + staged.rows_from_slots.nbytes
    assert real == cuda["prefill staging"] and p["prefill staging"] == 0


def test_lent_staging_items_are_the_backends(tiny_nvfp4):
    """From 2 x (E+1) slots the staging rows are the bank's (the plan's item: the counters
    alone); one slot fewer, a buffer of its own (the item: rows and counters)."""
    m = load_model(tiny_nvfp4, "cpu", F32)
    a = m.args
    w = Workload(64, cuda=True, candidates=6)
    for slots, lent in ((2 * (a.num_experts + 1), True), (2 * (a.num_experts + 1) - 1, False)):
        ex = build_experts(m, Settings(slots=slots, device="cpu", candidates=6))
        staged = ex.staged_prefill()
        shares = staged.staging.untyped_storage().data_ptr() == ex.bank.untyped_storage().data_ptr()
        own = 0 if shares else staged.staging.nbytes
        real = own + staged.rows_from_host.nbytes + staged.rows_from_slots.nbytes
        planned = items(plan(a, m.layout, F32, w, slots))["prefill staging"]
        assert shares == lent and planned == real


def test_slots_that_fit_is_the_most_that_fit_across_the_lending_threshold(tiny_nvfp4):
    """The plan drops by the staging rows where a bank starts lending them (2 x (E+1) slots):
    slots_that_fit is still the largest count whose plan fits, for budgets at and just under
    every count's total (brute force over all counts)."""
    a, layout = checkpoint_inputs(tiny_nvfp4)
    w = Workload(64, cuda=True)
    N = a.num_hidden_layers * a.num_experts
    lend_at = 2 * (a.num_experts + 1)
    assert lend_at < N
    totals = [plan(a, layout, F32, w, s).total for s in range(N + 1)]
    assert totals[lend_at] < totals[lend_at - 1]  # the staging rows are gone
    for budget in sorted({t + d for t in totals for d in (-1, 0)}):
        fits = [s for s, t in enumerate(totals) if t <= budget]
        assert slots_that_fit(a, layout, F32, w, budget) == max(fits, default=0), budget


def test_slots_that_fit_fill_the_budget_exactly(tiny_nvfp4):
    a, layout = checkpoint_inputs(tiny_nvfp4)
    w = Workload(64, cuda=False)
    exact = plan(a, layout, F32, w, 37).total
    assert slots_that_fit(a, layout, F32, w, exact) == 37
    assert slots_that_fit(a, layout, F32, w, exact - 1) == 36
    assert slots_that_fit(a, layout, F32, w, 10**12) == a.num_hidden_layers * a.num_experts


# ===== refusals before loading, each with a control that fits =====


@pytest.fixture
def loads(monkeypatch):
    """The calls that would load weights (a refusal must leave this empty)."""
    seen = []
    real = load_model

    def spy(*args, **kwargs):
        seen.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr("ftchat.engine.load_model", spy)
    return seen


def run_argv(folder, budget, *extra):
    return ["run", folder, "--prompt", "hi", "-n", "2", "--device", "cpu", "-q",
            "--vram-budget", repr(budget), *extra]


def budget_gib(a, layout, w: Workload, slots: int, extra: int = 0) -> float:
    return (plan(a, layout, F32, w, slots).total + extra) / GIB


def test_refused_a_budget_too_small_for_the_dense_weights(tiny_nvfp4, loads, capsys,
                                                          monkeypatch):
    a, layout = checkpoint_inputs(tiny_nvfp4)
    dense = plan(a, layout, F32, Workload(64, cuda=False), 4).dense_bytes()
    one_error(*_main(run_argv(tiny_nvfp4, dense / 2 / GIB, "--context", "64"), capsys,
                     monkeypatch), "is too small for the dense weights",
              "raise --vram-budget to", status=2)  # only the budget can change: a usage error
    assert loads == []
    w = Workload(64, cuda=False)
    code, out, err = _main(run_argv(tiny_nvfp4, budget_gib(a, layout, w, 4), "--context", "64"),
                           capsys, monkeypatch)  # control: the whole plan at 4 slots fits
    assert code == 0 and out.strip(), err
    assert loads == [tiny_nvfp4]


def test_refused_a_context_whose_kv_does_not_fit(tiny_nvfp4, loads, capsys, monkeypatch):
    a, layout = checkpoint_inputs(tiny_nvfp4)
    w = Workload(4096, cuda=False)
    p = plan(a, layout, F32, w, 4)
    before_kv = 0
    for it in p.items:
        if it.name == "KV cache (K and V)":
            break
        before_kv += it.nbytes
    budget = (before_kv + it.nbytes // 2) / GIB
    line = one_error(*_main(run_argv(tiny_nvfp4, budget, "--context", "4096"), capsys,
                            monkeypatch), "does not fit KV cache (K and V) at --context 4,096")
    assert loads == []
    fits = int(re.search(r"--context ([\d,]+) or less fits", line).group(1).replace(",", ""))
    assert 0 < fits < 4096
    code, out, err = _main(run_argv(tiny_nvfp4, budget, "--context", fits), capsys, monkeypatch)
    assert code == 0 and out.strip(), err  # control: the context it names runs
    assert loads == [tiny_nvfp4]


def test_refused_fewer_slots_than_batch_times_top_k(tiny_nvfp4, loads, capsys, monkeypatch):
    a, layout = checkpoint_inputs(tiny_nvfp4)
    K = a.num_experts_per_tok
    w = Workload(64, cuda=False)
    one_error(*_main(run_argv(tiny_nvfp4, budget_gib(a, layout, w, K - 1), "--context", "64"),
                     capsys, monkeypatch),
              f"leaves room for {K - 1} expert slots, fewer than batch size x top-k = {K}")
    one_error(*_main(["run", tiny_nvfp4, "--prompt", "hi", "--device", "cpu", "--slots", K - 1],
                     capsys, monkeypatch),
              f"{K - 1} expert slots are fewer than batch size x top-k = {K}",
              status=2)  # no budget: --slots alone is at fault
    w2 = Workload(64, (1, 2), cuda=False)  # --batch-size 2: decoders of 1 and 2 rows
    one_error(*_main(run_argv(tiny_nvfp4, budget_gib(a, layout, w2, 2 * K - 1), "--context", "64",
                              "--batch-size", "2"), capsys, monkeypatch),
              f"fewer than batch size x top-k = {2 * K}", "a smaller --batch-size")
    assert loads == []
    code, out, err = _main(run_argv(tiny_nvfp4, budget_gib(a, layout, w, K), "--context", "64"),
                           capsys, monkeypatch)  # control: exactly batch x top-k slots fit
    assert code == 0 and out.strip(), err
    assert loads == [tiny_nvfp4]


def test_the_budget_sizes_the_slots(tiny_nvfp4):
    m = load_model(tiny_nvfp4, "cpu", F32)
    a = m.args
    w = Workload(64, cuda=False)
    s = Settings(device="cpu", context=64, vram_budget_gib=budget_gib(a, m.layout, w, 37))
    ex = build_experts(m, s)
    assert ex.cfg.num_slots == 37 and ex.bank.shape[0] == 38


def test_budget_from_the_environment(tiny_nvfp4, loads, capsys, monkeypatch):
    capsys.readouterr()
    monkeypatch.setenv("FTCHAT_VRAM_BUDGET", "0.0001")
    code = main(["run", str(tiny_nvfp4), "--prompt", "hi", "--device", "cpu"])
    one_error(code, *capsys.readouterr(), "--vram-budget 0.0001 GiB is too small for the dense",
              status=2)
    assert loads == []
    one_error(*_main(run_argv(tiny_nvfp4, -1.0), capsys, monkeypatch),
              "--vram-budget -1.0: expected a positive number of GiB", status=2)
    monkeypatch.setenv("FTCHAT_VRAM_BUDGET", "lots")
    code = main(["run", str(tiny_nvfp4), "--prompt", "hi", "--device", "cpu"])
    one_error(code, *capsys.readouterr(), "FTCHAT_VRAM_BUDGET='lots': expected a positive number",
              status=2)


def test_bench_and_verify_take_the_budget(tiny_nvfp4, loads, capsys, monkeypatch):
    for cmd in (["bench", tiny_nvfp4, "--arms", "off;on", "--context", "16", "--steps", "1",
                 "--rounds", "1"],
                ["verify", tiny_nvfp4, "--prompts", "1", "-n", "2"]):
        one_error(*_main([*cmd, "--device", "cpu", "--vram-budget", "0.0001"], capsys,
                         monkeypatch), "--vram-budget 0.0001 GiB is too small for the dense",
                  status=2)
    assert loads == []


def test_bench_arms_get_the_planned_slots(tiny_nvfp4, capsys, monkeypatch):
    import json

    a, layout = checkpoint_inputs(tiny_nvfp4)
    # two offloaded arms, each with its own bank and decoder, one token prefilled; `on` runs
    # --budget auto, so the warm-up is SETTLE_STEPS steps, then one round of one step
    w = Workload(16 + SETTLE_STEPS + 1 + 2, (1, 1), (None, None), 1, cuda=False, graphs=False)
    code, out, err = _main(["bench", tiny_nvfp4, "--arms", "off;on", "--context", "16", "--steps",
                            "1", "--rounds", "1", "--device", "cpu", "--json", "--vram-budget",
                            repr(budget_gib(a, layout, w, 30))], capsys, monkeypatch)
    assert code == 0, err
    res = json.loads(out.splitlines()[-1])["16"]
    assert res["off"]["vram_peak_reserved_mib"] is None  # no CUDA: no peak
    seen = []
    real = build_experts
    monkeypatch.setattr("ftchat.commands.bench.build_experts",
                        lambda m, s, *x: seen.append(s.slots) or real(m, s, *x))
    _main(["bench", tiny_nvfp4, "--arms", "off;on", "--context", "16", "--steps", "1", "--rounds",
           "1", "--device", "cpu", "--json", "--vram-budget", repr(budget_gib(a, layout, w, 30))],
          capsys, monkeypatch)
    assert seen == [30, 30]


# ===== info =====


def test_info_prints_the_plan_and_the_slots(tiny_nvfp4, capsys, monkeypatch):
    code, out, err = _main(["info", tiny_nvfp4, "--context", "1k", "--vram", "1"], capsys,
                           monkeypatch)
    assert code == 0, err
    for name in ("embedding", "KV cache (K and V)", "QSA block keys", "GDN recurrent state",
                 "prefill staging", "CUDA graph pools (estimate)", "per expert slot"):
        assert name in out, name
    assert "1 GiB: 96 slots fit (all experts fit" in out
    assert "slots        1 GiB VRAM" not in out  # the plan replaces the dense-only figure


def test_info_of_a_synthetic_layout_states_its_slots(capsys, monkeypatch):
    code, out, err = _main(["info", "--synthetic", "flash-next", "--layers", "48", "--vram", "16",
                            "--vram", "24", "--context", "4k", "--prefill", "1", "--slots",
                            "1650"], capsys, monkeypatch)
    assert code == 0, err
    assert "48 layers" in out and "expert slot bank" in out
    assert re.search(r"^16 GiB: 1,650 slots fit", out, re.M), out
    code, out, err = _main(["info", "--synthetic", "flash-next", "--layers", "48", "--vram", "16",
                            "--context", "255k", "--prefill", "1"], capsys, monkeypatch)
    assert code == 0, err
    assert "16 GiB does not fit" in out and "--context 261,120" in out


def test_info_refuses_a_context_beyond_the_model(tiny_nvfp4, capsys, monkeypatch):
    one_error(*_main(["info", tiny_nvfp4, "--context", "8k"], capsys, monkeypatch),
              "--context 8192: more than this model's limit of 4,096 tokens", status=2)


# ===== the CUDA-only pieces, with torch.cuda stubbed (no GPU here) =====


def test_cap_process_sets_the_fraction_of_the_device(monkeypatch):
    calls = []
    props = type("Props", (), {"total_memory": 64 * GIB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    cap_process(torch.device("cuda:0"), 16 * GIB)
    # "cuda" (what --device cuda resolves to) has no index: torch's setter refuses that, so the
    # current device's index is passed (the H200 run failed here before)
    cap_process(torch.device("cuda"), 16 * GIB)
    assert calls == [(0.25, 0), (0.25, 3)]
    with pytest.raises(SettingsError, match="--vram-budget 80 GiB: more than the device's 64.0"):
        cap_process(torch.device("cuda:0"), 80 * GIB)
    assert len(calls) == 2


def test_bench_prints_the_peak_against_the_budget(tiny_nvfp4, capsys, monkeypatch):
    fake = {"vram_peak_allocated_mib": 1000.0, "vram_peak_reserved_mib": 1200.0,
            "vram_budget_mib": 2048.0}
    monkeypatch.setattr("ftchat.commands.bench.peak_report", lambda device, budget: fake)
    code, out, err = _main(["bench", tiny_nvfp4, "--arms", "off", "--context", "16", "--steps",
                            "1", "--rounds", "1", "--device", "cpu", "--slots", "20"], capsys,
                           monkeypatch)
    assert code == 0, err
    assert ("VRAM peak since start: allocated 1,000 MiB, reserved 1,200 MiB (graph pools "
            "included); budget 2,048 MiB") in out
    assert peak_report(torch.device("cpu"), None) == dict.fromkeys(PEAK_KEYS)


def test_the_prefill_chunk_is_chosen_from_the_plan():
    """Under a budget the prefill chunk is the largest of PREFILL_CHUNKS that keeps 85 % of the
    slots the smallest leaves: at flash-next's 48 layers, fp8 K/V and 16 GiB, 4,096 at 255K
    (8,192 keeps only ~80 %) and 8,192 at 32K; with given slots, the largest whose plan fits
    them (control: a budget that fits those slots only with smaller chunks)."""
    a, layout = synthetic_inputs("flash-next", 48, "nvfp4-modelopt", "nvfp4")
    bf16, gib = torch.bfloat16, 2**30

    def work(context, banks=(None,)):
        return Workload(context, (1,), banks, 1024, True, True, dense_nvfp4=True,
                           kv_cache_dtype="fp8")
    w = work(261_120)
    slots = {c: slots_that_fit(a, layout, bf16, dataclasses.replace(w, prefill_tokens=c),
                                  16 * gib) for c in PREFILL_CHUNKS}
    assert slots[8192] < CHUNK_SLOT_SHARE * slots[1024] <= slots[4096]
    assert choose_prefill_chunk(a, layout, bf16, w, 16 * gib) == 4096
    assert choose_prefill_chunk(a, layout, bf16, work(32_768), 16 * gib) == 8192
    given = work(261_120, (1650,))
    fits = {c: plan(a, layout, bf16, dataclasses.replace(given, prefill_tokens=c),
                       1650).total for c in PREFILL_CHUNKS}
    budget = fits[4096]  # 8,192 does not fit 1,650 slots there, 4,096 just does
    assert fits[8192] > budget
    assert choose_prefill_chunk(a, layout, bf16, given, budget) == 4096
    assert choose_prefill_chunk(a, layout, bf16, given, fits[8192]) == 8192
