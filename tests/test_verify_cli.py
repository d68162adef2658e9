"""`ftchat verify` / `ftchat audit` / `ftchat bench` on the tiny model: clean runs exit 0; an
injected fault (a missing join) makes verify exit 1."""

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
from ftchat.model.tokenizer import Tokenizer
from ftchat.offload.backend import OffloadExperts

runner = CliRunner()


def _verify(folder, *extra, as_json: bool = True):
    return runner.invoke(app, ["verify", str(folder), "--prompts", "3", "--max-new-tokens", "12",
                               "--slots", "20", "--device", "cpu",
                               *(["--json"] if as_json else []), *extra])


def test_verify_clean_exits_zero(tiny_nvfp4):
    res = _verify(tiny_nvfp4, "--mode", "bytes", "--audit-every", "4")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["prompts"] == 3 and out["mismatches"] == 0 and out["verifier_records"] == 0
    assert out["audits"] > 0 and out["bad_slots"] == 0


def test_verify_audits_every_prompt_even_a_short_one(tiny_nvfp4):
    # 12 tokens never reach an audit interval of 64: the end-of-prompt audit still runs
    res = _verify(tiny_nvfp4, "--audit-every", "64")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["audits"] == 3 and [v["audits"] for v in out["per_prompt"]] == [1, 1, 1]


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


def test_verify_catches_a_missing_join(tiny_nvfp4, monkeypatch):
    monkeypatch.setattr(OffloadExperts, "_join", lambda self, layer: None)
    res = _verify(tiny_nvfp4)
    assert res.exit_code == 1
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["verifier_records"] > 0


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


def test_final_audit_catches_a_slot_corrupted_after_the_last_periodic_audit(tiny_nvfp4,
                                                                            monkeypatch):
    # 12 tokens = 11 decode steps; audits every 4 run at steps 4 and 8, the corruption at 11
    _corrupt_after_the_last_step(monkeypatch, last_step=11)
    res = _verify(tiny_nvfp4, "--audit-every", "4")
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == ["error: the slot audit found 3 bad slots"]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert [v["audits"] for v in out["per_prompt"]] == [3, 3, 3]
    assert [[b["step"] for b in v["bad_slots"]] for v in out["per_prompt"]] == [[11]] * 3
    assert out["mismatches"] == 0  # nothing read the slot again: only the audit can see it


def test_without_the_final_audit_that_corruption_goes_unseen(tiny_nvfp4, monkeypatch):
    # negative control: the same corruption, only the periodic audits run
    _corrupt_after_the_last_step(monkeypatch, last_step=11, final_audit=False)
    res = _verify(tiny_nvfp4, "--audit-every", "4")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["audits"] == 6 and out["bad_slots"] == 0


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
    res = _verify(tiny_nvfp4, "--graph")
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
    res = _verify(tiny_nvfp4, "--graph")
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
    res = _verify(tiny_nvfp4, "--graph", as_json=False)
    assert "graph mismatches" in res.stdout and "graph first mismatch" in res.stdout, res.stdout
    assert res.exit_code == 1


def test_verify_graph_on_differing_from_graph_off_fails(tiny_nvfp4, eager_replay):
    """A fault in the prefetch-on graph arm only is a prefetch mismatch on the replayed path."""
    def wrong_on_token_at_step_7(arm, call, logits):
        if arm == 1 and call % 11 == 7:
            logits[0, logits[0].argmax()] = float("-inf")

    eager_replay.fault = wrong_on_token_at_step_7
    res = _verify(tiny_nvfp4, "--graph")
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == [
        "error: 3 of 3 prompts differ with prefetch on in CUDA-graph replay"]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["graph_prefetch_mismatches"] == 3
    assert [v["graph_prefetch_first_mismatch"] for v in out["per_prompt"]] == [7] * 3
    assert [v["graph_first_mismatch"] for v in out["per_prompt"]] == [{"off": None, "on": 7}] * 3
