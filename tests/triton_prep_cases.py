"""Cases for tests/test_triton_prep.py, run under TRITON_INTERPRET=1 (interp_helpers.run_interp_cases): the fused
prep (falcon_lab/kernels/triton/prep.py, prep_window.py for Falcon-3A) and the PyTorch prep (falcon_lab/kernels/prep.py)
in fp32, each against the PyTorch prep in float64 on the same inputs, forward (xw, vw, η, log γ, the statistic) and
backward (k, β, λ, the carried key and tail)."""
from interp_case_helpers import run_cases  # first: checks TRITON_INTERPRET=1 before torch and triton load

import torch  # noqa: E402


class CoreTuple:
    def __init__(self, xw, vw, eta, g, stat):
        self.xw, self.vw, self.eta, self.g, self.stat = xw, vw, eta, g, stat


def _rel(a, b):
    return float((a.double() - b).abs().max() / (b.abs().max() + 1e-30))


def prep_case(c):
    from falcon_lab.kernels.prep import prepare
    from falcon_lab.kernels.triton.prep import fused_prepare

    g = torch.Generator().manual_seed(c["seed"])
    B, T, H, K, V = c["B"], c["T"], c["H"], c["K"], c["V"]
    k = torch.randn(B, T, H, K, generator=g) * 0.7
    k[0, min(2, T - 1)] = 0  # a zero key: E = 0, the NLMS denominator at its smallest
    v = torch.randn(B, T, H, V, generator=g)
    beta = (torch.rand(B, T, H, V, generator=g) if c["per_col"] else torch.rand(B, T, H, generator=g)) * 1.8
    lam = torch.rand(B, T, H, generator=g) * c["lam_max"]  # large enough that η λ meets the clamp 1 - eps_gamma
    last = torch.randn(B, H, K, generator=g) if c["last_k"] else None
    W = c.get("window", 1)
    tail = torch.randn(B, W - 1, H, K, generator=g) if W > 1 and c.get("tail") else None
    tail_v = torch.randn(B, W - 1, H, V, generator=g) if tail is not None else None
    seen = torch.tensor([c["seen"]] + [0] * (B - 1))
    valid = torch.ones(B, T, dtype=torch.bool)
    if c["valid"]:
        valid[-1, T // 2:] = False
    # eps_gamma 0.05: rows meet the clamp (lam_max) while the rows just below it stay well conditioned (d log γ / dα =
    # -1 / (1 - α) turns fp32's rounding of α into a relative error up to 1e4 times larger at the default 1e-4,
    # in the PyTorch prep as much as in the fused one)
    kw = dict(shift=c["shift"], step=c["step"], lam_mode=c["lam_mode"], eps=c.get("eps", 1e-6), eps_gamma=0.05,
              seen=seen, valid=valid if c["valid"] else None)
    variant = ("3" if c.get("delta") else "3A") if W > 1 else ("2" if c["per_col"] else "1")
    dx = torch.randn(B, T + W - 1, H, K, generator=g)
    de, dg = torch.randn(beta.shape, generator=g), torch.randn(beta.shape, generator=g)

    def call(fn, kk, vv, bb, ll, lk, tx, tv):
        ci = fn(kk, vv, bb, ll, variant=variant, window=W, last_k=lk, tail_x=tx, tail_v=tv, **kw)
        return ci.xw, ci.vw, ci.eta, ci.g, ci.stat

    def run(fused, dtype, compiled=False):
        ins = [t.to(dtype).requires_grad_() if t is not None else None for t in (k, beta, lam, last, tail)]
        kk, bb, ll, lk, tx = ins
        tv = tail_v.to(dtype) if tail_v is not None else None
        fn = (lambda *a: call(fused_prepare if fused else prepare, *a))
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
        ci = CoreTuple(*fn(kk, v.to(dtype), bb, ll, lk, tx, tv))
        used = [t for t in ins if t is not None]
        loss = (ci.xw * dx.to(dtype)).sum() + (ci.eta * de.to(ci.eta.dtype)).sum() + (ci.g * dg.to(ci.g.dtype)).sum()
        grads = torch.autograd.grad(loss, used, allow_unused=True)
        grads = [gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads, used)]
        names = (["dk", "dbeta", "dlam"] + (["dlast_k"] if last is not None else [])
                 + (["dtail_x"] if tail is not None else []))
        return dict(zip(["x", "v", "eta", "g", "stat"] + names, [ci.xw, ci.vw, ci.eta, ci.g, ci.stat] + grads))

    ref = run(False, torch.float64)
    torch32, fused32 = run(False, torch.float32), run(True, torch.float32)
    out = {n: {"fused": _rel(fused32[n], ref[n]), "torch": _rel(torch32[n], ref[n])} for n in ref}
    if c.get("compiled"):  # the custom operators (prep_ops.py): what a compiled call runs, against the eager Function
        comp = run(True, torch.float32, compiled=True)
        out["compiled_differs"] = max(float((comp[n] - fused32[n]).abs().max()) for n in ref)
        out["opcheck_failed"] = _opcheck(k, beta, lam, last, tail, seen, valid if c["valid"] else None, W, c, kw)
    if c.get("gates"):  # FALCON_TRITON_3_PREP_GATES: its two forms must agree exactly (the default runs above too)
        import falcon_lab.kernels.triton.prep_window as pw

        default, got = pw.GATES, {}
        try:
            for form in ("recompute", "stat"):
                pw.GATES = form
                got[form] = run(True, torch.float32)
        finally:
            pw.GATES = default
        out["gates_forms_differ"] = max(float((got["stat"][n] - got["recompute"][n]).abs().max()) for n in ref)
    return out


def _opcheck(k, beta, lam, last, tail, seen, valid, W, c, kw):
    """torch.library.opcheck of falcon_lab::prep_fwd on the case's inputs (schema, fake tensors, the autograd
    registration, AOT dispatch): the number of its tests that failed."""
    from falcon_lab.kernels.triton.prep_ops import prep_fwd

    cfg = [float(kw["shift"]), float(kw["step"] == "nlms"), float(kw["lam_mode"] == "scaled"), float(kw["eps"]),
           float(kw["eps_gamma"]), float(W), float(bool(c.get("delta")))]
    args = (k.requires_grad_(), beta.requires_grad_(), lam.requires_grad_(),
            last.requires_grad_() if last is not None else None, tail.requires_grad_() if tail is not None else None,
            seen, valid.to(torch.int8) if valid is not None else None, None, None, cfg)
    res = torch.library.opcheck(prep_fwd, args)
    return sum(v != "SUCCESS" for v in res.values())


if __name__ == "__main__":
    run_cases(prep_case)
