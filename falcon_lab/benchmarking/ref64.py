"""A float64 step-by-step loop of the Falcon core (docs/kernel-contract.md), written independently of
falcon_lab.kernels.reference so the Triton kernels are checked against a second implementation, and
input generators for the core checks."""

from __future__ import annotations

import torch


def ref_core(q, xw, vw, eta, g, S0, *, delta, window, read_after):
    B, T, H, K = q.shape
    V = vw.shape[-1]
    W = window
    S = S0.clone() if S0 is not None else q.new_zeros(B, H, K, V)
    per_col = eta.dim() == 4
    outs = []
    for t in range(T):
        e = t + W - 1
        gam = torch.exp(g[:, t])
        et = eta[:, t]
        gam = gam[:, :, None, :] if per_col else gam[:, :, None, None]
        et = et[:, :, None, :] if per_col else et[:, :, None, None]
        upd = 0
        for m in range(W):
            x = xw[:, e - m]
            y = vw[:, e - m]
            r = y - torch.einsum("bhkv,bhk->bhv", S, x) if delta else y
            upd = upd + x[..., :, None] * r[..., None, :]
        Sn = gam * S + et * upd
        outs.append(torch.einsum("bhkv,bhk->bhv", Sn if read_after else S, q[:, t]))
        S = Sn
    return torch.stack(outs, 1), S


def make_core_inputs(B, T, H, K, V, W, *, strong=False, per_col=False, seed=0, device="cpu"):
    """Random core inputs in float64: unit-scale keys, η in [0, 1.5/W), log γ in [lo, 0], the shift
    sentinel at t = 0 (η = 0, γ = 1). strong=True lets γ fall to 0.25 (falcon-math.md §6.4)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = r(B, T, H, K) / K ** 0.5
    xw = r(B, T + W - 1, H, K) / K ** 0.5
    vw = r(B, T + W - 1, H, V)
    es = (B, T, H, V) if per_col else (B, T, H)
    eta = torch.rand(*es, generator=gen, dtype=torch.float64) * 1.5 / W
    lo = -1.4 if strong else -0.1
    g = torch.rand(*es, generator=gen, dtype=torch.float64) * lo
    eta[:, 0] = 0.0
    g[:, 0] = 0.0
    S0 = r(B, H, K, V) * 0.3
    return [t.to(device) for t in (q, xw, vw, eta, g, S0)]


def rel_err(a, b) -> float:
    a = a.detach().double()
    b = b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
