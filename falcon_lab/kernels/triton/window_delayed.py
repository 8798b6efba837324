"""Falcon-3A as ONE Falcon-1A scan of completed pair weights plus a band of W - 1 pairs per step (ours).

Falcon-3A's core (docs/kernel-contract.md), per (batch, head), 0-based step t, step t's pairs the rows t .. t+W-1
of the pair stream xw / vw (T + W - 1 rows, the first W - 1 carried from the previous segment), η_t with the
window's 1/B_t folded in, ζ_t = Σ_{r<=t} g_r:

    S_t = γ_t S_{t-1} + η_t Σ_{d<W} x_{t+d} v_{t+d}ᵀ ,   o_t = S_tᵀ q_t (after)  or  S_{t-1}ᵀ q_t (before)

Row p is written by the steps s = p-W+1 .. p (those >= 0), so once t >= p its weight in S_t is final up to the
decay: S_t = e^{ζ_t} S_0 + Σ_p Ω_{t,p} x_p v_pᵀ with Ω_{t,p} = Σ_{s<=t, s in [p-W+1, p]} η_s e^{ζ_t - ζ_s}, and
for p <= t, Ω_{t,p} = e^{ζ_t - ζ_p} c_p with c_p = Ω_{p,p}. Hence (our derivation)

    S_t = S'_t + Σ_{d=1}^{W-1} Ω_{t,d} x_{t+d} v_{t+d}ᵀ,
    Ω_{t,d} := Ω_{t,t+d} = Σ_{l=0}^{W-1-d} η_{t-l} e^{ζ_t - ζ_{t-l}}

where S'_t is Falcon-1A's state on the stream's OLDEST slot (row t at step t, the W scans' m = W - 1) with step
c_t = Ω_{t,0} and the same decay: one chunk scan of chunk.py, the fastest kernels here. The rows t+1 .. t+W-1 are
still inside a window, and enter the read-out as a band: with r = t (after) or t - 1 (before),

    o_t = o'_t + Σ_{e=1}^{W-1} Ω_{r,e} (q_t·x_{r+e}) v_{r+e},
    S_T = S'_T + Σ_{e=1}^{W-1} Ω_{T-1,e} x_{T-1+e} v_{T-1+e}ᵀ.

Every exponent is a sum of at most W - 1 log-decays (<= 0), so nothing overflows. Kernels: _wd_weights (Ω, c from
η, log γ; per row), the Falcon-1A scan (chunk.py, O' in fp32), _wd_band_fwd (o = o' + band, per row block; the last
block's program adds S_T's band, _wd_tail); backward: the scan's backward, _wd_band_bwd (the band's gradients added to
the scan's dq, dx, dv, which it leaves unfilled past row T; dΩ), _wd_tail_bwd (S_T's band, W - 1 rows per sequence,
only when dS_T is given), _wd_weights_bwd (dη, and dlog γ added to the scan's). The band costs O(W (K + V)) per step on
CUDA cores, memory-bound: q, x, v, o (and their gradients) read and written about once.
Packed calls (cu_seqlens, B = 1) run natively with FALCON_TRITON_3A_PACKED=delayed (ours; proven on the H200 and the
default since 2026-12-04, twenty-first session: rows 23-29 of the 3A sweep, 0.84x the banded scan's packed form):
the scan reads the packed pair stream, the band kernels each row's sequence (SEQ, PSEQ) and its bounds (cu_seqlens),
each sequence's final-state band its own program (_wd_tail_seq).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk import chunk_backward, chunk_forward
from .common import _empty, _np2, cdiv
from .host import next_pow2


@triton.jit
def _wd_weights(ETA, G, OM, CC, T, H: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
                SEQ, CU, VARLEN: tl.constexpr):
    """Ω_{t,d} = Σ_{l=0}^{W-1-d} h_l(t), h_l(t) = η_{t-l} e^{G_l(t)} (t - l >= 0), G_l(t) = Σ_{j=t-l+1}^{t} g_j, into
    OM [B, T, H, WP] (d < W) and c_t = Ω_{t,0} into CC [B, T, H]. Program (row block, b·H + h). VARLEN (B = 1, packed
    sequences; ours): t - l >= the start of t's sequence (SEQ: each row's sequence, CU: cu_seqlens)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = pid * BT + tl.arange(0, BT)
    tm = t < T
    base = (b * T).to(tl.int64) * H + h
    d = tl.arange(0, WP)
    Gl = tl.zeros([BT], dtype=tl.float32)
    om = tl.zeros([BT, WP], dtype=tl.float32)
    if VARLEN:
        st = tl.load(CU + tl.load(SEQ + t, mask=tm, other=0), mask=tm, other=0)
    else:
        st = 0
    for l in tl.static_range(W):
        s = t - l
        sm = tm & (s >= st)
        if l > 0:
            Gl += tl.load(G + base + (s + 1) * H, mask=sm, other=0.)
        hl = tl.where(sm, tl.load(ETA + base + s * H, mask=sm, other=0.) * tl.exp(tl.minimum(Gl, 0.)), 0.)
        om += tl.where(d[None, :] <= W - 1 - l, hl[:, None], 0.)
    tok = base + t * H
    tl.store(OM + tok[:, None] * WP + d[None, :], om, mask=tm[:, None] & (d < W)[None, :])
    tl.store(CC + tok, tl.sum(tl.where(d[None, :] == 0, om, 0.), 1), mask=tm)


@triton.jit
def _wd_weights_bwd(ETA, G, DOM, DC, DETA, DG, T, H: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                    BT: tl.constexpr, SEQ, CU, VARLEN: tl.constexpr):
    """The adjoint of _wd_weights: with dΩ (DOM, d >= 1; column 0 is dc, DC) and D_l(t) = Σ_{d<=W-1-l} dΩ_{t,d},
    dη_j = Σ_l D_l(j+l) e^{G_l(j+l)} into DETA and dlog γ_j += Σ_{k<W} Σ_{l>k} D_l(j+k) h_l(j+k) added to DG (the
    scan's). Program (row block, b·H + h)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    j = pid * BT + tl.arange(0, BT)
    jm = j < T
    base = (b * T).to(tl.int64) * H + h
    d = tl.arange(0, WP)
    deta = tl.zeros([BT], dtype=tl.float32)
    dg = tl.zeros([BT], dtype=tl.float32)
    for k in tl.static_range(W):
        t = j + k  # the step whose h_l (l >= k) involves row j
        tmk = jm & (t < T)
        ttok = base + t * H
        dom = tl.load(DOM + ttok[:, None] * WP + d[None, :], mask=tmk[:, None] & (d >= 1)[None, :] & (d < W)[None, :],
                      other=0.)
        dom += tl.where(d[None, :] == 0, tl.load(DC + ttok, mask=tmk, other=0.)[:, None], 0.)
        if VARLEN:  # t's sequence start: a step t in a later sequence than j masks every term (s <= j < its start)
            st = tl.load(CU + tl.load(SEQ + t, mask=tmk, other=0), mask=tmk, other=0)
        else:
            st = 0
        Gl = tl.zeros([BT], dtype=tl.float32)
        for l in tl.static_range(W):
            if l > 0:
                Gl += tl.load(G + base + (t - l + 1) * H, mask=tmk & (t - l >= st), other=0.)
            if l >= k:
                s = t - l
                sm = tmk & (s >= st)
                Dl = tl.sum(tl.where(d[None, :] <= W - 1 - l, dom, 0.), 1)
                e = tl.where(sm, tl.exp(tl.minimum(Gl, 0.)), 0.)
                if l == k:
                    deta += Dl * e
                else:
                    dg += Dl * e * tl.load(ETA + base + s * H, mask=sm, other=0.)
    tok = base + j * H
    tl.store(DETA + tok, deta, mask=jm)
    tl.store(DG + tok, tl.load(DG + tok, mask=jm, other=0.) + dg, mask=jm)


@triton.jit
def _wd_tail(X, VV, OM, ST, b, h, v0, T, XT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
             WP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The final state's band on value columns v0 .. v0+BV-1, added in place: S_T += Σ_{e=1}^{W-1} Ω_{T-1,e}
    x_{T-1+e} v_{T-1+e}ᵀ."""
    bh = b * H + h
    ck = tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    km = ck < K
    vm = cv < V
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    for e in tl.static_range(1, W):
        ptok = (b * XT + T - 1 + e).to(tl.int64) * H + h
        w = tl.load(OM + ((b * T + T - 1).to(tl.int64) * H + h) * WP + e)
        x = tl.load(X + ptok * K + ck, mask=km, other=0.).to(tl.float32)
        v = tl.load(VV + ptok * V + cv, mask=vm, other=0.).to(tl.float32)
        acc += (w * x)[:, None] * v[None, :]
    off = bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    m = km[:, None] & vm[None, :]
    tl.store(ST + off, tl.load(ST + off, mask=m, other=0.) + acc, mask=m)


@triton.jit
def _wd_tail_seq(X, VV, OM, ST, CU, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                 WP: tl.constexpr, BK: tl.constexpr):
    """Packed calls: each sequence's final-state band (_wd_tail on its rows). Program (sequence·H + h)."""
    sh = tl.program_id(0)
    sq = sh // H
    h = sh % H
    bos = tl.load(CU + sq)
    n = tl.load(CU + sq + 1) - bos
    if n > 0:
        pb = (bos + sq * (W - 1)).to(tl.int64) * H
        for v0 in range(0, V, 32):
            _wd_tail(X + pb * K, VV + pb * V, OM + bos.to(tl.int64) * H * WP, ST + sq.to(tl.int64) * H * K * V, 0, h,
                     v0, n, 0, H, K, V, W, WP, BK, 32)


@triton.jit
def _wd_band_fwd(Q, X, VV, OM, O1, O, ST, T, XT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                 WP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SB: tl.constexpr,
                 SEQ, CU, VARLEN: tl.constexpr):
    """o_t = o'_t + Σ_{e=1}^{W-1} Ω_{r,e} (q_t·x_{r+e}) v_{r+e}, r = t - SB, for a block of BT steps: O1 the scan's
    output (fp32), O in q's dtype; the last block's program also adds the final state's band to ST (_wd_tail). Program
    (row block, b·H + h)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = pid * BT + tl.arange(0, BT)
    tm = t < T
    r = t - SB
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    km = ck < K
    vm = cv < V
    tok = (b * T + t).to(tl.int64) * H + h
    q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=tm[:, None] & km[None, :], other=0.).to(tl.float32)
    o = tl.load(O1 + tok[:, None] * V + cv[None, :], mask=tm[:, None] & vm[None, :], other=0.)
    if VARLEN:  # B = 1: step t of sequence sq reads its pairs at rows t + sq (W - 1) + d of the packed stream
        sq = tl.load(SEQ + t, mask=tm, other=0)
        st = tl.load(CU + sq, mask=tm, other=0)
    for e in tl.static_range(1, W):
        if VARLEN:
            pm = tm & (r >= st)
            ptok = (r + sq * (W - 1) + e).to(tl.int64) * H + h
        else:
            pm = tm & (r >= 0)
            ptok = (b * XT + r + e).to(tl.int64) * H + h
        x = tl.load(X + ptok[:, None] * K + ck[None, :], mask=pm[:, None] & km[None, :], other=0.).to(tl.float32)
        w = tl.load(OM + ((b * T + r).to(tl.int64) * H + h) * WP + e, mask=pm, other=0.)
        v = tl.load(VV + ptok[:, None] * V + cv[None, :], mask=pm[:, None] & vm[None, :], other=0.).to(tl.float32)
        o += (w * tl.sum(q * x, 1))[:, None] * v
    tl.store(O + tok[:, None] * V + cv[None, :], o.to(O.dtype.element_ty), mask=tm[:, None] & vm[None, :])
    if not VARLEN:  # packed calls: _wd_tail_seq
        if pid == tl.num_programs(0) - 1:
            for v0 in range(0, V, 32):
                _wd_tail(X, VV, OM, ST, b, h, v0, T, XT, H, K, V, W, WP, BK, 32)


@triton.jit
def _wd_band_bwd(Q, X, VV, OM, DO, DQ, DX, DV, DOM, T, XT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 SB: tl.constexpr, SEQ, PSEQ, CU, VARLEN: tl.constexpr):
    """The band's adjoint for a block of BT rows i, added in place to the scan's gradients. As steps t = i < T (r = t -
    SB, pair rows p = r + e): dq_t += Σ_e Ω_{r,e} (dO_t·v_p) x_p and dΩ_{r,e} = (q_t·x_p)(dO_t·v_p) into DOM. As
    pair rows p = i < XT (r = p - e, t = r + SB < T): dx_p += Σ_e Ω_{r,e} (dO_t·v_p) q_t, dv_p += Σ_e Ω_{r,e}
    (q_t·x_p) dO_t. Program (row block over the XT pair rows, b·H + h)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    i = pid * BT + tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    km = ck < K
    vm = cv < V
    # as steps
    tm = i < T
    r = i - SB
    tok = (b * T + i).to(tl.int64) * H + h
    q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=tm[:, None] & km[None, :], other=0.).to(tl.float32)
    do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=tm[:, None] & vm[None, :], other=0.).to(tl.float32)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    rtok = (b * T + r).to(tl.int64) * H + h
    if VARLEN:  # B = 1: as in _wd_band_fwd; a sequence's last row is no step's r when reading before the write
        sq = tl.load(SEQ + i, mask=tm, other=0)
        st = tl.load(CU + sq, mask=tm, other=0)
        last = tm & (i == tl.load(CU + sq + 1, mask=tm, other=0) - 1)
    for e in tl.static_range(1, W):
        if VARLEN:
            pm = tm & (r >= st)
            ptok = (r + sq * (W - 1) + e).to(tl.int64) * H + h
        else:
            pm = tm & (r >= 0)
            ptok = (b * XT + r + e).to(tl.int64) * H + h
        x = tl.load(X + ptok[:, None] * K + ck[None, :], mask=pm[:, None] & km[None, :], other=0.).to(tl.float32)
        v = tl.load(VV + ptok[:, None] * V + cv[None, :], mask=pm[:, None] & vm[None, :], other=0.).to(tl.float32)
        w = tl.load(OM + rtok * WP + e, mask=pm, other=0.)
        bv = tl.sum(do * v, 1)
        dq += (w * bv)[:, None] * x
        tl.store(DOM + rtok * WP + e, tl.sum(q * x, 1) * bv, mask=pm)
        if SB == 1:  # row T - 1 is no step's r here: zero it for _wd_tail_bwd and _wd_weights_bwd
            if VARLEN:
                tl.store(DOM + tok * WP + e, tl.zeros([BT], dtype=tl.float32), mask=last)
            else:
                tl.store(DOM + tok * WP + e, tl.zeros([BT], dtype=tl.float32), mask=i == T - 1)
    qm = tm[:, None] & km[None, :]
    tl.store(DQ + tok[:, None] * K + ck[None, :],
             (tl.load(DQ + tok[:, None] * K + ck[None, :], mask=qm, other=0.).to(tl.float32) + dq)
             .to(DQ.dtype.element_ty), mask=qm)
    # as pair rows
    pmk = i < XT
    ptok = (b * XT + i).to(tl.int64) * H + h
    x = tl.load(X + ptok[:, None] * K + ck[None, :], mask=pmk[:, None] & km[None, :], other=0.).to(tl.float32)
    v = tl.load(VV + ptok[:, None] * V + cv[None, :], mask=pmk[:, None] & vm[None, :], other=0.).to(tl.float32)
    dx = tl.zeros([BT, BK], dtype=tl.float32)
    dv = tl.zeros([BT, BV], dtype=tl.float32)
    if VARLEN:  # pair row i of sequence ps (its segment: rows cu[ps] + ps (W - 1) ...) is step rr's pair e
        ps = tl.load(PSEQ + i, mask=pmk, other=0)
        pst = tl.load(CU + ps, mask=pmk, other=0)
        pen = tl.load(CU + ps + 1, mask=pmk, other=0)
    for e in tl.static_range(1, W):
        if VARLEN:
            rr = i - ps * (W - 1) - e
            ts = rr + SB
            sm = pmk & (rr >= pst) & (ts < pen)
        else:
            rr = i - e
            ts = rr + SB
            sm = pmk & (rr >= 0) & (ts < T)
        stok = (b * T + ts).to(tl.int64) * H + h
        qs = tl.load(Q + stok[:, None] * K + ck[None, :], mask=sm[:, None] & km[None, :], other=0.).to(tl.float32)
        dos = tl.load(DO + stok[:, None] * V + cv[None, :], mask=sm[:, None] & vm[None, :], other=0.).to(tl.float32)
        w = tl.load(OM + ((b * T + rr).to(tl.int64) * H + h) * WP + e, mask=sm, other=0.)
        dx += (w * tl.sum(dos * v, 1))[:, None] * qs
        dv += (w * tl.sum(qs * x, 1))[:, None] * dos
    # rows >= T (packed: each segment's last W - 1): the scan wrote nothing there (chunk_backward(zero_rest=False)), so
    # they are stored, not added to
    if VARLEN:
        old = (i - ps * (W - 1) < pen)[:, None]
    else:
        old = (i < T)[:, None]
    xm = pmk[:, None] & km[None, :]
    tl.store(DX + ptok[:, None] * K + ck[None, :],
             (tl.load(DX + ptok[:, None] * K + ck[None, :], mask=xm & old, other=0.).to(tl.float32) + dx)
             .to(DX.dtype.element_ty), mask=xm)
    ym = pmk[:, None] & vm[None, :]
    tl.store(DV + ptok[:, None] * V + cv[None, :],
             (tl.load(DV + ptok[:, None] * V + cv[None, :], mask=ym & old, other=0.).to(tl.float32) + dv)
             .to(DV.dtype.element_ty), mask=ym)


@triton.jit
def _wd_tail_bwd(X, VV, OM, DST, DX, DV, DOM, T, XT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 WP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CU, W: tl.constexpr, VARLEN: tl.constexpr):
    """The final state band's adjoint for pair row T-1+e: dΩ_{T-1,e} += x_eᵀ dS_T v_e, dx_e += Ω dS_T v_e, dv_e += Ω
    dS_Tᵀ x_e, added in place. Program (e - 1, b·H + h); VARLEN: (e - 1, sequence·H + h), the pointers moved to the
    sequence's rows (an empty sequence writes nothing)."""
    e = tl.program_id(0) + 1
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    ck = tl.arange(0, BK)
    km = ck < K
    if VARLEN:
        bos = tl.load(CU + b)
        T = tl.load(CU + b + 1) - bos
        pb = (bos + b * (W - 1)).to(tl.int64) * H
        X += pb * K
        VV += pb * V
        DX += pb * K
        DV += pb * V
        OM += bos.to(tl.int64) * H * WP
        DOM += bos.to(tl.int64) * H * WP
        b = 0
        XT = 0
        km = ck < tl.where(T > 0, K, 0)  # an empty sequence: nothing (not as km & (T > 0): the interpreter refuses it)
    ptok = (b * XT + T - 1 + e).to(tl.int64) * H + h
    otok = ((b * T + T - 1).to(tl.int64) * H + h) * WP + e
    if VARLEN:
        w = tl.load(OM + otok, mask=T > 0, other=0.)
    else:
        w = tl.load(OM + otok)
    x = tl.load(X + ptok * K + ck, mask=km, other=0.).to(tl.float32)
    dx = tl.zeros([BK], dtype=tl.float32)
    dw = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        vm = cv < V
        if VARLEN:
            vm = cv < tl.where(T > 0, V, 0)
        ds = tl.load(DST + bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :], mask=km[:, None] & vm[None, :],
                     other=0.)
        v = tl.load(VV + ptok * V + cv, mask=vm, other=0.).to(tl.float32)
        dsv = tl.sum(ds * v[None, :], 1)  # dS_T v_e over this tile: [BK]
        dx += w * dsv
        dw += x * dsv
        dv = w * tl.sum(x[:, None] * ds, 0)
        tl.store(DV + ptok * V + cv, (tl.load(DV + ptok * V + cv, mask=vm, other=0.).to(tl.float32) + dv)
                 .to(DV.dtype.element_ty), mask=vm)
    tl.store(DX + ptok * K + ck, (tl.load(DX + ptok * K + ck, mask=km, other=0.).to(tl.float32) + dx)
             .to(DX.dtype.element_ty), mask=km)
    if VARLEN:
        tl.store(DOM + otok, tl.load(DOM + otok, mask=T > 0, other=0.) + tl.sum(dw, 0), mask=T > 0)
    else:
        tl.store(DOM + otok, tl.load(DOM + otok) + tl.sum(dw, 0))


def _launch(K: int, V: int):
    """(BT, BK, BV, warps) of the band kernels (ours): the whole key and value width in one tile."""
    BK, BV = _np2(K), _np2(V)
    BT = 32 if max(BK, BV) <= 64 else 16
    return BT, BK, BV, 4


def _packed(cu_seqlens, q, T: int, XT: int, W: int):
    """(SEQ [T]: each step's sequence, PSEQ [XT]: each pair row's sequence, CU, VARLEN) for a packed call (B = 1; the
    pair stream holds each sequence's W - 1 carried rows before its pairs), or dummies (q, never read) without."""
    if cu_seqlens is None:
        return q, q, q, False
    if q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) run on a batch of 1, got B = {q.shape[0]}")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    n = cu[1:] - cu[:-1]
    N = n.numel()
    if XT != T + N * (W - 1):
        raise ValueError(f"the packed pair stream must have T + N (W - 1) = {T + N * (W - 1)} rows, got {XT}")
    idx = torch.arange(N, device=q.device, dtype=torch.int32)
    return (torch.repeat_interleave(idx, n.long(), output_size=T), torch.repeat_interleave(idx, (n + W - 1).long(),
                                                                                        output_size=XT), cu, True)


def window_delayed_forward(q, xw, vw, eta, g, S0, *, read_after, C, W, allow_tf32=False, cu_seqlens=None):
    """-> (O [B, T, H, V] in q's dtype, S_T [B, H, K, V] fp32, (HS, OM, CC)): Falcon-3A's core as one Falcon-1A scan
    of the completed weights c plus the band (module docstring). cu_seqlens (B = 1; ours, FALCON_TRITON_3A_PACKED=
    delayed): the packed sequences natively, xw / vw the packed pair stream of T + N (W - 1) rows; S0 and S_T with one
    row per sequence."""
    if W < 2:
        raise ValueError(f"the delayed window form takes W >= 2, got {W}")
    B, T, H, K = q.shape
    V = vw.shape[-1]
    XT = xw.shape[1]
    dev = q.device
    WP = next_pow2(W)
    SEQ, PSEQ, CU, VL = _packed(cu_seqlens, q, T, XT, W)
    OM = torch.empty(B, T, H, WP, dtype=torch.float32, device=dev)
    CC = torch.empty(B, T, H, dtype=torch.float32, device=dev)
    BTw = 128
    _wd_weights[(cdiv(T, BTw), B * H)](eta, g, OM, CC, T, H, W, WP, BTw, SEQ, CU, VL, num_warps=4)
    O1, ST, (HS, _A, _WT, _R) = chunk_forward(q, xw, vw, CC, g, S0, delta=False, read_after=read_after, C=C, xoff=0,
                                              allow_tf32=allow_tf32, out_dtype=torch.float32, cu_seqlens=cu_seqlens)
    O = _empty((B, T, H, V), q.dtype, dev)
    BT, BK, BV, nw = _launch(K, V)
    _wd_band_fwd[(cdiv(T, BT), B * H)](q, xw, vw, OM, O1, O, ST, T, XT, H, K, V, W, WP, BT, BK, BV,
                                       0 if read_after else 1, SEQ, CU, VL, num_warps=nw)
    if VL:
        _wd_tail_seq[(ST.shape[0] * H,)](xw, vw, OM, ST, CU, H, K, V, W, WP, BK, num_warps=4)
    return O, ST, (HS, OM, CC)


def window_delayed_backward(q, xw, vw, eta, g, saved, dO, dST, *, read_after, C, W, allow_tf32=False,
                            need_ds0=True, cu_seqlens=None):
    HS, OM, CC = saved
    B, T, H, K = q.shape
    V = vw.shape[-1]
    XT = xw.shape[1]
    dev = q.device
    WP = OM.shape[-1]
    SEQ, PSEQ, CU, VL = _packed(cu_seqlens, q, T, XT, W)
    dq, dx, dv, dc, dg, dS0 = chunk_backward(q, xw, vw, CC, g, (HS, CC, CC, CC), dO, dST, delta=False,
                                             read_after=read_after, C=C, xoff=0, allow_tf32=allow_tf32,
                                             need_ds0=need_ds0, zero_rest=False, cu_seqlens=cu_seqlens)
    DOM = _empty((B, T, H, WP), torch.float32, dev)  # columns 1 .. W-1 of every row written by _wd_band_bwd
    BT, BK, BV, nw = _launch(K, V)
    _wd_band_bwd[(cdiv(XT, BT), B * H)](q, xw, vw, OM, dO, dq, dx, dv, DOM, T, XT, H, K, V, W, WP, BT, BK, BV,
                                       0 if read_after else 1, SEQ, PSEQ, CU, VL, num_warps=nw)
    if dST is not None:  # the final state's band (after _wd_band_bwd: it adds to DOM's last row)
        _wd_tail_bwd[(W - 1, dST.shape[0] * H)](xw, vw, OM, dST, dx, dv, DOM, T, XT, H, K, V, WP, BK, min(64, BV), CU,
                                                W, VL, num_warps=4)
    deta = _empty((B, T, H), torch.float32, dev)
    BTw = 128
    _wd_weights_bwd[(cdiv(T, BTw), B * H)](eta, g, DOM, dc, deta, dg, T, H, W, WP, BTw, SEQ, CU, VL, num_warps=4)
    return dq, dx, dv, deta.to(eta.dtype), dg, dS0
