"""--record-routing writes one line per decode step; the replay tool reads it."""

from __future__ import annotations

import json
import subprocess
import sys

from ftchat.engine import generate
from ftchat.session import build_experts
from ftchat.settings import Settings
from tests.offload_util import PROMPTS, model


def test_record_and_replay(tiny_bf16, tmp_path):
    m = model(tiny_bf16)
    trace = tmp_path / "t.jsonl"
    ex = build_experts(m, Settings(record_routing=str(trace), candidates=8))
    out = list(generate(m, PROMPTS[1], 21, ex))
    assert not trace.exists()  # written under a temporary name until the run ends
    ex.close()
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    a = m.args
    assert len(lines) == 20  # decode steps (the first token comes from the prefill)
    assert all(len(x["routed"]) == a.num_hidden_layers for x in lines)
    assert all(len(c) == 8 for x in lines for c in x["candidates"])
    assert all(len(x["candidates"]) == a.num_hidden_layers - 1 for x in lines)
    assert len(out) == 21
    res = subprocess.run([sys.executable, "benchmarks/replay_routing.py", str(trace),
                          "--num-experts", str(a.num_experts), "--slots", "8,96"],
                         capture_output=True, text=True, check=True)
    rows = [r for r in res.stdout.splitlines() if r.startswith("slots")]
    assert len(rows) == 2
    # every expert fits in 96 slots: only first touches miss, and the oracle can't do better
    all_fit = rows[1]
    assert "lru" in all_fit and "belady" in all_fit
