"""GPU check and timing of the fused layer modules (falcon_lab.modules), at the small model's sizes.

    python -m falcon_lab.benchmarking.modules_check [--out DIR]

For each module (short conv + SiLU over q|k|v, the output RMSNorm × SiLU gate, the QK RMSNorm):
- correctness: the Triton path against the torch path computed in float64 on the same (rounded)
  inputs, forward and every gradient, bf16 and fp32, outputs NaN-poisoned (FALCON_TRITON_POISON=1);
- speed: forward+backward median (triton.testing.do_bench) of the Triton path, the torch path eager,
  and the torch path under torch.compile (what a compiled block would run without the Triton module).
Writes modules_check_<gpu>.json / .md; prints the table last.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

os.environ.setdefault("FALCON_TRITON_POISON", "1")


def _cases(B=16, T=2048, H=6, D=128):
    from falcon_lab.modules.conv import short_conv, short_conv_torch
    from falcon_lab.modules.norm import qk_norm, qk_norm_torch, rms_norm_gated, rms_norm_gated_torch

    C = 3 * H * D
    return {
        "short_conv": (lambda dt: [torch.randn(B, T, C, dtype=dt), torch.randn(C, 4) * 0.5],
                       lambda x, w: short_conv(x, w, backend="triton")[0],
                       lambda x, w: short_conv_torch(x, w)[0]),
        # as the Falcon mixer calls it: q, k, v out as three contiguous tensors [3, B, T, H*D]
        "short_conv_split3": (lambda dt: [torch.randn(B, T, C, dtype=dt), torch.randn(C, 4) * 0.5],
                              lambda x, w: short_conv(x, w, backend="triton", split=3)[0],
                              lambda x, w: short_conv_torch(x, w, split=3)[0]),
        "rms_norm_gated": (lambda dt: [torch.randn(B, T, H, D, dtype=dt), 1 + 0.1 * torch.randn(D),
                                       torch.randn(B, T, H, D, dtype=dt)],
                           lambda x, w, g: rms_norm_gated(x, w, g, 1e-6, backend="triton"),
                           lambda x, w, g: rms_norm_gated_torch(x, w, g, 1e-6)),
        "qk_rmsnorm": (lambda dt: [torch.randn(B, T, H, D, dtype=dt)],
                       lambda u: qk_norm(u, "rmsnorm", 1e-6, backend="triton"),
                       lambda u: qk_norm_torch(u, "rmsnorm", 1e-6)),
    }


def _rel(a, b):
    a = a.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_and_time(name, make, fast, ref, dtype, dev="cuda"):
    import triton

    torch.manual_seed(0)
    ins = [t.to(dev) for t in make(dtype)]
    ins = [t.requires_grad_(True) for t in ins]
    out = fast(*ins)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, ins, dy)
    ins64 = [t.detach().double().requires_grad_(True) for t in ins]
    out64 = ref(*ins64)
    grads64 = torch.autograd.grad(out64, ins64, dy.double())
    res = {"module": name, "dtype": str(dtype).replace("torch.", ""), "out_dtype": str(out.dtype).replace("torch.", ""),
           "err_y": _rel(out, out64)}
    for i, (g, g64) in enumerate(zip(grads, grads64)):
        res[f"err_d{i}"] = _rel(g, g64)
    compiled = torch.compile(ref)
    for label, fn in (("triton", fast), ("torch_eager", ref), ("torch_compiled", compiled)):
        def fb():
            fn(*ins).backward(dy)
        try:
            res[f"{label}_fwdbwd_ms"] = triton.testing.do_bench(fb, warmup=25, rep=100, grad_to_none=ins,
                                                                return_mode="median")
        except Exception as e:  # noqa: BLE001  recorded, the check goes on
            res[f"{label}_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    import triton

    gpu = torch.cuda.get_device_name()
    rows = []
    for name, (make, fast, ref) in _cases().items():
        for dtype in (torch.bfloat16, torch.float32):
            r = check_and_time(name, make, fast, ref, dtype)
            rows.append(r)
            print(json.dumps(r), flush=True)
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("FALCON_COMMIT", "unknown"), "shape": "B=16, T=2048, H=6, D=128 (conv: 3*H*D channels)"}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "_".join(gpu.lower().replace("nvidia", "").split()[:2]) or "cuda"
    (out / f"modules_check_{slug}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# Fused modules on {gpu} (torch {meta['torch']}, Triton {meta['triton']}, commit {meta['commit']})", "",
             f"Shape: {meta['shape']}. Errors: ‖fast − float64 torch‖/‖float64‖ on the same inputs; times: fwd+bwd median ms.", "",
             "| module | dtype | out dtype | max rel. err (y, grads) | Triton ms | torch eager ms | torch compiled ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        errs = [v for k, v in r.items() if k.startswith("err_")]
        f = lambda k: f"{r[k]:.3f}" if k in r else r.get(k.replace('fwdbwd_ms', 'error'), "")[:40]  # noqa: E731
        lines.append(f"| {r['module']} | {r['dtype']} | {r['out_dtype']} | {max(errs):.1e} | {f('triton_fwdbwd_ms')} | "
                     f"{f('torch_eager_fwdbwd_ms')} | {f('torch_compiled_fwdbwd_ms')} |")
    text = "\n".join(lines) + "\n"
    (out / f"modules_check_{slug}.md").write_text(text)
    print(text)
    bad = [r for r in rows if max(v for k, v in r.items() if k.startswith("err_")) > (2e-2 if r["dtype"] == "bfloat16" else 1e-4)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
