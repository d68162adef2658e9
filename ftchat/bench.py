"""`ftchat bench`: decode throughput of arms run side by side in one process, interleaved ABAB.

Each arm (e.g. `off`, `on`, `on:budget=4`, `resident`, `off:eviction=lru`, `off:graph=0`) gets its
own expert backend and decode state over the same loaded weights; every round runs every arm once.
Decoding starts at the context length over a zero KV cache (no prefill): the figures are the step
cost at that context, not model quality.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ftchat.engine import Decoder, build_experts, resident_backend
from ftchat.errors import FtchatError
from ftchat.settings import Settings

KEYS = {"budget": ("budget_gdn", "budget_attn"), "budget_gdn": ("budget_gdn",),
        "budget_attn": ("budget_attn",), "eviction": ("eviction",), "overlap": ("overlap",),
        "graph": ("graph",), "candidates": ("candidates",)}


def parse_arm(spec: str, base: Settings) -> Settings | None:
    """`on:budget=4,eviction=lru` -> Settings; `resident` -> None (every expert in VRAM)."""
    head, _, rest = spec.partition(":")
    if head == "resident":
        return None
    if head not in ("off", "measure", "on"):
        raise FtchatError(f"bench arm {spec!r}: expected resident, off, measure or on[:k=v,...]")
    kw: dict = {"prefetch": head}
    for item in filter(None, rest.replace(";", ",").split(",")):
        k, _, v = item.partition("=")
        if k not in KEYS or not v:
            raise FtchatError(f"bench arm {spec!r}: unknown setting {k!r}")
        val = v if k == "eviction" else bool(int(v)) if k in ("overlap", "graph") else int(v)
        kw.update({field: val for field in KEYS[k]})
    return dataclasses.replace(base, **kw)


def make_arm(m, spec: str, base: Settings, max_len: int):
    s = parse_arm(spec, base)
    ex = resident_backend(m) if s is None else build_experts(m, s)
    graph = (base if s is None else s).use_graph()
    before = torch.cuda.memory_allocated() if m.device.type == "cuda" else 0
    dec = Decoder(m, ex, 1, max_len, graph=graph)
    mem = (torch.cuda.memory_allocated() if m.device.type == "cuda" else 0) - before
    return {"dec": dec, "ex": ex, "mem": mem,
            "times": [], "misses": 0, "installs": 0, "useful": 0, "tokens": 0}


def counters(ex) -> tuple[int, int, int]:
    if not hasattr(ex, "maps"):
        return 0, 0, 0
    st = ex.maps.stats
    return int(st.misses.sum()), int(st.prefetch_installs.sum()), int(st.prefetch_useful.sum())


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_round(arm, token: torch.Tensor, length: int, steps: int) -> tuple[torch.Tensor, int]:
    before = counters(arm["ex"])
    _sync(token.device)
    t = time.perf_counter()
    for _ in range(steps):
        logits = arm["dec"].step(token, [length])
        token = logits.argmax(-1)
        length += 1
    _sync(token.device)
    arm["times"].append(time.perf_counter() - t)
    after = counters(arm["ex"])
    arm["misses"] += after[0] - before[0]
    arm["installs"] += after[1] - before[1]
    arm["useful"] += after[2] - before[2]
    arm["tokens"] += steps
    return token, length


def bench_context(m, arms: list[str], ctx: int, base: Settings, steps: int, rounds: int) -> dict:
    """Interleaved arms at one context length; per arm tok/s, misses, prefetch figures."""
    max_len = ctx + (rounds + 1) * steps + 2
    built = {name: make_arm(m, name, base, max_len) for name in arms}
    state = {name: (torch.tensor([7], device=m.device), ctx) for name in arms}
    for name in arms:  # warm-up round (fills the caches), not timed
        state[name] = run_round(built[name], *state[name], steps)
        built[name].update(times=[], misses=0, installs=0, useful=0, tokens=0)
    for _ in range(rounds):  # ABAB: every round runs every arm once
        for name in arms:
            state[name] = run_round(built[name], *state[name], steps)
    L = m.args.num_hidden_layers
    out = {}
    for name, a in built.items():
        tps = a["tokens"] / sum(a["times"])
        out[name] = {"tok_s": tps, "round_tok_s": [steps / t for t in a["times"]],
                     "misses_per_token": a["misses"] / a["tokens"],
                     "prefetch_installs_per_token": a["installs"] / a["tokens"],
                     "useful_per_layer": a["useful"] / a["tokens"] / L,
                     "precision": a["useful"] / a["installs"] if a["installs"] else None,
                     "extra_vram_mib": a["mem"] / 2**20}
    base = out.get("off", {}).get("tok_s")
    for v in out.values():
        v["vs_off"] = v["tok_s"] / base if base else None
    del built
    if m.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_prefill(m, base: Settings, lengths: list[int]) -> dict:
    """Prefill tok/s with offloaded experts (staging area on CUDA)."""
    ex = build_experts(m, dataclasses.replace(base, prefetch="off"))
    out = {}
    for n in lengths:
        dec = Decoder(m, ex, 1, n + 2)
        ids = torch.randint(0, 1000, (n,))
        dec.prefill(0, ids[:256], 0)  # warm-up
        dec.reset()
        _sync(m.device)
        t = time.perf_counter()
        dec.prefill(0, ids, 0)
        _sync(m.device)
        out[n] = n / (time.perf_counter() - t)
        del dec
    return out
