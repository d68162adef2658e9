"""GPU tier: `sync.co_resident` and `sync.grid_barrier`.

The grid barrier of the one-launch HC read spins until every program of the launch has arrived:
a launch of more programs than the GPU holds at once never ends. Session 19's first run of the
one-launch tests stopped at a timeout; these tests check the count against the hardware's limits
and run the barrier at exactly that count, each in a child process under a timeout, so that a
hang is a failure and not a stalled tier."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# a child process: a kernel whose programs each store pid + 1, meet at the barrier, then each
# read the next program's value (stored before the barrier: visible only if it held); argv:
# programs (0: co_resident's count), warps, extra (programs over that count)
_CHILD = textwrap.dedent("""
    import sys, torch, triton, triton.language as tl
    from ftchat.kernels import sync

    @triton.jit(do_not_specialize=["G"])  # the probe's G=1 compiles the launch's variant
    def k(v_ptr, out_ptr, bar_ptr, G, PAD: tl.constexpr):
        pid = tl.program_id(0)
        filler = tl.zeros([PAD], tl.float32) + pid  # registers / shared memory per program
        tl.store(v_ptr + pid, pid + 1)
        sync.grid_barrier(bar_ptr, G)
        nxt = tl.load(v_ptr + (pid + 1) % G, cache_modifier=".cg")
        tl.store(out_ptr + pid, nxt + tl.sum(filler, 0) * 0)

    g, warps, extra = (int(a) for a in sys.argv[1:])
    dev = torch.device("cuda")
    bar = torch.zeros(2, dtype=torch.int32, device=dev)
    probe = torch.zeros(1, dtype=torch.int32, device=dev)
    compiled = k.warmup(probe, probe, bar, 1, PAD=1024, grid=(1,), num_warps=warps)
    fit = sync.co_resident(compiled, dev)
    g = (g or fit) + extra
    v = torch.zeros(g, dtype=torch.int32, device=dev)
    out = torch.zeros(g, dtype=torch.int32, device=dev)
    for _ in range(3):  # the barrier leaves its counters zero: it runs again
        v.zero_(); out.zero_()
        k[(g,)](v, out, bar, g, PAD=1024, num_warps=warps)
        torch.cuda.synchronize()
        want = torch.roll(torch.arange(1, g + 1, device=dev, dtype=torch.int32), -1)
        assert torch.equal(out, want), "a program read before its neighbour stored"
    assert int(bar.abs().sum()) == 0
    print(fit, compiled.n_regs, compiled.metadata.shared)
""")


def _child(tmp: Path, programs: int, warps: int, extra: int,
           timeout: float) -> subprocess.CompletedProcess:
    # a file, not `python -c`: Triton reads a kernel's source with inspect, which has none for
    # code given on the command line (session 19's first run failed there, all three tests)
    script = tmp / "barrier_child.py"
    script.write_text(_CHILD)
    return subprocess.run([sys.executable, str(script), str(programs), str(warps), str(extra)],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])))


@pytest.mark.parametrize("warps", [4, 8])
def test_co_resident_is_the_hardware_limit_and_the_barrier_opens_there(tmp_path, warps):
    run = _child(tmp_path, 0, warps, 0, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    fit, n_regs, shared = (int(x) for x in run.stdout.split())
    p = torch.cuda.get_device_properties(0)
    # the expected count from the SM's limits, computed here apart from the driver's answer:
    # threads, registers (a warp's allocation in units of 256), and 32 blocks an SM
    by_threads = p.max_threads_per_multi_processor // (32 * warps)
    by_regs = 65536 // (warps * (-(-n_regs * 32 // 256) * 256))
    limit = min(by_threads, by_regs, 32)
    if shared:  # each block also reserves 1 KiB of shared memory on sm_80 and later
        limit = min(limit, p.shared_memory_per_multiprocessor // (shared + 1024))
    assert fit == p.multi_processor_count * limit


def test_control_the_barrier_over_the_count_never_opens(tmp_path):
    # negative control: one program more than the GPU holds spins for ever (killed at the
    # timeout), so the test above would see a count too high
    with pytest.raises(subprocess.TimeoutExpired):
        _child(tmp_path, 0, 4, 1, timeout=60)
