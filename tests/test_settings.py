"""Settings: flag > environment > default, and a one-line error for every invalid value."""

from __future__ import annotations

import pytest
import torch

from ftchat.errors import SettingsError
from ftchat.settings import Settings, resolve_settings


def test_defaults():
    s = resolve_settings({}, {})
    assert (s.prefetch, s.budget_gdn, s.budget_attn, s.candidates) == ("auto", None, None, 16)
    assert (s.slots, s.expert_vram_gib, s.eviction, s.overlap, s.graph) == (None, None, "rule",
                                                                            True, None)
    assert (s.max_new_tokens, s.batch_size, s.device, s.dtype) == (256, 1, "auto", "auto")
    assert (s.verify, s.audit_every, s.copy_programs, s.record_routing) == (None, 0, 8, None)
    assert (s.panel, s.json, s.system, s.prompt, s.context) == (None, False, None, None, None)


@pytest.mark.parametrize("var, value, field, expected", [
    ("FREETOKEN_MOE_PREFETCH", "on", "prefetch", "on"),
    ("FREETOKEN_MOE_PREFETCH", "Measure", "prefetch", "measure"),
    ("FREETOKEN_MOE_PREFETCH_K", "8", "candidates", 8),
    ("FREETOKEN_MOE_PREFETCH_VERIFY", "meta", "verify", "meta"),
    ("FREETOKEN_MOE_PREFETCH_VERIFY", "1", "verify", "bytes"),
    ("FREETOKEN_MOE_PREFETCH_VERIFY", "0", "verify", None),
    ("FREETOKEN_MOE_SLOT_AUDIT", "64", "audit_every", 64),
    ("FREETOKEN_MOE_SLIM_COPY", "4", "copy_programs", 4),
    ("FREETOKEN_MOE_SLIM_COPY", "0", "copy_programs", 0),
    ("FREETOKEN_MOE_SLIM_COPY", "off", "copy_programs", 0),
    ("FREETOKEN_MOE_PREFETCH", "", "prefetch", "auto"),  # empty means unset
])
def test_environment(var, value, field, expected):
    assert getattr(resolve_settings({}, {var: value}), field) == expected


def test_budget_env_sets_both():
    s = resolve_settings({}, {"FREETOKEN_MOE_PREFETCH_BUDGET": "5"})
    assert (s.budget_gdn, s.budget_attn) == (5, 5)


def test_flag_beats_environment():
    env = {"FREETOKEN_MOE_PREFETCH": "on", "FREETOKEN_MOE_PREFETCH_K": "8",
           "FREETOKEN_MOE_PREFETCH_VERIFY": "1", "FREETOKEN_MOE_SLOT_AUDIT": "64",
           "FREETOKEN_MOE_SLIM_COPY": "2"}
    s = resolve_settings({"prefetch": "measure", "candidates": 32, "verify": "meta", "audit": 0,
                          "copy_programs": 1}, env)
    assert (s.prefetch, s.candidates, s.verify, s.audit_every, s.copy_programs) == (
        "measure", 32, "meta", 0, 1)


@pytest.mark.parametrize("flags, gdn, attn", [
    ({}, 5, 5),  # the variable
    ({"budget": 2}, 2, 2),  # --budget beats it
    ({"budget_gdn": 1}, 1, 5),  # a per-kind flag beats it for its kind only
    ({"budget": 2, "budget_attn": 7}, 2, 7),  # and beats --budget
    ({"budget_gdn": 0, "budget_attn": 0}, 0, 0),
])
def test_budget_precedence(flags, gdn, attn):
    s = resolve_settings(flags, {"FREETOKEN_MOE_PREFETCH_BUDGET": "5"})
    assert (s.budget_gdn, s.budget_attn) == (gdn, attn)


# (flag key, a good value and what it becomes, a bad value, the flag the message must name)
FLAG_CASES = [
    ("prefetch", "on", "on", "maybe", "--prefetch"),
    ("budget", 0, 0, -1, "--budget"),
    ("budget_gdn", 2, 2, -3, "--budget-gdn"),
    ("budget_attn", 6, 6, 1.5, "--budget-attn"),
    ("candidates", 1, 1, 0, "--candidates"),
    ("slots", 100, 100, 0, "--slots"),
    ("expert_vram", 12.5, 12.5, -2.0, "--expert-vram"),
    ("eviction", "lru", "lru", "fifo", "--eviction"),
    ("max_new_tokens", 1, 1, 0, "--max-new-tokens"),
    ("batch_size", 2, 2, 0, "--batch-size"),
    ("context", 64, 64, 0, "--context"),
    ("device", "cpu", "cpu", "tpu", "--device"),
    ("dtype", "bfloat16", "bfloat16", "fp16", "--dtype"),
    ("verify", "bytes", "bytes", "1", "--verify"),
    ("audit", 10, 10, -1, "--audit"),
    ("copy_programs", 0, 0, -4, "--copy-programs"),
    ("kernels", "torch", "torch", "triton", "--kernels"),
    ("pdl", False, False, "no", "--pdl"),
]
FIELD = {"budget": "budget_gdn", "expert_vram": "expert_vram_gib", "audit": "audit_every"}


@pytest.mark.parametrize("key, good, parsed, bad, flag", FLAG_CASES)
def test_invalid_flag(key, good, parsed, bad, flag):
    assert getattr(resolve_settings({key: good}, {}), FIELD.get(key, key)) == parsed  # control
    with pytest.raises(SettingsError) as e:
        resolve_settings({key: bad}, {})
    msg = str(e.value)
    assert msg.startswith(f"{flag} {bad!r}: expected") and "\n" not in msg


ENV_CASES = [
    ("FREETOKEN_MOE_PREFETCH", "measure", "yes"),
    ("FREETOKEN_MOE_PREFETCH_BUDGET", "4", "x"),
    ("FREETOKEN_MOE_PREFETCH_BUDGET", "0", "-1"),
    ("FREETOKEN_MOE_PREFETCH_K", "16", "0"),
    ("FREETOKEN_MOE_PREFETCH_K", "16", "many"),
    ("FREETOKEN_MOE_PREFETCH_VERIFY", "meta", "2"),
    ("FREETOKEN_MOE_SLOT_AUDIT", "8", "-8"),
    ("FREETOKEN_MOE_SLIM_COPY", "on", "fast"),
    ("FTCHAT_PDL", "0", "2"),
]


@pytest.mark.parametrize("var, good, bad", ENV_CASES)
def test_invalid_environment(var, good, bad):
    resolve_settings({}, {var: good})  # control: the good value resolves
    with pytest.raises(SettingsError) as e:
        resolve_settings({}, {var: bad})
    msg = str(e.value)
    assert msg.startswith(f"{var}={bad!r}: expected") and "\n" not in msg


@pytest.mark.parametrize("flags, env, kernels, pdl", [
    ({}, {}, "fused", True),  # the defaults
    ({}, {"FTCHAT_PDL": "0"}, "fused", False),  # the variable beats the default
    ({}, {"FTCHAT_PDL": "1"}, "fused", True),
    ({"pdl": True}, {"FTCHAT_PDL": "0"}, "fused", True),  # the flag beats the variable
    ({"pdl": False}, {"FTCHAT_PDL": "1"}, "fused", False),
    ({"kernels": "Torch"}, {}, "torch", True),
])
def test_kernel_choices(flags, env, kernels, pdl):
    s = resolve_settings(flags, env)
    assert (s.kernels, s.pdl) == (kernels, pdl)


def test_invalid_environment_ignored_when_flag_given():
    # The flag decides, so a broken variable for the same setting is never parsed.
    s = resolve_settings({"prefetch": "off"}, {"FREETOKEN_MOE_PREFETCH": "yes"})
    assert s.prefetch == "off"


def test_slots_and_expert_vram_are_exclusive():
    assert resolve_settings({"slots": 10}, {}).slots == 10
    with pytest.raises(SettingsError, match="--slots and --expert-vram"):
        resolve_settings({"slots": 10, "expert_vram": 4.0}, {})


def test_unknown_flag_key():
    with pytest.raises(SettingsError, match="bogus"):
        resolve_settings({"bogus": 1}, {})


def test_frozen():
    s = resolve_settings({}, {})
    with pytest.raises(AttributeError):
        s.prefetch = "on"  # type: ignore[misc]


def test_device_and_dtype_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto = Settings()
    assert (auto.torch_device(), auto.torch_dtype(), auto.use_graph()) == (
        torch.device("cpu"), torch.float32, False)
    assert Settings(dtype="bfloat16").torch_dtype() == torch.bfloat16
    with pytest.raises(SettingsError, match="--device cuda"):  # a usage error: exit 2
        Settings(device="cuda").torch_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (auto.torch_device(), auto.torch_dtype(), auto.use_graph()) == (
        torch.device("cuda"), torch.bfloat16, True)
    assert Settings(device="cuda", dtype="float32").torch_dtype() == torch.float32
    assert Settings(graph=False).use_graph() is False
