"""The CLI in-process: typer's CliRunner for the commands, `main()` for the one-line errors."""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from ftchat import engine
from ftchat.cli import app, main
from ftchat.model.checkpoint import Checkpoint
from ftchat.session import Session
from ftchat.settings import Settings
from ftchat.ui.text import one_line
from tests.cli_harness import reply_ids

runner = CliRunner()


@pytest.fixture(scope="module")
def ref(tiny_nvfp4):
    return Session.open(tiny_nvfp4, Settings())


def text_of(s: Session, tokens: list[int]) -> str:
    return s.tokenizer.decode(tokens[:-1] if tokens[-1] in s.tokenizer.eos_ids else tokens)


def user(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]


# ===== run: piped =====


def test_piped_lines_match_the_engine(tiny_nvfp4, ref):
    r = runner.invoke(app, ["run", str(tiny_nvfp4), "--max-new-tokens", "10"],
                      input="hello\n\n   \nWhat is 2+2?\n", env={"FREETOKEN_MOE_PREFETCH": ""})
    assert r.exit_code == 0, r.output
    want = [one_line(text_of(ref, reply_ids(ref, user(p), 10))) for p in ("hello", "What is 2+2?")]
    assert r.stdout.split("\n") == [*want, ""]
    assert "2 replies | prompt eval" in r.stderr


def test_json_lines_match_the_engine(tiny_nvfp4, ref):
    lines = ['{"prompt": "hello"}',
             '{"prompt": "What is 2+2?", "system": "Be brief.", "max_new_tokens": 3}',
             "a plain line between JSON lines"]
    r = runner.invoke(app, ["run", str(tiny_nvfp4), "--json", "--max-new-tokens", "8",
                            "--system", "You are ftchat."], input="\n".join(lines) + "\n")
    assert r.exit_code == 0, r.output
    out = [json.loads(line) for line in r.stdout.splitlines()]
    cases = [(user("hello", "You are ftchat."), 8), (user("What is 2+2?", "Be brief."), 3),
             (user(lines[2], "You are ftchat."), 8)]
    for i, (obj, (messages, n)) in enumerate(zip(out, cases, strict=True)):
        want = reply_ids(ref, messages, n)
        assert (obj["index"], obj["tokens"], obj["text"]) == (i, want, text_of(ref, want))
        assert obj["prompt_tokens"] == len(ref.encode_messages(messages))
        assert obj["stop"] == ("eos" if want[-1] in ref.tokenizer.eos_ids else "length")
        assert set(obj["timings"]) == {"prefill_s", "prefill_tok_s", "decode_s", "decode_tok_s"}
        assert obj["offload"] == {} and obj["vram_peak_bytes"] is None


def test_batch_size_two_matches_the_engine_batch(tiny_nvfp4, ref):
    prompts = ["one", "two", "three"]
    r = runner.invoke(app, ["run", str(tiny_nvfp4), "--json", "--batch-size", "2",
                            "--max-new-tokens", "6"], input="\n".join(prompts))
    assert r.exit_code == 0, r.output
    got = [json.loads(line)["tokens"] for line in r.stdout.splitlines()]
    ids = [ref.encode_messages(user(p)) for p in prompts]
    pair = [step.tokens for step in engine.generate(ref.model, ids[:2], 6, ref.experts)]
    for b in range(2):
        col = [t[b] for t in pair]
        stop = next((i for i, t in enumerate(col) if t in ref.tokenizer.eos_ids), len(col) - 1)
        assert got[b] == col[: stop + 1]
    assert got[2] == reply_ids(ref, user("three"), 6)


def test_one_shot_prompt_is_written_as_is(tiny_nvfp4, ref):
    r = runner.invoke(app, ["run", str(tiny_nvfp4), "--prompt", "hello", "--system", "Hi.",
                            "--max-new-tokens", "12"])
    assert r.exit_code == 0, r.output
    assert r.stdout == text_of(ref, reply_ids(ref, user("hello", "Hi."), 12)) + "\n"


def test_empty_input_does_nothing(tiny_nvfp4):
    r = runner.invoke(app, ["run", str(tiny_nvfp4)], input="\n  \n")
    assert (r.exit_code, r.stdout) == (0, "")
    assert "no prompts" in r.stderr


def test_demo_model_is_written_once_and_announced(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("ftchat.resolve.SHIPPED_DEMO", tmp_path / "not-shipped")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, out, err = _main(["run", "--max-new-tokens", "3"], "hello\n", capsys, monkeypatch)
    assert code == 0 and len(out.splitlines()) == 1
    assert "demo model" in err and "RANDOM weights" in err
    config = tmp_path / "ftchat" / "demo-tiny" / "config.json"
    stamp = config.stat().st_mtime_ns
    assert _main(["run", "--max-new-tokens", "3"], "hello\n", capsys, monkeypatch)[1] == out
    assert config.stat().st_mtime_ns == stamp


def test_shipped_trained_demo_is_the_default_when_present(tiny_nvfp4, tmp_path, monkeypatch,
                                                          capsys, ref):
    monkeypatch.setattr("ftchat.resolve.SHIPPED_DEMO", tiny_nvfp4)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, out, err = _main(["run", "--max-new-tokens", "4", "--json"], "hello\n", capsys,
                           monkeypatch)
    assert code == 0, err
    assert json.loads(out)["tokens"] == reply_ids(ref, user("hello"), 4)
    assert "trained" in err and "RANDOM" not in err
    assert not (tmp_path / "ftchat").exists()  # nothing written to the cache


def test_repo_id_from_the_hub_cache_offline(tiny_nvfp4, tmp_path, monkeypatch, capsys, ref):
    snap = tmp_path / "hub" / "models--tester--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_nvfp4, snap)
    (tmp_path / "hub" / "models--tester--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--tester--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = _main(["run", "tester/tiny", "--max-new-tokens", "4", "--json"], "hello\n",
                           capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["tokens"] == reply_ids(ref, user("hello"), 4)
    # the same cache without that repo: one clear error (see test_bad_input_is_one_line too)
    code, out, err = _main(["run", "tester/other"], "hello\n", capsys, monkeypatch)
    assert code == 1 and "hf download tester/other" in err


# ===== info and synth =====


def test_info_reads_headers_only(tiny_nvfp4):
    r = runner.invoke(app, ["info", str(tiny_nvfp4), "--vram", "1"])
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "format       nvfp4-modelopt" in out
    assert "6: 5 GDN (linear_attention), 1 attention (indexed_attention)" in out
    assert "pattern      GGGAGG" in out
    # NVFP4 row, H=64 I=32, parts 128-aligned: 2048 + 256 + 256 + 1024 + 128 + 256
    assert "expert row   3,968 B (nvfp4)" in out
    assert "experts      96 rows = 372.00 KiB" in out
    assert "1 GiB VRAM: 96 slots (all experts fit" in out


def test_info_slot_count(tiny_nvfp4):
    # Dense bytes on the GPU, from the headers: synthetic dense weights are stored in bf16, as
    # they load; the n-gram table stays in host memory.
    dense = 0
    for f in sorted(tiny_nvfp4.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if ".mlp.experts." not in k and ".ngram_embedding.shard_" not in k:
                    t = h.get_slice(k)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    dense += n * (8 if t.get_dtype() == "I64" else 2)
    gib = (dense + 10.5 * 3968) / 2**30
    r = runner.invoke(app, ["info", str(tiny_nvfp4), "--vram", repr(gib), "--vram",
                            repr(dense / 2**30 / 2)])
    assert r.exit_code == 0, r.output
    assert ": 10 slots (10.4% of the experts" in r.stdout
    assert ": 0 slots (0.0% of the experts" in r.stdout


def test_synth_writes_a_loadable_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ck"
    r = runner.invoke(app, ["synth", str(out), "--layers", "4", "--format", "nvfp4-ct",
                            "--seed", "2"])
    assert r.exit_code == 0, r.output
    ck = Checkpoint(out)
    assert (ck.args.num_hidden_layers, ck.format) == (4, "nvfp4-ct")
    code, _, err = _main(["synth", str(out)], "", capsys, monkeypatch)
    assert code == 1 and err.startswith("error: ") and "exists" in err


# ===== bad input: one error line, no traceback =====


def _main(argv, stdin_text, capsys, monkeypatch):
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin_text.encode())))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def corrupt(tiny_nvfp4, tmp_path_factory):
    bad = tmp_path_factory.mktemp("bad") / "ck"
    shutil.copytree(tiny_nvfp4, bad)
    shard = sorted(bad.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return bad


# (id, argv, env, stdin, the error line contains; argv, env[, stdin] with the fault removed)
BAD = [
    ("missing-folder", ["run", "{tmp}/nope"], {}, "hi", "no such model folder",
     ["run", "{model}"], {}),
    # before: ": not a model folder (config.json: missing)" ("" is the current folder)
    ("empty-model", ["run", ""], {}, "hi", "MODEL '' is empty", ["run", "{model}"], {}),
    ("corrupt-checkpoint", ["run", "{corrupt}"], {}, "hi", "unreadable safetensors",
     ["run", "{model}"], {}),
    ("unknown-repo-offline", ["run", "nobody/no-such-model"],
     {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "{tmp}/hub"}, "hi",
     "not in the Hugging Face cache (HF_HUB_OFFLINE is set)", ["run", "{model}"], {}),
    ("invalid-flag-value", ["run", "{model}", "--budget", "-1"], {}, "hi",
     "--budget '-1': expected auto or a non-negative integer", ["run", "{model}", "--budget", "1"], {}),
    ("flag-not-a-number", ["run", "{model}", "--candidates", "x"], {}, "hi",
     "Invalid value for '--candidates'", ["run", "{model}", "--candidates", "2"], {}),
    ("unknown-flag", ["run", "{model}", "--bogus"], {}, "hi", "No such option: --bogus",
     ["run", "{model}"], {}),
    ("invalid-env", ["run", "{model}"], {"FREETOKEN_MOE_PREFETCH": "yes"}, "hi",
     "FREETOKEN_MOE_PREFETCH='yes': expected auto, off, measure or on", ["run", "{model}"],
     {"FREETOKEN_MOE_PREFETCH": "off"}),
    ("prompt-longer-than-context", ["run", "{model}", "--context", "8", "-p", "hello there"],
     {}, "", "--prompt has 19 tokens, more than the context (8)",
     ["run", "{model}", "--context", "32", "-p", "hello there"], {}),
    ("no-cuda", ["run", "{model}", "--device", "cuda"], {}, "hi", "--device cuda",
     ["run", "{model}", "--device", "cpu"], {}),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_one_line(case, tiny_nvfp4, corrupt, tmp_path, monkeypatch, capsys):
    _, argv, env, stdin, expected, good_argv, good_env, *good_stdin = case
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def fill(items):
        return [a.format(tmp=tmp_path, model=tiny_nvfp4, corrupt=corrupt) for a in items]

    for k, v in env.items():
        monkeypatch.setenv(k, fill([v])[0])
    code, out, err = _main(fill(argv) + ["--max-new-tokens", "2"], stdin, capsys, monkeypatch)
    assert code != 0 and out == ""
    lines = err.splitlines()  # status lines (the load banner) may come first
    assert lines[-1].startswith("error: ") and expected in lines[-1], err
    assert [ln for ln in lines if not ln.startswith("ftchat: ")] == [lines[-1]], err
    # control: the same command without the fault succeeds
    for k in env:
        monkeypatch.delenv(k)
    for k, v in good_env.items():
        monkeypatch.setenv(k, v)
    code, out, err = _main(fill(good_argv) + ["--max-new-tokens", "2"], (good_stdin or [stdin])[0],
                           capsys, monkeypatch)
    assert code == 0 and "error" not in err, err
