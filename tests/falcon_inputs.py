"""Shared random inputs and the independent float64 spec oracle for the operator tests."""

import torch
import torch.nn.functional as F

VARIANTS = ["1", "2", "3", "1A", "2A", "3A"]


def make_inputs(variant, B=2, T=23, H=2, K=5, V=4, dtype=torch.float64, beta_range=(0.2, 1.8),
                lam_scale=1.0, norm="l2", requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    if norm == "l2":
        k = F.normalize(k, dim=-1)
        q = F.normalize(q, dim=-1)
    elif norm == "rms":
        k = k / k.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        q = q / q.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    bshape = (B, T, H, V) if variant in ("2", "2A") else (B, T, H)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(*bshape, generator=g, dtype=torch.float64)
    lam = lam_scale * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    out = [t.to(dtype) for t in (q, k, v, beta, lam)]
    if requires_grad:
        out = [t.detach().requires_grad_() for t in out]
    return out


def spec_oracle(variant, q, k, v, beta, lam, *, window=4, step="nlms", lam_mode="absolute",
                shift=True, read="after", eps=1e-6, eps_gamma=1e-4):
    """falcon-math.md §4 written out literally, one (batch, head) at a time, float64, no shared code
    with the package: per-step window index sets, eigvalsh per step, explicit sums."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    O = torch.zeros(B, T, H, V, dtype=torch.float64)
    S_final = torch.zeros(B, H, K, V, dtype=torch.float64)
    windowed = variant in ("3", "3A")
    Bw = window if windowed else 1
    for b in range(B):
        for h in range(H):
            kk = k[b, :, h].double()
            if shift:
                x = torch.cat([torch.zeros(1, K, dtype=torch.float64), kk[:-1]])
                first = 1  # 0-based index of the first valid pair
            else:
                x = kk
                first = 0
            S = torch.zeros(K, V, dtype=torch.float64)
            for t in range(T):
                Wset = list(range(max(first, t - Bw + 1), t + 1)) if t >= first else []
                if variant in ("1", "2", "1A", "2A"):
                    stat = x[t] @ x[t]
                elif not Wset:
                    stat = torch.zeros((), dtype=torch.float64)
                elif variant == "3":
                    Xw = x[Wset]
                    stat = torch.linalg.eigvalsh(Xw @ Xw.T).max() / len(Wset)
                else:
                    Xw = x[Wset]
                    stat = (Xw * Xw).sum(-1).mean()
                lam_t = lam[b, t, h].double() * stat if lam_mode == "scaled" else lam[b, t, h].double()
                bt = beta[b, t, h].double()
                if step == "nlms":
                    den = stat + lam_t + eps
                    eta = bt / den if den > 0 else bt * 0
                else:
                    eta = bt
                if not Wset:
                    eta = eta * 0
                gam = 1 - torch.clamp(eta * lam_t, max=1 - eps_gamma)
                S_prev = S
                if variant == "1":
                    S = gam * S + eta * torch.outer(x[t], v[b, t, h] - S.T @ x[t])
                elif variant == "2":
                    S = S * gam + torch.outer(x[t], eta * (v[b, t, h] - S.T @ x[t]))
                elif variant == "1A":
                    S = gam * S + eta * torch.outer(x[t], v[b, t, h])
                elif variant == "2A":
                    S = S * gam + torch.outer(x[t], eta * v[b, t, h])
                elif Wset:
                    n = len(Wset)
                    if variant == "3":
                        upd = sum(torch.outer(x[j], v[b, j, h] - S.T @ x[j]) for j in Wset)
                    else:
                        upd = sum(torch.outer(x[j], v[b, j, h]) for j in Wset)
                    S = gam * S + (eta / n) * upd
                O[b, t, h] = (S if read == "after" else S_prev).T @ q[b, t, h].double()
            S_final[b, h] = S
    return O, S_final


def rel(a, b):
    """Relative RMS error ||a - b|| / ||b||."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
