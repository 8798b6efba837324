"""falcon_lab.modules.norm: the torch paths against float64 formulas and today's base.py numerics, dtype
under autocast, dispatch; the Triton kernels under the interpreter (one subprocess with
TRITON_INTERPRET=1, tests/norm_interp_cases.py, since triton reads the variable when first imported)
against the torch path in float64. Tiny sizes; fp32 and fp16 only under the interpreter (its bf16
arithmetic is wrong)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from interp_helpers import case_result, run_interp_cases
import torch
import torch.nn.functional as F

from falcon_lab.modules.norm import (FusedRMSNormGated, RMSNorm, qk_norm, qk_norm_torch, rms_norm_gated,
                                     rms_norm_gated_torch)

HERE = Path(__file__).resolve().parent
EPS = 1e-6


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _formula(x, w, g, kind, eps=EPS):
    """float64 reference: x / sqrt(stat + eps) * w * g * sigmoid(g)."""
    stat = (x * x).mean(-1, keepdim=True) if kind == "rmsnorm" else (x * x).sum(-1, keepdim=True)
    y = x / torch.sqrt(stat + eps)
    if w is not None:
        y = y * w
    return y * (g * torch.sigmoid(g)) if g is not None else y


def _leaves(shape, D, with_w, with_g, dtype, wshape=None):
    x = torch.randn(shape) * torch.exp(torch.randn(*shape[:-1], 1))
    w = (1 + 0.3 * torch.randn(wshape or (D,))) if with_w else None
    g = 2 * torch.randn(shape) if with_g else None
    return [t.to(dtype).requires_grad_(True) if t is not None else None for t in (x, w, g)]


def _compare(run, kind, leaves, tol):
    """run(x, w, g) in the leaves' dtype against the float64 formula: output and every gradient."""
    ref_leaves = [t.detach().double().requires_grad_(True) if t is not None else None for t in leaves]
    y, y_ref = run(*leaves), _formula(*ref_leaves, kind)
    assert y.dtype == leaves[0].dtype and _rel(y, y_ref) <= tol
    pairs = [(a, b) for a, b in zip(leaves, ref_leaves) if a is not None]
    dy = torch.randn(y.shape, dtype=torch.float64)
    grads = torch.autograd.grad(y, [a for a, _ in pairs], dy.to(y.dtype))
    grads_ref = torch.autograd.grad(y_ref, [b for _, b in pairs], dy)
    for (a, _), ga, gb in zip(pairs, grads, grads_ref):
        assert ga.dtype == a.dtype and _rel(ga, gb) <= tol, (_rel(ga, gb), tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("with_w,with_g", [(True, True), (False, True), (True, False), (False, False)])
def test_rms_norm_gated_torch_matches_float64_formula(dtype, tol, with_w, with_g):
    leaves = _leaves((2, 5, 3, 48), 48, with_w, with_g, dtype)
    _compare(lambda x, w, g: rms_norm_gated_torch(x, w, g, EPS), "rmsnorm", leaves, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("kind", ["rmsnorm", "l2"])
@pytest.mark.parametrize("gain", [None, "D", "HD"])
def test_qk_norm_torch_matches_float64_formula(dtype, tol, kind, gain):
    wshape = {None: None, "D": (32,), "HD": (3, 32)}[gain]
    x, w, _ = _leaves((2, 5, 3, 32), 32, gain is not None, False, dtype, wshape)
    _compare(lambda x, w, g: qk_norm_torch(x, kind, EPS, w), kind, [x, w, None], tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_is_todays_base_numerics(dtype):
    x = torch.randn(2, 7, 3, 64).to(dtype)
    # the numerics the mixers had before these modules (written out: layers/base.py, 0d99b9a)
    weight = torch.empty(64).uniform_(0.5, 1.5)
    old_hat = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
    old = old_hat * weight  # an fp32 weight promoted a bf16 x_hat to fp32
    new = RMSNorm(64)
    new.load_state_dict({"weight": weight})  # same parameter name, checkpoints load
    # ours casts the weight to x.dtype first, so the output stays in x.dtype
    assert torch.equal(new(x), old_hat * weight.to(dtype))
    assert new(x).dtype == dtype and _rel(new(x), old) <= (0 if dtype == torch.float32 else 4e-3)
    assert torch.equal(qk_norm(x, "rmsnorm", 1e-5),
                       x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype))
    assert torch.equal(qk_norm(x, "l2", 1e-5), x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-5).to(x.dtype))
    g = torch.randn(2, 7, 3, 64).to(dtype)
    assert torch.equal(rms_norm_gated(x, weight, g), new(x) * F.silu(g))
    assert RMSNorm(64, gain=False).weight is None and not list(RMSNorm(64, gain=False).parameters())


def test_output_dtype_under_bf16_autocast_with_fp32_weights():
    fused, norm = FusedRMSNormGated(32), RMSNorm(32)
    gain = torch.nn.Parameter(torch.ones(3, 32))
    x = torch.randn(2, 4, 3, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 4, 3, 32, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [fused(x, g), norm(x), rms_norm_gated(x, norm.weight, None),
                qk_norm(x, "rmsnorm", EPS, gain), qk_norm(x, "l2", EPS, norm.weight)]
        sum(o.float().sum() for o in outs).backward()
    assert all(o.dtype == torch.bfloat16 for o in outs), [o.dtype for o in outs]
    assert fused.weight.grad.dtype == torch.float32 and gain.grad.dtype == torch.float32
    assert x.grad.dtype == torch.bfloat16 and g.grad.dtype == torch.bfloat16


def test_dispatch_and_argument_errors():
    x = torch.randn(2, 3, 16)
    assert torch.equal(rms_norm_gated(x, torch.ones(16)), rms_norm_gated_torch(x, torch.ones(16)))
    with pytest.raises(ValueError, match="backend"):
        rms_norm_gated(x, backend="cuda")
    with pytest.raises(ValueError, match="kind"):
        qk_norm(x, "layernorm", EPS)
    with pytest.raises(ValueError, match="gate shape"):
        rms_norm_gated(x, None, torch.randn(2, 3, 8))


def test_triton_on_cpu_without_interpreter_gives_clear_error():
    code = ("import torch\nfrom falcon_lab.modules.norm import rms_norm_gated\n"
            "try:\n    rms_norm_gated(torch.zeros(4, 16), backend='triton')\n"
            "except RuntimeError as err:\n    print('ERR', err)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "ERR" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------------ Triton under the interpreter
def _c(id, fn, **kw):
    base_case = dict(B=2, T=37, H=3, D=32, dtype="float32", seed=1, fn=fn)
    base_case.update(kw, id=id)
    return base_case


CASES = []
for dt in ("float32", "float16"):
    for D in (32, 48, 128):
        CASES.append(_c(f"gated-w-g-D{D}-{dt}", "rms_norm_gated", D=D, dtype=dt, w="D", gate=True, seed=D))
    CASES.append(_c(f"gated-now-g-D48-{dt}", "rms_norm_gated", D=48, dtype=dt, w="none", gate=True, seed=2))
    CASES.append(_c(f"gated-w-nog-D128-{dt}", "rms_norm_gated", D=128, dtype=dt, w="D", gate=False, seed=3))
    for kind in ("rmsnorm", "l2"):
        for w, D in (("none", 48), ("D", 32), ("HD", 128)):
            CASES.append(_c(f"qk-{kind}-gain{w}-D{D}-{dt}", "qk_norm", kind=kind, D=D, dtype=dt, w=w, seed=4))
CASES.append(_c("gated-plain-D48-noncontig", "rms_norm_gated", D=48, w="none", gate=False, noncontig=True))
CASES.append(_c("gated-one-row-D256", "rms_norm_gated", B=1, T=1, H=1, D=256, w="D", gate=True, seed=5))
CASES.append(_c("qk-l2-gainHD-D48-noncontig", "qk_norm", kind="l2", D=48, w="HD", noncontig=True, seed=6))
COMPILE = [dict(id="compile-aot_eager-fullgraph", compile=True, seed=7)]


@pytest.fixture(scope="module")
def results():
    return run_interp_cases("norm_interp_cases.py", CASES + COMPILE, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_triton_interpreter_matches_float64(results, case):
    res = case_result(results, case["id"])
    expected = {"y", "dx"} | ({"dweight"} if case.get("w", "D") != "none" else set()) | (
        {"dgate"} if case.get("gate") else set())
    assert set(res) == expected, res
    lim = 3e-3 if case["dtype"] == "float16" else 1e-5
    for k, e in res.items():
        assert e <= lim, f"{case['id']}: {k} relative error {e:.3e} > {lim:.0e} ({res})"


def test_triton_ops_compile_without_graph_break(results):
    r = results.get(COMPILE[0]["id"])
    assert r is not None and "error" not in r, r
    res = r["res"]
    assert res["graph_count"] == 1 and res["graph_break_count"] == 0, res
    assert res["ops_in_graph"] == 3, res  # rms_norm_gated_fwd, qk_norm_fwd twice
    assert res["max_abs_diff"] <= 1e-6, res
