"""Device time of a call under CUDA-graph replay, shared by the kernel benchmarks (H200 only).

`graph_us(body, calls)`: body() once on a side stream (Triton compiles, cuBLAS picks its
kernels), captured into one graph, replayed; the median replay time over `iters` replays
(`median_replay`), in us, divided by the `calls` the body makes. Bodies cycle through distinct inputs or weight sets, so a
call's figure is its steady-state cost inside a long graph, with its weights read from HBM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def median_replay(graph: torch.cuda.CUDAGraph, iters: int = 30) -> float:
    """Median seconds of one replay of a captured graph (CUDA events), after one warm replay."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def graph_us(body: Callable[[], object], calls: int, iters: int = 30) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return median_replay(graph, iters) * 1e6 / calls
