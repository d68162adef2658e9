"""benchmarks/routing_report.py: the routing figures on hand-made traces (known answers), the
cache code against independent implementations, and the whole report on a tiny synthetic model."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftchat.model.tokenizer import Tokenizer
from ftchat.offload.backend import router_lookahead
from ftchat.offload.policy import LRU, RULE
from tests.offload_util import model

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "routing_report.py"
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # CI has two cores (see conftest.py)
_spec = importlib.util.spec_from_file_location("routing_report", SCRIPT)
rr = importlib.util.module_from_spec(_spec)
sys.modules["routing_report"] = rr  # dataclasses look their module up
_spec.loader.exec_module(rr)


def trace_of(tokens: list[list[list[int]]], E: int, doc_len: int | None = None) -> rr.Trace:
    """A Trace from routed ids [T][L][K]; candidates = none (empty), one document or docs of
    doc_len tokens."""
    routed = torch.tensor(tokens)
    T, L, _ = routed.shape
    starts = torch.arange(T) % (doc_len or T) == 0
    return rr.Trace(routed, torch.zeros(T, L - 1, 0, dtype=torch.long), starts, E)


def skewed_trace(T: int, L: int, E: int, K: int, seed: int) -> list[list[list[int]]]:
    """Routing with Zipf-like expert popularity and some stickiness (so caches have reuse)."""
    g = torch.Generator().manual_seed(seed)
    p = 1 / torch.arange(1, E + 1).float()
    out, prev = [], [None] * L
    for _ in range(T):
        tok = []
        for layer in range(L):
            w = p[torch.randperm(E, generator=g)] if layer % 2 else p.clone()
            if prev[layer] is not None:
                w[prev[layer]] *= 4
            ids = torch.multinomial(w, K, generator=g)
            prev[layer] = ids
            tok.append(ids.tolist())
        out.append(tok)
    return out


# ===== hand-made traces =====


def test_reuse_on_a_hand_made_trace():
    # one layer, top-2: tokens {0,1} {1,2} {1,2} {3,0}
    layer0 = [[[0, 1]], [[1, 2]], [[1, 2]], [[3, 0]]]
    one_doc = trace_of(layer0, 4)
    assert rr.adjacent_reuse(one_doc.routed, one_doc.doc_start).tolist() == [(1 + 2 + 0) / 2 / 3]
    two_docs = trace_of(layer0, 4, doc_len=2)  # pairs (t0, t1) and (t2, t3) only
    assert rr.adjacent_reuse(two_docs.routed, two_docs.doc_start).tolist() == [(1 + 0) / 2 / 2]
    # two layers; the order of ids within a token does not matter
    two = trace_of([[[0, 1], [0, 1]], [[1, 2], [1, 0]], [[1, 2], [2, 3]], [[3, 0], [3, 2]]], 4)
    assert rr.adjacent_reuse(two.routed, two.doc_start).tolist() == pytest.approx([0.5, 2 / 3])


def test_belady_and_lru_on_hand_made_traces():
    # top-1, 2 slots, cycle 0 1 2 0 1 2: LRU always evicts the next one needed (0 hits); Belady
    # evicts 1 at t2 (next used at t4, after 0 at t3): hits at t3 (0) and t5 (2).
    cycle = [[[0]], [[1]], [[2]], [[0]], [[1]], [[2]]]
    assert rr.belady_hits([t[0] for t in cycle], 2) == 2
    for engine in ("sim", "ftchat"):
        assert rr.per_layer_hits(trace_of(cycle, 3), 2, LRU, engine) == [0]
    # top-2, 3 slots, {0,1} {0,2} {0,3} {0,1}: 0 hits at t1, t2, t3; at t2 LRU evicts 1 (least
    # recent), Belady evicts 2 (never used again), so 1 hits at t3 too.
    tokens = [[[0, 1]], [[0, 2]], [[0, 3]], [[0, 1]]]
    assert rr.belady_hits([t[0] for t in tokens], 3) == 4
    for engine in ("sim", "ftchat"):
        assert rr.per_layer_hits(trace_of(tokens, 4), 3, LRU, engine) == [3]


def optimal_hits(tokens: list[list[int]], c: int) -> int:
    """Exhaustive optimum: every choice of which residents to keep, for every token."""
    best = {frozenset(): 0}  # resident set -> most hits so far
    for ids in tokens:
        cur, nxt = set(ids), {}
        for held, hits in best.items():
            h = hits + len(cur & held)
            others = sorted(held - cur)
            for keep in itertools.combinations(others, min(len(others), c - len(cur))):
                state = frozenset(cur | set(keep))
                nxt[state] = max(nxt.get(state, -1), h)
        best = nxt
    return max(best.values())


def test_belady_is_optimal_and_beats_lru():
    for seed in range(6):
        tokens = [t[0] for t in skewed_trace(10, 1, 6, 2, seed)]
        for c in (2, 3, 4):
            assert rr.belady_hits(tokens, c) == optimal_hits(tokens, c), (seed, c)
    tr = trace_of(skewed_trace(400, 3, 16, 4, seed=1), 16)
    for c in (4, 6, 8, 12):
        best = [rr.belady_hits(tr.layer_tokens(layer), c) for layer in range(3)]
        for policy in (LRU, RULE):
            hits = rr.per_layer_hits(tr, c, policy)
            assert all(b >= h for b, h in zip(best, hits))
            assert sum(best) > sum(hits) or c == 4  # c = top-k: every policy keeps one token


def independent_lru(tokens: list[list[int]], c: int) -> int:
    """Textbook LRU over c slots: a token's resident ids are hits and become most recent; its
    missing ids go, in routed order, to the least recently used slots it does not use (empty
    slots first, ties to the lower slot, as ftchat breaks them)."""
    held, last, hits = [None] * c, [-1] * c, 0
    for t, ids in enumerate(tokens):
        present = [s for s in range(c) if held[s] in ids]
        hits += len(present)
        for s in present:
            last[s] = t
        missing = [e for e in ids if e not in held]
        free = sorted((s for s in range(c) if s not in present), key=lambda s: (last[s], s))
        for e, s in zip(missing, free):
            held[s], last[s] = e, t
    return hits


def test_lru_of_ftchat_cache_code_equals_an_independent_lru():
    tr = trace_of(skewed_trace(150, 2, 16, 4, seed=2), 16)
    for c in (4, 5, 8, 12):
        want = [independent_lru(tr.layer_tokens(layer), c) for layer in range(2)]
        assert rr.per_layer_hits(tr, c, LRU, engine="ftchat") == want
        assert rr.per_layer_hits(tr, c, LRU, engine="sim") == want
        assert 0 < sum(want) < 150 * 4 * 2


def test_replica_equals_ftchat_code_for_rule_and_pooled():
    T = 80
    tr = trace_of(skewed_trace(T, 3, 16, 4, seed=3), 16)
    tr.cands = torch.stack([torch.randperm(16)[:8] for _ in range(T * 2)]).view(T, 2, 8)
    assert rr.crosscheck(tr, [4, 6, 9], 3, T) == 3 * 2 * (3 * T + 3 * T)
    for c in (9, 12):  # rule really differs from LRU here, so its keys were exercised
        assert rr.per_layer_hits(tr, c, RULE) != rr.per_layer_hits(tr, c, LRU)
        assert rr.pooled_hits(tr, c, RULE, "ftchat") == rr.pooled_hits(tr, c, RULE)


# ===== a tiny synthetic model =====


@pytest.fixture(scope="module")
def tiny_trace(tiny_bf16, tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "engine.txt"
    text.write_text((ROOT / "ftchat" / "engine.py").read_text())
    src = rr.text_sources([str(text)], [], ROOT)
    docs, used = rr.documents(Tokenizer.from_folder(tiny_bf16).encode, src, 100, 300)
    assert [len(d) for d in docs] == [100, 100, 100] and used == {str(text): 300}
    return rr.capture_routing(model(tiny_bf16), docs, 16), docs


def test_tiny_model_figures_in_range(tiny_bf16, tiny_trace):
    trace, docs = tiny_trace
    a = model(tiny_bf16).args
    E, K, L, T = a.num_experts, a.num_experts_per_tok, a.num_hidden_layers, 300
    assert trace.routed.shape == (T, L, K) and trace.cands.shape == (T, L - 1, min(16, E))
    assert trace.routed.sort(-1).values.diff(dim=-1).gt(0).all()  # distinct ids per token
    assert 0 <= trace.routed.min() and trace.routed.max() < E
    assert trace.doc_start.nonzero().flatten().tolist() == [0, 100, 200]
    sizes, skipped = rr.cache_sizes(E, K, None)
    assert sizes == [4, 6, 8] and skipped == [1, 2]  # 16 experts: 2, 4, 6, 8 and 1, 6; top-4
    r = rr.compute(trace, sizes + [E], budget=4)
    assert all(0 <= v <= 1 for v in r["reuse"])
    for c, fig in r["caches"].items():
        for policy, rates in fig["hit_rate"].items():
            assert all(0 <= v <= 1 for v in rates), (c, policy)
        for layer in range(L):
            best = fig["hit_rate"]["belady"][layer]
            assert all(best >= fig["hit_rate"][p][layer] - 1e-12
                       for p in ("lru", "rule", "pooled_lru", "pooled_rule"))
        sel, useful, miss = fig["lookahead_total"]
        assert 0 <= useful <= min(sel, miss)
    # c = top-k holds exactly the previous token's experts: hits = adjacent intersections
    stream = trace_of(trace.routed.tolist(), E)  # one document: pairs across boundaries too
    shared = rr.adjacent_reuse(stream.routed, stream.doc_start) * (T - 1) * K  # [L]
    for policy in ("lru", "rule", "belady", "pooled_lru"):
        hits = torch.tensor(r["caches"][K]["hit_rate"][policy]) * T * K
        assert torch.allclose(hits, shared), policy
    # c = all experts: only first touches miss
    first = [len(set(sum(trace.layer_tokens(layer), []))) for layer in range(L)]
    assert [round(v * T * K) for v in r["caches"][E]["hit_rate"]["lru"]] == \
        [T * K - f for f in first]


def test_captured_routing_as_a_trace_file(tiny_bf16, tiny_trace, tmp_path):
    # --trace-out: the captured tokens as a --record-routing file that read_trace takes back,
    # routed ids and candidates exact, logits to float16, ranking the routed ids first
    from ftchat.routing.trace import read_trace

    trace, _ = tiny_trace
    path = tmp_path / "t.jsonl"
    trace.write_jsonl(path)
    steps = read_trace(path)
    assert len(steps) == trace.routed.shape[0]
    for t in (0, 1, 150, len(steps) - 1):
        s = steps[t]
        assert s.routed.tolist() == trace.routed[t].tolist()
        assert s.candidates.tolist() == trace.cands[t].tolist()
        z = trace.logits[t]
        assert torch.allclose(torch.from_numpy(s.logits), z, rtol=2**-10, atol=1e-4)
        for layer, ids in enumerate(s.routed):
            rest = [e for e in range(z.shape[1]) if e not in set(ids.tolist())]
            assert z[layer, ids].min() > z[layer, rest].max()  # the router's own logits


def test_prefill_routing_equals_decode_routing(tiny_bf16, tiny_trace):
    _, docs = tiny_trace
    chk = rr.decode_agreement(model(tiny_bf16), docs[0], 12, 16)
    assert chk["routed_total"] == 12 * 6 and chk["routed_equal"] == chk["routed_total"]
    assert chk["candidates_equal"] == chk["candidates_total"] == 12 * 5


def test_token_lookahead_is_routers_lookahead_per_token():
    g = torch.Generator().manual_seed(0)
    x, router = torch.randn(5, 32, generator=g), torch.randn(16, 32, generator=g)
    got = rr.token_lookahead(x, router, 6)
    for t in range(5):
        assert got[t].tolist() == router_lookahead(x[t : t + 1], router, 6).tolist()


def test_lookahead_precision_oracle_and_random(tiny_trace):
    trace, _ = tiny_trace
    T, L, K = trace.routed.shape
    oracle = rr.Trace(trace.routed, trace.routed[:, 1:], trace.doc_start, 16)  # true next routing
    g = torch.Generator().manual_seed(0)
    random = torch.stack([torch.randperm(16, generator=g) for _ in range(T * (L - 1))])
    guess = rr.Trace(trace.routed, random.view(T, L - 1, 16), trace.doc_start, 16)
    for c in (4, 8):
        sel, useful, miss = map(sum, zip(*rr.lookahead_counts(oracle, c, 4)))
        assert sel > 0 and useful == sel == miss  # budget 4 = top-k: every miss predicted
        sel, useful, miss = map(sum, zip(*rr.lookahead_counts(oracle, c, 2)))
        assert useful == sel and useful < miss
        sel, useful, miss = map(sum, zip(*rr.lookahead_counts(guess, c, 4)))
        assert sel == T * (L - 1) * 4 and useful / sel < 0.5  # about misses / non-resident
        sel, useful, _ = map(sum, zip(*rr.lookahead_counts(trace, c, 4)))
        assert 0 <= useful <= sel


def test_cli_prints_the_report(tiny_bf16, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text((ROOT / "ftchat" / "engine.py").read_text())
    out = tmp_path / "r.json"
    # the replica crosscheck has its own test: 10 tokens keep this one fast
    res = subprocess.run([sys.executable, str(SCRIPT), str(tiny_bf16), "--text", str(text),
                          "--tokens", "300", "--json", str(out), "--crosscheck", "10"],
                         capture_output=True, text=True, cwd=ROOT, env=ONE_THREAD)
    assert res.returncode == 0, res.stderr
    for heading in ("## 1. Adjacent-token expert reuse", "## 2. Expert cache hit rate",
                    "## 3. Router lookahead", "## 4. Published figures",
                    "| layer | reuse |", "| c | LRU | rule | Belady | pooled LRU | pooled rule |",
                    "| Qwen3-30B-A3B (128 experts, top-8) | adjacent-token expert reuse | 38.9 %"):
        assert heading in res.stdout
    fig = json.loads(out.read_text())
    assert fig["tokens"] == 300 and sorted(fig["caches"]) == ["4", "6", "8"]


def test_cli_bad_model_path_is_one_line(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world")
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nope"), "--text",
                          str(text)], capture_output=True, text=True, cwd=ROOT, env=ONE_THREAD)
    assert res.returncode != 0
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_cli_trace_out_in_a_missing_folder_fails_before_loading(tmp_path):
    # the model path is bad too: the --trace-out error comes first, so the path is checked
    # before the model loads (control: without --trace-out, the model's error)
    text = tmp_path / "t.txt"
    text.write_text("hello world")
    base = [sys.executable, str(SCRIPT), str(tmp_path / "nope"), "--text", str(text)]
    res = subprocess.run(base + ["--trace-out", str(tmp_path / "no" / "t.jsonl")],
                         capture_output=True, text=True, cwd=ROOT, env=ONE_THREAD)
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert res.stderr.startswith("error: --trace-out") and "does not exist" in res.stderr
    res = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, env=ONE_THREAD)
    assert res.returncode == 1 and "--trace-out" not in res.stderr
