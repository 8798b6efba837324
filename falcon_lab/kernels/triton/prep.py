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

from .common import _empty, _np2, cdiv


@triton.jit
def _rows(N, T, H: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """This program's BR rows r = (b·T + t)·H + h of the B·T·H rows, with (b, t, h), and the key columns."""
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    ck = tl.arange(0, BK)
    return r, r < N, r // (H * T), (r // H) % T, r % H, ck, ck < K


@triton.jit
def _pair_x(K_, LASTK, TAILX, SEEN, tp, b, h, rmask, ck, kmask, T, H: tl.constexpr, K: tl.constexpr,
            W: tl.constexpr, SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr, HAS_TAIL: tl.constexpr):
    """The pair key of position tp (0-based, a [BR] vector; tp < 0: the carried tail row tp + W - 1), fp32 [BR, BK],
    zero where no pair exists, and whether a pair exists (at tp >= 0): x_t = φ(k_{t-1}) with the shift (x_0 the
    carried last key, or 0), else φ(k_t)."""
    seen = tl.load(SEEN + b, mask=rmask, other=0)
    hp = (seen + tp + 1 - SHIFT) > 0  # pairs written up to and including tp (1-based positions)
    inb = rmask & (tp >= 0)
    row = (b * T + tp) * H + h
    kcol = kmask[None, :]
    if SHIFT:
        x = tl.load(K_ + (row - H)[:, None] * K + ck[None, :], mask=(inb & (tp >= 1))[:, None] & kcol,
                    other=0.).to(tl.float32)
        if HAS_LASTK:
            x += tl.load(LASTK + (b * H + h)[:, None] * K + ck[None, :], mask=(inb & (tp == 0))[:, None] & kcol,
                         other=0.).to(tl.float32)
    else:
        x = tl.load(K_ + row[:, None] * K + ck[None, :], mask=inb[:, None] & kcol, other=0.).to(tl.float32)
    x = tl.where((hp & (tp >= 0))[:, None], x, 0.)
    if HAS_TAIL:
        trow = (b * (W - 1) + tp + W - 1) * H + h
        x += tl.load(TAILX + trow[:, None] * K + ck[None, :], mask=(rmask & (tp < 0))[:, None] & kcol,
                     other=0.).to(tl.float32)
    return x, hp


@triton.jit
def _pair_x_packed(K_, LASTK, SEEN, SEQ, CU, t, h, rmask, ck, kmask, H: tl.constexpr, K: tl.constexpr,
                   SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr):
    """_pair_x for packed sequences (B = 1, window 1; ours): token t of sequence s = SEQ[t] starting at CU[s]; the
    shift and the positions restart there (its x the carried last key of s, or 0). Also returns (s, the offset in s,
    whether t is s's last token)."""
    s = tl.load(SEQ + t, mask=rmask, other=0)
    bos = tl.load(CU + s, mask=rmask, other=0)
    loc = t - bos
    last = t == tl.load(CU + s + 1, mask=rmask, other=0) - 1
    hp = (tl.load(SEEN + s, mask=rmask, other=0) + loc + 1 - SHIFT) > 0
    row = t * H + h
    kcol = kmask[None, :]
    if SHIFT:
        x = tl.load(K_ + (row - H)[:, None] * K + ck[None, :], mask=(rmask & (loc >= 1))[:, None] & kcol,
                    other=0.).to(tl.float32)
        if HAS_LASTK:
            x += tl.load(LASTK + (s * H + h)[:, None] * K + ck[None, :], mask=(rmask & (loc == 0))[:, None] & kcol,
                         other=0.).to(tl.float32)
    else:
        x = tl.load(K_ + row[:, None] * K + ck[None, :], mask=rmask[:, None] & kcol, other=0.).to(tl.float32)
    return tl.where(hp[:, None], x, 0.), hp, s, loc, last


@triton.jit
def _keep(VALID, hp, rmask, b, t, T, HAS_VALID: tl.constexpr):
    """A pair exists at t and t is not right padding (varlen)."""
    keep = hp & rmask
    if HAS_VALID:
        keep = keep & (tl.load(VALID + b * T + t, mask=rmask, other=0) != 0)
    return keep


@triton.jit
def _log1m(a):
    """log(1 - a) to fp32 relative accuracy for small a as well (torch's log1p(-a)): Goldberg's correction
    log(u) · (-a) / (u - 1) with u = 1 - a rounded."""
    u = 1. - a
    return tl.where(u == 1., -a, tl.log(u) * (-a) / (u - 1.))


@triton.jit
def _step(beta, den, keep, lam_t, eps_gamma, NLMS: tl.constexpr):
    """η (β / den for NLMS, 0 where den <= 0, without a pair or on padding), the clamp's argument η λ and α = its
    clamp at 1 - ε_γ. Shapes broadcast: [BR] for scalar gates, [BR, BV] with den, keep, λ as [BR, 1] per column."""
    if NLMS:
        ok = den > 0
        eta = tl.where(ok, beta / tl.where(ok, den, 1.), 0.)
    else:
        eta = beta
    eta = tl.where(keep, eta, 0.)
    a = eta * lam_t
    return eta, a, tl.minimum(a, 1. - eps_gamma)


@triton.jit
def _step_bwd(deta, dg, eta, a, alpha, den, keep, lam_t, eps_gamma, NLMS: tl.constexpr):
    """_step's chain rule: from dη and d log γ (log γ = log1p(-α)) to dβ, the denominator's gradient and λ_t's
    (per element: per-column callers sum the last two over the columns)."""
    da = tl.where(a <= 1. - eps_gamma, -dg / (1. - alpha), 0.)
    de0 = tl.where(keep, deta + da * lam_t, 0.)
    dlam_t = da * eta
    if NLMS:
        ok = den > 0
        safe = tl.where(ok, den, 1.)
        dbeta = tl.where(ok, de0 / safe, 0.)
        dden = tl.where(ok, -de0 * eta, 0.) / safe
    else:
        dbeta = de0
        dden = tl.zeros_like(de0)
    return dbeta, dden, dlam_t


@triton.jit
def _store_key_grads(DK, DLASTK, dsrc, r, rmask, b, t, h, ck, kmask, T, H: tl.constexpr, K: tl.constexpr,
                     SHIFT: tl.constexpr, NEED_DLASTK: tl.constexpr):
    """dk from the pair rows' gradients dsrc: x_t = k_{t-1} with the shift (row t's gradient is k's row t - 1, row 0's
    the carried last key's, k's last row gets 0), else k's row t."""
    m2k = rmask[:, None] & kmask[None, :]
    if SHIFT:
        tl.store(DK + (r - H)[:, None] * K + ck[None, :], dsrc.to(DK.dtype.element_ty), mask=m2k & (t >= 1)[:, None])
        tl.store(DK + r[:, None] * K + ck[None, :], tl.zeros_like(dsrc).to(DK.dtype.element_ty),
                 mask=m2k & (t == T - 1)[:, None])
        if NEED_DLASTK:
            tl.store(DLASTK + (b * H + h)[:, None] * K + ck[None, :], dsrc.to(DLASTK.dtype.element_ty),
                     mask=m2k & (t == 0)[:, None])
    else:
        tl.store(DK + r[:, None] * K + ck[None, :], dsrc.to(DK.dtype.element_ty), mask=m2k)


@triton.jit
def _store_key_grads_packed(DK, DLASTK, dsrc, r, rmask, s, loc, last, h, ck, kmask, H: tl.constexpr, K: tl.constexpr,
                            SHIFT: tl.constexpr, NEED_DLASTK: tl.constexpr):
    """_store_key_grads for packed sequences: with the shift, row t's gradient is k's row t - 1 inside its sequence, a
    sequence's first row's the carried last key's of that sequence, and each sequence's last key gets 0."""
    m2k = rmask[:, None] & kmask[None, :]
    if SHIFT:
        tl.store(DK + (r - H)[:, None] * K + ck[None, :], dsrc.to(DK.dtype.element_ty), mask=m2k & (loc >= 1)[:, None])
        tl.store(DK + r[:, None] * K + ck[None, :], tl.zeros_like(dsrc).to(DK.dtype.element_ty),
                 mask=m2k & last[:, None])
        if NEED_DLASTK:
            tl.store(DLASTK + (s * H + h)[:, None] * K + ck[None, :], dsrc.to(DLASTK.dtype.element_ty),
                     mask=m2k & (loc == 0)[:, None])
    else:
        tl.store(DK + r[:, None] * K + ck[None, :], dsrc.to(DK.dtype.element_ty), mask=m2k)


@triton.jit
def _w1_row(K_, LAM, LASTK, VALID, SEEN, r, rmask, b, t, h, ck, kmask, T, eps, H: tl.constexpr, K: tl.constexpr,
            SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr, HAS_VALID: tl.constexpr, SCALED: tl.constexpr, SEQ, CU,
            VARLEN: tl.constexpr):
    """Window 1, both directions: the pair key x, its flags, E = ||x||², lam, λ_t and the NLMS denominator (and, for
    packed sequences, the token's (sequence, offset, is-last) for the key gradients; else placeholders)."""
    if VARLEN:
        x, hp, s, loc, last = _pair_x_packed(K_, LASTK, SEEN, SEQ, CU, t, h, rmask, ck, kmask, H, K, SHIFT, HAS_LASTK)
        keep = hp & rmask
    else:
        x, hp = _pair_x(K_, LASTK, K_, SEEN, t, b, h, rmask, ck, kmask, T, H, K, 1, SHIFT, HAS_LASTK, False)
        keep = _keep(VALID, hp, rmask, b, t, T, HAS_VALID)
        s = b
        loc = t
        last = hp
    E = tl.sum(x * x, 1)
    lam = tl.load(LAM + r, mask=rmask, other=0.).to(tl.float32)
    if SCALED:
        lam_t = lam * E
    else:
        lam_t = lam
    return x, hp, keep, E, lam, lam_t, E + lam_t + eps, s, loc, last


@triton.jit
def _prep_fwd(K_, BETA, LAM, LASTK, VALID, SEEN, X, ETA, G, STAT, N, T, eps, eps_gamma,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, PERCOL: tl.constexpr, SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr,
              HAS_VALID: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr, SEQ, CU, VARLEN: tl.constexpr):
    r, rmask, b, t, h, ck, kmask = _rows(N, T, H, K, BR, BK)
    x, hp, keep, E, lam, lam_t, den, s, loc, last = _w1_row(K_, LAM, LASTK, VALID, SEEN, r, rmask, b, t, h, ck, kmask,
                                                            T, eps, H, K, SHIFT, HAS_LASTK, HAS_VALID, SCALED, SEQ, CU,
                                                            VARLEN)
    tl.store(X + r[:, None] * K + ck[None, :], x.to(X.dtype.element_ty), mask=rmask[:, None] & kmask[None, :])
    tl.store(STAT + r, E, mask=rmask)
    if PERCOL:
        cv = tl.arange(0, BV)
        m2 = rmask[:, None] & (cv < V)[None, :]
        off = r[:, None] * V + cv[None, :]
        beta = tl.load(BETA + off, mask=m2, other=0.).to(tl.float32)
        eta, a, alpha = _step(beta, den[:, None], keep[:, None], lam_t[:, None], eps_gamma, NLMS)
        tl.store(ETA + off, eta, mask=m2)
        tl.store(G + off, _log1m(alpha), mask=m2)
    else:
        beta = tl.load(BETA + r, mask=rmask, other=0.).to(tl.float32)
        eta, a, alpha = _step(beta, den, keep, lam_t, eps_gamma, NLMS)
        tl.store(ETA + r, eta, mask=rmask)
        tl.store(G + r, _log1m(alpha), mask=rmask)


@triton.jit
def _prep_bwd(K_, BETA, LAM, LASTK, VALID, SEEN, DX, DETA, DG, DK, DBETA, DLAM, DLASTK, N, T, eps, eps_gamma,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, PERCOL: tl.constexpr, SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr,
              HAS_VALID: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr, NEED_DLASTK: tl.constexpr, SEQ, CU,
              VARLEN: tl.constexpr):
    r, rmask, b, t, h, ck, kmask = _rows(N, T, H, K, BR, BK)
    x, hp, keep, E, lam, lam_t, den, s, loc, last = _w1_row(K_, LAM, LASTK, VALID, SEEN, r, rmask, b, t, h, ck, kmask,
                                                            T, eps, H, K, SHIFT, HAS_LASTK, HAS_VALID, SCALED, SEQ, CU,
                                                            VARLEN)
    if PERCOL:
        cv = tl.arange(0, BV)
        m2 = rmask[:, None] & (cv < V)[None, :]
        off = r[:, None] * V + cv[None, :]
        beta = tl.load(BETA + off, mask=m2, other=0.).to(tl.float32)
        eta, a, alpha = _step(beta, den[:, None], keep[:, None], lam_t[:, None], eps_gamma, NLMS)
        dbeta, dden, dlam_t = _step_bwd(tl.load(DETA + off, mask=m2, other=0.), tl.load(DG + off, mask=m2, other=0.),
                                        eta, a, alpha, den[:, None], keep[:, None], lam_t[:, None], eps_gamma, NLMS)
        dden = tl.sum(dden, 1)
        dlam_t = tl.sum(dlam_t, 1)
        tl.store(DBETA + off, dbeta.to(DBETA.dtype.element_ty), mask=m2)
    else:
        beta = tl.load(BETA + r, mask=rmask, other=0.).to(tl.float32)
        eta, a, alpha = _step(beta, den, keep, lam_t, eps_gamma, NLMS)
        dbeta, dden, dlam_t = _step_bwd(tl.load(DETA + r, mask=rmask, other=0.), tl.load(DG + r, mask=rmask, other=0.),
                                        eta, a, alpha, den, keep, lam_t, eps_gamma, NLMS)
        tl.store(DBETA + r, dbeta.to(DBETA.dtype.element_ty), mask=rmask)
    dlam_t += dden  # den = E + λ_t + eps
    dE = dden
    if SCALED:  # λ_t = lam · E
        dlam = dlam_t * E
        dE += dlam_t * lam
    else:
        dlam = dlam_t
    tl.store(DLAM + r, dlam.to(DLAM.dtype.element_ty), mask=rmask)
    dx = tl.load(DX + r[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.).to(tl.float32)
    dsrc = tl.where(hp[:, None], dx + 2. * x * dE[:, None], 0.)
    if VARLEN:
        _store_key_grads_packed(DK, DLASTK, dsrc, r, rmask, s, loc, last, h, ck, kmask, H, K, SHIFT, NEED_DLASTK)
    else:
        _store_key_grads(DK, DLASTK, dsrc, r, rmask, b, t, h, ck, kmask, T, H, K, SHIFT, NEED_DLASTK)


def _block_rows(BK: int, BV: int) -> int:
    return max(16, min(128, 4096 // max(BK, BV)))


def _geometry(k, beta):
    """B, T, H, K, V (1 for scalar gates), per-column, rows, the key and value tiles and the rows per program."""
    B, T, H, K = k.shape
    per_col = beta.dim() == 4
    V = beta.shape[-1] if per_col else 1
    BK, BV = _np2(K), (_np2(V) if per_col else 1)
    return B, T, H, K, V, per_col, B * T * H, BK, BV, _block_rows(BK, BV)


def w1_prep_forward(k, beta, lam, last_k, seen, valid, seq, cu, cfg):
    """The forward kernel of one window-1 call: (x, eta, g, stat). cfg = (shift, nlms, scaled, eps, eps_gamma);
    seq, cu: packed sequences (token -> sequence, offsets) or None."""
    shift, nlms, scaled, eps, eps_gamma = cfg[:5]
    packed = (seq, cu, True) if seq is not None else (k, k, False)
    B, T, H, K, V, per_col, N, BK, BV, BR = _geometry(k, beta)
    dev = k.device
    x = _empty(k.shape, k.dtype, dev)
    eta = _empty(beta.shape, torch.float32, dev)
    g = _empty(beta.shape, torch.float32, dev)
    stat = _empty((B, T, H), torch.float32, dev)
    _prep_fwd[(cdiv(N, BR),)](
        k, beta, lam, last_k if last_k is not None else k, valid if valid is not None else seen, seen,
        x, eta, g, stat, N, T, eps, eps_gamma, H, K, V, BR, BK, BV, per_col, shift, last_k is not None,
        valid is not None, nlms, scaled, *packed)
    return x, eta, g, stat


def w1_prep_backward(k, beta, lam, last_k, seen, valid, seq, cu, cfg, dx, deta, dg, need_dlast):
    """(dk, dbeta, dlam, dlast) of one window-1 call (dlast None unless asked for and the key is shifted in); dx,
    deta, dg may be None (no gradient reached them)."""
    shift, nlms, scaled, eps, eps_gamma = cfg[:5]
    packed = (seq, cu, True) if seq is not None else (k, k, False)
    B, T, H, K, V, per_col, N, BK, BV, BR = _geometry(k, beta)
    dev = k.device
    dx = dx.contiguous() if dx is not None else torch.zeros_like(k)
    deta = deta.float().contiguous() if deta is not None else torch.zeros(beta.shape, device=dev)
    dg = dg.float().contiguous() if dg is not None else torch.zeros(beta.shape, device=dev)
    dk = _empty(k.shape, k.dtype, dev)
    dbeta = _empty(beta.shape, beta.dtype, dev)
    dlam = _empty(lam.shape, lam.dtype, dev)
    need_dlast = bool(need_dlast and shift and last_k is not None)  # unused without the shift
    dlast = _empty(last_k.shape, last_k.dtype, dev) if need_dlast else None
    _prep_bwd[(cdiv(N, BR),)](
        k, beta, lam, last_k if last_k is not None else k, valid if valid is not None else seen, seen,
        dx, deta, dg, dk, dbeta, dlam, dlast if dlast is not None else dk, N, T, eps, eps_gamma,
        H, K, V, BR, BK, BV, per_col, shift, last_k is not None, valid is not None, nlms, scaled, need_dlast,
        *packed)
    return dk, dbeta, dlam, dlast


def fused_prepare(k, v, beta, lam, *, variant: str, window: int, step: str, lam_mode: str, shift: bool, eps: float,
                  eps_gamma: float, seen: torch.Tensor, last_k: Optional[torch.Tensor] = None,
                  tail_x: Optional[torch.Tensor] = None, tail_v: Optional[torch.Tensor] = None,
                  valid: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None):
    """`prep.prepare` (same arguments, same CoreInputs) on the fused kernels: window 1 (variants 1, 1A, 2, 2A; xw = x,
    vw = v) here, Falcon-3A and Falcon-3 (window > 1; Falcon-3's μ_t with the squarings in the kernel) in
    prep_window.py.
    cu_seqlens (window 1, B = 1): packed sequences, `seen` and `last_k` per sequence (as `prep.prepare` takes them)."""
    from ..prep import CoreInputs, effective_window

    W = effective_window(variant, window)
    seq = cu = None
    if cu_seqlens is not None:
        if W != 1 or k.shape[0] != 1:
            raise ValueError(f"cu_seqlens: the fused packed prep takes window 1 and B = 1, got window {W}, "
                             f"B = {k.shape[0]}")
        cu = cu_seqlens.to(device=k.device, dtype=torch.int32).contiguous()
        n = cu.numel() - 1
        seq = torch.repeat_interleave(torch.arange(n, device=k.device, dtype=torch.int32), cu[1:] - cu[:-1],
                                      output_size=k.shape[1])
    if W > 1:
        from .prep_window import fused_window_prepare

        return fused_window_prepare(k, v, beta, lam, window=W, shift=shift, step=step, lam_mode=lam_mode, eps=eps,
                                    eps_gamma=eps_gamma, seen=seen, last_k=last_k, tail_x=tail_x, tail_v=tail_v,
                                    valid=valid, eig=variant == "3")
    from .prep_ops import prep_core

    cfg = (bool(shift), step == "nlms", lam_mode == "scaled", float(eps), float(eps_gamma), 1, False)
    last = last_k.to(k.dtype).contiguous() if last_k is not None else None
    x, eta, g, stat = prep_core(k.contiguous(), beta.contiguous(), lam.contiguous(), last, None,
                                seen.to(device=k.device, dtype=torch.int64).contiguous(),
                                valid.to(torch.int8).contiguous() if valid is not None else None, seq, cu, cfg)
    return CoreInputs(xw=x, vw=v, eta=eta, g=g, stat=stat)
