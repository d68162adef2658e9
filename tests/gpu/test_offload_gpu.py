"""GPU tier (`pytest -m gpu`, on the device): offload and prefetch identities with CUDA graphs and
in eager mode, delay kernels on every stream, and the in-flight-eviction race with its control."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from ftchat.engine import build_experts, generate, load_model, resident_backend
from ftchat.model.synth import write_checkpoint
from ftchat.settings import Settings

pytestmark = pytest.mark.gpu
STEPS = 201  # graph replay: 200 decode steps; eager runs 100 (device time is scarce)
EAGER_STEPS = 101
PROMPTS = {1: [[3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81]],
           2: [[3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81], [9, 120, 44, 2, 300]]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu")
    return {fmt: write_checkpoint(d / fmt, "tiny", fmt=fmt, seed=0, layers=8)
            for fmt in ("bf16", "nvfp4-modelopt")}


@functools.lru_cache(maxsize=None)
def model(folder):
    return load_model(folder, device="cuda", dtype=torch.bfloat16)


def tokens_and_logits(out):
    out = list(out)
    return [s.tokens for s in out], torch.stack([s.logits for s in out]).float().cpu()


@functools.lru_cache(maxsize=None)
def resident(folder, bs, graph, steps=STEPS):
    m = model(folder)
    return tokens_and_logits(generate(m, PROMPTS[bs], steps, resident_backend(m), graph=graph))


def offloaded(folder, bs, graph, steps=STEPS, patch=None, **kw):
    m = model(folder)
    ex = build_experts(m, Settings(batch_size=bs, **kw))
    if patch:
        patch(ex)
    return tokens_and_logits(generate(m, PROMPTS[bs], steps, ex, graph=graph)), ex


def test_decoder_smoke_cuda_matches_cpu(folders):
    """The same code on the device: fp32 CUDA prefill logits match the CPU ones."""
    from ftchat.engine import prefill
    from ftchat.model.state import DecodeState

    cpu, gpu = load_model(folders["bf16"]), load_model(folders["bf16"], device="cuda")
    ids = torch.tensor(PROMPTS[1][0])
    outs = []
    for m in (cpu, gpu):
        st = DecodeState.create(m.args, 1, 32, m.device, m.dtype)
        outs.append(prefill(m, st, 0, ids, 0, resident_backend(m)).cpu())
    assert (outs[0] - outs[1]).abs().max().item() < 1e-3


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4-modelopt"])
@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
def test_offload_and_prefetch_are_bit_identical(folders, fmt, bs, graph, overlap):
    folder = folders[fmt]
    steps = STEPS if graph else EAGER_STEPS
    ref = resident(folder, bs, graph, steps)
    for prefetch, policy, auto in (("off", "lru", False), ("on", "rule", False),
                                   ("on", "lru", False), ("off", "score", False),
                                   ("on", "score", False), ("on", "rule", True)):
        budget = None if auto else 1
        (tokens, logits), ex = offloaded(folder, bs, graph, steps, slots=bs * 4 + 10,
                                         eviction=policy, overlap=overlap, prefetch=prefetch,
                                         budget_gdn=budget, budget_attn=budget)
        assert tokens == ref[0], (prefetch, policy, auto)
        assert torch.equal(logits, ref[1]), (prefetch, policy, auto)
        assert int(ex.maps.stats.misses.sum()) > 0
        if auto:
            assert ex.auto.chosen is not None and ex.auto.row_s > 0


@pytest.mark.parametrize("graph", [False, True])
def test_a_replayed_graph_reads_the_budget_auto_sets(folders, graph, monkeypatch):
    # the bracket replaced by (1, 1), so the window's end sets budget 1 (plans are sized 4):
    # under graph replay the kernel reads the new limit, so installs stay at one a layer a step
    from ftchat.offload import budget
    from ftchat.offload.budget import SKIP_STEPS, WINDOW_STEPS
    monkeypatch.setattr(budget, "bracket", lambda *a: (1, 1))
    f = folders["nvfp4-modelopt"]
    steps = STEPS if graph else EAGER_STEPS
    (tokens, logits), ex = offloaded(f, 1, graph, steps, slots=14, prefetch="on")
    assert ex.auto.chosen == 1 and ex.budgets == [4] * len(ex.budgets)
    installs = ex.maps.stats.prefetch_installs
    assert 0 < int(installs.max()) <= steps - 1 - (SKIP_STEPS + WINDOW_STEPS)
    ref = resident(f, 1, graph, steps)
    assert tokens == ref[0] and torch.equal(logits, ref[1])
    # control: a fixed budget of 4 installs more than one a layer a step on the same run
    _, fixed = offloaded(f, 1, graph, steps, slots=14, prefetch="on", budget_gdn=4, budget_attn=4)
    assert int(fixed.maps.stats.prefetch_installs.max()) > steps - 1 - (SKIP_STEPS
                                                                        + WINDOW_STEPS)


def test_graph_replay_equals_eager(folders):
    f = folders["nvfp4-modelopt"]
    assert resident(f, 2, True, EAGER_STEPS)[0] == resident(f, 2, False, EAGER_STEPS)[0]


@pytest.fixture(scope="module")
def wide_budget(folders, tmp_path_factory):
    """The nvfp4 tiny model with a QSA budget of 128 tokens: 100 steps of PROMPTS stay below
    it, where the eager and the captured step once selected different block counts."""
    d = tmp_path_factory.mktemp("wide") / "tiny"
    shutil.copytree(folders["nvfp4-modelopt"], d)
    cfg = json.loads((d / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    assert text["indexer_budget"] == 8
    text["indexer_budget"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_graph_replay_equals_eager_below_the_budget(wide_budget):
    graph, eager = (resident(wide_budget, 2, g, EAGER_STEPS) for g in (True, False))
    assert graph[0] == eager[0] and torch.equal(graph[1], eager[1])


def _sleepy(ex, where: str, cycles: int = 2_000_000):
    """Delay kernels (torch.cuda._sleep) on one stream before its work."""
    if where in ("copy", "prefetch"):
        orig = ex._copy

        def copy(plan, layer, kind):
            if kind == ("demand" if where == "copy" else "prefetch"):
                torch.cuda._sleep(cycles)
            orig(plan, layer, kind)
        ex._copy = copy
    elif where == "predictor":
        orig_pred = ex.predictor

        def pred(nxt, x):
            torch.cuda._sleep(cycles)
            return orig_pred(nxt, x)
        ex.predictor = pred
    else:  # compute
        orig_install = ex._install_prefetch

        def install(nxt, protect):
            torch.cuda._sleep(cycles)
            return orig_install(nxt, protect)
        ex._install_prefetch = install


@pytest.mark.parametrize("where", ["compute", "predictor", "copy", "prefetch"])
@pytest.mark.parametrize("graph", [False, True])
def test_delay_kernels_on_each_stream_change_nothing(folders, where, graph):
    folder = folders["nvfp4-modelopt"]
    ref = resident(folder, 2, graph, 41)
    (tokens, logits), _ = offloaded(folder, 2, graph, steps=41, slots=18, prefetch="on",
                                    budget_gdn=4, patch=lambda ex: _sleepy(ex, where))
    assert tokens == ref[0] and torch.equal(logits, ref[1])


def test_eviction_of_a_slot_whose_prefetch_copy_is_in_flight(folders):
    """Slow prefetch copies + wrong guesses that the next ensure evicts at once: with the join the
    output is exact; the same run without the join (negative control) must come out wrong."""
    folder = folders["nvfp4-modelopt"]
    ref = resident(folder, 1, False, 41)

    def setup(ex, join: bool):
        def wrong_guesses(nxt, x):  # the least likely experts: every install is a miss target
            router = ex.routers[nxt]
            return torch.softmax(x.float() @ router.float().T, -1).sum(0).topk(
                ex.cfg.candidates, largest=False).indices

        ex.predictor = wrong_guesses
        # ~50 ms a prefetch copy: it lands after the next layer's demand copy into the slot it
        # targets, however loaded the GPU. The compute stream waits for every prefetch copy at
        # the end of each step (both arms), so a late copy corrupts a slot the next step reads:
        # without it the delayed copies pile up on their stream (41 steps x layers x 50 ms)
        # and most land after the last step, which hid the race on a GPU shared with two verify
        # processes (MPS); 20M cycles hid it beside five
        _sleepy(ex, "prefetch", 100_000_000)
        end_step = ex.end_step

        def end_step_joined(tokens):
            end_step(tokens)
            ex.streams.wait("compute", ex.streams.record("prefetch"))
        ex.end_step = end_step_joined
        if not join:
            ex._join = lambda layer: None

    (tokens, logits), _ = offloaded(folder, 1, False, steps=41, slots=8, prefetch="on",
                                    budget_gdn=4, budget_attn=4, patch=lambda ex: setup(ex, True))
    assert tokens == ref[0] and torch.equal(logits, ref[1])
    (_, bad_logits), _ = offloaded(folder, 1, False, steps=41, slots=8, prefetch="on",
                                   budget_gdn=4, budget_attn=4, patch=lambda ex: setup(ex, False))
    assert not torch.equal(bad_logits, ref[1]), "without the join the race must show"


def test_prefill_with_a_warm_cache_reads_cached_experts_from_slots(folders):
    """A second prompt's prefill (the CUDA staging path) copies the experts the decode cache
    holds from their slots; its output still equals the all-resident one."""
    folder = folders["nvfp4-modelopt"]
    m = model(folder)
    ex = build_experts(m, Settings(batch_size=1, slots=24, prefetch="on"))
    list(generate(m, PROMPTS[2][1:], 20, ex, graph=False))  # warm the cache
    staged = ex.for_prefill()
    before = int(staged.rows_from_slots)
    tokens, logits = tokens_and_logits(generate(m, PROMPTS[1], 41, ex, graph=False))
    ref = resident(folder, 1, False, 41)
    assert tokens == ref[0] and torch.equal(logits, ref[1])
    assert int(staged.rows_from_slots) > before


@pytest.mark.parametrize("graph", [False, True])
def test_compute_delayed_after_every_hand_off_changes_nothing(folders, graph):
    """A delay kernel on the compute stream right after each hand-off lets the side streams run
    ahead of everything the compute stream issues later. Prefill once read int32 counts cast
    after its hand-off, unwritten under load (found with another process loading the GPU)."""
    folder = folders["nvfp4-modelopt"]
    ref = resident(folder, 2, graph, 41)

    def patch(ex):
        orig = ex.streams.hand_off

        def hand_off(stream, *inputs):
            orig(stream, *inputs)
            torch.cuda._sleep(2_000_000)  # on the compute stream (the current one)
        ex.streams.hand_off = hand_off

    (tokens, logits), _ = offloaded(folder, 2, graph, steps=41, slots=18, prefetch="on",
                                    patch=patch)
    assert tokens == ref[0] and torch.equal(logits, ref[1])


@pytest.mark.parametrize("delay,num_slots", [(False, 24), (True, 24), (False, 40), (True, 40)])
def test_streamed_prefill_equals_resident(folders, delay, num_slots):
    """A 600-token prefill with layer streaming (chunks of 300 >= STREAM_MIN_TOKENS: each
    layer's experts copied whole while the previous layer finishes and this one's mixer runs),
    a warm slot cache feeding part of them: the logits of the all-resident prefill, bit for bit.
    With delay, a sleep on the compute stream after every hand-off lets the copy stream run
    ahead of all later compute work: the copy of layer L+1 must still wait for layer L's expert
    kernel, which reads the same staging rows. 40 slots (>= 2 x (E+1)) lend their last E+1 as
    the staging area; then a decode after the prefill still gives the resident tokens."""
    from ftchat.engine import Decoder
    from ftchat.offload import backend

    folder = folders["nvfp4-modelopt"]
    m = model(folder)
    ids = torch.randint(0, 500, (600,), generator=torch.Generator().manual_seed(6))
    ref = Decoder(m, resident_backend(m), 1, 640, prefill_chunk=300).prefill(0, ids, 0)
    ex = build_experts(m, Settings(batch_size=1, slots=num_slots, prefetch="on"))
    list(generate(m, PROMPTS[1], 20, ex, graph=False))  # warm the cache
    staged = ex.for_prefill()
    assert 300 >= backend.STREAM_MIN_TOKENS and staged.stream_layers
    assert ex.lends_staging == (num_slots == 40)
    if delay:
        orig = staged.streams.hand_off

        def hand_off(stream, *inputs):
            orig(stream, *inputs)
            torch.cuda._sleep(2_000_000)

        staged.streams.hand_off = hand_off
    host, slots = int(staged.rows_from_host), int(staged.rows_from_slots)
    got = Decoder(m, ex, 1, 640, prefill_chunk=300).prefill(0, ids, 0)
    if delay:
        staged.streams.hand_off = orig
    assert torch.equal(got, ref)
    E, L = m.args.num_experts, m.args.num_hidden_layers
    # layers 1.. of both chunks copied whole (from the host or their slots); layer 0 on demand
    copied = int(staged.rows_from_host) - host + int(staged.rows_from_slots) - slots
    assert 2 * (L - 1) * E < copied <= 2 * L * E
    assert int(staged.rows_from_slots) > slots
    if ex.lends_staging:  # decode refills the lent slots: still the resident run, graph replay too
        for graph in (False, True):
            tokens, logits = tokens_and_logits(generate(m, PROMPTS[1], 41, ex, graph=graph))
            ref_run = resident(folder, 1, graph, 41)
            assert tokens == ref_run[0] and torch.equal(logits, ref_run[1])
