"""The Python host time of the public Falcon ops with the Triton backend, on a machine without a GPU (ours).

Every Triton launch is replaced by a no-op (the kernels do not run: outputs are uninitialised), so what is timed is
what the host does per call: validation, dispatch, allocations, autograd, the launchers' argument handling. Tensors
are tiny (B=1, T=64, H=2, K=V=64) so that PyTorch's CPU ops cost about what their launches cost on a GPU host.
On the H200 at (16, 2048, 12, 64) Falcon-1A's host time (1.23 ms) exceeded its GPU time (0.90 ms), 2026-12-02:
this is where that time goes, measured where it can be, and a cProfile table of the hot spots with --profile.

    .venv/bin/python experiments/h200/host_cpu.py [--variants 1,1A,2A,3A] [--iters 300] [--profile]

A CPU estimate, not the H200 host's time (another CPU, and Triton's C launcher is not timed here).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="1,1A,2A,3A")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="cProfile the first variant, top 25 by own time")
    a = ap.parse_args()
    import torch
    from triton.runtime.jit import JITFunction

    launches = [0]

    def no_op(self, *args, grid, warmup, **kwargs):
        launches[0] += 1

    JITFunction.run = no_op
    import falcon_lab.kernels.triton as ft
    from falcon_lab.kernels import chunk_falcon

    ft._INTERPRET = True  # lets the Triton backend take CPU tensors; the kernels are no-ops here
    torch.set_num_threads(1)
    B, T, H, K = 1, 64, 2, 64
    rows = []
    for var in a.variants.split(","):
        per_col = var.startswith("2")
        q, k, v = (torch.randn(B, T, H, K, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        beta = torch.rand(B, T, H, K if per_col else 1, dtype=torch.bfloat16)
        beta = (beta if per_col else beta[..., 0]).requires_grad_()
        lam = torch.rand(B, T, H, dtype=torch.bfloat16, requires_grad=True)

        def step():
            o, _ = chunk_falcon(q, k, v, beta, lam, variant=var, backend="triton")
            o.float().sum().backward()

        for _ in range(20):
            step()
        launches[0] = 0
        if a.profile and not rows:
            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            step()
        us = (time.perf_counter() - t0) / a.iters * 1e6
        if a.profile and not rows:
            prof.disable()
        rows.append((var, us, launches[0] / a.iters))
        if a.profile and len(rows) == 1:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"host time per fwd+bwd, no-op launches, torch {torch.__version__}, {a.iters} iterations")
    for var, us, n in rows:
        print(f"  Falcon-{var:3s} {us:7.0f} us   {n:.0f} kernel launches")


if __name__ == "__main__":
    main()
