"""Programmatic dependent launch (ftchat.kernels.pdl_launch, KernelConfig.pdl, sync.pdl_wait /
pdl_release).

The decode kernels launch with PDL on sm_90+: each may start while the previous kernel drains,
issues its weight loads, and waits for the previous kernel before it reads activations or writes.
A wait placed wrong shows as a race: other bits than the launch without PDL, or bits that move
between replays. So the test decodes the same prompts with PDL on and off, each in its own
captured graph (the weights' KernelConfig: pdl on or off), and eagerly with PDL on, and asks for
the same tokens and logits bit for bit, on the tiny model (every kernel family: GDN, QSA, HC,
MoE, NVFP4 dense projections at bs 1 and bs 2) and replayed twice. The on arm is checked to
launch with PDL at all (else the comparison would be vacuous). CUDA only: PDL does not exist in the Triton
interpreter (pdl_launch gives PDL False there, checked on the CPU too).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ftchat.engine import generate, resident_backend
from ftchat.kernels import pdl_launch
from ftchat.kernels.config import KernelConfig
from tests.kernel_inputs import needs_hopper as hopper_marker

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
needs_hopper = hopper_marker("PDL")
PROMPTS = [[3, 17, 99, 4, 250, 31, 7, 507], [9, 120, 44, 2, 300, 8, 61, 5]]
STEPS = 24


def test_no_pdl_off_the_gpu_or_when_switched_off():
    assert pdl_launch(torch.zeros(1), True) == {"PDL": False}
    if CUDA:
        assert pdl_launch(torch.zeros(1, device="cuda"), False) == {"PDL": False}


def _run(m, batch, graph: bool, pdl: bool):
    m = dataclasses.replace(m, weights=m.weights.with_kernels(KernelConfig(pdl=pdl)))
    steps = list(generate(m, batch, STEPS, resident_backend(m), graph=graph))
    return [s.tokens for s in steps], torch.stack([s.logits for s in steps]).cpu()


@needs_hopper
@pytest.mark.parametrize("rows", [1, 2])
def test_pdl_changes_no_bit(rows):
    from ftchat.model.synth_memory import synthetic_model

    m = synthetic_model("tiny", 4, "nvfp4-modelopt", "cuda", torch.bfloat16, dense="nvfp4")
    assert pdl_launch(torch.zeros(1, device="cuda"), True) == {"PDL": True, "launch_pdl": True}
    batch = PROMPTS[:rows]
    tok_off, log_off = _run(m, batch, graph=True, pdl=False)
    tok_on, log_on = _run(m, batch, graph=True, pdl=True)
    tok_eager, log_eager = _run(m, batch, graph=False, pdl=True)
    tok_again, log_again = _run(m, batch, graph=True, pdl=True)
    assert tok_on == tok_off == tok_eager == tok_again
    for log in (log_on, log_eager, log_again):
        assert torch.equal(log.view(torch.int16), log_off.view(torch.int16))
