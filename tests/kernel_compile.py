"""Kernels compiled for sm_90 without a GPU: a wrapper's launches recorded instead of run
(`Recorder`), then compiled as those launches would compile them (`compile_ptx`). Needs Triton
(its ptxas included), not CUDA: tests that use it skip where Triton is not installed."""

from __future__ import annotations

import pytest
import torch


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16",
          torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl")


def compile_ptx(fn, args: tuple, kwargs: dict) -> str:
    # the kernel as a launch with these arguments would compile it for sm_90: its PTX (the
    # cubin is built too, so ptxas checks it)
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    values = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items()
                                               if k not in _OPTIONS}
    signature, constexprs = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            signature[p.name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "enable_fp_fusion") if k in kwargs}
    compiled = triton.compile(ASTSource(fn, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]
