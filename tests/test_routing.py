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
    res_file = tmp_path / "replay.json"
    subprocess.run([sys.executable, "benchmarks/replay_routing.py", "--source", f"trace:{trace}",
                    "--num-experts", str(a.num_experts), "--slots", "96", "--warmup", "0",
                    "--evictions", "rule,lru", "--arms", "off", "--out", str(res_file)],
                   capture_output=True, text=True, check=True)
    res = json.loads(res_file.read_text())
    # every expert fits in 96 slots: only first touches miss, and the oracle can't do better
    assert a.num_hidden_layers * a.num_experts <= 96
    first = len({(layer, e) for x in lines for layer, ids in enumerate(x["routed"])
                 for e in ids}) / len(lines)
    assert res["belady"] == first
    assert [r["misses"] for r in res["rows"]] == [first, first]
