"""Exact top-k of QSA's int64 block-ranking keys by a radix select (decode, CUDA graphs).

QSA decode (`qsa.select_blocks_fused`) keeps the K = min(512, N) largest keys of each row of
keys [B, N], key = bits(score) << 32 | (N - 1 - n) for a complete block n (score fp32 >= 0, so
its bits are in [0, 2^31) and order like the scores), -1 for an incomplete one (`qsa.rank_key`,
`qsa_decode._rank_kernel`). torch.topk costs 11 us at N = 1K and ~70 us at N = 32K-64K on the
H200 (a sort, then a multi-block radix path); this is a radix select without any sort.

Design. Only the high word matters for the radix select: u = (key >> 32) + 1 for a complete
block, 0 for an incomplete one (u in [0, 2^31], order-preserving; 32 bits). Among keys with the
same u the larger key is the lower block index (the low word is N - 1 - n), and the -1 keys may
be taken in any fixed order; so "the first ones in index order" is the right tie rule for both,
and the 16 or more index bits never need a radix pass. The K-th largest u (the threshold T) is
found digit by digit, most significant first: four passes of 8 bits (u bits 31..24, 23..16,
15..8, 7..0; `digits(8)`, the default) or three of 12, 12, 8 (`digits(12)`). A pass histograms
the digit of the candidates (keys whose higher digits equal the prefix found so far) and scans
the bins from the top: the digit d where the count at or above it first reaches `need` (the keys
still to take from the candidates); need -= the candidates above d. After the last pass: T,
and teq = need in [1, #(u == T)]. The output is every key with u > T plus the first teq keys
with u == T in index order: exactly K keys, the K largest (ties in score resolved towards the
lower block, as the keys themselves order them). That is the set torch.topk returns, except
which -1 entries fill a row with fewer than K complete blocks (torch: unspecified; here: the
first ones). Exact for any N < 2^31 and any K <= N; nothing is rounded or compared but
integers.

Digit width. tl.histogram's cost depends on the Triton version: Triton 3.6 (the device's)
lowers it with one warp ballot per bin bit and a popcount per bin a lane owns (bins / 32 of
them) for every element, so a 4096-bin histogram costs ~16 times a 256-bin one per element;
Triton 3.9's lowering (its PTX, not timed) uses shared-memory atomics, where 12-bit digits
should cost about the same and save a pass (one launch). Hence 8-bit digits by default;
`digit_bits=12` where the histogram is cheap.

Output order: ascending block index (an ordered compaction): deterministic, bit-identical run to
run and under graph replay, and the blocks' K/V rows are then read in address order.

Kernels (no host sync, static shapes, integer atomics only; counts are order-independent):
  * N <= small_max (4096 by default): `_small_kernel`, grid (B,): one program holds its row in
    registers and runs the passes and the compaction (1 launch).
  * else grid (B, cdiv(N, CHUNK)) for each of len(digits) + 1 launches (5 by default):
    - `_hist_kernel`, every pass but the last: each program histograms its chunk's candidates
      (tl.histogram) and adds the nonzero bins into the row's global histogram (int32
      atomics); the last program of the row to arrive (a counter: ftchat/kernels/sync.py)
      reads it (.cg: from L2), picks the digit, stores (prefix, need) in the row's state, and
      zeroes the histogram and the counter for the next launch.
    - `_final_kernel`, the last pass (u's low 8 bits): each program stores its own 256-bin
      histogram and the count of its keys above the prefix (plain stores); the last one sums
      them in chunk order, fixes T and teq, and from the per-chunk counts computes each chunk's
      output offset and how many u == T keys lie in the chunks before it (exclusive prefix sums
      over the chunks): no separate counting launch.
    - `_write_kernel`: each program writes its chunk's chosen keys at its offset (a prefix sum
      within the chunk), indices int64 and the keys themselves.
The global histogram and the counters persist per (device, B) (`sync.counters`), so two calls
must not run at once on two streams.

Measured (H200, Triton 3.6, B = 2, us per call in a graph of 20 calls on distinct keys;
benchmarks/bench_qsa_topk.py): torch.topk vs this, N = 1K: 12.3 vs 7.9 (one program per row);
4K: 24.8 vs 16.6; 8K: 38.8 vs 17.7; 16K: 73.9 vs 18.1; 65,280: 75.8 vs 20.0 (chunks of 1024,
8 warps; 4096-key chunks were 28-29 us, 12-bit digits ~71 us there). The multi-program path is
latency-bound: ~3.6 us per launch (one pass alone) against 1.3 us for a trivial kernel, the
same at every N; all-zero scores (one histogram bin) cost no more (seen with 4096-key chunks).

Torch mirror: `topk_keys_ref` (torch.topk, the first -1 entries, ascending index); dispatcher:
`topk_keys`. Legend: B rows, N keys a row, K chosen, u the 32-bit high-word rank, T its
threshold, teq the keys taken at u == T.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.skip import family
from ftchat.kernels.sync import counters, last_to_arrive as _last_to_arrive, pdl_release, pdl_wait

TOPK_MAX_N = 65536  # the dispatcher's limit (tested up to 65,280 = 255K context / 4)
CHUNK = 1024  # keys per program of the multi-program path (H200 sweep: 1024 < 2048 < 4096)
SMALL_MAX = 4096  # rows up to this length take the one-program-per-row kernel (H200: even at 4096)
WARPS = 8  # both paths (H200 sweep: 8 >= 4, 16 no better)
DIGIT_BITS = 8  # radix digit width: 8 -> four passes of 8 bits; 12 -> 12, 12, 8 (module doc)
BINS_LO = 256  # the last pass's digit: u's 8 lowest bits (both widths)
ST_W = 16  # int64 state per row: (prefix, need) after pass p at 2p, 2p + 1; T, teq at 14, 15
SCR_W = BINS_LO + 4  # int32 scratch per (row, chunk): histogram, above, offset, u == T before


def _const(v):
    return tl.constexpr(v) if HAS_TRITON else v  # a jit function reads globals as constexprs


_LO, _ST, _SW = (_const(v) for v in (BINS_LO, ST_W, SCR_W))


def digits(bits: int = DIGIT_BITS) -> list[tuple[int, int]]:
    """(shift, width) of each radix pass over the 32-bit u, most significant first; the last is
    always u's low 8 bits (the final pass's per-chunk histograms stay small)."""
    assert bits in (8, 12), "digits of 8 or 12 bits"
    out, top = [], 32
    while top > 8:
        w = min(bits, top - 8)
        out.append((top - w, w))
        top -= w
    return out + [(0, 8)]


# ===== device helpers =====


@_jit
def _rank_hi(key):
    # u: the key's high word + 1 for a complete block (key >= 0), 0 for an incomplete one;
    # int64 in [0, 2^31], ordered like the keys' high words
    return tl.where(key >= 0, (key >> 32) + 1, 0)


@_jit
def _pick(h, need, NB: tl.constexpr):
    # h [NB] int32 digit counts of the candidates, 1 <= need <= sum(h): the digit d holding the
    # need-th largest candidate and what remains to take inside it (need - candidates above d)
    s = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # candidates with a digit >= d: non-increasing
    d = tl.sum((s >= need).to(tl.int32), 0) - 1
    at = tl.arange(0, NB) == d
    above = tl.sum(tl.where(at, s - h, 0), 0)
    return d.to(tl.int64), need - above


@_jit
def _digit_hist(u, ok, pre, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr):
    # histogram [2^BITS] of digit u >> SHIFT over the candidates: keys in range whose higher
    # bits (u >> (SHIFT + BITS)) equal the prefix found so far (every key in the first pass)
    if FIRST:
        cand = ok
    else:
        cand = ok & ((u >> (SHIFT + BITS)) == pre)
    return tl.histogram(((u >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32), 1 << BITS, mask=cand)


@_jit
def _local_pass(u, ok, pre, need, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr):
    # one pass within one program: (prefix, need) -> (prefix with this digit appended, need)
    d, need = _pick(_digit_hist(u, ok, pre, SHIFT, BITS, FIRST), need, 1 << BITS)
    return pre * (1 << BITS) + d, need


@_jit
def _chosen(u, ok, thr, teq, eq_before):
    # whether each key is output: u > T, or u == T among the first teq of those (index order;
    # eq_before of them lie before this tile)
    eq = ok & (u == thr)
    e = eq.to(tl.int32)
    rank = eq_before + tl.cumsum(e, 0) - e
    return ok & ((u > thr) | (eq & (rank < teq)))


@_jit
def _emit(idx_ptr, val_ptr, n, key, sel, base):
    # ordered compaction: the chosen keys of a tile (n ascending) to slots base, base + 1, ...
    s = sel.to(tl.int32)
    pos = base + tl.cumsum(s, 0) - s
    tl.store(idx_ptr + pos, n.to(tl.int64), mask=sel)
    tl.store(val_ptr + pos, key, mask=sel)


# ===== kernels =====


@_jit
def _small_kernel(key_ptr, idx_ptr, val_ptr, N, K, NP: tl.constexpr, S0: tl.constexpr,
                  W0: tl.constexpr, S1: tl.constexpr, W1: tl.constexpr, S2: tl.constexpr,
                  W2: tl.constexpr, W3: tl.constexpr, PDL: tl.constexpr):
    """Grid (B,); keys [B, N] -> indices, values [B, K], ascending index. One program per row:
    the row in registers, the digit passes (S, W: shift, width; W3 = 0: three passes, else a
    fourth of the low W3 bits) on local histograms, then the compaction."""
    pdl_release(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, NP)
    ok = n < N
    key = tl.load(key_ptr + b * N + n, mask=ok, other=-1)
    u = _rank_hi(key)
    pre, need = _local_pass(u, ok, 0, tl.zeros([], dtype=tl.int64) + K, S0, W0, True)
    pre, need = _local_pass(u, ok, pre, need, S1, W1, False)
    pre, need = _local_pass(u, ok, pre, need, S2, W2, False)
    if W3 > 0:
        pre, need = _local_pass(u, ok, pre, need, 0, W3, False)
    _emit(idx_ptr + b * K, val_ptr + b * K, n, key, _chosen(u, ok, pre, need, 0), 0)


@_jit
def _hist_kernel(key_ptr, hist_ptr, cnt_ptr, st_ptr, N, K, SHIFT: tl.constexpr,
                 BITS: tl.constexpr, PASS: tl.constexpr, CHUNK: tl.constexpr,
                 NCH: tl.constexpr, PDL: tl.constexpr):
    """A pass but the last. Grid (B, NCH); keys [B, N], hist [B, >= 2^BITS] int32 zeros and
    cnt [B] int32 zeros (both left zero), state [B, _ST] int64. Program (b, j) histograms digit
    u >> SHIFT (BITS wide) of its chunk's candidates (keys matching state's prefix of pass
    PASS - 1) into the row's histogram (int32 atomics, nonzero bins); the last of the row to
    arrive picks the digit and stores (prefix, need) of pass PASS."""
    pdl_release(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = n < N
    u = _rank_hi(tl.load(key_ptr + b * N + n, mask=ok, other=-1))
    st = st_ptr + b * _ST
    if PASS == 0:
        pre = tl.zeros([], dtype=tl.int64)
        need = pre + K
    else:
        pre = tl.load(st + 2 * PASS - 2)
        need = tl.load(st + 2 * PASS - 1)
    h = _digit_hist(u, ok, pre, SHIFT, BITS, PASS == 0)
    row = hist_ptr + b * (1 << BITS) + tl.arange(0, 1 << BITS)
    if NCH > 1:
        tl.atomic_add(row, h, mask=h > 0, sem="relaxed")
    if _last_to_arrive(cnt_ptr + b, NCH):
        if NCH > 1:
            h = tl.load(row, cache_modifier=".cg")  # every program's counts (L2)
        d, need = _pick(h, need, 1 << BITS)
        tl.store(st + 2 * PASS, pre * (1 << BITS) + d)
        tl.store(st + 2 * PASS + 1, need)
        if NCH > 1:
            tl.store(row, tl.zeros([1 << BITS], dtype=tl.int32))
            tl.store(cnt_ptr + b, 0)


@_jit
def _final_kernel(key_ptr, cnt_ptr, st_ptr, scr_ptr, N, PASS: tl.constexpr, CHUNK: tl.constexpr,
                  NCH: tl.constexpr, NCHP: tl.constexpr, PDL: tl.constexpr):
    """The last pass (u's low 8 bits). Grid (B, NCH); state of pass PASS - 1 -> T, teq (state
    14, 15) and scratch [B, NCH, _SW] int32. Program (b, j) stores the histogram of its
    candidates' digits and the count of its keys above the prefix (plain stores); the last of
    the row sums the histograms in chunk order, picks T and teq, and stores for every chunk its
    output offset and the number of u == T keys in the chunks before it."""
    pdl_release(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    n = j * CHUNK + tl.arange(0, CHUNK)
    ok = n < N
    u = _rank_hi(tl.load(key_ptr + b * N + n, mask=ok, other=-1))
    st = st_ptr + b * _ST
    pre = tl.load(st + 2 * PASS - 2)
    need = tl.load(st + 2 * PASS - 1)
    bins = tl.arange(0, _LO)
    h = _digit_hist(u, ok, pre, 0, 8, False)
    above = tl.sum((ok & ((u >> 8) > pre)).to(tl.int32), 0)
    mine = scr_ptr + (b * NCH + j) * _SW
    tl.store(mine + bins, h)
    tl.store(mine + _LO, above)
    if NCH == 1:
        tl.debug_barrier()  # the program reads its own stores in another layout
    if _last_to_arrive(cnt_ptr + b, NCH):
        c = tl.arange(0, NCHP)
        c_ok = c < NCH
        rows = scr_ptr + (b * NCH + c) * _SW  # [NCHP] chunk rows
        hh = tl.load(rows[:, None] + bins[None, :], mask=c_ok[:, None], other=0,
                     cache_modifier=".cg")  # [NCHP, _LO]
        d, teq = _pick(tl.sum(hh, 0), need, _LO)
        gt = tl.load(rows + _LO, mask=c_ok, other=0, cache_modifier=".cg") + tl.sum(
            tl.where(bins[None, :] > d, hh, 0), 1)  # per chunk: u > T
        eq = tl.sum(tl.where(bins[None, :] == d, hh, 0), 1)  # per chunk: u == T
        eq_before = tl.cumsum(eq, 0) - eq
        taken = tl.minimum(tl.maximum(teq - eq_before, 0), eq.to(tl.int64))
        cnt = gt + taken
        tl.store(rows + _LO + 1, (tl.cumsum(cnt, 0) - cnt).to(tl.int32), mask=c_ok)
        tl.store(rows + _LO + 2, eq_before.to(tl.int32), mask=c_ok)
        tl.store(st + 14, pre * _LO + d)
        tl.store(st + 15, teq)
        if NCH > 1:
            tl.store(cnt_ptr + b, 0)


@_jit
def _write_kernel(key_ptr, st_ptr, scr_ptr, idx_ptr, val_ptr, N, K, CHUNK: tl.constexpr,
                  NCH: tl.constexpr, PDL: tl.constexpr):
    """Grid (B, NCH); keys, state (T, teq), scratch (offsets) -> indices, values [B, K]:
    program (b, j) compacts its chunk's chosen keys to its offset, in index order."""
    pdl_release(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    n = j * CHUNK + tl.arange(0, CHUNK)
    ok = n < N
    key = tl.load(key_ptr + b * N + n, mask=ok, other=-1)
    st = st_ptr + b * _ST
    mine = scr_ptr + (b * NCH + j) * _SW
    sel = _chosen(_rank_hi(key), ok, tl.load(st + 14), tl.load(st + 15), tl.load(mine + _LO + 2))
    _emit(idx_ptr + b * K, val_ptr + b * K, n, key, sel, tl.load(mine + _LO + 1))


# ===== wrappers =====


@family("qsa")
def topk_keys_triton(keys: Tensor, k: int, chunk: int = CHUNK, small_max: int = SMALL_MAX,
                     digit_bits: int = DIGIT_BITS, num_warps: int | None = None,
                     _edit_state=None, *, kc: KernelConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """(indices [B, k] int64, values [B, k] int64): the k largest of each row of keys [B, N]
    (int64 ranking keys in `qsa.rank_key`'s form: bits(score >= 0) << 32 | (N - 1 - n), or -1),
    in ascending index order; with fewer than k keys >= 0 the first -1 entries fill the row.
    One launch for N <= small_max, else len(digits) + 1 over chunks of `chunk` keys (a power of
    two >= 256, raised to keep <= 64 chunks a row; the interpreter wants few large programs).
    No host sync; 0 <= k <= N.
    `_edit_state(state, idx, val)`, for tests, runs between the last pass and the write."""
    assert keys.dim() == 2 and keys.dtype == torch.int64, "keys [B, N] int64"
    B, N = keys.shape
    assert 0 <= k <= N < 2**31
    dev = keys.device
    idx = torch.empty(B, k, dtype=torch.int64, device=dev)
    val = torch.empty(B, k, dtype=torch.int64, device=dev)
    if k == 0 or B == 0:
        return idx, val
    keys = keys.contiguous()
    dg = digits(digit_bits)
    if N <= small_max:
        npad = max(256, triton.next_power_of_2(N))
        (s0, w0), (s1, w1), (s2, w2) = dg[:3]
        _small_kernel[(B,)](keys, idx, val, N, k, NP=npad, S0=s0, W0=w0, S1=s1, W1=w1, S2=s2,
                            W2=w2, W3=dg[3][1] if len(dg) > 3 else 0,
                            num_warps=num_warps or WARPS, **pdl_launch(keys, kc.pdl))
        return idx, val
    assert chunk >= 256 and chunk & (chunk - 1) == 0, "chunk: a power of two >= 256"
    chunk = max(chunk, triton.next_power_of_2(triton.cdiv(N, 64)))  # <= 64 chunks a row: the
    nch = triton.cdiv(N, chunk)  # last pass's last program holds [nchp, 256] counts
    nchp = max(2, triton.next_power_of_2(nch))
    state = torch.empty(B, ST_W, dtype=torch.int64, device=dev)
    scr = torch.empty(B, nch, SCR_W, dtype=torch.int32, device=dev)
    hist = counters(dev, B * 4096, "topk_select_hist")
    cnt = counters(dev, B, "topk_select")
    w = num_warps or WARPS
    grid = (B, nch)
    for p, (shift, bits) in enumerate(dg[:-1]):
        _hist_kernel[grid](keys, hist, cnt, state, N, k, SHIFT=shift, BITS=bits, PASS=p,
                           CHUNK=chunk, NCH=nch, num_warps=w, **pdl_launch(keys, kc.pdl))
    _final_kernel[grid](keys, cnt, state, scr, N, PASS=len(dg) - 1, CHUNK=chunk, NCH=nch,
                        NCHP=nchp, num_warps=w, **pdl_launch(keys, kc.pdl))
    if _edit_state is not None:
        _edit_state(state, idx, val)
    _write_kernel[grid](keys, state, scr, idx, val, N, k, CHUNK=chunk, NCH=nch, num_warps=w,
                        **pdl_launch(keys, kc.pdl))
    return idx, val


def topk_keys_ref(keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`topk_keys_triton` in torch: torch.topk(sorted=False)'s keys >= 0, then the first
    (k - their count) entries < 0 in index order, all in ascending index order. Static shapes,
    no host sync (graph-capturable)."""
    B, N = keys.shape
    vals, picked = torch.topk(keys, k, dim=-1, sorted=False)
    sel = torch.zeros(B, N, dtype=torch.bool, device=keys.device)
    sel.scatter_(1, picked, vals >= 0)  # distinct indices: the -1 picks write False
    neg = keys < 0
    fill = k - (vals >= 0).sum(-1, keepdim=True)  # [B, 1] -1 entries to take
    sel |= neg & (torch.cumsum(neg, -1) <= fill)
    slot = torch.where(sel, torch.cumsum(sel, -1) - 1, k)  # k: a discard column
    ar = torch.arange(N, device=keys.device).expand(B, N)
    idx = torch.zeros(B, k + 1, dtype=torch.int64, device=keys.device).scatter_(1, slot, ar)
    idx = idx[:, :k].clone(memory_format=torch.contiguous_format)  # [B, k] strides, B = 1 too
    return idx, keys.gather(1, idx)


def topk_keys(keys: Tensor, k: int, *, kc: KernelConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """The k largest ranking keys of each row (indices, values; ascending index): the Triton
    radix select on CUDA (N <= TOPK_MAX_N), else its torch mirror; the same tensors either way."""
    if kc.runs_fused(keys) and keys.shape[-1] <= TOPK_MAX_N:
        return topk_keys_triton(keys, k, kc=kc)
    return topk_keys_ref(keys, k)
