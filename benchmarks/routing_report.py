"""Routing report: how a model's real routing would use a per-layer expert cache (docs/routing.md).

Runs a model folder on held-out text on the CPU (fp32, all experts resident), records the routed
experts of every token at every MoE layer, and prints a Markdown report:

1. adjacent-token expert reuse per layer: mean over tokens t > 0 of |E_t & E_t-1| / top_k;
2. per-layer cache hit rates, hits / (tokens x top_k), for caches of c experts per layer under
   LRU, ftchat's `rule` policy and the Belady oracle (plus ftchat's pooled cache, L x c slots);
3. router-lookahead precision and recall: layer L+1's router on layer L's router input, top-K
   candidates, the first `budget` of them not resident in layer L+1's LRU cache;
4. the published reference figures next to this model's figures at the same cache fraction.

    python benchmarks/routing_report.py MODEL --python-packages networkx sympy xarray \
        [--text FILE ...] [--tokens 20000] [--seq 512] [--cache-sizes 8,16,24,32] [--json F]

How routing is captured: `RecordingExperts` wraps the all-resident ExpertBackend; the MoE block
calls `begin(layer, x, ids)` with the router input x [T, D] and the routed ids [T, K], so one
chunked prefill per document (ftchat.engine.Decoder.prefill) records every token. A decode
check routes the first tokens again one decode step at a time and compares the expert sets.
The model code is not modified.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ftchat.errors import FtchatError
from ftchat.model.expert_backend import ForwardingBackend, Pending
from ftchat.offload import cache as sc
from ftchat.offload.policy import EMPTY_BASE, POLICIES, EvictionPolicy
from ftchat.output_file import OutputFile, check_target
from ftchat.routing.trace import trace_line

# Quoted figures (issue 7), not computed here: (model, figure, value, fraction of experts cached).
PUBLISHED = [
    ("Qwen3-30B-A3B (128 experts, top-8)", "adjacent-token expert reuse", 0.389, None),
    ("Qwen3-30B-A3B (128 experts, top-8)", "LRU hit rate, 8 of 128 per layer", 0.42, 8 / 128),
    ("Qwen3-30B-A3B (128 experts, top-8)", "Belady hit rate, 8 of 128 per layer", 0.61, 8 / 128),
    ("Qwen3.8-Flash-Next (512 experts, top-10)", "LRU hit rate, 186 of 512 per layer", 0.62,
     186 / 512),
]
DEFAULT_FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2)  # 8, 16, 24, 32 of 64 experts
REFERENCE_FRACTIONS = (8 / 128, 186 / 512)  # the published cache sizes, as fractions
MAX_FILE_BYTES = 1 << 20  # skip generated tables among the Python sources


# ===== held-out text =====


@dataclass
class Source:
    """A named piece of held-out text: one plain text file or one Python package's sources."""

    name: str
    files: list[Path]  # read in this order


def text_sources(texts: Sequence[str], packages: Sequence[str], root: Path) -> list[Source]:
    """--text files (one source each) and --python-packages (a folder, or a package under root)."""
    out = []
    for t in texts:
        if not Path(t).is_file():
            raise FtchatError(f"{t}: no such text file")
        out.append(Source(t, [Path(t)]))
    for name in packages:
        p = Path(name) if Path(name).is_dir() else root / name
        if p.is_dir():
            out.append(Source(name, sorted(p.rglob("*.py"))))
        elif p.with_suffix(".py").is_file():
            out.append(Source(name, [p.with_suffix(".py")]))
        else:
            raise FtchatError(f"{name}: not a folder and no package of that name under {root}")
    if not out:
        raise FtchatError("no text: give --text FILE... and/or --python-packages NAME...")
    return out


def _file_texts(src: Source) -> Iterator[str]:
    for path in src.files:
        try:
            if len(src.files) > 1 and path.stat().st_size > MAX_FILE_BYTES:
                continue
            yield path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            if len(src.files) == 1:
                raise FtchatError(f"{path}: cannot read as UTF-8 text") from None


def documents(encode: Callable[[str], list[int]], sources: list[Source], seq: int,
              max_tokens: int) -> tuple[list[list[int]], dict[str, int]]:
    """Token documents of at most `seq` tokens, at most `max_tokens` in all, shared equally
    between the sources; each source's files are concatenated, then cut. Also tokens per source."""
    quota = math.ceil(max_tokens / len(sources))
    docs, used = [], {}
    for src in sources:
        stream: list[int] = []
        for text in _file_texts(src):
            stream += encode(text)
            if len(stream) >= quota:
                break
        stream = stream[: min(quota, max_tokens - sum(used.values()))]
        used[src.name] = len(stream)
        docs += [stream[i : i + seq] for i in range(0, len(stream), seq)]
    docs = [d for d in docs if len(d) >= 2]
    if not docs:
        raise FtchatError("the text gave fewer than 2 tokens")
    return docs, used


# ===== routing capture =====


def token_lookahead(x: Tensor, router: Tensor, k: int) -> Tensor:
    """Per token: top-k experts [T, k] of the next layer's router [E, D] on this layer's router
    input x [T, D]. Row t equals ftchat's router_lookahead(x[t:t+1], router, k) (bs-1 decode)."""
    probs = torch.softmax(x.float() @ router.float().T, dim=-1)  # [T, E]
    return probs.topk(k, dim=-1).indices


class RecordingExperts(ForwardingBackend):
    """ExpertBackend wrapper: forwards every call to `inner` and records, per MoE call, the routed
    ids [T, K], the router logits [T, E] and the next layer's lookahead candidates [T, C]
    computed from the router input. (Per token, unlike the backend's lookahead, which sums a
    chunk's probabilities.)"""

    def __init__(self, inner, routers: list[Tensor], k: int,
                 predictor: Callable[[Tensor, Tensor, int], Tensor] = token_lookahead):
        super().__init__(inner)
        self.routers, self.k, self.predictor = routers, k, predictor
        self.ids: list[list[Tensor]] = [[] for _ in routers]  # per layer: [T, K] per call
        self.logits: list[list[Tensor]] = [[] for _ in routers]  # per layer: [T, E] per call
        self.cands: list[list[Tensor]] = [[] for _ in routers[1:]]  # per layer < last: [T, C]

    def begin(self, layer: int, x: Tensor, ids: Tensor) -> Pending:
        self.ids[layer].append(ids.detach().clone())
        self.logits[layer].append((x.detach() @ self.routers[layer].T).float())
        if layer + 1 < len(self.routers):
            self.cands[layer].append(self.predictor(x.detach(), self.routers[layer + 1], self.k))
        return self.inner.begin(layer, x, ids)

    def for_prefill(self) -> RecordingExperts:
        return self

    def take(self) -> tuple[Tensor, Tensor, Tensor]:
        """(routed [T, L, K], candidates [T, L-1, C], logits [T, L, E]) recorded since the last
        take."""
        routed = torch.stack([torch.cat(per) for per in self.ids], dim=1)
        cands = torch.stack([torch.cat(per) for per in self.cands], dim=1)
        logits = torch.stack([torch.cat(per) for per in self.logits], dim=1)
        self.ids = [[] for _ in self.ids]
        self.cands = [[] for _ in self.cands]
        self.logits = [[] for _ in self.logits]
        return routed, cands, logits


@dataclass
class Trace:
    """Routing of a token stream; documents follow one another (doc_start marks their firsts)."""

    routed: Tensor  # [T, L, K] int64 routed expert ids
    cands: Tensor  # [T, L-1, C] int64 lookahead candidates for layer l+1, best first
    doc_start: Tensor  # [T] bool: first token of a document
    num_experts: int
    logits: Tensor | None = None  # [T, L, E] fp32 router logits

    def write_jsonl(self, path: Path) -> None:
        """The tokens as a `--record-routing` file, one line a token (what
        benchmarks/replay_routing.py --source trace:FILE replays, eviction score included)."""
        out = OutputFile(path, "--trace-out", force=True)  # renamed into place when complete
        try:
            for t in range(self.routed.shape[0]):
                out.write(trace_line(t + 1, self.routed[t].tolist(), self.cands[t].tolist(),
                                     None if self.logits is None else self.logits[t].numpy()))
        except BaseException:
            out.discard()
            raise
        out.commit()

    @property
    def top_k(self) -> int:
        return self.routed.shape[2]

    def layer_tokens(self, layer: int) -> list[list[int]]:
        """The routed ids of `layer`, one list per token (what the cache simulations read)."""
        return self.routed[:, layer].tolist()


def routers_of(m) -> list[Tensor]:
    """gate.weight [E, D] of every layer (every layer of qwen4_exp is an MoE layer)."""
    return [m.weights.layers[i]["mlp"]["gate.weight"] for i in range(m.args.num_hidden_layers)]


def capture_routing(m, docs: list[list[int]], k: int) -> Trace:
    """Routing of every token: one chunked prefill per document (fresh decode state each)."""
    from ftchat.engine import Decoder, resident_backend

    rec = RecordingExperts(resident_backend(m), routers_of(m), min(k, m.args.num_experts))
    dec = Decoder(m, rec, 1, max(len(d) for d in docs) + 1)
    routed, cands, logits, starts = [], [], [], []
    with torch.inference_mode():
        for doc in docs:
            dec.reset(experts=False)
            dec.prefill(0, torch.tensor(doc), 0)
            r, c, z = rec.take()
            routed.append(r)
            cands.append(c)
            logits.append(z)
            starts.append(torch.arange(len(doc)) == 0)
    return Trace(torch.cat(routed), torch.cat(cands), torch.cat(starts), m.args.num_experts,
                 torch.cat(logits))


def decode_agreement(m, doc: list[int], n: int, k: int) -> dict:
    """Route the first n tokens of doc by one prefill and by n decode steps; how many
    (token, layer) routed sets, and lookahead top-k sets, are equal."""
    from ftchat.engine import Decoder, resident_backend

    n = min(n, len(doc))
    pre = capture_routing(m, [doc[:n]], k)
    rec = RecordingExperts(resident_backend(m), routers_of(m), min(k, m.args.num_experts))
    dec = Decoder(m, rec, 1, n + 1)
    with torch.inference_mode():
        for i in range(n):
            dec.step(torch.tensor([doc[i]]), [i])
    routed, cands, _ = rec.take()
    same = (routed.sort(-1).values == pre.routed.sort(-1).values).all(-1)  # [n, L]
    same_c = (cands.sort(-1).values == pre.cands.sort(-1).values).all(-1)  # [n, L-1]
    return {"tokens": n, "routed_equal": int(same.sum()), "routed_total": same.numel(),
            "candidates_equal": int(same_c.sum()), "candidates_total": same_c.numel()}


# ===== figure 1: adjacent-token reuse =====


def adjacent_reuse(routed: Tensor, doc_start: Tensor) -> Tensor:
    """Per layer [L]: mean over tokens t > 0 of a document of |E_t & E_t-1| / top_k, where E_t
    is the routed expert set of token t (ids within a token are distinct)."""
    k = routed.shape[2]
    shared = (routed[1:, :, :, None] == routed[:-1, :, None, :]).any(-1).sum(-1)  # [T-1, L]
    keep = ~doc_start[1:]  # pairs inside one document
    return shared[keep].float().mean(0) / k


# ===== figure 2: cache hit rates =====


class SlotCacheSim:
    """A fast stand-in for ftchat.offload.cache's demand path (ensure) and counting mode
    (prefetch_measure) with batch 1 and no prefetch installs: keys from ftchat's own
    `EvictionPolicy.stamp`, the clock ticking once per ensure, victims the lowest keys among
    slots not routed in the call, ties to the lower slot, kept in a heap. Much faster than the
    torch-op maps on the CPU; `crosscheck` compares it with ftchat's own code at every run."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, policy: EvictionPolicy):
        self.L, self.E, self.S, self.policy = num_layers, num_experts, num_slots, policy
        self.slot_of: dict[int, int] = {}  # global id (layer * E + e) -> slot
        self.id_of = [-1] * num_slots
        # key * S + slot per slot: these order by key, ties to the lower slot
        self.order = [EMPTY_BASE * num_slots + s for s in range(num_slots)]
        self.heap = list(self.order)  # a min-heap of orders, stale entries skipped when popped
        self.clock = 0
        self.hits = [0] * num_layers
        self.misses = [0] * num_layers

    def ensure(self, layer: int, ids: list[int]) -> int:
        """Make the routed ids of `layer` resident; returns the hits (distinct ids found)."""
        S, order, slot_of = self.S, self.order, self.slot_of
        if len(set(ids)) != len(ids):
            ids = list(dict.fromkeys(ids))  # equal ids share one slot, as in ensure
        if len(ids) > S:
            raise ValueError(f"{len(ids)} routed ids per call need at least {len(ids)} slots")
        self.clock += 1
        base, used, missing = layer * self.E, [], []
        for e in ids:
            s = slot_of.get(base + e)
            if s is None:
                missing.append(base + e)
            else:
                used.append(s)
        # the keys come from ftchat's own policy: hits restamped, misses stamped from empty
        w = self.policy.freq_weight(S, self.L, len(ids))
        old = torch.tensor([order[s] // S for s in used] + [EMPTY_BASE] * len(missing))
        keys = self.policy.stamp(old, torch.tensor(self.clock), w).tolist()
        victims = self._victims(len(missing), used)  # chosen before any key changes
        for s, key in zip(used, keys):
            self._set(s, key)
        for g, s, key in zip(missing, victims, keys[len(used):]):
            if self.id_of[s] >= 0:
                del slot_of[self.id_of[s]]
            slot_of[g], self.id_of[s] = s, g
            self._set(s, key)
        self.hits[layer] += len(used)
        self.misses[layer] += len(missing)
        return len(used)

    def _set(self, s: int, key: int) -> None:
        self.order[s] = key * self.S + s
        heapq.heappush(self.heap, self.order[s])
        if len(self.heap) > 4 * self.S:  # drop the stale entries
            self.heap = list(self.order)
            heapq.heapify(self.heap)

    def _victims(self, n: int, used: list[int]) -> list[int]:
        """The n slots of lowest (key, slot) among those not in `used`, lowest first."""
        out, kept = [], []
        while len(out) < n:
            v = heapq.heappop(self.heap)
            s = v % self.S
            if self.order[s] != v:
                continue  # stale: the slot has a newer key (keys of a slot never repeat)
            if s in used:
                kept.append(v)
            else:
                out.append(s)
        for v in kept:
            heapq.heappush(self.heap, v)
        return out

    def measure(self, layer: int, cands: list[int], budget: int,
                routed: list[int]) -> tuple[int, int, int]:
        """(selected, useful, misses) as prefetch_measure: the first `budget` distinct candidates
        not resident, how many of them `layer` routes to, and the routed ids not resident."""
        base, selected = layer * self.E, []
        for e in dict.fromkeys(cands):
            if len(selected) == budget:
                break
            if base + e not in self.slot_of:
                selected.append(e)
        routed_set = set(routed)
        misses = sum(base + e not in self.slot_of for e in routed_set)
        return len(selected), len(routed_set.intersection(selected)), misses


class FtchatCache:
    """ftchat.offload.cache itself behind SlotCacheSim's interface: the reference the replica is
    checked against (~0.7 ms per ensure on the CPU, too slow for the whole report)."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, policy: EvictionPolicy):
        self.maps = sc.SlotMaps.create(num_layers, num_experts, num_slots)
        self.policy = policy

    @property
    def id_of(self) -> list[int]:
        return self.maps.id_of[:-1].tolist()  # [S], without the sink

    def ensure(self, layer: int, ids: list[int]) -> int:
        before = int(self.maps.stats.hits[layer])
        sc.ensure(self.maps, layer, torch.tensor([ids]), self.policy)
        return int(self.maps.stats.hits[layer]) - before

    def measure(self, layer: int, cands: list[int], budget: int,
                routed: list[int]) -> tuple[int, int, int]:
        r = sc.prefetch_measure(self.maps, layer, torch.tensor(cands), budget, torch.tensor(routed))
        return int(r.selected), int(r.useful), int(r.misses)


CACHES = {"sim": SlotCacheSim, "ftchat": FtchatCache}


def per_layer_calls(trace: Trace, layer: int) -> list[tuple[int, list[int]]]:
    """The ensure calls of one layer's own cache (a 1-layer slot map): (0, ids) per token."""
    return [(0, ids) for ids in trace.layer_tokens(layer)]


def pooled_calls(trace: Trace) -> list[tuple[int, list[int]]]:
    """The ensure calls of ftchat's real layout, one slot map shared by all layers: (layer, ids)
    for every token, layer by layer."""
    return [(layer, ids) for tok in trace.routed.tolist() for layer, ids in enumerate(tok)]


def replay(cache: SlotCacheSim | FtchatCache, calls: list[tuple[int, list[int]]]) -> list[int]:
    """Hits of every ensure call, in order."""
    return [cache.ensure(layer, ids) for layer, ids in calls]


def per_layer_hits(trace: Trace, c: int, policy: EvictionPolicy, engine: str = "sim"
                   ) -> list[int]:
    """Per layer [L]: hits of the layer's own cache of c slots over the whole token stream."""
    E, L = trace.num_experts, trace.routed.shape[1]
    return [sum(replay(CACHES[engine](1, E, c, policy), per_layer_calls(trace, layer)))
            for layer in range(L)]


def pooled_hits(trace: Trace, c: int, policy: EvictionPolicy, engine: str = "sim") -> list[int]:
    """Per layer [L]: hits under ftchat's real layout, L x c slots shared by all layers."""
    E, L = trace.num_experts, trace.routed.shape[1]
    calls = pooled_calls(trace)
    hits = [0] * L
    for (layer, _), h in zip(calls, replay(CACHES[engine](L, E, L * c, policy), calls)):
        hits[layer] += h
    return hits


def belady_hits(tokens: list[list[int]], c: int) -> int:
    """Hits of the offline optimum (Belady) for one layer's cache of c >= top_k slots: the ids
    of token t already resident are hits; each missing id is installed in place of the resident
    whose next use is furthest in the future (never used again first), never one routed at t."""
    never = len(tokens)
    nxt: list[dict[int, int]] = [{}] * len(tokens)  # nxt[t][e]: next token after t routing e
    last: dict[int, int] = {}
    for t in range(len(tokens) - 1, -1, -1):
        nxt[t] = {e: last.get(e, never) for e in tokens[t]}
        last.update((e, t) for e in tokens[t])
    held: dict[int, int] = {}  # resident id -> its next use
    hits = 0
    for t, ids in enumerate(tokens):
        cur = set(ids)
        missing = [e for e in cur if e not in held]
        hits += len(cur) - len(missing)
        excess = len(held) + len(missing) - c
        if excess > 0:
            others = ((u, e) for e, u in held.items() if e not in cur)
            for _, e in heapq.nlargest(excess, others):
                del held[e]
        held.update(nxt[t])
    return hits


def crosscheck(trace: Trace, sizes: list[int], budget: int, n: int) -> int:
    """Compare SlotCacheSim with ftchat's own ensure / prefetch_measure on the first n tokens:
    per-layer and pooled caches, every size and policy (hits of every call and the final slot
    contents), and the lookahead counts. Returns the calls compared; RuntimeError on a difference.
    """
    E, L = trace.num_experts, trace.routed.shape[1]
    head = Trace(trace.routed[:n], trace.cands[:n], trace.doc_start[:n], E)
    checked = 0
    for c in sizes:
        for name in ("lru", "rule"):  # the replica's policies (not score: it reads logits)
            policy = POLICIES[name]
            setups = [(1, c, per_layer_calls(head, layer)) for layer in range(L)]
            setups.append((L, L * c, pooled_calls(head)))
            for layers, slots, calls in setups:
                sim = SlotCacheSim(layers, E, slots, policy)
                ref = FtchatCache(layers, E, slots, policy)
                if replay(sim, calls) != replay(ref, calls) or sim.id_of != ref.id_of:
                    raise RuntimeError(f"cache replica differs from ftchat ({name}, {slots} slots "
                                       f"for {layers} layer(s))")
                checked += len(calls)
        if lookahead_counts(head, c, budget, "ftchat") != lookahead_counts(head, c, budget):
            raise RuntimeError(f"prefetch_measure replica differs from ftchat at c {c}")
    return checked


# ===== figure 3: router lookahead =====


def lookahead_counts(trace: Trace, c: int, budget: int, engine: str = "sim") -> list[list[int]]:
    """Per target layer l = 1..L-1: [selected, useful, demand misses] summed over tokens.

    At token t, before layer l's ensure (its own LRU cache of c slots, no prefetch installs),
    take the candidates predicted for l at layer l-1, keep the first `budget` not resident
    (selected) and count those layer l routes to (useful). engine "ftchat" runs ftchat's
    prefetch_measure / ensure (slow), "sim" the replica.
    cands [T, L-1, C] may come from any predictor (tests use an oracle and a random one).
    """
    E, L = trace.num_experts, trace.routed.shape[1]
    out = []
    for layer in range(1, L):
        cache = CACHES[engine](1, E, c, POLICIES["lru"])
        total = [0, 0, 0]
        for ids, cand in zip(trace.layer_tokens(layer), trace.cands[:, layer - 1].tolist()):
            counts = cache.measure(0, cand, budget, ids)  # the maps before layer's ensure
            total = [a + b for a, b in zip(total, counts)]
            cache.ensure(0, ids)
        out.append(total)
    return out


# ===== the report =====


def cache_sizes(E: int, k: int, given: list[int] | None) -> tuple[list[int], list[int]]:
    """(sizes to simulate, sizes left out because they are below top_k). Default: 1/8, 1/4, 3/8,
    1/2 of the experts, the published fractions (8/128, 186/512) and c = top_k, rounded."""
    if given:
        wanted = set(given)
    else:
        fracs = DEFAULT_FRACTIONS + REFERENCE_FRACTIONS
        wanted = {max(1, round(f * E)) for f in fracs} | {k}
    ok = sorted(c for c in wanted if k <= c <= E)
    return ok, sorted(c for c in wanted if c < k or c > E)


def compute(trace: Trace, sizes: list[int], budget: int) -> dict:
    """Every figure of the report (plain numbers, JSON-ready)."""
    L, K = trace.routed.shape[1], trace.top_k
    T, E = trace.routed.shape[0], trace.num_experts
    demand = T * K  # lookups per layer
    reuse = adjacent_reuse(trace.routed, trace.doc_start).tolist()
    layers = [trace.layer_tokens(layer) for layer in range(L)]
    caches = {}
    for c in sizes:
        rates = {name: [h / demand for h in per_layer_hits(trace, c, pol)]
                 for name, pol in POLICIES.items()}
        rates["belady"] = [belady_hits(tok, c) / demand for tok in layers]
        for name, pol in POLICIES.items():
            rates[f"pooled_{name}"] = [h / demand for h in pooled_hits(trace, c, pol)]
        look = lookahead_counts(trace, c, budget)
        caches[c] = {"hit_rate": rates,
                     "mean": {p: sum(v) / L for p, v in rates.items()},
                     "lookahead": look,
                     "lookahead_total": [sum(col) for col in zip(*look)]}
    return {"tokens": T, "layers": L, "num_experts": E, "top_k": K,
            "reuse": reuse, "reuse_mean": sum(reuse) / L, "caches": caches}


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f} %"


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(r: dict) -> str:
    """The report as Markdown (r: compute()'s figures plus the run's metadata)."""
    L, E, K, caches = r["layers"], r["num_experts"], r["top_k"], r["caches"]
    sizes = sorted(caches)
    chk = r["decode_check"]
    lines = [f"# Routing report: {r['model']}", "",
             f"- Model: {L} MoE layers, {E} experts, top-{K}. Text: {r['tokens']} tokens in "
             f"{r['documents']} documents of at most {r['seq']} tokens ("
             + ", ".join(f"{n}: {t}" for n, t in r["sources"].items()) + ").",
             "- Routing: recorded from chunked prefill (fp32, CPU, all experts resident) "
             "through a recording ExpertBackend (`begin(layer, x, ids)`). Decode check on the "
             f"first {chk['tokens']} tokens, one decode step each: {chk['routed_equal']} of "
             f"{chk['routed_total']} (token, layer) expert sets and {chk['candidates_equal']} of "
             f"{chk['candidates_total']} lookahead top-{r['candidates']} sets equal prefill's.",
             "- Caches: each layer has its own c slots (a 1-layer ftchat slot map per layer, "
             "clock ticks once per token). LRU and rule use a replica of ftchat's "
             f"`ensure`, checked against `ftchat.offload.cache` on the first {r['crosscheck']} "
             "tokens (identical hits and slots). The cache persists across documents. "
             "`pooled` columns: ftchat's real layout, one map of L x c slots shared by all "
             "layers (same memory).",
             "- Hit rate = hits / (tokens x top_k) per layer, first touches included.",
             ""]
    if r["skipped_sizes"]:
        lines += [f"Cache sizes left out (below top-{K} or above {E}): "
                  + ", ".join(map(str, r["skipped_sizes"])) + ".", ""]

    lines += ["## 1. Adjacent-token expert reuse", "",
              f"Mean over tokens t > 0 of a document of |E_t & E_t-1| / {K}; uniform random "
              f"routing would give {K}/{E} = {_pct(K / E)}.", ""]
    rows = [[str(i), _pct(v)] for i, v in enumerate(r["reuse"])]
    lines += _table(["layer", "reuse"], rows + [["**mean**", f"**{_pct(r['reuse_mean'])}**"]])

    lines += ["", "## 2. Expert cache hit rate, c experts cached per layer", ""]
    if K in caches:
        lines += [f"At c = top-k = {K} every policy holds exactly the previous token's experts, "
                  "so its hit rate is the adjacent reuse (across document boundaries too).", ""]
    lines += ["Mean over layers:", ""]
    cols = ["lru", "rule", "belady", "pooled_lru", "pooled_rule"]
    rows = [[f"{c} of {E} ({_pct(c / E)})"] + [_pct(caches[c]["mean"][p]) for p in cols]
            for c in sizes]
    lines += _table(["c", "LRU", "rule", "Belady", "pooled LRU", "pooled rule"], rows)
    lines += ["", "Per layer, LRU / rule / Belady:", ""]
    rows = [[str(i)] + [" / ".join(f"{100 * caches[c]['hit_rate'][p][i]:.1f}"
                                   for p in ("lru", "rule", "belady")) for c in sizes]
            for i in range(L)]
    lines += _table(["layer"] + [f"c = {c}" for c in sizes], rows)

    b, kc = r["budget"], r["candidates"]
    lines += ["", "## 3. Router lookahead", "",
              f"Layer L+1's router on layer L's router input, top-{kc} candidates per token, the "
              f"first {b} not resident in layer L+1's LRU cache of c slots (before its ensure; "
              "no prefetch installs). Precision = useful / predicted; recall = useful / demand "
              "misses of layer L+1.", ""]
    rows = []
    for c in sizes:
        sel, useful, miss = caches[c]["lookahead_total"]
        n = r["tokens"] * (L - 1)
        rows.append([str(c), f"{sel / n:.2f}", f"{miss / n:.2f}", _pct(_ratio(useful, sel)),
                     _pct(_ratio(useful, miss))])
    lines += _table(["c", "predicted / token-layer", "demand misses / token-layer",
                     "precision", "recall"], rows)
    lines += ["", "Precision / recall per target layer:", ""]
    rows = [[str(i + 1)] + [_precision_recall(caches[c]["lookahead"][i]) for c in sizes]
            for i in range(L - 1)]
    lines += _table(["layer L+1"] + [f"c = {c}" for c in sizes], rows)

    lines += ["", "## 4. Published figures (quoted, not computed here)", "",
              "This model's figure at the same fraction of its experts (c rounded); a fraction "
              f"below top-{K} cannot hold one token's experts and is n/a.", ""]
    rows = [[m, fig, _pct(v), _this_model(r, frac, fig)] for m, fig, v, frac in PUBLISHED]
    lines += _table(["model", "figure", "published", "this model"], rows)
    return "\n".join(lines) + "\n"


def _precision_recall(counts: list[int]) -> str:
    sel, useful, miss = counts
    return f"{_pct(_ratio(useful, sel))} / {_pct(_ratio(useful, miss))}"


def _this_model(r: dict, frac: float | None, fig: str) -> str:
    """This model's figure for one PUBLISHED row: at the same fraction of the experts, and at
    c = top_k where that fraction cannot hold one token's experts (8 of 128 = Qwen3-30B's top-k).
    """
    if frac is None:
        return _pct(r["reuse_mean"])
    E, K, caches = r["num_experts"], r["top_k"], r["caches"]
    c = max(1, round(frac * E))
    policy = "belady" if fig.startswith("Belady") else "lru"
    if c in caches:
        return f"{_pct(caches[c]['mean'][policy])} at c = {c} of {E}"
    here = f"n/a at c = {c} of {E} (below top-{K})" if c < K else f"n/a at c = {c} of {E}"
    if K in caches:
        here += f"; {_pct(caches[K]['mean'][policy])} at c = top-k = {K}"
    return here


def _int_list(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]  # ValueError: argparse's usage error


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="ftchat / HF checkpoint folder")
    p.add_argument("--text", nargs="+", default=[], metavar="FILE", help="plain text files")
    p.add_argument("--python-packages", nargs="+", default=[], metavar="NAME",
                   help="Python package folders, or package names under --source")
    p.add_argument("--source", type=Path, default=Path(sysconfig.get_paths()["purelib"]),
                   help="where --python-packages names are looked up (default: site-packages)")
    p.add_argument("--tokens", type=int, default=20000, help="most tokens, all sources together")
    p.add_argument("--seq", type=int, default=512, help="tokens per document")
    p.add_argument("--cache-sizes", type=_int_list, default=None,
                   help="c values, comma-separated (default: fractions of the expert count)")
    p.add_argument("--candidates", type=int, default=16, help="lookahead top-K")
    p.add_argument("--budget", type=int, default=4, help="candidates kept per token and layer")
    p.add_argument("--decode-check", type=int, default=32, help="tokens routed by decode too")
    p.add_argument("--crosscheck", type=int, default=100,
                   help="tokens on which the cache replica is compared with ftchat's code")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--trace-out", type=Path, default=None, metavar="FILE",
                   help="also write the captured routing as a --record-routing trace")
    a = p.parse_args(argv)
    if a.tokens < 2 or a.seq < 2 or a.candidates < 1 or a.budget < 1:
        p.error("--tokens and --seq must be >= 2, --candidates and --budget >= 1")
    return a


def run(a: argparse.Namespace) -> dict:
    """Load, tokenize, capture, compute: the report's figures and metadata."""
    from ftchat.engine import load_model
    from ftchat.model.tokenizer import Tokenizer

    t0 = time.perf_counter()
    if a.trace_out:  # before the capture: a bad path fails in a second, not after minutes
        check_target(a.trace_out, "--trace-out", force=True)
    sources = text_sources(a.text, a.python_packages, a.source)
    m = load_model(a.model, "cpu", torch.float32)
    docs, used = documents(Tokenizer.from_folder(a.model).encode, sources, a.seq, a.tokens)
    E, K = m.args.num_experts, m.args.num_experts_per_tok
    sizes, skipped = cache_sizes(E, K, a.cache_sizes)
    if not sizes:
        raise FtchatError(f"no cache size in {K}..{E} (top-k..experts)")
    if a.budget > sizes[0]:
        raise FtchatError(f"--budget {a.budget} is above the smallest cache size {sizes[0]}")
    trace = capture_routing(m, docs, a.candidates)
    _log(f"routing of {trace.routed.shape[0]} tokens captured [{time.perf_counter() - t0:.1f}s]")
    if a.trace_out:
        trace.write_jsonl(a.trace_out)
    check = decode_agreement(m, docs[0], a.decode_check, a.candidates)
    crosscheck(trace, sizes, a.budget, a.crosscheck)
    _log(f"decode check and cache crosscheck done [{time.perf_counter() - t0:.1f}s]")
    r = compute(trace, sizes, a.budget)
    _log(f"figures computed [{time.perf_counter() - t0:.1f}s]")
    r.update(model=str(a.model), documents=len(docs), seq=a.seq, sources=used,
             candidates=min(a.candidates, E), budget=a.budget, decode_check=check,
             crosscheck=min(a.crosscheck, trace.routed.shape[0]), skipped_sizes=skipped)
    return r


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        r = run(a)
    except FtchatError as e:
        print(f"error: {(str(e).strip().splitlines() or [''])[0]}", file=sys.stderr)
        return 1
    print(markdown(r), end="")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
