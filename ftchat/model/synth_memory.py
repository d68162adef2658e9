"""The `ftchat synth` model built in memory: what engine.load_model returns for the checkpoint,
without the checkpoint (bench at 48 layers: ~68 GB of expert rows, more than the disk holds).

Dense weights go straight to the device, routed experts straight into one preallocated host
tensor [L*E, R] uint8, layer by layer: nothing is held twice and nothing touches the disk.
The tensors come from synth.generate, the stream the checkpoint writer consumes, and go through
the conversions load_model applies (stored bf16, then the model dtype; PLE shards concatenated;
expert parts packed into RowLayout rows).

Drawing from a CPU generator (the default on the CPU) gives the checkpoint's values bit for bit.
It is serial (torch's mt19937): 30-70 flash-next NVFP4 experts/s measured on the dev box, so
6-14 min for 48 x 512. Drawing on the device (the default on CUDA) runs the same stream from the
device's generator: the same tensors and distributions, deterministic per seed, other values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ftchat.codecs import nvfp4
from ftchat.codecs.nvfp4 import Nvfp4Weight
from ftchat.codecs.rows import RowLayout
from ftchat.engine import LoadedModel
from ftchat.errors import FtchatError
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.model import embedding, synth
from ftchat.model.config import ModelArgs
from ftchat.model.registry import family_of
from ftchat.model.synth import DenseTensor, ExpertTensors, model_args, row_layout
from ftchat.sizes import PLE_ON_DEVICE_BYTES

SHARD = ".ngram_embedding.shard_"


def synthetic_model(preset: str, layers: int | None = None, fmt: str = "bf16",
                    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    seed: int = 0, progress: Callable[[str, int, int], None] | None = None,
                    rng: str | torch.device | None = None, dense: str = "bf16",
                    kernels: KernelConfig = DEFAULT) -> LoadedModel:
    """The model `ftchat synth --preset P --layers N --format F --seed S --dense D` writes, as
    engine.load_model(folder, device, dtype) would return it (dense "nvfp4": the GDN qkv and z
    projections quantized and kept in NVFP4, as load_model keeps them).

    rng: where the generator draws; None = `device`. "cpu" reproduces the checkpoint bit for
    bit (any target device); a CUDA rng is fast but draws other values (see the module doc).
    progress: called as ("layers", done, total) after each layer's experts.
    """
    synth.check_dense(dense, fmt)
    args = model_args(preset, layers, fmt)
    device = torch.device(device)
    gen = torch.Generator(device=torch.device(rng) if rng is not None else device).manual_seed(seed)
    layout = row_layout(args, fmt)
    host = _host_rows(args, layout)
    stage_on = None if gen.device.type == "cpu" else gen.device
    rows = _RowWriter(host, layout, args.num_experts, stage_on)
    dense_w: dict[str, Tensor | Nvfp4Weight] = {}
    shards: dict[str, list[Tensor]] = {}  # table name -> its shards as stored
    head = None
    for item in synth.generate(args, fmt, gen):
        if isinstance(item, ExpertTensors):
            if rows.put(item) and progress:
                progress("layers", item.layer + 1, args.num_hidden_layers)
        elif SHARD in item.name:
            shards.setdefault(item.name.split(SHARD)[0] + ".ngram_embedding.weight", []).append(
                item.tensor)
        elif item.name == synth.LM_HEAD:
            head = item.tensor.to(device, dtype)
        elif synth.quantized_dense(item.name, dense):
            dense_w[item.name] = _nvfp4(item, fmt).to(device)
        else:
            dense_w[item.name] = _place(item, device, dtype)
    # load_model's order: dense in spec order, then the n-gram tables, then lm_head
    for name, parts in shards.items():
        dense_w[name] = _table(parts, device, dtype)
    dense_w[synth.LM_HEAD] = head
    if embedding.host_placement(device):  # as load_model
        dense_w[embedding.EMBED] = embedding.to_host(dense_w[embedding.EMBED])
    weights = family_of(args).weights(dense_w, args.num_hidden_layers, kernels)
    return LoadedModel(args, weights, layout, host, device, dtype)


def _place(item: DenseTensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Checkpoint.dense's cast: int64 buffers kept, floats from stored bf16 to dtype."""
    t = item.tensor
    return t.to(device) if t.dtype == torch.int64 else t.to(device, dtype)


def _nvfp4(item: DenseTensor, fmt: str) -> Nvfp4Weight:
    """The weight as the checkpoint writer quantizes it and load_model reads it back (through
    the dialect's stored global, so a compressed-tensors 1/g round trip is the same too)."""
    base = item.name[: -len(".weight")]
    stored = nvfp4.to_checkpoint(fmt, base, *nvfp4.quantize(item.tensor.float()))
    return Nvfp4Weight.of(*nvfp4.from_checkpoint(fmt, stored.__getitem__, base))


def _table(parts: list[Tensor], device: torch.device, dtype: torch.dtype) -> Tensor:
    """The n-gram table [rows, width]: on the device as load_model puts a small one; one over
    PLE_ON_DEVICE_BYTES (load_model leaves it in its files) stays in host memory."""
    t = torch.cat([p.to(dtype) for p in parts])
    small = t.numel() * t.element_size() <= PLE_ON_DEVICE_BYTES
    return t.to(device if small else torch.device("cpu"))


def _host_rows(a: ModelArgs, layout: RowLayout) -> Tensor:
    """rows [L*E, R] uint8, unfilled; refuses what the host cannot hold."""
    n = a.num_hidden_layers * a.num_experts
    need = n * layout.nbytes
    avail = _mem_available()
    if avail is not None and need > avail:
        raise FtchatError(f"the expert rows need {need / 2**30:.1f} GiB of host memory and "
                          f"{avail / 2**30:.1f} GiB are available: use fewer --layers")
    return torch.empty(n, layout.nbytes, dtype=torch.uint8)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gaps(layout: RowLayout) -> list[tuple[int, int]]:
    """Byte ranges of a row that no part covers (alignment padding): RowLayout.pack zeroes them."""
    out, pos = [], 0
    for p in layout.parts:
        if p.offset > pos:
            out.append((pos, p.offset))
        pos = p.offset + p.nbytes
    if layout.nbytes > pos:
        out.append((pos, layout.nbytes))
    return out


class _RowWriter:
    """Packs each expert into its row, as RowLayout.pack would (Checkpoint.expert_rows).

    The parts land in the host rows directly, or (stage_on: the generator's device) in a staging
    block [E, R] there, copied to the host once per layer."""

    def __init__(self, host: Tensor, layout: RowLayout, num_experts: int,
                 stage_on: torch.device | None = None):
        self.host, self.layout, self.E = host, layout, num_experts
        self.stage = None
        if stage_on is not None:  # zeroed once: the parts overwrite the same bytes each layer
            self.stage = torch.zeros(num_experts, layout.nbytes, dtype=torch.uint8,
                                     device=stage_on)
        self.layer, self.views = -1, {}

    def _block(self, layer: int) -> Tensor:
        """[E, R] the rows of `layer` are written into."""
        if self.stage is not None:
            return self.stage
        return self.host[layer * self.E : (layer + 1) * self.E]

    def put(self, item: ExpertTensors) -> bool:
        """Write one expert; True when it completed its layer."""
        if item.layer != self.layer:
            self.layer = item.layer
            block = self._block(item.layer)
            self.views = {p.name: self.layout.view(block, p.name) for p in self.layout.parts}
        _pack(self.views, item.index, item.parts, self.layout)
        if item.index < self.E - 1:
            return False
        dst = self.host[item.layer * self.E : (item.layer + 1) * self.E]  # [E, R]
        if self.stage is None:
            for a, b in _gaps(self.layout):
                dst[:, a:b].zero_()
        else:
            dst.copy_(self.stage)
        return True


def _pack(v: dict[str, Tensor], e: int, parts: dict, layout: RowLayout) -> None:
    """Expert e's parts into row e of the part views v (name -> [E, *shape]); gate rows first
    in gate_up, then up rows (Checkpoint._expert_parts)."""
    I = layout.inter
    gate, up, down = parts["gate_proj"], parts["up_proj"], parts["down_proj"]
    if layout.kind != "nvfp4":  # bf16 [n, k] each
        v["gate_up"][e, :I] = gate
        v["gate_up"][e, I:] = up
        v["down"][e] = down
        return
    # NVFP4: (packed [n, k/2] u8, block scale [n, k/16] e4m3, global fp32 []) each;
    # the global is a per-row vector in the row (float(g) is exact: fp32 -> fp64 -> fp32)
    for suffix, j in (("", 0), ("_scale", 1)):
        v["gate_up" + suffix][e, :I] = gate[j]
        v["gate_up" + suffix][e, I:] = up[j]
        v["down" + suffix][e] = down[j]
    v["gate_up_global"][e, :I].fill_(float(gate[2]))
    v["gate_up_global"][e, I:].fill_(float(up[2]))
    v["down_global"][e].fill_(float(down[2]))
