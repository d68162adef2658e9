"""Prefill, decode step and greedy generation over the qwen4_exp decoder.

Legend: B batch, T tokens, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ftchat.model.checkpoint import Checkpoint
from ftchat.model.config import ModelArgs
from ftchat.model.expert_backend import ExpertBackend
from ftchat.model.qwen4_exp import Weights, forward
from ftchat.model.rows import RowLayout
from ftchat.model.state import DecodeState
from ftchat.errors import FtchatError
from ftchat.graph import DecodeGraph
from ftchat.offload.backend import OffloadConfig, OffloadExperts, ResidentExperts
from ftchat.offload.hooks import Hooks
from ftchat.offload.store import fill_host_rows, pin
from ftchat.offload.streams import make_streams
from ftchat.settings import Settings

HEADROOM_BYTES = 1 << 30  # VRAM left free for activations, workspaces and graphs
PLE_ON_DEVICE_BYTES = 2 << 30
PREFILL_CHUNK = 1024  # the real table (48 GiB) stays in host memory


@dataclass
class LoadedModel:
    args: ModelArgs
    weights: Weights
    layout: RowLayout
    host_rows: Tensor  # [L*E, R] uint8, every routed expert
    device: torch.device
    dtype: torch.dtype


def load_model(folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
               progress: Callable[[str, int, int], None] | None = None) -> LoadedModel:
    """Read a checkpoint folder: dense weights to `device`, expert rows to host memory."""
    ckpt = Checkpoint(folder)
    a = ckpt.args
    dense = ckpt.dense(dtype, device, table_in_place_bytes=PLE_ON_DEVICE_BYTES,
                       progress=(lambda i, n: progress("dense", i, n)) if progress else None)
    layout = ckpt.row_layout()
    rows = fill_host_rows(ckpt, layout, (lambda i, n: progress("experts", i, n)) if progress else None)
    for name, t in dense.items():  # a small n-gram table goes to the device (graphs need it)
        if "ngram_embedding" in name and isinstance(t, Tensor):
            dense[name] = t.to(device)
    return LoadedModel(a, Weights(dense, a.num_hidden_layers), layout, rows,
                       torch.device(device), dtype)


def resident_backend(m: LoadedModel) -> ResidentExperts:
    return ResidentExperts(m.host_rows.to(m.device), m.layout, m.args.num_experts)


def num_slots(m: LoadedModel, settings: Settings) -> int:
    """Slot count from --slots, --expert-vram or (CUDA) the free VRAM; at least bs x top_k."""
    a = m.args
    total = a.num_hidden_layers * a.num_experts
    need = settings.batch_size * a.num_experts_per_tok
    if settings.slots is not None:
        n = settings.slots
    elif settings.expert_vram_gib is not None:
        n = int(settings.expert_vram_gib * 2**30 // m.layout.nbytes)
    elif m.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(m.device)
        n = int((free - HEADROOM_BYTES) // m.layout.nbytes)
    else:
        n = total
    if n < need:
        raise FtchatError(f"{n} expert slots are fewer than batch size x top-k = {need}: "
                          f"give --slots >= {need} or more --expert-vram")
    return min(n, total)


def build_experts(m: LoadedModel, settings: Settings, hooks: Hooks | None = None) -> ExpertBackend:
    """The routed-expert backend the settings ask for: offloaded slot cache, or all resident
    when every expert fits (on the CPU: when no slot count is asked for)."""
    a = m.args
    S = num_slots(m, settings)
    wants_debug = (hooks is not None or settings.verify or settings.audit_every
                   or settings.record_routing)
    if S == a.num_hidden_layers * a.num_experts and settings.prefetch == "off" and not wants_debug \
            and settings.slots is None:
        return resident_backend(m)
    routers = [m.weights.layers[i]["mlp"]["gate.weight"] for i in range(a.num_hidden_layers)]
    if hooks is None:
        hooks = debug_hooks(settings, a.num_hidden_layers, S, m.device, routers)
    cfg = OffloadConfig(num_slots=S, policy=settings.eviction, prefetch=settings.prefetch,
                        budget_gdn=settings.budget_gdn, budget_attn=settings.budget_attn,
                        candidates=min(settings.candidates, a.num_experts), overlap=settings.overlap,
                        copy_programs=settings.copy_programs)
    attention = {i for i in range(a.num_hidden_layers) if a.is_attention(i)}
    if m.device.type == "cuda" and not m.host_rows.is_pinned():
        pin(m.host_rows)
    return OffloadExperts(m.host_rows, m.layout, routers, attention, cfg, m.device,
                          make_streams(m.device), hooks)


def debug_hooks(settings: Settings, num_layers: int, num_slots: int, device,
                routers: list[Tensor]) -> Hooks | None:
    """The verifier, the slot audit and the routing recorder the settings ask for (None when
    all are off)."""
    from ftchat.debug import HookChain
    from ftchat.debug.audit import SlotAudit
    from ftchat.debug.routing import RoutingRecorder
    from ftchat.debug.verify import Verifier

    hooks: list[Hooks] = []
    if settings.verify:
        hooks.append(Verifier(settings.verify, num_layers, device))
    if settings.audit_every:
        hooks.append(SlotAudit(settings.audit_every, num_slots, device))
    if settings.record_routing:
        hooks.append(RoutingRecorder(settings.record_routing, routers, settings.candidates))
    return None if not hooks else hooks[0] if len(hooks) == 1 else HookChain(hooks)


def prefill(m: LoadedModel, state: DecodeState, row: int, ids: Tensor, start: int,
            experts: ExpertBackend) -> Tensor:
    """Run tokens ids [T] of sequence `row` from position `start`; logits [T, V]."""
    T = ids.shape[0]
    pos = torch.arange(start, start + T, device=m.device)[None]  # [1, T]
    logits = forward(ids[None].to(m.device), pos, m.weights, state, slice(row, row + 1),
                     experts.for_prefill(), m.args, kv_len=start + T)
    return logits[0]


def decode_step(m: LoadedModel, state: DecodeState, tokens: Tensor, lengths: list[int],
                experts: ExpertBackend) -> Tensor:
    """One token per sequence: tokens [B] at positions lengths[b]; logits [B, V].

    Eager attention spans the longest sequence; a captured graph spans the whole KV capacity
    (static shapes), masked either way."""
    pos = torch.tensor(lengths, device=m.device)[:, None]  # [B, 1]
    return _decode(m, state, experts, tokens.to(m.device), pos, max(lengths) + 1)


def _decode(m: LoadedModel, state: DecodeState, experts: ExpertBackend, tokens: Tensor,
            pos: Tensor, kv_len: int) -> Tensor:
    B = tokens.shape[0]
    logits = forward(tokens[:, None], pos, m.weights, state, slice(0, B), experts, m.args, kv_len)
    return logits[:, 0]


def graph_safe(m: LoadedModel) -> bool:
    """Whether the decode step can be captured: every weight it reads is a device tensor."""
    return all(isinstance(t, Tensor) for t in m.weights.tensors.values())


class Decoder:
    """Decode state of a batch of B sequences and its expert backend. With graph=True the whole
    decode step (cache logic and copies included) replays from one CUDA graph."""

    def __init__(self, m: LoadedModel, experts: ExpertBackend, batch: int, max_len: int,
                 graph: bool = False):
        self.m, self.experts = m, experts
        self.state = DecodeState.create(m.args, batch, max_len, m.device, m.dtype)
        self.graph = None
        if graph and not graph_safe(m):
            graph = False  # the n-gram table is read from host files each step: eager only
        if graph:
            self.graph = DecodeGraph(
                lambda tok, pos: _decode(m, self.state, experts, tok, pos, max_len), batch, m.device)
            self.reset()  # capture ran the step twice: start clean

    def reset(self, experts: bool = True) -> None:
        """Clear the decode state for new sequences; with experts=True also empty the expert
        cache (after graph capture, whose warm-up ran real steps)."""
        eos = self.m.args.eos_token_id or 0
        self.state.reset(slice(0, self.state.ple_ctx.shape[0]), eos)
        if experts and hasattr(self.experts, "reset"):
            self.experts.reset()

    def prefill(self, row: int, ids: Tensor, start: int) -> Tensor:
        """Logits [T, V] of ids [T] appended to sequence `row` at position `start`, in chunks
        (the attention scores of a chunk are [heads, chunk, context])."""
        out = []
        for i in range(0, ids.shape[0], PREFILL_CHUNK):
            chunk = ids[i : i + PREFILL_CHUNK]
            out.append(prefill(self.m, self.state, row, chunk, start + i, self.experts))
        return torch.cat(out)

    def step(self, tokens: Tensor, lengths: list[int]) -> Tensor:
        """logits [B, V] for tokens [B] at positions lengths."""
        if self.graph is not None:
            logits = self.graph(tokens, lengths)
        else:
            logits = decode_step(self.m, self.state, tokens, lengths, self.experts)
        self.experts.end_step()
        return logits


@dataclass(frozen=True)
class Step:
    """One decode step of a batch: the tokens it produced (index = sequence)."""

    tokens: tuple[int, ...]
    logits: Tensor  # [B, V]


def generate(m: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
             experts: ExpertBackend, max_len: int | None = None, graph: bool = False
             ) -> Iterator[Step]:
    """Greedy decode of a batch of prompts (prefilled one by one, decoded together)."""
    max_len = max_len or max(len(p) for p in prompts) + max_new_tokens + 1
    dec = Decoder(m, experts, len(prompts), max_len, graph)
    logits = torch.stack([dec.prefill(b, torch.tensor(p), 0)[-1] for b, p in enumerate(prompts)])
    lengths = [len(p) for p in prompts]
    for i in range(max_new_tokens):
        nxt = logits.argmax(-1)  # [B]
        # SYNC: the sampled tokens go to the host
        yield Step(tuple(nxt.tolist()), logits.clone() if graph else logits)
        if i + 1 == max_new_tokens:
            break
        logits = dec.step(nxt, lengths)
        lengths = [n + 1 for n in lengths]
