"""The kernel configuration: which kernels the decoder runs and how they launch.

Built once at start-up from the settings (`Settings.kernels` and `Settings.pdl`, the --kernels
and PDL flags: `KernelConfig.from_settings`), held by the dense weights (model/qwen4_exp.py
`Weights.kernels`) and by the expert backends, and passed to every kernel call as `kc`. A bench
arm builds its own (ftchat/commands/bench.py); nothing changes one once built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from ftchat.kernels import HAS_TRITON
from ftchat.kernels.skip import Skip

if TYPE_CHECKING:
    from ftchat.settings import Settings


@dataclass(frozen=True)
class KernelConfig:
    # the Triton kernels on CUDA; False: the torch path there too, but for the routed experts'
    # decode kernels (the torch form syncs the host) and the token embedding's gather from
    # pinned host memory (it has no torch form)
    fused: bool = True
    pdl: bool = True  # launch the decode kernels with programmatic dependent launch (sm_90+)
    skip: Skip | None = None  # kernel families left out of the step: bench's skip= arms only

    @classmethod
    def from_settings(cls, s: Settings) -> KernelConfig:
        return cls(fused=s.kernels == "fused", pdl=s.pdl)

    def runs_fused(self, t: Tensor) -> bool:
        """Whether the Triton kernels run on tensor t's device: fused on, CUDA, Triton present."""
        return self.fused and HAS_TRITON and t.is_cuda


DEFAULT = KernelConfig()  # the settings' defaults: what a call given no config runs
