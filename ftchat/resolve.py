"""MODEL argument -> a local checkpoint folder: a path, a Hugging Face repo id, or the demo model.

With no MODEL, ftchat runs the demo model: the trained one shipped inside the package when it is
there (`ftchat/models/demo`), else a tiny random-weight checkpoint written once into the user
cache folder, so a fresh install runs end to end with no download. `default_model_path` is the
one place that decides which.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ftchat.errors import FtchatError, ModelError
from ftchat.model.config import not_a_model_folder
from ftchat.model.synth import write_checkpoint

# Only what ftchat reads: config, generation config, tokenizer files, safetensors shards + index.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DEMO_NAME = "demo-tiny"
SHIPPED_DEMO = Path(__file__).parent / "models" / "demo"
RANDOM_NOTICE = ("demo model: a tiny synthetic checkpoint with RANDOM weights, so replies are "
                 "noise; pass MODEL (a folder or a Hugging Face repo id) to chat with a real model")
TRAINED_NOTICE = ("demo model: a small qwen4_exp trained for minutes on Python sources and a few "
                  "chat examples, so expect code-flavoured text, not reliable answers; pass MODEL "
                  "(a folder or a Hugging Face repo id) to chat with a real model")


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    name: str  # what the user typed, or "demo"
    demo: bool = False


def cache_dir(env: Mapping[str, str]) -> Path:
    """ftchat's user cache folder: $XDG_CACHE_HOME/ftchat, else ~/.cache/ftchat."""
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ftchat"


def default_model_path(env: Mapping[str, str]) -> Path:
    """The demo model: the shipped trained one, else the random one (written on first use)."""
    if (SHIPPED_DEMO / "config.json").is_file():
        return SHIPPED_DEMO
    path = cache_dir(env) / DEMO_NAME
    if not (path / "config.json").is_file():
        _write_demo(path)
    return path


def demo_notice(path: Path) -> str:
    """The banner line for the demo model at `path`."""
    return TRAINED_NOTICE if path == SHIPPED_DEMO else RANDOM_NOTICE


def _write_demo(path: Path) -> None:
    try:
        write_checkpoint(path, "tiny", fmt="nvfp4-modelopt", seed=0)
    except (FtchatError, OSError) as e:
        # Another ftchat may have written it meanwhile: its atomic rename leaves a whole folder.
        if not (path / "config.json").is_file():
            raise ModelError(f"cannot write the demo model to {path}: {e}") from None


def resolve_model(model: str | None, env: Mapping[str, str]) -> ResolvedModel:
    """A local folder for `model` (None: the demo model).

    Args:
        model: a folder, or an HF repo id `owner/name` fetched with snapshot_download.
        env: the process environment (HF_HUB_OFFLINE, HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME).
    Raises:
        ModelError: missing folder, or a repo that is neither cached nor downloadable.
    """
    if model is None:
        return ResolvedModel(default_model_path(env), "demo", demo=True)
    if not model.strip():  # Path("") is the current folder: it would be named ""
        raise ModelError(f"MODEL {model!r} is empty: give a checkpoint folder or a Hugging Face "
                         "repo id (or no MODEL for the demo model)")
    path = Path(model).expanduser()
    if path.is_dir():
        return _model_folder(path, model)
    if path.exists():
        raise ModelError(f"{model}: not a folder (MODEL is a checkpoint folder or a repo id)")
    if not REPO_ID.match(model) or model.startswith((".", "/", "~")):
        raise ModelError(f"{model}: no such model folder")
    return _model_folder(_snapshot(model, _offline(env), _hub_cache(env)), model)


def _model_folder(path: Path, name: str) -> ResolvedModel:
    # Checked here, first, so that every command says the same (not a missing tokenizer.json).
    if not (path / "config.json").is_file():
        raise not_a_model_folder(name)
    _check_files(path)
    return ResolvedModel(path, name)


def _check_files(folder: Path) -> None:
    """Every file of a model folder is a regular file ftchat can read: a FIFO would block the
    load forever, an unreadable file fail it halfway."""
    try:
        entries = list(folder.iterdir())
    except OSError as e:
        raise ModelError(f"{folder}: cannot list the folder ({e.strerror or e})") from None
    for entry in entries:
        try:
            mode = entry.stat().st_mode
        except OSError as e:  # a dangling link (a cache whose blob was deleted)
            raise ModelError(f"{entry}: cannot read it ({e.strerror or e}); download the model "
                             "again") from None
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            raise ModelError(f"{entry}: not a regular file (a FIFO, socket or device); a model "
                             "folder holds files only")
        if not os.access(entry, os.R_OK):
            raise ModelError(f"{entry}: no permission to read it")


def _offline(env: Mapping[str, str]) -> bool:
    return env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_cache(env: Mapping[str, str]) -> str | None:
    # Passed explicitly: huggingface_hub reads its variables once, when it is first imported.
    if env.get("HF_HUB_CACHE"):
        return env["HF_HUB_CACHE"]
    return str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None


def _snapshot(repo: str, offline: bool, cache: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    how = f"run `hf download {repo}` on a machine with network, or pass a local folder"
    try:
        return Path(snapshot_download(repo, allow_patterns=ALLOW_PATTERNS,
                                      local_files_only=offline, cache_dir=cache))
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if offline else "the Hub is unreachable"
        raise ModelError(f"{repo}: not a local folder, and not in the Hugging Face cache "
                         f"({where}): {how}") from None
    except GatedRepoError:
        raise ModelError(f"{repo}: gated repository: accept its terms on huggingface.co and "
                         "log in with `hf auth login`") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelError(f"{repo}: no such Hugging Face repository (or it is private), "
                         "and no such local folder") from None
    except ValueError as e:  # HFValidationError: not a valid repo id
        raise ModelError(f"{repo}: no such model folder, nor a valid repo id ({_first_line(e)})"
                         ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelError(f"{repo}: download failed ({_first_line(e)}): {how}") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
