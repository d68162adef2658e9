"""Slot maps: hand-built scenarios, an independent pure-Python model, instrumentation, policies."""

from __future__ import annotations

import random

import pytest
import torch

from ftchat.offload.cache import (
    SlotMaps,
    check_invariants,
    ensure,
    prefetch_ensure,
    prefetch_measure,
)
from ftchat.offload.policy import LOW_BASE, LRU, RES_BASE, RULE, EvictionPolicy, band_of

NONE = torch.empty(0, dtype=torch.int32)  # protect nothing


def R(score: int, h: int = 1) -> int:  # resident key, written out from the band layout
    return RES_BASE + (score << 8) + h


def LOW(clock: int, rank: int = 0) -> int:  # low-priority key
    return LOW_BASE + (clock << 16) + 0xFFFF - rank


def t(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def state(m: SlotMaps) -> tuple[list[int], list[int], list[int]]:
    return m.slot_of[: m.num_ids].tolist(), m.id_of[: m.num_slots].tolist(), m.key[:-1].tolist()


def plan_lists(p) -> tuple:
    return p.src.tolist(), p.dst.tolist(), p.count.tolist()


# ---------------------------------------------------------------- hand-built scenarios


def test_misses_fill_empty_slots_then_hits_copy_nothing():
    m = SlotMaps.create(2, 4, 4)  # N = 8
    p = ensure(m, 0, t([[1, 2]]), LRU)
    assert p.slots.tolist() == [[0, 1]] and p.slots.dtype == torch.int32
    assert plan_lists(p) == ([1, 2], [0, 1], [2])
    assert state(m) == ([-1, 0, 1, -1, -1, -1, -1, -1], [1, 2, -1, -1], [R(1), R(1), 0, 0])
    assert m.clock.tolist() == [1]
    p = ensure(m, 1, t([[2, 1]]), LRU)  # global ids 6, 5
    assert p.slots.tolist() == [[2, 3]] and plan_lists(p) == ([6, 5], [2, 3], [2])
    p = ensure(m, 0, t([[2, 1]]), LRU)
    assert p.slots.tolist() == [[1, 0]] and plan_lists(p) == ([8, 8], [4, 4], [0])
    assert state(m)[2] == [R(3), R(3), R(2), R(2)] and m.clock.tolist() == [3]
    assert m.stats.hits.tolist() == [2, 0] and m.stats.misses.tolist() == [2, 2]
    assert check_invariants(m) == []


def test_lru_evicts_least_recently_used():
    m = SlotMaps.create(1, 8, 3)
    for e in (0, 1, 2, 0):
        ensure(m, 0, t([[e]]), LRU)  # id 0 used at clocks 1 and 4
    p = ensure(m, 0, t([[3]]), LRU)
    assert plan_lists(p) == ([3], [1], [1]) and state(m)[1] == [0, 3, 2]
    ensure(m, 0, t([[4]]), LRU)
    assert state(m)[1] == [0, 3, 4]
    ensure(m, 0, t([[5]]), LRU)
    assert state(m)[:2] == ([-1, -1, -1, 1, 2, 0, -1, -1], [5, 3, 4])


def test_equal_keys_break_ties_by_slot_index():
    m = SlotMaps.create(1, 8, 4)
    p = ensure(m, 0, t([[3, 2, 1, 0]]), LRU)
    assert p.slots.tolist() == [[0, 1, 2, 3]] and plan_lists(p) == ([3, 2, 1, 0], [0, 1, 2, 3], [4])
    p = ensure(m, 0, t([[5, 4]]), LRU)  # all four keys are equal
    assert plan_lists(p) == ([5, 4], [0, 1], [2])
    assert state(m)[:2] == ([3, 2, -1, -1, 1, 0, -1, -1], [5, 4, 1, 0])


def test_duplicates_at_bs2_share_one_slot_and_one_copy():
    m = SlotMaps.create(1, 8, 4)
    p = ensure(m, 0, t([[1, 2], [2, 3]]), LRU)
    assert p.slots.tolist() == [[0, 1], [1, 2]]
    assert plan_lists(p) == ([1, 2, 3, 8], [0, 1, 2, 4], [3])
    p = ensure(m, 0, t([[3, 3], [3, 3]]), LRU)
    assert p.slots.tolist() == [[2, 2], [2, 2]] and p.count.tolist() == [0]
    p = ensure(m, 0, t([[4, 1], [1, 4]]), LRU)
    assert p.slots.tolist() == [[3, 0], [0, 3]]
    assert plan_lists(p) == ([4, 8, 8, 8], [3, 4, 4, 4], [1])
    assert m.stats.hits.tolist() == [2] and m.stats.misses.tolist() == [4]


def test_slots_of_the_current_call_are_never_victims():
    m = SlotMaps.create(1, 8, 4)
    ensure(m, 0, t([[0, 1, 2]]), LRU)
    m.key[1:3] = R(50, 16)  # a state rule can reach: frequent experts with a large bonus
    p = ensure(m, 0, t([[0, 5, 6]]), LRU)
    # id 0's fresh stamp was the lowest held key, yet only slots 3 (empty) and 1 are taken.
    assert int(m.key[0]) == R(2) < R(50, 16) == int(m.key[2])
    assert plan_lists(p) == ([5, 6, 8], [3, 1, 4], [2]) and state(m)[1] == [0, 6, 2, 5]


def test_rule_keeps_a_frequent_expert_that_lru_evicts():
    cases = ((LRU, [4, 1, 2, 3], [4, 5, 2, 3]), (RULE, [0, 4, 2, 3], [0, 4, 5, 3]))
    for policy, after_4, after_5 in cases:
        m = SlotMaps.create(1, 8, 4)  # rule: W = min(L, S // M - L) = min(1, 3) = 1 tick
        for e in (0, 0, 0, 1, 2, 3):
            ensure(m, 0, t([[e]]), policy)
        ensure(m, 0, t([[4]]), policy)
        assert state(m)[1] == after_4, policy.name
        ensure(m, 0, t([[5]]), policy)
        assert state(m)[1] == after_5, policy.name
    # rule keys: id 0 score 3 + 2 (h = 3), ids 3, 4, 5 single uses at clocks 6, 7, 8
    assert state(m)[2] == [R(5, 3), R(7), R(8), R(6)]


def test_bands_empty_then_low_then_resident_and_promotion():
    m = SlotMaps.create(2, 4, 4)  # layer 1's ids are 4..7
    p = ensure(m, 0, t([[0]]), LRU)
    pf = prefetch_ensure(m, 1, t([1]), 1, p.slots)
    assert plan_lists(pf) == ([5], [1], [1]) and m.key[1] == LOW(1)
    ensure(m, 0, t([[2]]), LRU)
    ensure(m, 0, t([[3]]), LRU)
    assert state(m)[1] == [0, 5, 2, 3]  # empty slots went before the low-priority one
    ensure(m, 0, t([[1]]), LRU)
    assert state(m)[1] == [0, 1, 2, 3]  # low-priority before the older resident in slot 0
    prefetch_ensure(m, 1, t([0]), 1, t([[1]]))  # clock 4: id 4 replaces id 0
    p = ensure(m, 0, t([[3]]), LRU)
    # id 4 is a resident candidate: kept, key unchanged, although it has the lowest key.
    pf = prefetch_ensure(m, 1, t([0, 2]), 1, p.slots)
    assert plan_lists(pf) == ([6], [2], [1])
    assert state(m) == (
        [-1, 1, -1, 3, 0, -1, 2, -1],
        [4, 1, 6, 3],
        [LOW(4), R(4), LOW(5), R(5)],
    )
    ensure(m, 0, t([[0]]), LRU)  # the older install (clock 4) goes first
    assert state(m)[1] == [0, 1, 6, 3]
    p = ensure(m, 1, t([[2]]), LRU)  # demand hit on the prefetched id 6: promoted
    assert p.count.tolist() == [0] and m.key[2] == R(7)
    assert m.stats.prefetch_useful.tolist() == [0, 1]
    ensure(m, 0, t([[2]]), LRU)  # now the oldest resident (slot 1, clock 4) goes
    assert state(m)[1] == [0, 2, 6, 3] and check_invariants(m) == []


def test_one_prefetch_call_evicts_its_lower_priority_install_first():
    m = SlotMaps.create(1, 8, 4)
    pf = prefetch_ensure(m, 0, t([3, 1]), 2, NONE)
    assert plan_lists(pf) == ([3, 1], [0, 1], [2]) and state(m)[2][:2] == [LOW(0), LOW(0, 1)]
    ensure(m, 0, t([[2]]), LRU)
    ensure(m, 0, t([[0]]), LRU)
    ensure(m, 0, t([[5]]), LRU)
    assert state(m)[1] == [3, 5, 2, 0]


def test_prefetch_skips_protected_and_resident_and_respects_budget():
    m = SlotMaps.create(2, 8, 5)  # N = 16, layer 1's ids are 8..15
    ensure(m, 1, t([[0]]), LRU)  # id 8 -> slot 0, key R(1)
    ensure(m, 0, t([[0, 1, 2, 3]]), LRU)  # slots 1..4, key R(2)
    p = ensure(m, 0, t([[2, 3]]), LRU)
    assert p.slots.tolist() == [[3, 4]]
    pf = prefetch_ensure(m, 1, t([0, 5, 5, 6, 7, 1]), 2, p.slots)
    assert plan_lists(pf) == ([13, 14], [1, 2], [2])
    slot_of, id_of, key = state(m)
    assert id_of == [8, 13, 14, 2, 3] and key == [R(1), LOW(3), LOW(3, 1), R(3), R(3)]
    assert m.stats.prefetch_installs.tolist() == [0, 2]
    # Only slots 1 and 2 may go; the third install does not happen.
    pf = prefetch_ensure(m, 1, t([7, 1, 4]), 3, t([[3, 4, 0]]))
    assert plan_lists(pf) == ([15, 9, 16], [2, 1, 5], [2])
    assert state(m)[1] == [8, 9, 15, 2, 3] and m.stats.prefetch_installs.tolist() == [0, 4]
    before = state(m)
    pf = prefetch_ensure(m, 1, t([2, 3]), 0, NONE)
    assert plan_lists(pf) == ([], [], [0]) and state(m) == before
    assert check_invariants(m) == []


def snapshot(m: SlotMaps) -> list[torch.Tensor]:
    s = m.stats
    return [x.clone() for x in (m.slot_of, m.id_of, m.key, m.clock, *vars(s).values())]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_measure_counts_and_writes_nothing():
    m = SlotMaps.create(2, 8, 4)
    ensure(m, 1, t([[0]]), LRU)  # id 8 resident
    before = snapshot(m)
    c = prefetch_measure(m, 1, t([0, 3, 3, 5, 6]), 2, t([[3, 0], [7, 3]]))
    # selected: ids 11 and 13; routed: 11 (useful); misses: 11 and 15 (8 is resident)
    assert (c.selected.tolist(), c.useful.tolist(), c.misses.tolist()) == ([2], [1], [2])
    assert same(snapshot(m), before)


def test_too_few_slots_or_too_large_budget_raise():
    m = SlotMaps.create(1, 8, 3)
    before = snapshot(m)
    with pytest.raises(ValueError):
        ensure(m, 0, t([[0, 1], [2, 3]]), LRU)
    with pytest.raises(ValueError):
        prefetch_ensure(m, 0, t([0, 1, 2, 3]), 4, NONE)
    assert same(snapshot(m), before)


# ---------------------------------------------------------------- single writer


def tensors(m: SlotMaps) -> dict[str, torch.Tensor]:
    named = {n: getattr(m, n) for n in ("slot_of", "id_of", "key", "clock")}
    named.update({f"stats.{n}": v for n, v in vars(m.stats).items()})
    return named


def test_every_write_goes_through_the_announced_helper():
    # Each in-place op bumps a tensor's version counter; each announced write is one such op.
    # So equal counts prove no write bypasses the helper.
    m = SlotMaps.create(2, 8, 6)
    calls: list[str] = []
    m.on_write = calls.append
    rng = random.Random(0)
    p = None  # the last ensure's placement (step 0 is an ensure)
    for step in range(40):
        before = {n: x._version for n, x in tensors(m).items()}
        calls.clear()
        if step % 3 == 2:
            prefetch_measure(m, step % 2, t([rng.randrange(8) for _ in range(4)]), 2, t([[1, 2]]))
        elif step % 3 == 1:
            prefetch_ensure(m, step % 2, t([rng.randrange(8) for _ in range(4)]), 2, p.slots)
        else:
            p = ensure(m, step % 2, t([rng.sample(range(8), 2), rng.sample(range(8), 2)]), RULE)
        bumps = {n: x._version - before[n] for n, x in tensors(m).items()}
        assert bumps == {n: calls.count(n) for n in bumps}
        assert (len(calls) > 0) == (step % 3 != 2)  # measure writes nothing


def test_a_raising_callback_runs_before_any_write():
    def refuse(name: str) -> None:
        raise RuntimeError(name)

    for op in ("ensure", "prefetch"):
        m = SlotMaps.create(2, 8, 6)
        ensure(m, 0, t([[1, 2]]), LRU)
        before, versions = snapshot(m), [x._version for x in tensors(m).values()]
        for callback, should_change in ((refuse, False), (lambda name: None, True)):
            m.on_write = callback
            try:
                if op == "ensure":
                    ensure(m, 1, t([[3, 4]]), RULE)
                else:
                    prefetch_ensure(m, 1, t([3, 4]), 2, NONE)
            except RuntimeError:
                assert not should_change
            changed = not same(snapshot(m), before)
            assert changed == should_change, (op, should_change)  # the second is the control
            if not should_change:
                assert [x._version for x in tensors(m).values()] == versions


# ---------------------------------------------------------------- key bands


def test_keys_stay_in_their_bands_after_2_to_the_31_steps():
    m = SlotMaps.create(2, 4, 4)
    m.clock.fill_(2**31 - 1)
    p = ensure(m, 0, t([[0]]), LRU)
    prefetch_ensure(m, 1, t([0]), 1, p.slots)
    assert state(m)[2][:2] == [RES_BASE + (2**31 << 8) + 1, LOW_BASE + (2**31 << 16) + 0xFFFF]
    m.clock.fill_(2**40 - 100)
    for _ in range(40):  # drive rule's count to its cap on id 0
        p = ensure(m, 0, t([[0]]), RULE)
        prefetch_ensure(m, 1, t([1, 2]), 2, p.slots)
    c = 2**40 - 60  # rule's W = min(L, S // M - L) = 2 ticks; ids 5, 6 stay where installed
    assert state(m)[2] == [R(c + 15 * 2, 16), LOW(2**31), LOW(c - 39), LOW(c - 39, 1)]
    assert band_of(m.key[:4]).tolist() == [2, 1, 1, 1] and check_invariants(m) == []
    assert LOW(2**40 - 1) < RES_BASE and 0 < LOW_BASE
    with pytest.raises(ValueError):
        EvictionPolicy("bad", freq_cap=256)


def test_invariant_checker_reports_broken_maps():
    m = SlotMaps.create(1, 8, 4)
    ensure(m, 0, t([[1, 2]]), LRU)
    assert check_invariants(m) == []  # control
    broken = [
        ("id_of", 1, 1),  # slot 1 claims id 1, held by slot 0 too
        ("slot_of", 3, 1),  # id 3 points at the slot holding id 2
        ("key", 0, 0),  # a held slot with an empty-band key
        ("key", 2, LOW(1)),  # an empty slot with a low-priority key
        ("key", 1, LOW(9)),  # installed after the current clock
        ("slot_of", 4, 4),  # points at the sink slot
    ]
    for name, index, value in broken:
        bad = SlotMaps.create(1, 8, 4)
        ensure(bad, 0, t([[1, 2]]), LRU)
        getattr(bad, name)[index] = value
        assert check_invariants(bad), (name, index, value)


# ---------------------------------------------------------------- independent model


class PyCache:
    """The cache written from its spec with dicts and lists, one id at a time.

    Keys are tuples (band, major, minor): empty (0, 0, 0), low priority (1, clock, -rank),
    resident (2, last use + (h - 1) * W, h). Victim = min (key, slot) over allowed slots.
    """

    def __init__(self, layers: int, experts: int, slots: int, cap: int):
        self.L, self.E, self.S, self.cap = layers, experts, slots, cap
        self.N = layers * experts
        self.where: dict[int, int] = {}  # global id -> slot
        self.held: list[int | None] = [None] * slots
        self.keys: list[tuple[int, int, int]] = [(0, 0, 0)] * slots
        self.clock = 0
        self.stats = {"hits": [0] * layers, "misses": [0] * layers, "useful": [0] * layers}
        self.stats["installs"] = [0] * layers

    def _take(self, slot: int, gid: int, key: tuple[int, int, int]) -> None:
        if self.held[slot] is not None:
            del self.where[self.held[slot]]
        self.held[slot], self.where[gid], self.keys[slot] = gid, slot, key

    def _victim(self, banned: set[int]) -> int | None:
        free = [(self.keys[s], s) for s in range(self.S) if s not in banned]
        return min(free)[1] if free else None

    def _used(self, key: tuple[int, int, int], w: int) -> tuple[int, int, int]:
        h = min(key[2] + 1 if key[0] == 2 else 1, self.cap)
        return (2, self.clock + (h - 1) * w, h)

    def ensure(self, layer: int, rows: list[list[int]]):
        self.clock += 1
        gids = [layer * self.E + e for row in rows for e in row]
        m = len(gids)
        w = 0 if self.cap == 1 else min(self.L, max(0, self.S // m - self.L))
        distinct = list(dict.fromkeys(gids))
        banned = {self.where[g] for g in distinct if g in self.where}
        for g in distinct:
            if g in self.where:
                s = self.where[g]
                self.stats["hits"][layer] += 1
                self.stats["useful"][layer] += self.keys[s][0] == 1
                self.keys[s] = self._used(self.keys[s], w)
        src, dst = [], []
        for g in distinct:
            if g not in self.where:
                s = self._victim(banned)
                self._take(s, g, self._used((0, 0, 0), w))
                banned.add(s)
                src.append(g)
                dst.append(s)
        self.stats["misses"][layer] += len(src)
        slots = [[self.where[layer * self.E + e] for e in row] for row in rows]
        pad = m - len(src)
        return slots, src + [self.N] * pad, dst + [self.S] * pad, len(src)

    def picks(self, layer: int, cands: list[int], budget: int) -> list[int]:
        out: list[int] = []
        for g in (layer * self.E + c for c in cands):
            if g not in self.where and g not in out and len(out) < budget:
                out.append(g)
        return out

    def prefetch(self, layer: int, cands: list[int], budget: int, protect: list[int]):
        gids = [layer * self.E + c for c in cands]
        banned = set(protect) | {self.where[g] for g in gids if g in self.where}
        src, dst = [], []
        for rank, g in enumerate(self.picks(layer, cands, budget)):
            s = self._victim(banned)
            if s is None:
                break
            self._take(s, g, (1, self.clock, -rank))
            banned.add(s)
            src.append(g)
            dst.append(s)
        self.stats["installs"][layer] += len(src)
        pad = budget - len(src)
        return src + [self.N] * pad, dst + [self.S] * pad, len(src)

    def measure(self, layer: int, cands: list[int], budget: int, rows: list[list[int]]):
        routed = [layer * self.E + e for row in rows for e in row]
        picks = self.picks(layer, cands, budget)
        misses = {g for g in routed if g not in self.where}
        return len(picks), sum(g in routed for g in picks), len(misses)

    def encoded(self) -> tuple[list[int], list[int], list[int]]:
        slot_of = [self.where.get(g, -1) for g in range(self.N)]
        id_of = [-1 if g is None else g for g in self.held]
        bases = (0, LOW_BASE, RES_BASE)
        keys = [0 if b == 0 else (bases[b] + (a << 16) + 0xFFFF + c if b == 1 else R(a, c))
                for b, a, c in self.keys]
        return slot_of, id_of, keys


def draw_rows(rng: random.Random, batch: int, experts: int, k: int) -> list[list[int]]:
    weights = [1.0 / (e + 1) for e in range(experts)]  # skewed, so hits happen
    rows = []
    for _ in range(batch):
        if rng.random() < 0.1:  # duplicates inside a row too, to stress dedup
            rows.append(rng.choices(range(experts), weights, k=k))
            continue
        row: list[int] = []
        while len(row) < k:
            e = rng.choices(range(experts), weights)[0]
            row += [e] if e not in row else []
        rows.append(row)
    return rows


@pytest.mark.parametrize(
    "batch,policy,slots",
    [(1, LRU, 5), (1, RULE, 10), (2, LRU, 4), (2, LRU, 9), (2, RULE, 16), (2, RULE, 9)],
)
def test_random_sequences_match_the_model(batch, policy, slots):
    layers, experts, k, steps = 3, 10, 2, 1000
    rng = random.Random(f"{batch}{policy.name}{slots}")
    m = SlotMaps.create(layers, experts, slots)
    model = PyCache(layers, experts, slots, policy.freq_cap)
    layer, protect = 0, [[0] * k]
    for step in range(steps):
        op = rng.random()
        if op < 0.55:
            layer = (layer + 1) % layers if rng.random() < 0.8 else rng.randrange(layers)
            rows = draw_rows(rng, batch, experts, k)
            p = ensure(m, layer, t(rows), policy)
            slots_, src, dst, count = model.ensure(layer, rows)
            assert p.slots.tolist() == slots_
            assert plan_lists(p) == (src, dst, [count])
            protect = p.slots.tolist()
        elif op < 0.93:
            nxt = (layer + 1) % layers
            cands = [rng.randrange(experts) for _ in range(rng.randrange(7))]
            budget = rng.randrange(min(5, slots + 1))
            prot = protect if rng.random() < 0.8 else [rng.sample(range(slots), min(3, slots))]
            pf = prefetch_ensure(m, nxt, t(cands), budget, torch.tensor(prot))
            src, dst, count = model.prefetch(nxt, cands, budget, sum(prot, []))
            assert plan_lists(pf) == (src, dst, [count])
        else:
            nxt = (layer + 1) % layers
            cands = [rng.randrange(experts) for _ in range(6)]
            rows = draw_rows(rng, batch, experts, k)
            before = snapshot(m)
            c = prefetch_measure(m, nxt, t(cands), 3, t(rows))
            assert same(snapshot(m), before)
            got = (c.selected.tolist(), c.useful.tolist(), c.misses.tolist())
            assert got == tuple([x] for x in model.measure(nxt, cands, 3, rows))
        assert check_invariants(m) == [], step
        assert state(m) == model.encoded(), step
        assert m.clock.tolist() == [model.clock]
    st = m.stats
    got = [st.hits, st.misses, st.prefetch_useful, st.prefetch_installs]
    want = [model.stats[n] for n in ("hits", "misses", "useful", "installs")]
    assert [x.tolist() for x in got] == want
    assert min(want[0]) > 0 and min(want[1]) > 0 and sum(want[2]) > 0  # the run exercised them


# ---------------------------------------------------------------- rule versus lru


def skewed_routing(seed: int, layers: int, experts: int, k: int, tokens: int, alpha: float,
                   reuse: float) -> list[list[list[int]]]:
    """Zipf popularity per layer (its own ranking), and each expert of the previous token
    routed again with probability `reuse`; returns [tokens][layers][k] local ids."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** alpha for r in range(experts)]
    ranking = [rng.sample(range(experts), experts) for _ in range(layers)]
    prev: list[list[int]] = [[] for _ in range(layers)]
    out = []
    for _ in range(tokens):
        token = []
        for layer in range(layers):
            row = [e for e in prev[layer] if rng.random() < reuse]
            while len(row) < k:
                e = ranking[layer][rng.choices(range(experts), weights)[0]]
                row += [e] if e not in row else []
            prev[layer] = row
            token.append(row)
        out.append(token)
    return out


def test_rule_beats_lru_on_skewed_routing():
    layers, experts, k, slots, tokens = 8, 64, 4, 80, 100  # room for 2.5 tokens of experts
    assert RULE.freq_weight(slots, layers, k) > 0  # else rule would equal lru
    totals = {"lru": 0, "rule": 0}
    for seed, (alpha, reuse) in enumerate([(1.0, 0.3), (0.8, 0.5), (1.2, 0.1)]):
        routing = skewed_routing(seed, layers, experts, k, tokens, alpha, reuse)
        misses = {}
        for policy in (LRU, RULE):
            m = SlotMaps.create(layers, experts, slots)
            for token in routing:
                for layer, row in enumerate(token):
                    ensure(m, layer, t([row]), policy)
            misses[policy.name] = int(m.stats.misses.sum())
            totals[policy.name] += misses[policy.name]
        assert misses["rule"] <= misses["lru"], (seed, misses)
    assert totals["rule"] < 0.97 * totals["lru"], totals


def test_score_eviction_evicts_the_expert_the_routers_rank_lowest():
    from ftchat.offload.policy import SCORE, SCORE_CLOCK0
    from ftchat.offload.scores import RouterScores

    def victim(policy, clock0):
        m = SlotMaps.create(1, 8, 4, clock0=clock0)
        ensure(m, 0, t([[0, 1, 2, 3]]), policy)
        if policy.reads_scores:
            s = RouterScores(1, 8, 4, "cpu")
            s.record(0, torch.tensor([[4.0, 3.0, -2.0, 2.0, 1.0, 0.0, 0.5, 0.2]]),
                     t([[0, 1, 2, 3]]))
            s.observe(m)
            assert check_invariants(m) == []
        before = m.id_of[:4].tolist()
        ensure(m, 0, t([[5, 0]]), policy)
        return before[int((m.id_of[:4] == 5).nonzero())]

    assert victim(SCORE, SCORE_CLOCK0) == 2  # the lowest logit of the four residents
    assert victim(RULE, 0) == 1  # control: rule evicts the oldest slot not used by this call


def test_score_weighs_what_was_routed_beside_the_logits():
    # expert 2 has the lowest logit of the four residents; routed, its ROUTED_BONUS lifts it
    # above expert 3, which then goes first (control: not routed, expert 2 goes)
    from ftchat.offload.policy import SCORE, SCORE_CLOCK0
    from ftchat.offload.scores import RouterScores

    def victim(routed):
        m = SlotMaps.create(1, 8, 4, clock0=SCORE_CLOCK0)
        ensure(m, 0, t([[0, 1, 2, 3]]), SCORE)
        s = RouterScores(1, 8, 2, "cpu")
        s.record(0, torch.tensor([[4.0, 3.0, -2.0, 1.0, 1.5, 0.0, 0.5, 0.2]]), t([routed]))
        s.observe(m)
        before = m.id_of[:4].tolist()
        ensure(m, 0, t([[5]]), SCORE)
        return before[int((m.id_of[:4] == 5).nonzero())]

    assert victim([0, 2]) == 3
    assert victim([0, 1]) == 2


def test_score_keys_rank_below_every_stamp_of_the_step():
    # an expert used or installed during a step keeps its slot until the next step's scores
    from ftchat.offload.policy import SCORE, SCORE_CLOCK0
    from ftchat.offload.scores import RouterScores

    m = SlotMaps.create(2, 8, 4, clock0=SCORE_CLOCK0)
    s = RouterScores(2, 8, 2, "cpu")
    ensure(m, 0, t([[0, 1]]), SCORE)
    s.record(0, torch.tensor([[9.0, 8.0, 0, 0, 0, 0, 0, 0]]), t([[0, 1]]))
    s.observe(m)  # experts 0 and 1 now hold score keys, high as the routers rank them
    ensure(m, 1, t([[0, 1]]), SCORE)  # layer 1: stamped at the clock
    ensure(m, 1, t([[2, 3]]), SCORE)  # two more misses: the victims are layer 0's experts
    assert sorted(m.id_of[:4].tolist()) == [8, 9, 10, 11]
