"""GPU tier (`pytest -m gpu`): ftchat.profile counts exactly the kernels a known sequence of
torch ops launches, eager and under CUDA graph replay, and leaves copies out."""

from __future__ import annotations

import pytest
import torch

from ftchat.profile import kernels_per_call, profile_call

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _adds(x: torch.Tensor, n: int):
    """n in-place elementwise ops on a preallocated tensor: one kernel each, no allocation."""

    def fn():
        for _ in range(n):
            x.add_(1.0)

    return fn


@pytest.mark.parametrize("n", [1, 7, 40])
def test_n_elementwise_ops_are_n_kernels(n):
    x = torch.zeros(1 << 16, device=DEV)
    fn = _adds(x, n)
    fn()  # warm-up
    assert kernels_per_call(fn, DEV) == n
    assert x[0].item() == 2 * n  # the profiled call ran once


def test_different_ops_each_count_once():
    x = torch.rand(1 << 16, device=DEV)
    y = torch.empty_like(x)

    def fn():
        torch.mul(x, 2.0, out=y)
        y.sub_(x)
        x.neg_()
        torch.exp(x, out=y)
        y.clamp_(max=0.5)

    fn()
    assert kernels_per_call(fn, DEV) == 5


def test_copies_are_not_kernels():
    x = torch.rand(1 << 16, device=DEV)
    y = torch.empty_like(x)
    host = torch.empty(x.shape, pin_memory=True)

    def fn():
        x.add_(1.0)
        y.copy_(x)  # device to device: a cudaMemcpyAsync
        host.copy_(x, non_blocking=True)  # device to host
        y.mul_(3.0)

    fn()
    assert kernels_per_call(fn, DEV) == 2


def test_graph_replay_counts_its_kernel_nodes():
    x = torch.zeros(1 << 16, device=DEV)
    fn = _adds(x, 9)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    assert kernels_per_call(g.replay, DEV) == 9


def test_busy_time_and_per_layer_figures():
    x = torch.zeros(1 << 24, device=DEV)  # 64 MB: each add is a few microseconds
    fn = _adds(x, 12)
    fn()
    p = profile_call(fn, DEV)
    assert p.kernels == 12
    assert p.busy_us > 0
    k, us = p.per_layer(4)
    assert k == 3 and us == pytest.approx(p.busy_us / 4)
