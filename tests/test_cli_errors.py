"""Bad input ends in one plain `error: ...` line: exit 1 for damaged or wrong config.json and
shards and synth output paths, exit 2 for a bad flag value (--context beyond the model, a bad
combination of flags); and small output fixes.

Most cases call `main()` in-process (no torch start per case); the no-argument help runs the real
console script.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftchat import engine
from ftchat.errors import ModelError
from ftchat.ui.info import header_bytes
from tests.cli_harness import run_main as _main

FTCHAT = Path(sys.executable).parent / "ftchat"


def one_error(code: int, out: str, err: str, *expected: str, status: int = 1) -> str:
    """The run failed with exactly one `error: ` line holding every `expected` text, exit
    `status` (1: a runtime failure; 2: a usage error, a bad flag or variable value)."""
    assert code == status, (code, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    for text in expected:
        assert text in lines[0], err
    return lines[0]


@pytest.fixture
def model(tiny_bf16, tmp_path) -> Path:
    """A private copy of the tiny bf16 checkpoint, to damage."""
    return Path(shutil.copytree(tiny_bf16, tmp_path / "ck"))


def edit_text_config(folder: Path, change) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg["text_config"])
    path.write_text(json.dumps(cfg))


# ===== shards and config.json =====


def test_info_on_a_shard_of_random_bytes(model, capsys, monkeypatch):
    shard = sorted(model.glob("*.safetensors"))[-1]
    shard.write_bytes(bytes(range(256)) * 400)  # 100 KB; its "header length" is ~5e17 B
    for command in ("info", "run"):
        line = one_error(*_main([command, model, "--prompt" if command == "run" else "--vram",
                                 "hi" if command == "run" else "24"], capsys, monkeypatch),
                         f"{shard}: unreadable safetensors", "download it again")
        assert "MemoryError" not in line


def test_header_reader_refuses_a_length_past_the_end(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"\xff" * 8 + b"{}" * 100)
    with pytest.raises(ModelError, match="header length .* but the file has 208 B"):
        header_bytes(f)


@pytest.mark.parametrize("command", ["info", "run"])
def test_config_json_not_an_object(model, command, capsys, monkeypatch):
    (model / "config.json").write_text("[]")
    one_error(*_main([command, model, "--prompt" if command == "run" else "--vram",
                      "hi" if command == "run" else "24"], capsys, monkeypatch),
              f"{model / 'config.json'}: expected a JSON object", "got a list")


# (field, bad value, the error line contains)
BAD_FIELDS = [
    ("hidden_size", "64", '"hidden_size" must be an integer, got "64" (a string)'),
    ("num_experts", True, '"num_experts" must be an integer, got true (true/false)'),
    ("num_experts", 0, '"num_experts" must be at least 1, got 0'),
    ("head_dim", 32.0, '"head_dim" must be an integer, got 32.0 (a number)'),
    ("rms_norm_eps", "1e-6", '"rms_norm_eps" must be a number, got "1e-6" (a string)'),
    ("norm_topk_prob", "yes", '"norm_topk_prob" must be true or false'),
    ("layer_types", "linear_attention", '"layer_types" must be a list of strings'),
    ("ple_layer_ids", [1.5], '"ple_layer_ids" must be a list of layer numbers'),
    ("rope_parameters", [10000], '"rope_parameters" must be a JSON object, got a list'),
    ("eos_token_id", "<eos>", '"eos_token_id" must be a token id or a list of them'),
    ("indexer_budget", "8", '"indexer_budget" must be an integer'),
]


@pytest.mark.parametrize("field,value,expected", BAD_FIELDS, ids=[f"{c[0]}={c[1]!r}"
                                                                 for c in BAD_FIELDS])
def test_config_field_of_the_wrong_type(model, field, value, expected, capsys, monkeypatch):
    edit_text_config(model, lambda t: t.update({field: value}))
    one_error(*_main(["info", model], capsys, monkeypatch), f"{model / 'config.json'}: ",
              expected)


def test_text_config_not_an_object(model, capsys, monkeypatch):
    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"] = "qwen4_exp_text"
    (model / "config.json").write_text(json.dumps(cfg))
    one_error(*_main(["info", model], capsys, monkeypatch),
              '"text_config" must be a JSON object, got "qwen4_exp_text" (a string)')


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "moe_intermediate_size"])
def test_a_required_field_missing(model, field, capsys, monkeypatch):
    edit_text_config(model, lambda t: t.pop(field))
    for command, extra in (("info", []), ("run", ["--prompt", "hi"])):
        one_error(*_main([command, model, *extra], capsys, monkeypatch),
                  f'required field "{field}" is missing',
                  "use the config.json that came with the checkpoint")


def test_a_defaulted_field_missing_takes_the_hf_default(model, capsys, monkeypatch):
    # norm_topk_prob is absent from the real model's config: HF's default (True) applies
    edit_text_config(model, lambda t: t.pop("norm_topk_prob"))
    code, out, err = _main(["info", model], capsys, monkeypatch)
    assert code == 0 and "hidden 64" in out, err


@pytest.mark.parametrize("field,value,tensor", [
    ("hidden_size", 128, "embed_tokens.weight has shape [512, 64], config.json implies [512, 128]"),
    ("hc_lowrank", 320, "input_mix_weight_down.weight has shape [16, 256], config.json implies "
                        "[320, 256]"),
    ("moe_intermediate_size", 64, "experts.0.gate_proj.weight has shape [32, 64], config.json "
                                  "implies [64, 64]"),
])
def test_info_refuses_a_config_that_does_not_match_the_weights(model, field, value, tensor,
                                                               capsys, monkeypatch):
    # Before: info printed figures for the config's geometry (36 MiB of experts for 1 MiB).
    edit_text_config(model, lambda t: t.update({field: value}))
    one_error(*_main(["info", model], capsys, monkeypatch), tensor,
              "config.json does not describe these weights")


def test_info_of_nvfp4_checks_the_packed_shapes(tiny_nvfp4, tiny_ct, capsys, monkeypatch):
    for ck in (tiny_nvfp4, tiny_ct):  # control: packed NVFP4 tensors are not a mismatch
        code, out, err = _main(["info", ck], capsys, monkeypatch)
        assert code == 0 and "expert row" in out, err


@pytest.mark.parametrize("command", ["info", "run"])
def test_not_a_model_folder_reads_the_same_everywhere(tmp_path, command, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a model")
    line = one_error(*_main([command, empty], capsys, monkeypatch, "hi\n"),
                     f"{empty}: not a model folder (config.json: missing)",
                     "MODEL is a checkpoint folder")
    assert "tokenizer.json:" not in line


# ===== --context =====


def test_context_far_beyond_the_demo_model(capsys, monkeypatch):
    # Before: "internal error: RuntimeError: ... you tried to allocate 51199999488 bytes".
    one_error(*_main(["run", "--context", "99999999", "--prompt", "hi"], capsys, monkeypatch),
              "--context 99999999: more than this model's limit of 4,096 tokens "
              "(max_position_embeddings); pass --context 4096 or less", status=2)


def test_context_just_past_the_model_limit(tiny_bf16, capsys, monkeypatch):
    # Before: it ran with a KV cache past max_position_embeddings, silently.
    one_error(*_main(["run", tiny_bf16, "--context", "4097", "--prompt", "hi"], capsys,
                     monkeypatch), "--context 4097: more than this model's limit of 4,096",
              status=2)
    code, out, err = _main(["run", tiny_bf16, "--context", "4096", "--prompt", "hi",
                            "--max-new-tokens", "2"], capsys, monkeypatch)
    assert code == 0 and "context 4096" in err and "error" not in err, err  # control


# ===== synth: the output path =====


def test_synth_onto_an_existing_file(tmp_path, capsys, monkeypatch):
    f = tmp_path / "FILE"
    f.write_text("keep me")
    one_error(*_main(["synth", f], capsys, monkeypatch),
              f"{f}: exists and is not a folder", "give a path that does not exist yet")
    assert f.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def test_synth_below_a_file(tmp_path, capsys, monkeypatch):
    f = tmp_path / "passwd"
    f.write_text("root")
    one_error(*_main(["synth", f / "x" / "y"], capsys, monkeypatch),
              f"{f / 'x' / 'y'}: {f} is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passwd"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_synth_into_proc(capsys, monkeypatch):
    one_error(*_main(["synth", "/proc/x"], capsys, monkeypatch),
              "/proc/x: cannot write the checkpoint in /proc", "choose a folder on a writable")
    one_error(*_main(["synth", "/proc/ftchat-no/such/x"], capsys, monkeypatch),
              "cannot create the folder /proc/ftchat-no")
    assert not any(p.name.startswith(".synth-") for p in Path("/proc").iterdir())


def test_synth_failing_midway_leaves_nothing(tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    calls = []
    real_save = __import__("ftchat.model.synth", fromlist=["save_file"]).save_file

    def second_shard_fails(*args, **kwargs):  # one shard is written, then the disk is full
        calls.append(1)
        return real_save(*args, **kwargs) if len(calls) == 1 else full()

    monkeypatch.setattr("ftchat.model.synth.save_file", second_shard_fails)
    out = tmp_path / "new" / "deeper" / "ck"
    one_error(*_main(["synth", out], capsys, monkeypatch),
              f"{out}: cannot write the checkpoint", "No space left on device")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no temp folder, no parents made


def test_synth_into_an_empty_folder_still_works(tmp_path, capsys, monkeypatch):
    (tmp_path / "ck").mkdir()
    code, out, err = _main(["synth", tmp_path / "ck", "--layers", "2"], capsys, monkeypatch)
    assert code == 0 and (tmp_path / "ck" / "config.json").is_file(), err


def test_synth_files_all_have_the_same_mode(tmp_path, capsys, monkeypatch):
    code, _, err = _main(["synth", tmp_path / "ck", "--layers", "2"], capsys, monkeypatch)
    assert code == 0, err
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "ck").iterdir()}
    assert len(set(modes.values())) == 1, modes


# ===== usage errors past the option parser: exit 2, as the parser's own =====


@pytest.mark.parametrize("argv, expected, status", [
    (["serve", "MODEL", "--port", "0"], "--port 0: expected 1 to 65535", 2),
    (["serve", "MODEL", "--parallel", "0"], "--parallel 0: expected 1 to 4,096", 2),
    # before: the model loaded, then "32 expert slots are fewer than ..." (exit 1)
    (["serve", "MODEL", "--parallel", "99999999"], "--parallel 99999999: expected 1 to 4,096", 2),
    (["serve", "MODEL", "--queue", "-1"], "--queue -1: expected 0 or more", 2),
    (["serve", "MODEL", "--cache-ram", "-1"], "--cache-ram -1.0: expected 0 to 1,048,576 GiB", 2),
    (["serve", "MODEL", "--cache-ram", "1e300"], "--cache-ram 1e+300: expected 0 to", 2),  # was
    (["info", "MODEL", "--vram", "1e300"], "--vram 1e+300: expected a positive number", 2),  # an
    (["info", "MODEL", "--context", "infk"], "--context 'infk': expected a token count", 2),  # int.
    (["bench", "MODEL", "--context", "1e400k"], "--context '1e400k': expected a token", 2),  # err
    (["info", "MODEL", "--context", ""], "--context '': expected a token count", 2),  # was exit 0
    (["bench", "MODEL", "--prefetch", ""], "--prefetch '': expected a comma-separated list", 2),
    (["bench", "MODEL", "--budget", ""], "--budget '': expected a comma-separated list", 2),
    (["serve", "EMPTY", "--port", "8080"], "EMPTY", 1),  # control: a model error stays 1
    (["info", "MODEL", "--synthetic", "tiny"], "give MODEL or --synthetic, not both", 2),
    (["info", "MODEL", "--layers", "4"], "--layers and --dense need --synthetic", 2),
    (["info", "MODEL", "--batch-size", "0"], "--batch-size 0: expected a positive integer", 2),
    (["info", "MODEL", "--context", "lots"], "--context 'lots': expected a token count", 2),
    (["info", "EMPTY", "--context", "64"], "EMPTY", 1),  # control
    (["verify", "MODEL", "--mode", "sloppy"], "--mode 'sloppy': expected meta or bytes", 2),
    (["verify", "MODEL", "--prompts", "0"], "--prompts 0: expected a positive integer", 2),
    (["verify", "MODEL", "--audit-every", "-1"], "--audit-every -1: expected a positive", 2),
    (["audit", "MODEL", "-p", "hi", "--every", "2", "--audit-every", "3"],
     "--audit-every and its old name --every give different values", 2),
    (["bench", "MODEL", "--steps", "0"], "--steps 0: expected a positive integer", 2),
    (["bench", "MODEL", "--rounds", "-1"], "--rounds -1: expected a positive integer", 2),
    (["bench", "MODEL", "--routing", "nowhere"], "--routing 'nowhere': expected model", 2),
    (["bench", "MODEL", "--routing", "calibrated:nope"], "--routing 'calibrated:nope': no fit", 2),
    (["bench", "MODEL", "--context", "5000", "--steps", "1", "--rounds", "1"],
     # the default arms hold `on` (--budget auto): a warm-up of 46 steps, then 1 round of 1
     "--context 5000: with 47 bench tokens (warm-up and rounds) it exceeds the model's 4096 "
     "positions", 2),
    (["bench", "--synthetic", "tiny", "--format", "fp3"], "--format 'fp3': expected", 2),
    # a value this model or machine cannot take: the flag must change, a usage error too
    (["run", "MODEL", "-p", "hi", "--device", "cuda"], "--device cuda: no CUDA device", 2),
    (["run", "MODEL", "-p", "hi", "--slots", "1"],
     "1 expert slots are fewer than batch size x top-k", 2),
    (["run", "MODEL", "-q", "-p", "hello there", "-c", "8"], "--prompt has", 1),  # control
    (["audit", "MODEL", "-p", "hi", "-n", "5000"],
     "--max-new-tokens 5000: with prompt 1's", 2),
    (["verify", "MODEL", "--prompts", "1", "-n", "5000"],
     "--max-new-tokens 5000: with prompts of up to", 2),
    (["synth", "OUT", "--preset", "nope"], "unknown preset 'nope'", 2),
    (["synth", "OUT", "--format", "fp3"], "unknown format 'fp3'", 2),
    (["synth", "OUT", "--format", "bf16", "--dense", "nvfp4"],
     "NVFP4 dense projections need an NVFP4 format", 2),
    (["synth", "OUT", "--seed", "18446744073709551616"],  # before: an internal error
     "--seed 18446744073709551616: expected an integer from 0 to 2**63 - 1", 2),
    (["synth", "EMPTY/file", "--preset", "tiny"], "EMPTY/file", 1),  # control: a path error
])
def test_flag_errors_past_the_parser_are_usage_errors(argv, expected, status, tiny_bf16, tmp_path,
                                                       capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # a CPU-only machine
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "file").write_text("not a folder")
    names = {"MODEL": str(tiny_bf16), "EMPTY": str(empty), "OUT": str(tmp_path / "out")}

    def named(text: str) -> str:
        for name, value in names.items():
            text = text.replace(name, value) if text.startswith(name) else text
        return text

    one_error(*_main([named(a) for a in argv], capsys, monkeypatch), named(expected),
              status=status)
    assert not (tmp_path / "out").exists()  # synth wrote nothing


# ===== no arguments; plural forms =====


def test_no_arguments_prints_the_help_only():
    env = {k: v for k, v in os.environ.items() if k != "FTCHAT_DEBUG"}
    p = subprocess.run([str(FTCHAT)], capture_output=True, text=True, timeout=120,
                       env={**env, "TERM": "dumb", "COLUMNS": "100"})
    assert p.returncode == 0, p.stderr
    assert "Usage: ftchat" in p.stdout and "run" in p.stdout
    assert p.stderr == ""  # before: an empty `error: ` line, exit 2


def test_plural():
    from ftchat.ui.text import plural

    assert [plural(n, "reply", "replies") for n in (0, 1, 2)] == [
        "0 replies", "1 reply", "2 replies"]
    assert plural(1, "token") == "1 token" and plural(3, "token") == "3 tokens"


def test_batch_summary_of_one_reply(tiny_bf16, capsys, monkeypatch):
    code, out, err = _main(["run", tiny_bf16, "--max-new-tokens", "2"], capsys, monkeypatch,
                           "hello\n")
    assert code == 0, err
    assert "1 reply | prompt eval" in err and "1 replies" not in err


OOM_TEXT = ("CUDA out of memory. Tried to allocate 130.00 MiB. GPU 0 has a total capacity of "
            "79.18 GiB of which 40.19 MiB is free. Including non-PyTorch memory, this process "
            "has 79.00 GiB memory in use.")


@pytest.mark.parametrize("error,expected", [
    (torch.OutOfMemoryError(OOM_TEXT),
     "out of GPU memory (130.00 MiB more was needed, 40.19 MiB of 79.18 GiB was free): try a "
     "shorter --context"),
    (torch.OutOfMemoryError("out of memory"), "out of GPU memory: try a shorter --context"),
])
def test_a_device_out_of_memory_is_one_plain_line(tiny_bf16, capsys, monkeypatch, error,
                                                  expected):
    # Before: "internal error: OutOfMemoryError: CUDA out of memory. Tried to allocate ..."
    def no_memory(*args, **kwargs):
        raise error
    monkeypatch.setattr(engine, "build_experts", no_memory)
    one_error(*_main(["run", tiny_bf16, "--prompt", "hi", "-n", "2"], capsys, monkeypatch),
              expected, status=1)


def test_another_device_error_is_still_an_internal_error(tiny_bf16, capsys, monkeypatch):
    # control for the test above: only an allocation failure is named as one
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(engine, "build_experts", broken)
    code, out, err = _main(["run", tiny_bf16, "--prompt", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 1 and err.startswith("error: internal error: RuntimeError: CUDA error"), err
