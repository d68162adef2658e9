"""Inputs shared by the kernel tests (CPU tier and tests/gpu): slot banks, routing, copy plans."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from ftchat.codecs import nvfp4
from ftchat.codecs.rows import RowLayout


def random_rows(layout: RowLayout, n: int, gen: torch.Generator) -> Tensor:
    """n expert rows [n, R] with random weights (NVFP4 through the real quantizer)."""
    H, I = layout.hidden, layout.inter
    rows = []
    for _ in range(n):
        gate_up = torch.randn(2 * I, H, generator=gen) / H**0.5
        down = torch.randn(H, I, generator=gen) / I**0.5
        if layout.kind != "nvfp4":
            rows.append(layout.pack({"gate_up": gate_up, "down": down}))
            continue
        parts = {}
        for name, w in (("gate_up", gate_up), ("down", down)):
            # gate and up get their own global, as a checkpoint has one per projection
            halves = w.chunk(2) if name == "gate_up" else (w,)
            q = [nvfp4.quantize(h) for h in halves]
            parts[name] = torch.cat([p for p, _, _ in q])
            parts[name + "_scale"] = torch.cat([s for _, s, _ in q])
            parts[name + "_global"] = torch.cat([g.expand(h.shape[0]) for h, (_, _, g)
                                                 in zip(halves, q)])
        rows.append(layout.pack(parts))
    return torch.stack(rows)


def exact_rows(layout: RowLayout, n: int, gen: torch.Generator) -> Tensor:
    """Rows whose routed output is exact in fp32 for x with entries in {1, 2}: gate weights in
    {1, 2} (so g >= 32 and silu(g) == g), up and down weights in {0, +-1} times powers of two.
    Every partial sum is then a short dyadic number, so any reduction order gives the same bits."""
    H, I = layout.hidden, layout.inter
    rows = []
    for _ in range(n):
        gate = torch.randint(1, 3, (I, H), generator=gen).float()
        up = torch.randint(-1, 2, (I, H), generator=gen).float()
        down = torch.randint(-1, 2, (H, I), generator=gen).float()
        if layout.kind != "nvfp4":
            rows.append(layout.pack({"gate_up": torch.cat([gate, up]), "down": down / 256}))
            continue
        # E2M1 codes 2 (1.0), 4 (2.0), 10 (-1.0), 0; block scales 0.5 / 2 in e4m3; globals 2^-k
        up_scale = torch.full((I, H // 16), 2.0)
        parts = {
            "gate_up": _codes(torch.cat([gate, up / 2])),
            "gate_up_scale": torch.cat([torch.ones(I, H // 16), up_scale]),
            "gate_up_global": torch.cat([torch.ones(I), torch.full((I,), 0.5)]),
            "down": _codes(down),
            "down_scale": torch.full((H, I // 16), 0.5),
            "down_global": torch.full((H,), 2.0**-7),
        }
        rows.append(layout.pack(parts))
    return torch.stack(rows)


def _codes(values: Tensor) -> Tensor:
    return nvfp4.pack_nibbles(nvfp4.e2m1_codes(values))


def place(rows: Tensor, num_slots: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """A bank [num_slots + 1, R] holding rows [E, R] at random slots (garbage elsewhere, sink
    included) and slot_of [E] int64."""
    E, R = rows.shape
    bank = torch.randint(0, 256, (num_slots + 1, R), dtype=torch.uint8, generator=gen)
    slot_of = torch.randperm(num_slots, generator=gen)[:E]
    bank[slot_of] = rows
    return bank, slot_of


def routing(T: int, K: int, E: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Distinct ids [T, K] per token and softmax weights [T, K] fp32."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return ids, torch.softmax(torch.randn(T, K, generator=gen), dim=-1)


def copy_plan(M: int, count: int, N: int, S: int, gen: torch.Generator,
              dup_src: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A plan of M entries, count real: distinct destination slots, sources drawn with or
    without repeats; entries >= count point at the sinks (src N, dst S)."""
    src = torch.full((M,), N, dtype=torch.int64)
    dst = torch.full((M,), S, dtype=torch.int32)
    if dup_src:
        src[:count] = torch.randint(0, N, (count,), generator=gen)
    else:
        src[:count] = torch.randperm(N, generator=gen)[:count]
    dst[:count] = torch.randperm(S, generator=gen)[:count].int()
    return src, dst, torch.tensor([count], dtype=torch.int32)


def expected_copy(host: Tensor, bank: Tensor, src: Tensor, dst: Tensor, count: int) -> Tensor:
    """What the bank must hold after the plan, except its sink row (written by a plain loop)."""
    want = bank.clone()
    for i in range(count):
        want[int(dst[i])] = host[int(src[i])]
    return want


# ===== the Triton kernel test files (tests/gpu) =====


def kernel_device(device: str, interpret: bool, has_triton: bool):
    """Body of the kernel test files' autouse fixture (use with `yield from`): checks that the
    chosen device can run the kernels; on CUDA it runs the test with the references' cuBLAS at
    fp32 sums of exact products, as on the CPU (no reduced-precision bf16 reduction, no TF32)."""
    assert has_triton, "these tests need triton"
    if device == "cpu":
        assert interpret, "FTCHAT_TEST_DEVICE=cpu needs TRITON_INTERPRET=1 (the interpreter)"
        yield
        return
    assert not interpret and torch.cuda.is_available(), \
        "no CUDA: set FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 to run on CPU"
    mm = torch.backends.cuda.matmul
    old = mm.allow_bf16_reduced_precision_reduction, mm.allow_tf32
    mm.allow_bf16_reduced_precision_reduction = mm.allow_tf32 = False
    try:
        yield
    finally:
        mm.allow_bf16_reduced_precision_reduction, mm.allow_tf32 = old


def capture(step):
    """(graph, outputs): step() once on a side stream (Triton compiles outside the capture),
    then captured into a CUDA graph; replay it after changing step's inputs in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def old_decode_blocks(rule: str, eager_cache: Callable[[int], int], capacity: int):
    """A stand-in for qsa.decode_blocks with one of the two rules that made eager decode and
    graph replay differ below the budget (the controls of the span tests): "span", K sized by
    kv_len // r; "cache", K = min(top, the cache's blocks). Calls at kv_len == capacity are the
    captured step's (a cache of `capacity` tokens); the others the eager step's, whose cache
    holds eager_cache(kv_len) tokens."""
    def sized(kv_len: int, a) -> tuple[int, int]:
        r, top = a.indexer_compress_ratio, a.indexer_budget // a.indexer_compress_ratio
        if rule == "span":
            N = kv_len // r
        else:
            cache = capacity if kv_len == capacity else eager_cache(kv_len)
            N = min(max(kv_len // r, top), cache // r)
        return N, min(top, N)

    assert rule in ("span", "cache")
    return sized


def needs_hopper(what: str):
    """Skip marker for a test of `what` that needs a CUDA GPU of sm_90 or later (PDL): not the
    interpreter, not an older GPU."""
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    return pytest.mark.skipif(not cuda or torch.cuda.get_device_capability() < (9, 0),
                              reason=f"{what} needs a CUDA GPU of sm_90 or later (not the "
                                     "interpreter)")
