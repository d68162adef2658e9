"""`ftchat bench` options a user chooses (--prefetch LIST, --budget LIST, beside --slots,
--context, --routing) stand for arms; the arm grammar (--arms) has its page of its own
(--help-arms, at most 80 columns), which lists only keys the arm parser accepts; the table keeps
arm names whole at 80 columns."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftchat.cli import main
from ftchat.commands.arms_help import ARM_KEYS, HEADS, SKIP_FAMILIES, arms_of_choices
from ftchat.commands.bench import parse_arm
from ftchat.errors import FtchatError
from ftchat.kernels.skip import FAMILIES
from ftchat.settings import Settings

CLI = [sys.executable, "-m", "ftchat.cli"]
ROOT = Path(__file__).resolve().parents[1]
FAST = ["--steps", "2", "--rounds", "1", "--threads", "1"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FREETOKEN_MOE_") and k != "FTCHAT_DEBUG"}
    return {**env, "TERM": "dumb", "PYTHONPATH": str(ROOT), **extra}


def _main(argv, capsys, monkeypatch):
    capsys.readouterr()
    monkeypatch.delenv("FTCHAT_DEBUG", raising=False)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ===== the user's choices -> arms =====


@pytest.mark.parametrize("prefetch, budget, arms", [
    (None, None, "off;on:budget=auto;on:budget=1"),  # the default
    ("off", None, "off"),
    ("resident,off,on", "2", "resident;off;on:budget=2"),
    ("off,measure", "1,4", "off;measure:budget=1;measure:budget=4"),
    ("on,off", " 0 , 3 ", "on:budget=0;on:budget=3;off"),  # in the order given
    ("off,on", "1,auto", "off;on:budget=1;on:budget=auto"),
])
def test_choices_stand_for_arms(prefetch, budget, arms):
    assert arms_of_choices(prefetch, budget) == arms
    assert list(parse_arm_names(arms)) == arms.split(";")  # arms the parser takes


def parse_arm_names(arms: str):
    for name in arms.split(";"):
        parse_arm(name, Settings())
        yield name


@pytest.mark.parametrize("prefetch, budget, message", [
    ("off,fast", None, "--prefetch 'fast': expected a list of resident, off, measure, on"),
    ("off,,on", None, "--prefetch 'off,,on': expected a comma-separated list"),
    ("off,off", None, "--prefetch 'off,off': an item is given twice"),
    ("on", "two", "--budget 'two': expected non-negative integers or auto"),
    ("on", "-1", "--budget '-1': expected non-negative integers"),
    ("off,resident", "2", "--budget: only the measure and on arms have a budget"),
])
def test_bad_choices_name_the_option(prefetch, budget, message):
    with pytest.raises(FtchatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        arms_of_choices(prefetch, budget)


def test_bench_runs_the_arms_the_choices_stand_for(tiny_bf16, capsys, monkeypatch):
    def arms(*flags):
        code, out, err = _main(["bench", tiny_bf16, "--json", *FAST, *flags], capsys,
                               monkeypatch)
        assert code == 0, err
        return [list(figures) for figures in json.loads(out).values()]

    assert arms() == [["off", "on:budget=auto", "on:budget=1"]]
    assert arms("--prefetch", "off,on", "--budget", "2") == [["off", "on:budget=2"]]
    assert arms("--arms", "resident;off") == [["resident", "off"]]  # the old way still works
    code, out, err = _main(["bench", tiny_bf16, *FAST, "--arms", "off", "--prefetch", "on"],
                           capsys, monkeypatch)
    assert code == 2 and out == "" and err == (  # a usage error, as the parser's own
        "error: give --arms, or --prefetch and --budget, not both\n")


@pytest.mark.parametrize("flags, names", [
    (["--prefetch", "on,maybe"], ["--prefetch", "'maybe'"]),
    (["--prefetch", "on,,off"], ["--prefetch", "'on,,off'"]),
    (["--prefetch", "on,on"], ["--prefetch", "given twice"]),
    (["--budget", "3,x"], ["--budget", "'x'"]),
    (["--budget", "-2"], ["--budget", "'-2'"]),
    (["--prefetch", "off", "--budget", "2"], ["--budget", "only the measure and on arms"]),
    (["--context", "4k,zz"], ["--context", "'zz'"]),
    (["--context", "4k,"], ["--context", "'4k,'"]),
    (["-c", "0"], ["--context", "'0'"]),
    (["--arms", "on;bogus"], ["--arms", "'bogus'"]),
    (["--arms", "on:budget=x"], ["--arms", "'on:budget=x'", "--budget 'x'"]),
    (["--arms", "off:colour=red"], ["--arms", "unknown setting 'colour'"]),
    (["--arms", "off;off"], ["--arms", "given twice"]),
    (["--arms", ";"], ["--arms", "no arm given"]),
])
def test_a_bad_list_item_is_a_usage_error_naming_option_and_item(flags, names, capsys,
                                                                   monkeypatch, tmp_path):
    # exit 2 (usage) before any model loads: MODEL here is a folder that does not exist, and
    # the model's own error (exit 1) would come first if the list were checked after it
    code, out, err = _main(["bench", tmp_path / "no-model", *FAST, *flags], capsys,
                           monkeypatch)
    assert (code, out) == (2, ""), err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for name in names:
        assert name in err, err


def test_the_list_check_lets_good_lists_through(capsys, monkeypatch, tmp_path):
    # control for the usage errors above: the same lists without the bad item pass the checks
    # and reach the model, whose absence is the (runtime) error
    for flags in (["--prefetch", "on,off"], ["--budget", "3,auto"], ["--context", "4k,32k"],
                  ["--arms", "on;off:eviction=lru"]):
        code, out, err = _main(["bench", tmp_path / "no-model", *FAST, *flags], capsys,
                               monkeypatch)
        assert code == 1 and "no-model" in err, (flags, err)


# ===== the help pages =====


def test_help_arms_is_its_own_page_at_80_columns():
    p = subprocess.run([*CLI, "bench", "--help-arms"], capture_output=True, text=True,
                       timeout=120, env=_env(COLUMNS="200"))  # 80 whatever the terminal
    assert p.returncode == 0 and p.stderr == "", p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) > 20 and max(map(len, lines)) <= 80
    for head in HEADS:
        assert f"  {head} " in p.stdout
    for key, _, _ in ARM_KEYS:
        assert f"  {key} " in p.stdout or f"  {key}\n" in p.stdout, key
    assert ", ".join(SKIP_FAMILIES) in p.stdout.replace("\n" + " " * 22, " ")
    main_page = subprocess.run([*CLI, "bench", "--help"], capture_output=True, text=True,
                               timeout=120, env=_env(COLUMNS="80")).stdout
    for option in ("--prefetch", "--budget", "--slots", "--context", "--routing", "--arms",
                   "--help-arms"):
        assert option in main_page, option
    # the grammar's keys live on the arms page only (before: a wall of them under --arms)
    for key in ("kv_cache_dtype", "fused=0", "skip="):
        assert key not in main_page and key in p.stdout, key


def test_every_listed_key_is_one_the_arm_parser_takes():
    takers = {"offload": ("off", "measure", "on"), "any": ("resident", "off", "on"),
              "resident": ("resident",)}
    for key, who, _ in ARM_KEYS:
        for head in takers[who]:
            parse_arm(f"{head}:{key}", Settings())  # raises if the key or value is refused
        if who == "offload":  # control: the page says resident arms do not take it
            with pytest.raises(FtchatError):
                parse_arm(f"resident:{key}", Settings())
    for bad in ("on:bogus=1", "off:skip=hc"):  # control: the parser refuses what is not listed
        with pytest.raises(FtchatError):
            parse_arm(bad, Settings())
    assert SKIP_FAMILIES == FAMILIES


# ===== the table at 80 columns =====


@pytest.mark.parametrize("columns", ["80", "200"])
def test_the_table_keeps_arm_names_whole(tiny_bf16, columns, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", columns)
    code, out, err = _main(["bench", tiny_bf16, *FAST, "--prefetch", "resident,off,measure,on",
                            "--budget", "2,4"], capsys, monkeypatch)
    assert code == 0, err
    lines = out.splitlines()
    for arm in ("measure:budget=2", "measure:budget=4", "on:budget=2", "on:budget=4"):
        assert sum(arm in ln for ln in lines) == 1, out
    if columns == "80":  # the headers wrap at their slashes to fit
        assert max(map(len, lines)) <= 80 and "misses/token" not in out, out
    else:  # control: room for one-line headers
        assert max(map(len, lines)) > 80 and "misses/token" in out, out
