"""The op's prep for window 1 (Falcon-1, -1A, -2, -2A) as one Triton kernel forward and one backward (ours);
Falcon-3A's (window > 1) is prep_window.py.

Computes exactly what `falcon_lab/kernels/prep.py` computes for W = 1 (docs/kernel-contract.md, falcon-math.md §4),
row by row over the B·T·H rows:

    x_t   = φ(k_{t-1}) (shift; x_1 = the carried last key or 0) or φ(k_t),  zeroed where no pair exists yet
    E_t   = ||x_t||²                                   (fp32)
    λ_t   = lam_t · E_t (lam_mode "scaled") or lam_t   ("absolute")
    η_t   = β_t / (E_t + λ_t + eps) where that is > 0, else 0 (step "nlms"); β_t (step "direct");
            0 where no pair exists or the row is padding        (per value channel for 2 / 2A: β_t is [V])
    log γ_t = log1p(-min(η_t λ_t, 1 - eps_gamma))

and the chain rule of all of it in the backward (dk, dβ, dλ and the carried last key's gradient from dx, dη,
d log γ), recomputing x, E and η from k rather than saving them. The PyTorch prep is ~90 small kernels and as many
host dispatches per forward+backward; at (16, 2048, 12, 64) on the H200 the op is bound by that host time
(experiments/h200/host_bound.py). Used in plain eager calls of the Triton backend (`core`'s eager rule, ops.py);
under torch.compile the PyTorch prep is traced and fused by Inductor instead.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .chunk import _empty, _np2
from .host import cdiv


@triton.jit
def _row_state(K_, LASTK, VALID, SEEN, lam, r, rmask, ck, kmask, b, t, h, T, H: tl.constexpr, K: tl.constexpr,
               SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr, HAS_VALID: tl.constexpr, SCALED: tl.constexpr, eps):
    """x [BR, BK] fp32 (the pair key), hp [BR] (a pair exists), keep (a pair and not padding), E, λ_t and the NLMS
    denominator [BR]: shared by both directions."""
    seen = tl.load(SEEN + b, mask=rmask, other=0)
    n_pairs = seen + t + 1 - SHIFT  # pairs written up to and including t (1-based positions)
    hp = n_pairs > 0
    if SHIFT:
        src = K_ + (r - H)[:, None] * K + ck[None, :]
        x = tl.load(src, mask=(rmask & (t >= 1))[:, None] & kmask[None, :], other=0.).to(tl.float32)
        if HAS_LASTK:
            lk = LASTK + (b * H + h)[:, None] * K + ck[None, :]
            x += tl.load(lk, mask=(rmask & (t == 0))[:, None] & kmask[None, :], other=0.).to(tl.float32)
    else:
        x = tl.load(K_ + r[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.).to(tl.float32)
    x = tl.where(hp[:, None], x, 0.)
    E = tl.sum(x * x, 1)
    if SCALED:
        lam_t = lam * E
    else:
        lam_t = lam
    keep = hp & rmask
    if HAS_VALID:
        keep = keep & (tl.load(VALID + b * T + t, mask=rmask, other=0) != 0)
    den = E + lam_t + eps
    return x, hp, keep, E, lam_t, den


@triton.jit
def _log1m(a):
    """log(1 - a) to fp32 relative accuracy for small a as well (torch's log1p(-a)): Goldberg's correction
    log(u) · (-a) / (u - 1) with u = 1 - a rounded."""
    u = 1. - a
    return tl.where(u == 1., -a, tl.log(u) * (-a) / (u - 1.))


@triton.jit
def _prep_fwd(K_, BETA, LAM, LASTK, VALID, SEEN, X, ETA, G, STAT, N, T, eps, eps_gamma,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, PERCOL: tl.constexpr, SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr,
              HAS_VALID: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = r < N
    h = r % H
    t = (r // H) % T
    b = r // (H * T)
    ck = tl.arange(0, BK)
    kmask = ck < K
    lam = tl.load(LAM + r, mask=rmask, other=0.).to(tl.float32)
    x, hp, keep, E, lam_t, den = _row_state(K_, LASTK, VALID, SEEN, lam, r, rmask, ck, kmask, b, t, h, T, H, K,
                                            SHIFT, HAS_LASTK, HAS_VALID, SCALED, eps)
    tl.store(X + r[:, None] * K + ck[None, :], x.to(X.dtype.element_ty), mask=rmask[:, None] & kmask[None, :])
    tl.store(STAT + r, E, mask=rmask)
    ok = den > 0
    if PERCOL:
        cv = tl.arange(0, BV)
        m2 = rmask[:, None] & (cv < V)[None, :]
        beta = tl.load(BETA + r[:, None] * V + cv[None, :], mask=m2, other=0.).to(tl.float32)
        if NLMS:
            eta = tl.where(ok[:, None], beta / tl.where(ok, den, 1.)[:, None], 0.)
        else:
            eta = beta
        eta = tl.where(keep[:, None], eta, 0.)
        alpha = tl.minimum(eta * lam_t[:, None], 1. - eps_gamma)
        tl.store(ETA + r[:, None] * V + cv[None, :], eta, mask=m2)
        tl.store(G + r[:, None] * V + cv[None, :], _log1m(alpha), mask=m2)
    else:
        beta = tl.load(BETA + r, mask=rmask, other=0.).to(tl.float32)
        if NLMS:
            eta = tl.where(ok, beta / tl.where(ok, den, 1.), 0.)
        else:
            eta = beta
        eta = tl.where(keep, eta, 0.)
        alpha = tl.minimum(eta * lam_t, 1. - eps_gamma)
        tl.store(ETA + r, eta, mask=rmask)
        tl.store(G + r, _log1m(alpha), mask=rmask)


@triton.jit
def _prep_bwd(K_, BETA, LAM, LASTK, VALID, SEEN, DX, DETA, DG, DK, DBETA, DLAM, DLASTK, N, T, eps, eps_gamma,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, PERCOL: tl.constexpr, SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr,
              HAS_VALID: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr, NEED_DLASTK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = r < N
    h = r % H
    t = (r // H) % T
    b = r // (H * T)
    ck = tl.arange(0, BK)
    kmask = ck < K
    lam = tl.load(LAM + r, mask=rmask, other=0.).to(tl.float32)
    x, hp, keep, E, lam_t, den = _row_state(K_, LASTK, VALID, SEEN, lam, r, rmask, ck, kmask, b, t, h, T, H, K,
                                            SHIFT, HAS_LASTK, HAS_VALID, SCALED, eps)
    ok = den > 0
    safe_den = tl.where(ok, den, 1.)
    hi = 1. - eps_gamma
    if PERCOL:
        cv = tl.arange(0, BV)
        m2 = rmask[:, None] & (cv < V)[None, :]
        off = r[:, None] * V + cv[None, :]
        beta = tl.load(BETA + off, mask=m2, other=0.).to(tl.float32)
        if NLMS:
            eta = tl.where(ok[:, None], beta / safe_den[:, None], 0.)
        else:
            eta = beta
        eta = tl.where(keep[:, None], eta, 0.)
        a = eta * lam_t[:, None]
        alpha = tl.minimum(a, hi)
        deta = tl.load(DETA + off, mask=m2, other=0.)
        dg = tl.load(DG + off, mask=m2, other=0.)
        da = tl.where(a <= hi, -dg / (1. - alpha), 0.)
        de0 = tl.where(keep[:, None], deta + da * lam_t[:, None], 0.)
        dlam_t = tl.sum(da * eta, 1)
        if NLMS:
            dbeta = tl.where(ok[:, None], de0 / safe_den[:, None], 0.)
            dden = tl.sum(tl.where(ok[:, None], -de0 * eta, 0.), 1) / safe_den
        else:
            dbeta = de0
            dden = tl.zeros([BR], dtype=tl.float32)
        tl.store(DBETA + off, dbeta.to(DBETA.dtype.element_ty), mask=m2)
    else:
        beta = tl.load(BETA + r, mask=rmask, other=0.).to(tl.float32)
        if NLMS:
            eta = tl.where(ok, beta / safe_den, 0.)
        else:
            eta = beta
        eta = tl.where(keep, eta, 0.)
        a = eta * lam_t
        alpha = tl.minimum(a, hi)
        deta = tl.load(DETA + r, mask=rmask, other=0.)
        dg = tl.load(DG + r, mask=rmask, other=0.)
        da = tl.where(a <= hi, -dg / (1. - alpha), 0.)
        de0 = tl.where(keep, deta + da * lam_t, 0.)
        dlam_t = da * eta
        if NLMS:
            dbeta = tl.where(ok, de0 / safe_den, 0.)
            dden = tl.where(ok, -de0 * eta, 0.) / safe_den
        else:
            dbeta = de0
            dden = tl.zeros([BR], dtype=tl.float32)
        tl.store(DBETA + r, dbeta.to(DBETA.dtype.element_ty), mask=rmask)
    dE = dden
    if NLMS:
        dlam_t += dden
    if SCALED:
        dlam = dlam_t * E
        dE += dlam_t * lam
    else:
        dlam = dlam_t
    tl.store(DLAM + r, dlam.to(DLAM.dtype.element_ty), mask=rmask)
    m2k = rmask[:, None] & kmask[None, :]
    dx = tl.load(DX + r[:, None] * K + ck[None, :], mask=m2k, other=0.).to(tl.float32)
    dsrc = tl.where(hp[:, None], dx + 2. * x * dE[:, None], 0.)
    if SHIFT:  # x_t = k_{t-1}: row t's gradient is k's row t-1 (t = 0: the carried last key); k's last row gets 0
        tl.store(DK + (r - H)[:, None] * K + ck[None, :], dsrc.to(DK.dtype.element_ty),
                 mask=m2k & (t >= 1)[:, None])
        tl.store(DK + r[:, None] * K + ck[None, :], tl.zeros([BR, BK], dtype=tl.float32).to(DK.dtype.element_ty),
                 mask=m2k & (t == T - 1)[:, None])
        if NEED_DLASTK:
            tl.store(DLASTK + (b * H + h)[:, None] * K + ck[None, :], dsrc.to(DLASTK.dtype.element_ty),
                     mask=m2k & (t == 0)[:, None])
    else:
        tl.store(DK + r[:, None] * K + ck[None, :], dsrc.to(DK.dtype.element_ty), mask=m2k)


def _block_rows(BK: int, BV: int) -> int:
    return max(16, min(128, 4096 // max(BK, BV)))


class _FusedPrep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, beta, lam, last_k, seen, valid, cfg):
        shift, nlms, scaled, eps, eps_gamma = cfg
        B, T, H, K = k.shape
        per_col = beta.dim() == 4
        V = beta.shape[-1] if per_col else 1
        N = B * T * H
        BK, BV = _np2(K), (_np2(V) if per_col else 1)
        BR = _block_rows(BK, BV)
        dev = k.device
        x = _empty(k.shape, k.dtype, dev)
        eta = _empty(beta.shape, torch.float32, dev)
        g = _empty(beta.shape, torch.float32, dev)
        stat = _empty((B, T, H), torch.float32, dev)
        _prep_fwd[(cdiv(N, BR),)](
            k, beta, lam, last_k if last_k is not None else k, valid if valid is not None else seen, seen,
            x, eta, g, stat, N, T, eps, eps_gamma, H, K, V, BR, BK, BV, per_col, shift, last_k is not None,
            valid is not None, nlms, scaled)
        ctx.save_for_backward(k, beta, lam, last_k, seen, valid)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(stat)
        ctx.set_materialize_grads(False)
        return x, eta, g, stat

    @staticmethod
    def backward(ctx, dx, deta, dg, _dstat):
        k, beta, lam, last_k, seen, valid = ctx.saved_tensors
        shift, nlms, scaled, eps, eps_gamma = ctx.cfg
        B, T, H, K = k.shape
        per_col = beta.dim() == 4
        V = beta.shape[-1] if per_col else 1
        N = B * T * H
        BK, BV = _np2(K), (_np2(V) if per_col else 1)
        BR = _block_rows(BK, BV)
        dev = k.device
        dx = dx.contiguous() if dx is not None else torch.zeros_like(k)
        deta = deta.float().contiguous() if deta is not None else torch.zeros(beta.shape, device=dev)
        dg = dg.float().contiguous() if dg is not None else torch.zeros(beta.shape, device=dev)
        dk = _empty(k.shape, k.dtype, dev)
        dbeta = _empty(beta.shape, beta.dtype, dev)
        dlam = _empty(lam.shape, lam.dtype, dev)
        need_dlast = shift and last_k is not None and ctx.needs_input_grad[3]  # unused without the shift
        dlast = _empty(last_k.shape, last_k.dtype, dev) if need_dlast else None
        _prep_bwd[(cdiv(N, BR),)](
            k, beta, lam, last_k if last_k is not None else k, valid if valid is not None else seen, seen,
            dx, deta, dg, dk, dbeta, dlam, dlast if dlast is not None else dk, N, T, eps, eps_gamma,
            H, K, V, BR, BK, BV, per_col, shift, last_k is not None, valid is not None, nlms, scaled, need_dlast)
        return dk, dbeta, dlam, dlast, None, None, None


def fused_prepare(k, v, beta, lam, *, shift: bool, step: str, lam_mode: str, eps: float, eps_gamma: float,
                  seen: torch.Tensor, last_k: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None,
                  window: int = 1, tail_x: Optional[torch.Tensor] = None, tail_v: Optional[torch.Tensor] = None):
    """`prep.prepare` for window 1 (variants 1, 1A, 2, 2A; xw = x, vw = v) or, window > 1, for Falcon-3A
    (prep_window.py): the same CoreInputs."""
    from ..prep import CoreInputs

    if window > 1:
        from .prep_window import fused_window_prepare

        return fused_window_prepare(k, v, beta, lam, window=window, shift=shift, step=step, lam_mode=lam_mode, eps=eps,
                                    eps_gamma=eps_gamma, seen=seen, last_k=last_k, tail_x=tail_x, tail_v=tail_v,
                                    valid=valid)

    cfg = (bool(shift), step == "nlms", lam_mode == "scaled", float(eps), float(eps_gamma))
    last = last_k.to(k.dtype).contiguous() if last_k is not None else None
    x, eta, g, stat = _FusedPrep.apply(k.contiguous(), beta.contiguous(), lam.contiguous(), last,
                                       seen.to(device=k.device, dtype=torch.int64).contiguous(),
                                       valid.to(torch.int8).contiguous() if valid is not None else None, cfg)
    return CoreInputs(xw=x, vw=v, eta=eta, g=g, stat=stat)
