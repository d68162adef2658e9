"""Slot-map kernels of the expert cache: ensure and prefetch_ensure, one launch each.

They leave the same map state, counters and plans as the torch specification in
ftchat/offload/cache.py (sinks aside, whose values are unspecified there); the dispatch that knows
the maps and the plans is ftchat/offload/cache_kernels.py. On CUDA the torch ops cost ~82 us per
layer under graph replay (docs/design.md section 5); these kernels never sync the host and have
fixed launch shapes.

How one kernel works: the B*K (or C) ids are a small register vector (dedup by an [M, M]
comparison, ranks by cumsum); the keys of all S slots are a register tile, with the slots that
may not be victims set to MASKED; each victim is one min-reduction (ties: lowest slot index)
followed by masking it; the map writes come last, after a CTA barrier. For S above one tile the
kernel keeps each tile's minimum and, after a pick, re-reduces only the winning tile, reading
back the key it temporarily set to MASKED in memory (the install overwrites it before exit).

Launch shape: grid (1,); one register tile of next_pow2(S) slots up to MAX_TILE (more tiles
above); 8 warps from a 2048-slot tile for ensure, from 4096 for prefetch_ensure, else 4. Plans
are fresh tensors per call: a plan still read by a copy stream is never rewritten by the next
call.

The maps: slot_of [N+1] int32, id_of [S+1] int32, key [S+1] int64, clock [1] int64 (the last
entry of each map is a sink); counters [L] int64. The key layout (bands, bit widths) is the
caller's (offload/policy.py), passed in as KeyBands.
Legend: B, K, S, C, M = batch, top-k, slots, candidates, B*K; N = layers * experts global ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.kernels import jit as _jit, tl, triton

MAX_TILE = 4096  # slots per register tile: 16 int64 per thread at 8 warps

# per-call integers are not specialized on their values (layer == 1, base % 16 == 0, ...):
# one compiled kernel per shape, so a warm-up of any layer compiles what a graph capture needs
_PLAIN_INTS = ["base", "layer", "S", "N"]


@dataclass(frozen=True)
class KeyBands:
    """The eviction key's layout, as the kernels compute with it (constexprs)."""

    low_base: int  # first key of the low-priority (prefetched) band
    res_base: int  # first key of the resident band
    masked: int  # above every real key: a slot that may not be a victim
    hit_bits: int  # resident band: bits of the capped use count
    max_freq_cap: int  # (1 << hit_bits) - 1
    rank_bits: int  # low band: bits of the install rank
    max_budget: int  # 1 << rank_bits

    def constexprs(self) -> dict[str, int]:
        return {"LOW": self.low_base, "RES": self.res_base, "MASKED": self.masked,
                "HIT_BITS": self.hit_bits, "HMASK": self.max_freq_cap,
                "RANK_BITS": self.rank_bits, "MAXB": self.max_budget}


# ===== device helpers =====


@_jit
def _dedup(gid, live, MB: tl.constexpr):
    # [MB] first occurrence of each id, and [MB, MB] same-id matrix (dead lanes match nothing)
    pos = tl.arange(0, MB)
    same = (gid[:, None] == gid[None, :]) & live[:, None] & live[None, :]  # [MB, MB]
    earlier = pos[None, :] < pos[:, None]  # [MB, MB] j < i
    first = live & (tl.max((same & earlier).to(tl.int32), axis=1) == 0)
    return first, same


@_jit
def _block_tile(keys, offs, ids_ptr, base, slot_of_ptr, prot_ptr,
                NQ: tl.constexpr, NP: tl.constexpr, MASKED: tl.constexpr):
    # keys [BLOCK] of slots offs: MASKED where a slot holds one of the NQ ids (resident ids of
    # this call) or is one of the NP protected slots. Scalar loads, so no [BLOCK, M] matrix.
    for j in tl.static_range(NQ):
        held = tl.load(slot_of_ptr + (tl.load(ids_ptr + j).to(tl.int64) + base))  # -1: none
        keys = tl.where(offs == held, MASKED, keys)
    for j in tl.static_range(NP):
        keys = tl.where(offs == tl.load(prot_ptr + j), MASKED, keys)
    return keys


@_jit
def _pick_victims(key_ptr, ids_ptr, base, slot_of_ptr, prot_ptr, S, picks,
                  NQ: tl.constexpr, NP: tl.constexpr, VB: tl.constexpr, BLOCK: tl.constexpr,
                  TILES: tl.constexpr, TB: tl.constexpr, MASKED: tl.constexpr):
    # [VB] int32: the `picks` unblocked slots of lowest key, lowest first (ties: lower slot),
    # S where fewer are left or past `picks`
    vpos = tl.arange(0, VB)
    victims = tl.full([VB], 0, tl.int32) + S
    idx = tl.arange(0, BLOCK)
    if TILES == 1:
        keys = tl.load(key_ptr + idx, mask=idx < S, other=MASKED)
        keys = _block_tile(keys, idx, ids_ptr, base, slot_of_ptr, prot_ptr, NQ, NP, MASKED)
        for r in range(picks):
            kmin, v = tl.min(keys, axis=0, return_indices=True)
            keys = tl.where(idx == v, MASKED, keys)
            victims = tl.where((vpos == r) & (kmin < MASKED), v, victims)
    else:
        tpos = tl.arange(0, TB)
        tkey = tl.full([TB], MASKED, tl.int64)
        tidx = tl.zeros([TB], tl.int32)
        for t in tl.static_range(TILES):  # every tile's minimum
            offs = t * BLOCK + idx
            keys = tl.load(key_ptr + offs, mask=offs < S, other=MASKED)
            keys = _block_tile(keys, offs, ids_ptr, base, slot_of_ptr, prot_ptr, NQ, NP, MASKED)
            kmin, v = tl.min(keys, axis=0, return_indices=True)
            tkey = tl.where(tpos == t, kmin, tkey)
            tidx = tl.where(tpos == t, v + t * BLOCK, tidx)
        for r in range(picks):
            kmin, win = tl.min(tkey, axis=0, return_indices=True)  # ties: lower tile
            ok = kmin < MASKED
            v = tl.sum(tl.where(tpos == win, tidx, 0), axis=0)
            victims = tl.where((vpos == r) & ok, v, victims)
            # park the pick at MASKED in memory (the install overwrites it), re-reduce its tile
            tl.store(key_ptr + v, MASKED, mask=ok)
            tl.debug_barrier()
            offs = win * BLOCK + idx
            keys = tl.load(key_ptr + offs, mask=offs < S, other=MASKED, volatile=True)
            keys = _block_tile(keys, offs, ids_ptr, base, slot_of_ptr, prot_ptr, NQ, NP, MASKED)
            kmin, v = tl.min(keys, axis=0, return_indices=True)
            tkey = tl.where(tpos == win, kmin, tkey)
            tidx = tl.where(tpos == win, v + win * BLOCK, tidx)
    return victims


@_jit
def _by_rank(values, rank, take, VB: tl.constexpr):
    # [VB]: out[r] = values[i] for the taken i of rank r, else 0
    r = tl.arange(0, VB)
    hit = (rank[None, :] == r[:, None]) & take[None, :]  # [VB, MB]
    return tl.sum(tl.where(hit, values[None, :], 0), axis=1)


@_jit
def _install(slot_of_ptr, id_of_ptr, key_ptr, gids, victims, real, keys):
    # gids[i] into victims[i] for real i, unmapping the victims' old ids (cache._install)
    old = tl.load(id_of_ptr + victims, mask=real, other=-1)
    tl.debug_barrier()  # every read of id_of above happens before any write below
    tl.store(slot_of_ptr + old, -1, mask=real & (old >= 0))
    tl.store(slot_of_ptr + gids, victims, mask=real)
    tl.store(id_of_ptr + victims, gids.to(tl.int32), mask=real)
    tl.store(key_ptr + victims, keys, mask=real)


# ===== ensure =====


@_jit(do_not_specialize=_PLAIN_INTS + ["weight", "freq_cap"])
def _ensure_kernel(ids_ptr, slot_of_ptr, id_of_ptr, key_ptr, clock_ptr,
                   hits_ptr, misses_ptr, useful_ptr, slots_ptr, src_ptr, dst_ptr, count_ptr,
                   base, layer, S, N, weight, freq_cap,
                   M: tl.constexpr, MB: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
                   TB: tl.constexpr, LOW: tl.constexpr, RES: tl.constexpr, MASKED: tl.constexpr,
                   HIT_BITS: tl.constexpr, HMASK: tl.constexpr, RANK_BITS: tl.constexpr,
                   MAXB: tl.constexpr):
    pos = tl.arange(0, MB)
    live = pos < M
    gid = tl.load(ids_ptr + pos, mask=live, other=0).to(tl.int64) + base  # [MB]
    slot = tl.load(slot_of_ptr + gid, mask=live, other=-1)  # [MB] int32, -1 absent
    first, same = _dedup(gid, live, MB)
    hit = slot >= 0
    stamp = hit & first
    miss = live & first & (slot < 0)
    rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1  # order of first occurrence
    num_miss = tl.sum(miss.to(tl.int32), axis=0)
    clock = tl.load(clock_ptr) + 1

    # hit stamps (policy.stamp): a low-priority hit counts as useful and starts at h = 1
    old_key = tl.load(key_ptr + slot, mask=stamp, other=0)
    promoted = stamp & (old_key >= LOW) & (old_key < RES)
    h = tl.minimum(tl.where(old_key >= RES, old_key & HMASK, 0) + 1, freq_cap)
    new_key = RES + ((clock + (h - 1) * weight) << HIT_BITS) + h

    # victims: lowest keys among slots no routed id holds (S >= M, so num_miss always fit)
    victims = _pick_victims(key_ptr, ids_ptr, base, slot_of_ptr, ids_ptr, S, num_miss,
                            M, 0, MB, BLOCK, TILES, TB, MASKED)
    tl.debug_barrier()  # all key reads done before the writes below

    real = pos < num_miss
    src = tl.where(real, _by_rank(gid, rank, miss, MB), N)  # [MB] by miss rank
    _install(slot_of_ptr, id_of_ptr, key_ptr, src, victims, real,
             RES + (clock << HIT_BITS) + 1)  # stamp of an empty key: h = 1, score = clock
    tl.store(key_ptr + slot, new_key, mask=stamp)
    tl.store(clock_ptr, clock)
    tl.store(hits_ptr + layer, tl.load(hits_ptr + layer) + tl.sum(stamp.to(tl.int64), axis=0))
    tl.store(misses_ptr + layer, tl.load(misses_ptr + layer) + num_miss.to(tl.int64))
    tl.store(useful_ptr + layer,
             tl.load(useful_ptr + layer) + tl.sum(promoted.to(tl.int64), axis=0))

    # slots of every position, duplicates included: a miss takes its first occurrence's victim
    first_rank = tl.sum(tl.where(same & miss[None, :], rank[None, :], 0), axis=1)  # [MB]
    pick = tl.sum(tl.where(pos[None, :] == first_rank[:, None], victims[None, :], 0), axis=1)
    tl.store(slots_ptr + pos, tl.where(hit, slot, pick), mask=live)
    tl.store(src_ptr + pos, src, mask=live)
    tl.store(dst_ptr + pos, victims, mask=live)
    tl.store(count_ptr, num_miss)


def _size(n: int) -> int:
    # power-of-two vector size; at least 16 so that no block is degenerate
    return max(16, triton.next_power_of_2(n))


def tiling(num_slots: int, tile: int | None) -> tuple[int, int, int]:
    """(BLOCK, TILES, TB): register tile size, tile count, its power-of-two vector size."""
    block = tile or min(_size(num_slots), MAX_TILE)
    tiles = triton.cdiv(num_slots, block)
    return block, tiles, _size(tiles)


def _warps(block: int, num_warps: int | None, eight_from: int) -> int:
    # Swept on the H200 at S = 1650, one 2048-slot tile (`benchmarks/ensure_ab.py --warps`,
    # docs/performance.md): ensure is fastest at 8 warps (4 costs 3-9 % more, 16 costs 14-19 %);
    # the prefetch kernel's share is 0.7 us lower at 4 warps at bs 2. Smaller tiles: not swept.
    return num_warps or (8 if block >= eight_from else 4)


def _nonempty(x: Tensor) -> Tensor:
    # a zero-size tensor may have a null pointer: hand the kernel a 1-entry stand-in it never reads
    return x if x.numel() > 0 else torch.zeros(1, dtype=x.dtype, device=x.device)


def _check_maps(slot_of: Tensor, id_of: Tensor, key: Tensor, clock: Tensor,
                *counters: Tensor) -> None:
    assert slot_of.dtype == id_of.dtype == torch.int32, (slot_of.dtype, id_of.dtype)
    assert key.dtype == clock.dtype == torch.int64 and clock.shape == (1,)
    assert id_of.shape == key.shape and all(c.dtype == torch.int64 for c in counters)
    assert all(t.is_contiguous() and t.device == key.device
               for t in (slot_of, id_of, key, clock, *counters))


def ensure_slots(ids: Tensor, slot_of: Tensor, id_of: Tensor, key: Tensor, clock: Tensor,
                 hits: Tensor, misses: Tensor, useful: Tensor, base: int, layer: int,
                 weight: int, freq_cap: int, bands: KeyBands, tile: int | None = None,
                 num_warps: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """cache.ensure as one kernel launch (grid 1); writes the maps and the layer's counters.

    Args:
        ids: [M] local expert ids of `layer` (global id = base + id); M <= S.
        hits, misses, useful: [L] int64 counters, entry `layer` incremented.
        weight, freq_cap: the policy's W and cap (offload/policy.py).
        tile, num_warps: launch shape overrides (benchmarks and tests); the defaults are
            MAX_TILE and 8 warps from 1025 slots, else 4.
    Returns (slots [M] int32, src [M] int64, dst [M] int32, count [1] int32).
    """
    m, n, s = ids.shape[0], slot_of.shape[0] - 1, key.shape[0] - 1
    assert ids.dim() == 1 and m <= s and ids.device == key.device, (ids.shape, ids.device, s)
    _check_maps(slot_of, id_of, key, clock, hits, misses, useful)
    dev = key.device
    slots = torch.empty(m, dtype=torch.int32, device=dev)
    src = torch.empty(m, dtype=torch.int64, device=dev)
    dst = torch.empty(m, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    block, tiles, tb = tiling(s, tile)
    _ensure_kernel[(1,)](
        ids.contiguous(), slot_of, id_of, key, clock, hits, misses, useful, slots, src, dst, count,
        base, layer, s, n, weight, freq_cap, M=m, MB=_size(m), BLOCK=block, TILES=tiles, TB=tb,
        num_warps=_warps(block, num_warps, 2048), **bands.constexprs(),
    )
    return slots, src, dst, count


# ===== prefetch_ensure =====


@_jit(do_not_specialize=_PLAIN_INTS + ["budget"])
def _prefetch_kernel(cand_ptr, prot_ptr, slot_of_ptr, id_of_ptr, key_ptr, clock_ptr,
                     installs_ptr, src_ptr, dst_ptr, count_ptr, limit_ptr, base, layer, S, N,
                     budget, LIMITED: tl.constexpr, C: tl.constexpr, CB: tl.constexpr,
                     P: tl.constexpr, VB: tl.constexpr,
                     BLOCK: tl.constexpr, TILES: tl.constexpr, TB: tl.constexpr,
                     LOW: tl.constexpr, RES: tl.constexpr, MASKED: tl.constexpr,
                     HIT_BITS: tl.constexpr, HMASK: tl.constexpr, RANK_BITS: tl.constexpr,
                     MAXB: tl.constexpr):
    pos = tl.arange(0, CB)
    live = pos < C
    gid = tl.load(cand_ptr + pos, mask=live, other=0).to(tl.int64) + base  # [CB]
    slot = tl.load(slot_of_ptr + gid, mask=live, other=-1)  # [CB]
    first, _ = _dedup(gid, live, CB)
    eligible = first & (slot < 0)  # distinct, not resident; priority = candidate order
    rank = tl.cumsum(eligible.to(tl.int32), axis=0) - 1
    picks = tl.minimum(tl.sum(eligible.to(tl.int32), axis=0), budget)
    if LIMITED:  # a per-layer budget on the device (the adaptive budget), at most `budget`
        picks = tl.minimum(picks, tl.load(limit_ptr + layer))
    clock = tl.load(clock_ptr)

    # victims: never a protected slot nor the slot of a resident candidate
    victims = _pick_victims(key_ptr, cand_ptr, base, slot_of_ptr, prot_ptr, S, picks,
                            C, P, VB, BLOCK, TILES, TB, MASKED)
    tl.debug_barrier()  # all key reads done before the writes below

    r = tl.arange(0, VB)
    real = victims < S  # a prefix: picks, cut where unblocked slots ran out
    count = tl.sum(real.to(tl.int32), axis=0)
    src = tl.where(real, _by_rank(gid, rank, eligible, VB), N)  # [VB]
    _install(slot_of_ptr, id_of_ptr, key_ptr, src, victims, real,
             LOW + (clock << RANK_BITS) + (MAXB - 1 - r))  # policy.low_key
    tl.store(installs_ptr + layer, tl.load(installs_ptr + layer) + count.to(tl.int64))
    tl.store(src_ptr + r, src, mask=r < budget)
    tl.store(dst_ptr + r, victims, mask=r < budget)
    tl.store(count_ptr, count)


def prefetch_slots(candidates: Tensor, protect: Tensor, slot_of: Tensor, id_of: Tensor,
                   key: Tensor, clock: Tensor, installs: Tensor, base: int, layer: int,
                   budget: int, bands: KeyBands, tile: int | None = None,
                   num_warps: int | None = None,
                   limit: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """cache.prefetch_ensure as one kernel launch (grid 1); writes the maps and installs[layer].

    Args:
        candidates: [C] local expert ids of `layer`, best first; protect: [P] slots never evicted.
        budget: most installs, 0..min(S, bands.max_budget - 1) (the caller checks); the plan's
            size.
        limit: [L] int32 on the device, or None: installs also stop at limit[layer], read by
            the kernel (a graph replay sees its current value).
    Returns (src [budget] int64, dst [budget] int32, count [1] int32).
    """
    n, s = slot_of.shape[0] - 1, key.shape[0] - 1
    assert candidates.dim() == protect.dim() == 1 and 0 <= budget <= s
    assert candidates.device == protect.device == key.device
    _check_maps(slot_of, id_of, key, clock, installs)
    dev = key.device
    if limit is not None:
        assert limit.dtype == torch.int32 and limit.device == dev and 0 <= layer < limit.shape[0]
    c, p = candidates.shape[0], protect.shape[0]
    vb = _size(budget)
    src = torch.empty(vb, dtype=torch.int64, device=dev)  # entries past budget: scratch
    dst = torch.empty(vb, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    block, tiles, tb = tiling(s, tile)
    _prefetch_kernel[(1,)](
        _nonempty(candidates.contiguous()), _nonempty(protect.contiguous()), slot_of, id_of, key,
        clock, installs, src, dst, count, count if limit is None else limit, base, layer, s, n,
        budget, LIMITED=limit is not None, C=c, CB=_size(c), P=p, VB=vb, BLOCK=block,
        TILES=tiles, TB=tb,
        num_warps=_warps(block, num_warps, 4096), **bands.constexprs(),
    )
    return src[:budget], dst[:budget], count
