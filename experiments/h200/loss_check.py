"""The LM loss on the H200: the Triton chunk body (falcon_lab/modules/xent.py) against float64 and the
three loss paths (model.loss_impl) timed forward+backward at the benchmark's size, in one process.

    python experiments/h200/loss_check.py --out DIR      (writes DIR/loss_check_h200.json)

Accuracy: one chunk of bf16 / fp32 logits [rows, 50304]; the Triton body's per-row NLL and in-place
gradient against the torch body computed in float64 on the same logits. Speed: lm_nll(h, W, y) + backward
with 32768 tokens, d_model 768, vocab 50304, bf16 autocast (the `small` model's head), median of 7 after 2
warm-ups (CUDA events), and the peak memory above the inputs.
"""
import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

import torch


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    a = ap.parse_args()
    from falcon_lab.models.loss import LOSS_IMPLS, lm_nll
    from falcon_lab.modules.xent import xent_rows_, xent_rows_torch_

    dev = torch.device("cuda")
    V, D, N = 50304, 768, a.tokens
    g = torch.Generator(device=dev).manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("FALCON_COMMIT"),
           "accuracy": [], "speed": []}
    import triton

    res["triton"] = triton.__version__
    for dtype in (torch.bfloat16, torch.float32):
        for scale in (1.0, 0.7):
            z = (torch.randn(1024, V, device=dev, generator=g) * 4).to(dtype)
            y = torch.randint(0, V, (1024,), device=dev, generator=g)
            y[::9] = -100
            z64 = z.double()
            ref = xent_rows_torch_(z64, y, scale, -100, grad=True)
            zt = z.clone()
            nll = xent_rows_(zt, y, scale, -100, grad=True, backend="triton")
            row = {"dtype": str(dtype), "scale": scale, "rows": 1024, "vocab": V, "nll_rel": rel(nll, ref),
                   "grad_rel": rel(zt, z64), "ignored_zero": bool((nll[y == -100] == 0).all()
                                                                   and (zt[y == -100] == 0).all())}
            res["accuracy"].append(row)
            print(json.dumps(row), flush=True)
    h0 = torch.randn(N, D, device=dev, generator=g)
    w0 = torch.randn(V, D, device=dev, generator=g) * 0.02
    y = torch.randint(0, V, (N,), device=dev, generator=g)
    losses = {}
    for impl in LOSS_IMPLS:
        h = h0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)

        def step():
            h.grad = w.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                nll, n = lm_nll(h, w, y, impl=impl)
            (nll / n).backward()
            return nll

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(7):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            nll = step()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        losses[impl] = (float(nll), h.grad.double(), w.grad.double())
        row = {"impl": impl, "tokens": N, "d_model": D, "vocab": V, "fwd_bwd_ms": statistics.median(times),
               "peak_extra_bytes": torch.cuda.max_memory_allocated() - base}
        res["speed"].append(row)
        print(json.dumps(row), flush=True)
    ref = losses["materialized"]
    for impl in LOSS_IMPLS:
        l, dh, dw = losses[impl]
        res.setdefault("agreement_vs_materialized", {})[impl] = {
            "loss_rel": abs(l - ref[0]) / abs(ref[0]), "dh_rel": rel(dh, ref[1]), "dw_rel": rel(dw, ref[2])}
    print(json.dumps(res["agreement_vs_materialized"]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_check_h200.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
