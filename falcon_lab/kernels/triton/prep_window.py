"""The op's prep for Falcon-3A (window W > 1, inner product) and Falcon-3 (regression) as Triton kernels (ours): one
forward, two backward.

What `falcon_lab/kernels/prep.py` computes for a linear window (docs/kernel-contract.md, falcon-math.md §4), row by
row over the B·T·H rows (the W = 1 pieces as in prep.py here):

    xw    = [carried tail (W-1 rows, or zeros) ; x_1..x_T]                     the pair stream, x as for W = 1
    Ē_t   = Σ_{m<W} ||xw_{t+W-1-m}||² / max(B_t, 1),   B_t = clamp(pairs written up to t, 0, W)
    λ_t   = lam_t · Ē_t (λ scaled; Ē enters λ without gradient, as prep.py's stat.detach()) or lam_t
    η_t   = β_t / (Ē_t + λ_t + eps) (NLMS) or β_t, 0 without a pair or on padding
    log γ_t = log1p(-min(η_t λ_t, 1 - ε_γ))
    eta   = η_t / max(B_t, 1)

Forward: each row recomputes its W window rows' energies from k (and the tail). Backward: `_win_bwd_gates` gives dβ,
dλ and q_t = dĒ_t / max(B_t, 1) per row; `_win_bwd_keys` gives each pair row's key gradient
dxw + 2 x Σ_{t sees it} q_t (dk, the carried key's and the carried tail's). vw is `torch.cat([tail_v, v])` (its
gradient is autograd's).
Falcon-3 (`eig`; windows 2, 4, 8, 16): the statistic is μ_t, the top eigenvalue of the window's [W, W] Gram, divided
by max(B_t, 1) as prep.py does, by prep._largest_eig's arithmetic (`_win_eig`: the Gram of the W window rows, 20
squarings of the trace-normalised matrix as rank-1 updates, the column of the largest diagonal as v, μ = vᵀGv / vᵀv);
the forward saves the unit eigenvector v̂ per row, and a key's gradient from the windows holding it is
Σ 2 q_ρ v̂_ρ[pos] Σ_n v̂_ρ[n] x_{ρ-n} (eigvalsh's gradient v̂ v̂ᵀ of a simple top eigenvalue; `_eig_key_grad`).
Interpreter-tested against prep.py in float64 (tests/test_triton_prep.py); proven on the H200 for Falcon-3A
(2026-12-03, padded and packed rows), not yet run there for Falcon-3; on CUDA a variant runs it once in
`PROVEN_PREP` (falcon_lab/kernels/triton/__init__.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import _empty, _np2, cdiv
from .eig import SQUARINGS_C, TINY_C, _squarings_top, window_ok
from .host import env_choice

from .prep import _block_rows, _keep, _log1m, _pair_x, _rows, _step, _step_bwd, _store_key_grads

# Falcon-3's gate backward (ours): "recompute" (_win_bwd_gates recomputes each row's window Gram and μ_t by the
# squarings, as the forward did; proven, the default) or "stat" (_win_bwd_gates_stat reads the statistic the forward
# stored, μ_t / max(B_t, 1) in fp32, the same value bit for bit, so no key is loaded and no squaring runs: the gates'
# chain rule needs nothing else of the window). On the H200 _win_bwd_gates took 0.53 of Falcon-3's 7.1 ms at
# (16, 2048, 12, 64) (kernels_2026-12-03h/call9). Written 2026-12-05 (twenty-third session). On the H200 the same
# day (benchmarks/results/h200_logs/kernels_2026-12-05/): the fused-prep rows 23-29 of Falcon-3's sweep pass with
# "stat", and in one process it takes the kernel from 0.53 to 0.004 ms and Falcon-3 to 0.924 / 0.971 / 0.930 / 0.949x
# the GPU time of "recompute" at the four shapes: the default since then.
GATES = env_choice("FALCON_TRITON_3_PREP_GATES", "stat", ("recompute", "stat"),
                   "Falcon-3's prep backward: the gates from μ_t recomputed or from the stored statistic (both "
                   "proven)")


@triton.jit
def _win_row(K_, LASTK, TAILX, VALID, SEEN, BETA, LAM, r, rmask, b, t, h, ck, kmask, T, eps, eps_gamma,
             H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr,
             HAS_TAIL: tl.constexpr, HAS_VALID: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr,
             EIG: tl.constexpr):
    """Row t, both directions: its own pair key x and flags, the statistic (Falcon-3A: the window energy Ē; Falcon-3,
    EIG: μ_t) times 1/max(B_t, 1), that inverse, lam, λ_t, the NLMS denominator, keep, _step's η (before the division
    by B_t), η λ and α, and (EIG) the unit top eigenvector [BR, W] of the window Gram."""
    x, hp = _pair_x(K_, LASTK, TAILX, SEEN, t, b, h, rmask, ck, kmask, T, H, K, W, SHIFT, HAS_LASTK, HAS_TAIL)
    if EIG:  # Falcon-3: μ_t, the window Gram's top eigenvalue, and its unit top eigenvector (position m: row t - m)
        esum, vh = _win_eig(K_, LASTK, TAILX, SEEN, x, t, b, h, rmask, ck, kmask, T, H, K, W, SHIFT, HAS_LASTK,
                            HAS_TAIL)
    else:  # Falcon-3A: the window energy
        esum = tl.sum(x * x, 1)
        for m in tl.static_range(1, W):
            xm, _ = _pair_x(K_, LASTK, TAILX, SEEN, t - m, b, h, rmask, ck, kmask, T, H, K, W, SHIFT, HAS_LASTK,
                            HAS_TAIL)
            esum += tl.sum(xm * xm, 1)
        vh = esum
    seen = tl.load(SEEN + b, mask=rmask, other=0)
    inv = 1. / tl.maximum(tl.minimum(tl.maximum(seen + t + 1 - SHIFT, 0), W).to(tl.float32), 1.)
    stat = esum * inv
    lam = tl.load(LAM + r, mask=rmask, other=0.).to(tl.float32)
    if SCALED:
        lam_t = lam * stat
    else:
        lam_t = lam
    keep = _keep(VALID, hp, rmask, b, t, T, HAS_VALID)
    den = stat + lam_t + eps
    beta = tl.load(BETA + r, mask=rmask, other=0.).to(tl.float32)
    eta0, a, alpha = _step(beta, den, keep, lam_t, eps_gamma, NLMS)
    return x, hp, stat, inv, lam_t, den, keep, eta0, a, alpha, vh


@triton.jit
def _win_eig(K_, LASTK, TAILX, SEEN, x, t, b, h, rmask, ck, kmask, T, H: tl.constexpr, K: tl.constexpr,
             W: tl.constexpr, SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Falcon-3's μ_t per row (ours; prep._largest_eig's arithmetic): the [W, W] Gram of the window rows t, t-1, ..,
    t-W+1 (position m is row t - m), its top eigenvector v by eig.py's squarings, and μ = vᵀGv / vᵀv (0 where
    vᵀv = 0). Returns (μ [BR], v / |v| [BR, W], zero where v = 0)."""
    i = tl.arange(0, W)
    G = tl.zeros([x.shape[0], W, W], dtype=tl.float32)
    for m in tl.static_range(W):
        if m == 0:
            xm = x
        else:
            xm, _ = _pair_x(K_, LASTK, TAILX, SEEN, t - m, b, h, rmask, ck, kmask, T, H, K, W, SHIFT, HAS_LASTK,
                            HAS_TAIL)
        for n in tl.static_range(m + 1):
            if n == 0:
                xn = x
            else:
                xn, _ = _pair_x(K_, LASTK, TAILX, SEEN, t - n, b, h, rmask, ck, kmask, T, H, K, W, SHIFT, HAS_LASTK,
                                HAS_TAIL)
            gmn = tl.sum(xm * xn, 1)
            sel = ((i[:, None] == m) & (i[None, :] == n)) | ((i[:, None] == n) & (i[None, :] == m))
            G = tl.where(sel[None, :, :], gmn[:, None, None], G)
    v = _squarings_top(G, i, x.shape[0], W, SQUARINGS_C, TINY_C)  # [BR, W]
    gv = tl.zeros([x.shape[0], W], dtype=tl.float32)
    for k in tl.static_range(W):
        vk = tl.sum(tl.where((i == k)[None, :], v, 0.), 1)
        gv += tl.sum(tl.where((i == k)[None, None, :], G, 0.), 2) * vk[:, None]  # G[:, :, k] v_k
    vv = tl.sum(v * v, 1)
    ok = vv > 0
    safe = tl.where(ok, vv, 1.)
    mu = tl.where(ok, tl.sum(v * gv, 1) / safe, 0.)
    vh = tl.where(ok[:, None], v / tl.sqrt(safe)[:, None], 0.)
    return mu, vh


@triton.jit
def _win_fwd(K_, BETA, LAM, LASTK, TAILX, VALID, SEEN, XW, ETA, G, STAT, VH, N, T, eps, eps_gamma,
             H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
             SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_VALID: tl.constexpr,
             NLMS: tl.constexpr, SCALED: tl.constexpr, EIG: tl.constexpr):
    r, rmask, b, t, h, ck, kmask = _rows(N, T, H, K, BR, BK)
    x, hp, stat, inv, lam_t, den, keep, eta0, a, alpha, vh = _win_row(
        K_, LASTK, TAILX, VALID, SEEN, BETA, LAM, r, rmask, b, t, h, ck, kmask, T, eps, eps_gamma, H, K, W, SHIFT,
        HAS_LASTK, HAS_TAIL, HAS_VALID, NLMS, SCALED, EIG)
    if EIG:  # the unit top eigenvectors, for the key gradients (_win_bwd_keys)
        wi = tl.arange(0, W)
        tl.store(VH + r[:, None] * W + wi[None, :], vh, mask=rmask[:, None])
    m2k = rmask[:, None] & kmask[None, :]
    ext = (b * (T + W - 1) + t + W - 1) * H + h
    tl.store(XW + ext[:, None] * K + ck[None, :], x.to(XW.dtype.element_ty), mask=m2k)
    for j in tl.static_range(W - 1):  # the carried tail rows, written by each (b, h)'s row t = 0
        xt, _ = _pair_x(K_, LASTK, TAILX, SEEN, t * 0 + (j - (W - 1)), b, h, rmask, ck, kmask, T, H, K, W, SHIFT,
                        HAS_LASTK, HAS_TAIL)
        tl.store(XW + ((b * (T + W - 1) + j) * H + h)[:, None] * K + ck[None, :], xt.to(XW.dtype.element_ty),
                 mask=m2k & (t == 0)[:, None])
    tl.store(STAT + r, stat, mask=rmask)
    tl.store(ETA + r, eta0 * inv, mask=rmask)
    tl.store(G + r, _log1m(alpha), mask=rmask)


@triton.jit
def _gates_bwd_store(DETA, DG, DBETA, DLAM, QS, r, rmask, inv, stat, eta0, a, alpha, den, keep, lam_t, eps_gamma,
                     NLMS: tl.constexpr, SCALED: tl.constexpr):
    """The gates' chain rule of rows r (both gate backwards): dβ, dλ and q_t = dstat / max(B_t, 1) to DBETA, DLAM, QS."""
    dbeta, dstat, dlam_t = _step_bwd(tl.load(DETA + r, mask=rmask, other=0.) * inv,
                                     tl.load(DG + r, mask=rmask, other=0.), eta0, a, alpha, den, keep, lam_t,
                                     eps_gamma, NLMS)
    dlam_t += dstat  # den = stat + λ_t + eps
    if SCALED:  # λ_t = lam · stat with stat held constant (prep.py's stat.detach())
        dlam = dlam_t * stat
    else:
        dlam = dlam_t
    tl.store(DBETA + r, dbeta.to(DBETA.dtype.element_ty), mask=rmask)
    tl.store(DLAM + r, dlam.to(DLAM.dtype.element_ty), mask=rmask)
    tl.store(QS + r, dstat * inv, mask=rmask)


@triton.jit
def _win_bwd_gates(K_, BETA, LAM, LASTK, TAILX, VALID, SEEN, DETA, DG, DBETA, DLAM, QS, N, T, eps, eps_gamma,
                   H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                   SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_VALID: tl.constexpr,
                   NLMS: tl.constexpr, SCALED: tl.constexpr, EIG: tl.constexpr):
    r, rmask, b, t, h, ck, kmask = _rows(N, T, H, K, BR, BK)
    x, hp, stat, inv, lam_t, den, keep, eta0, a, alpha, _vh = _win_row(
        K_, LASTK, TAILX, VALID, SEEN, BETA, LAM, r, rmask, b, t, h, ck, kmask, T, eps, eps_gamma, H, K, W, SHIFT,
        HAS_LASTK, HAS_TAIL, HAS_VALID, NLMS, SCALED, EIG)
    _gates_bwd_store(DETA, DG, DBETA, DLAM, QS, r, rmask, inv, stat, eta0, a, alpha, den, keep, lam_t, eps_gamma,
                     NLMS, SCALED)


@triton.jit
def _win_bwd_gates_stat(STAT, BETA, LAM, VALID, SEEN, DETA, DG, DBETA, DLAM, QS, N, T, eps, eps_gamma,
                        H: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, SHIFT: tl.constexpr,
                        HAS_VALID: tl.constexpr, NLMS: tl.constexpr, SCALED: tl.constexpr):
    """_win_bwd_gates from the forward's statistic (STAT: the window statistic times 1/max(B_t, 1), as _win_row forms
    it) instead of the window's keys: _win_row's gate arithmetic on rows r = (b·T + t)·H + h, then the same chain
    rule and stores."""
    r, rmask, b, t, h, _ck, _km = _rows(N, T, H, 16, BR, 16)
    seen = tl.load(SEEN + b, mask=rmask, other=0)
    hp = (seen + t + 1 - SHIFT) > 0  # _pair_x's flag at tp = t
    inv = 1. / tl.maximum(tl.minimum(tl.maximum(seen + t + 1 - SHIFT, 0), W).to(tl.float32), 1.)
    stat = tl.load(STAT + r, mask=rmask, other=0.)
    lam = tl.load(LAM + r, mask=rmask, other=0.).to(tl.float32)
    if SCALED:
        lam_t = lam * stat
    else:
        lam_t = lam
    keep = _keep(VALID, hp, rmask, b, t, T, HAS_VALID)
    den = stat + lam_t + eps
    beta = tl.load(BETA + r, mask=rmask, other=0.).to(tl.float32)
    eta0, a, alpha = _step(beta, den, keep, lam_t, eps_gamma, NLMS)
    _gates_bwd_store(DETA, DG, DBETA, DLAM, QS, r, rmask, inv, stat, eta0, a, alpha, den, keep, lam_t, eps_gamma,
                     NLMS, SCALED)


@triton.jit
def _win_bwd_keys(K_, LASTK, TAILX, SEEN, DXW, QS, VH, DK, DLASTK, DTAILX, N, T,
                  H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                  SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr, HAS_TAIL: tl.constexpr,
                  NEED_DLASTK: tl.constexpr, NEED_DTAIL: tl.constexpr, EIG: tl.constexpr):
    r, rmask, b, t, h, ck, kmask = _rows(N, T, H, K, BR, BK)
    m2k = rmask[:, None] & kmask[None, :]
    x, hp = _pair_x(K_, LASTK, TAILX, SEEN, t, b, h, rmask, ck, kmask, T, H, K, W, SHIFT, HAS_LASTK, HAS_TAIL)
    if EIG:  # Falcon-3: dμ_r v̂_r v̂_rᵀ is row r's Gram gradient; x_t is position r - t of the windows r = t .. t+W-1
        ext = (b * (T + W - 1) + t + W - 1) * H + h
        dx = tl.load(DXW + ext[:, None] * K + ck[None, :], mask=m2k, other=0.).to(tl.float32)
        dsrc = tl.where(hp[:, None], dx + _eig_key_grad(K_, LASTK, TAILX, SEEN, QS, VH, t, t, b, h, rmask, ck,
                                                        kmask, T, H, K, W, SHIFT, HAS_LASTK, HAS_TAIL), 0.)
    else:  # Falcon-3A (in the order of the build proven on the H200: same IR, ptx_fingerprint.py)
        dE = tl.zeros([BR], dtype=tl.float32)
        for m in tl.static_range(W):  # the windows of rows t .. t + W - 1 hold x_t
            dE += tl.load(QS + r + m * H, mask=rmask & (t + m < T), other=0.)
        ext = (b * (T + W - 1) + t + W - 1) * H + h
        dx = tl.load(DXW + ext[:, None] * K + ck[None, :], mask=m2k, other=0.).to(tl.float32)
        dsrc = tl.where(hp[:, None], dx + 2. * x * dE[:, None], 0.)
    _store_key_grads(DK, DLASTK, dsrc, r, rmask, b, t, h, ck, kmask, T, H, K, SHIFT, NEED_DLASTK)
    if NEED_DTAIL:  # tail row j sits in the windows of rows 0 .. j: written by each (b, h)'s row t = 0
        for j in tl.static_range(W - 1):
            xt, _ = _pair_x(K_, LASTK, TAILX, SEEN, t * 0 + (j - (W - 1)), b, h, rmask, ck, kmask, T, H, K, W, SHIFT,
                            HAS_LASTK, HAS_TAIL)
            if EIG:
                erow = (b * (T + W - 1) + j) * H + h
                dxt = tl.load(DXW + erow[:, None] * K + ck[None, :], mask=m2k & (t == 0)[:, None], other=0.)
                dt_ = dxt.to(tl.float32) + _eig_key_grad(K_, LASTK, TAILX, SEEN, QS, VH, t * 0 + (j - (W - 1)), t, b,
                                                         h, rmask & (t == 0), ck, kmask, T, H, K, W, SHIFT,
                                                         HAS_LASTK, HAS_TAIL)
            else:  # in the proven build's order (same IR)
                dEt = tl.zeros([BR], dtype=tl.float32)
                for s in tl.static_range(j + 1):
                    dEt += tl.load(QS + r + s * H, mask=rmask & (t == 0) & (t + s < T), other=0.)
                erow = (b * (T + W - 1) + j) * H + h
                dxt = tl.load(DXW + erow[:, None] * K + ck[None, :], mask=m2k & (t == 0)[:, None], other=0.)
                dt_ = dxt.to(tl.float32) + 2. * xt * dEt[:, None]
            tl.store(DTAILX + ((b * (W - 1) + j) * H + h)[:, None] * K + ck[None, :], dt_.to(DTAILX.dtype.element_ty),
                     mask=m2k & (t == 0)[:, None])


@triton.jit
def _eig_key_grad(K_, LASTK, TAILX, SEEN, QS, VH, tp, t, b, h, rmask, ck, kmask, T, H: tl.constexpr,
                  K: tl.constexpr, W: tl.constexpr, SHIFT: tl.constexpr, HAS_LASTK: tl.constexpr,
                  HAS_TAIL: tl.constexpr):
    """The gradient [BR, BK] that μ's of the windows holding pair position tp (rows ρ = tp .. tp + W - 1, ρ >= 0,
    ρ < T) give the key x_tp: with G_ρ's gradient dμ_ρ v̂ v̂ᵀ (prep._largest_eig's, v̂ the unit top eigenvector),
    2 dμ_ρ v̂_ρ[ρ - tp] Σ_n v̂_ρ[n] x_{ρ-n}. QS holds dμ_ρ (= dstat · inv), VH the v̂ of each row; t is the
    program's row (for the row offsets of QS and VH: tp - t is a constant shift)."""
    wi = tl.arange(0, W)
    acc = tl.zeros([t.shape[0], ck.shape[0]], dtype=tl.float32)
    for m in tl.static_range(W):  # x_tp at position m of row ρ = tp + m
        rho = tp + m
        ok = rmask & (rho >= 0) & (rho < T)
        rr = (b * T + rho) * H + h
        q = tl.load(QS + rr, mask=ok, other=0.)
        vh = tl.load(VH + rr[:, None] * W + wi[None, :], mask=ok[:, None], other=0.)  # [BR, W]
        y = tl.zeros([t.shape[0], ck.shape[0]], dtype=tl.float32)
        for n in tl.static_range(W):
            xn, _ = _pair_x(K_, LASTK, TAILX, SEEN, rho - n, b, h, ok, ck, kmask, T, H, K, W, SHIFT, HAS_LASTK,
                            HAS_TAIL)
            y += tl.sum(tl.where((wi == n)[None, :], vh, 0.), 1)[:, None] * xn
        c = 2. * q * tl.sum(tl.where((wi == m)[None, :], vh, 0.), 1)
        acc += c[:, None] * y
    return acc


def _rows_per_program(BK: int, W: int, eig: bool) -> int:
    """Rows per program: prep.py's, and for Falcon-3 at most 2048 // W² so the [rows, W, W] squarings stay small."""
    BR = _block_rows(BK, 1)
    return max(16, min(BR, 2048 // (W * W))) if eig else BR


def window_prep_forward(k, beta, lam, last_k, tail_x, seen, valid, cfg):
    """The forward kernel of one call: (xw, eta, g, stat, vh); vh the rows' unit top eigenvectors [B, T, H, W] fp32
    for Falcon-3 (eig), else an empty tensor. cfg = (shift, nlms, scaled, eps, eps_gamma, W, eig)."""
    shift, nlms, scaled, eps, eps_gamma, W, eig = cfg
    B, T, H, K = k.shape
    N = B * T * H
    BK = _np2(K)
    BR = _rows_per_program(BK, W, eig)
    xw = _empty((B, T + W - 1, H, K), k.dtype, k.device)
    eta = _empty((B, T, H), torch.float32, k.device)
    g = _empty((B, T, H), torch.float32, k.device)
    stat = _empty((B, T, H), torch.float32, k.device)
    vh = _empty((B, T, H, W), torch.float32, k.device) if eig else stat.new_empty(0)
    _win_fwd[(cdiv(N, BR),)](
        k, beta, lam, last_k if last_k is not None else k, tail_x if tail_x is not None else k,
        valid if valid is not None else seen, seen, xw, eta, g, stat, vh if eig else stat, N, T, eps, eps_gamma, H,
        K, W, BR, BK, shift, last_k is not None, tail_x is not None, valid is not None, nlms, scaled, eig)
    return xw, eta, g, stat, vh


def keeps_stat(cfg) -> bool:
    """Whether the backward reads the forward's statistic (Falcon-3 with GATES = "stat")."""
    return bool(cfg[6]) and GATES == "stat"


def window_prep_backward(k, beta, lam, last_k, tail_x, seen, valid, vh, stat, cfg, dxw, deta, dg, need_dlast,
                         need_dtail):
    """(dk, dbeta, dlam, dlast, dtail) of one call (dlast / dtail None unless asked for); dxw, deta, dg may be None
    (no gradient reached them); stat is read only where keeps_stat(cfg)."""
    shift, nlms, scaled, eps, eps_gamma, W, eig = cfg
    B, T, H, K = k.shape
    N = B * T * H
    BK = _np2(K)
    BR = _rows_per_program(BK, W, eig)
    dev = k.device
    dxw = dxw.contiguous() if dxw is not None else torch.zeros((B, T + W - 1, H, K), dtype=k.dtype, device=dev)
    deta = deta.float().contiguous() if deta is not None else torch.zeros(beta.shape, device=dev)
    dg = dg.float().contiguous() if dg is not None else torch.zeros(beta.shape, device=dev)
    dbeta = _empty(beta.shape, beta.dtype, dev)
    dlam = _empty(lam.shape, lam.dtype, dev)
    qs = _empty((B, T, H), torch.float32, dev)
    lk = last_k if last_k is not None else k
    tx = tail_x if tail_x is not None else k
    vl = valid if valid is not None else seen
    grid = (cdiv(N, BR),)
    if keeps_stat(cfg):
        BS = 256
        _win_bwd_gates_stat[(cdiv(N, BS),)](stat, beta, lam, vl, seen, deta, dg, dbeta, dlam, qs, N, T, eps,
                                            eps_gamma, H, W, BS, shift, valid is not None, nlms, scaled)
    else:
        _win_bwd_gates[grid](k, beta, lam, lk, tx, vl, seen, deta, dg, dbeta, dlam, qs, N, T, eps, eps_gamma, H, K,
                             W, BR, BK, shift, last_k is not None, tail_x is not None, valid is not None, nlms,
                             scaled, eig)
    dk = _empty(k.shape, k.dtype, dev)
    need_dlast = bool(need_dlast and shift and last_k is not None)
    need_dtail = bool(need_dtail and tail_x is not None)
    dlast = _empty(last_k.shape, last_k.dtype, dev) if need_dlast else None
    dtail = _empty(tail_x.shape, tail_x.dtype, dev) if need_dtail else None
    _win_bwd_keys[grid](k, lk, tx, seen, dxw, qs, vh if eig else qs, dk, dlast if dlast is not None else dk,
                        dtail if dtail is not None else dk, N, T, H, K, W, BR, BK, shift, last_k is not None,
                        tail_x is not None, need_dlast, need_dtail, eig)
    return dk, dbeta, dlam, dlast, dtail


def fused_window_prepare(k, v, beta, lam, *, window: int, shift: bool, step: str, lam_mode: str, eps: float,
                         eps_gamma: float, seen: torch.Tensor, last_k: Optional[torch.Tensor] = None,
                         tail_x: Optional[torch.Tensor] = None, tail_v: Optional[torch.Tensor] = None,
                         valid: Optional[torch.Tensor] = None, eig: bool = False):
    """`prep.prepare` for Falcon-3A (window > 1, linear; the window energy) or, with eig, Falcon-3 (regression; μ_t,
    the window Gram's top eigenvalue, W a power of two <= 16): the same CoreInputs."""
    from ..prep import CoreInputs

    W = int(window)
    if eig and not window_ok(W):
        raise ValueError(f"the fused Falcon-3 prep takes windows 2, 4, 8, 16, got {W}")
    B, T, H, _ = k.shape
    cfg = (bool(shift), step == "nlms", lam_mode == "scaled", float(eps), float(eps_gamma), W, bool(eig))
    from .prep_ops import prep_core

    xw, eta, g, stat = prep_core(
        k.contiguous(), beta.contiguous(), lam.contiguous(),
        last_k.to(k.dtype).contiguous() if last_k is not None else None,
        tail_x.to(k.dtype).contiguous() if tail_x is not None else None,
        seen.to(device=k.device, dtype=torch.int64).contiguous(),
        valid.to(torch.int8).contiguous() if valid is not None else None, None, None, cfg)
    tv = tail_v.to(v.dtype) if tail_v is not None else v.new_zeros(B, W - 1, H, v.shape[-1])
    return CoreInputs(xw=xw, vw=torch.cat([tv, v], dim=1), eta=eta, g=g, stat=stat)
