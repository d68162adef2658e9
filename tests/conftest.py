"""Shared fixtures: synthetic checkpoints written once per session."""

from __future__ import annotations

import signal

import pytest
import torch

from ftchat.model.synth import write_checkpoint


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-bf16", "tiny", fmt="bf16", seed=0)


@pytest.fixture(scope="session")
def tiny_nvfp4(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-nvfp4", "tiny",
                            fmt="nvfp4-modelopt", seed=1)


@pytest.fixture(scope="session")
def tiny_ct(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-ct", "tiny", fmt="nvfp4-ct", seed=1)


# A run started from a background job (`cmd &` in a script, nohup) inherits SIGINT ignored, and
# its children keep an ignored signal across exec: the Ctrl-C tests' ftchat processes would never
# see theirs. A handler here (Python's own) is reset to the default in every child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Two cores in CI: intra-op threads fight each other and the other test workers (an index_add_
# took 14 ms instead of microseconds under contention), so the tests run single-threaded.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def qwen3_folders(tmp_path_factory):
    """family -> a tiny checkpoint of it written by transformers (tests/qwen3_checkpoints.py)."""
    from tests.qwen3_checkpoints import FAMILIES, write_hf_checkpoint

    root = tmp_path_factory.mktemp("qwen3")
    return {f: write_hf_checkpoint(root / f, f, seed=i) for i, f in enumerate(FAMILIES)}
