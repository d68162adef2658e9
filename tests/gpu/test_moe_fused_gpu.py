"""The fused MoE decode path against the torch references: the shared expert's activation kernel
(ftchat/kernels/shared_expert.py), the gated shared expert added in the routed kernels' weighted
sum (qwen4_exp.moe_block on CUDA decode), and the routed kernel sets
(ftchat/kernels/routed_experts.py) against each other.

Two ways to run the same tests (the `gpu` marker is deselected by default, so name it):
    on the device (CUDA):        pytest -m gpu tests/gpu/test_moe_fused_gpu.py
    on CPU, Triton interpreter:  FTCHAT_TEST_DEVICE=cpu TRITON_INTERPRET=1 \
                                 pytest -m gpu tests/gpu/test_moe_fused_gpu.py
TRITON_INTERPRET=1 is read when the kernels are decorated, so set it on the command line. The
interpreter pays per operation, not per element: there the real geometry runs with large tiles
(about 20 s per routed call).

Tolerances. The fused path rounds where the reference (routed + sigmoid(w_sg . x) * swiglu(x),
every op in the model dtype) rounds; what differs is fp32 summation order (the routed kernels)
and exp / division ulps (silu, sigmoid):
* shared activation h = silu(g) * u: fp32 within 4e-6 relative (the GPU's exp is ex2 of a
  rounded g * log2(e): up to ~|g| * 2^-24 relative for the |g| <= 12 drawn here, plus two ulps;
  measured 2.8e-7 on CPU); bf16 within one bf16 ulp (2^-7 relative), a flip only when the fp32
  value lies that close to a rounding boundary (at most 2 % of the elements; measured 0).
* shared_expert_parts: at <= 2 rows on CUDA the down GEMV computes h itself from the fused
  GEMV's columns (gemv.linear_gated_triton): bit-identical to the activation kernel then the
  GEMV (the same roundings); at 3 rows and on CPU it is that pair.
* MoE output against the kernels' mirror (routed_experts_decode_ref + shared_expert_ref): fp32
  within 1e-5 * max|ref| (the routed kernels' summation order, as tests/gpu/test_kernels_gpu.py);
  bf16 within 2^-7 * (|routed| + |shared| + |ref|) per element: one ulp for each of the three
  values that are rounded (the routed sum, the gated shared expert, their sum), any of which a
  reordered fp32 sum or an exp ulp can push across a boundary. Measured on CPU (small
  geometry): bf16 bit-identical, fp32 <= 2.3e-7 * max|ref|.
* against the engine's torch path (routed in ascending expert id, weights rounded to the model
  dtype): fp32 as above, bf16 within 2^-5 * max|ref| (the routed tolerance of
  test_kernels_gpu.py; measured 0.0072 * max|ref|).
* v2 against v1: the same sums in the same order: bit-identical on CPU; on CUDA within the fp32
  tolerance (the compiler may contract other multiply-adds).
Negative controls perturb one weight of the shared expert or of one routed expert and must fail
the same checks.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
import torch.nn.functional as F

from ftchat.codecs.rows import RowLayout
from ftchat.kernels import gemv, routed_experts as rk, router, sync
from ftchat.kernels.config import KernelConfig
from ftchat.kernels.shared_expert import shared_act_triton
from ftchat.model import layers
from ftchat.model import qwen4_exp as q
from ftchat.offload.backend import ResidentExperts
from ftchat.offload.experts import routed_experts, routed_experts_decode_ref
from tests.kernel_inputs import kernel_device, place, random_rows, routing

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("FTCHAT_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
GEOS = {"real": (2560, 640, 12, 10), "small": (64, 32, 12, 4)}  # D, I, E experts, K top-k
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _device():
    yield from kernel_device(DEVICE, INTERPRET, rk.HAS_TRITON)


# ===== inputs =====


@functools.lru_cache(maxsize=4)
def _bank(geo: str, kind: str):
    # E expert rows at random slots of a bank with garbage elsewhere
    D, I, E, _ = GEOS[geo]
    gen = torch.Generator().manual_seed(len(geo) + len(kind))
    layout = RowLayout(kind, D, I)
    make = _random_codes if kind == "nvfp4" and D >= 1024 else random_rows
    bank, slot_of = place(make(layout, E, gen), E + 3, gen)
    return layout, bank, slot_of


def _random_codes(layout: RowLayout, n: int, gen: torch.Generator) -> torch.Tensor:
    # NVFP4 rows of random codes, block scales in [1, 448) and globals giving weights of about
    # 1/sqrt(fan-in): any bytes are a valid row for the kernels and their mirror, and quantizing
    # the real geometry (random_rows) would take ~25 s on CPU
    rows = torch.randint(0, 256, (n, layout.nbytes), dtype=torch.uint8, generator=gen)
    for part, fan_in in (("gate_up", layout.hidden), ("down", layout.inter)):
        sc = layout.view(rows, part + "_scale")
        sc.copy_((1 + 447 * torch.rand(sc.shape, generator=gen)).to(sc.dtype))
        layout.view(rows, part + "_global").fill_(fan_in ** -0.5 / (2.1 * 224))  # mean |E2M1 s|
    return rows


def _shared_weights(D: int, I: int, dtype, gen) -> dict:
    w = {"shared_expert.gate_proj.weight": torch.randn(I, D, generator=gen) * D ** -0.5,
         "shared_expert.up_proj.weight": torch.randn(I, D, generator=gen) * D ** -0.5,
         "shared_expert.down_proj.weight": torch.randn(D, I, generator=gen) * I ** -0.5,
         "shared_expert_gate.weight": torch.randn(1, D, generator=gen) * D ** -0.5}
    w = {k: v.to(dtype).to(DEVICE) for k, v in w.items()}
    assert layers.fuse_moe_projections(w)
    return w


def _case(geo: str, rows: int, dtype, seed: int, kind: str = "nvfp4"):
    D, I, E, K = GEOS[geo]
    layout, bank, slot_of = _bank(geo, kind)
    gen = torch.Generator().manual_seed(seed)
    ids, weights = routing(rows, K, E, gen)
    x = torch.randn(rows, D, generator=gen).to(dtype)
    w = _shared_weights(D, I, dtype, gen)
    slots = slot_of[ids].int()
    return SimpleCase(layout, bank.to(DEVICE), slots.to(DEVICE), ids.to(DEVICE),
                      weights.to(dtype).to(DEVICE), x.to(DEVICE), w)


@dataclasses.dataclass
class SimpleCase:
    layout: RowLayout
    bank: torch.Tensor
    slots: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    x: torch.Tensor
    w: dict


def _v4_tiles(layout: RowLayout, tiles: rk.DecodeTiles) -> rk.DecodeTiles:
    # v4 needs whole chunks along D: the widest power of two up to gate_up_k dividing D; the
    # default's 2 h rows per program on the GPU, fewer programs in the interpreter
    k = tiles.gate_up_k
    while layout.hidden % k:
        k //= 2
    rows = tiles.gate_up_rows if INTERPRET else rk.V4_TILES.gate_up_rows
    v4 = dataclasses.replace(tiles, gate_up_rows=rows, gate_up_k=k, gate_up_warps=1,
                             variant="v4")
    assert rk.v4_applies(layout, v4), (layout, v4)
    return v4


# v4 runs NVFP4 rows only (rk.v4_applies; default_tiles never gives it bf16 rows)
KIND_VARIANTS = [(k, v) for k in ("nvfp4", "bf16") for v in rk.VARIANTS
                 if (k, v) != ("bf16", "v4")]


def _tiles(c: SimpleCase, variant: str) -> rk.DecodeTiles:
    if variant == "v4":
        return _v4_tiles(c.layout, _tiles(c, "v2"))
    if INTERPRET and c.layout.hidden >= 1024:  # few big programs: seconds instead of minutes
        return rk.DecodeTiles(64, 4096, 4, 256, 1024, 4, 2048, variant)
    return dataclasses.replace(rk.default_tiles(c.layout), variant=variant)


def _fused(c: SimpleCase, variant: str = "v1", w: dict | None = None) -> torch.Tensor:
    # the CUDA decode path of moe_block after routing: shared parts, then the routed kernels
    shared = q.shared_expert_parts(c.x, c.w if w is None else w)
    return rk.routed_experts_triton(c.x, c.bank, c.layout, c.slots, c.weights, _tiles(c, variant),
                                    shared)


def _refs(c: SimpleCase):
    # (mirror reference, engine torch-path reference, routed mirror, gated shared expert)
    routed = routed_experts_decode_ref(c.x, c.bank, c.layout, c.slots, c.weights)
    shared = layers.shared_expert_ref(c.x, c.w)
    engine = routed_experts(c.x, c.bank, c.layout, c.slots, c.ids, c.weights) + shared
    return routed + shared, engine, routed, shared


def _close(got, ref, dtype, routed=None, shared=None, engine=False) -> bool:
    got, ref = got.float().cpu(), ref.float().cpu()
    scale = float(ref.abs().max())
    if dtype == torch.float32:
        tol = 1e-5 * scale
    elif engine:
        tol = 2**-5 * scale
    else:
        tol = 2**-7 * (routed.float().cpu().abs() + shared.float().cpu().abs() + ref.abs())
    return bool(((got - ref).abs() <= tol).all())


# ===== the shared expert's activation =====


@pytest.mark.parametrize("geo", ["real", "small"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_act_matches_torch(geo, rows, dtype):
    D, I, _, _ = GEOS[geo]
    gen = torch.Generator().manual_seed(rows + 10 * (dtype == torch.float32))
    gu = (torch.randn(rows, 2 * I + 1, generator=gen) * 3).to(dtype).to(DEVICE)
    got = shared_act_triton(gu, I)
    ref = F.silu(gu[:, :I]) * gu[:, I:2 * I]
    assert got.shape == ref.shape and got.dtype == dtype
    err = (got.float() - ref.float()).abs()
    rtol = 4e-6 if dtype == torch.float32 else 2**-7
    assert bool((err <= rtol * ref.float().abs()).all())
    if dtype == torch.bfloat16:  # flips only near rounding boundaries
        assert float((err > 0).float().mean()) <= 0.02


@pytest.mark.parametrize("geo", ["real", "small"])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_parts_gated_down_equals_act_then_down(geo, rows, dtype):
    # where the GEMV kernel takes the down projection (CUDA, <= 2 rows) shared_expert_parts runs
    # it on proj's columns itself (gemv.linear_gated_triton): the activation kernel then the
    # GEMV, bit for bit; at 3 rows on CUDA it is that pair; on the CPU (the interpreter tier)
    # the torch expressions (shared_expert.shared_down), which the fp32 activation kernel
    # does not match bit for bit there
    D, I, _, _ = GEOS[geo]
    gen = torch.Generator().manual_seed(rows + 10 * (dtype == torch.float32) + len(geo))
    w = _shared_weights(D, I, dtype, gen)
    x = torch.randn(rows, D, generator=gen).to(dtype).to(DEVICE)
    down_w = w["shared_expert.down_proj.weight"]
    proj = gemv.linear(x, w[layers.SHARED_FUSED])
    assert gemv.dispatches(proj[:, :I], down_w) == (DEVICE == "cuda" and rows <= 2)
    down, logit = q.shared_expert_parts(x, w, proj)
    if DEVICE == "cuda":
        want = gemv.linear(shared_act_triton(proj, I), down_w)
    else:
        want = F.linear(F.silu(proj[:, :I]) * proj[:, I:2 * I], down_w)
    assert torch.equal(down, want)
    assert torch.equal(logit, proj[:, 2 * I:2 * I + 1])
    down2, _ = q.shared_expert_parts(x, w)  # proj computed inside: the same
    assert torch.equal(down2, down)


# ===== the MoE output: the shared expert added in the routed kernels' sum =====


@pytest.mark.parametrize("geo", ["real", "small"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", rk.VARIANTS)
def test_moe_fused_matches_reference(geo, rows, dtype, variant):
    c = _case(geo, rows, dtype, seed=rows + 10 * (dtype == torch.float32))
    got = _fused(c, variant)
    ref, engine, routed, shared = _refs(c)
    assert got.shape == c.x.shape and got.dtype == dtype
    assert _close(got, ref, dtype, routed, shared)
    assert _close(got, engine, dtype, engine=True)


@pytest.mark.parametrize("kind,variant", KIND_VARIANTS)
def test_moe_fused_dense_rows_and_masked_steps(kind, variant):
    # dense (bf16) expert rows too, and D = 80 / I = 48: no large power-of-two step divides them
    D, I, E, K = 80, 48, 12, 3
    gen = torch.Generator().manual_seed(21)
    layout = RowLayout(kind, D, I)
    bank, slot_of = place(random_rows(layout, E, gen), E + 2, gen)
    ids, weights = routing(2, K, E, gen)
    x = torch.randn(2, D, generator=gen).bfloat16()
    c = SimpleCase(layout, bank.to(DEVICE), slot_of[ids].int().to(DEVICE), ids.to(DEVICE),
                   weights.bfloat16().to(DEVICE), x.to(DEVICE),
                   _shared_weights(D, I, torch.bfloat16, gen))
    tiles = rk.DecodeTiles(16, 128, 2, 16, 32, 2, 32, variant)
    if variant == "v4":  # D = 80: chunks of 16
        tiles = _v4_tiles(layout, tiles)
    assert not rk._gemv_args(layout, "gate_up", D, 128)["EVEN"]
    got = rk.routed_experts_triton(c.x, c.bank, layout, c.slots, c.weights, tiles,
                                   q.shared_expert_parts(c.x, c.w))
    ref, engine, routed, shared = _refs(c)
    assert _close(got, ref, torch.bfloat16, routed, shared)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("control", ["gate_row", "down_shared", "routed_global"])
def test_moe_fused_negative_control(dtype, control):
    # the kernels read a slightly wrong weight; the checks above must notice
    c = _case("small", 2, dtype, seed=31)
    ref, engine, routed, shared = _refs(c)
    w = dict(c.w)
    if control == "gate_row":  # the gate logit of the shared expert, +0.5 (x . w_sg moves)
        fused = w[layers.SHARED_FUSED].clone()
        fused[-1] += 0.5
        w[layers.SHARED_FUSED] = fused
    elif control == "down_shared":  # one row of the shared down projection, doubled
        w["shared_expert.down_proj.weight"] = w["shared_expert.down_proj.weight"].clone()
        w["shared_expert.down_proj.weight"][3] *= 2
    else:  # the down globals of the first routed expert of token 0, x1.25
        c.bank = c.bank.clone()
        c.layout.view(c.bank, "down_global")[int(c.slots[0, 0])] *= 1.25
    got = rk.routed_experts_triton(c.x, c.bank, c.layout, c.slots, c.weights,
                                   _tiles(c, "v2"), q.shared_expert_parts(c.x, w))
    assert not _close(got, ref, dtype, routed, shared)


# ===== v2 against v1 =====


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_v2_equals_v1(kind, dtype):
    D, I, E, K = 128, 64, 12, 6
    gen = torch.Generator().manual_seed(41)
    layout = RowLayout(kind, D, I)
    bank, slot_of = place(random_rows(layout, E, gen), E + 2, gen)
    ids, weights = routing(2, K, E, gen)
    args = [t.to(DEVICE) for t in (torch.randn(2, D, generator=gen).to(dtype), bank,
                                   slot_of[ids].int(), weights.to(dtype))]
    tiles = dataclasses.replace(rk.default_tiles(layout), variant="v1")
    v1 = rk.routed_experts_triton(*args[:2], layout, *args[2:], tiles)
    v2 = rk.routed_experts_triton(*args[:2], layout, *args[2:],
                                  dataclasses.replace(tiles, variant="v2"))
    if DEVICE == "cpu":
        assert torch.equal(v1, v2)
    else:
        assert _close(v2, v1, torch.float32)


def test_v2_leaves_its_counters_zero_and_repeats():
    # the last program of each D block resets its counter: a second launch (graph replay reads
    # the same buffer) must see zeros and give the same bits
    c = _case("small", 2, torch.bfloat16, seed=51)
    first = _fused(c, "v2")
    nb = -(-c.layout.hidden // _tiles(c, "v2").down_rows)
    cnt = sync.counters(c.x.device, c.x.shape[0] * nb, "routed")
    assert int(cnt.abs().sum()) == 0
    assert torch.equal(_fused(c, "v2"), first)
    # control: with counts no program can bring to K - 1, none combines and none resets (a
    # stale count of 1 is timing-dependent on the GPU: the reset can land after the last add)
    cnt.fill_(1000)
    try:
        _fused(c, "v2")
        assert int(cnt.abs().sum()) != 0
    finally:
        cnt.zero_()


# ===== dispatch and graph capture =====


def _layer(dtype, seed: int, router_fused: bool = True):
    # one MoE layer of the small geometry: router and shared expert fused at load (as Weights
    # does; router_fused False: the router kept apart, e.g. of another dtype), resident rows
    D, I, E, K = GEOS["small"]
    gen = torch.Generator().manual_seed(seed)
    w = {"shared_expert.gate_proj.weight": torch.randn(I, D, generator=gen) * D ** -0.5,
         "shared_expert.up_proj.weight": torch.randn(I, D, generator=gen) * D ** -0.5,
         "shared_expert.down_proj.weight": torch.randn(D, I, generator=gen) * I ** -0.5,
         "shared_expert_gate.weight": torch.randn(1, D, generator=gen) * D ** -0.5,
         "gate.weight": torch.randn(E, D, generator=gen) * D ** -0.5}
    w = {k: v.to(dtype).to(DEVICE) for k, v in w.items()}
    router_w = w.pop("gate.weight")
    if router_fused:
        w["gate.weight"] = router_w
    assert layers.fuse_moe_projections(w)
    w["gate.weight"] = w.get("gate.weight", router_w)
    layout = RowLayout("nvfp4", D, I)
    experts = ResidentExperts(random_rows(layout, E, gen).to(DEVICE), layout, E)
    a = dataclasses.make_dataclass("A", ["num_experts_per_tok", "norm_topk_prob"])(K, True)
    return w, experts, a, gen


@pytest.mark.parametrize("router_fused", [True, False], ids=["router_fused", "router_apart"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_block_dispatch(dtype, router_fused):
    w, experts, a, gen = _layer(dtype, 61, router_fused)
    D, I, E, K = GEOS["small"]
    assert w[layers.SHARED_FUSED].shape[0] == 2 * I + 1 + (E if router_fused else 0)
    x = torch.randn(2, 1, D, generator=gen).to(dtype).to(DEVICE)
    got = q.moe_block(0, x, w, experts, a)
    xt = x.flatten(0, 1)
    if DEVICE == "cuda":  # the fused path: one GEMV (router rows included), the shared expert
        # added in the routed kernels' sum
        proj = gemv.linear(xt, w[layers.SHARED_FUSED])
        logits = proj[:, 2 * I + 1:] if router_fused else F.linear(xt, w["gate.weight"])
        ids, weights = router.router_topk_triton(logits, K, True)
        pending = experts.begin(0, xt, ids)
        want = experts.finish(pending, xt, weights, q.shared_expert_parts(xt, w, proj))
    else:  # CPU tensors: the torch reference
        ids, weights = q.route_ref(xt, w["gate.weight"], a)
        pending = experts.begin(0, xt, ids)
        want = experts.finish(pending, xt, weights) + layers.shared_expert_ref(xt, w)
    assert torch.equal(got.flatten(0, 1), want)
    x9 = torch.randn(9, 1, D, generator=gen).to(dtype).to(DEVICE)  # > 8 rows: the torch path
    xt9 = x9.flatten(0, 1)
    ids9, w9 = q.route(xt9, w["gate.weight"], a)
    want9 = experts.finish(experts.begin(0, xt9, ids9), xt9, w9) + layers.shared_expert_ref(xt9, w)
    assert torch.equal(q.moe_block(0, x9, w, experts, a).flatten(0, 1), want9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_block_fused_router_against_the_torch_path(dtype):
    # the fused path's router logits are the Triton GEMV's (gemv.py's tolerance against F.linear);
    # with the same ids chosen (checked), the MoE output is within the engine tolerance above
    w, experts, a, gen = _layer(dtype, 62)
    D, I, E, K = GEOS["small"]
    for seed in range(4):
        x = torch.randn(1 + seed % 2, 1, D, generator=gen).to(dtype).to(DEVICE)
        xt = x.flatten(0, 1)
        proj = gemv.linear(xt, w[layers.SHARED_FUSED])
        ref_logits = F.linear(xt.double(), w["gate.weight"].double())
        scale = float(ref_logits.abs().max())
        tol = 1e-5 * scale if dtype == torch.float32 else 2**-7 * ref_logits.abs() + 2**-8 * scale
        assert bool(((proj[:, 2 * I + 1:].double() - ref_logits).abs() <= tol).all())
        got = q.moe_block(0, x, w, experts, a).flatten(0, 1)
        off = KernelConfig(fused=False)
        ids, weights = q.route(xt, w["gate.weight"], a, kc=off)
        want = q.moe_block(0, x, w, experts, a, kc=off).flatten(0, 1)
        fused_ids, _ = router.router_topk_triton(proj[:, 2 * I + 1:], K, True)
        assert torch.equal(fused_ids.sort(-1).values, ids.sort(-1).values), seed
        assert _close(got, want, dtype, engine=True), seed
        # negative control: one router row scaled changes the fused logits out of tolerance
        bad = w[layers.SHARED_FUSED].clone()
        bad[2 * I + 1 + int(ids[0, 0])] *= 3
        bad_logits = gemv.linear(xt, bad)[:, 2 * I + 1:]
        assert not bool(((bad_logits.double() - ref_logits).abs() <= tol).all())


def _assert_replay_equals_eager(c: SimpleCase, step, seeds) -> None:
    # step() captured once (compiled on a side stream first), then replayed with new x and
    # permuted slots written in place: each replay's output equals an eager step's bits
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        c.x.copy_(torch.randn(c.x.shape, generator=gen).bfloat16())
        c.slots.copy_(c.slots.flip(1))
        graph.replay()
        assert torch.equal(out, step())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("variant", rk.VARIANTS)
def test_graph_replay_equals_eager(variant):
    c = _case("real", 2, torch.bfloat16, seed=71)
    tiles = _tiles(c, variant)

    def step():
        shared = q.shared_expert_parts(c.x, c.w)
        return rk.routed_experts_triton(c.x, c.bank, c.layout, c.slots, c.weights, tiles, shared)
    _assert_replay_equals_eager(c, step, (72, 73))
