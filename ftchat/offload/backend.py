"""The offloaded expert backend: slot cache, demand copies, prefetch from a router lookahead.

One MoE block of layer L (docs/design.md section 3), in program order:
  predictor: fork at the block start; layer L+1's router on router_in(L) -> candidates(L+1)
  compute:   wait prefetch_done(L) (the join), ensure(L) -> demand plan;
             prefetch_ensure(L+1) after the predictor's event -> prefetch plan
  copy:      after ensure: demand copy of L -> demand_done(L)
  prefetch:  after demand_done(L): prefetch copy of L+1 -> prefetch_done(L+1)
  compute:   shared expert (overlaps the copies), wait demand_done(L), routed expert kernel
Every slot-map write (ensure, prefetch_ensure) is issued on the compute stream.
Prefill runs through `for_prefill()`: it reads its experts from the host rows (CPU) or a staging
area (CUDA: host rows, and slots the cache holds); on a large chunk the next layer's experts
stream into that area while this layer's mixer runs. A large cache lends its last E+1 slots as
that area (emptied at each prefill call); a small one keeps its own and is left untouched.
Legend: T tokens, D hidden, K top-k, C candidates, S slots, R row bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ftchat.errors import SettingsError
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.model.expert_backend import Pending, SharedOut
from ftchat.codecs.rows import RowLayout
from ftchat.offload import cache as sc
from ftchat.offload.budget import AUTO_CAP, AutoBudget
from ftchat.offload.cache_kernels import ensure_any, prefetch_ensure_any
from ftchat.offload.copy import copy_rows
from ftchat.offload.experts import routed_experts_any
from ftchat.offload.hooks import BackendView, Hooks
from ftchat.offload.policy import MAX_BUDGET, POLICIES, SCORE_CLOCK0
from ftchat.offload.scores import RouterScores
from ftchat.offload.streams import CpuStreams, CudaStreams

if TYPE_CHECKING:
    from ftchat.settings import Settings


def router_lookahead(x: Tensor, router: Tensor, k: int) -> Tensor:
    """Top-k candidates [k] of the next layer: its router [E, D] on this layer's input x [T, D],
    probabilities summed over the tokens. Reads no cache state."""
    probs = torch.softmax(x @ router.T, dim=-1, dtype=torch.float32)  # [T, E]
    return probs.sum(0).topk(k).indices


class _NoCache:
    """Lifecycle and figures of a backend that caches nothing: every call is a no-op."""

    def end_step(self, tokens: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def stats(self) -> dict[str, float | int | None]:
        return {}  # no cache, no offload figures

    def close(self) -> None:
        pass

    def before_capture(self) -> None:
        pass

    def after_capture(self) -> None:
        pass


class ResidentExperts(_NoCache):
    """Every expert resident: rows [L*E, R]; the slot of (layer, e) is layer*E + e.

    `begin` hands the kernel the layer's E rows as the bank (a view starting at row layer*E),
    so the router's ids are the slots as they are: no kernel runs between the router and the
    routed experts. `kernels`: the kernel configuration its expert kernels run with."""

    def __init__(self, rows: Tensor, layout: RowLayout, num_experts: int,
                 kernels: KernelConfig = DEFAULT):
        self.rows, self.layout, self.num_experts = rows, layout, num_experts
        self.kernels = kernels

    def begin(self, layer: int, x: Tensor, ids: Tensor) -> Pending:
        E = self.num_experts
        return Pending(layer, ids, ids, self.rows[layer * E:(layer + 1) * E])

    def finish(self, pending: Pending, x: Tensor, weights: Tensor,
               shared: SharedOut | None = None) -> Tensor:
        p = pending
        return routed_experts_any(x, p.bank, self.layout, p.slots, p.ids, weights, shared,
                                  kc=self.kernels)

    def for_prefill(self) -> ResidentExperts:
        return self


@dataclass(frozen=True)
class OffloadConfig:
    """What the offload backend takes from the Settings (which own every default)."""

    num_slots: int
    policy: str  # Eviction: rule | lru
    prefetch: str  # Prefetch: off | measure | on
    budget_gdn: int | None  # prefetch budget when the prefetched layer is GDN; None: auto
    budget_attn: int | None  # ... when it is attention
    candidates: int  # router-lookahead top-K (at most the layer's experts)
    overlap: bool
    copy_programs: int

    @classmethod
    def from_settings(cls, s: Settings, num_slots: int, num_experts: int) -> OffloadConfig:
        """s.prefetch resolved (off | measure | on: Settings.prefetch_mode)."""
        assert s.prefetch != "auto", "resolve the prefetch mode first (Settings.prefetch_mode)"
        top = min(num_slots, MAX_BUDGET - 1)  # a prefetch plan holds at most this many
        for flag, b in (("--budget-gdn", s.budget_gdn), ("--budget-attn", s.budget_attn)):
            if s.prefetch != "off" and b is not None and b > top:
                raise SettingsError(f"{flag} {b} (or --budget): expected 0 to {top}, at most "
                                    f"the {num_slots} expert slots")
        return cls(num_slots, s.eviction, s.prefetch, s.budget_gdn, s.budget_attn,
                   min(s.candidates, num_experts), s.overlap, s.copy_programs)

    def layer_budgets(self, attention_layers: set[int], num_layers: int) -> list[int | None]:
        """Per layer: its fixed budget, or None where it is measured (auto)."""
        return [self.budget_attn if i in attention_layers else self.budget_gdn
                for i in range(num_layers)]


class OffloadExperts:
    """ExpertBackend over a slot cache; see the module docstring for the choreography."""

    def __init__(self, host_rows: Tensor, layout: RowLayout, routers: list[Tensor],
                 attention_layers: set[int], cfg: OffloadConfig, device: torch.device,
                 streams: CpuStreams | CudaStreams, hooks: Hooks | None = None,
                 predictor: Callable[[int, Tensor], Tensor] | None = None,
                 kernels: KernelConfig = DEFAULT, top_k: int = 1):
        # predictor(nxt, x) -> candidates [C] of layer nxt; scorer(layer, x) -> its router
        # logits [T, E] (eviction `score`). A routing source (ftchat/routing/forced.py)
        # replaces both.
        self.predictor = predictor or self.lookahead
        self.scorer = self.router_logits
        self.kernels = kernels  # the kernel configuration its expert kernels run with
        self.host, self.layout, self.cfg, self.device = host_rows, layout, cfg, device
        self.routers = routers  # gate.weight [E, D] per layer (dense, on device)
        self.num_layers, self.num_experts = len(routers), routers[0].shape[0]
        fixed = cfg.layer_budgets(attention_layers, self.num_layers)  # None: auto
        # each prefetch plan's size: an auto layer's is the largest budget auto may pick
        cap = min(AUTO_CAP, cfg.num_slots, MAX_BUDGET - 1)
        self.budgets = [cap if b is None else b for b in fixed]
        self.streams, self.hooks = streams, hooks or Hooks()
        # the router lookahead runs for prefetch, and for a hook that records its candidates
        self.predicts = cfg.prefetch != "off" or self.hooks.reads_candidates
        # ===== fixed-address state (a captured graph reads and writes these) =====
        self.policy = POLICIES[cfg.policy]
        self.maps = sc.SlotMaps.create(self.num_layers, self.num_experts, cfg.num_slots, device,
                                       clock0=SCORE_CLOCK0 if self.policy.reads_scores else 0)
        # eviction `score`: every layer's router logits, folded in at the next step's start
        self.scores = (RouterScores(self.num_layers, self.num_experts, top_k, device)
                       if self.policy.reads_scores else None)
        self.maps.on_write = self.hooks.on_map_write
        self.bank = torch.zeros(cfg.num_slots + 1, layout.nbytes, dtype=torch.uint8, device=device)
        # --budget auto: the per-layer budget the prefetch kernel reads from the device
        self.auto = (AutoBudget.measured(fixed, cap, host_rows, self.bank, streams,
                                         self.maps.stats.misses, cfg.copy_programs)
                     if None in fixed and cfg.prefetch == "on" else None)
        # measure mode: per layer [selected, useful, demand misses] (what prefetch would do)
        self.measured = torch.zeros(self.num_layers, 3, dtype=torch.int64, device=device)
        # predictor output per layer [C] (written on the predictor stream)
        self.cands = torch.zeros(self.num_layers, cfg.candidates, dtype=torch.int64, device=device)
        self.pred_done: list[object] = [None] * self.num_layers
        self.prefetch_done: list[object] = [None] * self.num_layers
        self.step = 0  # decode steps so far (debug records)
        self.staged: StagedExperts | None = None
        self.tokens, self.started = 0, None  # figures for stats()
        self.live: list[tuple | None] = [None] * self.num_layers  # see begin()
        self.view = BackendView(self)  # what the hooks may read

    # ===== ExpertBackend =====
    def for_prefill(self) -> ResidentExperts | StagedExperts:
        """Prefill reads its experts from the host rows (CPU) or a staging area (CUDA, filled
        from the host and from the slots it finds resident: `staged_prefill`)."""
        if self.auto is not None:
            self.auto.restart()  # a span times decode steps: this prefill is not one
        if self.device.type == "cpu":
            return ResidentExperts(self.host, self.layout, self.num_experts, self.kernels)
        return self.staged_prefill()

    @property
    def lends_staging(self) -> bool:
        """The staging area is the bank's last E+1 slots (see `staged_prefill`)."""
        return lends_staging(self.cfg.num_slots, self.num_experts)

    def staged_prefill(self) -> StagedExperts:
        """The staging backend for one prefill call: CUDA's path, and on the CPU (stream
        emulation) the tests'. With at least LEND_STAGING_FACTOR x (E+1) slots the staging area
        is the bank's last E+1 slots, so it costs no VRAM of its own (1.33 GiB at flash-next's
        geometry: ~510 more slots in a 16 GB plan): they are emptied here at every call, on the
        compute stream (the maps' one writer), after every prefetch copy has been joined, and
        decode refills them on demand afterwards. A smaller cache gets a staging buffer of its
        own and is left untouched by prefill."""
        E, S = self.num_experts, self.cfg.num_slots
        if self.staged is None:
            staging = self.bank[S - E - 1:S] if self.lends_staging else None  # not the sink row
            self.staged = StagedExperts(self.host, self.layout, E, self.device, self.streams,
                                        self.cfg.copy_programs, (self.maps.slot_of, self.bank),
                                        staging=staging, kernels=self.kernels)
        if self.lends_staging:
            # every prefetch copy is joined by its layer's step already, unless that step was cut
            # short: wait for all the prefetch stream holds (a fresh event: the ones kept in
            # prefetch_done may have been recorded inside a graph capture)
            self.streams.wait("compute", self.streams.record("prefetch"))
            self._run_compute(lambda: sc.empty_slots(self.maps, S - E - 1, S))
        return self.staged

    def reset(self) -> None:
        """Empty the cache in place and zero the figures; addresses are kept (graphs)."""
        sc.clear(self.maps)
        if self.scores is not None:
            self.scores.reset()
        if self.auto is not None:
            self.auto.restart()
        self.tokens, self.started = 0, None
        self.measured.zero_()
        self.cands.zero_()

    def before_capture(self) -> None:
        pass  # the warm-up and capture run real steps: after_capture undoes them

    def after_capture(self) -> None:
        self.reset()
        self.step = 0

    def begin(self, layer: int, x: Tensor, ids: Tensor) -> Pending:
        s, cfg = self.streams, self.cfg
        nxt = layer + 1 if layer + 1 < self.num_layers else None
        if self.predicts and nxt is not None:
            self._predict(nxt, x)
        if cfg.prefetch == "measure" and layer > 0:
            self._measure(layer, ids)  # the maps are as they were when the candidates were made
        self._join(layer)
        if self.scores is not None and layer == 0:
            self._run_compute(lambda: self.scores.observe(self.maps))  # rekey before evicting
        plan = self._run_compute(lambda: ensure_any(self.maps, layer, ids, self.policy))
        # the demand copy starts as soon as its plan exists: the lookahead and prefetch_ensure
        # below run on the compute stream while it copies
        s.hand_off("copy", plan.src, plan.dst, plan.count)
        self.hooks.before_copy(self.view, plan, layer, "demand")
        s.run("copy", lambda: self._copy(plan, layer, "demand"))
        demand_done = s.record("copy")
        pplan = None
        if cfg.prefetch == "on" and nxt is not None:
            s.wait("compute", self.pred_done[nxt])
            pplan = self._install_prefetch(nxt, plan.slots)  # protects the demand copy's slots
            s.wait("prefetch", demand_done)  # demand first: one link
            s.hand_off("prefetch", pplan.src, pplan.dst, pplan.count)
            self.hooks.before_copy(self.view, pplan, nxt, "prefetch")
            s.run("prefetch", lambda: self._copy(pplan, nxt, "prefetch"))
            self.prefetch_done[nxt] = s.record("prefetch")
        if self.scores is not None:  # read at the next step only: it runs under the copy
            self._run_compute(lambda: self.scores.record(layer, self.scorer(layer, x), ids))
        if not cfg.overlap:
            s.wait("compute", demand_done)
        # NOTE: the side streams read these after Python is done with them; holding them until
        # this layer's next step keeps the allocator (or a graph capture) from reusing the memory
        # while a delayed copy or predictor still reads it.
        self.live[layer] = (plan, pplan, x)
        return Pending(layer, ids, plan.slots, self.bank, demand_done)

    def finish(self, p: Pending, x: Tensor, weights: Tensor,
               shared: SharedOut | None = None) -> Tensor:
        self.streams.wait("compute", p.ready)
        self.hooks.before_kernel(self.view, p)
        out = routed_experts_any(x, p.bank, self.layout, p.slots, p.ids, weights, shared,
                                 kc=self.kernels)
        self.hooks.after_kernel(self.view, p)
        return out

    def end_step(self, tokens: int) -> None:
        """A decode step of `tokens` tokens is complete (debug audits count steps)."""
        self.step += 1
        self.tokens += tokens
        if self.started is None:
            self.started = time.perf_counter()
        if self.auto is not None:
            self.auto.end_step(tokens)
        self.hooks.end_step(self.view)

    def stats(self) -> dict[str, float | int | None]:
        """Offload figures for the panel, bench and --json; misses, hits, prefetch_installs and
        prefetch_useful are running totals. SYNC: reads device counters (call rarely)."""
        st = self.maps.stats
        hits, misses = int(st.hits.sum()), int(st.misses.sum())
        installs, useful = int(st.prefetch_installs.sum()), int(st.prefetch_useful.sum())
        copied = (misses + installs) * self.layout.nbytes
        elapsed = time.perf_counter() - self.started if self.started else 0.0
        out = {"slots": self.cfg.num_slots, "decode_tokens": self.tokens,
               "misses": misses, "hits": hits, "prefetch_installs": installs,
               "prefetch_useful": useful,
               "misses_per_token": misses / self.tokens if self.tokens else None,
               "hit_rate": hits / (hits + misses) if hits + misses else None,
               "copy_gb": copied / 1e9,
               "copy_gbps": copied / 1e9 / elapsed if elapsed > 0 else None}  # average link use
        if self.staged is not None:  # prefill (CUDA): rows copied from the host vs from slots
            out.update(prefill_copy_gb=int(self.staged.rows_from_host) * self.layout.nbytes / 1e9,
                       prefill_rows_from_slots=int(self.staged.rows_from_slots))
        if self.cfg.prefetch == "on":
            out.update(prefetch_copies=installs, useful_prefetches=useful,
                       precision=useful / installs if installs else None)
            if self.auto is not None:  # None while the window is still measuring
                out.update(budget_auto=self.auto.chosen, link_row_us=self.auto.row_s * 1e6,
                           auto_compute_us=self.auto.layer_compute_us,
                           auto_trial_ms=self.auto.trial_ms)
        elif self.cfg.prefetch == "measure":
            selected, useful, missed = self.measured.sum(0).tolist()
            out.update(useful_prefetches=useful, precision=useful / selected if selected else None,
                       covered_misses=useful / missed if missed else None)
        out.update(self.hooks.figures())  # debug figures, when hooks watch
        return out

    def close(self) -> None:
        self.hooks.close()

    # ===== parts =====
    def candidates(self, layer: int) -> Tensor:
        """The lookahead's candidates [C] for `layer` (made at layer - 1), once they exist."""
        self.streams.wait("compute", self.pred_done[layer])
        return self.cands[layer]

    def _run_compute(self, fn):
        out = []
        self.streams.run("compute", lambda: out.append(fn()))
        return out[0]

    def _join(self, layer: int) -> None:
        """The compute stream waits for layer's prefetch copy before issuing its demand copy:
        that copy may target a wrong guess's slot, and the routed kernel reads right ones."""
        self.streams.wait("compute", self.prefetch_done[layer])

    def _install_prefetch(self, nxt: int, protect: Tensor) -> sc.PrefetchPlan:
        """prefetch_ensure(nxt) on the compute stream: the maps have one writer."""
        limit = self.auto.limit if self.auto is not None else None
        return self._run_compute(lambda: prefetch_ensure_any(
            self.maps, nxt, self.cands[nxt], self.budgets[nxt], protect, limit))

    def _predict(self, nxt: int, x: Tensor) -> None:
        """Layer nxt's router on this layer's router input, on the predictor stream."""
        s = self.streams
        s.hand_off("predictor", x)

        def run():
            self.cands[nxt] = self.predictor(nxt, x)
        s.run("predictor", run)
        self.pred_done[nxt] = s.record("predictor")

    def lookahead(self, nxt: int, x: Tensor) -> Tensor:
        """The default predictor: layer nxt's router on this layer's router input x."""
        return router_lookahead(x, self.routers[nxt], self.cfg.candidates)

    def router_logits(self, layer: int, x: Tensor) -> Tensor:
        """The default scorer: layer's router on its input x [T, D] -> [T, E] fp32 (the GEMV in
        the model dtype: no fp32 copy of the router in the decode step)."""
        return (x @ self.routers[layer].T).float()

    def step_logits(self, layer: int) -> Tensor:
        """Layer's router logits [T, E] on the input its `begin` of this step received."""
        return self.router_logits(layer, self.live[layer][2])

    def _measure(self, layer: int, ids: Tensor) -> None:
        """Count what prefetch would have done for `layer` (read-only)."""
        self.streams.wait("compute", self.pred_done[layer])
        c = sc.prefetch_measure(self.maps, layer, self.cands[layer], self.budgets[layer], ids)
        self.measured[layer] += torch.cat([c.selected, c.useful, c.misses])

    def _copy(self, plan, layer: int, kind: str) -> None:
        """Runs on the copy's own stream."""
        copy_rows(self.host, self.bank, plan.src, plan.dst, plan.count, self.cfg.copy_programs)
        self.hooks.after_copy(self.view, plan, layer, kind)


# The staging area is lent from the slot bank when the bank has at least this many times E+1
# slots: a prefill then empties at most half of the decode cache, and small caches (the tests'
# tiny models among them) keep a staging buffer of their own
LEND_STAGING_FACTOR = 2


def lends_staging(num_slots: int, num_experts: int) -> bool:
    """Whether a bank of num_slots lends its last E+1 slots to prefill's staging (vram/plan.py
    plans the same)."""
    return num_slots >= LEND_STAGING_FACTOR * (num_experts + 1)


# Prefill chunks of at least this many tokens stream the next layer's experts (all of them):
# with top-10 of 512 experts, 256 tokens leave ~0.7 % of a layer's experts unrouted
STREAM_MIN_TOKENS = 256


@dataclass
class _Ahead:
    """A whole layer's experts copied into staging ahead of its MoE block (layer streaming)."""

    layer: int
    rank: Tensor  # [E] int32: staging row of each expert
    ready: object  # the copy's event
    plans: tuple  # read by the copy stream: kept alive until it ran


class StagedExperts(_NoCache):
    """Prefill on CUDA: each layer's routed experts are copied into a staging area [E+1, R]
    (its own buffer, or slots the cache lent and emptied), then read from there. Experts the
    slot cache holds are copied from their slots (device to device) instead of crossing PCIe
    again; the maps are only read here.

    Layer streaming: once layer L's routed-expert kernel is issued on a chunk of at least
    STREAM_MIN_TOKENS tokens, the copy stream waits for it (the kernel reads staging) and copies
    every expert of layer L+1 (a large chunk routes to nearly all of them), overlapping layer
    L+1's mixer; L+1's `begin` then only waits for that copy. A smaller chunk, or a layer with
    no copy ahead (the first), copies its routed experts on demand.

    Staging order: experts fetched from the host first, then those copied from slots, each
    group by ascending id. rows_from_host / rows_from_slots count rows (device counters)."""

    def __init__(self, host: Tensor, layout: RowLayout, num_experts: int, device: torch.device,
                 streams: CpuStreams | CudaStreams, programs: int, slots: tuple[Tensor, Tensor],
                 stream_layers: bool = True, staging: Tensor | None = None,
                 kernels: KernelConfig = DEFAULT):
        self.host, self.layout, self.E, self.streams, self.programs = (
            host, layout, num_experts, streams, programs)
        self.kernels = kernels
        self.slot_of, self.bank = slots  # the decode cache's [N+1] map and [S+1, R] bank: read only
        self.num_layers = (self.slot_of.numel() - 1) // num_experts
        self.stream_layers = stream_layers
        # [E+1, R]: given (rows of the bank that the caller emptied) or a buffer of its own
        self.staging = torch.empty(num_experts + 1, layout.nbytes, dtype=torch.uint8,
                                   device=device) if staging is None else staging
        assert self.staging.shape == (num_experts + 1, layout.nbytes)
        self.rows_from_host = torch.zeros((), dtype=torch.int64, device=device)
        self.rows_from_slots = torch.zeros((), dtype=torch.int64, device=device)
        self.ahead: _Ahead | None = None
        self.live: tuple = ()

    def begin(self, layer: int, x: Tensor, ids: Tensor) -> Pending:
        ahead, self.ahead = self.ahead, None  # used once: a later prefill never sees it
        if ahead is not None and ahead.layer == layer:
            self.live = ahead.plans
            return Pending(layer, ids, ahead.rank[ids], self.staging, ahead.ready)
        routed = torch.zeros(self.E, dtype=torch.bool, device=ids.device)
        routed[ids.flatten()] = True
        rank, ready = self._stage(layer, routed)
        return Pending(layer, ids, rank[ids], self.staging, ready)

    def _stage(self, layer: int, routed: Tensor) -> tuple[Tensor, object]:
        """Copy the experts of `layer` that `routed` [E] marks into staging (issued on the
        compute stream, run on the copy stream after the compute work so far); (staging row of
        each expert [E] int32, the copy's event)."""
        E, s, dev = self.E, self.streams, routed.device
        # every copy into the slots was joined before the last decode step ended
        slot = self.slot_of[layer * E:(layer + 1) * E]  # [E] slot of expert e, -1 absent
        cached = routed & (slot >= 0)
        group = torch.where(routed & ~cached, 0, torch.where(cached, 1, 2)).to(torch.uint8)
        order = torch.sort(group, stable=True).indices  # [E] host-fetched, from slots, the rest
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(E, device=dev))
        n_host = (group == 0).sum().reshape(1)
        n_slot = cached.sum().reshape(1)
        pos = torch.arange(E, device=dev)
        # host plan: entries [0, n_host) of `order`; slot plan: entries [n_host, n_host + n_slot)
        host_src = torch.where(pos < n_host, order + layer * E, self.host.shape[0])
        at = (pos + n_host).clamp(max=E - 1)  # [E] staging position of slot-plan entry i
        slot_src = slot[order[at]].long().clamp(min=0)
        plans = (host_src, pos.to(torch.int32), n_host.to(torch.int32), slot_src,
                 at.to(torch.int32), n_slot.to(torch.int32))
        s.hand_off("copy", *plans)  # after the compute work so far: the last kernel on staging
        s.run("copy", lambda: self._copy(*plans))
        self.rows_from_host += n_host[0]
        self.rows_from_slots += n_slot[0]
        self.live = plans  # read by the copy stream: keep until the next layer
        return rank.to(torch.int32), s.record("copy")

    def _copy(self, host_src, host_dst, n_host, slot_src, slot_dst, n_slot) -> None:
        copy_rows(self.host, self.staging, host_src, host_dst, n_host, self.programs)
        copy_rows(self.bank, self.staging, slot_src, slot_dst, n_slot, self.programs)

    def finish(self, p: Pending, x: Tensor, weights: Tensor,
               shared: SharedOut | None = None) -> Tensor:
        self.streams.wait("compute", p.ready)
        out = routed_experts_any(x, p.bank, self.layout, p.slots, p.ids, weights, shared,
                                 kc=self.kernels)
        nxt = p.layer + 1
        if self.stream_layers and nxt < self.num_layers and x.shape[0] >= STREAM_MIN_TOKENS:
            every = torch.ones(self.E, dtype=torch.bool, device=x.device)
            rank, ready = self._stage(nxt, every)  # waits for the kernel just issued
            self.ahead = _Ahead(nxt, rank, ready, self.live)
        return out

    def for_prefill(self) -> StagedExperts:
        return self
