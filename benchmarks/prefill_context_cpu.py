"""CPU prefill tok/s of the tiny synthetic model for 2K, 8K and 32K prompts (issue 17 item 2).

Target: tok/s for a 32K prompt >= half the tok/s for a 2K prompt. Arms:
  after   the query-chunked sparse QSA prefill (qsa.prefill_attention) and the GDN chunks
          formed all at once (gdn.delta_rule_chunked);
  before  the dense QSA prefill (qsa.dense_attention: [T, L] scores and a sort per query) and
          the GDN loop with all of its work per 64-token chunk (1fcacbc, copied below).
Each run is Decoder.prefill (engine chunks of 1024) of a fresh zeroed state, one thread; the
arms alternate within each round so that load from other processes hits both alike, and a
short prompt runs several times a round (a quarter of the longest prompt's tokens at least),
so that its median is as steady as the long one's.

    python benchmarks/prefill_context_cpu.py [--lengths 2048 8192 32768] [--rounds 3]
                                             [--arms after before]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.engine import Decoder, load_model, resident_backend
from ftchat.model import gdn, qsa
from ftchat.model.synth import write_checkpoint


def delta_rule_chunked_loop(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            S: Tensor) -> Tensor:
    """gdn.delta_rule_chunked as of 1fcacbc: the state and the output one chunk at a time."""
    C = gdn.CHUNK
    T = k.shape[2]
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // C
    q, k, v = (t.unflatten(2, (n, C)) for t in (q, k, v))
    g, beta = (t.unflatten(2, (n, C)) for t in (g, beta))
    gamma = g.cumsum(-1)
    diff = gamma[..., :, None] - gamma[..., None, :]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(incl, diff, float("-inf")).exp()
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    kb = k * beta[..., None]
    L = torch.where(strict, (kb @ k.transpose(-1, -2)) * decay, 0.0)
    A = torch.eye(C, device=q.device, dtype=q.dtype) + L
    U = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    Wk = torch.linalg.solve_triangular(A, kb * gamma.exp()[..., None], upper=False,
                                       unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    out = torch.empty_like(v)
    for i in range(n):
        v_new = U[:, :, i] - Wk[:, :, i] @ S
        out[:, :, i] = (q[:, :, i] * gamma[:, :, i, :, None].exp()) @ S + qk[:, :, i] @ v_new
        last = gamma[:, :, i, -1]
        k_decay = k[:, :, i] * (last[..., None] - gamma[:, :, i]).exp()[..., None]
        S.mul_(last.exp()[..., None, None]).add_(k_decay.transpose(-1, -2) @ v_new)
    return out.flatten(2, 3)[:, :, :T]


@contextmanager
def arm(name: str):
    """Swap the before arm's functions in for the duration (module globals, read per call)."""
    if name == "after":
        yield
        return
    saved = qsa.prefill_attention, gdn.delta_rule_chunked
    qsa.prefill_attention, gdn.delta_rule_chunked = qsa.dense_attention, delta_rule_chunked_loop
    try:
        yield
    finally:
        qsa.prefill_attention, gdn.delta_rule_chunked = saved


def prefill_seconds(dec: Decoder, ids: Tensor) -> float:
    dec.reset(experts=False)
    t0 = time.perf_counter()
    dec.prefill(0, ids, 0)
    return time.perf_counter() - t0


def median(t: list[float]) -> float:
    return sorted(t)[len(t) // 2]


def report(name: str, lengths: list[int], times: dict[int, list[float]]) -> None:
    """Median tok/s per length (best run in brackets), and the longest over the shortest."""
    med = {T: T / median(t) for T, t in times.items()}
    best = {T: T / min(t) for T, t in times.items()}
    cells = ", ".join(f"{T} tok {med[T]:.0f} tok/s ({best[T]:.0f})" for T in lengths)
    lo, hi = lengths[0], lengths[-1]
    print(f"{name}: {cells}; {hi}/{lo} ratio {med[hi] / med[lo]:.2f} "
          f"(best runs {best[hi] / best[lo]:.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", nargs="+", choices=["after", "before"], default=["after", "before"])
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(Path(tmp) / "tiny", "tiny", fmt="bf16", seed=0)
        m = load_model(folder)
    dec = Decoder(m, resident_backend(m), 1, max(args.lengths) + 8)
    ids = torch.randint(0, 500, (max(args.lengths),), generator=torch.Generator().manual_seed(0))
    times = {a: {T: [] for T in args.lengths} for a in args.arms}
    for name in args.arms:  # warm-up: one engine chunk
        with arm(name):
            prefill_seconds(dec, ids[:1024])
    longest = max(args.lengths)
    for _ in range(args.rounds):
        for T in args.lengths:
            for name in args.arms:
                with arm(name):
                    for _ in range(max(1, longest // (4 * T))):
                        times[name][T].append(prefill_seconds(dec, ids[:T]))
    runs = ", ".join(f"{T} tok {len(times[args.arms[0]][T])}" for T in args.lengths)
    print(f"tiny prefill, 1 thread; medians of runs ({runs}), best run in brackets:")
    for name in args.arms:
        report(name, args.lengths, times[name])
    if len(args.arms) == 2:
        speedup = {T: median(times["before"][T]) / median(times["after"][T]) for T in args.lengths}
        print("after/before speedup: " + ", ".join(f"{T} tok {s:.1f}x" for T, s in speedup.items()))


if __name__ == "__main__":
    main()
