"""The Qwen3 MoE line's terms of the VRAM plan (docs/design.md section 4.9): dense weights and
decode state (exact, from the tensor inventory and the state's shapes), a decode step's and a
prefill call's transients (estimates walked through qwen3_decoder.py, attention.py and gdn.py;
the terms shared with qwen4_exp, the GDN prefill among them, are ftchat/model/memory_common.py's).
The offload backend's items and the routed experts' transients are the plan's
(ftchat/vram/plan.py).

Legend: B rows, L KV capacity (context), T prefill tokens, V vocab, D hidden, act = bytes of
the model dtype; fp32 intermediates are 4 B.
"""

from __future__ import annotations

import torch

from ftchat.model import gdn, memory_common as mc
from ftchat.model.memory_common import gdn_prefill_bytes, rms_norm_peak
from ftchat.model.qwen3_decoder import Qwen3Args, dense_specs
from ftchat.vram.items import GIB, Item, Workload

DENSE_KINDS = ("embedding", "lm_head", "GDN projections", "attention projections",
               "router and shared expert", "norms")


def dense_items(a: Qwen3Args, dtype: torch.dtype, cuda: bool = True,
                dense_nvfp4: bool = False) -> list[Item]:
    """The dense weights as load_model leaves them (every float at the model dtype, the GDN
    qkv / z packed with dense_nvfp4; on CUDA the embedding in pinned host memory)."""
    by_kind, embed = mc.dense_bytes(a, dense_specs(a), DENSE_KINDS, mc.dense_kind, dtype, cuda,
                                    dense_nvfp4)
    n_attn = len(a.attention_layers())
    dt = str(dtype).removeprefix("torch.")
    notes = {
        "embedding": (f"in host memory (pinned; {embed / GIB:,.2f} GiB at {dt}): 0 B of VRAM"
                      if cuda else f"[{a.vocab_size}, {a.hidden_size}] at {dt}"),
        "lm_head": f"[{a.vocab_size}, {a.hidden_size}] at {dt}",
        "GDN projections": f"{a.num_hidden_layers - n_attn} GDN layers at {dt}",
        "attention projections": f"{n_attn} attention layers: q/k/v/o at {dt}",
        "router and shared expert": f"{a.num_hidden_layers} layers: router [{a.num_experts}, "
                                    f"{a.hidden_size}] and the shared expert at {dt}",
        "norms": "every RMSNorm weight",
    }
    return [Item(k, by_kind[k], notes[k], dense=True) for k in DENSE_KINDS]


def state_items(a: Qwen3Args, dtype: torch.dtype, w: Workload) -> list[Item]:
    """qwen3_decoder.new_state of every decoder (K/V per attention layer, GDN state)."""
    act, rows, L = dtype.itemsize, sum(w.decoders), w.context
    n_attn = len(a.attention_layers())
    n_gdn = a.num_hidden_layers - n_attn
    Hkv, hd = a.num_key_value_heads, a.head_dim
    who = f"{rows} row(s) x {L:,} tokens"
    per = 2 * Hkv * (hd + 4) if w.kv_cache_dtype == "fp8" else 2 * Hkv * hd * act
    items = [Item("KV cache (K and V)", n_attn * rows * L * per,
                  f"{n_attn} attention layers x {who} x 2 x [{Hkv}, {hd}]"
                  + (" fp8 + fp32 scales" if w.kv_cache_dtype == "fp8" else f" x {act} B"),
                  grows="context")]
    if n_gdn:
        items += mc.gdn_state_items(a, n_gdn, rows, act)
    return items


def decode_terms(a: Qwen3Args, act: int, B: int, L: int) -> dict[str, int]:
    """Transient bytes of one decode step of B rows at KV capacity L, by term (the routed
    experts' are the plan's). The attention is the torch path: the K/V read [L] (dequantized
    copies when fp8: counted at act), scores and probabilities [Hq, L] in fp32 and act."""
    Hq, Hkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    Hk, Hv, dk = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim
    widths = (2 * Hk * dk + 2 * Hv * dk + 2 * Hv, Hq * 2 * hd + 2 * Hkv * hd,
              2 * a.shared_expert_intermediate_size + 1 + a.num_experts)
    terms = {
        "logits": 2 * B * a.vocab_size * act,
        "residual": 4 * B * a.hidden_size * act + B * a.hidden_size * 4,
        "projection": B * max(widths) * act,
        "attention": B * L * (2 * Hq * hd * act + Hq * (2 * act + 8) + 1),
    }
    if len(a.attention_layers()) < a.num_hidden_layers:
        terms["GDN"] = 2 * B * Hv * dk * a.linear_value_head_dim * 4
    return terms


def stream_bytes(a: Qwen3Args, act: int) -> int:
    """Per token: what forward holds across every block: h, the block's input x and output y;
    the positions and the ids (int64)."""
    return 3 * a.hidden_size * act + 16


def attention_prefill_bytes(a: Qwen3Args, act: int, T: int, L: int, fp8: bool) -> int:
    """attention.attention_mixer's prefill of T queries at KV length L above its input: the
    projections and q, k (normed, roped) and the gate, the K/V read (dequantized when fp8), the
    causal mask, and per query chunk (memory_common.causal_chunk_bytes) its K/V repeated over
    the query heads, the scores (act and fp32) and the outputs; then o, its gate product and y."""
    Hq, Hkv, hd, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.hidden_size
    q_width = Hq * hd * (2 if a.attention_gate else 1)
    proj = T * act * (q_width + 2 * Hkv * hd) * 2  # projections and their normed / roped copies
    kv = L * Hkv * hd * (2 * act + (8 if fp8 else 0))
    o = T * act * Hq * hd
    return proj + max(T * rms_norm_peak(Hq * hd, act),
                      kv + T * L + mc.causal_chunk_bytes(a, act, T, L) + 2 * o,
                      3 * o + T * act * D)


def prefill_blocks(a: Qwen3Args, act: int, T: int, L: int, cuda: bool, dense_nvfp4: bool,
                   fp8: bool, dtype: torch.dtype) -> dict[str, int]:
    """Peak bytes of each block of a layer but the MoE in a prefill call of T tokens ending at
    KV length L, above the stream."""
    blocks = {"RMSNorm (fp32)": T * rms_norm_peak(a.hidden_size, act),
              "attention": attention_prefill_bytes(a, act, T, L, fp8)}
    if len(a.attention_layers()) < a.num_hidden_layers:
        blocks[f"GDN (sub-blocks of {gdn.GDN_SUBBLOCK:,})"] = gdn_prefill_bytes(
            a, act, T, dense_nvfp4, cuda)
    return blocks


def prefill_lengths(a: Qwen3Args, L: int) -> tuple[int, ...]:
    """Causal attention peaks at the longest KV length: L."""
    return (L,)
