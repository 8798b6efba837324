"""Shared by the *_interp_cases.py scripts, which tests/interp_helpers.run_interp_cases runs as subprocesses
(tests/ is then their sys.path[0]). Import it before torch and falcon_lab: importing it checks that
TRITON_INTERPRET=1 is set (triton reads the variable when first imported) and keeps torch to one thread."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

torch.set_num_threads(1)


def rel(a, b):
    """Relative error ||a - b|| / ||b|| with `a` in float64 (`b`: the float64 reference); inf if `a` is not
    finite."""
    a = a.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_cases(run_case):
    """Run every case of the JSON list in argv[1] through `run_case(case) -> result` and print one JSON line
    per case: {"id", "res"}, or {"id", "error"} where it raised (reported; the parent test fails on it)."""
    for c in json.loads(sys.argv[1]):
        try:
            res = run_case(c)
            print(json.dumps({"id": c["id"], "res": res}), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"id": c["id"], "error": f"{type(e).__name__}: {e}"}), flush=True)
