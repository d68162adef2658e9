"""Decode with the routing a source gives instead of the model's routers (`ftchat bench
--routing`): the routed ids, their weights, the lookahead's candidates and the router logits
the `score` eviction reads come from the source; everything else runs as in real decode (the
cache kernels, the copies, the expert kernels, CUDA graphs). The source's step sits in device
buffers of fixed address, rewritten after every decode step, so a graph replay sees a new
step each time. Prefill keeps the model's own routing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.errors import FtchatError, UsageError
from ftchat.model.expert_backend import ExpertBackend, ForwardingBackend, Pending, SharedOut
from ftchat.offload.backend import OffloadExperts
from ftchat.routing.calibrated import FITS, Geometry, RoutingStep, generate
from ftchat.routing.trace import cycle, read_trace

Steps = Callable[[], Iterator[RoutingStep]]  # a fresh stream of steps from the first


@dataclass(frozen=True)
class RoutingSource:
    """`model`, `calibrated[:FIT]` or `trace:FILE` (the --routing flag), checked early."""

    kind: str  # model | calibrated | trace
    arg: str = ""  # the fit's name or the trace's path
    seed: int = 0

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> RoutingSource:
        kind, _, arg = spec.partition(":")
        if kind == "model" and not arg:
            return cls("model")
        if kind == "calibrated":
            fit = arg or "default"
            if fit not in FITS:
                raise UsageError(f"--routing {spec!r}: no fit {fit!r} (fits: "
                                 f"{', '.join(FITS)})")
            return cls("calibrated", fit, seed)
        if kind == "trace" and arg:
            return cls("trace", arg)
        raise UsageError(f"--routing {spec!r}: expected model, calibrated[:FIT] or trace:FILE")

    def __str__(self) -> str:
        return self.kind + (f":{self.arg}" if self.arg else "")

    def steps(self, geo: Geometry) -> Steps:
        """A factory of step streams for a model of this geometry (None-free: not for model)."""
        if self.kind == "calibrated":
            params = FITS[self.arg]
            return lambda: generate(geo, params, self.seed)
        trace = read_trace(self.arg)
        first = trace[0]
        got = (first.routed.shape[0], first.routed.shape[1], int(first.routed.max()) + 1)
        if got[0] != geo.num_layers or got[1] != geo.top_k or got[2] > geo.num_experts:
            raise FtchatError(f"routing trace {self.arg}: {got[0]} layers of top-{got[1]} ids "
                              f"up to {got[2] - 1}; the model has {geo.num_layers} layers, "
                              f"top-{geo.top_k} of {geo.num_experts} experts")
        if first.logits is not None and first.logits.shape[1] != geo.num_experts:
            raise FtchatError(f"routing trace {self.arg}: {first.logits.shape[1]} router logits "
                              f"a layer; the model has {geo.num_experts} experts")
        return lambda: cycle(trace)


class ForcedRouting(ForwardingBackend):
    """An ExpertBackend whose decode steps route as `steps` says (bs rows route alike)."""

    def __init__(self, inner: ExpertBackend, steps: Steps, geo: Geometry, batch: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(inner)
        self.make = steps
        L, K, E = geo.num_layers, geo.top_k, geo.num_experts
        self.ids = torch.zeros(L, batch, K, dtype=torch.int64, device=device)  # [L, B, K]
        self.weights = torch.zeros(L, batch, K, dtype=dtype, device=device)  # [L, B, K]
        self.cands = torch.zeros(L, geo.candidates, dtype=torch.int64, device=device)  # [L, C]
        self.logits = torch.zeros(L, E, dtype=torch.float32, device=device)  # [L, E]
        # eviction `score` reads the source's logits: a trace recorded without them has none
        self.needs_logits = isinstance(inner, OffloadExperts) and inner.policy.reads_scores
        if isinstance(inner, OffloadExperts):  # the lookahead and the scores follow the source
            inner.predictor = lambda nxt, x: self.cands[nxt]
            inner.scorer = lambda layer, x: self.logits[layer][None].expand(x.shape[0], -1)
        self._restart()

    def _restart(self) -> None:
        self.it = self.make()
        self._load(next(self.it))

    def _load(self, s: RoutingStep) -> None:
        """The next step into the device buffers (behind the last step's work on the stream)."""
        self.ids.copy_(torch.from_numpy(s.routed)[:, None].expand_as(self.ids))
        self.weights.copy_(torch.from_numpy(s.weights)[:, None].expand_as(self.weights))
        self.cands[1:].copy_(torch.from_numpy(s.candidates))  # row l+1 predicted at layer l
        if s.logits is not None:
            self.logits.copy_(torch.from_numpy(s.logits))
        elif self.needs_logits:
            raise FtchatError("--eviction score needs router logits, and this routing trace has "
                              "none (it was recorded before --record-routing wrote them)")

    def begin(self, layer: int, x: Tensor, ids: Tensor) -> Pending:
        return self.inner.begin(layer, x, self.ids[layer, :ids.shape[0]])

    def finish(self, pending: Pending, x: Tensor, weights: Tensor,
               shared: SharedOut | None = None) -> Tensor:
        return self.inner.finish(pending, x, self.weights[pending.layer, :weights.shape[0]],
                                 shared)

    def end_step(self, tokens: int) -> None:
        self.inner.end_step(tokens)
        self._load(next(self.it))

    def reset(self) -> None:
        self.inner.reset()
        self._restart()

    def after_capture(self) -> None:
        self.inner.after_capture()
        self._restart()


def first_steps(source: RoutingSource, geo: Geometry, n: int) -> list[RoutingStep]:
    """The first n steps a ForcedRouting of this source decodes (for the replay)."""
    return list(itertools.islice(source.steps(geo)(), n))
