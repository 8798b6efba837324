"""The shared pre-step of every backend: pairs, window statistic, NLMS step, decay (kernel-contract.md).

Plain differentiable PyTorch: the chain rules of the shift, the NLMS division, the clamp and the
window spectral norm μ_t (through `eigvalsh`) are autograd's. Notation follows falcon-math.md §4:
position t (1-based) writes the pair (x_t, y_t) = (φ(k_{t-1}), v_t) (shift) or (φ(k_t), v_t).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .spec import SPECS, FalconSpec

# variant name -> FalconSpec (delta, per_column, windowed): the one encoding of a variant (spec.py)
VARIANTS = SPECS


@dataclass
class CoreInputs:
    xw: torch.Tensor  # [B, T+W-1, H, K] pair keys (first W-1 rows: carried tail)
    vw: torch.Tensor  # [B, T+W-1, H, V] pair values
    eta: torch.Tensor  # [B, T, H] or [B, T, H, V]: step (already / B_t for windows), 0 where no pair
    g: torch.Tensor  # same shape: log γ_t <= 0
    stat: torch.Tensor  # [B, T, H]: E_t, μ_t or Ē_t (diagnostics)


def effective_window(variant: str, window: int) -> int:
    return FalconSpec.from_variant(variant).window(window)


def prepare(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    variant: str,
    window: int,
    step: str,
    lam_mode: str,
    shift: bool,
    eps: float,
    eps_gamma: float,
    seen: torch.Tensor,  # [B] int64 tokens already consumed by each row
    last_k: Optional[torch.Tensor] = None,  # [B, H, K]
    tail_x: Optional[torch.Tensor] = None,  # [B, W-1, H, K]
    tail_v: Optional[torch.Tensor] = None,  # [B, W-1, H, V]
    valid: Optional[torch.Tensor] = None,  # [B, T] bool: False on right padding (varlen)
) -> CoreInputs:
    spec = FalconSpec.from_variant(variant)
    per_column, windowed = spec.per_column, spec.windowed
    W = spec.window(window)
    Bsz, T, H, K = k.shape
    V = v.shape[-1]
    cd = torch.float64 if k.dtype == torch.float64 else torch.float32

    # ---- the pair stream ------------------------------------------------------------------
    pos = seen.to(k.device)[:, None] + torch.arange(1, T + 1, device=k.device)  # global 1-based
    if shift:
        prev = last_k if last_k is not None else k.new_zeros(Bsz, H, K)
        x = torch.cat([prev[:, None].to(k.dtype), k[:, :-1]], dim=1)
        n_pairs = pos - 1  # pairs written up to and including t
    else:
        x = k
        n_pairs = pos
    has_pair = n_pairs > 0  # [B, T]
    x = x * has_pair[..., None, None].to(x.dtype)  # the x_1 = 0 sentinel, in feature space
    if W > 1:
        tx = tail_x if tail_x is not None else k.new_zeros(Bsz, W - 1, H, K)
        tv = tail_v if tail_v is not None else v.new_zeros(Bsz, W - 1, H, V)
        xw = torch.cat([tx.to(k.dtype), x], dim=1)
        vw = torch.cat([tv.to(v.dtype), v], dim=1)
    else:
        xw, vw = x, v
    count = n_pairs.clamp(min=0, max=W).to(cd)  # B_t: pairs in the window at t

    # ---- the statistic E_t / μ_t / Ē_t ------------------------------------------------------
    xc = xw.to(cd)
    if not windowed:
        stat = (xc[:, W - 1:] ** 2).sum(-1)  # E_t = ||x_t||²   [B, T, H]
    else:
        win = xc.unfold(1, W, 1)  # [B, T, H, K, W]: pairs t..t+W-1 of the extended stream
        if not spec.delta:  # 3A: mean window energy
            stat = (win ** 2).sum((-2, -1)) / count.clamp(min=1)[..., None]  # Ē_t
        else:  # "3": top eigenvalue of the W x W window Gram (zero rows add zero eigenvalues)
            gram = win.transpose(-1, -2) @ win  # [B, T, H, W, W]
            stat = _largest_eig(gram) / count.clamp(min=1)[..., None]  # μ_t

    # ---- λ_t, η_t, γ_t ----------------------------------------------------------------------
    lam_c = lam.to(cd)
    if lam_mode == "scaled":
        lam_t = lam_c * (stat.detach() if windowed else stat)
    else:
        lam_t = lam_c
    beta_c = beta.to(cd)
    if step == "nlms":
        den = stat + lam_t + eps
        if per_column:
            den = den[..., None]
        ok = den > 0
        eta = torch.where(ok, beta_c / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(den))
    else:
        eta = beta_c
    keep = has_pair if valid is None else has_pair & valid
    keep = keep[..., None] if not per_column else keep[..., None, None]
    eta = torch.where(keep, eta, torch.zeros_like(eta))
    lam_b = lam_t[..., None] if per_column else lam_t
    alpha = torch.clamp(eta * lam_b, max=1.0 - eps_gamma)
    g = torch.log1p(-alpha)
    if windowed:
        eta = eta / count.clamp(min=1)[..., None]
    return CoreInputs(xw=xw, vw=vw, eta=eta, g=g, stat=stat)


def _largest_eig(gram: torch.Tensor, max_batch: int = 32768) -> torch.Tensor:
    """Largest eigenvalue of each symmetric [.., B, B] matrix, exact (eigvalsh). In fp32 at least (CUDA
    has no bf16 eigh) and in batches of at most `max_batch` matrices: cuSOLVER's batched syevj failed
    with CUSOLVER_STATUS_INTERNAL_ERROR on the H200 once a call held ~1e5 matrices (ours).
    While a CUDA graph is being captured, cuSOLVER cannot run (it checks its status on the host), so
    the cyclic Jacobi method with a fixed number of sweeps is used instead: the same value to rounding
    for these tiny windows, with no host synchronisation (ours)."""
    g = gram if gram.dtype in (torch.float32, torch.float64) else gram.float()
    if g.is_cuda and torch.cuda.is_current_stream_capturing():
        return _jacobi_top_eig(g).to(gram.dtype)
    flat = g.reshape(-1, g.shape[-2], g.shape[-1])
    if flat.shape[0] <= max_batch:
        top = torch.linalg.eigvalsh(flat)[..., -1]
    else:
        top = torch.cat([torch.linalg.eigvalsh(c)[..., -1] for c in flat.split(max_batch)])
    return top.reshape(g.shape[:-2]).to(gram.dtype)


def _jacobi_top_eig(a: torch.Tensor, sweeps: int = 10) -> torch.Tensor:
    """Largest eigenvalue of symmetric [.., n, n] matrices by cyclic Jacobi rotations (Golub & Van Loan,
    Matrix Computations, §8.5): each rotation zeroes one off-diagonal pair; convergence is quadratic, so
    a fixed number of sweeps (no data-dependent control flow, hence graph-capturable) reaches rounding
    level for the window sizes used here (n = B <= 16)."""
    n = a.shape[-1]
    if n == 1:
        return a[..., 0, 0]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    tiny = torch.finfo(a.dtype).tiny
    # J(p, q) = I + (c - 1)(e_p e_pᵀ + e_q e_qᵀ) + s(e_p e_qᵀ - e_q e_pᵀ): its constant parts, once per pair
    pairs = []
    for p in range(n - 1):
        for q in range(p + 1, n):
            diag, skew = torch.zeros_like(eye), torch.zeros_like(eye)
            diag[p, p] = diag[q, q] = 1
            skew[p, q], skew[q, p] = 1, -1
            pairs.append((p, q, diag, skew))
    for _ in range(sweeps):
        for p, q, diag, skew in pairs:
            app, aqq, apq = a[..., p, p], a[..., q, q], a[..., p, q]
            off = apq.abs() > tiny
            safe = torch.where(off, apq, torch.ones_like(apq))
            tau = (aqq - app) / (2 * safe)
            sgn = torch.where(tau >= 0, torch.ones_like(tau), -torch.ones_like(tau))
            t = torch.where(off, sgn / (tau.abs() + torch.sqrt(1 + tau * tau)), torch.zeros_like(tau))
            c = torch.rsqrt(1 + t * t)
            j = eye + (c - 1)[..., None, None] * diag + (t * c)[..., None, None] * skew
            a = j.transpose(-1, -2) @ a @ j
    return a.diagonal(dim1=-2, dim2=-1).amax(-1)
