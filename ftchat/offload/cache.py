"""Slot maps of the expert cache and the operations that write them (docs/design.md section 4).

This torch-op code is the specification and the CPU path; the fused Triton kernels must leave the
same map state and plans. Every operation has fixed shapes and never syncs the host: masked writes
go to the sink entries (slot_of[N], id_of[S], key[S]), whose values are unspecified, and every
tie (victims of equal key) breaks towards the lower slot index.

Legend: B, K, S, C, M = batch, top-k, slots, candidates, B*K; N = num_layers * num_experts global
expert ids (layer * E + e).

Clock: ensure ticks it once (before stamping); prefetch_ensure and prefetch_measure never do, so
prefetch installs carry the clock of the ensure that preceded them.

Single writer: `_write` is the only function that changes a map or counter tensor; each call is
one in-place op, preceded by `maps.on_write(name)` when a callback is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ftchat.offload.policy import (
    EMPTY_BASE,
    HIT_BITS,
    LOW_BASE,
    MASKED,
    MAX_BUDGET,
    MAX_FREQ_CAP,
    RANK_BITS,
    RES_BASE,
    SCORE_BITS,
    EvictionPolicy,
    band_of,
    low_key,
)


@dataclass
class CacheStats:
    """Per-layer counters on the maps' device, in distinct ids per call."""

    hits: Tensor  # [L] int64 demand ids found resident
    misses: Tensor  # [L] int64 demand ids copied
    prefetch_installs: Tensor  # [L] int64 ids installed by prefetch_ensure
    prefetch_useful: Tensor  # [L] int64 demand hits on a low-priority (prefetched) slot

    @classmethod
    def create(cls, num_layers: int, device: torch.device | str) -> CacheStats:
        def z() -> Tensor:
            return torch.zeros(num_layers, dtype=torch.int64, device=device)

        return cls(z(), z(), z(), z())


@dataclass
class SlotMaps:
    """The cache's bookkeeping. Only this module writes the tensors."""

    num_layers: int
    num_experts: int
    num_slots: int
    slot_of: Tensor  # [N+1] int32 slot of a global id, -1 absent; [N] is a sink
    id_of: Tensor  # [S+1] int32 global id in a slot, -1 empty; [S] is a sink
    key: Tensor  # [S+1] int64 eviction key, lowest evicted first; [S] is a sink
    clock: Tensor  # [1] int64, +1 per ensure
    stats: CacheStats
    on_write: Callable[[str], None] | None = field(default=None)  # debug hook, see _write
    clock0: int = 0  # the clock's value when empty (policy.SCORE_CLOCK0 under `score`)

    @property
    def num_ids(self) -> int:
        return self.num_layers * self.num_experts

    @classmethod
    def create(
        cls, num_layers: int, num_experts: int, num_slots: int, device: torch.device | str = "cpu",
        clock0: int = 0,
    ) -> SlotMaps:
        n = num_layers * num_experts
        if num_layers < 1 or num_experts < 1 or num_slots < 1:
            raise ValueError("num_layers, num_experts and num_slots must be >= 1")
        if n + 1 >= 2**31 or num_slots + 1 >= 2**31:
            raise ValueError("expert ids and slots must fit int32")
        return cls(
            num_layers,
            num_experts,
            num_slots,
            slot_of=torch.full((n + 1,), -1, dtype=torch.int32, device=device),
            id_of=torch.full((num_slots + 1,), -1, dtype=torch.int32, device=device),
            key=torch.full((num_slots + 1,), EMPTY_BASE, dtype=torch.int64, device=device),
            clock=torch.full((1,), clock0, dtype=torch.int64, device=device),
            stats=CacheStats.create(num_layers, device),
            clock0=clock0,
        )


@dataclass(frozen=True)
class DemandPlan:
    slots: Tensor  # [B, K] int32 slot of every routed id (what the expert kernel reads)
    src: Tensor  # [M] int64 global id = host row to copy; N for unused entries
    dst: Tensor  # [M] int32 destination slot; S for unused entries
    count: Tensor  # [1] int32 number of real copies (the first `count` entries)


@dataclass(frozen=True)
class PrefetchPlan:
    src: Tensor  # [budget] int64, N for unused entries
    dst: Tensor  # [budget] int32, S for unused entries
    count: Tensor  # [1] int32


@dataclass(frozen=True)
class PrefetchCounts:
    selected: Tensor  # [1] int64 candidates prefetch_ensure would install (ignoring protect)
    useful: Tensor  # [1] int64 of those, routed: each is a demand miss it would have covered
    misses: Tensor  # [1] int64 distinct demand misses of the routed ids


def _write(
    maps: SlotMaps, name: str, index: Tensor | int, values: Tensor, add: bool = False
) -> None:
    """The only writer of map and counter tensors: one in-place op, announced first.

    name: "slot_of", "id_of", "key", "clock" or "stats.<counter>". index: a tensor of positions
    (masked entries point at the sink) or one int position.
    """
    if maps.on_write is not None:
        maps.on_write(name)  # may raise: nothing has been written yet
    owner, attr = (maps.stats, name[6:]) if name.startswith("stats.") else (maps, name)
    target: Tensor = getattr(owner, attr)
    values = values.to(target.dtype)
    if isinstance(index, int):
        view = target.narrow(0, index, 1)
        view.add_(values) if add else view.copy_(values)
    else:
        target.index_put_((index,), values, accumulate=add)


def clear(maps: SlotMaps) -> None:
    """Empty the cache in place, addresses kept (after a CUDA-graph warm-up ran real steps)."""
    for name, value in (("slot_of", -1), ("id_of", -1), ("key", EMPTY_BASE),
                        ("clock", maps.clock0)):
        if maps.on_write is not None:
            maps.on_write(name)
        getattr(maps, name).fill_(value)
    for name, t in vars(maps.stats).items():
        if maps.on_write is not None:
            maps.on_write(f"stats.{name}")
        t.zero_()


def empty_slots(maps: SlotMaps, lo: int, hi: int) -> None:
    """Empty slots [lo, hi) in place: their experts become absent, their keys empty (lent to
    prefill's staging: offload/backend.py `OffloadExperts.staged_prefill`). Keeps the invariants;
    the clock and the counters are untouched. No host sync."""
    n, s = maps.num_ids, maps.num_slots
    assert 0 <= lo <= hi <= s, f"slots [{lo}, {hi}) outside [0, {s})"
    slots = torch.arange(lo, hi, device=maps.id_of.device)
    old = maps.id_of[slots].long()
    _write(maps, "slot_of", torch.where(old >= 0, old, n), torch.full_like(old, -1))
    _write(maps, "id_of", slots, torch.full_like(old, -1))
    _write(maps, "key", slots, torch.full_like(old, EMPTY_BASE))


SCORE_RANGE = 64.0  # scores are clamped to +-64 (standardised logits never come near)
SCORE_STEPS = float(1 << (SCORE_BITS - HIT_BITS - 8))  # key steps per unit of score


def _first_occurrence(ids: Tensor) -> Tensor:
    """[X] bool: True where ids[i] differs from every earlier entry (dedup without a sync)."""
    pos = torch.arange(ids.shape[0], device=ids.device)
    same = ids[:, None] == ids[None, :]  # [X, X]
    earlier = pos[None, :] < pos[:, None]  # [X, X] j < i
    return ~(same & earlier).any(dim=1)


def _lowest_slots(maps: SlotMaps, blocked: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The n slots of lowest key among those not blocked ([S+1] bool), lowest first.

    Returns (slots [n] int64, ok [n] bool); ok is False past the last unblocked slot.
    """
    s = maps.num_slots
    masked = torch.where(blocked[:s], MASKED, maps.key[:s])  # [S]
    keys, order = torch.sort(masked, stable=True)  # stable: ties go to the lower slot
    return order[:n], keys[:n] < MASKED


def _by_rank(values: Tensor, rank: Tensor, take: Tensor, n: int, fill: int) -> Tensor:
    """[n]: out[rank[i]] = values[i] where take[i] (ranks distinct among taken), else fill."""
    out = torch.full((n + 1,), fill, dtype=values.dtype, device=values.device)
    out.scatter_(0, torch.where(take, rank, n), values)  # untaken entries land on out[n]
    return out[:n]


def _install(maps: SlotMaps, gids: Tensor, victims: Tensor, real: Tensor, keys: Tensor) -> None:
    """Put gids[i] into victims[i] for real i (victims distinct, not held by any of gids)."""
    n, s = maps.num_ids, maps.num_slots
    victim = torch.where(real, victims, s)
    old = maps.id_of[victim].long()
    _write(maps, "slot_of", torch.where(real & (old >= 0), old, n), torch.full_like(old, -1))
    _write(maps, "slot_of", torch.where(real, gids, n), victim)
    _write(maps, "id_of", victim, torch.where(real, gids, -1))
    _write(maps, "key", victim, keys)


def ensure(maps: SlotMaps, layer: int, ids: Tensor, policy: EvictionPolicy) -> DemandPlan:
    """Map the routed experts of `layer` to slots, evicting as needed; returns the copy plan.

    Args:
        ids: [B, K] local expert ids of `layer`; equal ids share one slot and one copy.
        policy: how a use stamps the key (policy.LRU or policy.RULE).
    """
    b, k = ids.shape
    m, n, s = b * k, maps.num_ids, maps.num_slots
    if m > s:
        raise ValueError(f"{m} routed ids per call need at least {m} slots, have {s}")
    gid = ids.reshape(m).long() + layer * maps.num_experts  # [M]
    first = _first_occurrence(gid)
    slot = maps.slot_of[gid].long()  # [M], -1 absent
    hit = slot >= 0
    clock = maps.clock + 1  # [1]
    weight = policy.freq_weight(s, maps.num_layers, m)

    # Stamp hits first (once per distinct id); a low-priority hit moves to the resident band.
    stamp_slot = torch.where(hit & first, slot, s)
    old_key = maps.key[stamp_slot]
    promoted = (band_of(old_key) == 1) & hit & first
    _write(maps, "key", stamp_slot, policy.stamp(old_key, clock, weight))

    # Victims: lowest keys among slots that no routed id of this call holds.
    used = torch.zeros(s + 1, dtype=torch.bool, device=gid.device)
    used.index_fill_(0, torch.where(hit, slot, s), True)  # scratch mask, not a map
    victims, _ = _lowest_slots(maps, used, m)  # enough exist since S >= M
    miss = ~hit & first
    rank = torch.cumsum(miss, 0) - 1  # order of first occurrence
    num_miss = miss.sum()
    real = torch.arange(m, device=gid.device) < num_miss
    miss_gid = _by_rank(gid, rank, miss, m, n)  # [M], N past the last miss
    install_key = policy.stamp(torch.full_like(miss_gid, EMPTY_BASE), clock, weight)
    _install(maps, miss_gid, victims, real, install_key)
    _write(maps, "clock", 0, clock)

    _write(maps, "stats.hits", layer, (hit & first).sum(), add=True)
    _write(maps, "stats.misses", layer, num_miss, add=True)
    _write(maps, "stats.prefetch_useful", layer, promoted.sum(), add=True)
    return DemandPlan(
        slots=maps.slot_of[gid].reshape(b, k),  # [B, K]
        src=torch.where(real, miss_gid, n),
        dst=torch.where(real, victims, s).to(torch.int32),
        count=num_miss.reshape(1).to(torch.int32),
    )


def _select_candidates(maps: SlotMaps, gid: Tensor, budget: int) -> tuple[Tensor, ...]:
    """First `budget` distinct non-resident candidates: (selected, rank, slot, resident)."""
    slot = maps.slot_of[gid].long()  # [C]
    resident = slot >= 0
    eligible = ~resident & _first_occurrence(gid)
    rank = torch.cumsum(eligible, 0) - 1  # priority order among eligible
    return eligible & (rank < budget), rank, slot, resident


def check_budget(maps: SlotMaps, budget: int) -> None:
    """Raise unless 0 <= budget <= min(S, MAX_BUDGET - 1) (a prefetch plan's size)."""
    if not 0 <= budget <= min(maps.num_slots, MAX_BUDGET - 1):
        raise ValueError(f"budget must be in 0..{min(maps.num_slots, MAX_BUDGET - 1)}")


def prefetch_ensure(
    maps: SlotMaps,
    layer: int,
    candidates: Tensor,
    budget: int,
    protect: Tensor,
    limit: Tensor | None = None,
) -> PrefetchPlan:
    """Install the first `budget` non-resident candidates of `layer` into low-priority slots.

    Args:
        candidates: [C] local expert ids of `layer`, best first (duplicates and residents allowed).
        budget: most installs, also the plan's fixed size.
        protect: slots being read (the previous demand plan's [B, K] slots): never evicted.
        limit: [L] int32 on the maps' device, or None: installs also stop at limit[layer]
            (the adaptive budget, ftchat/offload/budget.py; read on the device, no host sync).
    Low-priority keys do not depend on the eviction policy, so it takes none.
    """
    check_budget(maps, budget)
    n, s = maps.num_ids, maps.num_slots
    gid = candidates.reshape(-1).long() + layer * maps.num_experts  # [C]
    selected, rank, slot, resident = _select_candidates(maps, gid, budget)
    if limit is not None:
        selected &= rank < limit[layer]
    blocked = torch.zeros(s + 1, dtype=torch.bool, device=gid.device)
    blocked.index_fill_(0, protect.reshape(-1).long(), True)  # scratch mask, not a map
    blocked.index_fill_(0, torch.where(resident, slot, s), True)  # keep resident candidates
    victims, ok = _lowest_slots(maps, blocked, budget)
    rank_b = torch.arange(budget, device=gid.device)
    real = (rank_b < selected.sum()) & ok  # ok is a prefix, so real is too
    pf_gid = _by_rank(gid, rank, selected, budget, n)  # [budget]
    _install(maps, pf_gid, victims, real, low_key(maps.clock, rank_b))
    count = real.sum()
    _write(maps, "stats.prefetch_installs", layer, count, add=True)
    return PrefetchPlan(
        src=torch.where(real, pf_gid, n),
        dst=torch.where(real, victims, s).to(torch.int32),
        count=count.reshape(1).to(torch.int32),
    )


def prefetch_measure(
    maps: SlotMaps, layer: int, candidates: Tensor, budget: int, routed_ids: Tensor
) -> PrefetchCounts:
    """Counting mode: what prefetch_ensure would install and how much of it `layer` routes to.

    Read-only. Call it before ensure(layer, routed_ids) so the maps are those prefetch_ensure
    would have seen. Victim availability (protect) is not modelled.
    """
    check_budget(maps, budget)
    base = layer * maps.num_experts
    gid = candidates.reshape(-1).long() + base  # [C]
    routed = routed_ids.reshape(-1).long() + base  # [M]
    selected = _select_candidates(maps, gid, budget)[0]
    routed_hit = (gid[:, None] == routed[None, :]).any(dim=1)  # [C]
    miss = _first_occurrence(routed) & (maps.slot_of[routed] < 0)
    return PrefetchCounts(
        selected=selected.sum().reshape(1),
        useful=(selected & routed_hit).sum().reshape(1),
        misses=miss.sum().reshape(1),
    )


def rekey_by_score(maps: SlotMaps, score: Tensor) -> None:
    """The `score` policy's keys: every slot in the resident band gets a key that orders it by
    score [N] float32 (one value per global id; higher is kept longer), below every stamp of a
    clock >= SCORE_CLOCK0. Low-priority and empty slots keep theirs. No host sync."""
    s = maps.num_slots
    ids = maps.id_of[:s].long()  # [S]
    resident = (band_of(maps.key[:s]) == 2) & (ids >= 0)
    value = score.float()[ids.clamp(min=0)].clamp(-SCORE_RANGE, SCORE_RANGE) + SCORE_RANGE
    q = (value * SCORE_STEPS).long()  # [S], below 2^(SCORE_BITS - HIT_BITS)
    slots = torch.arange(s, device=ids.device)
    _write(maps, "key", torch.where(resident, slots, s), RES_BASE + (q << HIT_BITS) + 1)


def check_invariants(maps: SlotMaps) -> list[str]:
    """Host-side consistency check (syncs); returns one line per violation, [] when sound."""
    n, s = maps.num_ids, maps.num_slots
    # SYNC: debug and tests only
    slot_of, id_of = maps.slot_of[:n].tolist(), maps.id_of[:s].tolist()
    key, bands = maps.key[:s].tolist(), band_of(maps.key[:s]).tolist()
    clock = int(maps.clock[0])
    errors: list[str] = []
    for i, sl in enumerate(slot_of):
        if not -1 <= sl < s:
            errors.append(f"slot_of[{i}] = {sl} is not a slot")
        elif sl >= 0 and id_of[sl] != i:
            errors.append(f"slot_of[{i}] = {sl} but id_of[{sl}] = {id_of[sl]}")
    for sl, i in enumerate(id_of):
        if not -1 <= i < n:
            errors.append(f"id_of[{sl}] = {i} is not an expert id")
        elif i >= 0 and slot_of[i] != sl:
            errors.append(f"id_of[{sl}] = {i} but slot_of[{i}] = {slot_of[i]} (held twice?)")
        if (i == -1) != (bands[sl] == 0):
            errors.append(f"slot {sl} holds {i} but its key {key[sl]} is in band {bands[sl]}")
        if bands[sl] == 1 and (key[sl] - LOW_BASE) >> RANK_BITS > clock:
            errors.append(f"slot {sl} low-priority key {key[sl]} is newer than clock {clock}")
        if key[sl] < EMPTY_BASE or (bands[sl] == 2 and key[sl] & MAX_FREQ_CAP == 0):
            errors.append(f"slot {sl} key {key[sl]} is malformed")
    if clock < 0:
        errors.append(f"clock {clock} is negative")
    return errors
