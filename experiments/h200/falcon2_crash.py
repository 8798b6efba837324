"""Falcon-2's H200 crash (issue 15), one configuration per process (an illegal access poisons the context).

    FALCON_TRITON_UNPROVEN=1 python experiments/h200/falcon2_crash.py --dtype bfloat16 --json out.json
    ... --stages 1            force num_stages=1 in the Falcon-2 kernels (bf16 otherwise takes Triton's default)
    ... --kernel-only         no float64 reference (for compute-sanitizer, which slows every kernel)
    ... --variant 2A          the per-column inner-product kernels at the same shape
    ... --state-fp32          the backward state kernel on fp32 copies of q and x (a workaround candidate)
    ... --state-warps 4       the backward state kernel (_pcd_bwd_state) at 4 warps: the launch that crashed

Default shape: the one that died on 2026-12-01 (B=1, T=1000, H=2, K=V=128, chunk 64, initial state, gradient
through the final state). With the reference, the errors are falcon_lab.benchmarking.gpu_check's against the
float64 loop, judged with its tolerances. Exit 0 pass, 1 fail (numbers off), 3 error (exception, e.g. CUDA).

History: up to e5909d9 percol_delta_backward launched _pcd_bwd_state with Triton's default 4 warps; there
compute-sanitizer found an out-of-range shared/local address at the dH update in bf16 (2026-12-02,
benchmarks/results/h200_logs/falcon2_crash_2026-12-02b/), and 8 warps, --state-fp32 and --C 32 passed. Since
then the module launches it with 8 warps, so the default run here checks that candidate fix and
`--state-warps 4` reproduces the old launch (`--state-fp32` now runs at 8 warps unless combined with it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class _Launch:
    """kernel[grid](*args, **kw) with (args, kw) rewritten by `adjust` first: one launch site changed for an
    experiment, without touching the kernel module's code."""

    def __init__(self, kernel, adjust):
        self.kernel, self.adjust = kernel, adjust

    def __getitem__(self, grid):
        def launch(*args, **kw):
            args, kw = self.adjust(list(args), dict(kw))
            return self.kernel[grid](*args, **kw)
        return launch


def _warps(n):
    """num_warps forced."""
    return lambda args, kw: (args, {**kw, "num_warps": n})


def _fp32_state(args, kw):
    """_pcd_bwd_state(q, x, ..., prec): q and x as fp32 copies and "tf32" dots: the bf16 path's workaround
    candidate (the kernel takes its dot dtype from x)."""
    args[0], args[1] = args[0].float(), args[1].float()
    args[22] = "tf32"  # PREC (the 23rd argument)
    return args, kw


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="2")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=1000)
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--C", type=int, default=64)
    p.add_argument("--stages", type=int, default=0, help="0 = the kernels' own choice")
    p.add_argument("--state-warps", type=int, default=0,
                   help="launch Falcon-2's backward state kernel (_pcd_bwd_state) with this many warps (0 = the "
                        "module's own, 8 since the issue-15 fix; 4 = the launch that crashed on the H200)")
    p.add_argument("--state-fp32", action="store_true",
                   help="give _pcd_bwd_state fp32 copies of q and x (its dots then run as in the fp32 path, which passed)")
    p.add_argument("--kernel-only", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cpu runs the Triton interpreter (TRITON_INTERPRET=1): a dry run")
    a = p.parse_args(argv)
    rec = dict(vars(a))
    t0 = time.time()
    code = 3
    try:
        import torch

        from falcon_lab.benchmarking import gpu_check
        from falcon_lab.kernels.triton import chunk, percol, percol_delta

        if a.stages:
            forced = {"num_stages": a.stages}
            for mod in (chunk, percol, percol_delta):
                mod._stages = lambda dtype, _f=forced: dict(_f)
        if a.state_warps:
            percol_delta._pcd_bwd_state = _Launch(percol_delta._pcd_bwd_state, _warps(a.state_warps))
        if a.state_fp32:
            percol_delta._pcd_bwd_state = _Launch(percol_delta._pcd_bwd_state, _fp32_state)
        rec["gpu"] = torch.cuda.get_device_name() if a.device == "cuda" else a.device
        rec["torch"], rec["commit"] = torch.__version__, os.environ.get("FALCON_COMMIT", "unknown")
        cfg = dict(variant=a.variant, B=a.B, T=a.T, H=a.H, K=a.K, V=a.K, C=a.C, dtype=a.dtype)
        if a.kernel_only:
            from falcon_lab.benchmarking.ref64 import make_core_inputs
            from falcon_lab.kernels.spec import FalconSpec
            from falcon_lab.kernels.triton import core

            spec = FalconSpec.from_variant(a.variant)
            W = spec.window(4)
            ins = make_core_inputs(a.B, a.T, a.H, a.K, a.K, W, per_col=spec.per_column, device=a.device)
            dt = getattr(torch, a.dtype)
            kin = [t.to(dt).requires_grad_(True) for t in ins[:3]] + [t.float().requires_grad_(True) for t in ins[3:]]
            o, s = core(*kin, delta=spec.delta, window=W, read_after=True, chunk_size=a.C)
            grads = torch.autograd.grad(o.float().sum() + s.float().sum(), kin)
            if a.device == "cuda":
                torch.cuda.synchronize()
            rec["finite"] = bool(all(torch.isfinite(t).all() for t in (o, s, *grads)))
            code = 0 if rec["finite"] else 1
        else:
            res = gpu_check.check_core(seed=0, dev=a.device, **cfg)
            if a.device == "cuda":
                torch.cuda.synchronize()
            ftol, gtol = gpu_check.TOL[a.dtype] if a.dtype in gpu_check.TOL else (2e-2, 4e-2)
            rec["errors"] = res
            rec["pass"] = all(v <= (ftol if k in ("o", "S_T") else gtol) for k, v in res.items())
            code = 0 if rec["pass"] else 1
    except Exception as e:  # noqa: BLE001 - recorded, the exit code says it
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["traceback"] = traceback.format_exc()[-4000:]
    rec["seconds"] = round(time.time() - t0, 1)
    rec["exit"] = code
    print("RESULT " + json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
