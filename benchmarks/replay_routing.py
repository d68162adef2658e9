"""Offload counts without a GPU: a routing source replayed through ftchat's cache code.

For each eviction policy and prefetch arm: demand misses, prefetch installs and rows over the
link per token, precision (useful / selected, measure mode's definition), useful predictions
per predicted layer, the Belady floor, and the tok/s the link model (ftchat/routing/link.py)
gives on a PCIe-5 and a PCIe-4 link beside its overlap bound. Arms: off, default (3 before a
GDN layer, 4 before attention: the seed's budget), budget 1/2/4, auto (as `--budget auto`:
of floor(r) and floor(r) + 1, r the rows the link carries under one layer's compute, the one
the link model puts faster by at least the trial's margin; the GPU times them instead).

    python benchmarks/replay_routing.py --source calibrated:default --steps 600
    python benchmarks/replay_routing.py --source trace:trace.jsonl --num-experts 64 --slots 96
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

from ftchat.offload.budget import AUTO_CAP, TRIAL_MARGIN
from ftchat.routing.calibrated import FITS, SEED_GEOMETRY, generate
from ftchat.routing.link import PCIE4_GBPS, PCIE5_GBPS, LinkModel
from ftchat.routing.replay import ReplayConfig, belady, replay
from ftchat.routing.trace import read_trace

ROW_BYTES = 2_780_160  # one NVFP4 expert row of flash-next


def budgets(arm: str, num_layers: int, auto: int) -> tuple[str, tuple[int, ...]]:
    """An arm's prefetch mode and budget a layer (`auto`: the budget auto settled on)."""
    if arm == "off":
        return "off", tuple(4 if (i % 4 == 3) else 3 for i in range(num_layers))
    if arm == "default":
        return "on", tuple(4 if (i % 4 == 3) else 3 for i in range(num_layers))
    if arm == "auto":
        return "on", (auto,) * num_layers
    return "on", (int(arm.removeprefix("budget")),) * num_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="calibrated:default",
                    help="calibrated:FIT (" + ", ".join(FITS) + ") or trace:FILE")
    ap.add_argument("--steps", type=int, default=600, help="calibrated steps (with the warm-up)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-experts", type=int, default=SEED_GEOMETRY.num_experts)
    ap.add_argument("--slots", type=int, default=1650)
    ap.add_argument("--evictions", default="rule,lru,score")
    ap.add_argument("--arms", default="off,default,budget1,budget2,budget4,auto")
    ap.add_argument("--compute-ms", type=float, default=5.0,
                    help="the resident decode step, ms per token (the link model's compute)")
    ap.add_argument("--row-bytes", type=int, default=ROW_BYTES)
    ap.add_argument("--link-gbps", type=float,
                    help="a measured link, modelled beside the PCIe-5 and PCIe-4 ones")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    kind, _, what = args.source.partition(":")
    if kind == "calibrated":
        steps = list(itertools.islice(generate(SEED_GEOMETRY, FITS[what or "default"],
                                               args.seed), args.steps))
    elif kind == "trace":
        steps = read_trace(what)
    else:
        sys.exit(f"--source {args.source!r}: expected calibrated:FIT or trace:FILE")
    L = steps[0].routed.shape[0]
    links = {"pcie5": LinkModel(args.compute_ms / 1e3, PCIE5_GBPS, args.row_bytes),
             "pcie4": LinkModel(args.compute_ms / 1e3, PCIE4_GBPS, args.row_bytes)}
    if args.link_gbps:
        links["link"] = LinkModel(args.compute_ms / 1e3, args.link_gbps, args.row_bytes)
    floor = belady(steps, args.num_experts, args.slots, args.warmup)
    out = {"source": args.source, "seed": args.seed, "steps": len(steps), "warmup": args.warmup,
           "slots": args.slots, "compute_ms": args.compute_ms, "belady": floor,
           "auto_bracket": {k: v.bracket(L, AUTO_CAP) for k, v in links.items()},
           "auto_budget": {}, "rows": []}
    print(f"{args.source}: {len(steps) - args.warmup} tokens counted, {args.slots} slots, "
          f"Belady floor {floor:.1f} misses/token", flush=True)
    done = {}  # (eviction, arm's budgets) -> counts: auto's trials reuse the fixed arms' replays

    def counts(ev, arm, b):
        prefetch, bud = budgets(arm, L, b)
        if (ev, prefetch, bud) not in done:
            done[ev, prefetch, bud] = replay(steps, args.num_experts,
                                             ReplayConfig(args.slots, ev, prefetch, bud),
                                             args.warmup)
        return prefetch, bud, done[ev, prefetch, bud]

    def auto_budget(ev, link):
        """The trial on the link model: the faster of the bracket, the larger by the margin."""
        lo, hi = link.bracket(L, AUTO_CAP)
        t = {}
        for b in (lo, hi):
            c = counts(ev, "auto", b)[2]
            t[b] = link.token_seconds(c.per_layer_misses, c.per_layer_installs)
        return hi if t[hi] < t[lo] * (1 - TRIAL_MARGIN) else lo

    for ev in args.evictions.split(","):
        if ev == "score" and steps[0].logits is None:
            continue  # a trace recorded before --record-routing wrote logits
        for arm in args.arms.split(","):
            for link_name, link in links.items():
                if arm != "auto" and link_name != "pcie5":
                    continue  # the same counts: one replay serves both links
                b = auto_budget(ev, link) if arm == "auto" else 0
                if arm == "auto":
                    out["auto_budget"].setdefault(ev, {})[link_name] = b
                t0 = time.perf_counter()
                prefetch, bud, c = counts(ev, arm, b)
                row = {"eviction": ev, "arm": arm if arm != "auto" else f"auto({link_name})",
                       "budget": bud[3] if prefetch == "on" else 0,
                       "misses": c.misses, "installs": c.installs, "rows": c.rows,
                       "precision": c.precision, "useful_per_layer": c.useful_per_layer(L)}
                for name, lk in links.items():
                    if arm == "auto" and name != link_name:
                        continue
                    row[f"tok_s_{name}"] = 1 / lk.token_seconds(c.per_layer_misses,
                                                                c.per_layer_installs)
                    row[f"bound_tok_s_{name}"] = 1 / lk.bound_seconds(c.rows)
                out["rows"].append(row)
                print(f"{ev:5} {row['arm']:12} misses {c.misses:6.1f}  installs {c.installs:6.1f}"
                      f"  rows {c.rows:6.1f}  precision {c.precision:.3f}  useful/layer "
                      f"{row['useful_per_layer']:.2f}  " + "  ".join(
                          f"{k[6:]} {v:.1f}" for k, v in row.items() if k.startswith("tok_s_"))
                      + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
