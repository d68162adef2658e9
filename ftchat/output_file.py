"""A result file written under a temporary name in its own folder and renamed into place only
when complete (`OutputFile`): a run that fails or is stopped leaves no half-written file, and an
existing file is replaced only when the user asked for it (`--force`).

A leaf: nothing here imports the rest of ftchat but its errors.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import TextIO

from ftchat.errors import FtchatError


def check_target(path: str | Path, flag: str, force: bool) -> Path:
    """Refuse, before any work, an output path that cannot be written or would overwrite a file
    the user did not say to replace. Returns the path."""
    p = Path(path)
    where = f"{flag} {path}"
    if str(path) == "" or str(path).endswith(os.sep):
        raise FtchatError(f"{where}: expected a file name")
    try:
        st = p.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise FtchatError(f"{where}: cannot use it ({e.strerror or e})") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise FtchatError(f"{where}: is a folder; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise FtchatError(f"{where}: exists and is not a regular file (a device, FIFO or "
                              "socket); give a new file name")
        if not force:
            raise FtchatError(f"{where}: exists; give a new file name, or --force to replace it")
    parent = p.absolute().parent
    if not parent.is_dir():
        raise FtchatError(f"{where}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FtchatError(f"{where}: no permission to write in {parent}")
    return p


def check_outside(path: str | Path, folder: Path, flag: str) -> None:
    """Refuse an existing file of `folder` (the model the run reads) as the output: --force
    would replace a file of the model itself."""
    p = Path(path)
    if not p.exists():
        return  # a new file: nothing of the model is replaced
    real = Path(os.path.realpath(p.absolute().parent))  # the parent: a snapshot's files link out
    if real == Path(os.path.realpath(folder)) or Path(os.path.realpath(folder)) in real.parents:
        raise FtchatError(f"{flag} {path}: a file of the model folder {folder}; give a file "
                          "outside it")


class OutputFile:
    """A text file written as `<folder>/.<name>.<random>.tmp` and renamed to `path` by `commit`;
    `discard` removes the temporary file. Either one closes it; the second call does nothing."""

    def __init__(self, path: str | Path, flag: str, force: bool = False):
        self.path = check_target(path, flag, force)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp",
                                   dir=self.path.absolute().parent)
        self.tmp = Path(tmp)
        os.chmod(fd, 0o666 & ~_umask())  # as open() would create it, not mkstemp's 0600
        self.file: TextIO = os.fdopen(fd, "w", encoding="utf-8", buffering=1)
        self.done = False

    def write(self, text: str) -> None:
        self.file.write(text)

    def commit(self) -> None:
        if self._finish():
            try:
                self.file.close()
                os.replace(self.tmp, self.path)
            except OSError:
                self._remove()
                raise

    def discard(self) -> None:
        if self._finish():
            with contextlib.suppress(OSError):
                self.file.close()
            self._remove()

    def _finish(self) -> bool:
        """Mark the file done; False when it already was (commit or discard ran)."""
        if self.done:
            return False
        self.done = True
        return True

    def _remove(self) -> None:
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
