"""Sampling, opt-in: the chooser inside engine.decode, reproducible with a seed,
lossless prefetch still bit-identical under sampling, and the flags / JSON keys."""

from __future__ import annotations

import json

import pytest
import torch

from ftchat import engine
from ftchat.sampling import REPEAT_WINDOW, Sampler, Sampling
from ftchat.session import Session, build_experts
from ftchat.settings import Settings
from tests.cli_harness import run_main as _main


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def session(tiny_nvfp4):
    return Session.open(tiny_nvfp4, Settings())


HOT = Sampling(temperature=0.9, seed=7)


def draws(sampler: Sampler, logits: torch.Tensor, n: int) -> list[list[int]]:
    return [sampler(logits).tolist() for _ in range(n)]


# ===== the chooser =====


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler([Sampling(), Sampling(temperature=1.0, top_k=1, seed=1), HOT], [[1], [2], [3]],
                torch.device("cpu"))
    for _ in range(5):
        t = s(logits)
        assert t[0] == logits[0].argmax() and t[1] == logits[1].argmax()  # top-k 1 is greedy


def test_a_seed_reproduces_and_rows_do_not_share_a_generator():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1)).repeat(2, 1)
    one = draws(Sampler([HOT, HOT], [[1], [1]], torch.device("cpu")), logits, 20)
    again = draws(Sampler([HOT, HOT], [[1], [1]], torch.device("cpu")), logits[:1], 20)
    assert [r[0] for r in one] == [r[0] for r in again]  # alone or beside another row
    assert [r[0] for r in one] == [r[1] for r in one]  # same seed, same logits: same draws
    other = draws(Sampler([Sampling(temperature=0.9, seed=8)], [[1]], torch.device("cpu")),
                  logits[:1], 20)
    assert [r[0] for r in other] != [r[0] for r in one]


def test_draws_follow_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    s = Sampler([Sampling(temperature=1.0, seed=3)], [[0]], torch.device("cpu"))
    counts = torch.bincount(torch.tensor([s(logits).item() for _ in range(4000)]), minlength=4)
    assert torch.allclose(counts / 4000, probs[0], atol=0.03), counts


@pytest.mark.parametrize("params, allowed", [
    (Sampling(temperature=1.0, top_k=2, seed=0), {0, 1}),
    (Sampling(temperature=1.0, top_p=0.45, seed=0), {0}),  # 0.5 alone reaches it
    (Sampling(temperature=1.0, top_p=0.75, seed=0), {0, 1}),
    (Sampling(temperature=1.0, top_p=0.81, seed=0), {0, 1, 2}),
    (Sampling(temperature=5.0, top_k=3, top_p=1.0, seed=0), {0, 1, 2}),
])
def test_top_k_and_top_p_cut_the_tail(params, allowed):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    s = Sampler([params], [[0]], torch.device("cpu"))
    seen = {s(logits).item() for _ in range(400)}
    assert seen == allowed


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    before = logits.clone()
    greedy_penalized = Sampler([Sampling(repeat_penalty=2.0)], [[0, 3]], torch.device("cpu"))
    assert greedy_penalized(logits).item() == 1  # 2.0 / 2 = 1.0 < 1.9
    assert torch.equal(logits, before)  # the caller's logits untouched
    s = Sampler([Sampling(repeat_penalty=1.5)], [[0]], torch.device("cpu"))
    x = torch.tensor([[-1.0, -1.4]])
    assert s(x).item() == 1  # -1.0 * 1.5 = -1.5 < -1.4
    # the window: the chosen token joins it; only the last REPEAT_WINDOW count
    s = Sampler([Sampling(repeat_penalty=10.0)], [[2] * (REPEAT_WINDOW + 3)], torch.device("cpu"))
    assert s.recent.shape == (1, REPEAT_WINDOW)
    first = s(torch.tensor([[1.0, 0.5, 3.0]])).item()
    assert first == 0 and s.recent[0, -1] == 0  # 2 was penalized: 0.3 < 1.0
    assert s(torch.tensor([[1.0, 0.5, 3.0]])).item() == 1  # 0 was just generated: 0.1 < 0.5


def test_the_sampler_never_syncs_with_the_host(monkeypatch):
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    s = Sampler([Sampling(temperature=0.7, top_k=10, top_p=0.9, repeat_penalty=1.3, seed=1),
                 Sampling(repeat_penalty=1.1)], [[1, 2, 3], [4]], torch.device("cpu"))

    def sync(*args, **kwargs):
        raise AssertionError("a host sync in the sampler")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__",
                 "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    out = s(logits)
    monkeypatch.undo()
    assert out.shape == (2,) and out.dtype == torch.long


# ===== in the decode loop =====


def test_greedy_default_runs_the_argmax_path(session, monkeypatch):
    seen = []
    real = engine.decode

    def recording(dec, prompts, starts, limits, stops=frozenset(), **kwargs):
        seen.append(kwargs)
        yield from real(dec, prompts, starts, limits, stops, **kwargs)

    monkeypatch.setattr(engine, "decode", recording)
    p = session.encode_messages([{"role": "user", "content": "hello"}])
    list(session.generate_batch([p], 4))
    list(session.generate_batch([p], 4, sampling=HOT))
    assert seen[0] == {} and isinstance(seen[1]["choose"], Sampler)


def test_seeded_sampling_reproduces_and_differs_from_greedy(session):
    p = session.encode_messages([{"role": "user", "content": "What is 2+2?"}])
    runs = [[r.token for r in session.generate_batch([p], 16, stop_ids=frozenset(),
                                                     sampling=HOT)] for _ in range(2)]
    greedy = [r.token for r in session.generate_batch([p], 16, stop_ids=frozenset())]
    assert runs[0] == runs[1] and runs[0] != greedy
    recs = list(session.generate_batch([p], 2, sampling=HOT))
    assert recs[-1].seed == 7
    random_seed = list(session.generate_batch([p], 2, sampling=Sampling(temperature=0.9)))
    assert random_seed[-1].seed is not None  # drawn once, reported so it can be reproduced


def test_chat_sampling_reproduces_after_reset(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=12, temperature=0.9, seed=11))
    first = [r.token for r in s.chat(s.turn_ids("hello"))]
    s.reset()
    assert [r.token for r in s.chat(s.turn_ids("hello"))] == first


def test_prefetch_on_and_off_stay_bit_identical_under_sampling(tiny_nvfp4):
    # The CPU offload backend: 20 slots for 96 experts, so copies, misses and prefetches happen
    m = engine.load_model(tiny_nvfp4)
    s = Session.open(tiny_nvfp4, Settings())
    prompts = [s.encode_messages([{"role": "user", "content": t}])
               for t in ("What is 2+2?", "Write a haiku about the sea.")]
    params = [Sampling(temperature=1.0, top_k=40, top_p=0.95, repeat_penalty=1.1, seed=5),
              Sampling(temperature=0.7, seed=6)]
    results = {}
    for prefetch in ("off", "on"):
        settings = Settings(slots=20, prefetch=prefetch, budget_gdn=4, budget_attn=4)
        experts = build_experts(m, settings)
        dec = engine.Decoder(m, experts, 2, 128)
        steps = list(engine.decode(dec, prompts, [0, 0], [40, 40], frozenset(),
                                   choose=Sampler(params, prompts, m.device)))
        results[prefetch] = ([st.tokens for st in steps], torch.stack([st.logits for st in steps]))
        stats = experts.stats()
        assert stats["misses"] > 0, stats  # offloaded for real
        if prefetch == "on":
            assert stats["prefetch_installs"] > 0, stats
    assert results["on"][0] == results["off"][0]
    assert torch.equal(results["on"][1], results["off"][1])  # bit for bit
    greedy = [st.tokens for st in engine.generate(m, prompts, 40, build_experts(m, Settings()))]
    assert results["on"][0] != greedy  # control: it did sample


# ===== flags and JSON lines =====


def test_sampling_flags_and_json_keys(tiny_nvfp4, capsys, monkeypatch):
    base = ["run", tiny_nvfp4, "--json", "-n", "12"]
    flags = ["--temp", "0.9", "--top-k", "30", "--top-p", "0.9", "--repeat-penalty", "1.2",
             "--seed", "42"]
    a = _main([*base, *flags], capsys, monkeypatch, "What is 2+2?\n")
    b = _main([*base, *flags], capsys, monkeypatch, "What is 2+2?\n")
    line = json.dumps({"prompt": "What is 2+2?", "temperature": 0.9, "top_k": 30, "top_p": 0.9,
                       "repeat_penalty": 1.2, "seed": 42})
    c = _main(base, capsys, monkeypatch, line + "\n")
    greedy = _main(base, capsys, monkeypatch, "What is 2+2?\n")
    objs = [json.loads(r[1]) for r in (a, b, c, greedy)]
    assert all(r[0] == 0 for r in (a, b, c, greedy)), a[2]
    assert objs[0]["tokens"] == objs[1]["tokens"] == objs[2]["tokens"] != objs[3]["tokens"]
    assert objs[0]["seed"] == 42 and "seed" not in objs[3]
    # no seed: a random one, reported; giving it back reproduces the reply
    d = json.loads(_main([*base, "--temp", "0.9"], capsys, monkeypatch, "hi\n")[1])
    e = json.loads(_main([*base, "--temp", "0.9", "--seed", str(d["seed"])], capsys, monkeypatch,
                         "hi\n")[1])
    assert d["tokens"] == e["tokens"]


@pytest.mark.parametrize("argv, message", [
    (["--top-k", "5"], "--top-k applies to sampling: give --temp above 0 too"),
    (["--seed", "1"], "--seed applies to sampling"),
    (["--top-p", "0.5", "--temp", "0"], "--top-p applies to sampling"),
    (["--temp", "-1"], "--temp -1.0: expected a number >= 0"),
    (["--temp", "1", "--top-p", "0"], "--top-p 0.0: expected a number above 0 and at most 1"),
    (["--temp", "1", "--top-p", "1.5"], "--top-p 1.5: expected"),
    (["--repeat-penalty", "0"], "--repeat-penalty 0.0: expected a positive number"),
    (["--temp", "1", "--seed", "-1"], "--seed -1: expected a non-negative integer"),
    (["--temp", "nan"], "--temp nan: expected"),
])
def test_bad_sampling_flags_are_one_line(argv, message, capsys, monkeypatch):
    code, out, err = _main(["run", "--prompt", "hi", *argv], capsys, monkeypatch)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("obj, message", [
    ({"temperature": -0.5}, '"temperature" must be a number >= 0'),
    ({"temperature": "0.5"}, '"temperature" must be a number'),
    ({"temperature": 1, "top_k": 2.5}, '"top_k" must be an integer'),
    ({"temperature": 1, "top_p": 0}, '"top_p" must be a number above 0 and at most 1'),
    ({"repeat_penalty": True}, '"repeat_penalty" must be a positive number'),
    ({"temperature": 1, "seed": -3}, '"seed" must be an integer from 0'),
    ({"seed": 3}, '"seed" applies to sampling: give "temperature" above 0 too'),
    ({"stop": ""}, '"stop" must be a non-empty string or a list of them'),
    ({"stop": ["a", 1]}, '"stop" must be'),
])
def test_bad_json_sampling_keys(obj, message, tiny_nvfp4, capsys, monkeypatch):
    line = json.dumps({"prompt": "hi", **obj})
    code, out, err = _main(["run", tiny_nvfp4, "-n", "2"], capsys, monkeypatch, line + "\n")
    assert code == 1 and out == "\n" and "Traceback" not in err  # an empty reply line
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: stdin line 1: {message}"), err
