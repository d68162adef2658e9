"""Prefill, decode step and greedy generation over a model family's decoder (the family comes
from the registry: ftchat/model/registry.py).

Legend: B batch, T tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ftchat.codecs.nvfp4 import Nvfp4Weight
from ftchat.codecs.rows import RowLayout
from ftchat.errors import FtchatError, SettingsError
from ftchat.graph import DecodeGraph
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.model import embedding
from ftchat.model.checkpoint import Checkpoint
from ftchat.model.expert_backend import ExpertBackend
from ftchat.model.family import Family
from ftchat.model.ngram_table import HostTable
from ftchat.model.registry import family_of
from ftchat.model.state import DecodeState
from ftchat.offload.backend import OffloadConfig, OffloadExperts, ResidentExperts
from ftchat.offload.hooks import Hooks
from ftchat.host_memory import pin
from ftchat.offload.store import fill_host_rows
from ftchat.offload.streams import make_streams
from ftchat.settings import Settings
from ftchat.sizes import PLE_ON_DEVICE_BYTES, PREFILL_CHUNK
from ftchat.vram.workloads import budget_slots

HEADROOM_BYTES = 1 << 30  # VRAM left free for activations, workspaces and graphs


@dataclass
class LoadedModel:
    args: Any  # the family's ModelArgs
    weights: Any  # the family's Weights (dense tensors by checkpoint name)
    layout: RowLayout
    host_rows: Tensor  # [L*E, R] uint8, every routed expert
    device: torch.device
    dtype: torch.dtype

    @property
    def family(self) -> Family:
        return family_of(self.args)


def load_model(folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
               progress: Callable[[str, int, int], None] | None = None,
               ple_table: str | None = None, kernels: KernelConfig = DEFAULT) -> LoadedModel:
    """Read a checkpoint folder: dense weights to `device` (on CUDA the embedding stays in
    pinned host memory: ftchat/model/embedding.py), expert rows to host memory. `kernels`
    (KernelConfig.from_settings) is held by the weights: the forward pass and the expert
    backends built from the model run their kernels with it.

    A PLE table over PLE_ON_DEVICE_BYTES stays in host memory in its stored dtype
    (docs/model.md 7.4). ple_table "host": one host tensor, pinned on CUDA, gathered by the
    Triton kernel inside the decode graph (the CUDA default); "mmap": read in place from its
    files (the CPU default: only the pages of the rows asked use RAM)."""
    ckpt = Checkpoint(folder)
    a = ckpt.args
    on_cuda = torch.device(device).type == "cuda"
    ple_table = ple_table or ("host" if on_cuda else "mmap")
    if ple_table not in ("host", "mmap"):
        raise ValueError(f"ple_table {ple_table!r}: use host or mmap")
    stage = (lambda s: lambda i, n: progress(s, i, n)) if progress else (lambda s: None)
    dense = ckpt.dense(dtype, device, progress=stage("dense"),
                       table_in_place_bytes=PLE_ON_DEVICE_BYTES, table_host=ple_table == "host",
                       table_progress=stage("ple table"))
    layout = ckpt.row_layout()
    rows = fill_host_rows(ckpt, layout, (lambda i, n: progress("experts", i, n)) if progress else None)
    for name, t in dense.items():  # a small n-gram table goes to the device (graphs need it)
        if "ngram_embedding" in name and isinstance(t, Tensor):
            dense[name] = t.to(device)
        elif isinstance(t, HostTable) and on_cuda:
            pin(t.data)  # the gather kernel reads it over UVA
    if embedding.host_placement(device):
        dense[embedding.EMBED] = embedding.to_host(dense[embedding.EMBED])
    return LoadedModel(a, ckpt.family.weights(dense, a.num_hidden_layers, kernels), layout, rows,
                       torch.device(device), dtype)


def resident_backend(m: LoadedModel) -> ResidentExperts:
    return ResidentExperts(m.host_rows.to(m.device), m.layout, m.args.num_experts,
                           m.weights.kernels)


def num_slots(m: LoadedModel, settings: Settings) -> int:
    """Slot count from --slots, --expert-vram, --vram-budget (the VRAM plan) or (CUDA) the free
    VRAM; at least bs x top_k."""
    a = m.args
    total = a.num_hidden_layers * a.num_experts
    need = settings.batch_size * a.num_experts_per_tok
    if settings.slots is not None:
        n = settings.slots
    elif settings.expert_vram_gib is not None:
        n = int(settings.expert_vram_gib * 2**30 // m.layout.nbytes)
    elif settings.vram_budget_gib is not None:
        kept_nvfp4 = any(isinstance(t, Nvfp4Weight) for t in m.weights.tensors.values())
        n = budget_slots(a, m.layout, m.dtype, m.device, kept_nvfp4, settings)
    elif m.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(m.device)
        n = int((free - HEADROOM_BYTES) // m.layout.nbytes)
    else:
        n = total
    if n < need:
        # a count the flags gave must change (exit 2); free VRAM too small is the device's (1)
        given = settings.slots is not None or settings.expert_vram_gib is not None
        raise (SettingsError if given else FtchatError)(
            f"{n} expert slots are fewer than batch size x top-k = {need}: "
            f"give --slots >= {need} or more --expert-vram")
    return min(n, total)


def build_experts(m: LoadedModel, settings: Settings, hooks: Hooks | None = None) -> ExpertBackend:
    """The routed-expert backend the settings ask for: offloaded slot cache, or all resident
    when every expert fits, prefetch is off, no slot count is asked for and no hooks watch.
    `hooks` are the debug watchers (ftchat.debug builds them from the settings)."""
    a = m.args
    S = num_slots(m, settings)
    all_fit = S == a.num_hidden_layers * a.num_experts and settings.slots is None
    if all_fit and settings.prefetch in ("off", "auto") and hooks is None:
        return resident_backend(m)
    on_cuda = m.device.type == "cuda"
    settings = dataclasses.replace(settings,
                                   prefetch=settings.prefetch_mode(on_cuda, m.layout.nbytes))
    routers = m.family.routers(m.weights, a)
    cfg = OffloadConfig.from_settings(settings, S, a.num_experts)
    attention = set(m.family.attention_layers(a))
    if m.device.type == "cuda" and not m.host_rows.is_pinned():
        pin(m.host_rows)
    return OffloadExperts(m.host_rows, m.layout, routers, attention, cfg, m.device,
                          make_streams(m.device), hooks, kernels=m.weights.kernels,
                          top_k=a.num_experts_per_tok)


def prefill(m: LoadedModel, state: DecodeState, row: int, ids: Tensor, start: int,
            experts: ExpertBackend, logits_at: slice | None = slice(None)) -> Tensor | None:
    """Run tokens ids [T] of sequence `row` from position `start`; logits [n, V] of the n
    positions `logits_at` picks (every one by default), None for logits_at None (forward)."""
    T = ids.shape[0]
    pos = torch.arange(start, start + T, device=m.device)[None]  # [1, T]
    logits = m.family.forward(ids[None].to(m.device), pos, m.weights, state,
                              slice(row, row + 1), experts.for_prefill(), m.args,
                              kv_len=start + T, logits_at=logits_at)
    return None if logits is None else logits[0]


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
    logits = m.family.forward(tokens[:, None], pos, m.weights, state, slice(0, B), experts,
                              m.args, kv_len)
    return logits[:, 0]


def graph_safe(m: LoadedModel) -> bool:
    """Whether the decode step can be captured: every weight it reads is a device tensor, or a
    host n-gram table the gather kernel reads without a host sync (pinned, CUDA + Triton)."""
    return all(isinstance(t, (Tensor, Nvfp4Weight))
               or (isinstance(t, HostTable) and t.sync_free(m.device, m.dtype, m.weights.kernels))
               for t in m.weights.tensors.values())


class Decoder:
    """Decode state of a batch of B sequences and its expert backend. With graph=True the whole
    decode step (cache logic and copies included) replays from one CUDA graph."""

    def __init__(self, m: LoadedModel, experts: ExpertBackend, batch: int, max_len: int,
                 graph: bool = False, prefill_chunk: int | None = None,
                 kv_dtype: torch.dtype | None = None):
        self.m, self.experts = m, experts
        self.prefill_chunk = prefill_chunk  # tokens a prefill call takes; None: PREFILL_CHUNK
        # kv_dtype: the K/V cache storage (None: the model dtype; Settings.kv_torch_dtype)
        self.state: DecodeState = m.family.new_state(m.args, batch, max_len, m.device, m.dtype,
                                                     kv_dtype)
        self.graph = None
        if graph and not graph_safe(m):
            graph = False  # the n-gram table is read from host files each step: eager only
        if graph:
            experts.before_capture()
            self.graph = DecodeGraph(
                lambda tok, pos: _decode(m, self.state, experts, tok, pos, max_len), batch, m.device)
            experts.after_capture()  # the capture's warm-up ran real steps: the backend is cold
            self.reset(experts=False)

    def reset(self, experts: bool = True) -> None:
        """Clear the decode state for new sequences; with experts=True also empty the expert
        cache."""
        eos = self.m.args.eos_token_id or 0
        self.state.reset(slice(0, self.state.batch), eos)
        if experts:
            self.experts.reset()

    def prefill(self, row: int, ids: Tensor, start: int,
                on_prefill: Callable[[int, int], None] | None = None,
                all_logits: bool = False) -> Tensor:
        """Logits [1, V] of the last of ids [T] appended to sequence `row` at position `start`
        (all the next token needs), or with all_logits those of every token, [T, V] (tests that
        compare positions; T x V does not fit a long prompt). Runs in chunks (activations,
        expert staging and the QSA block scores grow with the chunk); only the last chunk runs
        the final mixer and lm_head unless all_logits.

        `on_prefill(done, total)` is called before the first chunk (done 0: the start time) and
        after each one, once its work is finished (a progress line for long prompts)."""
        out, total = [], ids.shape[0]
        step = self.prefill_chunk or PREFILL_CHUNK
        if on_prefill is not None:
            on_prefill(0, total)
        for i in range(0, total, step):
            chunk = ids[i : i + step]
            final = i + step >= total  # earlier chunks only advance the state
            at = slice(None) if all_logits else (slice(-1, None) if final else None)
            logits = prefill(self.m, self.state, row, chunk, start + i, self.experts,
                             logits_at=at)
            if logits is not None:
                out.append(logits)
            if on_prefill is not None:
                _now(self.m.device)  # SYNC: report finished work, not queued kernels
                on_prefill(min(i + step, total), total)
        return torch.cat(out)

    def step(self, tokens: Tensor, lengths: list[int]) -> Tensor:
        """logits [B, V] for tokens [B] at positions lengths. A graph's logits are its static
        output buffer: the next step overwrites them."""
        if self.graph is not None:
            logits = self.graph(tokens, lengths)
        else:
            logits = decode_step(self.m, self.state, tokens, lengths, self.experts)
        self.experts.end_step(tokens.shape[0])
        return logits


# ===== the decode loop: every caller (chat, batch, verify, audit, bench, tests) runs this =====

Stop = str  # why a sequence ends at a token: "eos" | "length" | "context"


@dataclass(frozen=True)
class Step:
    """One position of a batch's greedy decode. Index b = sequence b of the batch.

    A finished sequence rides along in later steps (the batch decodes together): `active[b]` is
    False there and its token is meaningless."""

    tokens: tuple[int, ...]  # [B] the chosen (greedy by default) token of each sequence
    logits: Tensor  # [B, V] the logits they were chosen from (a copy under graph replay)
    stops: tuple[Stop | None, ...]  # why a sequence ends at this token, if it does
    active: tuple[bool, ...]  # the sequence produced this token (not finished before)
    n: tuple[int, ...]  # tokens generated per sequence so far, this one included
    lengths: tuple[int, ...]  # tokens in each sequence's state (this token not fed yet)
    prefill_s: tuple[float, ...]  # each sequence's prefill time
    decode_s: float  # since the first token
    decode_tokens: int  # tokens that came from decode steps so far (a reply's first: prefill)


def stop_reason(token: int, n: int, limit: int, length: int, max_len: int,
                stops: frozenset[int]) -> Stop | None:
    """Why a sequence ends at its n-th token, if it does (`length` = tokens in its state)."""
    if token in stops:
        return "eos"
    if n >= limit:
        return "length"
    if length >= max_len:  # no room to feed this token back
        return "context"
    return None


def pick(logits: Tensor, choose: Callable[[Tensor], Tensor] | None = None) -> list[int]:
    """The token of each row of logits [B, V]: the argmax, or `choose`'s (logits -> tokens [B]
    on the device); -1 for a row whose logits hold NaN or +Inf, found with the same sync (a
    -inf logit is a token ruled out, not a fault)."""
    picked = logits.argmax(-1) if choose is None else choose(logits)  # [B] greedy or drawn
    broken = (logits.isnan() | logits.isposinf()).any(-1)  # [B]
    return torch.where(broken, -1, picked).tolist()  # SYNC: the chosen tokens go to the host


def broken_output(dtype: torch.dtype, where: str) -> FtchatError:
    """The error for a row `pick` found broken; `where` names the sequence and position."""
    return FtchatError(f"the model's output holds NaN or Inf ({where}): its weights are "
                       f"damaged or the {dtype} computation overflowed; try --dtype float32 or "
                       "check the checkpoint")


def decode(dec: Decoder, prompts: Sequence[Sequence[int]], starts: Sequence[int],
           limits: Sequence[int], stops: frozenset[int] = frozenset(),
           choose: Callable[[Tensor], Tensor] | None = None,
           on_prefill: Callable[[int, int], None] | None = None) -> Iterator[Step]:
    """Greedy decode: prompt b is prefilled into row b of `dec` at position starts[b] (rows
    already hold starts[b] tokens), then every row decodes together until each has stopped
    (eos, its limit, or a full state). Yields one Step per position.

    `choose` replaces the greedy argmax: logits [B, V] -> tokens [B] on the device (sampling,
    ftchat.sampling.Sampler); it is called once per position, in order.
    `on_prefill(done, total)` follows each prompt's prefill, chunk by chunk (Decoder.prefill).
    Closing the iterator at a yield leaves the state whole: the yielded tokens were not fed.
    """
    m, B, max_len = dec.m, len(prompts), dec.state.max_len
    prefill_s, last = [], []
    for b, ids in enumerate(prompts):
        t = _now(m.device)
        last.append(dec.prefill(b, torch.tensor(list(ids)), starts[b], on_prefill)[-1])
        prefill_s.append(_now(m.device) - t)
    logits = torch.stack(last)  # [B, V]
    lengths = [s + len(p) for s, p in zip(starts, prompts, strict=True)]
    n, done, decode_tokens = [0] * B, [False] * B, 0
    t0 = _now(m.device, sync=False)
    while True:
        tokens = pick(logits, choose)  # SYNC inside: the chosen tokens go to the host
        active = [not d for d in done]
        if any(t < 0 and a for t, a in zip(tokens, active)):
            b = next(b for b, t in enumerate(tokens) if t < 0 and active[b])
            raise broken_output(m.dtype, f"sequence {b + 1}, position {lengths[b]}")
        reasons = [None] * B
        for b, t in enumerate(tokens):
            if active[b]:
                n[b] += 1
                reasons[b] = stop_reason(t, n[b], limits[b], lengths[b], max_len, stops)
                done[b] = reasons[b] is not None
        yield Step(tuple(tokens), logits.clone() if dec.graph is not None else logits,
                   tuple(reasons), tuple(active), tuple(n), tuple(lengths), tuple(prefill_s),
                   _now(m.device, sync=False) - t0, decode_tokens)
        if all(done):
            return
        logits = dec.step(torch.tensor(tokens, device=m.device), lengths)
        decode_tokens += done.count(False)
        # a finished row rides along, but never past its state
        lengths = [ln + 1 if not d else min(ln + 1, max_len - 1)
                   for ln, d in zip(lengths, done, strict=True)]


def generate(m: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
             experts: ExpertBackend, max_len: int | None = None, graph: bool = False,
             kv_dtype: torch.dtype | None = None) -> Iterator[Step]:
    """Greedy decode of a batch of fresh prompts for exactly max_new_tokens tokens each (no stop
    tokens), in a fresh Decoder: `decode` with the defaults tests and verify use."""
    max_len = max_len or max(len(p) for p in prompts) + max_new_tokens + 1
    dec = Decoder(m, experts, len(prompts), max_len, graph, kv_dtype=kv_dtype)
    B = len(prompts)
    return decode(dec, prompts, [0] * B, [max_new_tokens] * B)


def _now(device: torch.device, sync: bool = True) -> float:
    """Wall time; with sync, after the device's queued work (prefill boundaries)."""
    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: timing only
    return time.perf_counter()
