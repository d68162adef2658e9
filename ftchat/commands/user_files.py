"""The files and folders a user names on the command line: the one prompt of `--file` (run,
audit) and the new folder `ftchat synth OUT` writes; each problem one line naming the path."""

from __future__ import annotations

import os
from pathlib import Path

from ftchat.errors import FtchatError, UsageError
from ftchat.sizes import MAX_LINE_BYTES


def read_prompt_file(path: Path) -> str:
    """FILE of `--file FILE` as text (UTF-8, at most MAX_LINE_BYTES, one final newline off)."""
    where = f"--file {path}"
    try:
        if path.is_char_device() or path.is_block_device():  # /dev/zero would never end
            raise FtchatError(f"{where}: is a device, not a file")
        with path.open("rb") as f:
            data = f.read(MAX_LINE_BYTES + 1)  # a FIFO (`-f <(cmd)`) is read to its end
        if len(data) > MAX_LINE_BYTES:
            raise FtchatError(f"{where}: larger than {MAX_LINE_BYTES >> 20} MiB, more than "
                              "any context holds")
    except FileNotFoundError:
        raise FtchatError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise FtchatError(f"{where}: is a folder, not a file") from None
    except OSError as e:
        raise FtchatError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FtchatError(f"{where}: not UTF-8 text ({e})") from None
    if not text.strip():  # as --prompt '', but naming the file the prompt came from
        raise UsageError(f"{where}: the file has no text; expected a prompt with some text in it")
    return text.removesuffix("\n")


def new_folder_parents(out: Path) -> list[Path]:
    """Check that `out` can become a new folder; create its missing parents and return them
    (outermost first), so that a failed write can remove them again."""
    new = "synth writes a new folder: give a path that does not exist yet"
    if out.is_symlink() or out.exists():
        if not out.is_dir():
            raise FtchatError(f"{out}: exists and is not a folder; {new}")
        if any(out.iterdir()):
            raise FtchatError(f"{out}: exists and is not empty; {new}")
        return []
    missing = []
    parent = out.absolute().parent
    while not parent.exists() and not parent.is_symlink():
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise FtchatError(f"{out}: {parent} is not a folder; give a path inside a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FtchatError(f"{out}: no permission to write in {parent}; choose another folder")
    created: list[Path] = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except OSError as e:
            remove_empty(created)
            raise FtchatError(f"{out}: cannot create the folder {folder} ({e.strerror or e}); "
                              "choose a folder on a writable disk") from None
        created.append(folder)
    return created


def remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            pass
