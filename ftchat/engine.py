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
from ftchat.model.qwen4_exp import ExpertBackend, Weights, forward
from ftchat.model.rows import RowLayout
from ftchat.model.state import DecodeState
from ftchat.offload.experts import ResidentExperts
from ftchat.offload.store import fill_host_rows


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
    dense = ckpt.dense(dtype, device, progress=(lambda i, n: progress("dense", i, n)) if progress else None)
    layout = ckpt.row_layout()
    rows = fill_host_rows(ckpt, layout, (lambda i, n: progress("experts", i, n)) if progress else None)
    return LoadedModel(a, Weights(dense, a.num_hidden_layers), layout, rows,
                       torch.device(device), dtype)


def resident_backend(m: LoadedModel) -> ResidentExperts:
    return ResidentExperts(m.host_rows.to(m.device), m.layout, m.args.num_experts)


def prefill(m: LoadedModel, state: DecodeState, row: int, ids: Tensor, start: int,
            experts: ExpertBackend) -> Tensor:
    """Run tokens ids [T] of sequence `row` from position `start`; logits [T, V]."""
    T = ids.shape[0]
    pos = torch.arange(start, start + T, device=m.device)[None]  # [1, T]
    logits = forward(ids[None].to(m.device), pos, m.weights, state, slice(row, row + 1), experts,
                     m.args, kv_len=start + T)
    return logits[0]


def decode_step(m: LoadedModel, state: DecodeState, tokens: Tensor, lengths: list[int],
                experts: ExpertBackend) -> Tensor:
    """One token per sequence: tokens [B] at positions lengths[b]; logits [B, V]."""
    B = tokens.shape[0]
    pos = torch.tensor(lengths, device=m.device)[:, None]  # [B, 1]
    logits = forward(tokens[:, None].to(m.device), pos, m.weights, state, slice(0, B), experts,
                     m.args, kv_len=max(lengths) + 1)
    return logits[:, 0]


@dataclass(frozen=True)
class Step:
    """One decode step of a batch: the tokens it produced (index = sequence)."""

    tokens: tuple[int, ...]
    logits: Tensor  # [B, V]


def generate(m: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
             experts: ExpertBackend, max_len: int | None = None) -> Iterator[Step]:
    """Greedy decode of a batch of prompts (prefilled one by one, decoded together)."""
    B = len(prompts)
    max_len = max_len or max(len(p) for p in prompts) + max_new_tokens + 1
    state = DecodeState.create(m.args, B, max_len, m.device, m.dtype)
    last = []
    for b, p in enumerate(prompts):
        last.append(prefill(m, state, b, torch.tensor(p), 0, experts)[-1])
    logits = torch.stack(last)
    lengths = [len(p) for p in prompts]
    for _ in range(max_new_tokens):
        nxt = logits.argmax(-1)  # [B]
        # SYNC: the sampled tokens go to the host
        yield Step(tuple(nxt.tolist()), logits)
        logits = decode_step(m, state, nxt, lengths, experts)
        lengths = [n + 1 for n in lengths]
