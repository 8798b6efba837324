"""Falcon-3A in ONE chunked scan: the window's pairs enter through a banded intra-chunk mask (ours).

Falcon-3A's update (no delta, scalar gates, window W >= 2), per (batch, head), 0-based step t:

    S_t = γ_t S_{t-1} + η_t Σ_{m<W} x_{t,m} v_{t,m}ᵀ ,   o_t = S_tᵀ q_t   (or S_{t-1}ᵀ q_t)

where step t's pairs are the rows t .. t+W-1 of the pair stream xw/vw (kernel-contract.md: xw has T+W-1
rows, the first W-1 carried). The W-scan path (`__init__.core`) runs one Falcon-1A scan per window slot and
sums them; here one scan reads each pair once (falcon-math.md §6's window chunk form). In a chunk of C
steps with local log-prefix u_i = Σ_{r<=i} g_r, read prefix ur = u (after) or u - g (before), state S at
the chunk start, and the step-to-read decay Dr[i, s] = [s <= i | s < i] e^{ur_i - u_s} η_s:

  * the chunk's "own" pairs j' = 0..C-1 (rows nC+W-1+j', step j''s newest pair) belong to steps
    s = j' .. min(j'+W-1, C-1) of this chunk: M_o[i, j'] = Σ_{m<W} Dr[i, j'+m];
  * its W-1 "carried" pairs c (rows nC+c, the previous chunk's last own pairs) belong to steps s = 0..c:
    M_c[i, c] = Σ_{s<=c} Dr[i, s];

    o_i   = e^{ur_i} q_iᵀ S + Σ_j' (q_i·x_j') M_o[i,j'] v_j' + Σ_c (q_i·x_c) M_c[i,c] v_c
    S_out = e^{u_C} S + Σ_j' m_o[j'] x_j' v_j'ᵀ + Σ_c m_c[c] x_c v_cᵀ,   with w_s = e^{u_C - u_s} η_s,
            m_o[j'] = Σ_{m<W} w_{j'+m} (j'+m < C),  m_c[c] = Σ_{s<=c} w_s.

The band sums are formed elementwise from shifted loads of g and η (no fp32 dot, so no precision knob), every
exponent <= 0. Backward by hand: the adjoint of each band sum is a shift of a vector, done with a [C, C]
selection. The carried pairs' gradients land in a small [B·H, NT, 16, K|V] buffer that the launcher adds to
the previous chunk's rows. Kernels: _wl_fwd_state (sequential over chunks), _wl_fwd_out (per chunk),
_wl_bwd_state (reverse sequential), _wl_bwd_main (per chunk). W <= 16.

Status: interpreter-tested (tests/test_triton_interp.py, `fused` cases) against the float64 loop. On the H200
(2026-12-02, 273f685 and 5d7a5d8) `bench check --variants 3A` passed every row at K <= 64 and K = 128 with
C <= 32 that it reached, and failed at K = 128, C = 64 (see `chunk_for`, which now avoids that chunk). With that
cap its whole sweep passed on 2026-12-03 at c2485d2 (29/29 rows without a failure: every core row, bf16 and fp32,
K = 16/64/128, the public op with continuation, CUDA-graph decode; the varlen-native rows "not implemented":
benchmarks/results/h200_logs/kernels_2026-12-03b/call3_c2485d2/check_banded3a_sweep/), so `core` runs it by default
(FALCON_TRITON_3A=banded; `=scans` or `fused_window=False` keeps the W scans, which also run every packed call).
Timed in the full `bench kernels` of that commit (benchmarks/results/kernels_h200.json, public op, bf16): fwd+bwd
3.13 / 3.53 / 3.62 / 5.93 ms against the W scans' 4.60 / 5.56 / 5.45 / 10.53 ms (0.56-0.68x) at (16, 2048, 12, 64),
(4, 8192, 12, 64), (16, 2048, 6, 128), (1, 32768, 6, 128), at lower peak memory (985 vs 1278 MB at K = 64).
Its backward's _wl_bwd_main takes the read-out's row sum from the dq accumulator after the value loop (ours, as
chunk.py's backward does per key tile for Falcon-1; since 2026-12-03) with its own value block of 32
(FALCON_TRITON_3A_BWD_BV); see the note above WL_BWD_BV for the H200 proof and timings (fwd+bwd 0.75x of the kernel
before it at (16, 2048, 12, 64), same call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (_empty, _np2, _prec, _stages, _state_get, _state_init, _state_put, _state_tile, _varlen_chunk,
                     _varlen_seq, cdiv, varlen_args)
from .host import env_choice

BW = 16  # the carried-pairs tile (W - 1 <= 15 rows used)
# _wl_bwd_main's read-out row sum d_ur_i ∋ e^{ur_i} Σ_v dO_iv (q_i S)_v (ours, as chunk.py's _bwd_dqdx does): taken
# after the value loop from the dq accumulator, q_i · (dO_i Sᵀ) (one dot and one [C, BV] fp32 tile fewer per value
# block than the kernel proven on the H200 up to 2026-12-03, which formed q·S per value block inside the loop), with q
# loaded again after the loop and dq, dx stored before the band adjoints. Same sum, different rounding. Offline (sm_90a,
# Triton 3.6 ptxas -v, bf16, W = 4, 8 warps, both 255 registers): spill stores 920 -> 572 bytes at K = V = 64, C = 64
# (smem 69632 -> 61440), 888 -> 268 at K = V = 128, C = 32 (110592 -> 94208); W = 16: 4952 -> 1968.
# Its value block (ours): FALCON_TRITON_3A_BWD_BV = 16 / 32 / 64 / 128, default 32 since 2026-12-03 (before: the
# forward's, 64 at K <= 64, 32 above). Offline (sm_90a, Triton 3.6, bf16, K = V = 64, C = 64, W = 4, 8 warps) BV = 32
# cut the spill stores from 572 to 120 bytes.
# On the H200 (2026-12-03 at 12b0470, benchmarks/results/h200_logs/kernels_2026-12-03d/): this form passed rows 1-25
# of `bench check --variants 3A` (every row the banded scan implements: core bf16/fp32 K = V = 16/64/128 at every
# chunk size, the public op with continuation, CUDA-graph decode) at the forward's value block, and with BV = 32 the
# 16 quick rows (K = 16/64/128, bf16 and fp32, varlen continuation, decode, native varlen); fwd+bwd of the public op
# with BV = 32: 2.37 / 5.25 / 2.71 / 2.93 ms at (16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64),
# (16, 2048, 6, 128), against 3.18 ms with the in-loop dots at the first shape in the same call. Tried and removed
# (FALCON_TRITON_3A_BWD=dots / split, the switch gone with them): the in-loop dots above, and a split into
# _wl_bwd_main storing dA = dP ⊙ M plus a per-key-tile dq/dx kernel (fewer spills offline; on the H200 at c84b0ad
# 25/25 rows passed but fwd+bwd was 3-4 % slower and peak 36-120 MB higher: kernels_2026-12-03e).
WL_BWD_BV = env_choice("FALCON_TRITON_3A_BWD_BV", "32", ("16", "32", "64", "128"),
                       "Falcon-3A banded: the backward's value tile (32 proven)")
# The largest chunk (ours): "64" (the default: the asked chunk, capped at 32 above K = 64, chunk_for) or "32" (capped
# at 32 for every K). Why: _wl_bwd_main, 1.60 of Falcon-3A's 2.4 ms at (16, 2048, 12, 64) (kernels_2026-12-03h), does
# [C, C] band work per chunk (W exponentials of [C, C] and their adjoints), C² per chunk and C per token, while the
# sequential passes it would lengthen take 0.11 + 0.06 ms there. Every K <= 64 build at C = 32 is in the H200's check
# sweep (the core rows at every chunk size). On the H200 (2026-12-04, one process, 2 rounds, GPU time): 32 is 1.18-1.21x
# the time at K = 64 (16x2048x12x64, 4x8192x12x64; 1.15-1.18x with band weights), the same at K = 128 (where both are
# 32): the sequential passes grow more than the band work shrinks. Kept as an opt-in for other shapes.
WL_CHUNK = env_choice("FALCON_TRITON_3A_CHUNK", "64", ("64", "32"),
                      "Falcon-3A banded: the largest chunk, 64 (32 above K = 64) or 32")
# The forward state pass's weights m_o, m_c (ours): "shifted" (the proven form: W shifted loads of g and η, each with
# its own cumsum, and W - 1 scalar extractions for m_c) or "band" (m_o[j'] = Σ_{j' <= s < j'+W} w_s and
# m_c[c] = Σ_{s <= c} w_s as one masked [C, C] and one [BW, C] row sum of w, which the chunk computes anyway: one cumsum
# per chunk instead of W + 1, no shifted loads). The same sums up to the order of the fp32 additions. Written
# 2026-12-03 (sixteenth session) after the H200 profile put _wl_fwd_state, the sequential pass that forms them per
# chunk, at 1.88 ms of Falcon-3A's 5.3 at (1, 32768, 6, 128) against Falcon-1's _fwd_state 0.74 ms
# (kernels_2026-12-03h). Offline (sm_90a, Triton 3.6, bf16, W = 4, 4 warps): at K = 128, C = 32 (the long shape's
# launch) 186 -> 127 registers and 1472 -> 1152 SASS instructions; at K = 64, C = 64 (the [C, C] band is 32 values a
# thread) 2656 -> 2840 instructions, stack 184 -> 240 bytes — so the A/B decides, per chunk size. _wl_bwd_main keeps
# the shifted form (offline no fewer instructions or spills with the band). On the H200 (2026-12-04, seventeenth
# session, kernels_2026-12-04): Falcon-3A's whole check sweep passes with "band" (29/29 rows), and in one process
# (2 rounds, GPU time) it is 0.986 / 0.905 / 0.951 / 0.998x the time of "shifted" at 16x2048x12x64, 1x32768x6x128,
# 4x8192x12x64, 16x2048x6x128, peak unchanged: the default since then ("shifted" kept as the opt-out).
WL_WEIGHTS = env_choice("FALCON_TRITON_3A_WEIGHTS", "band", ("shifted", "band"),
                        "Falcon-3A banded: the forward state pass's weights by band sums or shifted loads")


@triton.jit
def _shifted(G, ETA, b, h, n, i, m: tl.constexpr, g, T, H: tl.constexpr, C: tl.constexpr):
    """Step j'+m of chunk n, as vectors over j': (u_{j'+m}, η_{j'+m}, valid). u is the chunk-local inclusive
    log-prefix: u_{j'+m} = Σ_{r<m} g_r + Σ_{r<=j'} g_{r+m}."""
    rows = n * C + i + m
    val = (i + m < C) & (rows < T)
    tok = (b * T + rows).to(tl.int64) * H + h
    gm = tl.load(G + tok, mask=val, other=0.).to(tl.float32)
    em = tl.load(ETA + tok, mask=val, other=0.).to(tl.float32)
    um = tl.cumsum(gm, 0) + tl.sum(tl.where(i < m, g, 0.), 0)
    return um, em, val


@triton.jit
def _shift(vec, i, m: tl.constexpr):
    """out[s] = vec[s - m] (0 for s < m): the adjoint of reading position j' + m."""
    return tl.sum(tl.where(i[:, None] == i[None, :] + m, vec[None, :], 0.), 1)


@triton.jit
def _chunk_vecs(G, b, h, n, i, T, H: tl.constexpr, C: tl.constexpr, READ_AFTER: tl.constexpr):
    """Chunk n's steps: (row mask, token offsets, g, inclusive log-prefix u, read prefix ur)."""
    rows = n * C + i
    rmask = rows < T
    tok = (b * T + rows).to(tl.int64) * H + h
    g = tl.load(G + tok, mask=rmask, other=0.).to(tl.float32)
    u = tl.cumsum(g, 0)
    if READ_AFTER:
        ur = u
    else:
        ur = u - g
    return rmask, tok, g, u, ur


@triton.jit
def _pair_rows(b, h, n, i, c, XT, H: tl.constexpr, C: tl.constexpr, W: tl.constexpr):
    """Pair-stream offsets of chunk n: its own pairs (rows nC+W-1+i) and its carried pairs (rows nC+c, c < W-1)."""
    otok = (b * XT + n * C + W - 1 + i).to(tl.int64) * H + h
    ctok = (b * XT + n * C + c).to(tl.int64) * H + h
    return otok, ctok, c < W - 1


@triton.jit
def _load_pairs(P, otok, ctok, rmask, cm, cols, cmask, D: tl.constexpr):
    """The own [C, B*] and carried [BW, B*] rows of XW (D = K) or VW (D = V), masked."""
    own = tl.load(P + otok[:, None] * D + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.)
    car = tl.load(P + ctok[:, None] * D + cols[None, :], mask=cm[:, None] & cmask[None, :], other=0.)
    return own, car


@triton.jit
def _band_own(G, ETA, b, h, n, i, g, ur, T, H: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
              READ_AFTER: tl.constexpr):
    """M_o [C (read i), C (own pair j')] = Σ_m Dr[i, j'+m]."""
    M = tl.zeros([C, C], dtype=tl.float32)
    for m in tl.static_range(W):
        um, em, val = _shifted(G, ETA, b, h, n, i, m, g, T, H, C)
        s = i + m
        if READ_AFTER:
            caus = s[None, :] <= i[:, None]
        else:
            caus = s[None, :] < i[:, None]
        M += tl.where(caus & val[None, :], tl.exp(tl.minimum(ur[:, None] - um[None, :], 0.)) * em[None, :], 0.)
    return M


@triton.jit
def _band_carried(i, c, u, eta, ur, C: tl.constexpr, W: tl.constexpr, READ_AFTER: tl.constexpr,
                  BWc: tl.constexpr):
    """M_c [C (read i), BW (carried pair c)] = Σ_{s<=c} Dr[i, s], c < W-1."""
    M = tl.zeros([C, BWc], dtype=tl.float32)
    for s in tl.static_range(W - 1):
        u_s = tl.sum(tl.where(i == s, u, 0.), 0)
        e_s = tl.sum(tl.where(i == s, eta, 0.), 0)
        if READ_AFTER:
            caus = s <= i
        else:
            caus = s < i
        col = tl.where(caus, tl.exp(tl.minimum(ur - u_s, 0.)) * e_s, 0.)
        M += tl.where(((c >= s) & (c < W - 1))[None, :], col[:, None], 0.)
    return M


@triton.jit
def _state_weights(G, ETA, b, h, n, i, c, g, eta, u, uC, T, H: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
                   BWc: tl.constexpr, BANDW: tl.constexpr):
    """(m_o [C], m_c [BW], w [C]): the weights of the own and carried pairs in S_out, and w_s = e^{u_C-u_s} η_s
    (0 past T, where η is). BANDW (WL_WEIGHTS="band"): m_o and m_c as band sums of w."""
    if BANDW:
        w = tl.exp(tl.minimum(uC - u, 0.)) * eta
        d = i[None, :] - i[:, None]  # [j', s]: s - j'
        mo = tl.sum(tl.where((d >= 0) & (d < W), w[None, :], 0.), 1)
        mc = tl.sum(tl.where((i[None, :] <= c[:, None]) & (c < W - 1)[:, None], w[None, :], 0.), 1)
    else:
        mo = tl.zeros([C], dtype=tl.float32)
        for m in tl.static_range(W):
            um, em, val = _shifted(G, ETA, b, h, n, i, m, g, T, H, C)
            mo += tl.where(val, tl.exp(tl.minimum(uC - um, 0.)) * em, 0.)
        w = tl.exp(tl.minimum(uC - u, 0.)) * eta
        mc = tl.zeros([BWc], dtype=tl.float32)
        for s in tl.static_range(W - 1):
            w_s = tl.sum(tl.where(i == s, w, 0.), 0)
            mc += tl.where((c >= s) & (c < W - 1), w_s, 0.)
    return mo, mc, w


@triton.jit
def _wl_fwd_state(XW, VW, ETA, G, S0, HS, ST, T, XT, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  C: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BWc: tl.constexpr,
                  HAS_S0: tl.constexpr, PREC: tl.constexpr, BANDW: tl.constexpr, CU, CIDX, COFF,
                  VARLEN: tl.constexpr):
    """Sequential over chunks per (value tile, b·H + h). VARLEN (packed sequences, ours): b is the sequence, its
    steps, pairs and chunk slots found from CU / COFF (common.varlen), its state rows S0[b], ST[b]."""
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    i = tl.arange(0, C)
    c = tl.arange(0, BWc)
    ck, kmask, cv, vmask, smask, soff = _state_tile(vb, K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    S = _state_init(S0, bh64, soff, smask, HAS_S0, K, V, BK, BV)
    if VARLEN:
        bos, T, NL, coff = _varlen_seq(CU, COFF, b, C)
        pbos = bos + b.to(tl.int64) * (W - 1)  # its pair rows: each sequence's W - 1 carried rows before its pairs
        ETA += bos * H
        G += bos * H
        XW += pbos * H * K
        VW += pbos * H * V
        HS += coff * K * V
        hs = h.to(tl.int64)
        b = 0
    else:
        NL = NT
        hs = bh64
    for n in range(0, NL):
        _state_put(HS, S, hs, n, NT, soff, smask, K, V)
        rmask, tok, g, u, ur = _chunk_vecs(G, b, h, n, i, T, H, C, True)
        eta = tl.load(ETA + tok, mask=rmask, other=0.).to(tl.float32)
        uC = tl.sum(g, 0)
        mo, mc, w = _state_weights(G, ETA, b, h, n, i, c, g, eta, u, uC, T, H, C, W, BWc, BANDW)
        otok, ctok, cm = _pair_rows(b, h, n, i, c, XT, H, C, W)
        xo, xc = _load_pairs(XW, otok, ctok, rmask, cm, ck, kmask, K)
        vo, vc = _load_pairs(VW, otok, ctok, rmask, cm, cv, vmask, V)
        dt = xo.dtype
        S = S * tl.exp(uC)
        S += tl.dot(tl.trans(xo), (vo.to(tl.float32) * mo[:, None]).to(dt), input_precision=PREC)
        S += tl.dot(tl.trans(xc), (vc.to(tl.float32) * mc[:, None]).to(dt), input_precision=PREC)
    tl.store(ST + bh64 * K * V + soff, S, mask=smask)


@triton.jit
def _wl_fwd_out(Q, XW, VW, ETA, G, HS, O, T, XT, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                C: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BWc: tl.constexpr,
                READ_AFTER: tl.constexpr, PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr):
    """Per (value tile, chunk, b·H + h). VARLEN: the chunk axis walks the packed plan's slots (an empty slot reads
    sequence 0's first chunk with every step masked and writes nothing)."""
    vb = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    if VARLEN:
        sq, n, bos, T, coff = _varlen_chunk(CU, CIDX, COFF, n)
        pbos = bos + sq.to(tl.int64) * (W - 1)  # as in _wl_fwd_state
        Q += bos * H * K
        ETA += bos * H
        G += bos * H
        O += bos * H * V
        XW += pbos * H * K
        VW += pbos * H * V
        HS += coff * K * V
    i = tl.arange(0, C)
    c = tl.arange(0, BWc)
    ck, kmask, cv, vmask, smask, soff = _state_tile(vb, K, V, BK, BV)
    rmask, tok, g, u, ur = _chunk_vecs(G, b, h, n, i, T, H, C, READ_AFTER)
    eta = tl.load(ETA + tok, mask=rmask, other=0.).to(tl.float32)
    otok, ctok, cm = _pair_rows(b, h, n, i, c, XT, H, C, W)
    q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
    dt = q.dtype
    xo, xc = _load_pairs(XW, otok, ctok, rmask, cm, ck, kmask, K)
    vo, vc = _load_pairs(VW, otok, ctok, rmask, cm, cv, vmask, V)
    Po = tl.dot(q, tl.trans(xo), input_precision=PREC) * _band_own(G, ETA, b, h, n, i, g, ur, T, H, C, W, READ_AFTER)
    Pc = tl.dot(q, tl.trans(xc), input_precision=PREC) * _band_carried(i, c, u, eta, ur, C, W, READ_AFTER, BWc)
    S = _state_get(HS, bh, n, NT, soff, smask, K, V)
    o = tl.dot(q, S.to(dt), input_precision=PREC) * tl.exp(ur)[:, None]
    o += tl.dot(Po.to(dt), vo, input_precision=PREC)
    o += tl.dot(Pc.to(dt), vc, input_precision=PREC)
    tl.store(O + tok[:, None] * V + cv[None, :], o.to(O.dtype.element_ty), mask=rmask[:, None] & vmask[None, :])


@triton.jit
def _wl_bwd_state(Q, G, DO, DST, DHS, DS0, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr,
                  HAS_DST: tl.constexpr, STORE_DS0: tl.constexpr, PREC: tl.constexpr, CU, COFF,
                  VARLEN: tl.constexpr):
    """DHS[n] = dL/dS at the END of chunk n; S's only other reader is the read-out e^{ur} qᵀ S. VARLEN as in
    _wl_fwd_state."""
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    i = tl.arange(0, C)
    ck, kmask, cv, vmask, smask, soff = _state_tile(vb, K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    dH = _state_init(DST, bh64, soff, smask, HAS_DST, K, V, BK, BV)
    if VARLEN:
        bos, T, NL, coff = _varlen_seq(CU, COFF, b, C)
        Q += bos * H * K
        G += bos * H
        DO += bos * H * V
        DHS += coff * K * V
        hs = h.to(tl.int64)
        b = 0
    else:
        NL = NT
        hs = bh64
    for nn in range(0, NL):
        n = NL - 1 - nn
        _state_put(DHS, dH, hs, n, NT, soff, smask, K, V)
        rmask, tok, g, u, ur = _chunk_vecs(G, b, h, n, i, T, H, C, READ_AFTER)
        q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
        do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=rmask[:, None] & vmask[None, :], other=0.)
        dH = dH * tl.exp(tl.sum(g, 0)) + tl.dot(tl.trans(q), (do.to(tl.float32) * tl.exp(ur)[:, None]).to(q.dtype),
                                                input_precision=PREC)
    if STORE_DS0:
        tl.store(DS0 + bh64 * K * V + soff, dH, mask=smask)


@triton.jit
def _wl_store_dqdx(DQ, DX, DXC, tok, otok, cbase, c, ck, km, ckm, dq, dxo, dxc, K: tl.constexpr):
    tl.store(DQ + tok[:, None] * K + ck[None, :], dq.to(DQ.dtype.element_ty), mask=km)
    tl.store(DX + otok[:, None] * K + ck[None, :], dxo.to(DX.dtype.element_ty), mask=km)
    tl.store(DXC + (cbase + c)[:, None] * K + ck[None, :], dxc, mask=ckm)


@triton.jit
def _wl_bwd_main(Q, XW, VW, ETA, G, HS, DHS, DO, DQ, DX, DV, DXC, DVC, DETA, DG, T, XT, NT,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, BWc: tl.constexpr, READ_AFTER: tl.constexpr,
                 PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr):
    """The banded scan's backward per chunk: dv, dη, d log γ, dq, dx. VARLEN as in _wl_fwd_out: per-chunk buffers
    (HS, DHS, the carried rows' DXC / DVC) by the program's slot; an empty slot writes nothing (its carried rows
    masked too: its slot's DXC rows are never read, but it would store what it read from unwritten HS / DHS)."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    slot = n
    if VARLEN:
        sq, n, bos, T, _coff = _varlen_chunk(CU, CIDX, COFF, slot)
        pbos = bos + sq.to(tl.int64) * (W - 1)  # as in _wl_fwd_state
        Q += bos * H * K
        ETA += bos * H
        G += bos * H
        DO += bos * H * V
        DQ += bos * H * K
        DETA += bos * H
        DG += bos * H
        XW += pbos * H * K
        VW += pbos * H * V
        DX += pbos * H * K
        DV += pbos * H * V
    i = tl.arange(0, C)
    c = tl.arange(0, BWc)
    ck = tl.arange(0, BK)
    kmask = ck < K
    rmask, tok, g, u, ur = _chunk_vecs(G, b, h, n, i, T, H, C, READ_AFTER)
    eta = tl.load(ETA + tok, mask=rmask, other=0.).to(tl.float32)
    uC = tl.sum(g, 0)
    otok, ctok, cm = _pair_rows(b, h, n, i, c, XT, H, C, W)
    if VARLEN:
        cm = cm & (c * 0 + T > 0)
    km = rmask[:, None] & kmask[None, :]
    ckm = cm[:, None] & kmask[None, :]
    q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=km, other=0.)
    dt = q.dtype
    xo, xc = _load_pairs(XW, otok, ctok, rmask, cm, ck, kmask, K)
    # Pᵀ built directly from dots with swapped operands (a transposed [C, C] dot result is never fed to a dot:
    # the Hopper miscompile of Triton 3.4-3.7.0, fla #640). The band matrices and qxᵀ are formed again after the
    # value loop rather than kept live across it (fewer [C, C] fp32 tiles in registers; ours).
    PoT = (tl.dot(xo, tl.trans(q), input_precision=PREC)
           * tl.trans(_band_own(G, ETA, b, h, n, i, g, ur, T, H, C, W, READ_AFTER))).to(dt)
    PcT = (tl.dot(xc, tl.trans(q), input_precision=PREC)
           * tl.trans(_band_carried(i, c, u, eta, ur, C, W, READ_AFTER, BWc))).to(dt)
    mo, mc, w = _state_weights(G, ETA, b, h, n, i, c, g, eta, u, uC, T, H, C, W, BWc, False)
    dPo = tl.zeros([C, C], dtype=tl.float32)
    dPc = tl.zeros([C, BWc], dtype=tl.float32)
    dq = tl.zeros([C, BK], dtype=tl.float32)
    dxo = tl.zeros([C, BK], dtype=tl.float32)
    dxc = tl.zeros([BWc, BK], dtype=tl.float32)
    dmo = tl.zeros([C], dtype=tl.float32)
    dmc = tl.zeros([BWc], dtype=tl.float32)
    d_ur = tl.zeros([C], dtype=tl.float32)
    duC = tl.sum(tl.zeros([C], dtype=tl.float32), 0)
    hbase = (bh.to(tl.int64) * NT + slot) * K * V
    cbase = (bh.to(tl.int64) * NT + slot) * BWc
    for vb in range(0, tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        vmask = cv < V
        vm = rmask[:, None] & vmask[None, :]
        cvm = cm[:, None] & vmask[None, :]
        soff = ck[:, None] * V + cv[None, :]
        smask = kmask[:, None] & vmask[None, :]
        S = tl.load(HS + hbase + soff, mask=smask, other=0.)
        dH = tl.load(DHS + hbase + soff, mask=smask, other=0.)
        Sd = S.to(dt)
        dHd = dH.to(dt)
        do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(dt)
        vo, vc = _load_pairs(VW, otok, ctok, rmask, cm, cv, vmask, V)
        dPo += tl.dot(do, tl.trans(vo), input_precision=PREC)
        dPc += tl.dot(do, tl.trans(vc), input_precision=PREC)
        dq += tl.dot(do, tl.trans(Sd), input_precision=PREC)
        duC += tl.sum(tl.sum(dH * S, 1), 0) * tl.exp(uC)
        xoG = tl.dot(xo, dHd, input_precision=PREC)
        xcG = tl.dot(xc, dHd, input_precision=PREC)
        vof = vo.to(tl.float32)
        vcf = vc.to(tl.float32)
        dmo += tl.sum(xoG * vof, 1)
        dmc += tl.sum(xcG * vcf, 1)
        dxo += tl.dot((vof * mo[:, None]).to(dt), tl.trans(dHd), input_precision=PREC)
        dxc += tl.dot((vcf * mc[:, None]).to(dt), tl.trans(dHd), input_precision=PREC)
        dvo = tl.dot(PoT, do, input_precision=PREC) + xoG * mo[:, None]
        dvc = tl.dot(PcT, do, input_precision=PREC) + xcG * mc[:, None]
        tl.store(DV + otok[:, None] * V + cv[None, :], dvo.to(DV.dtype.element_ty), mask=vm)
        tl.store(DVC + (cbase + c)[:, None] * V + cv[None, :], dvc, mask=cvm)
    Mo = _band_own(G, ETA, b, h, n, i, g, ur, T, H, C, W, READ_AFTER)
    Mc = _band_carried(i, c, u, eta, ur, C, W, READ_AFTER, BWc)
    dAo = dPo * Mo
    dAc = dPc * Mc
    # the read-out's row sum Σ_v dO_iv (q_i S)_v = q_i · (dO_i Sᵀ), off dq before its e^{ur} (ours); q loaded again
    # rather than kept live across the loop (ours: fewer spills offline, see above WL_BWD_BV)
    q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=km, other=0.)
    d_ur += tl.exp(ur) * tl.sum(q.to(tl.float32) * dq, 1)
    dq = dq * tl.exp(ur)[:, None] + tl.dot(dAo.to(dt), xo, input_precision=PREC) \
        + tl.dot(dAc.to(dt), xc, input_precision=PREC)
    dxo += tl.trans(tl.dot(tl.trans(q), dAo.to(dt), input_precision=PREC))
    dxc += tl.trans(tl.dot(tl.trans(q), dAc.to(dt), input_precision=PREC))
    dMo = dPo * tl.dot(q, tl.trans(xo), input_precision=PREC)
    dMc = dPc * tl.dot(q, tl.trans(xc), input_precision=PREC)
    # dq, dx are final here: stored before the band adjoints, not kept live through them (ours)
    _wl_store_dqdx(DQ, DX, DXC, tok, otok, cbase, c, ck, km, ckm, dq, dxo, dxc, K)
    # the band sums' adjoints: d(Dr[i, s]) from M_o (s = j'+m) and M_c (s <= c), and dw_s from m_o, m_c
    d_u = tl.zeros([C], dtype=tl.float32)
    d_eta = tl.zeros([C], dtype=tl.float32)
    dw = tl.zeros([C], dtype=tl.float32)
    for m in tl.static_range(W):
        um, em, val = _shifted(G, ETA, b, h, n, i, m, g, T, H, C)
        s = i + m
        if READ_AFTER:
            caus = s[None, :] <= i[:, None]
        else:
            caus = s[None, :] < i[:, None]
        E = tl.where(caus & val[None, :], tl.exp(tl.minimum(ur[:, None] - um[None, :], 0.)), 0.)
        Z = dMo * E
        d_ur += tl.sum(Z * em[None, :], 1)
        d_u -= _shift(tl.sum(Z, 0) * em, i, m)
        d_eta += _shift(tl.sum(Z, 0), i, m)
        dw += _shift(tl.where(val, dmo, 0.), i, m)
    for s in tl.static_range(W - 1):
        u_s = tl.sum(tl.where(i == s, u, 0.), 0)
        e_s = tl.sum(tl.where(i == s, eta, 0.), 0)
        if READ_AFTER:
            caus_s = s <= i
        else:
            caus_s = s < i
        E_s = tl.where(caus_s, tl.exp(tl.minimum(ur - u_s, 0.)), 0.)
        cs = tl.sum(tl.where(((c >= s) & cm)[None, :], dMc, 0.), 1)
        d_ur += cs * E_s * e_s
        zs = tl.sum(cs * E_s, 0)
        d_u -= tl.where(i == s, zs * e_s, 0.)
        d_eta += tl.where(i == s, zs, 0.)
        dw += tl.where(i == s, tl.sum(tl.where((c >= s) & cm, dmc, 0.), 0), 0.)
    dwe = dw * w
    duC += tl.sum(dwe, 0)
    d_u -= dwe
    d_eta += dw * tl.exp(tl.minimum(uC - u, 0.))
    d_u += d_ur
    d_u += tl.where(i == C - 1, duC, 0.)
    dg = tl.cumsum(d_u, 0, reverse=True)
    if not READ_AFTER:
        dg -= d_ur
    tl.store(DETA + tok, d_eta, mask=rmask)
    tl.store(DG + tok, dg, mask=rmask)


def chunk_for(K: int, C: int) -> int:
    """The chunk this kernel runs at for head size K when C is asked for (ours). On the H200 (Triton 3.6,
    2026-12-02, benchmarks/results/h200_logs/kernels_2026-12-02d/) every K = 128, C = 64 row failed in the
    forward read-out (bf16: o off by 0.4 while S_T and every gradient passed; fp32: an illegal memory access),
    at 4 warps and at 8, while K = 128 at C = 16 and 32 and K <= 64 at C = 64 passed. The cause is not known,
    so above K = 64 the chunk is capped at 32: the scan is exact at any chunk size. WL_CHUNK = "32" caps it at 32
    for every K."""
    return min(C, 32) if K > 64 or WL_CHUNK == "32" else C


def _tiles(K: int, V: int):
    BK = _np2(K)
    return BK, min(64 if BK <= 64 else 32, _np2(V))


def window_linear_forward(q, xw, vw, eta, g, S0, *, read_after, C, W, allow_tf32=False, cu_seqlens=None):
    """-> (O [B, T, H, V] in q's dtype, S_T [B, H, K, V] fp32, (HS,)): Falcon-3A's core in one scan. cu_seqlens
    (B = 1; ours, FALCON_TRITON_3A_PACKED=banded): the packed sequences run natively, xw / vw the packed pair stream
    of T + N (W - 1) rows (each sequence's W - 1 carried rows before its pairs); S0 and S_T have one row per
    sequence."""
    if not 2 <= W <= BW:
        raise ValueError(f"the fused window kernel takes 2 <= W <= {BW}, got {W}")
    B, T, H, K = q.shape
    XT = xw.shape[1]
    V = vw.shape[-1]
    va, NT, NS = varlen_args(cu_seqlens, q, T, C, cdiv(T, C), B)
    BK, BV = _tiles(K, V)
    prec = _prec(q.dtype, allow_tf32, q.device, K, V)
    st = _stages(q.dtype)
    HS = torch.empty(B, H, NT, K, V, dtype=torch.float32, device=q.device)
    ST = _empty((NS, H, K, V), torch.float32, q.device)
    cu, cidx, coff, varlen = va
    _wl_fwd_state[(cdiv(V, BV), NS * H)](xw, vw, eta, g, S0 if S0 is not None else eta, HS, ST, T, XT, NT,
                                         H, K, V, C, W, BK, BV, BW, S0 is not None, prec,
                                         WL_WEIGHTS == "band", cu, cidx, coff, varlen, **st)
    O = _empty((B, T, H, V), q.dtype, q.device)
    _wl_fwd_out[(cdiv(V, BV), NT, B * H)](q, xw, vw, eta, g, HS, O, T, XT, NT, H, K, V, C, W, BK, BV, BW,
                                          read_after, prec, cu, cidx, coff, varlen, **st)
    return O, ST, (HS,)


def window_linear_backward(q, xw, vw, eta, g, saved, dO, dST, *, read_after, C, W, allow_tf32=False,
                           need_ds0=True, cu_seqlens=None):
    (HS,) = saved
    B, T, H, K = q.shape
    XT = xw.shape[1]
    V = vw.shape[-1]
    va, NT, NS = varlen_args(cu_seqlens, q, T, C, cdiv(T, C), B)
    cu, cidx, coff, varlen = va
    BK, BV = _tiles(K, V)
    dev = q.device
    prec = _prec(q.dtype, allow_tf32, dev, K, V)
    st = _stages(q.dtype)
    f32 = torch.float32
    DHS = torch.empty(B, H, NT, K, V, dtype=f32, device=dev)
    DS0 = _empty((NS, H, K, V), f32, dev) if need_ds0 else None
    _wl_bwd_state[(cdiv(V, BV), NS * H)](q, g, dO, dST if dST is not None else eta, DHS,
                                         DS0 if DS0 is not None else eta, T, NT, H, K, V, C, BK, BV,
                                         read_after, dST is not None, need_ds0, prec, cu, coff, varlen, **st)
    dq = _empty(q.shape, q.dtype, dev)
    dxo = _empty(xw.shape, f32, dev)  # the own pairs' part (rows W-1..): rows 0..W-2 are only ever carried
    dvo = _empty(vw.shape, f32, dev)
    DXC = torch.zeros(B * H, NT, BW, K, dtype=f32, device=dev)
    DVC = torch.zeros(B * H, NT, BW, V, dtype=f32, device=dev)
    deta = _empty(eta.shape, eta.dtype, dev)
    dg = _empty(g.shape, g.dtype, dev)
    _wl_bwd_main[(NT, B * H)](q, xw, vw, eta, g, HS, DHS, dO, dq, dxo, dvo, DXC, DVC, deta, dg, T, XT, NT,
                              H, K, V, C, W, BK, int(WL_BWD_BV), BW, read_after, prec, cu, cidx, coff, varlen,
                              num_warps=8, **st)
    pk = _packed_rows(cu_seqlens, XT, W, dev) if varlen else None
    dx = _add_carried(dxo, DXC, xw.dtype, C, W, NT, pk, coff)
    dv = _add_carried(dvo, DVC, vw.dtype, C, W, NT, pk, coff)
    return dq, dx, dv, deta, dg, DS0


@triton.jit
def _wl_carried_sum(OWN, CAR, OUT, N, XT, NT, H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
                    BWc: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SEQ, XCU, COFF, VARLEN: tl.constexpr):
    """OUT[row e] = OWN[e] (e >= W-1: a step's own pair) + CAR[chunk e // C, e % C] (e % C < W-1: a pair carried into
    chunk e // C), in OUT's dtype, over the rows (b·XT + e)·H + h of the pair stream. VARLEN (B = 1): e counts from
    the first row of the row's sequence SEQ[row] (its pair rows start at XCU[s]) and chunk n is slot COFF[s] + n,
    if the sequence has it (slot < COFF[s + 1])."""
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = r < N
    h = r % H
    e = (r // H) % XT
    b = r // (H * XT)
    if VARLEN:
        sq = tl.load(SEQ + e, mask=rmask, other=0)
        e = e - tl.load(XCU + sq, mask=rmask, other=0)
    cd = tl.arange(0, BD)
    dmask = cd[None, :] < D
    val = tl.load(OWN + r[:, None] * D + cd[None, :], mask=(rmask & (e >= W - 1))[:, None] & dmask, other=0.)
    n = e // C
    c = e % C
    if VARLEN:
        slot = tl.load(COFF + sq, mask=rmask, other=0) + n
    else:
        slot = n
    crow = ((b * H + h) * NT + slot) * BWc + c
    if VARLEN:  # the chunk exists in the row's sequence
        cmask = rmask & (c < W - 1) & (slot < tl.load(COFF + sq + 1, mask=rmask, other=0))
    else:
        cmask = rmask & (c < W - 1) & (n < NT)
    val += tl.load(CAR + crow[:, None] * D + cd[None, :], mask=cmask[:, None] & dmask, other=0.)
    tl.store(OUT + r[:, None] * D + cd[None, :], val.to(OUT.dtype.element_ty), mask=rmask[:, None] & dmask)


def _packed_rows(cu_seqlens, XT: int, W: int, dev):
    """Packed pair stream (ours): (each row's sequence [XT] int32, each sequence's first pair row [N + 1] int32)."""
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    xcu = (cu + torch.arange(cu.numel(), device=dev, dtype=torch.int32) * (W - 1)).contiguous()
    seq = torch.searchsorted(xcu[1:], torch.arange(XT, device=dev, dtype=torch.int32), right=True).to(torch.int32)
    return seq.contiguous(), xcu


def _add_carried(own, car, dtype, C: int, W: int, NT: int, packed=None, coff=None):
    """The pair stream's gradient: the own pairs' rows (fp32, from _wl_bwd_main) plus the carried pairs' (chunk n's
    rows nC + c, c < W-1), in the stream's dtype. One launch instead of zero-fill, gather, index_add and cast.
    packed: _packed_rows' (row sequences, pair-row offsets) with the plan's chunk offsets coff, for packed sequences."""
    B, XT, H, D = own.shape
    out = _empty(own.shape, dtype, own.device)
    BD = _np2(D)
    BR = max(16, min(128, 4096 // BD))
    N = B * XT * H
    seq, xcu = packed if packed is not None else (own, own)
    _wl_carried_sum[(cdiv(N, BR),)](own, car, out, N, XT, NT, H, D, C, W, BW, BR, BD, seq, xcu,
                                    coff if packed is not None else own, packed is not None)
    return out
