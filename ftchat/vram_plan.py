"""The VRAM plan (docs/design.md section 4.9): what a run allocates on its compute device, item
by item, from config.json and the safetensors headers (or a synthetic model's config) before any
tensor is loaded, and how many expert slots fit in what a budget leaves.

Exact items are dtype x shape of the tensors the loader, DecodeState and the offload backend
create (tests/test_vram_plan.py checks them against real allocations of a tiny model). Estimates
(activations, workspaces, CUDA graph pools) say so and give their formula; they are not measured.

Legend: B rows, L KV capacity (context), T prefill tokens, V vocab, H hidden, E experts, K top-k,
I expert inner, R row bytes, S slots, N = layers x E, act = bytes of the model dtype.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ftchat.engine import PLE_ON_DEVICE_BYTES, PREFILL_CHUNK
from ftchat.errors import FtchatError
from ftchat.model.config import ModelArgs
from ftchat.model.nvfp4 import Nvfp4Weight, nvfp4_bytes
from ftchat.model.rows import RowLayout
from ftchat.model.spec import dense_specs
from ftchat.offload.experts import EXPERT_GROUP

if TYPE_CHECKING:
    from ftchat.engine import LoadedModel
    from ftchat.settings import Settings

GIB = 2**30
MIB = 2**20
DEFAULT_CONTEXT = 32768  # KV capacity when --context is not given (and the model allows it)
# Assumed, not measured: PyTorch's cuBLAS workspace on Hopper (32 MiB) on each stream that runs a
# GEMM: compute, the predictor, and the side stream of the graph warm-up.
CUBLAS_WORKSPACE_BYTES = 32 * MIB
GEMM_STREAMS = 3
PROMPT_BOUND = 512  # verify's cold prompts (a nonce and a short question) are far shorter
SHARD = ".ngram_embedding.shard_"
DENSE_KINDS = ("embedding", "lm_head", "GDN projections", "attention projections",
               "router and shared expert", "hyper-connection mixers", "PLE projections", "norms",
               "PLE n-gram table")


@dataclass(frozen=True)
class Workload:
    """What a run allocates besides the weights; every field changes some item."""

    context: int  # KV capacity per sequence (L)
    decoders: tuple[int, ...] = (1,)  # rows of each DecodeState alive together
    banks: tuple[int | None, ...] = (None,)  # slot banks alive together; None: sized to fit
    prefill_tokens: int = PREFILL_CHUNK  # tokens of one prefill call (T; bench prefills 1)
    cuda: bool = True  # the prefill staging area and cuBLAS workspaces exist on CUDA only
    graphs: bool = True  # one CUDA graph (and its private pool) per decoder
    resident_rows: bool = False  # every expert row on the device too (bench's resident arms)
    candidates: int = 16  # router-lookahead top-C (the backend's cands buffer)
    dense_nvfp4: bool = False  # the GDN qkv / z kept in NVFP4 (an NVFP4 checkpoint stores them so)
    kv_cache_dtype: str = "auto"  # K/V storage: auto (the model dtype) or fp8 (codes + scales)

    @property
    def batch(self) -> int:
        return max(self.decoders)


@dataclass(frozen=True)
class Item:
    """One allocation, or a group of alike ones. grows: what makes it smaller (the advice of a
    refusal): "context", "slots", or "" (only a larger budget helps)."""

    name: str
    nbytes: int
    note: str
    exact: bool = True
    grows: str = ""


@dataclass(frozen=True)
class VramPlan:
    items: tuple[Item, ...]  # in allocation order; the slot bank last
    slots: int  # slots of each bank sized to fit (or of every bank when all are given)
    row_bytes: int  # one expert row as the slot bank stores it
    total_experts: int  # N
    need: int  # the fewest slots a bank may have: batch x top-k

    @property
    def total(self) -> int:
        return sum(i.nbytes for i in self.items)

    def dense_bytes(self) -> int:
        return sum(i.nbytes for i in self.items if i.name in DENSE_KINDS)


# ===== items =====


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def dense_kind(name: str) -> str:
    """The plan item a dense tensor (checkpoint name, prefix stripped) belongs to."""
    if name == "embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if SHARD in name or name.endswith(".ngram_embedding.weight"):
        return "PLE n-gram table"
    if "norm" in name.rsplit(".", 2)[-2]:
        return "norms"
    for part, kind in ((".linear_attn.", "GDN projections"),
                       (".self_attn.", "attention projections"),
                       (".mlp.", "router and shared expert"),
                       ("hyper_connection", "hyper-connection mixers"),
                       (".ple.", "PLE projections")):
        if part in name:
            return kind
    raise AssertionError(name)


def table_on_device(a: ModelArgs, act: int) -> tuple[int, bool]:
    """(bytes of the n-gram table at act, whether load_model puts it on the device)."""
    n = sum(_numel(s.shape) for name, s in dense_specs(a).items() if SHARD in name)
    return n * act, n * act <= PLE_ON_DEVICE_BYTES


def dense_items(a: ModelArgs, dtype: torch.dtype, cuda: bool = True,
                dense_nvfp4: bool = False) -> list[Item]:
    """The dense weights as load_model leaves them: every float at the model dtype (NVFP4 ones
    dequantized, but with dense_nvfp4 the GDN qkv / z, kept packed: nvfp4.Nvfp4Weight), int64
    buffers kept; the load-time fusions only concatenate (row views). On CUDA the embedding
    stays in pinned host memory (ftchat/model/embedding.py)."""
    act = dtype.itemsize
    by_kind = dict.fromkeys(DENSE_KINDS, 0)
    for name, spec in dense_specs(a).items():
        if SHARD in name:
            continue
        if dense_nvfp4 and spec.kept_nvfp4:
            by_kind[dense_kind(name)] += nvfp4_bytes(*spec.shape)
        else:
            by_kind[dense_kind(name)] += _numel(spec.shape) * (8 if spec.init == "int64" else act)
    by_kind["lm_head"] = a.vocab_size * a.hidden_size * act
    embed = by_kind["embedding"]
    if cuda:
        by_kind["embedding"] = 0
    table, on_device = table_on_device(a, act)
    by_kind["PLE n-gram table"] = table if on_device else 0
    n_gdn = sum(not a.is_attention(i) for i in range(a.num_hidden_layers))
    n_attn = a.num_hidden_layers - n_gdn
    dt = str(dtype).removeprefix("torch.")
    notes = {
        "embedding": (f"in host memory (pinned; [{a.vocab_size}, {a.hidden_size}] at {dt}, "
                      f"{embed / GIB:,.2f} GiB): a decode step reads one row over UVA, 0 B of "
                      "VRAM" if cuda else f"[{a.vocab_size}, {a.hidden_size}] at {dt}"),
        "lm_head": f"[{a.vocab_size}, {a.hidden_size}] at {dt}",
        "GDN projections": (f"{n_gdn} GDN layers: in_proj qkv/z in NVFP4 (kept packed), b/a, "
                            f"out_proj, conv1d, A_log, dt_bias at {dt}" if dense_nvfp4 else
                            f"{n_gdn} GDN layers: in_proj qkv/z/b/a, out_proj, conv1d, A_log, "
                            f"dt_bias at {dt} (NVFP4 ones dequantized at load)"),
        "attention projections": f"{n_attn} attention layers: q/k/v/o and the QSA index "
                                 f"projection at {dt}",
        "router and shared expert": f"{a.num_hidden_layers} layers: router [{a.num_experts}, "
                                    f"{a.hidden_size}], shared expert and its gate at {dt}",
        "hyper-connection mixers": f"{2 * a.num_hidden_layers + 1} mixers (down, up, inject)",
        "PLE projections": f"PLE layer(s) {list(a.ple_layer_ids)}: key/value projections, conv, "
                           "int64 hash buffers",
        "norms": "every RMSNorm weight (hc, q/k, GDN, indexer, PLE)",
        "PLE n-gram table": (f"on the device ({table / MIB:,.1f} MiB <= "
                             f"{PLE_ON_DEVICE_BYTES // GIB} GiB at {dt})" if on_device else
                             f"in host memory (pinned on CUDA; {table / GIB:,.1f} GiB at {dt} "
                             f"> {PLE_ON_DEVICE_BYTES // GIB} GiB): 0 B of VRAM"),
    }
    return [Item(k, by_kind[k], notes[k]) for k in DENSE_KINDS if k != "PLE n-gram table"
            or a.ple_layer_ids]


def state_items(a: ModelArgs, dtype: torch.dtype, w: Workload) -> list[Item]:
    """DecodeState.create of every decoder (docs/model.md 8)."""
    act, rows, L = dtype.itemsize, sum(w.decoders), w.context
    n_attn = sum(a.is_attention(i) for i in range(a.num_hidden_layers))
    n_gdn = a.num_hidden_layers - n_attn
    Hkv, hd, di, r = a.num_key_value_heads, a.head_dim, a.indexer_head_dim, a.indexer_compress_ratio
    Hk, Hv, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                      a.linear_value_head_dim)
    conv_dim, Kc = 2 * Hk * dk + Hv * dv, a.linear_conv_kernel_dim
    n_ple, hcD = len(a.ple_layers), a.hc_count * a.hidden_size
    ple_cols = (a.ple_conv_kernel_size - 1) * a.ngram_size
    who = f"{rows} row(s) x {L:,} tokens" + (f" (decoders of {', '.join(map(str, w.decoders))} "
                                              "rows)" if len(w.decoders) > 1 else "")
    kv = (Item("KV cache (K and V)", n_attn * rows * L * 2 * Hkv * (hd + 4),
               f"{n_attn} attention layers x {who} x 2 x ([{Hkv}, {hd}] fp8 + [{Hkv}] fp32 "
               "scales)", grows="context")
          if w.kv_cache_dtype == "fp8" else
          Item("KV cache (K and V)", n_attn * rows * L * 2 * Hkv * hd * act,
               f"{n_attn} attention layers x {who} x 2 x [{Hkv}, {hd}] x {act} B",
               grows="context"))
    return [
        kv,
        Item("QSA index keys", n_attn * rows * L * di * act,
             f"raw index keys: {n_attn} layers x {rows} x {L:,} x {di} x {act} B",
             grows="context"),
        Item("QSA block keys", n_attn * rows * (L // r) * di * act,
             f"compressed keys: {n_attn} layers x {rows} x {L // r:,} blocks x {di} x {act} B",
             grows="context"),
        Item("GDN recurrent state", n_gdn * rows * Hv * dk * dv * 4,
             f"{n_gdn} GDN layers x {rows} x [{Hv}, {dk}, {dv}] fp32"),
        Item("GDN conv state", n_gdn * rows * conv_dim * (Kc - 1) * act,
             f"{n_gdn} layers x {rows} x [{conv_dim}, {Kc - 1}] x {act} B"),
        Item("PLE state", n_ple * rows * hcD * ple_cols * act + rows * (a.ngram_size - 1) * 8,
             f"conv columns {n_ple} x {rows} x [{hcD}, {ple_cols}] x {act} B, n-gram context "
             "int64"),
    ]


def _copy_plans(a: ModelArgs, act: int, w: Workload) -> int:
    """Bytes of the plans (and router input) the backend keeps per layer until that layer's
    next step: demand slots [B, K] i32, src [M] i64, dst [M] i32, count; prefetch src/dst/count;
    x [B, H]."""
    B, K = w.batch, a.num_experts_per_tok
    M, budget = B * K, 8  # budgets above 8 are rare; a larger one adds 12 B a slot
    per_layer = B * K * 4 + M * 12 + 4 + budget * 12 + 4 + B * a.hidden_size * act
    return a.num_hidden_layers * per_layer


def expert_side_items(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, w: Workload,
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
    staging = nb * ((E + 1) * R + 2 * 8) if w.cuda else 0
    out += [
        Item("prefill staging", staging,
             f"{nb} x [{E + 1}, {R:,}] u8 (CUDA prefill copies each layer's experts here)"
             if w.cuda else "none: CPU prefill reads the host rows"),
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


# ===== estimates: activations, workspaces, graph pools =====


def _dequant_bytes(layout: RowLayout, act: int, a: ModelArgs, experts: int, T: int,
                   cuda: bool) -> int:
    """The torch expert path's transients for `experts` experts at a time over T tokens
    (offload/experts.py): the rows gathered; NVFP4 rows dequantized, on CUDA by one kernel
    straight to the model dtype (kernels/nvfp4_dequant.py), on the CPU in fp32 (codes, values,
    scales, product: ~24 B per element of gate_up), then cast; float rows cast (no copy when the
    dtype is the same); plus the [T*K, D] pair buffer (inputs, then products)."""
    H, I = a.hidden_size, a.moe_intermediate_size
    rows = experts * layout.nbytes  # the rows gathered from the bank (a copy)
    pairs = T * a.num_experts_per_tok * H * act
    if layout.kind == "nvfp4":
        fp32 = 0 if cuda else experts * 2 * I * H * 24
        return rows + fp32 + experts * 3 * I * H * act + pairs
    return rows + (0 if layout.dtype.itemsize == act else experts * 3 * I * H * act) + pairs


def decode_workspace(a: ModelArgs, layout: RowLayout, act: int, B: int, L: int,
                     fused: bool) -> dict[str, int]:
    """Transient bytes of one decode step of B rows at KV capacity L, by term (an estimate)."""
    V, H, hcD = a.vocab_size, a.hidden_size, a.hc_count * a.hidden_size
    Hq, Hkv, hd, Hi, di, r = (a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                              a.indexer_n_heads, a.indexer_head_dim, a.indexer_compress_ratio)
    Hk, Hv, dk = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim
    K, I = a.num_experts_per_tok, a.moe_intermediate_size
    widths = (2 * Hk * dk + 2 * Hv * dk + 2 * Hv, Hq * 2 * hd + 2 * Hkv * hd + (Hi + 1) * di,
              2 * a.shared_expert_intermediate_size + 1)
    S = a.indexer_budget + r - 1
    experts = (B * K * (2 * I + H) * 4 if fused and B <= 8
               else _dequant_bytes(layout, act, a, min(a.num_experts, B * K, EXPERT_GROUP), B,
                                   fused))
    return {
        "logits": 2 * B * V * act,  # the step's, and the copy decode yields under a graph
        "residual": 6 * B * hcD * act,  # R in and out, normed copies
        "projection": B * max(widths) * act,
        "QSA block scores": B * (L // r) * (di * 4 + 2 * Hi * 4 + 4 + 16),  # k̄ fp32, ReLU, keys
        "QSA attention": B * S * (2 * Hkv * hd * act + 2 * Hq * hd * act + Hq * (2 * act + 4)),
        "routed experts": experts,
        "GDN": 2 * B * Hv * dk * a.linear_value_head_dim * 4,  # torch path: state-sized temps
    }


def _prefill_attention(a: ModelArgs, act: int, T: int, L: int, cuda: bool) -> int:
    """Peak bytes of one attention layer's prefill of T > 1 queries at KV length L."""
    from ftchat.model import qsa

    Hq, Hkv, hd, Hi, r = (a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                          a.indexer_n_heads, a.indexer_compress_ratio)
    top, N = a.indexer_budget // r, L // r
    causal = T * L + 2 * Hq * L * hd * act + Hq * T * L * (2 * act + 4)  # `attend` over [T, L]
    if N <= top:  # every complete block selected: plain causal attention over L
        return causal
    # the sparse prefill, in query chunks
    tq, S = qsa.prefill_query_chunk(T, L, a, "cuda" if cuda else "cpu"), top * r + r - 1
    per_query = (N * (2 * Hi * 4 + 4 + 1)  # block scores and their ReLU, fp32; completeness
                 + S * (2 * Hkv * hd * act + Hq * (2 * act + 4) + 9))  # K/V gathered, scores
    return tq * per_query + 2 * T * Hq * hd * act  # + the chunk outputs and their concatenation


def prefill_workspace(a: ModelArgs, layout: RowLayout, act: int, T: int, L: int,
                      fused: bool) -> dict[str, int]:
    """Transient bytes of one prefill call of T tokens of one sequence ending at KV length L
    (an estimate); T == 1 is the decode path."""
    if T == 1:
        return decode_workspace(a, layout, act, 1, L, fused)
    V, hcD = a.vocab_size, a.hc_count * a.hidden_size
    Hk, Hv, dk = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim
    U = min(a.num_experts, T * a.num_experts_per_tok)
    layers = {"attention": _prefill_attention(a, act, T, L, fused),
              f"routed experts of {U} ({layout.kind}, torch path, {EXPERT_GROUP} at a time)":
                  _dequant_bytes(layout, act, a, min(U, EXPERT_GROUP), T, fused),
              "GDN chunked": 16 * T * (2 * Hk * dk + 2 * Hv * dk)}  # fp32 chunk tensors
    top = max(layers, key=layers.get)  # one layer's transients at a time
    # logits: [1, V], the last position's (Decoder.prefill); the sampler's fp32 / int64 rows of
    # them come after the layers' transients are freed, so they do not add to this peak
    return {top: layers[top], "residual": 6 * T * hcD * act, "logits": V * act}


def _human(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _gib_up(n: int) -> str:
    """A budget in GiB that holds n bytes (rounded up: it is a value to pass)."""
    return f"{math.ceil(n / GIB * 100) / 100:.2f} GiB"


def workspace_items(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, w: Workload
                    ) -> list[Item]:
    act, L = dtype.itemsize, w.context
    T = min(w.prefill_tokens, L)
    dec = decode_workspace(a, layout, act, w.batch, L, w.cuda)
    pre = prefill_workspace(a, layout, act, T, L, w.cuda)
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
        f"max(prefill of {T:,} tokens at {L:,}: {_human(p)}, largest term {top} "
        f"{_human(pre[top])}; decode step of {w.batch} row(s): {_human(d)})"
        + (f" + cuBLAS {GEMM_STREAMS} x {CUBLAS_WORKSPACE_BYTES // MIB} MiB (assumed)"
           if cublas else ""), exact=False, grows="context"))
    return items


# ===== the plan =====


def plan(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, w: Workload, slots: int) -> VramPlan:
    """Every item at `slots` slots per bank sized to fit (banks with a given size keep it).

    Order: dense weights, the estimates, the decode state, the backend, the slot bank last. A
    refusal names the item where the running sum passes the budget, so a context too long for
    the budget is pinned on the (exact) KV item, not on an estimate that follows it."""
    items = [*dense_items(a, dtype, w.cuda, w.dense_nvfp4),
             *workspace_items(a, layout, dtype, w), *state_items(a, dtype, w), *expert_side_items(a, layout, dtype, w, slots),
             bank_item(layout, w, slots)]
    return VramPlan(tuple(items), slots, layout.nbytes, a.num_hidden_layers * a.num_experts,
                    w.batch * a.num_experts_per_tok)


def slots_that_fit(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, w: Workload,
                   budget: int) -> int:
    """Slots per auto-sized bank within `budget` bytes (the plan is linear in them), at most
    N; 0 when not even an empty bank fits (or no bank is auto-sized)."""
    base = plan(a, layout, dtype, w, 0).total
    per = plan(a, layout, dtype, w, 1).total - base
    if per == 0 or budget < base:
        return 0
    return min(a.num_hidden_layers * a.num_experts, (budget - base) // per)


def max_context(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, w: Workload, budget: int,
                slots: int) -> int:
    """The longest context whose plan at `slots` slots fits `budget` (0: none)."""
    def fits(c: int) -> bool:
        v = dataclasses.replace(w, context=c)
        return plan(a, layout, dtype, v, slots).total <= budget

    lo, hi = 0, w.context  # fits(lo) or lo == 0; hi: the one asked (it does not fit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo if lo and fits(lo) else 0


def check(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, w: Workload,
          budget: int | None, flag: str = "--vram-budget") -> VramPlan:
    """The plan of a run, or FtchatError (one line) naming the item that does not fit and what
    would make it fit. Banks sized to fit get as many slots as the budget leaves; without a budget
    only given slot counts are checked (against batch x top-k)."""
    need, total = w.batch * a.num_experts_per_tok, a.num_hidden_layers * a.num_experts
    given = [s for s in w.banks if s is not None]
    for s in given:
        if s < need:
            raise FtchatError(f"{s} expert slots are fewer than batch size x top-k = {need} "
                              f"({w.batch} x {a.num_experts_per_tok}): give --slots {need} or "
                              "more (or more --expert-vram)")
    if budget is None:
        return plan(a, layout, dtype, w, total)
    auto = any(s is None for s in w.banks)
    p = plan(a, layout, dtype, w, need if auto else max(given, default=0))
    if p.total > budget:
        raise FtchatError(_refusal(a, layout, dtype, w, budget, p, flag))
    if not auto:
        return p
    return plan(a, layout, dtype, w, slots_that_fit(a, layout, dtype, w, budget))


def _refusal(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, w: Workload, budget: int,
             p: VramPlan, flag: str) -> str:
    """The one line: the item where the running sum passes the budget, and the way out."""
    line = _refusal_line(a, layout, dtype, w, budget, p, flag)
    largest = max(p.items, key=lambda i: i.nbytes)
    if largest.nbytes > budget // 2 and f" {largest.name} " not in line:
        line += f"; the largest item: {largest.name}, {_human(largest.nbytes)}"
    return line


def _refusal_line(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, w: Workload,
                  budget: int, p: VramPlan, flag: str) -> str:
    gib = f"{flag} {budget / GIB:.4g} GiB".strip()  # flag "": a budget of `info --vram`
    run, item = 0, p.items[-1]
    for it in p.items:
        run += it.nbytes
        if run > budget:
            item = it
            break
    auto = any(s is None for s in w.banks)
    slots = p.slots if auto else 0
    bigger = f"raise {flag or 'the budget'} to {_gib_up(p.total)}"
    if item.name in DENSE_KINDS:
        return (f"{gib} is too small for the dense weights ({_human(p.dense_bytes())}; the "
                f"sum passes the budget at {item.name}), which do not shrink with fewer slots or "
                f"a shorter context: {bigger} (the whole plan at --context {w.context:,} with "
                f"{p.need} slots)")
    c = max_context(a, layout, dtype, w, budget, slots)
    shorter = f"--context {c:,} or less fits" if c else "no --context fits"
    fit = slots_that_fit(a, layout, dtype, w, budget) if auto else 0
    if item.grows == "slots":
        given = [s for s in w.banks if s is not None]
        if not auto:
            most = slots_that_fit(a, layout, dtype, dataclasses.replace(
                w, banks=(None,) * len(w.banks)), budget)
            return (f"--slots {max(given):,} do not fit in {gib} (the plan needs "
                    f"{_human(p.total)}): at most {most:,} fit (--slots {most}), or "
                    f"{shorter} with {max(given):,} slots, or {bigger}")
        return (f"{gib} leaves room for {fit:,} expert slots, fewer than batch size x top-k = "
                f"{p.need} (at --context {w.context:,}): {shorter} with {p.need} slots"
                + (", or a smaller --batch-size" if w.batch > 1 else "") + f", or {bigger}")
    why = f": {item.note}" if not item.exact else ""  # what an estimate is made of
    return (f"{gib} does not fit {item.name} at --context {w.context:,} ({_human(item.nbytes)}"
            f"{why}; the plan reaches {_human(run)} there): {shorter} with {p.need} "
            f"expert slots, or {bigger}")


# ===== inputs: a checkpoint folder, a synthetic preset, a loaded model =====


def checkpoint_inputs(folder: str | Path) -> tuple[ModelArgs, RowLayout]:
    """Args and row layout from config.json and the safetensors headers (no tensor read)."""
    from ftchat.model.checkpoint import Checkpoint

    ck = Checkpoint(folder)
    ck.check_shapes()  # the plan comes from config.json: it must describe these weights
    return ck.args, ck.row_layout()


def checkpoint_dense_nvfp4(folder: str | Path) -> bool:
    """Whether loading `folder` keeps the GDN qkv / z in NVFP4 (Workload.dense_nvfp4), from the
    safetensors headers."""
    from ftchat.model.checkpoint import Checkpoint

    return Checkpoint(folder).kept_nvfp4()


def synthetic_inputs(preset: str, layers: int | None, fmt: str, dense: str = "bf16"
                     ) -> tuple[ModelArgs, RowLayout]:
    """Args and row layout of the model `ftchat synth` (or bench --synthetic) would build."""
    from ftchat.model.synth import FORMATS, check_dense
    from ftchat.model.synth_memory import model_args, row_layout

    if fmt not in FORMATS:
        raise FtchatError(f"--format {fmt!r}: expected {', '.join(FORMATS)}")
    check_dense(dense, fmt)
    if layers is not None and layers < 2:
        raise FtchatError("--layers must be at least 2")
    a = model_args(preset, layers, fmt)
    return a, row_layout(a, fmt)


# ===== settings -> workload, and the budget on CUDA =====


def run_context(a: ModelArgs, settings: Settings | None) -> int:
    """The KV capacity a session gives: --context, else the model's maximum up to 32768."""
    given = settings.context if settings is not None else None
    return given or min(a.max_position_embeddings, DEFAULT_CONTEXT)


def given_slots(settings: Settings, layout: RowLayout) -> int | None:
    """--slots, or the slots --expert-vram buys; None: sized to fit."""
    if settings.slots is not None:
        return settings.slots
    if settings.expert_vram_gib is not None:
        return int(settings.expert_vram_gib * GIB // layout.nbytes)
    return None


def run_workload(a: ModelArgs, layout: RowLayout, settings: Settings) -> Workload:
    """What `ftchat run` (a Session) allocates: one decoder per batch size a chunk of piped
    prompts takes, each kept (1..B rows), one slot bank, prefill in chunks of --prefill-chunk."""
    cuda = settings.torch_device().type == "cuda"
    L = run_context(a, settings)
    T = min(settings.prefill_chunk or PREFILL_CHUNK, L)
    return Workload(L, tuple(range(1, settings.batch_size + 1)), (given_slots(settings, layout),),
                    T, cuda, cuda and settings.use_graph(),
                    candidates=settings.candidates, kv_cache_dtype=settings.kv_cache_dtype)


def verify_workload(a: ModelArgs, layout: RowLayout, settings: Settings, max_new: int,
                    arms: int = 2) -> Workload:
    """verify: a backend per arm alive together (the last prompt's `on` while the next `off` is
    built; verify --graph adds two kept arms), short sequences, eager."""
    cuda = settings.torch_device().type == "cuda"
    L = settings.context or max_new + PROMPT_BOUND
    return Workload(L, (1,), (given_slots(settings, layout),) * arms, min(PREFILL_CHUNK, L), cuda,
                    cuda and settings.graph is True, candidates=settings.candidates,
                    kv_cache_dtype=settings.kv_cache_dtype)


def bench_workload(a: ModelArgs, layout: RowLayout, base: Settings,
                   arms: list[Settings | None], max_len: int) -> Workload:
    """bench: every arm's decoder (1 row) and backend alive together, each decoding from one
    token prefilled at the context; resident arms (None) share every row on the device."""
    cuda = base.torch_device().type == "cuda"
    offload = [s for s in arms if s is not None]
    return Workload(max_len, (1,) * len(arms), tuple(given_slots(s, layout) for s in offload), 1,
                    cuda, cuda and any((s or base).use_graph() for s in arms),
                    resident_rows=cuda and len(offload) < len(arms),
                    candidates=max((s.candidates for s in offload), default=base.candidates),
                    # fp8 only when every arm stores fp8 (mixed arms: planned at the larger)
                    kv_cache_dtype="fp8" if all((s or base).kv_cache_dtype == "fp8" for s in arms)
                    else "auto")


def budget_bytes(settings: Settings) -> int | None:
    return None if settings.vram_budget_gib is None else int(settings.vram_budget_gib * GIB)


def preflight(a: ModelArgs, layout: RowLayout, settings: Settings, w: Workload) -> VramPlan:
    """Before loading: refuse what cannot fit (FtchatError) and, on CUDA, cap the process at the
    budget, so that every later allocation stays inside it."""
    p = check(a, layout, settings.torch_dtype(), w, budget_bytes(settings))
    if settings.vram_budget_gib is not None and w.cuda:
        cap_process(settings.torch_device(), budget_bytes(settings))
    return p


def budget_slots(m: LoadedModel, settings: Settings) -> int:
    """engine.num_slots under --vram-budget: the run plan's slots for the loaded model."""
    w = run_workload(m.args, m.layout, settings)
    w = dataclasses.replace(w, cuda=m.device.type == "cuda", graphs=w.graphs and
                            m.device.type == "cuda", dense_nvfp4=any(
                                isinstance(t, Nvfp4Weight) for t in m.weights.tensors.values()))
    return check(m.args, m.layout, m.dtype, w, budget_bytes(settings)).slots


# ===== CUDA only (untested here: no GPU in CI) =====


def cap_process(device: torch.device, budget: int) -> None:
    """Every allocation of the caching allocator (graph pools included) stays inside `budget`."""
    # "cuda" names the current device; set_per_process_memory_fraction wants its index
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if budget > total:
        raise FtchatError(f"--vram-budget {budget / GIB:.4g} GiB: more than the device's "
                          f"{total / GIB:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(budget / total, index)


PEAK_KEYS = ("vram_peak_allocated_mib", "vram_peak_reserved_mib", "vram_budget_mib")


def peak_report(device: torch.device, budget: int | None) -> dict[str, float | None]:
    """Peak allocated and reserved since the start (graph pools are reserved memory) in MiB,
    against the budget; every value None off CUDA."""
    if device.type != "cuda":
        return dict.fromkeys(PEAK_KEYS)
    return {"vram_peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
            "vram_peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB,
            "vram_budget_mib": None if budget is None else budget / MIB}

