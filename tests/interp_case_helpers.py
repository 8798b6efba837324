"""Shared by the *_interp_cases.py scripts, which tests/interp_helpers.run_interp_cases runs as subprocesses
(tests/ is then their sys.path[0]). Import it before torch and falcon_lab: importing it checks that
TRITON_INTERPRET=1 is set (triton reads the variable when first imported) and keeps torch to one thread."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

torch.set_num_threads(1)


def _fast_device_calls():
    """Test speed only (ours): Triton's interpreter (3.x) re-patches triton.language at every device-function call
    (InterpretedFunction.__call__ -> _patch_lang, an inspect.getmembers scan of the language modules), although the
    kernel launch (GridExecutor.__call__) has patched them for the whole launch and restores them after it; the nested
    patch finds nothing left to patch (patched members are no longer builtins) and is never restored. In these suites it
    was ~40 % of the interpreter's time (cProfile of one packed Falcon-3 case, 2026-12-04: 28.9 of 69 s in
    _patch_lang). Device calls whose module sees the same triton.language as every launch here skip it; any other
    callee keeps Triton's own path, and so does any Triton without these internals."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti

        cls, error = ti.InterpretedFunction, ti.InterpreterError
        orig = cls.__call__
        cls.rewrite  # noqa: B018  (the internal this relies on)
    except (ImportError, AttributeError):
        return
    if getattr(orig, "_falcon_fast", False):
        return

    def call(self, *args, **kwargs):
        if not any(v is tl for v in self.fn.__globals__.values()):
            return orig(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e
    call._falcon_fast = True
    cls.__call__ = call


_fast_device_calls()


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
