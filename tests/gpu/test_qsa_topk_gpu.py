"""The radix-select top-k of QSA's ranking keys (ftchat/kernels/topk_select.py) against its torch
mirror `topk_keys_ref` and torch.topk itself.

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_qsa_topk_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \\
                                 pytest -m gpu tests/gpu/test_qsa_topk_gpu.py
TRITON_INTERPRET=1 is read when the kernels are decorated, so set it on the command line. The
interpreter pays per operation, not per element: the multi-program cases run with large chunks.

Exactness: no tolerance anywhere. The kernel returns the k largest keys of each row in
ascending index order, the first -1 entries filling a row with fewer than k complete blocks;
`topk_keys_ref` puts torch.topk(sorted=False)'s answer into that form, so the two are compared
with torch.equal, and the sorted values (and the index set of the keys >= 0) also against
torch.topk directly. Keys are built by `qsa.rank_key` from scores with many exact ties and
zeros (their low word, N - 1 - n, breaks them) and incomplete blocks at the end of the row, as
in decode. Paths: one program per row (N <= small_max), the multi-program passes with several
chunks (a partial last one), and both digit widths (12, 12, 8 and 8 x 4 bits).
Negative controls: a perturbed key and a corrupted threshold both fail the comparison; a preset
counter keeps the last program from running (nothing is reset or stored).
"""

from __future__ import annotations

import os

import pytest
import torch

from ftchat.kernels import sync
from ftchat.kernels import topk_select as ts
from ftchat.kernels.config import KernelConfig
from ftchat.model.qsa import rank_key
from tests.kernel_inputs import capture


pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
NS = (1, 5, 511, 512, 513, 1024, 4097, 8192, 65280)
MULTI_CHUNK = 1024  # the forced multi-program path: N = 65280 is 64 chunks (the most allowed)


@pytest.fixture(autouse=True)
def _device():
    assert ts.HAS_TRITON, "these tests need triton"
    if DEVICE == "cpu":
        assert INTERPRET, "FTCHAT_TEST_DEVICE=cpu needs TRITON_INTERPRET=1 (the interpreter)"
    else:
        assert not INTERPRET and torch.cuda.is_available(), \
            "no CUDA: set FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 to run on CPU"
    yield


# ===== inputs and checks =====


def _keys(B: int, N: int, gen: torch.Generator, incomplete: int = 2, mix=(0.5, 0.35, 0.15)):
    """rank_key keys [B, N] on DEVICE: scores continuous (fraction mix[0]), from 8 exact values
    (mix[1]) or 0.0 (mix[2]); the last `incomplete` blocks of every row incomplete (-1)."""
    kind = torch.rand(B, N, generator=gen)
    cont = torch.rand(B, N, generator=gen) * 3.0
    tied = torch.randint(0, 8, (B, N), generator=gen).float() * 0.375
    s = torch.where(kind < mix[0], cont, torch.where(kind < mix[0] + mix[1], tied, 0.0))
    complete = (torch.arange(N) < N - incomplete).expand(B, N)
    return rank_key(s, complete).to(DEVICE)


def _check(got, keys: torch.Tensor, k: int):
    """got == topk_keys_ref exactly, and the same values (and valid indices) as torch.topk."""
    idx, val = got
    ref = ts.topk_keys_ref(keys, k)
    assert idx.shape == val.shape == (keys.shape[0], k)
    assert torch.equal(idx, ref[0]) and torch.equal(val, ref[1])
    tv, ti = torch.topk(keys, k, dim=-1, sorted=False)
    assert torch.equal(val.sort(-1).values, tv.sort(-1).values)
    for r in range(keys.shape[0]):
        assert set(idx[r][val[r] >= 0].tolist()) == set(ti[r][tv[r] >= 0].tolist())
    assert bool((idx[:, 1:] > idx[:, :-1]).all())  # ascending index order
    assert torch.equal(keys.gather(1, idx), val)


def _paths(N: int):
    # (name, kwargs): the defaults (one program per row up to SMALL_MAX, 8-bit digits), the
    # multi-program path with several chunks, each also with 12-bit digits
    out = [("default", {}), ("d12", {"digit_bits": 12})]
    if N > 1:
        big = {"small_max": 0, "chunk": MULTI_CHUNK}
        out += [("multi", big), ("multi12", {**big, "digit_bits": 12})]
    return out


# ===== exactness =====


@pytest.mark.parametrize("B", [1, 2, 3])
@pytest.mark.parametrize("N", NS)
def test_topk_equals_reference(N, B):
    gen = torch.Generator().manual_seed(N * 10 + B)
    keys = _keys(B, N, gen, incomplete=min(N - 1, 1 + N % 3))
    k = min(512, N)
    for _, kw in _paths(N):
        _check(ts.topk_keys_triton(keys, k, **kw), keys, k)


@pytest.mark.parametrize("N", [5, 600, 5000])
def test_all_incomplete(N):
    keys = torch.full((2, N), -1, dtype=torch.int64, device=DEVICE)
    k = min(512, N)
    for _, kw in _paths(N):
        idx, val = ts.topk_keys_triton(keys, k, **kw)
        assert torch.equal(idx, torch.arange(k, device=DEVICE).expand(2, k))  # the first -1s
        assert bool((val == -1).all())
        _check((idx, val), keys, k)


@pytest.mark.parametrize("N,valid", [(700, 300), (5000, 100), (1000, 512), (8192, 512)])
def test_fewer_or_exactly_k_valid(N, valid):
    # complete blocks scattered over the row (not only a prefix): fewer than k (the first -1
    # entries fill) or exactly k (no -1 taken)
    gen = torch.Generator().manual_seed(N + valid)
    keys = _keys(2, N, gen, incomplete=0)
    for r in range(2):
        drop = torch.randperm(N, generator=gen)[valid:]
        keys[r, drop.to(DEVICE)] = -1
    for _, kw in _paths(N):
        _check(ts.topk_keys_triton(keys, 512, **kw), keys, 512)


@pytest.mark.parametrize("score", [0.0, 1.5])
@pytest.mark.parametrize("N", [600, 8192])
def test_all_scores_equal(N, score):
    # one tie group of the whole row: the index bits decide, the lowest blocks win
    s = torch.full((3, N), score)
    keys = rank_key(s, torch.ones(3, N, dtype=torch.bool)).to(DEVICE)
    for _, kw in _paths(N):
        idx, _ = ts.topk_keys_triton(keys, 512, **kw)
        assert torch.equal(idx, torch.arange(512, device=DEVICE).expand(3, 512))


@pytest.mark.parametrize("k", [1, 7, 100, 4999])
def test_other_k(k):
    # k = 1 (a specialised argument), a small k, and k = N - 1 (nearly every key)
    gen = torch.Generator().manual_seed(k)
    keys = _keys(2, 5000, gen, mix=(0.2, 0.6, 0.2))
    for _, kw in _paths(5000):
        _check(ts.topk_keys_triton(keys, k, **kw), keys, k)


def test_threshold_inside_a_large_tie_group():
    # three score values: the k-th key lies inside thousands of equal scores (the last pass and
    # the tie rank across chunks decide)
    gen = torch.Generator().manual_seed(3)
    s = torch.randint(0, 3, (2, 8192), generator=gen).float()
    keys = rank_key(s, torch.ones(2, 8192, dtype=torch.bool)).to(DEVICE)
    for _, kw in _paths(8192):
        _check(ts.topk_keys_triton(keys, 512, **kw), keys, 512)


def test_k_zero_and_reference_is_torch_topk():
    keys = _keys(2, 40, torch.Generator().manual_seed(1))
    idx, val = ts.topk_keys_triton(keys, 0)
    assert idx.shape == val.shape == (2, 0)
    ref_idx, ref_val = ts.topk_keys_ref(keys, 9)  # the mirror keeps torch.topk's values
    tv = torch.topk(keys, 9, dim=-1).values
    assert torch.equal(ref_val.sort(-1).values, tv.sort(-1).values)
    assert torch.equal(keys.gather(1, ref_idx), ref_val)


# ===== determinism, state, controls =====


def test_deterministic_and_counters_left_zero():
    gen = torch.Generator().manual_seed(5)
    keys = _keys(3, 8192, gen)
    for _, kw in _paths(8192)[2:]:
        first = ts.topk_keys_triton(keys, 512, **kw)
        cnt = sync.counters(keys.device, 3, "topk_select")
        hist = sync.counters(keys.device, 3 * 4096, "topk_select_hist")
        assert int(cnt.abs().sum()) == 0 and int(hist.abs().sum()) == 0
        for _ in range(2):
            again = ts.topk_keys_triton(keys, 512, **kw)
            assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
        _check(first, keys, 512)


def test_preset_counter_blocks_the_last_program():
    # control for the reset: from a count no program brings to NCH - 1 none is last, so none
    # stores the state or zeroes the histogram; every program adds one
    gen = torch.Generator().manual_seed(6)
    keys = _keys(2, 4096, gen)
    nch = 4096 // MULTI_CHUNK
    cnt = sync.counters(keys.device, 2, "topk_select")
    hist = sync.counters(keys.device, 2 * 4096, "topk_select_hist")
    state = torch.full((2, ts.ST_W), -7, dtype=torch.int64, device=DEVICE)
    cnt.fill_(1000)
    try:
        ts._hist_kernel[(2, nch)](keys, hist, cnt, state, 4096, 512, SHIFT=20, BITS=12, PASS=0,
                                  CHUNK=MULTI_CHUNK, NCH=nch, num_warps=4, PDL=False)
        assert cnt.tolist() == [1000 + nch] * 2
        assert int(hist.sum()) == 2 * 4096  # every key counted once, nothing reset
        assert bool((state == -7).all())
    finally:
        cnt.zero_()
        hist.zero_()
    _check(ts.topk_keys_triton(keys, 512, small_max=0, chunk=MULTI_CHUNK), keys, 512)


def test_negative_controls():
    gen = torch.Generator().manual_seed(7)
    keys = _keys(2, 8192, gen)
    k = 512
    ref = ts.topk_keys_ref(keys, k)
    # a key outside the top k raised above the threshold: the set changes, the check sees it
    out_pos = int(torch.nonzero(~torch.isin(torch.arange(8192, device=DEVICE), ref[0][0]))[0])
    bad = keys.clone()
    bad[0, out_pos] = ref[1][0].max() + 1
    for _, kw in _paths(8192):
        got = ts.topk_keys_triton(bad, k, **kw)
        assert not torch.equal(got[0], ref[0])
        _check(got, bad, k)  # and it is the right answer for the perturbed keys

    # a corrupted threshold (one above the true one) between the last pass and the write: fewer
    # keys are chosen, the slots left hold the poison
    def corrupt(state, idx, val):
        state[:, 14] += 1
        idx.fill_(-7)
        val.fill_(-7)
    got = ts.topk_keys_triton(keys, k, small_max=0, chunk=MULTI_CHUNK, _edit_state=corrupt)
    assert not torch.equal(got[0], ref[0]) and bool((got[0] == -7).any())
    assert not torch.equal(got[1], ref[1])
    good = ts.topk_keys_triton(keys, k, small_max=0, chunk=MULTI_CHUNK,
                               _edit_state=lambda s, i, v: None)
    assert torch.equal(good[0], ref[0]) and torch.equal(good[1], ref[1])


# ===== dispatch and graph capture =====


def test_dispatcher():
    gen = torch.Generator().manual_seed(8)
    for N in (300, 8192):
        keys = _keys(2, N, gen)
        k = min(512, N)
        _check(ts.topk_keys(keys, k), keys, k)  # CUDA: the kernel; CPU: the mirror
        _check(ts.topk_keys(keys, k, kc=KernelConfig(fused=False)), keys, k)
    big = _keys(1, ts.TOPK_MAX_N + 5, gen)  # over the limit: the mirror everywhere
    _check(ts.topk_keys(big, 512), big, 512)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA (the interpreter runs on CPU)")
@pytest.mark.parametrize("N", [1024, 8192, 65280])
def test_graph_replay_equals_eager(N):
    # the decode step is captured: static shapes, no host sync; replays follow new keys and
    # leave the counters zero for the next
    gen = torch.Generator().manual_seed(N)
    keys = _keys(2, N, gen)
    k = min(512, N)
    variants = [{}, {"small_max": 0, "chunk": MULTI_CHUNK}, {"digit_bits": 12}]

    def step():
        return [ts.topk_keys_triton(keys, k, **kw) for kw in variants]
    graph, out = capture(step)
    for seed in (1, 2, 3):
        keys.copy_(_keys(2, N, torch.Generator().manual_seed(seed), incomplete=seed))
        graph.replay()
        want = step()
        for (gi, gv), (wi, wv) in zip(out, want):
            assert torch.equal(gi, wi) and torch.equal(gv, wv)
            _check((gi, gv), keys, k)
    assert int(sync.counters(keys.device, 2, "topk_select").abs().sum()) == 0
