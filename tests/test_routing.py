"""--record-routing writes one line per decode step, router logits included; the replay tool
reads it, eviction score too."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ftchat.engine import generate
from ftchat.errors import FtchatError
from ftchat.routing.trace import decode_logits, encode_logits, read_trace
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
                    "--evictions", "rule,lru,score", "--arms", "off", "--out", str(res_file)],
                   capture_output=True, text=True, check=True)
    res = json.loads(res_file.read_text())
    # every expert fits in 96 slots: only first touches miss, and the oracle can't do better
    assert a.num_hidden_layers * a.num_experts <= 96
    first = len({(layer, e) for x in lines for layer, ids in enumerate(x["routed"])
                 for e in ids}) / len(lines)
    assert res["belady"] == first
    assert [r["eviction"] for r in res["rows"]] == ["rule", "lru", "score"]  # logits: score too
    assert [r["misses"] for r in res["rows"]] == [first, first, first]


def test_recorded_logits_rank_the_routed_experts_first(tiny_bf16, tmp_path):
    # the logits are the router's on the token's own input (CPU: the GEMV that routed it), so
    # every routed expert's logit is at least every other's (>=: float16 may tie them)
    m = model(tiny_bf16)
    trace = tmp_path / "t.jsonl"
    ex = build_experts(m, Settings(record_routing=str(trace)))
    list(generate(m, PROMPTS[1], 21, ex))
    ex.close()
    steps = read_trace(trace)
    assert len(steps) == 20
    E, K = m.args.num_experts, m.args.num_experts_per_tok
    for s in steps:
        assert s.logits.shape == (m.args.num_hidden_layers, E)
        for layer, ids in enumerate(s.routed):
            z = s.logits[layer]
            others = np.delete(z, ids)
            assert z[ids].min() >= others.max()
            assert len(set(ids.tolist())) == K
    # control: another layer's logits do not rank this layer's routed experts first everywhere
    shifted = [(s.logits[(layer + 1) % len(s.routed)], ids) for s in steps
               for layer, ids in enumerate(s.routed)]
    assert not all(z[ids].min() >= np.delete(z, ids).max() for z, ids in shifted)


def test_logits_codec_round_trip_and_errors(tmp_path):
    z = np.array([[0.5, -1.25, 3.0], [2.0, 0.0, -0.5]], dtype=np.float32)
    assert np.array_equal(decode_logits(encode_logits(z), 2), z)  # exact in float16
    with pytest.raises(ValueError):
        decode_logits(encode_logits(z), 4)  # 6 values are not 4 layers
    p = tmp_path / "t.jsonl"
    line = {"step": 1, "routed": [[1], [2]], "candidates": [[0]]}
    bad = {**line, "logits_f16": "not base64!"}
    p.write_text(json.dumps(bad) + "\n")
    with pytest.raises(FtchatError, match="line 1: logits_f16"):
        read_trace(p)
    narrow = {**line, "logits_f16": encode_logits(np.zeros((2, 2), np.float32))}
    p.write_text(json.dumps(narrow) + "\n")  # expert 2 is routed: 2 logits a layer are too few
    with pytest.raises(FtchatError, match="expert 2 is routed"):
        read_trace(p)
    good = {**line, "logits_f16": encode_logits(z)}
    p.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(FtchatError, match="some lines have logits_f16"):
        read_trace(p)
    p.write_text(json.dumps(good) + "\n")  # control: one consistent line reads
    assert np.array_equal(read_trace(p)[0].logits, z)
