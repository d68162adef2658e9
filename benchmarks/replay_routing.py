"""Replay a routing trace (`ftchat run --record-routing FILE`) through the slot cache.

For each slot count: demand misses per token under lru and rule (ftchat's own cache code), the
Belady (furthest next use) oracle's misses, and the router lookahead's precision: of the first
`budget` candidates predicted for layer L+1 at layer L, the share that layer L+1 routes to.

    python benchmarks/replay_routing.py trace.jsonl --slots 8,16,32 --num-experts 64
"""

from __future__ import annotations

import argparse
import json

import torch

from ftchat.offload import cache as sc
from ftchat.offload.policy import POLICIES


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def replay(trace: list[dict], E: int, S: int, policy: str) -> float:
    L = len(trace[0]["routed"])
    maps = sc.SlotMaps.create(L, E, S)
    for step in trace:
        for layer, ids in enumerate(step["routed"]):
            sc.ensure(maps, layer, torch.tensor([ids]), POLICIES[policy])
    return int(maps.stats.misses.sum()) / len(trace)


def belady(trace: list[dict], E: int, S: int) -> float:
    seq = [layer * E + e for step in trace for layer, ids in enumerate(step["routed"])
           for e in sorted(set(ids))]
    nxt, last = [0] * len(seq), {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i], last[seq[i]] = last.get(seq[i], len(seq)), i
    held, misses = {}, 0  # id -> next use
    for i, g in enumerate(seq):
        if g not in held:
            misses += 1
            if len(held) >= S:
                del held[max(held, key=held.get)]
        held[g] = nxt[i]
    return misses / len(trace)


def precision(trace: list[dict], budget: int) -> float:
    good = total = 0
    for step in trace:
        for layer, cands in enumerate(step["candidates"]):
            routed = set(step["routed"][layer + 1])
            good += len(set(cands[:budget]) & routed)
            total += budget
    return good / total if total else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--num-experts", type=int, required=True)
    ap.add_argument("--slots", default="16,32,64")
    ap.add_argument("--budget", type=int, default=4)
    args = ap.parse_args()
    trace = load(args.trace)
    print(f"{len(trace)} tokens, lookahead precision (first {args.budget} of the candidates): "
          f"{precision(trace, args.budget):.3f}")
    for S in (int(s) for s in args.slots.split(",")):
        row = {p: replay(trace, args.num_experts, S, p) for p in ("lru", "rule")}
        row["belady"] = belady(trace, args.num_experts, S)
        print(f"slots {S}: misses/token " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
