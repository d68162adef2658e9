"""Fused hyper-connection and router kernels (ftchat/kernels/hyper.py, router.py) against the torch
references in ftchat/model/qwen4_exp.py (hc_read_ref, hc_write_ref, route_ref).

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_hyper_router_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \
                                 pytest -m gpu tests/gpu/test_hyper_router_gpu.py
TRITON_INTERPRET=1 is read when the kernels are decorated, so set it on the command line. The
interpreter pays per operation, not per element: there the real geometry runs with large tiles.

Tolerances. The kernels round to the model dtype wherever torch does, except the normed input
of the down GEMV, which the split read sums unrounded (ftchat/kernels/hyper.py); otherwise only
fp32 summation orders (and exp / division ulps) differ, so:
* R' = R + s * y is elementwise: bit-identical in both dtypes.
* fp32 x and s: |got - ref| <= 1e-5 * max|ref|. A 10240-term fp32 dot product summed in another
  order can move by ~sqrt(n) * 2^-24 ~ 6e-6 of its terms' scale; measured <= 2.4e-7.
* bf16 x and s: |got - ref| <= 2^-7 * |ref| + 2^-8 * max|ref|, one bf16 ulp per element plus half
  an ulp of the largest: a GEMV output whose fp32 sum lands on the other side of a rounding
  boundary (or the unrounded Rn moves it there) shifts what depends on it by about one ulp.
  Measured on CPU (interpreter): at most one ulp of x (2^-7 at |x| ~ 1.5). On CUDA the
  reference's cuBLAS runs with fp32 reductions (the fixture turns off
  allow_bf16_reduced_precision_reduction and TF32) so that it is the same math.
* bf16 accuracy: the kernels' mean error against float64 math is at most 1.25x torch's (plus
  2^-12 * max): both are dominated by the final roundings, so they are nearly equal.
* Router: the default (keyed) kernel equals the previous one (`router_topk_triton_v0`) bit for
  bit, ids and weights, on every logits tested (distinct, ties, -inf, +-0; ftchat/kernels/router.py
  says why).
* Router ids: identical to torch when the logits are distinct (random fp32; near-ties one ulp
  apart). With exact ties, common among bf16 logits, the kernel orders tied experts by index
  while torch promises no order (CPU topk returned [2, 4, 1] for three equal values at 1, 2, 4):
  then the chosen logit values match position by position and the ids match wherever the value is
  unique in its row. Weights: fp32 within rtol 1e-5 (measured 2.5e-7), bf16 within one ulp.
* Negative controls: a perturbed weight fails the same checks.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ftchat.kernels import hyper, router, sync
from ftchat.model import qwen4_exp as q
from tests.kernel_inputs import capture, kernel_device


pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
GEOS = {  # D hidden, hc streams, L low rank
    "real": SimpleNamespace(D=2560, hc=4, L=320),
    "small": SimpleNamespace(D=48, hc=4, L=20),
    "odd": SimpleNamespace(D=40, hc=3, L=12),  # hc not a power of two, masked steps
}
EPS = 1e-6


@pytest.fixture(autouse=True)
def _device():
    yield from kernel_device(DEVICE, INTERPRET, hyper.HAS_TRITON)


# ===== inputs and checks =====


def _args(g) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=g.D, hc_count=g.hc, rms_norm_eps=EPS)


def _weights(g, dtype, gen) -> dict:
    C = g.hc * g.D

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)
    return {"hc_norm.weight": rnd(C, scale=0.1),
            "input_mix_weight_down.weight": rnd(g.L, C, scale=C ** -0.5),
            "input_mix_weight_up.weight": rnd(C, g.L, scale=g.L ** -0.5),
            "block_inject_weight.weight": rnd(g.hc, C, scale=C ** -0.5)}


def _inputs(g, lead, dtype, gen):
    # R [*lead, hc*D], y [*lead, D], s [*lead, hc] in (0, 2) as the injection makes it
    R = torch.randn(*lead, g.hc * g.D, generator=gen)
    y = torch.randn(*lead, g.D, generator=gen)
    s = 2 * torch.rand(*lead, g.hc, generator=gen)
    return [t.to(dtype).to(DEVICE) for t in (R, y, s)]


def _tiles(g, rows):
    if INTERPRET and g.D >= 1024:  # few big programs: seconds instead of minutes
        rb = hyper._rows_block(rows)
        return hyper.HcTiles(128, 1024, 4, 256 // rb, 512, 4)
    return None  # the defaults


def _reference(R, y, s, w, a, inject=True):
    # the torch composition hc_write then hc_read, whatever the device
    R = R if y is None else q.hc_write_ref(R, y, s)
    out = q.hc_read_ref(R, w, a, inject)
    return (R, *out) if inject else (R, out, None)


def _close(got, ref, dtype) -> bool:
    got, ref = got.float(), ref.float()
    scale = float(ref.abs().max())
    if dtype == torch.float32:
        tol = 1e-5 * scale
    else:
        tol = 2**-7 * ref.abs() + 2**-8 * scale
    return bool(((got - ref).abs() <= tol).all())


def _f64(R, y, s, w, a):
    # float64 math (the RMS statistic stays fp32 inside rms_norm): the accuracy yardstick
    w64 = {k: v.double() for k, v in w.items()}
    return _reference(R.double(), None if y is None else y.double(),
                      None if s is None else s.double(), w64, a)


# ===== hyper-connections =====


@pytest.mark.parametrize("geo", ["real", "small"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("add", [False, True], ids=["read", "write+read"])
def test_hc_mix_matches_reference(geo, rows, dtype, add):
    g = GEOS[geo]
    gen = torch.Generator().manual_seed(rows + 10 * add + 100 * (dtype == torch.bfloat16))
    w = _weights(g, dtype, gen)
    R, y, s = _inputs(g, (rows, 1), dtype, gen)
    y, s = (y, s) if add else (None, None)
    got = hyper.hc_mix_triton(R, w, g.hc, EPS, y, s, tiles=_tiles(g, rows))
    ref = _reference(R, y, s, w, _args(g))
    assert [t.shape for t in got] == [t.shape for t in ref]
    assert all(t.dtype == dtype for t in got)
    assert torch.equal(got[0], ref[0])  # R'
    assert _close(got[1], ref[1], dtype) and _close(got[2], ref[2], dtype)  # x, s
    if dtype == torch.bfloat16:  # as accurate as torch's own bf16 evaluation, on average
        exact = _f64(R, y, s, w, _args(g))
        for i in (1, 2):
            err = (got[i].double() - exact[i]).abs().mean()
            err_torch = (ref[i].double() - exact[i]).abs().mean()
            assert err <= 1.25 * err_torch + 2**-12 * exact[i].abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_write_alone_and_folded_agree(dtype):
    g = GEOS["small"]
    gen = torch.Generator().manual_seed(3)
    w = _weights(g, dtype, gen)
    R, y, s = _inputs(g, (2, 1), dtype, gen)
    Rw = hyper.hc_write_triton(R, y, s)
    assert torch.equal(Rw, q.hc_write_ref(R, y, s))
    folded = hyper.hc_mix_triton(R, w, g.hc, EPS, y, s)
    apart = hyper.hc_mix_triton(Rw, w, g.hc, EPS)
    assert apart[0] is not None and all(torch.equal(a, b) for a, b in zip(folded, apart))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_final_mixer_without_inject(dtype):
    g = GEOS["small"]
    gen = torch.Generator().manual_seed(4)
    w = _weights(g, dtype, gen)
    R, y, s = _inputs(g, (1, 1), dtype, gen)
    with_inject = hyper.hc_mix_triton(R, w, g.hc, EPS, y, s)
    del w["block_inject_weight.weight"]  # the final mixer has none
    R2, x, s2 = hyper.hc_mix_triton(R, w, g.hc, EPS, y, s, inject=False)
    assert s2 is None and torch.equal(x, with_inject[1]) and torch.equal(R2, with_inject[0])


@pytest.mark.parametrize("lead", [(1, 1), (2, 3), (8, 1)])  # rows 1, 6 (padded to 8), 8
@pytest.mark.parametrize("tiles", [None, hyper.HcTiles(8, 16, 2, 4, 4, 2)], ids=["default", "tiny"])
def test_hc_shapes_tiles_and_masks(lead, tiles):
    g = GEOS["odd"]  # D = 40: 16-element steps leave a masked tail; L = 12: 4-element steps
    gen = torch.Generator().manual_seed(len(lead) + lead[0])
    w = _weights(g, torch.bfloat16, gen)
    R, y, s = _inputs(g, lead, torch.bfloat16, gen)
    got = hyper.hc_mix_triton(R, w, g.hc, EPS, y, s, tiles=tiles)
    ref = _reference(R, y, s, w, _args(g))
    assert torch.equal(got[0], ref[0])
    assert _close(got[1], ref[1], torch.bfloat16) and _close(got[2], ref[2], torch.bfloat16)


def test_hc_split_leaves_its_counters_zero_and_repeats():
    # the last program of each output-row block resets its counter: a second launch (a graph
    # replay reads the same buffer) must see zeros and give the same bits
    g = GEOS["small"]
    gen = torch.Generator().manual_seed(12)
    w = _weights(g, torch.bfloat16, gen)
    R, y, s = _inputs(g, (2, 1), torch.bfloat16, gen)
    t = hyper.default_tiles(2)
    nb = -(-(g.L + g.hc) // t.down_rows)
    first = hyper.hc_mix_triton(R, w, g.hc, EPS, y, s, tiles=t)
    cnt = sync.counters(R.device, nb, "hc")
    assert int(cnt.abs().sum()) == 0
    assert all(torch.equal(a, b) for a, b in zip(hyper.hc_mix_triton(R, w, g.hc, EPS, y, s), first))
    # control: from counts no program can bring to NS - 1 none finishes and none resets; each of
    # the NS chunk programs of a block adds one (D = 48: one chunk per stream, NS = hc)
    cnt.fill_(1000)
    try:
        hyper.hc_mix_triton(R, w, g.hc, EPS, y, s, tiles=t)
        assert cnt.tolist() == [1000 + g.hc] * nb
    finally:
        cnt.zero_()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("control", ["norm", "up_rows", "inject_row"])
def test_hc_negative_control(dtype, control):
    # the kernels read a slightly wrong weight; the checks above must notice
    g = GEOS["real"]
    gen = torch.Generator().manual_seed(5)
    w = _weights(g, dtype, gen)
    R, y, s = _inputs(g, (1, 1), dtype, gen)
    ref = _reference(R, y, s, w, _args(g))
    bad = dict(w)
    # each moves its output by 4x (bf16) to 250x (fp32) or more the tolerance at this seed
    if control == "norm":  # 16 elements of stream 0's norm weight, +2^-3
        bad["hc_norm.weight"] = w["hc_norm.weight"].clone()
        bad["hc_norm.weight"][:16] += 2**-3
    elif control == "up_rows":  # W_up rows of x columns 0..15 in stream 1, negated
        bad["input_mix_weight_up.weight"] = w["input_mix_weight_up.weight"].clone()
        bad["input_mix_weight_up.weight"][g.D:g.D + 16] *= -1
    else:  # stream 1's injection row, doubled
        bad["block_inject_weight.weight"] = w["block_inject_weight.weight"].clone()
        bad["block_inject_weight.weight"][1] *= 2
    got = hyper.hc_mix_triton(R, bad, g.hc, EPS, y, s, tiles=_tiles(g, 1))
    i = 2 if control == "inject_row" else 1  # the output the perturbation reaches
    assert not _close(got[i], ref[i], dtype)
    assert torch.equal(got[0], ref[0])  # R' does not depend on the weights


# ===== router =====

ROUTERS = {"real": (2560, 512, 10), "small": (64, 24, 3)}  # D, E, K


def _router_case(geo, rows, dtype, norm, gen):
    D, E, K = ROUTERS[geo]
    x = torch.randn(rows, D, generator=gen).to(dtype).to(DEVICE)
    W = (torch.randn(E, D, generator=gen) * D ** -0.5).to(dtype).to(DEVICE)
    return x, W, SimpleNamespace(num_experts_per_tok=K, norm_topk_prob=norm)


def _stable_topk(logits, k):
    # the kernel's order: larger logit first, lower index first among equal ones
    return torch.sort(-logits.float().cpu(), dim=-1, stable=True).indices[:, :k]


def _route_ok(ids, w, ids_ref, w_ref, logits, dtype) -> bool:
    assert ids.dtype == torch.int64 and w.dtype == dtype and ids.shape == w.shape == ids_ref.shape
    ids, w, ids_ref, w_ref, lg = (t.cpu() for t in (ids, w, ids_ref, w_ref, logits))
    assert torch.equal(ids, _stable_topk(lg, ids.shape[1]))
    assert torch.equal(lg.gather(1, ids), lg.gather(1, ids_ref))  # the same chosen values
    unique = (lg.gather(1, ids)[:, :, None] == lg[:, None, :]).sum(-1) == 1  # [rows, K]
    assert torch.equal(ids[unique], ids_ref[unique])
    if dtype == torch.float32:
        return bool(torch.allclose(w, w_ref, rtol=1e-5, atol=0))
    return bool(torch.allclose(w.float(), w_ref.float(), rtol=2**-7, atol=0))


@pytest.mark.parametrize("geo", ["real", "small"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
def test_router_matches_reference(geo, rows, dtype, norm):
    gen = torch.Generator().manual_seed(rows + 10 * norm + 100 * (dtype == torch.bfloat16))
    x, W, a = _router_case(geo, rows, dtype, norm, gen)
    logits = F.linear(x, W)
    ids_ref, w_ref = q.route_ref(x, W, a)
    ids, w = router.router_topk_triton(logits, a.num_experts_per_tok, norm)
    if dtype == torch.float32:  # distinct logits: the ids are torch's exactly
        assert logits.unique().numel() == logits.numel()
        assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert _route_ok(ids, w, ids_ref, w_ref, logits, dtype)


def _identity_route(logits, a):
    # torch's router on exactly these logits: x = logits, W = I (exact in fp32 accumulation)
    E = logits.shape[-1]
    return q.route_ref(logits, torch.eye(E, dtype=logits.dtype, device=logits.device), a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_near_ties(dtype):
    # two pairs of logits one ulp apart, at the top-k boundary (ranks K-1, K) and inside (ranks
    # 2, 3), the smaller value at the lower id: an order by index would pick the wrong one.
    # The values lie in [8, 16), where a logit ulp keeps torch's fp32 probabilities apart too
    E, K = 512, 10
    gen = torch.Generator().manual_seed(6)
    lg = torch.rand(2, E, generator=gen) * 2  # the rest: [0, 2)
    top = torch.randperm(E, generator=gen)[:K + 1].sort().values  # K + 1 ids, ascending
    ulp = 2**-4 if dtype == torch.bfloat16 else 2**-20  # at [8, 16)
    vals = torch.tensor([14.0, 13.75, 13.0, 13.0 - ulp] + [12.75 - 0.125 * r for r in range(K - 5)]
                        + [12.0, 12.0 - ulp])  # by rank, descending
    rank = list(range(K + 1))
    rank[2], rank[3], rank[K - 1], rank[K] = 3, 2, K, K - 1  # lower id of a pair: smaller value
    lg[:, top] = vals[rank]
    lg = lg.to(dtype).to(DEVICE)
    a = SimpleNamespace(num_experts_per_tok=K, norm_topk_prob=True)
    ids_ref, w_ref = _identity_route(lg, a)
    probs = torch.softmax(lg.float(), -1).cpu()
    for lo, hi in ((2, 3), (K - 1, K)):  # premise: torch's probabilities keep each pair apart
        assert (probs[:, top[lo]] < probs[:, top[hi]]).all()
    ids, w = router.router_topk_triton(lg, K, True)
    chosen = lg.gather(1, ids).cpu()
    assert (chosen[:, :-1] > chosen[:, 1:]).all()  # strictly descending: no ties among them
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert set(ids[0].tolist()) == set(top.tolist()) - {top[K - 1].item()}
    assert _route_ok(ids, w, ids_ref, w_ref, lg, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_exact_ties(dtype):
    E, K = 512, 6
    lg = torch.zeros(2, E)
    lg[:, [5, 100, 7, 300]] = 1.0  # four equal maxima
    lg[1, 200] = 0.5  # row 1: then one lone value, then 507 tied zeros across the boundary
    lg = lg.to(dtype).to(DEVICE)
    a = SimpleNamespace(num_experts_per_tok=K, norm_topk_prob=True)
    ids_ref, w_ref = _identity_route(lg, a)
    ids, w = router.router_topk_triton(lg, K, True)
    assert ids[0].tolist() == [5, 7, 100, 300, 0, 1]
    assert ids[1].tolist() == [5, 7, 100, 300, 200, 0]
    assert _route_ok(ids, w, ids_ref, w_ref, lg, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_negative_control(dtype):
    gen = torch.Generator().manual_seed(7)
    x, W, a = _router_case("real", 1, dtype, True, gen)
    ids_ref, w_ref = q.route_ref(x, W, a)
    bad = W.clone()
    bad[ids_ref[0, 0]] *= 1 + 2**-5  # the top expert's logit, +3%
    ids, w = router.router_topk_triton(F.linear(x, bad), a.num_experts_per_tok, True)
    assert torch.equal(ids.cpu(), ids_ref.cpu())  # the same experts ...
    assert not _route_ok(ids, w, ids_ref, w_ref, F.linear(x, W), dtype)  # ... other weights


# ===== the keyed top-k against the previous kernel =====


def _logits_case(kind, rows, E, dtype, gen):
    # router logits [rows, E] of one kind: "distinct" (random fp32, all distinct), "ties" (a
    # 1/4 grid: many equal values in every row, across the top-k boundary), "inf" (-inf on half
    # the experts of each row, and row 0 with fewer than K finite ones: the picks reach -inf),
    # "zeros" (+0 and -0 mixed, the largest values among them, a negative rest)
    if kind == "distinct":
        lg = torch.randn(rows, E, generator=gen) * 2
    elif kind == "ties":
        lg = (torch.randn(rows, E, generator=gen) * 4).round() / 4
    elif kind == "inf":
        lg = torch.randn(rows, E, generator=gen)
        lg[torch.rand(rows, E, generator=gen) < 0.5] = float("-inf")
        lg[0, 3:] = float("-inf")
        lg[0, :3] = torch.tensor([0.5, -1.0, 2.0])  # three finite, then -inf picks
    else:
        lg = -torch.rand(rows, E, generator=gen) - 0.5
        lg[:, ::3] = 0.0
        lg[:, 1::7] = -0.0
    lg = lg.to(dtype)
    if kind == "distinct" and dtype == torch.float32:
        assert lg.unique().numel() == lg.numel()
    return lg.to(DEVICE)


ROWS = [1, 2, 3, 8] if INTERPRET else list(range(1, 9))


def _torch_route(logits, a):
    # route_ref's math on given logits (the identity GEMV of _identity_route makes -inf * 0 NaN)
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, a.num_experts_per_tok, dim=-1)
    if a.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return ids, top.to(logits.dtype)


@pytest.mark.parametrize("kind", ["distinct", "ties", "inf", "zeros"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
def test_router_keyed_equals_v0_and_torch(kind, rows, dtype, norm):
    # the default (keyed) kernel gives the previous kernel's ids and weights bit for bit, and
    # torch's routing within the tolerances above (ids exactly where the logits are distinct)
    E, K = 512, 10
    gen = torch.Generator().manual_seed(rows + 10 * norm + 100 * (dtype == torch.bfloat16)
                                        + 1000 * len(kind))
    lg = _logits_case(kind, rows, E, dtype, gen)
    ids, w = router.router_topk_triton(lg, K, norm)
    ids0, w0 = router.router_topk_triton_v0(lg, K, norm)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)
    a = SimpleNamespace(num_experts_per_tok=K, norm_topk_prob=norm)
    ids_ref, w_ref = _torch_route(lg, a)
    if kind == "distinct" and dtype == torch.float32:
        assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert _route_ok(ids, w, ids_ref, w_ref, lg, dtype)


@pytest.mark.parametrize("E,K", [(24, 3), (40, 6), (5, 5), (512, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_keyed_shapes(E, K, dtype):
    # masked lanes (E not a power of two: their keys sit below every expert's), K = E (every
    # expert, -inf ones last), K = 1 (KP padded to 2); strided rows as the fused GEMV gives them
    gen = torch.Generator().manual_seed(E + K)
    base = _logits_case("ties", 3, E + 7, dtype, gen)
    lg = base[:, 7:]  # row stride E + 7
    lg[1, : E // 2] = float("-inf")
    ids, w = router.router_topk_triton(lg, K, True)
    ids0, w0 = router.router_topk_triton_v0(lg, K, True)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)
    assert ((ids >= 0) & (ids < E)).all() and (ids.sort(-1).values.diff(dim=-1) > 0).all()
    ids_ref, w_ref = _torch_route(lg, SimpleNamespace(num_experts_per_tok=K, norm_topk_prob=True))
    assert _route_ok(ids, w, ids_ref, w_ref, lg, dtype)


def test_router_keyed_negative_control():
    # the checks above see a one-ulp change of one chosen logit: the weights move (v0 on the
    # changed logits gives the changed weights, so the bit comparison is not vacuous)
    gen = torch.Generator().manual_seed(13)
    lg = _logits_case("distinct", 2, 512, torch.float32, gen)
    ids, w = router.router_topk_triton(lg, 10, True)
    bad = lg.clone()
    bad[0, ids[0, 0]] = torch.nextafter(bad[0, ids[0, 0]], torch.tensor(float("inf")).to(DEVICE))
    ids_b, w_b = router.router_topk_triton(bad, 10, True)
    assert torch.equal(ids_b, ids) and not torch.equal(w_b, w)
    assert torch.equal(w_b, router.router_topk_triton_v0(bad, 10, True)[1])


# ===== dispatch and graph capture =====


def test_dispatch_picks_the_path_for_the_device():
    g = GEOS["small"]
    gen = torch.Generator().manual_seed(8)
    w = _weights(g, torch.bfloat16, gen)
    R, y, s = _inputs(g, (2, 1), torch.bfloat16, gen)
    a = _args(g)
    x, W, ra = _router_case("small", 2, torch.bfloat16, True, gen)
    a.num_experts_per_tok, a.norm_topk_prob = ra.num_experts_per_tok, ra.norm_topk_prob
    fused = DEVICE == "cuda"  # CPU tensors always take the torch reference
    want_mix = hyper.hc_mix_triton(R, w, g.hc, EPS, y, s) if fused else _reference(R, y, s, w, a)
    assert all(torch.equal(p, r) for p, r in zip(q.hc_write_read(R, y, s, w, a), want_mix))
    want_read = hyper.hc_mix_triton(R, w, g.hc, EPS)[1:] if fused else q.hc_read_ref(R, w, a)
    assert all(torch.equal(p, r) for p, r in zip(q.hc_read(R, w, a), want_read))
    want_write = hyper.hc_write_triton(R, y, s) if fused else q.hc_write_ref(R, y, s)
    assert torch.equal(q.hc_write(R, y, s), want_write)
    want_route = (router.router_topk_triton(F.linear(x, W), ra.num_experts_per_tok, True)
                  if fused else q.route_ref(x, W, a))
    assert all(torch.equal(p, r) for p, r in zip(q.route(x, W, a), want_route))
    R9, y9, s9 = _inputs(g, (9, 1), torch.bfloat16, gen)  # over HC_MAX_ROWS: torch everywhere
    got9 = q.hc_write_read(R9, y9, s9, w, a)
    assert all(torch.equal(p, r) for p, r in zip(got9, _reference(R9, y9, s9, w, a)))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_graph_replay_equals_eager():
    # the decode step is captured: static shapes, no host sync; replays follow new inputs
    g = GEOS["real"]
    gen = torch.Generator().manual_seed(9)
    w = _weights(g, torch.bfloat16, gen)
    R, y, s = _inputs(g, (2, 1), torch.bfloat16, gen)
    a = _args(g)
    x, W, ra = _router_case("real", 2, torch.bfloat16, True, gen)
    a.num_experts_per_tok, a.norm_topk_prob = ra.num_experts_per_tok, ra.norm_topk_prob

    def step():
        return (*q.hc_write_read(R, y, s, w, a), *q.route(x, W, a))
    graph, out = capture(step)
    for seed in (10, 11):
        R2, y2, s2 = _inputs(g, (2, 1), torch.bfloat16, torch.Generator().manual_seed(seed))
        for dst, src in ((R, R2), (y, y2), (s, s2), (x, x * 0.5 + 0.25)):
            dst.copy_(src)
        graph.replay()
        want = step()
        assert all(torch.equal(o, e) for o, e in zip(out, want))
