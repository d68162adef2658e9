"""`ftchat verify` / `ftchat audit` / `ftchat bench` on the tiny model: clean runs exit 0; an
injected fault (a missing join) makes verify exit 1, prompt by prompt (--batch 1) and with the
prompts decoded in groups (--batch 2, 3: the tiny model routes top-4, so 20 slots hold 5 rows)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import ftchat.engine as engine
from ftchat.cli import app, main
from ftchat.commands import bench_ui
from ftchat.debug import verify_command
from ftchat.debug.slot_audit import SlotAudit
from ftchat.errors import FtchatError
from ftchat.model.tokenizer import Tokenizer
from ftchat.offload.backend import OffloadExperts
from ftchat.settings import Settings
from ftchat.vram.workloads import checkpoint_inputs, verify_workload

runner = CliRunner()


def _verify(folder, *extra, as_json: bool = True):
    return runner.invoke(app, ["verify", str(folder), "--prompts", "3", "--max-new-tokens", "12",
                               "--slots", "20", "--device", "cpu",
                               *(["--json"] if as_json else []), *extra])


@pytest.mark.parametrize("extra, batch", [((), 3), (("--batch", "1"), 1),
                                          (("--batch", "2"), 2), (("--slots", "8"), 2)])
def test_verify_clean_exits_zero(tiny_nvfp4, extra, batch):
    # auto: every prompt in one group (20 slots hold 5 rows of top-4), or 8 // 4 = 2 rows
    res = _verify(tiny_nvfp4, "--mode", "bytes", "--audit-every", "4", *extra)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["prompts"] == 3 and out["mismatches"] == 0 and out["verifier_records"] == 0
    assert out["audits"] > 0 and out["bad_slots"] == 0
    assert out["batch"] == batch
    groups = [v["group"] for v in out["per_prompt"]]
    assert groups == {1: [0, 1, 2], 2: [0, 0, 1], 3: [0, 0, 0]}[batch]


@pytest.mark.parametrize("batch", ["2", "3"])
def test_verify_batched_text_report_ends_with_pass(tiny_nvfp4, batch):
    res = _verify(tiny_nvfp4, "--batch", batch, as_json=False)
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[-1] == ("PASS: prefetch on matched off over 3 prompts x 12 "
                                           "tokens, no verifier record, no bad slot")


@pytest.mark.parametrize("batch, audits", [("1", [1, 1, 1]), ("2", [1, 0, 1]),
                                           ("3", [1, 0, 0])])
def test_verify_audits_every_prompt_even_a_short_one(tiny_nvfp4, batch, audits):
    # 12 tokens never reach an audit interval of 64: the end-of-group audit still runs, once a
    # group (its count is carried by the group's first prompt)
    res = _verify(tiny_nvfp4, "--audit-every", "64", "--batch", batch)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["audits"] == sum(audits) and [v["audits"] for v in out["per_prompt"]] == audits


def test_a_ragged_group_decodes_each_row_as_it_decodes_alone(tiny_nvfp4, monkeypatch):
    # prompts of 3, 9 and 5 tokens in one group of 3: each row's tokens, in both eager arms, are
    # those the prompt gets decoded alone on the all-resident backend
    m = engine.load_model(tiny_nvfp4)
    ragged = [[3, 17, 99], [9, 120, 44, 2, 300, 7, 7, 12, 400], [250, 31, 5, 66, 81]]
    texts = verify_command.cold_prompts(3, 0)
    arms = []
    real = verify_command._greedy
    monkeypatch.setattr(verify_command, "_greedy", lambda *a: arms.append(real(*a)) or arms[-1])
    done = []
    verdicts = verify_command.verify_prompts(
        m, lambda text: ragged[texts.index(text)], Settings(slots=20, prefetch="on"), 3, 8,
        "bytes", audit_every=4, batch=3, progress=lambda i, n: done.append((i, n)))
    assert [v.prompt_tokens for v in verdicts] == [3, 9, 5]
    assert [v.tokens for v in verdicts] == [8] * 3
    assert [v.first_mismatch for v in verdicts] == [None] * 3 and verdicts[0].records == []
    assert [v.group for v in verdicts] == [0, 0, 0] and done == [(3, 3)]
    alone = [[s.tokens[0] for s in engine.generate(m, [ids], 8, engine.resident_backend(m))]
             for ids in ragged]
    assert arms == [alone, alone]  # the off arm, then the on arm, one batch each


def test_the_vram_plan_counts_a_groups_rows(tiny_nvfp4, monkeypatch):
    # the plan is made before the weights load: the rows from --slots (20 // top-k 4 = 5, or
    # 8 // 4 = 2), the cap when the slots are sized later, or --batch
    seen = []

    def spy(a, layout, settings, max_new, arms, batch):
        seen.append(batch)
        raise FtchatError("planned")

    monkeypatch.setattr(verify_command, "verify_workload", spy)
    for extra in (["--slots", "20"], ["--slots", "8"], [], ["--batch", "2"]):
        res = runner.invoke(app, ["verify", str(tiny_nvfp4), "--prompts", "20", "--device",
                                  "cpu", *extra])
        assert str(res.exception) == "planned"
    assert seen == [5, 2, verify_command.AUTO_BATCH_CAP, 2]
    a, layout = checkpoint_inputs(tiny_nvfp4)
    assert verify_workload(a, layout, Settings(device="cpu"), 8, 2, batch=4).decoders == (4,)


def test_verify_progress_counts_prompts(tiny_nvfp4):
    m = engine.load_model(tiny_nvfp4)
    done = []
    verify_command.verify_prompts(m, lambda text: [3, 17, 99, 4], Settings(slots=20), 5, 2,
                                  "meta", batch=2, progress=lambda i, n: done.append((i, n)))
    assert done == [(2, 5), (4, 5), (5, 5)]


def test_verify_reports_each_prompts_length(tiny_nvfp4):

    tok = Tokenizer.from_folder(tiny_nvfp4)
    want = [len(tok.encode(tok.render_chat([{"role": "user", "content": t}])))
            for t in verify_command.cold_prompts(3, 0)]
    res = _verify(tiny_nvfp4)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert [v["prompt_tokens"] for v in out["per_prompt"]] == want and min(want) > 10


def test_verify_prompt_seed_picks_other_cold_prompts(tiny_nvfp4, monkeypatch):

    seen = []
    real = verify_command.cold_prompts
    monkeypatch.setattr(verify_command, "cold_prompts",
                        lambda n, seed: seen.append(real(n, seed)) or seen[-1])
    outs = [json.loads(_verify(tiny_nvfp4, *args).stdout.strip().splitlines()[-1])
            for args in ((), ("--prompt-seed", "7"))]
    assert [o["prompt_seed"] for o in outs] == [0, 7]
    assert seen[0] == real(3, 0) and seen[1] == real(3, 7)
    assert not set(seen[0]) & set(seen[1])  # other nonces: a split run repeats no prompt


def test_verify_that_audited_nothing_fails(tiny_nvfp4, monkeypatch):

    monkeypatch.setattr(SlotAudit, "audit", lambda self, view: None)  # the check never runs
    res = _verify(tiny_nvfp4)
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == ["error: no slot audit ran"]


@pytest.mark.parametrize("batch", ["1", "3"])
def test_verify_catches_a_missing_join(tiny_nvfp4, monkeypatch, batch):
    # negative control: test_verify_clean_exits_zero, the same run with the join in place
    monkeypatch.setattr(OffloadExperts, "_join", lambda self, layer: None)
    res = _verify(tiny_nvfp4, "--batch", batch)
    assert res.exit_code == 1
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["verifier_records"] > 0
    if batch == "3":  # one group: its records are carried by its first prompt
        assert [bool(v["records"]) for v in out["per_prompt"]] == [True, False, False]
        res = _verify(tiny_nvfp4, "--batch", batch, as_json=False)
        assert res.exit_code == 1
        lines = res.stdout.splitlines()
        assert lines[-1].startswith("FAIL: "), res.stdout
        assert any(line.startswith("prompt 0 (group 0): ") for line in lines), res.stdout
        assert "(a group's records and bad slots are listed on its first prompt)" in lines


def test_a_batch_the_slots_cannot_hold_is_a_usage_error(tiny_nvfp4, capsys, monkeypatch):
    monkeypatch.delenv("FTCHAT_DEBUG", raising=False)

    def no_load(*a, **k):
        raise AssertionError("the weights loaded")

    with monkeypatch.context() as mp:  # --slots given: refused before the weights load
        mp.setattr("ftchat.commands.load.load_model", no_load)
        assert main(["verify", str(tiny_nvfp4), "--prompts", "6", "--batch", "6", "--slots",
                     "20", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "error: Invalid value for '--batch': --batch 6: 6 prompts decoded together need 24 "
        "expert slots (6 x top-k 4), more than the 20 the run has; give --batch 5 or less, or "
        "--slots 24 or more"]
    # no --slots: every expert (6 layers x 16 = 96 slots) on the CPU, known once loaded
    assert main(["verify", str(tiny_nvfp4), "--prompts", "25", "--batch", "25", "-n", "1",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "need 100 expert slots" in err[0] and "the 96 the run" in err[0]
    # control: the largest group that fits runs
    assert main(["verify", str(tiny_nvfp4), "--prompts", "5", "--batch", "5", "-n", "2",
                 "--slots", "20", "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["batch"] == 5


def test_audit_and_bench_commands(tiny_bf16):
    res = runner.invoke(app, ["audit", str(tiny_bf16), "--prompt", "hello", "--every", "4",
                              "--slots", "20", "--prefetch", "on", "--max-new-tokens", "20",
                              "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["audits"] == 19 // 4 + 1 and out["bad_slots"] == 0  # every 4 steps, and the end
    res = runner.invoke(app, ["bench", str(tiny_bf16), "--arms", "resident;off;on:budget=4",
                              "--context", "32", "--steps", "3", "--rounds", "1", "--slots", "20",
                              "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])["32"]
    assert set(out) == {"resident", "off", "on:budget=4"}
    assert out["resident"]["misses_per_token"] == 0 and out["off"]["misses_per_token"] > 0
    bad = runner.invoke(app, ["bench", str(tiny_bf16), "--arms", "sideways", "--device", "cpu"])
    assert bad.exit_code != 0


def test_an_internal_error_is_one_line(monkeypatch, capsys, tiny_bf16):

    def boom(*a, **k):
        raise RuntimeError("device fell over\nsecond line")

    monkeypatch.setattr(bench_ui, "run_bench", boom)
    monkeypatch.delenv("FTCHAT_DEBUG", raising=False)
    assert main(["bench", str(tiny_bf16), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: internal error: RuntimeError: device fell over (FTCHAT_DEBUG=1 shows "
                   "the traceback)"]
    monkeypatch.setenv("FTCHAT_DEBUG", "1")  # control: the traceback on request
    with pytest.raises(RuntimeError):
        main(["bench", str(tiny_bf16), "--device", "cpu"])


def test_audit_with_no_model_announces_the_demo(tiny_bf16, monkeypatch):
    # the debug commands print the same demo banner as `run` (once printed a function's repr)
    monkeypatch.setattr("ftchat.resolve.SHIPPED_DEMO", tiny_bf16)
    res = runner.invoke(app, ["audit", "--prompt", "hello", "--every", "4", "--slots", "20",
                              "--max-new-tokens", "4", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    assert "demo model: a small qwen4_exp trained" in res.stderr
    assert "<function" not in res.stderr


# ===== the end-of-prompt audit =====

def _corrupt_after_the_last_step(monkeypatch, last_step: int, final_audit: bool = True):
    """Flip a byte of a held slot at the end of decode step `last_step` (after the periodic
    audit of that step, if any); with final_audit=False only audits run from end_step count."""

    audit, end_step = SlotAudit.audit, SlotAudit.end_step

    def corrupting_end_step(self, v):
        self.in_step = True
        end_step(self, v)
        self.in_step = False
        if v.step == last_step:
            S = v.bank.shape[0] - 1
            slot = int((v.maps.id_of[:S] >= 0).nonzero()[0])
            v.bank[slot, 0] ^= 0xFF

    def periodic_only(self, v):
        if final_audit or getattr(self, "in_step", False):
            audit(self, v)

    monkeypatch.setattr(SlotAudit, "end_step", corrupting_end_step)
    monkeypatch.setattr(SlotAudit, "audit", periodic_only)


# per batch: (the audit's finding, audits per prompt, bad-slot steps per prompt)
FINAL_AUDIT = {"1": ("3 bad slots", [3, 3, 3], [[11]] * 3),
               "3": ("1 bad slots", [3, 0, 0], [[11], [], []])}


@pytest.mark.parametrize("batch", ["1", "3"])
def test_final_audit_catches_a_slot_corrupted_after_the_last_periodic_audit(tiny_nvfp4,
                                                                            monkeypatch, batch):
    # 12 tokens = 11 decode steps; audits every 4 run at steps 4 and 8, the corruption at 11
    found, audits, steps = FINAL_AUDIT[batch]
    _corrupt_after_the_last_step(monkeypatch, last_step=11)
    res = _verify(tiny_nvfp4, "--audit-every", "4", "--batch", batch)
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == [f"error: the slot audit found {found}"]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert [v["audits"] for v in out["per_prompt"]] == audits
    assert [[b["step"] for b in v["bad_slots"]] for v in out["per_prompt"]] == steps
    assert out["mismatches"] == 0  # nothing read the slot again: only the audit can see it


@pytest.mark.parametrize("batch, audits", [("1", 6), ("3", 2)])
def test_without_the_final_audit_that_corruption_goes_unseen(tiny_nvfp4, monkeypatch, batch,
                                                             audits):
    # negative control: the same corruption, only the periodic audits run
    _corrupt_after_the_last_step(monkeypatch, last_step=11, final_audit=False)
    res = _verify(tiny_nvfp4, "--audit-every", "4", "--batch", batch)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["audits"] == audits and out["bad_slots"] == 0


# ===== verify --graph: graph replay, prefetch off and on, against the eager arms =====

class EagerReplay:
    """DecodeGraph's stand-in on CPU, where CUDA graphs do not exist: the same step function on
    the same static buffers, run eagerly at each replay (no capture). `fault(call, logits)` may
    change the logits of a replay (calls count per arm from 1); `arm` is the replay's place in
    `built` (verify builds the prefetch-off arm first: 0 off, 1 on)."""

    built: list[EagerReplay] = []
    fault = None

    def __init__(self, step, batch: int, device):
        self.step, self.calls, self.arm = step, 0, len(EagerReplay.built)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        for _ in range(2):  # the capture's warm-up steps, which the Decoder must undo
            step(self.tokens, self.pos)
        EagerReplay.built.append(self)

    def __call__(self, tokens, lengths):
        self.calls += 1
        self.tokens.copy_(tokens)
        self.pos.copy_(torch.tensor(lengths, dtype=torch.long)[:, None])
        logits = self.step(self.tokens, self.pos)
        if EagerReplay.fault is not None:
            EagerReplay.fault(self.arm, self.calls, logits)
        return logits


@pytest.fixture
def eager_replay(monkeypatch):
    """Let --graph run on the CPU with EagerReplay in place of the CUDA graph."""

    monkeypatch.setattr(verify_command, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(engine, "DecodeGraph", EagerReplay)
    monkeypatch.setattr(EagerReplay, "built", [])
    monkeypatch.setattr(EagerReplay, "fault", None)
    return EagerReplay


def test_verify_graph_on_the_cpu_is_one_usage_line(capsys, monkeypatch, tmp_path):

    monkeypatch.delenv("FTCHAT_DEBUG", raising=False)
    # a model that does not exist: the refusal comes before anything loads
    assert main(["verify", str(tmp_path / "none"), "--graph", "--device", "cpu",
                 "--slots", "20"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "error: Invalid value for '--graph': CUDA-graph replay needs a CUDA device and this "
        "run is on cpu; there is no CPU equivalent (drop --graph)"]
    # control: without --graph the same command gets as far as the missing model
    assert main(["verify", str(tmp_path / "none"), "--device", "cpu", "--slots", "20"]) == 1
    assert "--graph" not in capsys.readouterr().err


def test_verify_graph_needs_a_fixed_slot_count(capsys, monkeypatch, tiny_nvfp4, eager_replay):

    assert main(["verify", str(tiny_nvfp4), "--graph", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "give --slots, --expert-vram or --vram-budget" in err[0], err


def test_verify_graph_compares_hook_free_replay_with_the_eager_arms(tiny_nvfp4, eager_replay,
                                                                    monkeypatch):

    built = []
    real = verify_command.build_experts

    def spy(m, settings, hooks=None):
        built.append((settings.prefetch, hooks is None))
        return real(m, settings, hooks)

    monkeypatch.setattr(verify_command, "build_experts", spy)
    res = _verify(tiny_nvfp4, "--graph", "--batch", "1")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["mismatches"] == 0 and out["graph_mismatches"] == 0
    assert out["graph_first_mismatch"] is None
    assert [v["graph_first_mismatch"] for v in out["per_prompt"]] == [{"off": None, "on": None}] * 3
    assert out["graph_prefetch_mismatches"] == 0
    # one capture per arm for the whole run, each replayed 11 steps x 3 prompts, without hooks
    assert [g.calls for g in eager_replay.built] == [33, 33]
    assert built[:2] == [("off", True), ("on", True)]
    assert built[2:] == [("off", True), ("on", False)] * 3  # the eager arms: `on` is watched


def test_verify_graph_mismatch_fails_and_is_reported(tiny_nvfp4, eager_replay, monkeypatch):
    def wrong_token_at_step_5(arm, call, logits):
        if call % 11 == 5:  # 11 replays per prompt: token 5 of every prompt, both arms
            logits[0, logits[0].argmax()] = float("-inf")

    eager_replay.fault = wrong_token_at_step_5
    res = _verify(tiny_nvfp4, "--graph", "--batch", "1")
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == [
        "error: 3 of 3 prompts differ between CUDA-graph replay and eager decode"]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["mismatches"] == 0 and out["graph_mismatches"] == 3
    assert out["graph_first_mismatch"] == 5
    assert [v["graph_first_mismatch"] for v in out["per_prompt"]] == [{"off": 5, "on": 5}] * 3
    # both graph arms took the same wrong token: replay differs from eager, not prefetch on from off
    assert out["graph_prefetch_mismatches"] == 0
    assert [v["graph_prefetch_first_mismatch"] for v in out["per_prompt"]] == [None] * 3
    monkeypatch.setenv("COLUMNS", "200")  # the table, wide enough for every column name
    res = _verify(tiny_nvfp4, "--graph", "--batch", "1", as_json=False)
    assert "graph mismatches" in res.stdout and "graph first mismatch" in res.stdout, res.stdout
    assert res.exit_code == 1


def test_verify_graph_on_differing_from_graph_off_fails(tiny_nvfp4, eager_replay):
    """A fault in the prefetch-on graph arm only is a prefetch mismatch on the replayed path."""
    def wrong_on_token_at_step_7(arm, call, logits):
        if arm == 1 and call % 11 == 7:
            logits[0, logits[0].argmax()] = float("-inf")

    eager_replay.fault = wrong_on_token_at_step_7
    res = _verify(tiny_nvfp4, "--graph", "--batch", "1")
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == [
        "error: 3 of 3 prompts differ with prefetch on in CUDA-graph replay"]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["graph_prefetch_mismatches"] == 3
    assert [v["graph_prefetch_first_mismatch"] for v in out["per_prompt"]] == [7] * 3
    assert [v["graph_first_mismatch"] for v in out["per_prompt"]] == [{"off": None, "on": 7}] * 3


def test_verify_graph_in_groups_captures_each_group_size(tiny_nvfp4, eager_replay, monkeypatch):
    """--batch 2 over 3 prompts: a pair captured at 2 rows for the first group, then a pair at
    1 row for the last (the same batch as its eager arms)."""
    built = []
    real = verify_command.build_experts

    def spy(m, settings, hooks=None):
        built.append((settings.prefetch, hooks is None, settings.batch_size))
        return real(m, settings, hooks)

    monkeypatch.setattr(verify_command, "build_experts", spy)
    res = _verify(tiny_nvfp4, "--graph", "--batch", "2")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["mismatches"] == 0 and out["graph_mismatches"] == 0 and out["batch"] == 2
    assert out["graph_prefetch_mismatches"] == 0
    assert [g.tokens.shape[0] for g in eager_replay.built] == [2, 2, 1, 1]
    assert [g.calls for g in eager_replay.built] == [11, 11, 11, 11]
    graph, eager = [("off", True, 2), ("on", True, 2)], [("off", True, 2), ("on", False, 2)]
    assert built == graph + eager + graph + eager  # every backend checked for 2 rows


def test_verify_graph_in_groups_attributes_a_mismatch_to_its_row(tiny_nvfp4, eager_replay):
    """A replay fault in row 1 only (the second prompt of the first group of 2): that prompt,
    and only it, differs from eager decode."""
    def wrong_row_1_token_at_step_5(arm, call, logits):
        if logits.shape[0] > 1 and call == 5:
            logits[1, logits[1].argmax()] = float("-inf")

    eager_replay.fault = wrong_row_1_token_at_step_5
    res = _verify(tiny_nvfp4, "--graph", "--batch", "2")
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == [
        "error: 1 of 3 prompts differ between CUDA-graph replay and eager decode"]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert [v["graph_first_mismatch"] for v in out["per_prompt"]] == [
        {"off": None, "on": None}, {"off": 5, "on": 5}, {"off": None, "on": None}]
    assert out["mismatches"] == 0 and out["graph_prefetch_mismatches"] == 0


def test_graph_groups_stay_on_the_decode_expert_path():
    """Under --graph a group is at most 8 rows (the Triton decode experts' limit; a larger batch
    takes the prefill path, whose capture failed on the device); without --graph the slots and
    the cap of 16 decide."""
    from ftchat.debug.verify_command import BatchTooLarge, group_size

    assert group_size(None, 60, 96, 8, graph=True) == 8
    assert group_size(None, 60, 96, 8, graph=False) == 12  # control: 96 slots // top-8
    assert group_size(None, 3, 96, 8, graph=True) == 3
    with pytest.raises(BatchTooLarge, match="--batch 8 or less"):
        group_size(9, 60, 200, 8, graph=True)
    assert group_size(9, 60, 200, 8, graph=False) == 9
