"""What the decoder asks of the routed experts: the ExpertBackend protocol and its pending value.

The MoE block splits its routed experts in two calls so the shared expert runs in between:
`begin` makes the routed experts readable (offload: slot lookup, demand copies, prefetch) and
returns a Pending; `finish` waits for it and runs the routed expert kernel. On CUDA decode the
block hands `finish` the shared expert's down output and gate logit (SharedOut), and the routed
kernel adds the gated shared expert in its weighted sum (docs/model.md section 5.1).
Legend: T tokens, D hidden, K top-k, R row bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from torch import Tensor


class SharedOut(NamedTuple):
    """The shared expert before its gate: down_s(silu(g) * u) [T, D] and the gate logit
    w_sg . x [T, 1] (any row stride), both in the model dtype."""

    down: Tensor
    gate_logit: Tensor


@dataclass(frozen=True)
class Pending:
    """The routed experts of one MoE block between `begin` and `finish`."""

    layer: int
    ids: Tensor  # [T, K] expert ids (in the layer)
    slots: Tensor  # [T, K] int32 or int64: the row of `bank` that holds each routed expert
    bank: Tensor  # [S(+1), R] uint8 rows the expert kernel reads
    ready: object = None  # event (or None): the rows are written once it completes


class ExpertBackend(Protocol):
    """Routed experts of every MoE block of a decoder, and their figures.

    Capture lifecycle: `before_capture()` is called before a CUDA graph's warm-up and capture of
    the decode step, `after_capture()` after it; whatever the warm-up steps did to the backend's
    state (cache contents, counters) is undone there, so the first real step sees a cold
    backend."""

    def begin(self, layer: int, x: Tensor, ids: Tensor) -> Pending:
        """Make experts `ids` [T, K] of `layer` readable; x [T, D] is the router input."""

    def finish(self, pending: Pending, x: Tensor, weights: Tensor,
               shared: SharedOut | None = None) -> Tensor:
        """Weighted sum [T, D] of the routed experts' outputs (weights [T, K]); with `shared`,
        plus sigmoid(gate logit) * the shared down output in the model dtype (the MoE output)."""

    def end_step(self, tokens: int) -> None:
        """One decode step of `tokens` tokens (the batch) is complete."""

    def reset(self) -> None:
        """Forget every cached expert and every figure (a cold backend)."""

    def stats(self) -> Mapping[str, float | int | None]:
        """Figures for the panel and --json (may sync the device: call rarely)."""

    def close(self) -> None:
        """Release files and buffers the backend opened (debug records)."""

    def for_prefill(self) -> ExpertBackend:
        """The backend prefill chunks run through (they route to most experts of a layer)."""

    def before_capture(self) -> None:
        """A CUDA graph of the decode step is about to be warmed up and captured."""

    def after_capture(self) -> None:
        """The capture is done: undo the warm-up's effects."""


class ForwardingBackend:
    """An ExpertBackend that forwards every call to `inner`: subclass it to watch or alter
    some calls (tests, routing capture)."""

    def __init__(self, inner: ExpertBackend):
        self.inner = inner

    def begin(self, layer: int, x: Tensor, ids: Tensor) -> Pending:
        return self.inner.begin(layer, x, ids)

    def finish(self, pending: Pending, x: Tensor, weights: Tensor,
               shared: SharedOut | None = None) -> Tensor:
        return self.inner.finish(pending, x, weights, shared)

    def end_step(self, tokens: int) -> None:
        self.inner.end_step(tokens)

    def reset(self) -> None:
        self.inner.reset()

    def stats(self) -> Mapping[str, float | int | None]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def for_prefill(self) -> ExpertBackend:
        return self.inner.for_prefill()

    def before_capture(self) -> None:
        self.inner.before_capture()

    def after_capture(self) -> None:
        self.inner.after_capture()
