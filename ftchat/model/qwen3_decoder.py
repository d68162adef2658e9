"""The decoder of the Qwen3 MoE line: qwen3_5_moe, qwen3_next and qwen3_moe (docs/model.md
section 15). Each layer is two pre-norm residual blocks, a mixer (Gated DeltaNet or full
attention) and the routed MoE:

    h = embed(ids)                                         # [B, T, D]
    per layer: h = h + mixer(norm_in(h));  h = h + moe(norm_post(h))
    logits = lm_head(norm_final(h))

The mixers and the MoE are the code qwen4_exp runs (ftchat/model/gdn.py, ftchat/model/moe.py)
and the attention of ftchat/model/attention.py; what differs between the three families is
their config (`Qwen3Args`'s switches) and tensor names, in their own files. No
hyper-connections, PLE or QSA.

Legend: B batch, T tokens, D hidden, V vocab, E experts, K top-k.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.errors import ModelError
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.model import attention
from ftchat.model.config import _Fields, hf_config_object, json_kind, parse_eos_token_id
from ftchat.model.embedding import EMBED, embed
from ftchat.model.expert_backend import ExpertBackend
from ftchat.model.gdn import fuse_gdn_layers, gdn_mixer
from ftchat.model.layers import ROUTER, fuse_moe_layers
from ftchat.model.moe import moe_block
from ftchat.model.spec import (EMBED as EMBED_INIT, NORM, PLAIN_NORM, TensorSpec,
                               attention_specs, gdn_specs, moe_specs)
from ftchat.model.state import DecodeState, GdnCache

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
BLOCKS = ("input_layernorm", "self_attn", "linear_attn", "post_attention_layernorm", "mlp")
ArgsT = TypeVar("ArgsT", bound="Qwen3Args")


@dataclass(frozen=True)
class Qwen3Args:
    """Text-model geometry; HF config.json field names, plus the family's switches (the last
    four fields). Each family subclasses it (the registry tells families apart by type)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # linear_attention (GDN) or full_attention, per layer
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    hidden_act: str
    eos_token_id: int | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_gate: bool  # q_proj carries a per-head output gate (o * sigmoid(gate))
    zero_centred_norms: bool  # every RMSNorm but the GDN one is x * (1 + w); else x * w
    packed_gdn_inputs: bool  # GDN input projections stored as in_proj_qkvz / in_proj_ba

    output_gate_type = "silu"  # the GDN output norm's gate (gdn.py reads it)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL_ATTENTION

    def attention_layers(self) -> frozenset[int]:
        return frozenset(i for i in range(self.num_hidden_layers) if self.is_attention(i))

    @classmethod
    def build(cls: type[ArgsT], fields: dict, where: str, **switches: bool) -> ArgsT:
        """The family's args of `parse_fields`'s fields and its switches, validated."""
        a = cls(**fields, **switches)
        validate(a, where)
        return a


# ===== config.json =====


def text_config(cfg: object, where: str, wrapper: str | None, text_types: tuple[str, ...]
                ) -> dict:
    """The text model's fields of an HF config: `text_config` inside a `wrapper` model_type
    (a multimodal checkpoint: its vision tower is ignored), else the config itself."""
    model_type = hf_config_object(cfg, where).get("model_type")
    if model_type == wrapper and wrapper is not None:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ModelError(f"{where}: \"text_config\" must be a JSON object, got "
                             f"{json_kind(text)}")
        return text
    if model_type not in text_types:
        raise ModelError(f"{where}: model_type {model_type!r} is not one of "
                         f"{', '.join(t for t in (wrapper, *text_types) if t)}")
    return cfg


def parse_fields(t: dict, where: str, *, partial_rotary: float, gdn: bool, shared: bool
                 ) -> dict:
    """The Qwen3Args fields of a text config t (the family adds its switches). partial_rotary:
    the family's default factor; gdn: it has GDN layers (else every layer is attention);
    shared: it has a shared expert. ModelError naming `where` and the field otherwise."""
    f = _Fields(t, where)
    n = f.int("num_hidden_layers")
    if gdn:
        types = f.list("layer_types", str, "strings")
        if types is None:
            interval = f.int("full_attention_interval", 4)
            types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION
                     for i in range(n)]
        bad = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if bad or len(types) != n:
            raise ModelError(f"{where}: bad layer_types {list(types)}")
    else:
        types = [FULL_ATTENTION] * n
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise f.fail("rope_parameters", f"must be a JSON object, got {json_kind(rope)}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelError(f"{where}: rope_type {rope_type!r} is not supported (default RoPE only)")
    src = {"rope_theta": rope.get("rope_theta", t.get("rope_theta")),
           "partial_rotary_factor": rope.get("partial_rotary_factor",
                                             t.get("partial_rotary_factor"))}
    eos = parse_eos_token_id(f)
    heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    lin = (lambda name: f.int(name)) if gdn else (lambda name: f.int(name, 1))
    return dict(
        vocab_size=f.int("vocab_size"), hidden_size=hidden, num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=f.int("num_key_value_heads"),
        head_dim=f.int("head_dim", hidden // heads), layer_types=tuple(types),
        linear_conv_kernel_dim=f.int("linear_conv_kernel_dim", 4),
        linear_key_head_dim=lin("linear_key_head_dim"),
        linear_value_head_dim=lin("linear_value_head_dim"),
        linear_num_key_heads=lin("linear_num_key_heads"),
        linear_num_value_heads=lin("linear_num_value_heads"),
        num_experts=f.int("num_experts"), num_experts_per_tok=f.int("num_experts_per_tok"),
        moe_intermediate_size=f.int("moe_intermediate_size"),
        shared_expert_intermediate_size=(f.int("shared_expert_intermediate_size")
                                         if shared else 0),
        norm_topk_prob=f.bool("norm_topk_prob", True),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope_theta=f.float("rope_theta", 10000.0, src),
        partial_rotary_factor=f.float("partial_rotary_factor", partial_rotary, src),
        hidden_act=f.str("hidden_act", "silu"), eos_token_id=eos,
        max_position_embeddings=f.int("max_position_embeddings", 32768),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
    )


def refuse_dense_mlp_layers(t: dict, where: str) -> None:
    """qwen3_next / qwen3_moe can make some layers a dense MLP (mlp_only_layers,
    decoder_sparse_step); no released checkpoint does, and ftchat runs MoE layers only."""
    f = _Fields(t, where)
    step = f.int("decoder_sparse_step", 1)
    only = f.list("mlp_only_layers", int, "layer numbers") or []
    if step != 1 or only:
        raise ModelError(f"{where}: dense MLP layers (decoder_sparse_step {step}, mlp_only_layers "
                         f"{only}) are not supported: ftchat runs MoE layers only")


def moe_only_text_config(cfg: object, where: str, model_types: tuple[str, ...]) -> dict:
    """`text_config` of a family with no wrapper type whose config can ask for dense MLP layers
    (qwen3_next, qwen3_moe): those are refused (`refuse_dense_mlp_layers`)."""
    t = text_config(cfg, where, None, model_types)
    refuse_dense_mlp_layers(t, where)
    return t


def validate(a: Qwen3Args, where: str) -> None:
    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise ModelError(f"{where}: {msg}")

    check(a.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {a.rms_norm_eps}")
    check(a.rope_theta > 0, f"rope_theta must be > 0, got {a.rope_theta}")
    check(0 < a.partial_rotary_factor <= 1,
          f"partial_rotary_factor must be in (0, 1], got {a.partial_rotary_factor}")
    check(a.rotary_dim % 2 == 0, "rotary dim must be even")
    check(a.hidden_act == "silu", f"hidden_act {a.hidden_act!r} unsupported (silu only)")
    check(0 < a.num_experts_per_tok <= a.num_experts, "num_experts_per_tok out of range")
    check(a.num_attention_heads % a.num_key_value_heads == 0,
          "num_attention_heads must be a multiple of num_key_value_heads")
    check(a.linear_key_head_dim == a.linear_value_head_dim,
          "GDN needs key and value head dims equal")
    check(a.linear_num_value_heads % a.linear_num_key_heads == 0,
          "linear_num_value_heads must be a multiple of linear_num_key_heads")


# ===== the tensor inventory (docs/model.md 15.2) =====


def layer_specs(i: int, a: Qwen3Args) -> dict[str, TensorSpec]:
    D, p = a.hidden_size, f"layers.{i}"
    norm = NORM if a.zero_centred_norms else PLAIN_NORM
    s = {f"{p}.input_layernorm.weight": TensorSpec((D,), norm)}
    if a.is_attention(i):
        q_rows = a.num_attention_heads * a.head_dim * (2 if a.attention_gate else 1)
        s.update(attention_specs(f"{p}.self_attn", a, q_rows, norm))
    else:
        s.update(gdn_specs(f"{p}.linear_attn", a, packed=a.packed_gdn_inputs))
    s[f"{p}.post_attention_layernorm.weight"] = TensorSpec((D,), norm)
    s.update(moe_specs(f"{p}.mlp", a, shared=bool(a.shared_expert_intermediate_size)))
    return s


def dense_specs(a: Qwen3Args) -> dict[str, TensorSpec]:
    """Every tensor but the routed experts and lm_head, in checkpoint order."""
    s = {"embed_tokens.weight": TensorSpec((a.vocab_size, a.hidden_size), EMBED_INIT)}
    for i in range(a.num_hidden_layers):
        s.update(layer_specs(i, a))
    s["norm.weight"] = TensorSpec((a.hidden_size,), NORM if a.zero_centred_norms else PLAIN_NORM)
    return s


# ===== weights, state, forward =====


class Weights:
    """Dense weights by checkpoint name, grouped once: layers[i][block] holds
    `layers.{i}.{block}.*` with the prefix stripped; `kernels` as qwen4_exp.Weights."""

    def __init__(self, tensors: dict[str, Tensor], num_layers: int,
                 kernels: KernelConfig = DEFAULT):
        self.tensors = tensors
        self.kernels = kernels
        self.layers = [{b: _sub(tensors, f"layers.{i}.{b}.") for b in BLOCKS}
                       for i in range(num_layers)]
        fuse_gdn_layers(tensors, self.layers)  # GDN decode: one GEMV on [qkv | z | b | a]
        fuse_moe_layers(tensors, self.layers)  # one GEMV on [gate | up | gate logit | router]

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def with_kernels(self, kernels: KernelConfig) -> Weights:
        view = copy.copy(self)
        view.kernels = kernels
        return view


def new_state(a: Qwen3Args, batch: int, max_len: int, device, dtype,
              kv_dtype: torch.dtype | None = None) -> DecodeState:
    """Zeroed decode state: a K/V cache per attention layer, conv and recurrent state per GDN
    layer (no PLE: an empty n-gram context)."""
    conv_dim = 2 * a.linear_num_key_heads * a.linear_key_head_dim + (
        a.linear_num_value_heads * a.linear_value_head_dim)
    mixers = []
    for i in range(a.num_hidden_layers):
        if a.is_attention(i):
            mixers.append(attention.new_cache(a, batch, max_len, device, dtype, kv_dtype))
        else:
            mixers.append(GdnCache(
                torch.zeros(batch, conv_dim, a.linear_conv_kernel_dim - 1, device=device,
                            dtype=dtype),
                torch.zeros(batch, a.linear_num_value_heads, a.linear_key_head_dim,
                            a.linear_value_head_dim, device=device, dtype=torch.float32)))
    ctx = torch.zeros(batch, 0, device=device, dtype=torch.long)
    return DecodeState(max_len, mixers, [None] * a.num_hidden_layers, ctx)


def forward(tokens: Tensor, pos: Tensor, W: Weights, state: DecodeState, rows: slice,
            experts: ExpertBackend, a: Qwen3Args, kv_len: int,
            logits_at: slice | None = slice(None)) -> Tensor | None:
    """Logits [B, n, V] for tokens [B, T] at positions pos [B, T] of state rows `rows`: the n
    positions `logits_at` picks (None: no logits, only the state advances). The contract of
    qwen4_exp.forward."""
    kc = W.kernels
    h = embed(W[EMBED], tokens, kc=kc)  # [B, T, D]
    for i in range(a.num_hidden_layers):
        lw = W.layers[i]
        x = attention.norm(h, lw["input_layernorm"]["weight"], a)
        cache = state.mixers[i].rows(rows)  # AttentionCache or GdnCache
        if a.is_attention(i):
            y = attention.attention_mixer(x, lw["self_attn"], cache, pos, kv_len, a)
        else:
            y = gdn_mixer(x, lw["linear_attn"], cache.conv, cache.recurrent, a, kc=kc)
        h = h + y
        x = attention.norm(h, lw["post_attention_layernorm"]["weight"], a)
        h = h + moe_block(i, x, lw["mlp"], experts, a, kc=kc)
    if logits_at is None:
        return None
    h = attention.norm(h[:, logits_at], W["norm.weight"], a)  # per token: pick the rows first
    return F.linear(h, W["lm_head.weight"])


def routers(W: Weights, a: Qwen3Args) -> list[Tensor]:
    """The router weight [E, D] of every layer (the offload backend's lookahead reads them)."""
    return [W.layers[i]["mlp"][ROUTER] for i in range(a.num_hidden_layers)]


def attention_layers(a: Qwen3Args) -> frozenset[int]:
    return a.attention_layers()


def describe(a: Qwen3Args) -> list[str]:
    """`ftchat info`'s geometry lines."""
    n_attn = len(a.attention_layers())
    pattern = "".join("A" if a.is_attention(i) else "G" for i in range(a.num_hidden_layers))
    gdn = (f", GDN {a.linear_num_key_heads} key / {a.linear_num_value_heads} value heads of "
           f"{a.linear_key_head_dim}" if n_attn < a.num_hidden_layers else "")
    shared = (f", shared expert inner {a.shared_expert_intermediate_size}"
              if a.shared_expert_intermediate_size else ", no shared expert")
    gate = "gated " if a.attention_gate else ""
    return [
        f"layers       {a.num_hidden_layers}: {a.num_hidden_layers - n_attn} GDN "
        f"(linear_attention), {n_attn} {gate}full attention",
        f"pattern      {pattern}  (G = GDN, A = attention)",
        f"geometry     hidden {a.hidden_size}, vocab {a.vocab_size}, {a.num_experts} experts "
        f"top-{a.num_experts_per_tok}, expert inner {a.moe_intermediate_size}{shared}; "
        f"attention {a.num_attention_heads} query / {a.num_key_value_heads} kv heads of "
        f"{a.head_dim}, rotary {a.rotary_dim}{gdn}",
    ]


def _sub(w: dict, prefix: str) -> dict:
    n = len(prefix)
    return {k[n:]: v for k, v in w.items() if k.startswith(prefix)}
