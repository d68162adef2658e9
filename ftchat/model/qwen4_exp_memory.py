"""The qwen4_exp family's terms of the VRAM plan (docs/design.md section 4.9): its dense weights,
its decode state, and the transients of its blocks (hyper-connections, QSA attention, GDN, PLE).
The offload backend's items and the routed experts' transients are the plan's
(ftchat/vram/plan.py); the registry hands these to it (ftchat/model/registry.py). The terms it
shares with the Qwen3 MoE line (dense weight bytes, GDN state, RMSNorm, the causal attention
chunk, the GDN prefill) are ftchat/model/memory_common.py's.

Legend: B rows, L KV capacity (context), T prefill tokens, V vocab, H hidden, act = bytes of the
model dtype; fp32 intermediates are 4 B.
"""

from __future__ import annotations

import torch

from ftchat.kernels.qsa_attention import default_splits
from ftchat.model import gdn, memory_common as mc, ple, qsa, qwen4_exp
from ftchat.model.config import ModelArgs
from ftchat.model.memory_common import gdn_prefill_bytes, rms_norm_peak
from ftchat.model.spec import dense_specs
from ftchat.sizes import PLE_ON_DEVICE_BYTES
from ftchat.vram.items import GIB, MIB, Item, Workload

SHARD = ".ngram_embedding.shard_"
DENSE_KINDS = ("embedding", "lm_head", "GDN projections", "attention projections",
               "router and shared expert", "hyper-connection mixers", "PLE projections", "norms",
               "PLE n-gram table")
PARTS = (*mc.SHARED_PARTS, ("hyper_connection", "hyper-connection mixers"),
         (".ple.", "PLE projections"))


# ===== dense weights and decode state (exact) =====


def dense_kind(name: str) -> str:
    """The plan item a dense tensor (checkpoint name, prefix stripped) belongs to."""
    if SHARD in name or name.endswith(".ngram_embedding.weight"):
        return "PLE n-gram table"
    return mc.dense_kind(name, PARTS)


def table_on_device(a: ModelArgs, act: int) -> tuple[int, bool]:
    """(bytes of the n-gram table at act, whether load_model puts it on the device)."""
    n = sum(mc.numel(s.shape) for name, s in dense_specs(a).items() if SHARD in name)
    return n * act, n * act <= PLE_ON_DEVICE_BYTES


def dense_items(a: ModelArgs, dtype: torch.dtype, cuda: bool = True,
                dense_nvfp4: bool = False) -> list[Item]:
    """The dense weights as load_model leaves them: every float at the model dtype (NVFP4 ones
    dequantized, but with dense_nvfp4 the GDN qkv / z, kept packed: nvfp4.Nvfp4Weight), int64
    buffers kept; the load-time fusions only concatenate (row views). On CUDA the embedding
    stays in pinned host memory (ftchat/model/embedding.py)."""
    act = dtype.itemsize
    by_kind, embed = mc.dense_bytes(a, dense_specs(a), DENSE_KINDS, dense_kind, dtype, cuda,
                                    dense_nvfp4, skip=lambda name: SHARD in name)
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
    return [Item(k, by_kind[k], notes[k], dense=True) for k in DENSE_KINDS
            if k != "PLE n-gram table" or a.ple_layer_ids]


def state_items(a: ModelArgs, dtype: torch.dtype, w: Workload) -> list[Item]:
    """DecodeState.create of every decoder (docs/model.md 8; ftchat/model/state.py)."""
    act, rows, L = dtype.itemsize, sum(w.decoders), w.context
    n_attn = sum(a.is_attention(i) for i in range(a.num_hidden_layers))
    n_gdn = a.num_hidden_layers - n_attn
    Hkv, hd, di, r = a.num_key_value_heads, a.head_dim, a.indexer_head_dim, a.indexer_compress_ratio
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
        *mc.gdn_state_items(a, n_gdn, rows, act),
        Item("PLE state", n_ple * rows * hcD * ple_cols * act + rows * (a.ngram_size - 1) * 8,
             f"conv columns {n_ple} x {rows} x [{hcD}, {ple_cols}] x {act} B, n-gram context "
             "int64"),
    ]


# ===== a decode step's transients (an estimate) =====


def decode_terms(a: ModelArgs, act: int, B: int, L: int) -> dict[str, int]:
    """Transient bytes of one decode step of B rows at KV capacity L, by term, but the routed
    experts' (the plan adds the backend's)."""
    V, hcD = a.vocab_size, a.hc_count * a.hidden_size
    Hq, Hkv, hd, Hi, di, r = (a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                              a.indexer_n_heads, a.indexer_head_dim, a.indexer_compress_ratio)
    Hk, Hv, dk = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim
    widths = (2 * Hk * dk + 2 * Hv * dk + 2 * Hv, Hq * 2 * hd + 2 * Hkv * hd + (Hi + 1) * di,
              2 * a.shared_expert_intermediate_size + 1)
    S = a.indexer_budget + r - 1
    return {
        "logits": 2 * B * V * act,  # the step's, and the copy decode yields under a graph
        "residual": 6 * B * hcD * act,  # R in and out, normed copies
        "projection": B * max(widths) * act,
        "QSA block scores": B * (L // r) * (di * 4 + 2 * Hi * 4 + 4 + 16),  # k̄ fp32, ReLU, keys
        "QSA attention": B * S * (2 * Hkv * hd * act + 2 * Hq * hd * act + Hq * (2 * act + 4)),
        "GDN": 2 * B * Hv * dk * a.linear_value_head_dim * 4,  # torch path: state-sized temps
    }


# ===== a prefill call: each block of a layer at its peak (docs/design.md 4.9) =====
#
# Bytes per token (T of one sequence) or per query chunk of the tensors a block's torch code
# holds at its peak, walked through that code (the files named). tests/test_prefill_memory.py
# measures the same peaks on the CPU (the profiler's allocation events) and checks the plan
# covers them.


def stream_bytes(a: ModelArgs, act: int) -> int:
    """Per token: what qwen4_exp.forward holds across every block of a layer: R [hc*D], the
    block's input h and the last block's output y (its write rides in the next read), the
    embedding x (kept), s [hc]; the positions and the ids on the device (int64)."""
    D = a.hidden_size
    return act * (a.hc_count * D + 3 * D + a.hc_count) + 16


def hc_mix_bytes(a: ModelArgs, act: int, T: int) -> int:
    """hc_write_read's torch path on T tokens above the stream: the write R' = R + s*y (the
    caller's R alive until it returns), then hc_read_ref in sub-blocks of
    qwen4_exp.HC_SUBBLOCK tokens: one sub-block's RMSNorm(R') in fp32 at a time, the norm
    weight's fp32 copies (w.float() and 1 + w), and past one sub-block the outputs x [D] and
    s [hc] of the sub-blocks and their concatenation."""
    hcD = a.hc_count * a.hidden_size
    sub = qwen4_exp.HC_SUBBLOCK
    parts = 2 * T * act * (a.hidden_size + a.hc_count) if T > sub else 0
    return T * act * hcD + parts + min(T, sub) * rms_norm_peak(hcD, act) + 8 * hcD


def ple_block_bytes(a: ModelArgs, act: int, T: int) -> int:
    """ple.ple_layer of T tokens above the stream: its output [hc*D] and table rows (int64
    [nh]) per token, and one sub-block's (ple.PLE_SUBBLOCK tokens) transients at the RMSNorm of
    G per token (key, query and G alive, [hc*D] each, E [ple_embed_dim] and value [D]; the
    sub-block's slice of the output is written after), and the norm weight's fp32 copies
    (w.float() and 1 + w, [hc*D] each)."""
    hcD, nh = a.hc_count * a.hidden_size, (a.ngram_size - 1) * a.heads_per_ngram
    whole = T * 8 * nh + (T * act * hcD if T > ple.PLE_SUBBLOCK else 0)  # rows; the output
    t = min(T, ple.PLE_SUBBLOCK)
    return whole + t * (3 * act * hcD + rms_norm_peak(hcD, act)
                        + act * (a.ple_embed_dim + a.hidden_size)) + 8 * hcD


def attention_prefill_bytes(a: ModelArgs, act: int, T: int, L: int, cuda: bool,
                            fp8: bool = False, dtype: torch.dtype | None = None) -> int:
    """Peak bytes of qsa.attention_mixer_ref's prefill of T > 1 queries at KV length L above
    its input: the projections (qg [2 Hq hd], k, v, iqk) kept to the end, then the largest of
    q's RMSNorm (fp32; the gate's copy, flatten of a strided view, made before it), the
    attention with q, the gate and iq alive, and the gate's product. The attention: causal
    over L when every complete block is selected (the K/V dequantized when fp8), else the
    sparse prefill in chunks of qsa.prefill_query_chunk queries, with the chunk outputs so
    far (then their concatenation) and, per query of a chunk, the largest of its block scores
    (fp32 [Hi, N] twice, the sum; the cached k̄ in fp32 once a chunk), the gather of its S
    tokens' K/V (fp8: both tensors' codes, the K dequantized, the V's fp32 value and product;
    else the K and V gathered) and attend_rows (the K/V, the reshaped copy matmul makes of one,
    the scores: act twice, softmax fp32), plus the previous chunk's K/V (still bound while the
    next is gathered) and the indices.
    On CUDA, where `qsa.prefill_kernel_supported` (one row; dtype: the model's), the sparse
    prefill is qsa.prefill_attention_fused, in chunks of prefill_query_chunk(kernel=True)
    queries: nothing gathered; per query the largest of its block scores (as above), its token
    indices (select_blocks_rows: int64 and bool [S], built while the scores [N] fp32 are still
    bound) and the kernel's partial o, m, l (fp32 [Hq, splits, hd + 2]), plus the indices of
    the chunk before (bound while the next is selected); its output is o * sigmoid(gate)."""
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
        attn = (T * L + dequant  # the mask
                + mc.causal_chunk_bytes(a, act, T, L)  # the K/V repeated, one query chunk's
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
    return proj + max(T * (rms_norm_peak(Hq * hd, act) + act * Hq * hd),  # q's RMSNorm
                      qi + max(attn, 2 * o),  # the chunks; their concatenation
                      qi + 3 * o + T * act * a.hidden_size)  # o, sigmoid(gate), o * it, y


def prefill_blocks(a: ModelArgs, act: int, T: int, L: int, cuda: bool, dense_nvfp4: bool,
                   fp8: bool, dtype: torch.dtype) -> dict[str, int]:
    """Peak bytes of each block of a layer but the MoE (the plan adds the routed experts') in a
    prefill call of T > 1 tokens ending at KV length L, above the stream (`stream_bytes`)."""
    blocks = {"hyper-connection mix (fp32 RMSNorm)": hc_mix_bytes(a, act, T),
              "attention": attention_prefill_bytes(a, act, T, L, cuda, fp8, dtype),
              f"GDN (sub-blocks of {gdn.GDN_SUBBLOCK:,})": gdn_prefill_bytes(
                  a, act, T, dense_nvfp4, cuda)}
    if a.ple_layer_ids:
        blocks["PLE layer"] = ple_block_bytes(a, act, T)
    return blocks


def prefill_lengths(a: ModelArgs, L: int) -> tuple[int, ...]:
    """The KV lengths where a prefill call of a run at capacity L peaks: L, and the longest
    still attended causally (every complete block selected; a chat turn can end there)."""
    r = a.indexer_compress_ratio
    causal = min(L, (a.indexer_budget // r + 1) * r - 1)
    return (L, causal) if causal < L else (L,)
