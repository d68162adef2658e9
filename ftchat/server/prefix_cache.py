"""State checkpoints of one decode row, for prefix reuse.

The GDN and conv states are recurrent: they cannot be rolled back to an earlier token. So the
engine copies the row's whole state at chosen points (the end of the system prefix, of the
history before the generation prompt, of a prompt) into host memory: the recurrent tensors
whole, the attention K/V and index keys up to the checkpoint's length. A request whose tokens
start with a checkpoint's restores it and prefills only the rest; one whose tokens are a whole
prompt's checkpoint (a retry, a regenerated reply) also restores that prompt's last logits and
prefills nothing. Checkpoints are kept under a byte budget, least recently used evicted first.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.codecs.fp8 import FP8
from ftchat.model.kv_cache import AttentionCache
from ftchat.model.state import DecodeState


@dataclass
class Checkpoint:
    tokens: tuple[int, ...]
    parts: list[Tensor]  # host copies, in `_views` order
    # [1, V] host copy of the last token's logits, kept at the end of a prompt: the same prompt
    # again restores the checkpoint and samples from them, with nothing to prefill
    logits: Tensor | None = None

    @property
    def nbytes(self) -> int:
        extra = [] if self.logits is None else [self.logits]
        return sum(t.numel() * t.element_size() for t in [*self.parts, *extra])


def _views(state: DecodeState, row: int, length: int) -> list[Tensor]:
    """The parts of row `row` a checkpoint at `length` tokens copies (views into the state)."""
    out = []
    for c in state.caches():
        if isinstance(c, AttentionCache):
            ratio = state.max_len // c.kbar.shape[1]
            for name in ("k", "v", "ik", "k_scale", "v_scale"):
                t = getattr(c, name)
                if t is not None:
                    out.append(t[row, :length])
            out.append(c.kbar[row, :math.ceil(length / ratio)])
        else:
            out.extend(t[row] for t in c.tensors())
    out.append(state.ple_ctx[row])
    return [t.view(torch.uint8) if t.dtype == FP8 else t for t in out]


def save(state: DecodeState, row: int, tokens: Sequence[int],
         logits: Tensor | None = None) -> Checkpoint:
    """A host copy of row `row`, which holds exactly `tokens` (and of the last token's logits
    [1, V], when given)."""
    return Checkpoint(tuple(tokens), [t.to("cpu", copy=True)
                                      for t in _views(state, row, len(tokens))],
                      None if logits is None else logits.to("cpu", copy=True))


def restore(state: DecodeState, row: int, ck: Checkpoint) -> None:
    for dst, src in zip(_views(state, row, len(ck.tokens)), ck.parts, strict=True):
        dst.copy_(src)


def _recurrent_views(state: DecodeState, row: int) -> list[Tensor]:
    """Row `row` of every state tensor but the positional attention caches."""
    out = [t[row] for c in state.caches() if not isinstance(c, AttentionCache)
           for t in c.tensors()]
    return [*out, state.ple_ctx[row]]


def save_recurrent(state: DecodeState, row: int) -> list[Tensor]:
    """A copy (on the state's device) of the row's recurrent state: GDN, conv, PLE context."""
    return [t.clone() for t in _recurrent_views(state, row)]


def restore_recurrent(state: DecodeState, row: int, parts: list[Tensor]) -> None:
    for dst, src in zip(_recurrent_views(state, row), parts, strict=True):
        dst.copy_(src)


class PrefixCache:
    """Checkpoints under `budget_bytes`, LRU."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.items: OrderedDict[tuple[int, ...], Checkpoint] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.items.values())

    def best(self, ids: Sequence[int]) -> Checkpoint | None:
        """The longest checkpoint whose tokens start `ids` and leave at least one to prefill,
        or that holds all of `ids` with their last logits."""
        found = None
        for ck in self.items.values():
            n = len(ck.tokens)
            usable = n < len(ids) or (n == len(ids) and ck.logits is not None)
            if usable and (found is None or n > len(found.tokens)) \
                    and tuple(ids[:n]) == ck.tokens:
                found = ck
        if found is not None:
            self.items.move_to_end(found.tokens)
        return found

    def add(self, state: DecodeState, row: int, tokens: Sequence[int],
            logits: Tensor | None = None) -> None:
        """Keep row `row`, which holds exactly `tokens`; with `logits` [1, V], their last
        token's (the end of a prompt)."""
        key = tuple(tokens)
        if self.budget <= 0 or key in self.items:
            if key in self.items:
                self.items.move_to_end(key)
            return
        ck = save(state, row, tokens, logits)
        if ck.nbytes > self.budget:
            return
        self.items[key] = ck
        while self.nbytes > self.budget:
            self.items.popitem(last=False)
