"""The one-scan Falcon-3A kernel's H200 fault (issue 14), forward only, one configuration per process.

    FALCON_TRITON_UNPROVEN=1 compute-sanitizer --tool memcheck python experiments/h200/wl_fault.py --K 128 --C 64

On 2026-12-02 (5d7a5d8) `bench check --variants 3A` with FALCON_TRITON_3A=banded failed every K = 128, C = 64 row
(bf16: o 0.41 off while S_T and every gradient passed; fp32: illegal memory access) at 4 and at 8 warps, while
K = 128 at C = 16/32 and K <= 64 at C = 64 passed. This script runs the forward launch alone, so that memcheck can
name the faulting kernel and line.
"""
import argparse
import json
import sys

import torch

sys.path.insert(0, ".")
from falcon_lab.kernels.triton.window_linear import window_linear_forward  # noqa: E402

p = argparse.ArgumentParser()
for a, d in (("B", 1), ("T", 1000), ("H", 2), ("K", 128), ("C", 64), ("W", 4)):
    p.add_argument(f"--{a}", type=int, default=d)
p.add_argument("--dtype", default="float32")
p.add_argument("--device", default="cuda", help="cpu with TRITON_INTERPRET=1: a dry run")
a = p.parse_args()
dt = getattr(torch, a.dtype)
g0 = torch.Generator(device=a.device).manual_seed(0)
r = lambda *s: torch.randn(*s, device=a.device, generator=g0)  # noqa: E731
q = r(a.B, a.T, a.H, a.K).to(dt)
xw = r(a.B, a.T + a.W - 1, a.H, a.K).to(dt)
vw = r(a.B, a.T + a.W - 1, a.H, a.K).to(dt)
eta = torch.rand(a.B, a.T, a.H, device=a.device, generator=g0)
g = -0.1 * torch.rand(a.B, a.T, a.H, device=a.device, generator=g0)
O, ST, _ = window_linear_forward(q, xw, vw, eta, g, None, read_after=True, C=a.C, W=a.W)
if a.device == "cuda":
    torch.cuda.synchronize()
print(json.dumps(dict(vars(a), finite=bool(O.isfinite().all()), o_norm=float(O.float().norm()))))
