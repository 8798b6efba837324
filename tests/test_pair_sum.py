"""pair_sum.py: the Triton kernel (under the interpreter) against the host loop it replaces, bitwise (fp32, fp16; bf16
to one rounding step: the interpreter truncates bf16 casts), and against the definition (float64): every pair's W
readers, rows no step reads left zero."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys, torch
import falcon_lab.kernels.triton.pair_sum as ps
out = {}
for dtype, B, Ts, W, H, D, extra in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(Ts * 7 + W)
    src = torch.randn(B, Ts, W, H, D, generator=g).to(getattr(torch, dtype))
    rows = Ts + W - 1 + extra
    res = {}
    for mode in ("torch", "triton"):
        ps.PAIR_SUM = mode
        res[mode] = ps.pair_sum(src, rows, src.dtype)
    ref = torch.zeros(B, rows, H, D, dtype=torch.float64)
    for t in range(Ts):
        for m in range(W):
            ref[:, t + W - 1 - m] += src[:, t, m].double()
    key = f"{dtype}-{Ts}-{W}-{D}-{extra}"
    ulp = (res["torch"].float() - res["triton"].float()).abs() / res["torch"].float().abs().clamp_min(1e-30)
    out[key] = dict(bitwise=bool(torch.equal(res["torch"], res["triton"])), rel_diff=float(ulp.max()),
                    err=float((res["triton"].double() - ref).abs().max() / ref.abs().max()),
                    tail_zero=bool((res["triton"][:, Ts + W - 1:] == 0).all()), dtype=str(res["triton"].dtype))
print(json.dumps(out))
"""

CASES = [("float32", 2, 37, 4, 2, 16, 0), ("float16", 1, 45, 2, 3, 32, 0), ("float32", 1, 5, 8, 1, 48, 3),
         ("bfloat16", 2, 20, 3, 2, 64, 0)]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[2]}-W{c[3]}-D{c[5]}-extra{c[6]}")
def test_pair_sum_matches_host_loop_and_definition(results, case):
    dtype, B, Ts, W, H, D, extra = case
    r = results[f"{dtype}-{Ts}-{W}-{D}-{extra}"]
    if dtype == "bfloat16":
        # the same sum, one rounding; Triton's CPU interpreter truncates fp32 -> bf16 casts (round-to-nearest-even on
        # the GPU), so here they may differ by one bf16 step (2^-7 relative)
        assert r["rel_diff"] <= 2 ** -7, r
    else:
        assert r["bitwise"], r  # the same fp32 additions in the same order, one rounding
    assert r["err"] < {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype], r
    assert r["tail_zero"] and r["dtype"] == f"torch.{dtype}", r
