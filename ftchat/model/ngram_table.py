"""The PLE n-gram table read in place: memory-mapped safetensors shards, rows gathered per token.

The real table is 320 M rows x 160 (47.7 GiB in fp8 with one scalar scale, or 95 GiB in bf16),
split into `split_ngram_parts` shards; loading it whole would need that much RAM. A decode token
reads 16 rows. Legend: n rows asked, d row width.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ftchat.errors import ModelError

DTYPES = {"BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2), "F32": (torch.float32, 4),
          "F8_E4M3": (torch.float8_e4m3fn, 1)}


def tensor_extent(path: Path, name: str) -> tuple[int, str, list[int]]:
    """(byte offset of the data in the file, dtype code, shape) from the safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.get(name)
    if meta is None:
        raise ModelError(f"{path}: tensor {name} missing")
    return 8 + n + meta["data_offsets"][0], meta["dtype"], meta["shape"]


class NGramTable:
    """Row-sharded table; `table[rows]` gathers rows [...] -> [..., d] in `dtype` on the CPU."""

    device = torch.device("cpu")

    def __init__(self, shards: list[tuple[Path, str]], scale: float | None, dtype: torch.dtype):
        self.maps, self.rows_per_shard, self.scale, self.dtype = [], None, scale, dtype
        for path, name in shards:
            offset, code, shape = tensor_extent(path, name)
            if code not in DTYPES:
                raise ModelError(f"{path}: tensor {name} has dtype {code}; expected bf16/f16/f32/fp8")
            tdtype, size = DTYPES[code]
            rows, width = shape
            mm = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(rows, width * size))
            self.maps.append((mm, tdtype))
            if self.rows_per_shard not in (None, rows):
                raise ModelError(f"{path}: n-gram shards of unequal sizes")
            self.rows_per_shard, self.width = rows, width
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
            mm, tdtype = self.maps[s]
            raw = torch.from_numpy(np.ascontiguousarray(mm[local[hit]]))  # [k, d*size] bytes
            vals = raw.view(tdtype).float()
            if self.scale is not None:
                vals = vals * self.scale
            out[torch.from_numpy(hit)] = vals.to(self.dtype)
        return out.reshape(*rows.shape, self.width)
