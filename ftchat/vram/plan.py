"""The plan of a workload (docs/design.md section 4.9): the model family's items (its dense
weights, decode state and blocks' transients: ftchat/model/registry.py) and the offload
backend's (slot bank, slot maps, prefill staging, the routed experts' transients), with the
estimates of a decode step, a prefill call, CUDA graph pools and the allocator's slack.

The prefill's estimates are walked through the code and checked against the peaks measured on
the CPU (tests/test_prefill_memory.py); the allocator's slack is calibrated on the H200.

Legend: B rows, L KV capacity (context), T prefill tokens, H hidden, E experts, K top-k,
I expert inner, R row bytes, S slots, N = layers x E, act = bytes of the model dtype.
"""

from __future__ import annotations

import torch

from ftchat.codecs.rows import RowLayout
from ftchat.kernels import moe_prefill
from ftchat.model.family import MemoryFormulas
from ftchat.model.registry import family_of
from ftchat.offload.backend import LEND_STAGING_FACTOR, lends_staging
from ftchat.offload.experts import EXPERT_GROUP
from ftchat.vram.items import MIB, Item, VramPlan, Workload, human

# Assumed, not measured: PyTorch's cuBLAS workspace on Hopper (32 MiB) on each stream that runs a
# GEMM: compute, the predictor, and the side stream of the graph warm-up.
CUBLAS_WORKSPACE_BYTES = 32 * MIB
GEMM_STREAMS = 3
# The CUDA caching allocator's slack, as a fraction of the largest block of transients (a
# prefill block, or the decode step's largest term): memory it holds in free cached blocks that
# the next requests cannot use whole. Why it scales with the transients, not with the weights,
# KV or slot bank (allocated once, before them): what outlives a block (the residual stream R,
# h, y) is carved from the segments the previous block's transients left cached, and pins
# them; the next block's largest requests then need new segments while those stay reserved
# (partly free). Two H200 runs with expandable segments (docs/performance.md): chunk 2,048 and
# 700 slots held 688 MiB reserved but free, 0.59 of that run's largest block (the fp8 attention
# chunk, 1,172 MiB planned); chunk 4,096, 1,100 slots at 255K held 679 MiB with a largest block
# of only 493 MiB (1.38 of it), and at the plan's 1,270 slots ran out with ~0.55 GiB held. A
# 4,096-token run without expandable segments ran out of memory with 0.98 GiB reserved but free,
# ~0.5 of its largest block then (the unblocked GDN prefill). The gap stayed ~0.68 GiB while the
# largest block shrank 2.4x, so the term is the larger of the fraction and a floor near both
# measurements. Re-measure when the allocator settings or the prefill's shapes change.
ALLOCATOR_SLACK = 0.6
ALLOCATOR_SLACK_MIN = 700 * 2**20


def _memory(a) -> MemoryFormulas:
    return family_of(a).memory


# ===== the offload backend =====


def _copy_plans(a, act: int, w: Workload) -> int:
    """Bytes of the plans (and router input) the backend keeps per layer until that layer's
    next step: demand slots [B, K] i32, src [M] i64, dst [M] i32, count; prefetch src/dst/count;
    x [B, H]."""
    B, K = w.batch, a.num_experts_per_tok
    M, budget = B * K, 8  # budgets above 8 are rare; a larger one adds 12 B a slot
    per_layer = B * K * 4 + M * 12 + 4 + budget * 12 + 4 + B * a.hidden_size * act
    return a.num_hidden_layers * per_layer


def expert_side_items(a, layout: RowLayout, dtype: torch.dtype, w: Workload,
                      slots: int) -> list[Item]:
    """The offload backend but its bank: slot maps, prefill staging, kept plans (and the
    resident rows of bench's resident arms)."""
    N, E, R, L = a.num_hidden_layers * a.num_experts, a.num_experts, layout.nbytes, \
        a.num_hidden_layers
    C, nb = min(w.candidates, E), len(w.banks)
    sizes = [slots if s is None else s for s in w.banks]
    maps = sum((N + 1) * 4 + (s + 1) * (4 + 8) + 8 + 4 * L * 8 + L * 3 * 8 + L * C * 8
               for s in sizes)
    out = []
    if w.resident_rows:
        out.append(Item("resident expert rows", N * R, f"bench's resident arms: {N:,} rows x "
                        f"{R:,} B"))
    own = [s for s in sizes if not lends_staging(s, E)]  # banks too small to lend E+1 slots
    # the rows (banks that keep their own) and two int64 row counters per bank
    staging = (len(own) * (E + 1) * R + nb * 2 * 8) if w.cuda else 0
    if not w.cuda:
        how = "none: CPU prefill reads the host rows"
    elif own:
        how = (f"{len(own)} x [{E + 1}, {R:,}] u8 (CUDA prefill copies each layer's experts "
               f"here; a bank of >= {LEND_STAGING_FACTOR * (E + 1):,} slots lends its own)")
    else:
        how = (f"no rows: each bank lends its last {E + 1} slots (>= "
               f"{LEND_STAGING_FACTOR * (E + 1):,} slots), emptied at each prefill call")
    out += [
        Item("prefill staging", staging, how),
        Item("slot maps", maps, f"{nb} bank(s): slot_of [{N + 1}] i32, id_of/key [S+1] i32/i64, "
             "clock, counters, measure and candidate buffers"),
        Item("copy plans (estimate)", nb * _copy_plans(a, dtype.itemsize, w),
             "per layer, kept until its next step: demand/prefetch plans and the router input",
             exact=False),
    ]
    return out


def bank_item(layout: RowLayout, w: Workload, slots: int) -> Item:
    sizes = [slots if s is None else s for s in w.banks]
    R = layout.nbytes
    shown = ", ".join(f"{s:,}" for s in sizes)
    return Item("expert slot bank", sum((s + 1) * R for s in sizes),
                f"({shown}) slots + 1 sink row each, x {R:,} B ({layout.kind} row)", grows="slots")


# ===== the routed experts' transients (an estimate) =====


def dequant_bytes(layout: RowLayout, act: int, a, experts: int, T: int, cuda: bool) -> int:
    """The torch expert path's transients for `experts` experts at a time over T tokens
    (offload/experts.py): the rows gathered; NVFP4 rows dequantized, on CUDA by one kernel
    straight to the model dtype (kernels/nvfp4_dequant.py), on the CPU in fp32 (codes, values,
    scales, product: ~24 B per element of gate_up), then cast; float rows cast (no copy when the
    dtype is the same); plus the [T*K, D] pair buffer (inputs, then products)."""
    H, I = a.hidden_size, a.moe_intermediate_size
    rows = experts * layout.nbytes  # the rows gathered from the bank (a copy)
    pairs = T * a.num_experts_per_tok * H * act
    if layout.kind == "nvfp4":
        fp32 = 0 if cuda else experts * 2 * I * H * 32
        return rows + fp32 + experts * 3 * I * H * act + pairs
    return rows + (0 if layout.dtype.itemsize == act else experts * 3 * I * H * act) + pairs


def moe_prefill_bytes(a, layout: RowLayout, dtype: torch.dtype, T: int, cuda: bool
                      ) -> tuple[int, str]:
    """Peak bytes of the MoE block's prefill of T tokens above its input, and how the routed
    experts run. Routing (route_ref: logits and fp32 probabilities [T, E], then ids int64,
    weights, the backend's slot ids int32 [T, K] kept) and the shared expert's output [T, D]
    (its swiglu temporaries before) stay for the routed experts. Those: on CUDA the grouped
    Triton kernels (kernels/moe_prefill.py, when `supports` takes the call): the split-parity x
    copy [T, D], h [T*K, I] and y [T*K, D] bf16, the sorted pair order int64 and the token /
    pair ids int32 [T*K], the per-token order and the output [T, D]; else the torch path
    (offload/experts.py: `dequant_bytes`, EXPERT_GROUP experts at a time)."""
    act, D, E, K = dtype.itemsize, a.hidden_size, a.num_experts, a.num_experts_per_tok
    I, Is = a.moe_intermediate_size, a.shared_expert_intermediate_size
    kept = T * (K * (8 + act + 4) + act * D)  # ids, weights, slots; the shared expert's output
    x = torch.empty(0, D, dtype=dtype, device="meta")
    if cuda and moe_prefill.supports(x, layout):
        parity = act * D if layout.kind == "nvfp4" else 0
        routed = T * (parity + K * (2 * I + 2 * D + 16) + K * 20 + 2 * D)
        how = "grouped Triton kernels"
    else:
        U = min(E, T * K)
        routed = dequant_bytes(layout, act, a, min(U, EXPERT_GROUP), T, cuda) + T * (
            K * 40 + 2 * act * D)  # + the sort, the per-token order, the sum and its term
        how = f"torch path, {EXPERT_GROUP} experts at a time"
    return max(T * E * (act + 4),  # routing
               T * (K * (8 + act + 4)) + T * act * (3 * Is + D),  # shared expert
               kept + routed,
               kept + 2 * T * act * D), how  # the routed and shared outputs summed


# ===== a decode step, a prefill call =====


def decode_workspace(a, layout: RowLayout, act: int, B: int, L: int, fused: bool
                     ) -> dict[str, int]:
    """Transient bytes of one decode step of B rows at KV capacity L, by term (an estimate):
    the family's, and the routed experts' (the fused decode kernels' fp32 intermediates on
    CUDA at <= 8 rows, else the torch path's)."""
    K, I, H = a.num_experts_per_tok, a.moe_intermediate_size, a.hidden_size
    experts = (B * K * (2 * I + H) * 4 if fused and B <= 8
               else dequant_bytes(layout, act, a, min(a.num_experts, B * K, EXPERT_GROUP), B,
                                  fused))
    return {**_memory(a).decode_terms(a, act, B, L), "routed experts": experts}


def prefill_workspace(a, layout: RowLayout, act: int, T: int, L: int, fused: bool,
                      dense_nvfp4: bool = False, fp8: bool = False,
                      dtype: torch.dtype | None = None) -> dict[str, int]:
    """Transient bytes of one prefill call of T tokens of one sequence ending at KV length L
    (an estimate); T == 1 is the decode path. The largest block of a layer (one block's
    transients at a time) on top of what the forward holds across the blocks (the family's
    stream bytes), and the last position's logits [1, V] (Decoder.prefill; the sampler's copies
    come after the layers' transients are freed). dtype: the model dtype (None: bf16 for act 2,
    else fp32); fp8: K/V stored in fp8; dense_nvfp4: the GDN qkv / z kept in NVFP4."""
    if T == 1:
        return decode_workspace(a, layout, act, 1, L, fused)
    dtype = dtype or (torch.bfloat16 if act == 2 else torch.float32)
    mem = _memory(a)
    moe, how = moe_prefill_bytes(a, layout, dtype, T, fused)
    blocks = {**mem.prefill_blocks(a, act, T, L, fused, dense_nvfp4, fp8, dtype),
              f"MoE ({layout.kind} experts, {how})": moe}
    top = max(blocks, key=blocks.get)
    return {top: blocks[top], "residual stream": T * mem.stream_bytes(a, act),
            "logits": a.vocab_size * act}


def workspace_items(a, layout: RowLayout, dtype: torch.dtype, w: Workload) -> list[Item]:
    act, L = dtype.itemsize, w.context
    T = min(w.prefill_tokens, L)
    dec = decode_workspace(a, layout, act, w.batch, L, w.cuda)

    def pre_at(kv: int) -> dict[str, int]:  # a call of up to T tokens ending at KV length kv
        return prefill_workspace(a, layout, act, min(T, kv), kv, w.cuda, w.dense_nvfp4,
                                 w.kv_cache_dtype == "fp8", dtype)
    # the KV length where the call peaks (the first of equals), among the family's candidates
    at = L
    pre = pre_at(L)
    for kv in _memory(a).prefill_lengths(a, L)[1:] if T > 1 else ():
        other = pre_at(kv)
        if sum(other.values()) > sum(pre.values()):
            pre, at = other, kv
    d, p = sum(dec.values()), sum(pre.values())
    cublas = CUBLAS_WORKSPACE_BYTES * GEMM_STREAMS if w.cuda else 0
    top = max(pre, key=pre.get)
    items = []
    if w.cuda and w.graphs:
        pool = sum(sum(decode_workspace(a, layout, act, b, L, True).values()) for b in w.decoders)
        items.append(Item("CUDA graph pools (estimate)", pool,
                          f"{len(w.decoders)} graph(s): each keeps its decode step's transients "
                          "(the decode workspace of its rows)", exact=False, grows="context"))
    items.append(Item(
        "activations and workspaces (estimate)", max(d, p) + cublas,
        f"max(prefill of {min(T, at):,} tokens at {at:,}: {human(p)}, largest block {top} "
        f"{human(pre[top])}; decode step of {w.batch} row(s): {human(d)})"
        + (f" + cuBLAS {GEMM_STREAMS} x {CUBLAS_WORKSPACE_BYTES // MIB} MiB (assumed)"
           if cublas else ""), exact=False, grows="context"))
    if w.cuda:
        block = max(pre[top], max(dec.values()))
        items.append(Item(
            "allocator slack (estimate)", max(int(ALLOCATOR_SLACK * block), ALLOCATOR_SLACK_MIN),
            f"max({ALLOCATOR_SLACK:g} x the largest block of transients ({human(block)}), "
            f"{human(ALLOCATOR_SLACK_MIN)}): free cached blocks the caching allocator cannot "
            "hand out whole (measured 688 and 679 MiB in two H200 runs; "
            "vram/plan.py ALLOCATOR_SLACK)", exact=False, grows="context"))
    return items


# ===== the plan =====


def plan(a, layout: RowLayout, dtype: torch.dtype, w: Workload, slots: int) -> VramPlan:
    """Every item at `slots` slots per bank sized to fit (banks with a given size keep it).

    Order: dense weights, the estimates, the decode state, the backend, the slot bank last. A
    refusal names the item where the running sum passes the budget, so a context too long for
    the budget is pinned on the (exact) KV item, not on an estimate that follows it."""
    mem = _memory(a)
    items = [*mem.dense_items(a, dtype, w.cuda, w.dense_nvfp4),
             *workspace_items(a, layout, dtype, w), *mem.state_items(a, dtype, w),
             *expert_side_items(a, layout, dtype, w, slots), bank_item(layout, w, slots)]
    return VramPlan(tuple(items), slots, layout.nbytes, a.num_hidden_layers * a.num_experts,
                    w.batch * a.num_experts_per_tok)
