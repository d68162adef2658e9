"""What the engine, the checkpoint reader and the VRAM plan need of a model family: one Family
per family, listed in ftchat/model/registry.py (a family's modules import neither)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from ftchat.vram.items import Item, Workload

Args = Any  # the family's ModelArgs (HF config.json field names)


@dataclass(frozen=True)
class MemoryFormulas:
    """The family's terms of the VRAM plan; ftchat/vram/plan.py adds the offload backend's and
    the routed experts' (docs/design.md 4.9)."""

    # (args, dtype, cuda, dense_nvfp4) -> the dense weights as the loader leaves them (exact)
    dense_items: Callable[[Args, torch.dtype, bool, bool], list[Item]]
    # (args, dtype, workload) -> the decode state of every decoder (exact)
    state_items: Callable[[Args, torch.dtype, Workload], list[Item]]
    # (args, act, rows, context) -> a decode step's transients by term
    decode_terms: Callable[[Args, int, int, int], dict[str, int]]
    # (args, act, T, L, cuda, dense_nvfp4, fp8, dtype) -> each block's prefill peak
    prefill_blocks: Callable[[Args, int, int, int, bool, bool, bool, torch.dtype],
                             dict[str, int]]
    # (args, act) -> bytes per token held across every block of a layer
    stream_bytes: Callable[[Args, int], int]
    # (args, context) -> the KV lengths where a prefill call peaks
    prefill_lengths: Callable[[Args, int], tuple[int, ...]]

    @classmethod
    def of(cls, module: Any) -> MemoryFormulas:
        """The functions of a family's memory module (qwen4_exp_memory.py, ...) of these names."""
        return cls(**{f.name: getattr(module, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # the config.json model_type values it reads
    args_type: type  # its ModelArgs
    parse_config: Callable[[dict, str], Args]  # (config.json, its path for errors) -> args
    # the checkpoint's tensors (docs/model.md 1.2): dense name -> TensorSpec, expert projection
    # -> [n, k], and the name of (layer, expert, projection)
    dense_specs: Callable[[Args], dict]
    expert_specs: Callable[[Args], dict[str, tuple[int, int]]]
    expert_name: Callable[[int, int, str], str]
    # (dense tensors by name, num_layers, KernelConfig) -> the Weights forward reads
    weights: Callable[..., Any]
    # (tokens, pos, weights, state, rows, experts, args, kv_len, logits_at) -> logits or None
    forward: Callable[..., Tensor | None]
    # (args, batch, max_len, device, dtype, kv_dtype) -> a zeroed decode state
    new_state: Callable[..., Any]
    routers: Callable[[Any, Args], list[Tensor]]  # (weights, args) -> router weight per layer
    attention_layers: Callable[[Args], frozenset[int]]  # layers whose mixer is attention
    memory: MemoryFormulas
    describe: Callable[[Args], list[str]]  # `ftchat info`'s layers, pattern and geometry lines
