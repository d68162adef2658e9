"""`ftchat verify` / `ftchat audit` / `ftchat bench` on the tiny model: clean runs exit 0; an
injected fault (a missing join) makes verify exit 1."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ftchat.cli import app
from ftchat.offload.backend import OffloadExperts

runner = CliRunner()


def _verify(folder, *extra):
    return runner.invoke(app, ["verify", str(folder), "--prompts", "3", "--max-new-tokens", "12",
                               "--slots", "20", "--device", "cpu", "--json", *extra])


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


def test_verify_that_audited_nothing_fails(tiny_nvfp4, monkeypatch):
    from ftchat.debug.audit import SlotAudit

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
    import ftchat.ui.debug as dbg
    from ftchat.cli import main

    def boom(*a, **k):
        raise RuntimeError("device fell over\nsecond line")

    monkeypatch.setattr(dbg, "bench", boom)
    monkeypatch.delenv("FTCHAT_DEBUG", raising=False)
    assert main(["bench", str(tiny_bf16), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: internal error: RuntimeError: device fell over (FTCHAT_DEBUG=1 shows "
                   "the traceback)"]
    monkeypatch.setenv("FTCHAT_DEBUG", "1")  # control: the traceback on request
    import pytest

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
