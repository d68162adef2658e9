"""The PLE n-gram table in host memory (docs/model.md section 7.4): read in place from its
memory-mapped shards (`NGramTable`, the CPU path), or loaded whole into one host tensor in its
stored dtype (`HostTable`, the CUDA path: pinned, read by the gather kernel over UVA).

The real table is 320 M rows x 160 (47.7 GiB in fp8 with one scalar scale, or 95 GiB in bf16),
split into `split_ngram_parts` equal row shards. A decode token reads 16 rows. Both readers give
the values `ftchat.kernels.ple_gather.dequantize` gives: stored -> fp32, x scale, -> model dtype.
Legend: n rows asked, d row width, N table rows, S shards.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ftchat.errors import ModelError
from ftchat.kernels import ple_gather
from ftchat.kernels.config import DEFAULT, KernelConfig

DTYPES = {"BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2), "F32": (torch.float32, 4),
          "F8_E4M3": (torch.float8_e4m3fn, 1)}
READ_CHUNK = 64 << 20  # bytes per read call while loading a shard


def tensor_extent(path: Path, name: str) -> tuple[int, str, list[int]]:
    """(byte offset of the data in the file, dtype code, shape) from the safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.get(name)
    if meta is None:
        raise ModelError(f"{path}: tensor {name} missing")
    return 8 + n + meta["data_offsets"][0], meta["dtype"], meta["shape"]


@dataclass(frozen=True)
class Shards:
    """Where the table's shards lie: files[i] holds rows [i*rows, (i+1)*rows) at offsets[i]."""

    files: list[Path]
    offsets: list[int]
    stored: torch.dtype  # the one stored dtype of every shard
    rows: int  # rows per shard
    width: int  # d

    @property
    def shard_bytes(self) -> int:
        return self.rows * self.width * torch.empty((), dtype=self.stored).element_size()


def shard_extents(shards: list[tuple[Path, str]]) -> Shards:
    """The shards' places from their headers; one dtype and one shape for all (section 11.4)."""
    files, offsets, stored, shape = [], [], None, None
    for path, name in shards:
        offset, code, sh = tensor_extent(path, name)
        if code not in DTYPES:
            raise ModelError(f"{path}: tensor {name} has dtype {code}; expected bf16/f16/f32/fp8")
        if shape not in (None, sh) or stored not in (None, DTYPES[code][0]):
            raise ModelError(f"{path}: n-gram shards of unequal sizes or dtypes")
        files.append(path)
        offsets.append(offset)
        stored, shape = DTYPES[code][0], sh
    return Shards(files, offsets, stored, shape[0], shape[1])


class NGramTable:
    """Row-sharded table read in place; `table[rows]` gathers rows [...] -> [..., d] in `dtype`
    on the CPU. Only the pages of the rows asked are read (the CPU path: no 48 GiB in RAM)."""

    device = torch.device("cpu")

    def __init__(self, shards: list[tuple[Path, str]], scale: float | None, dtype: torch.dtype):
        ex = shard_extents(shards)
        self.scale, self.dtype, self.stored = scale, dtype, ex.stored
        self.rows_per_shard, self.width = ex.rows, ex.width
        size = ex.shard_bytes // (ex.rows * ex.width)
        self.maps = [np.memmap(p, dtype=np.uint8, mode="r", offset=o,
                               shape=(ex.rows, ex.width * size))
                     for p, o in zip(ex.files, ex.offsets, strict=True)]
        self.num_rows = self.rows_per_shard * len(self.maps)

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.width

    def __getitem__(self, rows: Tensor) -> Tensor:
        flat = rows.reshape(-1).cpu().numpy()  # [n]
        shard, local = np.divmod(flat, self.rows_per_shard)
        out = torch.empty(flat.shape[0], self.width, dtype=self.dtype)
        for s in np.unique(shard):
            hit = np.nonzero(shard == s)[0]
            raw = torch.from_numpy(np.ascontiguousarray(self.maps[s][local[hit]]))  # [k, d*size]
            out[torch.from_numpy(hit)] = ple_gather.dequantize(raw.view(self.stored), self.scale,
                                                               self.dtype)
        return out.reshape(*rows.shape, self.width)


class HostTable:
    """The whole table in one host tensor `data` [N, d] in its stored dtype, plus the scalar
    scale. On CUDA `data` is pinned (engine.load_model) and `gather` reads it with the Triton
    kernel over UVA; elsewhere (CPU, no Triton) the torch reference gathers it. The pinning
    ends when `data` is collected (ftchat/host_memory.py)."""

    device = torch.device("cpu")

    def __init__(self, data: Tensor, scale: float | None, dtype: torch.dtype):
        self.data, self.scale, self.dtype = data, scale, dtype

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def __getitem__(self, rows: Tensor) -> Tensor:
        """rows [...] -> [..., d] in the model dtype on the CPU (the reference, as NGramTable)."""
        return ple_gather.dequantize(self.data[rows.cpu()], self.scale, self.dtype)

    def gather(self, rows: Tensor, dtype: torch.dtype, *, kc: KernelConfig = DEFAULT) -> Tensor:
        """E [..., nh*d] in dtype on rows' device for rows [..., nh] (kernel or reference)."""
        return ple_gather.gather(self.data, self.scale, rows, dtype, kc=kc)

    def sync_free(self, device: torch.device, dtype: torch.dtype,
                  kc: KernelConfig = DEFAULT) -> bool:
        """Whether `gather` on `device` runs without a host sync (so a CUDA graph can hold it):
        on the CPU, or with the kernel (pinned data, CUDA + Triton, fused kernels on in kc)."""
        if device.type == "cpu":
            return True
        probe = torch.empty(0, dtype=torch.int64, device=device)
        return ple_gather.fused(self.data, probe, dtype, kc)


def load_host_table(shards: list[tuple[Path, str]], scale: float | None, dtype: torch.dtype,
                    progress: Callable[[int, int], None] | None = None) -> HostTable:
    """Read every shard into its rows of one host tensor [S*rows, d] in the stored dtype;
    progress(i, S) after shard i. Each shard's bytes go from the file straight into their rows
    (no shard tensor in between, so the table is never held twice), and its page cache is
    dropped after it is read (the 48 GiB would otherwise sit in RAM twice until evicted)."""
    ex = shard_extents(shards)
    data = page_tensor((ex.rows * len(ex.files), ex.width), ex.stored)  # [N, d]
    by_shard = data.view(torch.uint8).view(len(ex.files), ex.shard_bytes)  # [S, bytes]
    for i, (path, offset) in enumerate(zip(ex.files, ex.offsets, strict=True)):
        _read_into(path, offset, by_shard[i].numpy())
        if progress:
            progress(i + 1, len(ex.files))
    return HostTable(data, scale, dtype)


def page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An empty host tensor on pages of its own (a private anonymous mapping, huge pages asked
    for): cudaHostRegister locks whole pages, and a range sharing a page with another pinned
    buffer (small tables, tests) would be refused as already registered."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults and pages to lock (48 GiB)
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)  # keeps buf


def _read_into(path: Path, offset: int, buf: np.ndarray) -> None:
    """buf's bytes from `path` at `offset`; a short file is a ModelError."""
    view = memoryview(buf).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done : done + READ_CHUNK])
            if not n:
                raise ModelError(f"{path}: file ends inside an n-gram shard ({done} of "
                                 f"{len(view)} bytes); it is incomplete: download it again")
            done += n
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), offset, len(view), os.POSIX_FADV_DONTNEED)
