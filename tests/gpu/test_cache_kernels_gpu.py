"""Fused slot-map kernels (ftchat/kernels/slot_cache.py, through offload/cache_kernels.py)
against the torch specification (offload/cache.py).

Two ways to run (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):  pytest -m gpu tests/gpu/test_cache_kernels_gpu.py
    on CPU, interpreter:   TRITON_INTERPRET=1 pytest -m gpu tests/gpu/test_cache_kernels_gpu.py
The interpreter needs numpy < 2.4: Triton 3.6's interpreter holds a reduced scalar as a
1-element array, which numpy 2.4 no longer converts to an int (the kernels' `range(picks)`).
The random runs drive torch maps (CPU) and kernel maps side by side and require identical maps,
counters and plans after every call. They take CACHE_KERNEL_STEPS steps each (default 400 on
CUDA; 10 under the interpreter, where one kernel call costs ~0.1 s), after a warm-up that fills
the cache with the reference and copies its state, so even short runs start from mixed bands.
Sinks (slot_of[N], id_of[S], key[S]) are unspecified and not compared.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from ftchat.kernels import HAS_TRITON
from ftchat.offload import cache
from ftchat.offload import cache_kernels as ck
from ftchat.offload.cache import SlotMaps, check_invariants
from ftchat.offload.policy import LOW_BASE, LRU, RES_BASE, RULE, band_of

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
STEPS = int(os.environ.get("CACHE_KERNEL_STEPS", "10" if INTERPRET else "400"))
NONE = torch.empty(0, dtype=torch.int32)  # protect nothing


@pytest.fixture(autouse=True)
def _triton():
    assert HAS_TRITON, "these tests need triton"
    assert INTERPRET or torch.cuda.is_available(), "no CUDA: set TRITON_INTERPRET=1 to run on CPU"


def R(score: int, h: int = 1) -> int:  # resident key, written out from the band layout
    return RES_BASE + (score << 8) + h


def LOW(clock: int, rank: int = 0) -> int:  # low-priority key
    return LOW_BASE + (clock << 16) + 0xFFFF - rank


def maps_state(m: SlotMaps) -> list[torch.Tensor]:
    """Every map and counter without the sinks, on the CPU."""
    n, s = m.num_ids, m.num_slots
    return [x.cpu() for x in (m.slot_of[:n], m.id_of[:s], m.key[:s], m.clock,
                              *vars(m.stats).values())]


def assert_same_maps(a: SlotMaps, b: SlotMaps, where) -> None:
    names = ["slot_of", "id_of", "key", "clock", *vars(a.stats)]
    for name, x, y in zip(names, maps_state(a), maps_state(b)):
        assert x.dtype == y.dtype and torch.equal(x, y), (where, name, x.tolist(), y.tolist())


def assert_same_plan(p, q, where) -> None:
    for name, x in vars(p).items():
        y = getattr(q, name).cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, (where, name, x.dtype, y.dtype)
        assert torch.equal(x, y), (where, name, x.tolist(), y.tolist())


def copy_state(src: SlotMaps, dst: SlotMaps) -> None:
    """dst takes src's maps and counters, sinks included."""
    for name in ("slot_of", "id_of", "key", "clock"):
        getattr(dst, name).copy_(getattr(src, name))
    for a, b in zip(vars(src.stats).values(), vars(dst.stats).values()):
        b.copy_(a)


# ===== long random runs =====


@dataclass
class Coverage:
    """What the run exercised, read from the reference (it is the control, not under test)."""

    hits: int = 0
    misses: int = 0
    duplicates: int = 0
    promoted: int = 0
    cut: int = 0  # prefetch calls that installed fewer than they selected (no free slot)
    victim_bands: set = field(default_factory=set)  # bands of the keys ensure/prefetch evicted
    capped: bool = False  # a rule key reached its frequency cap
    limited: int = 0  # prefetch calls whose device limit was below the plan's size and supply


def draw_ids(rng: random.Random, bs: int, k: int, e: int) -> torch.Tensor:
    """[bs, k] rows of distinct local ids; a hot pool gives hits and cross-row duplicates."""
    hot = min(e, 2 * k + 2)
    rows = [rng.sample(range(hot if rng.random() < 0.7 else e), k) for _ in range(bs)]
    return torch.tensor(rows, dtype=torch.int64)


def draw_candidates(rng: random.Random, ids: torch.Tensor, e: int) -> torch.Tensor:
    """[C] candidates, best first: ids like a routing (so guesses come true), random ids and
    repeats, C in 1..16."""
    pool = ids.reshape(-1).tolist() + [rng.randrange(e) for _ in range(8)]
    return torch.tensor([rng.choice(pool) for _ in range(rng.randint(1, 16))])


def random_run(num_slots: int, bs: int, k: int, num_experts: int, policy, tile, seed: int,
               steps: int, warm: int | None = None, warps: int | None = None,
               limited: bool = False) -> Coverage:
    """Decode-like: layers in order with random jumps, ensure(L) then prefetch_ensure(L + 1).
    limited: every prefetch plan is sized for the largest budget and the drawn budget is the
    per-layer device limit (the adaptive budget's path), in both implementations."""
    layers = 4
    rng = random.Random(seed)
    ref = SlotMaps.create(layers, num_experts, num_slots, "cpu")
    dev = SlotMaps.create(layers, num_experts, num_slots, DEVICE)
    ensure_k = functools.partial(ck.ensure_triton, tile=tile, num_warps=warps)
    prefetch_k = functools.partial(ck.prefetch_ensure_triton, tile=tile, num_warps=warps)
    cov = Coverage()
    protect = NONE
    warm = num_slots // 2 + 60 if warm is None else warm  # long enough to fill the cache
    layer = 0
    for step in range(warm + steps):
        twin = step >= warm
        if step == warm:
            copy_state(ref, dev)
            assert_same_maps(ref, dev, "warm")
        jump = rng.random()  # mostly the next layer; a repeat gives hits even in a tiny cache
        layer = (layer + 1) % layers if jump < 0.7 else layer if jump < 0.85 else \
            rng.randrange(layers)
        ids = draw_ids(rng, bs, k, num_experts)
        before_hits = int(ref.stats.hits.sum())
        before_useful = int(ref.stats.prefetch_useful.sum())
        snapshot = ref.key.clone()
        p = cache.ensure(ref, layer, ids, policy)
        if twin:
            q = ensure_k(dev, layer, ids.to(DEVICE), policy)
            assert_same_plan(p, q, (step, "ensure"))
            assert_same_maps(ref, dev, (step, "ensure"))
            cov.misses += int(p.count)
            cov.hits += int(ref.stats.hits.sum()) - before_hits
            cov.duplicates += ids.numel() - len(set(ids.reshape(-1).tolist()))
            cov.promoted += int(ref.stats.prefetch_useful.sum()) - before_useful
            cov.victim_bands |= set(band_of(snapshot[p.dst[: int(p.count)].long()]).tolist())
        protect = p.slots
        for _ in range(rng.choice([0, 1, 1, 1, 2])):  # sometimes none, sometimes two in a row
            nxt = (layer + 1) % layers if rng.random() < 0.8 else rng.randrange(layers)
            cands = draw_candidates(rng, draw_ids(rng, bs, k, num_experts), num_experts)
            budget = rng.randint(0, min(6, num_slots))
            lim = {}
            if limited:  # plan size 6 (or S); the drawn budget becomes layer nxt's limit
                lim = {"limit": torch.full((layers,), budget, dtype=torch.int32)}
                budget = min(6, num_slots)
            prot = protect if rng.random() < 0.8 else torch.tensor(
                rng.sample(range(num_slots), rng.randint(0, min(num_slots, 8))), dtype=torch.int32)
            snapshot = ref.key.clone()
            distinct_new = len({c for c in cands.tolist()
                                if ref.slot_of[nxt * num_experts + c] < 0})
            pp = cache.prefetch_ensure(ref, nxt, cands, budget, prot, **lim)
            if twin:
                qq = prefetch_k(dev, nxt, cands.to(DEVICE), budget, prot.to(DEVICE),
                                **{n: t.to(DEVICE) for n, t in lim.items()})
                assert_same_plan(pp, qq, (step, "prefetch"))
                assert_same_maps(ref, dev, (step, "prefetch"))
                cov.cut += int(pp.count) < min(int(lim.get("limit", [budget])[0]), budget,
                                               distinct_new)
                cov.limited += bool(lim) and int(lim["limit"][0]) < min(budget, distinct_new)
                cov.victim_bands |= set(band_of(snapshot[pp.dst[: int(pp.count)].long()]).tolist())
        if twin and policy.freq_cap > 1:
            resident = band_of(ref.key[:-1]) == 2
            cov.capped |= bool((resident & ((ref.key[:-1] & 0xFF) == policy.freq_cap)).any())
    if steps:
        assert check_invariants(dev) == []
    return cov


# (num_slots, bs, k, num_experts, policy, tile): tile forces several register tiles
CASES = [
    (8, 1, 4, 32, LRU, None), (8, 2, 4, 32, RULE, None), (8, 1, 4, 32, RULE, None),
    (8, 2, 4, 32, LRU, None),
    (37, 1, 4, 32, RULE, None), (37, 2, 10, 32, LRU, None), (37, 1, 10, 32, LRU, None),
    (37, 2, 10, 32, RULE, None),
    (300, 1, 10, 128, LRU, None), (300, 2, 10, 128, RULE, None), (300, 1, 10, 128, RULE, None),
    (300, 2, 10, 128, LRU, None),
    (37, 1, 4, 32, RULE, 16),  # 3 tiles, the last partial
    (300, 2, 10, 128, LRU, 64), (300, 1, 10, 128, RULE, 64),  # 5 tiles, the cache fills
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}-bs{c[1]}-k{c[2]}-E{c[3]}-"
                         f"{c[4].name}-tile{c[5]}")
def test_random_runs_leave_identical_maps_and_plans(case):
    S, bs, k, E, policy, tile = case
    cov = random_run(S, bs, k, E, policy, tile, seed=CASES.index(case), steps=STEPS)
    # the run did what it is meant to check (every case fills its cache: S < layers * E)
    assert cov.misses > 0 and cov.hits > 0
    assert cov.victim_bands >= {1, 2}  # warm and full: low-priority and resident slots go
    if bs == 2:
        assert cov.duplicates > 0
        if S == 8:  # B * K = S: a protected plan can leave no slot to prefetch into
            assert cov.cut > 0
    if STEPS >= 100:  # rarer events need a longer run
        assert cov.promoted > 0
        if policy.freq_cap > 1 and S >= 300:  # smaller caches evict before 16 uses
            assert cov.capped


@pytest.mark.parametrize("case", CASES[:4] + CASES[8:10] + CASES[12:13],
                         ids=lambda c: f"S{c[0]}-bs{c[1]}-k{c[2]}-E{c[3]}-{c[4].name}-tile{c[5]}")
def test_random_runs_with_a_device_limit_leave_identical_maps_and_plans(case):
    S, bs, k, E, policy, tile = case
    cov = random_run(S, bs, k, E, policy, tile, seed=CASES.index(case), steps=STEPS,
                     limited=True)
    assert cov.misses > 0 and cov.hits > 0
    assert cov.limited > 0  # the limit, not the plan's size, stopped some plans


def test_random_runs_from_a_cold_cache():
    # no warm-up: the first calls see an empty cache (every victim empty, ties by index)
    for case in ((8, 2, 4, 32, RULE, None), (37, 1, 10, 32, LRU, 16), (300, 2, 10, 32, LRU, None)):
        S, bs, k, E, policy, tile = case
        cov = random_run(S, bs, k, E, policy, tile, seed=3, steps=max(STEPS // 2, 5), warm=0)
        assert 0 in cov.victim_bands and cov.misses > 0


# ===== hand cases: both implementations, the expected values written out =====

IMPLS = ["torch", "triton", "triton-tiled"]


def ops(impl: str):
    if impl == "torch":
        return cache.ensure, cache.prefetch_ensure, "cpu"
    tile = 2 if impl == "triton-tiled" else None
    return (functools.partial(ck.ensure_triton, tile=tile),
            functools.partial(ck.prefetch_ensure_triton, tile=tile), DEVICE)


def build(layers: int, experts: int, slots: int, held: dict[int, tuple[int, int]], clock: int,
          device) -> SlotMaps:
    """Maps with held[slot] = (global id, key); other slots empty."""
    m = SlotMaps.create(layers, experts, slots, device)
    for sl, (gid, key) in held.items():
        m.slot_of[gid], m.id_of[sl], m.key[sl] = sl, gid, key
    m.clock.fill_(clock)
    assert check_invariants(m) == []
    return m


def lists(p) -> tuple:
    return tuple(x.tolist() for x in vars(p).values())


@pytest.mark.parametrize("impl", IMPLS)
def test_victims_go_empty_then_low_older_first_then_resident_ties_by_index(impl):
    ensure, _, device = ops(impl)
    held = {0: (0, R(5)), 2: (2, LOW(3, 0)), 3: (3, R(5)), 4: (4, LOW(3, 1)), 6: (6, LOW(2, 0)),
            7: (7, R(4))}
    m = build(1, 16, 8, held, 5, device)
    p = ensure(m, 0, torch.tensor([[8, 9, 10, 11, 12, 13, 14]], device=device), LRU)
    order = [1, 5, 6, 4, 2, 7, 0]  # empty by index; low by clock, then rank; resident; tie 0 < 3
    assert lists(p) == ([order], [8, 9, 10, 11, 12, 13, 14], order, [7])
    assert m.id_of[:8].tolist() == [14, 8, 12, 3, 11, 9, 10, 13]
    assert m.key[:8].tolist() == [R(6)] * 3 + [R(5)] + [R(6)] * 4
    assert m.slot_of[:16].tolist() == [-1, -1, -1, 3, -1, -1, -1, -1, 1, 5, 6, 4, 2, 7, 0, -1]
    assert m.stats.misses.tolist() == [7] and m.stats.hits.tolist() == [0]


@pytest.mark.parametrize("impl", IMPLS)
def test_duplicates_share_one_stamp_and_a_low_hit_is_promoted(impl):
    ensure, _, device = ops(impl)
    m = build(1, 8, 8, {0: (1, R(3, 2)), 1: (2, LOW(3))}, 3, device)
    # rule, S = 8, M = 4, L = 1: W = min(1, 8 // 4 - 1) = 1 tick per extra use
    p = ensure(m, 0, torch.tensor([[1, 2], [2, 5]], device=device), RULE)
    assert lists(p) == ([[0, 1], [1, 2]], [5, 8, 8, 8], [2, 8, 8, 8], [1])
    assert m.key[:3].tolist() == [R(4 + 2, 3), R(4), R(4)]  # id 1: h 2 -> 3; id 2: promoted
    assert [m.stats.hits.tolist(), m.stats.misses.tolist(), m.stats.prefetch_useful.tolist()] \
        == [[2], [1], [1]]
    p = ensure(m, 0, torch.tensor([[5, 5], [5, 1]], device=device), RULE)
    assert lists(p) == ([[2, 2], [2, 0]], [8] * 4, [8] * 4, [0])
    assert m.key[:3].tolist() == [R(5 + 3, 4), R(4), R(5 + 1, 2)]
    assert m.stats.hits.tolist() == [4] and m.clock.tolist() == [5]


@pytest.mark.parametrize("impl", IMPLS)
def test_prefetch_skips_protected_and_resident_slots_and_stops_when_none_is_left(impl):
    _, prefetch, device = ops(impl)
    t = functools.partial(torch.tensor, device=device)
    # layer 1 ids are 8..15; slot 0 holds id 9 (a candidate below), slots 1..3 ids 0..2
    held = {0: (9, R(1)), 1: (0, R(2)), 2: (1, R(3)), 3: (2, R(2)), }
    m = build(2, 8, 6, held, 3, device)
    pf = prefetch(m, 1, t([1, 5, 5, 6, 7]), 3, t([[1, 2]], dtype=torch.int32))
    # candidates 13, 14, 15 selected; victims: empty 4, 5, then slot 3 (lowest unprotected;
    # slot 0 has the lowest key but holds the resident candidate 9)
    assert lists(pf) == ([13, 14, 15], [4, 5, 3], [3])
    assert m.key[:6].tolist() == [R(1), R(2), R(3), LOW(3, 2), LOW(3, 0), LOW(3, 1)]
    assert m.slot_of[:16].tolist() == [1, 2, -1, -1, -1, -1, -1, -1,
                                       -1, 0, -1, -1, -1, 4, 5, 3]
    assert m.stats.prefetch_installs.tolist() == [0, 3]
    # everything but slot 4 blocked: one install of three, the rest of the plan at the sinks
    pf = prefetch(m, 1, t([0, 2, 3, 4]), 3, t([0, 1, 2, 3, 5], dtype=torch.int32))
    assert lists(pf) == ([8, 16, 16], [4, 6, 6], [1])
    assert m.id_of[:6].tolist() == [9, 0, 1, 15, 8, 14] and m.slot_of[13] == -1
    before = [x.clone() for x in maps_state(m)]
    for args in ((t([1, 0]), 2, NONE.to(device)), (t([3, 3]), 0, NONE.to(device))):
        pf = prefetch(m, 1, *args)  # all resident / budget 0: nothing to do
        assert pf.count.tolist() == [0] and pf.src.tolist() == [16] * args[1]
    assert all(torch.equal(x, y) for x, y in zip(before, maps_state(m)))


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_stay_exact_at_a_large_clock(impl):
    ensure, prefetch, device = ops(impl)
    m = SlotMaps.create(2, 4, 4, device)
    m.clock.fill_(2**40 - 100)
    p = ensure(m, 0, torch.tensor([[0, 3]], device=device), RULE)
    prefetch(m, 1, torch.tensor([2], device=device), 1, p.slots)
    assert m.key[:3].tolist() == [R(2**40 - 99), R(2**40 - 99), LOW(2**40 - 99)]
    p = ensure(m, 0, torch.tensor([[0, 1]], device=device), RULE)  # W = min(2, 4 // 2 - 2) = 0
    assert m.key[:4].tolist() == [R(2**40 - 98, 2), R(2**40 - 99), LOW(2**40 - 99),
                                  R(2**40 - 98)]


def test_tiles_do_not_change_tie_breaks_across_tile_edges():
    # equal keys in every tile: the lowest slot index still wins, whatever the tiling
    for tile in (None, 2, 4, 8):
        m = build(1, 64, 13, {s: (s, R(7)) for s in range(13)}, 9, DEVICE)
        p = ck.ensure_triton(m, 0, torch.tensor([[40, 41, 42]], device=DEVICE), LRU, tile=tile)
        assert p.dst.tolist() == [0, 1, 2], tile
        m.key[:13] = R(8)
        m.key[:4] = R(9)
        m.key[5] = m.key[11] = R(3)
        pf = ck.prefetch_ensure_triton(m, 0, torch.tensor([50, 51, 52], device=DEVICE), 3,
                                       torch.tensor([5], device=DEVICE), tile=tile)
        assert pf.dst.tolist() == [11, 4, 6], tile  # slot 5 protected; then the R(8) tie from 4


# ===== the announced writes and the argument checks =====


def test_kernels_announce_the_maps_they_write_before_launching():
    for op in ("ensure", "prefetch"):
        seen = {}
        for impl in ("torch", "triton"):
            ensure, prefetch, device = ops(impl)
            m = SlotMaps.create(2, 8, 6, device)
            ensure(m, 0, torch.tensor([[1, 2]], device=device), RULE)
            calls: list[str] = []
            m.on_write = calls.append
            if op == "ensure":
                ensure(m, 1, torch.tensor([[3, 4]], device=device), RULE)
            else:
                prefetch(m, 1, torch.tensor([3, 4], device=device), 2, NONE.to(device))
            seen[impl] = set(calls)
        assert seen["triton"] == seen["torch"] and seen["torch"], op

        def refuse(name: str) -> None:
            raise RuntimeError(name)

        for callback, should_change in ((refuse, False), (lambda name: None, True)):
            m = SlotMaps.create(2, 8, 6, DEVICE)
            ck.ensure_triton(m, 0, torch.tensor([[1, 2]], device=DEVICE), LRU)
            before = [x.clone() for x in maps_state(m)]
            m.on_write = callback
            try:
                if op == "ensure":
                    ck.ensure_triton(m, 1, torch.tensor([[3, 4]], device=DEVICE), RULE)
                else:
                    ck.prefetch_ensure_triton(m, 1, torch.tensor([3, 4], device=DEVICE), 2,
                                              NONE.to(DEVICE))
            except RuntimeError:
                assert not should_change
            changed = not all(torch.equal(x, y) for x, y in zip(before, maps_state(m)))
            assert changed == should_change, (op, should_change)  # the second is the control


def test_too_few_slots_or_a_bad_budget_raise_before_any_write():
    m = SlotMaps.create(1, 8, 3, DEVICE)
    calls: list[str] = []
    m.on_write = calls.append
    with pytest.raises(ValueError):
        ck.ensure_triton(m, 0, torch.tensor([[0, 1], [2, 3]], device=DEVICE), LRU)
    for budget in (-1, 4):
        with pytest.raises(ValueError):
            ck.prefetch_ensure_triton(m, 0, torch.tensor([0, 1], device=DEVICE), budget,
                                      NONE.to(DEVICE))
    assert calls == [] and m.clock.tolist() == [0]
    ck.prefetch_ensure_triton(m, 0, torch.tensor([0, 1], device=DEVICE), 3, NONE.to(DEVICE))
    assert calls and m.stats.prefetch_installs.tolist() == [2]  # control: a valid call writes
