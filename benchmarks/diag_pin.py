"""Diagnostic: cudaHostRegister'd rows read by the Triton copy kernel (device only)."""
import torch
from ftchat.offload.copy import copy_rows
from ftchat.offload.store import pin

R, N = 2780160, 16
host = torch.randint(0, 255, (N, R), dtype=torch.uint8)
rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
print("register rc", rc, int(rc), "is_pinned", host.is_pinned())
bank = torch.zeros(N + 1, R, dtype=torch.uint8, device="cuda")
src = torch.arange(N, device="cuda"); dst = torch.arange(N, device="cuda", dtype=torch.int32)
cnt = torch.tensor([N], device="cuda", dtype=torch.int32)
try:
    copy_rows(host, bank, src, dst, cnt, 8); torch.cuda.synchronize()
    print("triton copy ok", torch.equal(bank[:N].cpu(), host))
except Exception as e:
    print("triton copy failed", e)
