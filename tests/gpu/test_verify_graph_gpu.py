"""GPU tier (`pytest -m gpu`): `ftchat verify --graph` with real CUDA-graph replay, prompt by
prompt (--batch 1) and in groups (--batch 2 over 3 prompts: a group of 2, then one of 1, each
size captured), with a control that breaks only the replay, and a short soak on CUDA."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftchat.cli import app
from ftchat.graph import DecodeGraph
from ftchat.model.synth import write_checkpoint

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gpu") / "tiny", "tiny",
                            fmt="nvfp4-modelopt", seed=1, layers=8)


def _verify(folder, batch: str):
    res = CliRunner().invoke(app, ["verify", str(folder), "--prompts", "3", "--max-new-tokens",
                                   "24", "--slots", "20", "--device", "cuda", "--graph", "--json",
                                   "--batch", batch])
    return res, json.loads(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else None


@pytest.mark.parametrize("batch, audits", [("1", 3), ("2", 2)])  # an end-of-group audit each
def test_verify_graph_replay_equals_the_eager_arms(tiny, batch, audits):
    res, out = _verify(tiny, batch)
    assert res.exit_code == 0, res.output
    assert out["mismatches"] == 0 and out["graph_mismatches"] == 0 and out["audits"] == audits
    assert out["graph_prefetch_mismatches"] == 0 and out["batch"] == int(batch)
    assert [v["graph_first_mismatch"] for v in out["per_prompt"]] == [{"off": None, "on": None}] * 3


@pytest.mark.parametrize("batch", ["1", "2"])
def test_verify_graph_sees_a_replay_that_reads_stale_positions(tiny, monkeypatch, batch):
    # control: a replay that never updates its position buffer decodes every step at one place
    def stale(self, tokens, lengths):
        self.tokens.copy_(tokens, non_blocking=True)
        self.graph.replay()
        return self.logits

    monkeypatch.setattr(DecodeGraph, "__call__", stale)
    res, out = _verify(tiny, batch)
    assert res.exit_code == 1
    assert out["mismatches"] == 0 and out["graph_mismatches"] > 0


def test_short_soak_on_cuda(tiny, tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import soak

    out = tmp_path / "soak.jsonl"
    # 30 s, a report every 5 s: turns of a fraction of a second make a shorter fit all noise
    rc = soak.main([str(tiny), "--minutes", "0.5", "--interval", "5", "--warmup", "1",
                    "--max-new-tokens", "8", "--slots", "20", "--prefetch", "on", "--trim",
                    "--max-rss-slope", "64", "--device", "cuda", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 0, capsys.readouterr().err
    assert all(s["vram_reserved"] >= s["vram_allocated"] > 0 for s in lines[:-1])
    assert lines[-1]["ok"] is True
