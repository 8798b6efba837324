"""Cases for tests/test_triton_eig.py, run under TRITON_INTERPRET=1 (interp_helpers.run_interp_cases): Falcon-3's
μ_t squarings in one Triton kernel (falcon_lab/kernels/triton/eig.py) against the PyTorch squarings
(falcon_lab/kernels/prep.py) and float64 eigvalsh, and through the prep with gradients."""
from interp_case_helpers import run_cases  # first: checks TRITON_INTERPRET=1 before torch and triton load

import torch  # noqa: E402


def _grams(c):
    g = torch.Generator().manual_seed(c["seed"])
    W, N, K = c["W"], c["N"], c["K"]
    x = torch.randn(N, W, K, generator=g)
    if c.get("rank1"):  # windows of one repeated key (rank 1, a (W-1)-fold zero eigenvalue: what broke syevj)
        x = x[:, :1].expand(N, W, K).clone()
    if c.get("zeros"):  # empty windows: zero Grams
        x[: N // 2] = 0
    if c.get("close"):  # two nearly equal top eigenvalues
        q, _ = torch.linalg.qr(torch.randn(N, W, W, generator=g, dtype=torch.float64))
        lam = torch.linspace(0.1, 1.0, W, dtype=torch.float64).repeat(N, 1)
        lam[:, -2] = 1.0 - 1e-6
        return (q * lam[:, None, :]) @ q.transpose(-1, -2)
    return (x @ x.transpose(-1, -2)).double()


def eig_case(c):
    from falcon_lab.kernels.prep import _largest_eig, _top_eigvec_torch, prepare
    from falcon_lab.kernels.triton.eig import top_eigvec

    gram = _grams(c)
    ref = torch.linalg.eigvalsh(gram)[..., -1]
    scale = float(ref.abs().max()) + 1e-30
    g32 = gram.float()
    v_tri, v_torch = top_eigvec(g32), _top_eigvec_torch(g32, 20)
    out = {"shape": list(v_tri.shape),
           "mu_triton": float((_largest_eig(g32, eigvec=top_eigvec).double() - ref).abs().max()) / scale,
           "mu_torch": float((_largest_eig(g32).double() - ref).abs().max()) / scale,
           "v_finite": bool(torch.isfinite(v_tri).all())}
    # the eigenvectors agree up to scale and sign where the top eigenvalue is simple and well separated
    if not c.get("close"):
        cos = (v_tri * v_torch).sum((-2, -1)).abs() / (v_tri.norm(dim=(-2, -1)) * v_torch.norm(dim=(-2, -1))
                                                       ).clamp(min=1e-30)
        nz = v_torch.norm(dim=(-2, -1)) > 0
        out["min_cos"] = float(cos[nz].min()) if bool(nz.any()) else 1.0
        out["zero_where_torch_zero"] = bool((v_tri[~nz] == 0).all())
    # through Falcon-3's prep, forward and backward: the kernel only replaces the no-grad eigenvector
    gg = torch.Generator().manual_seed(c["seed"] + 1)
    B, T, H, K = 1, 9, 2, c["K"]
    k = torch.randn(B, T, H, K, generator=gg)
    v = torch.randn(B, T, H, 4, generator=gg)
    beta, lam = torch.rand(B, T, H, generator=gg), torch.rand(B, T, H, generator=gg)
    kw = dict(variant="3", window=c["W"], step="nlms", lam_mode="scaled", shift=True, eps=1e-6, eps_gamma=1e-4,
              seen=torch.zeros(B, dtype=torch.long))

    def run(eigvec, dtype):
        kk = k.to(dtype).requires_grad_()
        ci = prepare(kk, v.to(dtype), beta.to(dtype), lam.to(dtype), eigvec=eigvec, **kw)
        (dk,) = torch.autograd.grad((ci.eta * 1.3).sum() + (ci.g * 0.7).sum(), [kk])
        return ci.stat, ci.eta, dk

    r64 = run(None, torch.float64)
    for name, (a, b) in zip(("stat", "eta", "dk"), zip(run(top_eigvec, torch.float32), r64)):
        out[f"prep_{name}"] = float((a.double() - b).abs().max() / (b.abs().max() + 1e-30))
    for name, (a, b) in zip(("stat", "eta", "dk"), zip(run(None, torch.float32), r64)):
        out[f"prep_{name}_torch"] = float((a.double() - b).abs().max() / (b.abs().max() + 1e-30))
    if c.get("compiled"):  # the custom operator falcon_lab::top_eigvec, what a compiled call's PyTorch prep runs
        torch._dynamo.reset()
        comp = torch.compile(lambda x: _largest_eig(x, eigvec=top_eigvec), backend="aot_eager", fullgraph=True)
        out["compiled_differs"] = float((comp(g32) - _largest_eig(g32, eigvec=top_eigvec)).abs().max())
        from falcon_lab.kernels.triton.eig import top_eigvec_op

        out["opcheck_failed"] = sum(v != "SUCCESS" for v in torch.library.opcheck(top_eigvec_op, (g32,)).values())
    return out


if __name__ == "__main__":
    run_cases(eig_case)
