"""The slot-map operations the engine calls: the fused kernels on CUDA, else the torch reference.

`ensure_triton` and `prefetch_ensure_triton` run cache.ensure / cache.prefetch_ensure as one
kernel launch each (ftchat/kernels/slot_cache.py) and return the same plans; like the
reference, they check their arguments and announce every map they write (`SlotMaps.on_write`)
before anything changes.
Legend: B, K, C = batch, top-k, candidates.
"""

from __future__ import annotations

from torch import Tensor

from ftchat.kernels import HAS_TRITON
from ftchat.kernels.slot_cache import KeyBands, ensure_slots, prefetch_slots
from ftchat.offload import cache
from ftchat.offload.cache import DemandPlan, PrefetchPlan, SlotMaps
from ftchat.offload.policy import (
    HIT_BITS,
    LOW_BASE,
    MASKED,
    MAX_BUDGET,
    MAX_FREQ_CAP,
    RANK_BITS,
    RES_BASE,
    EvictionPolicy,
)

KEY_BANDS = KeyBands(low_base=LOW_BASE, res_base=RES_BASE, masked=MASKED, hit_bits=HIT_BITS,
                     max_freq_cap=MAX_FREQ_CAP, rank_bits=RANK_BITS, max_budget=MAX_BUDGET)
_ENSURE_WRITES = ("key", "slot_of", "id_of", "clock", "stats.hits", "stats.misses",
                  "stats.prefetch_useful")  # every map the ensure kernel writes, as cache.py names
_PREFETCH_WRITES = ("slot_of", "id_of", "key", "stats.prefetch_installs")


def _announce(maps: SlotMaps, names: tuple[str, ...]) -> None:
    if maps.on_write is not None:
        for name in names:
            maps.on_write(name)  # may raise: nothing has been launched yet


def ensure_triton(maps: SlotMaps, layer: int, ids: Tensor, policy: EvictionPolicy,
                  tile: int | None = None, num_warps: int | None = None) -> DemandPlan:
    """cache.ensure as one kernel launch. tile / num_warps: launch shape overrides (benchmarks
    and tests; kernels/slot_cache.py gives the defaults)."""
    b, k = ids.shape
    m, s = b * k, maps.num_slots
    if m > s:
        raise ValueError(f"{m} routed ids per call need at least {m} slots, have {s}")
    _announce(maps, _ENSURE_WRITES)
    st = maps.stats
    slots, src, dst, count = ensure_slots(
        ids.reshape(m), maps.slot_of, maps.id_of, maps.key, maps.clock,
        st.hits, st.misses, st.prefetch_useful, base=layer * maps.num_experts, layer=layer,
        weight=policy.freq_weight(s, maps.num_layers, m), freq_cap=policy.freq_cap,
        bands=KEY_BANDS, tile=tile, num_warps=num_warps)
    return DemandPlan(slots=slots.reshape(b, k), src=src, dst=dst, count=count)  # [B, K] slots


def prefetch_ensure_triton(maps: SlotMaps, layer: int, candidates: Tensor, budget: int,
                           protect: Tensor, tile: int | None = None,
                           num_warps: int | None = None,
                           limit: Tensor | None = None) -> PrefetchPlan:
    """cache.prefetch_ensure as one kernel launch."""
    cache.check_budget(maps, budget)
    _announce(maps, _PREFETCH_WRITES)
    src, dst, count = prefetch_slots(
        candidates.reshape(-1), protect.reshape(-1), maps.slot_of, maps.id_of, maps.key,
        maps.clock, maps.stats.prefetch_installs, base=layer * maps.num_experts, layer=layer,
        budget=budget, bands=KEY_BANDS, tile=tile, num_warps=num_warps, limit=limit)
    return PrefetchPlan(src=src, dst=dst, count=count)


# ===== dispatch: the engine's call sites =====


def use_triton(maps: SlotMaps) -> bool:
    """The fused kernels run where the maps live on CUDA and Triton imports."""
    return HAS_TRITON and maps.key.is_cuda


def ensure_any(maps: SlotMaps, layer: int, ids: Tensor, policy: EvictionPolicy) -> DemandPlan:
    """cache.ensure: the fused kernel on CUDA, else the torch reference."""
    if use_triton(maps):
        return ensure_triton(maps, layer, ids, policy)
    return cache.ensure(maps, layer, ids, policy)


def prefetch_ensure_any(maps: SlotMaps, layer: int, candidates: Tensor, budget: int,
                        protect: Tensor, limit: Tensor | None = None) -> PrefetchPlan:
    """cache.prefetch_ensure: the fused kernel on CUDA, else the torch reference."""
    if use_triton(maps):
        return prefetch_ensure_triton(maps, layer, candidates, budget, protect, limit=limit)
    return cache.prefetch_ensure(maps, layer, candidates, budget, protect, limit)
