"""The VRAM plan (docs/design.md section 4.9): what a run allocates on its compute device, item
by item, from config.json and the safetensors headers (or a synthetic model's config) before any
tensor is loaded, and how many expert slots fit in what a budget leaves.

Exact items are dtype x shape of the tensors the loader, DecodeState and the offload backend
create (tests/test_vram_plan.py checks them against real allocations of a tiny model). Estimates
(activations, workspaces, CUDA graph pools, the allocator's slack) say so and give their
formula; the prefill's are walked through the code and checked against the peaks measured on
the CPU (tests/test_prefill_memory.py), the allocator's slack is calibrated on the H200.

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
from ftchat.codecs.nvfp4 import Nvfp4Weight, nvfp4_bytes
from ftchat.codecs.rows import RowLayout
from ftchat.model.spec import dense_specs
from ftchat.offload.backend import LEND_STAGING_FACTOR, lends_staging
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
# The CUDA caching allocator's slack, as a fraction of the largest block of transients (a
# prefill block, or the decode step's largest term): memory it holds in free cached blocks that
# the next requests cannot use whole. Why it scales with the transients, not with the weights,
# KV or slot bank (allocated once, before them): what outlives a block (the residual stream R,
# h, y) is carved from the segments the previous block's transients left cached, and pins
# them; the next block's largest requests then need new segments while those stay reserved
# (partly free). An estimate from one H200 run (docs/performance.md, session 9; expandable
# segments on, chunk 2048, 700 slots): peak reserved - peak allocated = 688 MiB, 0.59 of that
# run's largest block (the fp8 attention chunk, 1,172 MiB planned at the run's context); the
# 4,096-token run without expandable segments ran out of memory with 0.98 GiB reserved but
# free, ~0.5 of its largest block then (the unblocked GDN prefill). A second run (session 10:
# chunk 4,096, 1,100 slots, 255K, expandable segments) held 679 MiB reserved but free with a
# largest block of only 493 MiB (1.38 of it), and at the plan's 1,270 slots ran out with ~0.55
# GiB held: the gap stayed ~0.68 GiB while the largest block shrank 2.4x, so the term is the
# larger of the fraction and a floor near both measurements. Re-measure when the allocator
# settings or the prefill's shapes change.
ALLOCATOR_SLACK = 0.6
ALLOCATOR_SLACK_MIN = 700 * 2**20
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
        fp32 = 0 if cuda else experts * 2 * I * H * 32
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


# ===== the prefill: each block of a layer at its peak (docs/design.md 4.9) =====
#
# Bytes per token (T of one sequence) or per query chunk of the tensors a block's torch code
# holds at its peak, walked through that code (the files named). tests/test_prefill_memory.py
# measures the same peaks on the CPU (the profiler's allocation events) and checks the plan
# covers them. act = bytes of the model dtype; fp32 intermediates are 4 B.


def _rms_norm_peak(n: int, act: int) -> int:
    """layers.rms_norm of n elements at its peak: x.float(), x * rsqrt(..), that times
    (1 + w) (fp32 each, the first two kept as locals) and the cast to the model dtype."""
    return n * (12 + act)


def _stream(a: ModelArgs, act: int) -> int:
    """Per token: what qwen4_exp.forward holds across every block of a layer: R [hc*D], the
    block's input h and the last block's output y (its write rides in the next read), the
    embedding x (kept), s [hc]; the positions and the ids on the device (int64)."""
    D = a.hidden_size
    return act * (a.hc_count * D + 3 * D + a.hc_count) + 16


def _hc_mix(a: ModelArgs, act: int, T: int) -> int:
    """hc_write_read's torch path on T tokens above the stream: the write R' = R + s*y (the
    caller's R alive until it returns), then hc_read_ref in sub-blocks of
    qwen4_exp.HC_SUBBLOCK tokens: one sub-block's RMSNorm(R') in fp32 at a time, the norm
    weight's fp32 copies (w.float() and 1 + w), and past one sub-block the outputs x [D] and
    s [hc] of the sub-blocks and their concatenation."""
    from ftchat.model.qwen4_exp import HC_SUBBLOCK

    hcD = a.hc_count * a.hidden_size
    parts = 2 * T * act * (a.hidden_size + a.hc_count) if T > HC_SUBBLOCK else 0
    return T * act * hcD + parts + min(T, HC_SUBBLOCK) * _rms_norm_peak(hcD, act) + 8 * hcD


def _ple_block(a: ModelArgs, act: int, T: int) -> int:
    """ple.ple_layer of T tokens above the stream: its output [hc*D] and table rows (int64
    [nh]) per token, and one sub-block's (ple.PLE_SUBBLOCK tokens) transients at the RMSNorm of
    G per token (key, query and G alive, [hc*D] each, E [ple_embed_dim] and value [D]; the
    sub-block's slice of the output is written after), and the norm weight's fp32 copies
    (w.float() and 1 + w, [hc*D] each)."""
    from ftchat.model.ple import PLE_SUBBLOCK

    hcD, nh = a.hc_count * a.hidden_size, (a.ngram_size - 1) * a.heads_per_ngram
    whole = T * 8 * nh + (T * act * hcD if T > PLE_SUBBLOCK else 0)  # rows; the output
    t = min(T, PLE_SUBBLOCK)
    return whole + t * (3 * act * hcD + _rms_norm_peak(hcD, act)
                        + act * (a.ple_embed_dim + a.hidden_size)) + 8 * hcD


def gdn_block_bytes(a: ModelArgs, act: int, t: int) -> int:
    """Peak bytes of gdn.gdn_core_block's prefill of t tokens (t padded to whole chunks), above
    its inputs: the max over its steps. Per token and value head, fp32: the conv output [conv
    dim] (act), q, k [dk], v [dv] heads first; in delta_rule_block the decay and L [C], kb [dk],
    rhs and the solve's output [dv + dk] each, k_decay [dk], the states [dk dv / C], q e^gamma
    [dk], the output [dv], q kᵀ [C] and its product [dv]; the gated norm's fp32 [dv] copies."""
    from ftchat.model import gdn

    Hk, Hv, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                      a.linear_value_head_dim)
    C = gdn.CHUNK
    t = -(-t // C) * C
    conv = act * (2 * Hk * dk + Hv * dv)  # per token
    qkv = 4 * Hv * (2 * dk + dv)
    f = 4 * Hv  # one fp32 value per token and value head
    small = 5 * f  # g, beta (fp32), gamma, e^gamma, the exp of last - gamma
    rule = f * max(3 * C + dk,  # kb kᵀ and its product with the decay; L
                   2 * C + 2 * dk + dv,  # rhs filled (kb still alive)
                   2 * C + 2 * (dv + dk),  # the solve: rhs and its output
                   C + dv + 2 * dk + dk * dv // C,  # chunk_states: k_decay, the states
                   C + 2 * dv + 2 * dk + dk * dv // C,  # (q e^gamma) @ states
                   2 * dv + dk + 3 * C)  # q kᵀ times the decay
    steps = (3 * conv,  # causal_conv: the window, the conv output, its silu
             2 * conv,  # the padding copy of the conv output
             conv + 4 * Hv * 3 * dk,  # l2norm of k: q done, k's fp32 copy and its square
             conv + qkv,  # v's fp32 copy: the conv output is freed after it
             qkv + small + rule,  # delta_rule_block
             f * dv * 4 + act * Hv * dv * 3)  # gated_rms_norm: o, x.float(), x * r, z.float()
    return t * max(steps) + 4 * Hv * dk * dv  # + chunk_states' running state


def gdn_prefill_bytes(a: ModelArgs, act: int, T: int, dense_nvfp4: bool = False,
                      cuda: bool = True) -> int:
    """Peak bytes of gdn.gdn_mixer_ref's prefill of T > 1 tokens above its input x: the four
    projections u, z, b, a (kept until out_proj), the core's output [T, Hv*dv] when it runs in
    more than one sub-block, and one sub-block's transients (`gdn_block_bytes`, at most
    GDN_SUBBLOCK tokens: bounded whatever T); or out_proj's moment (the core output and y).
    With the GDN qkv / z kept in NVFP4 (dense_nvfp4) each projection's weight is dequantized
    for the call (gdn.dense: one kernel to the model dtype on CUDA; on the CPU nvfp4.dequantize's
    int32 codes and fp32 values, scales and products, ~30 B an element measured: 32 planned)."""
    from ftchat.model import gdn

    D, Hv, dv = a.hidden_size, a.linear_num_value_heads, a.linear_value_head_dim
    conv_dim = 2 * a.linear_num_key_heads * a.linear_key_head_dim + Hv * dv
    proj = T * act * (conv_dim + Hv * dv + 2 * Hv)
    core_out = T * act * Hv * dv
    weight = 0
    if dense_nvfp4:
        weight = conv_dim * D * (act if cuda else 32 + act)
    sub = min(T, gdn.GDN_SUBBLOCK)
    return proj + max(weight,
                      (core_out if T > gdn.GDN_SUBBLOCK else 0) + gdn_block_bytes(a, act, sub),
                      core_out + T * act * D)


def _prefill_attention(a: ModelArgs, act: int, T: int, L: int, cuda: bool,
                       fp8: bool = False, dtype: torch.dtype | None = None) -> int:
    """Peak bytes of qsa.attention_mixer_ref's prefill of T > 1 queries at KV length L above
    its input: the projections (qg [2 Hq hd], k, v, iqk) kept to the end, then the largest of
    q's RMSNorm (fp32; the gate's copy, flatten of a strided view, made before it), the
    attention with q, the gate and iq alive, and the gate's product. The attention: causal
    over L when every complete block is selected (the K/V dequantized when fp8), else the
    sparse prefill in chunks of qsa.prefill_query_chunk queries, with the chunk outputs so
    far (then their concatenation) and, per query of a chunk, the largest of its block scores
    (fp32 [Hi, N] twice, the sum; the cached k̄ in fp32 once a chunk), the gather of its S
    tokens' K/V (fp8: both tensors' codes, the K
    dequantized, the V's fp32 value and product; else the K and V gathered) and attend_rows
    (the K/V, the reshaped copy matmul makes of one, the scores: act twice, softmax fp32),
    plus the previous chunk's K/V (still bound while the next is gathered) and the indices.
    On CUDA, where `qsa.prefill_kernel_supported` (one row; dtype: the model's), the sparse
    prefill is qsa.prefill_attention_fused, in chunks of prefill_query_chunk(kernel=True)
    queries: nothing gathered; per query the largest of its block scores (as above), its token
    indices (select_blocks_rows: int64 and bool [S], built while the scores [N] fp32 are still
    bound) and the kernel's partial o, m, l (fp32 [Hq, splits, hd + 2]), plus the indices of
    the chunk before (bound while the next is selected); its output is o * sigmoid(gate)."""
    from ftchat.kernels.qsa_decode import default_splits
    from ftchat.model import qsa

    Hq, Hkv, hd, Hi, di, r = (a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                              a.indexer_n_heads, a.indexer_head_dim, a.indexer_compress_ratio)
    top, N = a.indexer_budget // r, L // r
    proj = T * act * (2 * Hq * hd + 2 * Hkv * hd + (Hi + 1) * di)
    qi = T * act * (2 * Hq * hd + Hi * di)  # q and iq (normed, roped), the gate's copy
    o = T * act * Hq * hd
    kvh = Hkv * hd
    dtype = dtype or (torch.bfloat16 if act == 2 else torch.float32)
    scores = N * (2 * Hi * 4 + 4 + 4 + 1)  # select_blocks_rows' block scores, per query
    if N <= top:  # every complete block selected: causal attention over L, in query chunks
        dequant = L * kvh * (8 + 2 * act) if fp8 else 0  # K, V dequantized (slices: no gather)
        tq = qsa.causal_query_chunk(T, L, a)
        attn = (T * L + dequant + 2 * Hq * L * hd * act  # the mask, the K/V repeated
                # a chunk's inverted mask and scores: the masked ones, softmax's fp32 copy of
                # them and its output, then the output cast to act
                + tq * (L + Hq * L * max(act + 8, 2 * act + 4)
                        + 3 * Hq * hd * act)  # its q copy, output and transposed output
                + 2 * o)  # the chunk outputs so far, then their concatenation
    elif cuda and qsa.prefill_kernel_supported(a, dtype, 1):  # the kernel path, in query chunks
        tq = qsa.prefill_query_chunk(T, L, a, "cuda", True)
        S = top * r + r - 1
        splits = default_splits(tq, Hkv, S, dtype)
        per_query = 9 * S + max(  # the indices of the chunk before
            scores,
            4 * N + 26 * S,  # s; idx, ok, the cat and the block tokens and their validity
            Hq * splits * (hd + 2) * 4)  # qsa_attention's partial buffers
        attn = tq * per_query + 4 * N * di + o
    else:  # the sparse prefill, in query chunks
        tq = qsa.prefill_query_chunk(T, L, a, "cuda" if cuda else "cpu")
        S = top * r + r - 1
        gather = kvh * (10 + act) if fp8 else 2 * act * kvh
        per_query = S * (2 * act * kvh + 17) + max(  # a chunk's K/V bound, the indices
            scores,  # select_blocks_rows
            S * gather,  # gather_kv
            S * (act * kvh + Hq * (2 * act + 4)))  # attend_rows
        attn = tq * per_query + 4 * N * di + o
    return proj + max(T * (_rms_norm_peak(Hq * hd, act) + act * Hq * hd),  # q's RMSNorm
                      qi + max(attn, 2 * o),  # the chunks; their concatenation
                      qi + 3 * o + T * act * a.hidden_size)  # o, sigmoid(gate), o * it, y


def _moe_prefill(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, T: int, cuda: bool
                 ) -> tuple[int, str]:
    """Peak bytes of qwen4_exp.moe_block's prefill of T tokens above its input, and how the
    routed experts run. Routing (route_ref: logits and fp32 probabilities [T, E], then ids
    int64, weights, the backend's slot ids int32 [T, K] kept) and the shared expert's output
    [T, D] (its swiglu temporaries before) stay for the routed experts. Those: on CUDA the
    grouped Triton kernels (kernels/moe_prefill.py, when `supports` takes the call): the
    split-parity x copy [T, D], h [T*K, I] and y [T*K, D] bf16, the sorted pair order int64
    and the token / pair ids int32 [T*K], the per-token order and the output [T, D]; else the
    torch path (offload/experts.py: `_dequant_bytes`, EXPERT_GROUP experts at a time)."""
    from ftchat.kernels import moe_prefill

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
        routed = _dequant_bytes(layout, act, a, min(U, EXPERT_GROUP), T, cuda) + T * (
            K * 40 + 2 * act * D)  # + the sort, the per-token order, the sum and its term
        how = f"torch path, {EXPERT_GROUP} experts at a time"
    return max(T * E * (act + 4),  # routing
               T * (K * (8 + act + 4)) + T * act * (3 * Is + D),  # shared expert
               kept + routed,
               kept + 2 * T * act * D), how  # the routed and shared outputs summed


def prefill_workspace(a: ModelArgs, layout: RowLayout, act: int, T: int, L: int,
                      fused: bool, dense_nvfp4: bool = False, fp8: bool = False,
                      dtype: torch.dtype | None = None) -> dict[str, int]:
    """Transient bytes of one prefill call of T tokens of one sequence ending at KV length L
    (an estimate); T == 1 is the decode path. The largest block of a layer (one block's
    transients at a time) on top of what forward holds across the blocks (`_stream`), and the
    last position's logits [1, V] (Decoder.prefill; the sampler's copies come after the
    layers' transients are freed). dtype: the model dtype (None: bf16 for act 2, else fp32);
    fp8: K/V stored in fp8; dense_nvfp4: the GDN qkv / z kept in NVFP4."""
    from ftchat.model import gdn

    if T == 1:
        return decode_workspace(a, layout, act, 1, L, fused)
    dtype = dtype or (torch.bfloat16 if act == 2 else torch.float32)
    moe, how = _moe_prefill(a, layout, dtype, T, fused)
    blocks = {"hyper-connection mix (fp32 RMSNorm)": _hc_mix(a, act, T),
              "attention": _prefill_attention(a, act, T, L, fused, fp8, dtype),
              f"GDN (sub-blocks of {gdn.GDN_SUBBLOCK:,})": gdn_prefill_bytes(
                  a, act, T, dense_nvfp4, fused),
              f"MoE ({layout.kind} experts, {how})": moe}
    if a.ple_layer_ids:
        blocks["PLE layer"] = _ple_block(a, act, T)
    top = max(blocks, key=blocks.get)
    return {top: blocks[top], "residual stream": T * _stream(a, act),
            "logits": a.vocab_size * act}


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

    def pre_at(t: int, kv: int) -> dict[str, int]:
        return prefill_workspace(a, layout, act, t, kv, w.cuda, w.dense_nvfp4,
                                 w.kv_cache_dtype == "fp8", dtype)
    pre, at = pre_at(T, L), L
    # a call of up to T tokens ending at the longest KV length still attended causally (every
    # complete block selected; a chat turn can end there whatever T is)
    causal = min(L, (a.indexer_budget // a.indexer_compress_ratio + 1) * a.indexer_compress_ratio
                 - 1)
    if T > 1 and causal < L and sum(pre_at(min(T, causal), causal).values()) > sum(pre.values()):
        pre, at = pre_at(min(T, causal), causal), causal
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
        f"max(prefill of {min(T, at):,} tokens at {at:,}: {_human(p)}, largest block {top} "
        f"{_human(pre[top])}; decode step of {w.batch} row(s): {_human(d)})"
        + (f" + cuBLAS {GEMM_STREAMS} x {CUBLAS_WORKSPACE_BYTES // MIB} MiB (assumed)"
           if cublas else ""), exact=False, grows="context"))
    if w.cuda:
        block = max(pre[top], max(dec.values()))
        items.append(Item(
            "allocator slack (estimate)", max(int(ALLOCATOR_SLACK * block), ALLOCATOR_SLACK_MIN),
            f"max({ALLOCATOR_SLACK:g} x the largest block of transients ({_human(block)}), "
            f"{_human(ALLOCATOR_SLACK_MIN)}): free cached blocks the caching allocator cannot "
            "hand out whole (measured 688 and 679 MiB in two H200 runs; "
            "vram_plan.ALLOCATOR_SLACK)", exact=False, grows="context"))
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
    """Slots per auto-sized bank within `budget` bytes, at most N; 0 when not even an empty bank
    fits (or no bank is auto-sized). The plan is linear in the slots on each side of the count
    from which a bank lends its staging area (`lends_staging`): first the count with the staging
    lent, kept if it reaches that threshold; else the count with a staging buffer of its own
    (lower, so below the threshold as well)."""
    N = a.num_hidden_layers * a.num_experts

    def linear_from(s0: int) -> int | None:  # the count the line through s0, s0 + 1 reaches
        base = plan(a, layout, dtype, w, s0).total
        per = plan(a, layout, dtype, w, s0 + 1).total - base
        if per == 0 or budget < base:
            return None
        return s0 + (budget - base) // per

    lend_at = LEND_STAGING_FACTOR * (a.num_experts + 1)
    if w.cuda and lend_at <= N:
        lent = linear_from(lend_at)
        if lent is not None:
            return min(N, lent)
    own = linear_from(0)
    return 0 if own is None else min(N, own)


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


# Prefill call sizes `choose_prefill_chunk` considers, largest first: a large chunk streams each
# layer's experts once for more tokens (prefill is link-bound: docs/performance.md), a small one
# leaves more VRAM to the slot cache
PREFILL_CHUNKS = (8192, 4096, 2048, 1024)
# a larger chunk is taken while it keeps this share of the most slots: an 8,192-token chunk
# prefilled 1.7x faster than 4,096 at 48 layers (4,295.7 against 2,530.2 tok/s, session 10) for
# ~0.9 GiB more workspace, ~11 % of the slots at 32K, ~20 % at 255K (where 4,096 is chosen)
CHUNK_SLOT_SHARE = 0.85


def choose_prefill_chunk(a: ModelArgs, layout: RowLayout, dtype: torch.dtype, w: Workload,
                         budget: int) -> int:
    """The prefill call size for a run under `budget` that left it unset: the largest of
    PREFILL_CHUNKS (at most the context) whose plan fits the budget and, for a bank sized to fit,
    keeps at least CHUNK_SLOT_SHARE of the slots the smallest chunk leaves (at 16 GiB, 48 layers
    and fp8 K/V: 8,192 at 32K, 2,783 slots against 3,130 at 1,024; 4,096 at 255K, 1,669 against
    1,778, where 8,192 would leave 1,431). PREFILL_CHUNK when none fits (the refusal then names
    what does not)."""
    sizes = sorted({min(c, w.context) for c in PREFILL_CHUNKS}, reverse=True)
    auto = any(s is None for s in w.banks)
    given = max((s for s in w.banks if s is not None), default=0)

    def slots_at(c: int) -> int:  # the slots the bank gets (auto) / fits (given) at chunk c
        v = dataclasses.replace(w, prefill_tokens=c)
        if auto:
            return slots_that_fit(a, layout, dtype, v, budget)
        return given if plan(a, layout, dtype, v, given).total <= budget else 0

    need = w.batch * a.num_experts_per_tok
    floor = max(need, math.ceil(CHUNK_SLOT_SHARE * slots_at(sizes[-1]))) if auto else given
    for c in sizes:
        if slots_at(c) >= max(floor, 1):
            return c
    return min(PREFILL_CHUNK, w.context)


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

