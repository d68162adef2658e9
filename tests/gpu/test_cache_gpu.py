"""Slot maps on CUDA: same state as the CPU path, no host sync, and capturable in a CUDA graph."""

from __future__ import annotations

import random

import pytest
import torch

from ftchat.offload.cache import (
    SlotMaps,
    check_invariants,
    ensure,
    prefetch_ensure,
    prefetch_measure,
)
from ftchat.offload.policy import LRU, RULE

pytestmark = pytest.mark.gpu

LAYERS, EXPERTS, K = 3, 16, 4


def maps_state(m: SlotMaps) -> list[list[int]]:
    """Everything but the sinks, whose values are unspecified."""
    s, n = m.num_slots, m.num_ids
    st = m.stats
    parts = [m.slot_of[:n], m.id_of[:s], m.key[:s], m.clock, *vars(st).values()]
    return [x.tolist() for x in parts]


def rows(rng: random.Random, batch: int) -> list[list[int]]:
    return [rng.sample(range(EXPERTS // 2), K // 2) + rng.sample(range(EXPERTS), K // 2)
            for _ in range(batch)]


@pytest.mark.parametrize("batch,policy", [(1, LRU), (2, RULE)])
def test_cuda_matches_cpu_without_host_syncs(batch, policy):
    rng = random.Random(batch)
    cpu = SlotMaps.create(LAYERS, EXPERTS, 20, "cpu")
    gpu = SlotMaps.create(LAYERS, EXPERTS, 20, "cuda")
    for step in range(300):
        layer = step % LAYERS
        ids = torch.tensor(rows(rng, batch))
        cands = torch.tensor([rng.randrange(EXPERTS) for _ in range(8)])
        ids_g, cands_g = ids.cuda(), cands.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync below raises
        try:
            c_g = prefetch_measure(gpu, layer, cands_g, 3, ids_g)
            p_g = ensure(gpu, layer, ids_g, policy)
            pf_g = prefetch_ensure(gpu, (layer + 1) % LAYERS, cands_g, 3, p_g.slots)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        c = prefetch_measure(cpu, layer, cands, 3, ids)
        p = ensure(cpu, layer, ids, policy)
        pf = prefetch_ensure(cpu, (layer + 1) % LAYERS, cands, 3, p.slots)
        for a, b in ((c, c_g), (p, p_g), (pf, pf_g)):
            for name, x in vars(a).items():
                assert x.tolist() == getattr(b, name).tolist(), (step, name)
        assert maps_state(gpu) == maps_state(cpu), step
        assert check_invariants(gpu) == []
    assert sum(maps_state(cpu)[6]) > 0  # prefetch installs happened


def test_graph_replay_writes_the_same_maps_as_eager():
    rng = random.Random(5)
    cpu = SlotMaps.create(LAYERS, EXPERTS, 24, "cpu")
    gpu = SlotMaps.create(LAYERS, EXPERTS, 24, "cuda")
    ids_buf = [torch.zeros(2, K, dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
    cand_buf = [torch.zeros(8, dtype=torch.int64, device="cuda") for _ in range(LAYERS)]

    def step(layer: int):
        p = ensure(gpu, layer, ids_buf[layer], RULE)
        pf = prefetch_ensure(gpu, (layer + 1) % LAYERS, cand_buf[layer], 4, p.slots)
        return p, pf

    def feed(layer: int):
        ids = torch.tensor(rows(rng, 2))
        cands = torch.tensor([rng.randrange(EXPERTS) for _ in range(8)])
        ids_buf[layer].copy_(ids)
        cand_buf[layer].copy_(cands)
        p = ensure(cpu, layer, ids, RULE)
        return p, prefetch_ensure(cpu, (layer + 1) % LAYERS, cands, 4, p.slots)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in range(LAYERS):  # warm-up: real steps, mirrored on the CPU maps
            feed(layer)
            step(layer)
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = [], []
    for layer in range(LAYERS):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(step(layer))
        graphs.append(g)
    torch.cuda.synchronize()
    assert maps_state(gpu) == maps_state(cpu)  # capture itself wrote nothing
    for i in range(150):
        layer = i % LAYERS
        want = feed(layer)
        graphs[layer].replay()
        torch.cuda.synchronize()
        for a, b in zip(want, outs[layer]):
            for name, x in vars(a).items():
                assert x.tolist() == getattr(b, name).tolist(), (i, name)
        assert maps_state(gpu) == maps_state(cpu), i
    assert check_invariants(gpu) == []
