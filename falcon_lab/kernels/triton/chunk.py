"""Triton chunk kernels of the Falcon core for scalar gates and window 1 (Falcon-1 and Falcon-1A).

The core recurrence (docs/kernel-contract.md), per (batch, head), 0-based t:

    S_t = γ_t S_{t-1} + η_t x_t (v_t - [delta] S_{t-1}ᵀ x_t)ᵀ ,   o_t = S_tᵀ q_t   (or S_{t-1}ᵀ q_t)

Chunk form (our derivation, stable-exponent, falcon-math.md §6.1/§6.4). In a chunk with local
log-prefix u_i = Σ_{r<=i} g_r (g = log γ <= 0), ub_i = u_i - g_i, read prefix ur = u (after) or ub
(before), and state S at the chunk start:

    delta:  (I + L) R = V - diag(e^{ub}) X S,   L_{s,r} = (x_s·x_r) η_r e^{ub_s - u_r}  (r < s)
            A = (I + L)^{-1},  Wt = A diag(e^{ub}) X,  Vt = A V,  R = Vt - Wt S,  U = diag(η) R
    linear: U = diag(η) V
    o_i   = e^{ur_i} q_iᵀ S + Σ_{s <= i (after) | s < i (before)} (q_i·x_s) e^{ur_i - u_s} U_s
    S_out = e^{u_C} S + Xᵀ diag(e^{u_C - u}) U

Every exponent is <= 0 (clamped with min(., 0) against rounding). Kernels:

    forward:  _fwd_prep (delta only; per chunk: Gram, L, triangular inverse A, Wt, Vt)
              _fwd_state (sequential over chunks; states at chunk starts, residuals R, final state)
              _fwd_out   (per chunk: outputs)
    backward: _bwd_dul   (per chunk: dU = Pᵀ dO, the intra-chunk part)
              _bwd_state (reverse sequential: state gradients at chunk ends, full dU, dS0)
              _bwd_cc    (per chunk: dv, dη, M and Gm, the [C, C] gate terms; ours, as the next two)
              _bwd_dqdx  (per key tile and chunk: dq, dx, the gate row sums of the tile)
              _bwd_gate  (per chunk: dg)

All accumulation is fp32; dot operands are in the input dtype (bf16/fp16 -> tensor cores; fp32 ->
full-precision "ieee" dots unless tf32 is asked for). States and the backward's dU are kept in fp32;
Wt, Vt and R (the residuals) are stored in the input dtype (as fla does), and A too (FALCON_TRITON_A_DTYPE=input, the
default; fp32 with =fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (POISON, _cfg, _chunk_rows, _empty, _np2, _prec, _stages, _state_init,  # noqa: F401
                     _state_put, _state_tile, _state_tile_k, _varlen_chunk, _varlen_seq, cdiv, launch,
                     linear_state_tiles, state_bv, state_opts, varlen_args)
from .host import env_choice, refuse_unproven
from .pair_sum import pair_sum
from .state_split import bwd_state_split, fwd_state_split, split_pieces

# The backward's per-chunk work (dq, dx, dv, dη, dg) runs as three kernels, _bwd_cc, _bwd_dqdx and _bwd_gate (ours,
# the default since 2026-12-03: at most three fp32 accumulators live in each value loop, 4 warps, fla-style). Its
# one-kernel forms, _bwd_main with the gate-gradient row sums formed inside the value loop ("dots", proven up to
# 5e0a3b1) and then from the dq, dx accumulators after it ("rowsum", proven at 5e0a3b1), were removed: in one process
# on the H200 (2026-12-03, fourteenth session, switch_ab.py, GPU time; benchmarks/results/h200_logs/kernels_2026-12-03f/)
# rowsum took 1.218 / 1.002 / 1.200 / 1.004x the split's time for Falcon-1 and 1.182 / 1.012 / 1.142 / 1.051x for
# Falcon-1A at (16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128), for 57-106 MB less peak
# (the split's scratch). FALCON_TRITON_BWD_MAIN is no longer read.
# The storage of the triangular inverse A between _fwd_prep and the backward (ours): "input" (the inputs' dtype, as
# fla stores its A; the default) or "fp32". Every reader casts A to the inputs' dtype after loading it (_bwd_cc:
# AiT = trans(A).to(dt)), and a store rounds as that cast does, so the gradients do not change. On the H200 with
# "input": Falcon-1's and Falcon-3's (expansion) whole check sweeps (29/29 each; 2026-12-03, 3a650c1 and 71520f4,
# kernels_2026-12-03f), fwd+bwd 0.986-0.996x "fp32" in one process, peak -24 to -48 MB (Falcon-1) and -96 to -192 MB
# (Falcon-3's expansion) at the benchmark's four shapes; Falcon-3 in place (gather=True) rows 1-25 of `bench check
# --variants 3` (every row it implements; 2026-12-03, fifteenth session, 5ceb36d, kernels_2026-12-03g), the default
# for it since then too (until then "auto" kept it in fp32).
A_DTYPE = env_choice("FALCON_TRITON_A_DTYPE", "input", ("input", "fp32"),
                     "Falcon-1/-3: the triangular inverse A stored in the inputs' dtype or fp32 (both proven)")
# Falcon-3 in place: dq per step (ours): "kernel" (_bwd_dqdx sums each step's W pseudo-token rows in fp32 before its
# store: dq [B, T, H, K] instead of [B, T·W, H, K], no host sum kernel, one rounding instead of two; the default since
# 2026-12-03, sixteenth session: Falcon-3's 25 check rows pass with it on the H200, 0.986-0.993x the time and -24 MB
# peak, as op_memory.py predicted, in one process) or "host" (_bwd_dqdx writes one row per pseudo-token, W-fold, and
# the launcher sums each step's W rows; proven).
DQ_SUM = env_choice("FALCON_TRITON_3_DQ_SUM", "kernel", ("kernel", "host"),
                    "Falcon-3 in place: dq summed per step in _bwd_dqdx or on the host")
# The per-chunk states' storage (ours): "input" (the inputs' dtype, as fla's chunk_fwd_h stores h; the default since
# 2026-12-04) or "fp32" (the default before, proven): HS (the state at each chunk's start, from _fwd_state) and DHS
# (the gradient at its end, from _bwd_state), read by _fwd_out and _bwd_dqdx. The sequential passes keep their fp32
# tile; every read feeds a dot in the inputs' dtype (S.to(dt)), the same value as a store in that dtype, except
# _bwd_dqdx's Σ dH ⊙ S for d log γ, which then sums rounded states. Half the bytes written by the passes and read back
# (at (1, 32768, 6, 128) 201 -> 101 MB each), and half of two of the larger buffers (Falcon-3's are W-fold). Written
# 2026-12-03 (sixteenth session) for Falcon-1's state passes, 1.06x fla's at that shape. On the H200 (2026-12-04,
# seventeenth session, kernels_2026-12-04): the whole check sweeps of Falcon-1 (29/29), -1A (29/29) and -3 (25/25,
# every row its in-place path implements) pass with "input"; in one process (2 rounds, GPU time) it is 0.92-0.97x
# (Falcon-1), 0.85-0.94x (1A), 0.93-0.98x (3) the time of "fp32" at the four shapes, and the ops' own peaks are
# op_memory.py's predictions: at (16, 2048, 12, 64) / (1, 32768, 6, 128) Falcon-1 880.5 -> 784.5 / 995.3 -> 803.3 MB,
# Falcon-1A 688.5 -> 592.5 / 851.3 -> 659.3, Falcon-3 in place 2674.6 -> 2290.6 / 3137.3 -> 2369.3.
STATE_DTYPE = env_choice("FALCON_TRITON_STATE_DTYPE", "input", ("fp32", "input"),
                         "Falcon-1/-1A/-3: the per-chunk states HS, DHS in the inputs' dtype or fp32 (both proven)")


# The diagonal 16 x 16 blocks' inverses in _fwd_prep (ours): "subst" (forward substitution, _inv16: 15 dependent
# steps, each two masked cross-thread sums over the block; proven, the default) or "prod" (_inv16_prod: the product
# (I - L)(I + L²)(I + L⁴)(I + L⁸) as tensor-core dots at the block substitution's precision, truncated where L's powers
# vanish: two dots for Falcon-3 at W = 4, whose L is block-strict over groups of W, six for Falcon-1; percol_delta's
# INV_FORM="prod" is the same product, proven for Falcon-2's per-column inverses). Written 2026-12-04 (twenty-second
# session) after an H200 profile put _fwd_prep at 1.65 of Falcon-3's 7.3 ms at (16, 2048, 12, 64)
# (kernels_2026-12-03h/call5). On the H200 (2026-12-05, twenty-third session, 5852125,
# benchmarks/results/h200_logs/kernels_2026-12-05/): the whole check sweeps of Falcon-1 and -3 pass with "prod" (29/29
# each), and in one process it takes Falcon-1 to 0.855 / 0.968 / 0.869 / 0.941x and Falcon-3 to 0.867 / 0.966 / 0.881 /
# 0.940x the GPU time of "subst" at (16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128)
# (_fwd_prep 0.43 -> 0.23 and 1.64 -> 0.74 ms at the first): the default since then.
A_INV = env_choice("FALCON_TRITON_A_INV", "prod", ("subst", "prod"),
                   "Falcon-1/-3: _fwd_prep's diagonal-block inverses by substitution or as a product of dots (both "
                   "proven)")


# The backward's dU buffer (ours): "fp32" (proven, the default) or "input" (the inputs' dtype, as fla keeps its dv
# between chunk_bwd_dv_local and the reverse state pass): _bwd_dul (or _bwd_dul_state) writes dU's intra part,
# _bwd_state adds its state part in fp32 and stores it rounded, _bwd_cc reads it. Every kernel computes in fp32 and only
# the buffer changes (its loads are promoted), so the fp32 builds' code is unchanged. Half its bytes: at
# (16, 2048, 12, 64) bf16 101 MB for Falcon-1, W times that for Falcon-3's pseudo-tokens (its largest backward buffer,
# written twice and read twice). Written 2026-12-04 (twenty-second session). On the H200 (2026-12-05,
# benchmarks/results/h200_logs/kernels_2026-12-05/): the sweeps of Falcon-1, -1A and -3 pass with "input" (29/29 each,
# beside GATE_FOLD=on), and in one process it is 0.968 / 0.976 / 0.978 / 0.979x (Falcon-1), 0.969 / 0.989 / 0.977 /
# 0.950x (1A), 0.983 / 0.982 / 0.980 / 0.984x (3) the GPU time of "fp32" at the four shapes, Falcon-3's peak 2290.6 ->
# 2170.6 MB as op_memory.py predicted: the default since then.
DU_DTYPE = env_choice("FALCON_TRITON_DU_DTYPE", "input", ("fp32", "input"),
                      "Falcon-1/-1A/-3: the backward's dU buffer in fp32 or the inputs' dtype (both proven)")


# Falcon-3 in place: the step-only terms on the chunk's steps (ours): "off" (every term over the C pseudo-token rows
# of a chunk; proven, the default until 2026-12-05), "after" (the default since: SROWS for calls that read after the
# write, the builds the H200 ran) or "on" (SROWS for both read orders; read-before is interpreter-tested only and on
# CUDA runs only with FALCON_TRITON_UNPROVEN=1). SROWS: _fwd_out's read-out, _bwd_dul's Pᵀ dO, _bwd_cc's DOU = dO Uᵀ
# and M, _bwd_dqdx's dO Sᵀ, M x and Mᵀ q, and _bwd_state's qᵀ dO on the chunk's C / W step rows: q and dO are the same
# on a step's W pseudo-tokens, and dO, O live on the first one only, so W - 1 of every W rows of those products were
# copies or zeros; M is stored per step, [B, T, H, C] instead of [B, T·W, H, C]. Where C / W >= 16 (a dot's smallest
# side; W = 4 at C = 64, the default) and dq is summed in the kernel (DQ_SUM). Written 2026-12-05 (twenty-fourth
# session) after the compiled small model's profile put _bwd_dqdx (1.20 ms), _bwd_state (0.78), _bwd_cc (0.65),
# _fwd_out (0.28) and _bwd_dul (0.18) at 3.1 of Falcon-3's 4.7 ms per layer at (16, 2048, 6, 128)
# (kernels_2026-12-05b/call1/model_op.log). On the H200 the same day (7a32399, kernels_2026-12-05b/call2/): rows 1-28
# of Falcon-3's check sweep pass with "on" (NaN-poisoned, bf16 and fp32, K = V = 16 / 64 / 128, T = 8192 with the
# delta split, T = 1000, strong decay, the public op; every row that runs SROWS reads after; row 29, a packed row on
# the host expansion that never runs it, was cut by the call's time cap), and in one process it takes Falcon-3 to
# 0.916 / 0.959 / 0.942 / 0.939x the GPU time of "off" at (16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64),
# (16, 2048, 6, 128) (the five kernels 2.42 -> 2.16 ms at the first) and its peak from 2172.1 / 2274.0 / 2172.0 /
# 2250.1 to 2028.1 / 2202.0 / 2028.0 / 2178.1 MB, op_memory.py's prediction to the 0.1 MB.
STEP_ROWS = env_choice("FALCON_TRITON_3_STEP_ROWS", "after", ("off", "after", "on"),
                       "Falcon-3 in place: the read-out, dU, M and dq terms on the chunk's steps (read-after calls, "
                       "or every call) or on every pseudo-token row (off and after proven)")


def step_rows(gather: bool, C: int, group: int, device, read_after: bool = True) -> bool:
    """Whether a call's kernels run SROWS (STEP_ROWS): Falcon-3 in place, C // W >= 16, dq summed in the kernel, read
    after the write unless STEP_ROWS = "on" (read before: on CUDA only with FALCON_TRITON_UNPROVEN=1)."""
    if not (gather and STEP_ROWS != "off" and C // group >= 16 and DQ_SUM == "kernel"):
        return False
    if not read_after:
        if STEP_ROWS != "on":
            return False
        refuse_unproven(device, "FALCON_TRITON_3_STEP_ROWS=on with read='before'", "off or after")
    return True


def du_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the backward's dU buffer for inputs of `dtype` (DU_DTYPE)."""
    return dtype if DU_DTYPE == "input" else torch.float32


# dlog γ of the chunk backward (ours): "off" (_bwd_dqdx writes each key tile's row sums to PART and _bwd_gate forms dg;
# proven, the default) or "on" (where one key tile covers K, K <= 64: _bwd_dqdx forms dg itself, as _bwd_gate does,
# from the same sums: one launch, PART's write and read fewer per backward of Falcon-1, -1A, -3 and the 3A scans, whose
# small shapes are bound by the host's launches: Falcon-1A 1.28 ms of host time per fwd+bwd for 9 launches at
# (16, 2048, 12, 64), kernels_2026-12-04e/call1). Written 2026-12-04 (twenty-second session). On the H200 (2026-12-05,
# benchmarks/results/h200_logs/kernels_2026-12-05/) the sweeps of Falcon-1, -1A and -3 pass with "on" (beside
# DU_DTYPE=input), but in one process it is 1.002 / 1.034 / 1.022x (Falcon-1 / 1A / 3A) the GPU time of "off" at (16,
# 2048, 12, 64) and 1.002 / 1.028 / 1.018x at (4, 8192, 12, 64), the host's time within its noise: proven, "off" stays
# the default.
GATE_FOLD = env_choice("FALCON_TRITON_GATE_FOLD", "off", ("off", "on"),
                       "Falcon-1/-1A/-3: dlog γ inside _bwd_dqdx where one key tile covers K, or _bwd_gate (both "
                       "proven)")


def inv_groups(group: int) -> int:
    """_fwd_prep's INV_NG: 0 (substitution) or, with A_INV="prod", the power at which the diagonal blocks' L
    vanishes: the groups of `group` rows in a 16-row block (16 when `group` does not divide 16)."""
    if A_INV != "prod":
        return 0
    return 16 // group if 16 % group == 0 else 16


def a_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype A is stored in for inputs of `dtype` (A_DTYPE)."""
    return dtype if A_DTYPE == "input" else torch.float32


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the per-chunk states HS and their gradients DHS are stored in for inputs of `dtype` (STATE_DTYPE)."""
    return dtype if STATE_DTYPE == "input" else torch.float32


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------
@triton.jit
def _rows_w(b, h, n, i, T, XT, XOFF, H: tl.constexpr, C: tl.constexpr, W: tl.constexpr, GATHER: tl.constexpr):
    """Chunk n's rows and the offsets each stream is read at: (rows, row mask, tok: the kernel's own rows (its
    intermediates A, Wt, Vt, R, dU and per-row gradients), xtok: the pair stream (x, v), stok: the step stream (q, η,
    log γ, O, dO), smask: where log γ, O and dO live). Without GATHER all three are the rows themselves (smask is
    the row mask). With GATHER (Falcon-3 without the host's pseudo-token expansion, ours) row p = t·W + m is
    pseudo-token m of step t: q and η of step t, log γ, O and dO at m = 0 only, the pair at row t + W - 1 - m of xw
    and vw (XT = T / W + W - 1 rows a sequence): the expansion's gathers done by the loads."""
    if GATHER:
        rows = n * C + i
        rmask = rows < T
        tok = (b * T + rows).to(tl.int64) * H + h
        stok = (b * (T // W) + rows // W).to(tl.int64) * H + h
        xtok = (b * XT + rows // W + (W - 1) - rows % W).to(tl.int64) * H + h
        smask = rmask & (rows % W == 0)
    else:
        rows, rmask, tok, xtok = _chunk_rows(b, h, n, i, T, XT, XOFF, H, C)
        stok = tok
        smask = rmask
    return rows, rmask, tok, xtok, stok, smask


@triton.jit
def _ld_blk(X, ETA, G, b, h, row0, T, XT, XOFF, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
            W: tl.constexpr, GATHER: tl.constexpr):
    """One 16-row block of a chunk: keys, step, log-decay, token indices, row mask (streams as in _rows_w)."""
    j = tl.arange(0, 16)
    if GATHER:  # row0 is a multiple of 16: the block is "chunk" row0 // 16 of 16 rows
        rows, rm, tok, xtok, stok, gm = _rows_w(b, h, row0 // 16, j, T, XT, XOFF, H, 16, W, True)
    else:
        rows = row0 + j
        rm = rows < T
        tok = (b * T + rows).to(tl.int64) * H + h
        xtok = (b * XT + XOFF + rows).to(tl.int64) * H + h
    ck = tl.arange(0, BK)
    x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=rm[:, None] & (ck < K)[None, :], other=0.)
    if GATHER:
        eta = tl.load(ETA + stok, mask=rm, other=0.).to(tl.float32)
        g = tl.load(G + stok, mask=gm, other=0.).to(tl.float32)
    else:
        eta = tl.load(ETA + tok, mask=rm, other=0.).to(tl.float32)
        g = tl.load(G + tok, mask=rm, other=0.).to(tl.float32)
    return x, eta, g, tok, xtok, rm


@triton.jit
def _blk_L(xa, uba, xb, ub_, etab, PREC: tl.constexpr):
    """L block (rows of block a, columns of block b): (x_s·x_r) e^{ub_s - u_r} η_r."""
    gr = tl.dot(xa, tl.trans(xb), input_precision=PREC)
    return gr * tl.exp(tl.minimum(uba[:, None] - ub_[None, :], 0.)) * etab[None, :]


@triton.jit
def _inv16(L):
    """(I + L)^{-1} of a strictly lower 16 x 16 block by forward substitution."""
    i = tl.arange(0, 16)
    Ai = tl.where(i[:, None] == i[None, :], 1., 0.)
    for r in range(1, 16):
        lr = tl.sum(tl.where(i[:, None] == r, L, 0.), 0)
        new = tl.sum(lr[:, None] * Ai, 0)
        Ai = tl.where(i[:, None] == r, (tl.where(i == r, 1., 0.) - new)[None, :], Ai)
    return Ai


@triton.jit
def _inv16_prod(L, NG: tl.constexpr, IPREC: tl.constexpr):
    """(I + L)^{-1} of a strictly lower 16 x 16 block as the product (I - L)(I + L²)(I + L⁴)(I + L⁸) of tensor-core dots
    at IPREC (ours; as percol_delta's _inv_prod, INV_FORM="prod"), truncated where the powers vanish: L^NG = 0 with NG
    the groups in the block (16 / GROUP: Falcon-3's block-strict L over groups of W pseudo-tokens is nilpotent of
    index 16 / W, so W = 4 needs (I - L)(I + L²), two dots; Falcon-1 all six)."""
    i = tl.arange(0, 16)
    P = tl.where(i[:, None] == i[None, :], 1., 0.) - L
    if NG > 2:
        L2 = tl.dot(L, L, input_precision=IPREC)
        P += tl.dot(P, L2, input_precision=IPREC)
        if NG > 4:
            L4 = tl.dot(L2, L2, input_precision=IPREC)
            P += tl.dot(P, L4, input_precision=IPREC)
            if NG > 8:
                L8 = tl.dot(L4, L4, input_precision=IPREC)
                P += tl.dot(P, L8, input_precision=IPREC)
    return P


@triton.jit
def _inv_diag(L, IPREC: tl.constexpr, INV_NG: tl.constexpr):
    """A diagonal block's inverse: by forward substitution (INV_NG = 0, _inv16; proven) or as a product (_inv16_prod
    with NG = INV_NG)."""
    if INV_NG > 0:
        out = _inv16_prod(L, INV_NG, IPREC)
    else:
        out = _inv16(L)
    return out


@triton.jit
def _gfirst(g, i, GROUP: tl.constexpr):
    """log γ at the first pseudo-token of each row's group (Falcon-3 expansion); g itself if GROUP = 1."""
    out = g
    if GROUP > 1:
        out = tl.sum(tl.where(i[None, :] == (i - i % GROUP)[:, None], g[None, :], 0.), 1)
    return out


@triton.jit
def _gseg(z, i, GROUP: tl.constexpr):
    """Adjoint of _gfirst: the sum of z over each group, placed on the group's first row."""
    out = z
    if GROUP > 1:
        out = tl.sum(tl.where(i[:, None] == (i - i % GROUP)[None, :], z[None, :], 0.), 1)
    return out


@triton.jit
def _st_A(A, tok, rm, col0, blk, C: tl.constexpr):
    j = tl.arange(0, 16)
    tl.store(A + tok[:, None] * C + (col0 + j)[None, :], blk, mask=rm[:, None])


@triton.jit
def _fwd_prep(X, VV, ETA, G, A, WT, VT, T, XT, XOFF, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
              IPREC: tl.constexpr, GROUP: tl.constexpr, GATHER: tl.constexpr, CU, CIDX, COFF,
              VARLEN: tl.constexpr, INV_NG: tl.constexpr = 0):
    """Per chunk: A = (I + L)^{-1} by 16 x 16 blocks (diagonal blocks by forward substitution, the
    rest by block substitution A_ab = -A_aa Σ_{b<=c<a} L_ac A_cb with small dots), then
    Wt = A diag(e^{ub}) X and Vt = A V. NB = C / 16 blocks (1, 2 or 4)."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if VARLEN:  # packed sequences (B = 1): program n is chunk slot n; pointers moved to its sequence
        s_, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        xb = bos + s_ * XT  # the pair stream: each sequence's XT carried rows (W - 1), then its pairs
        X += xb * H * K
        VV += xb * H * V
        ETA += bos * H
        G += bos * H
        A += bos * H * C
        WT += bos * H * K
        VT += bos * H * V
    NB: tl.constexpr = C // 16
    j = tl.arange(0, 16)
    strict = (j // GROUP)[:, None] > (j // GROUP)[None, :]  # GROUP > 1: block-strict (Falcon-3)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    ck = tl.arange(0, BK)
    kmask = ck < K
    x0, e0, g0, tok0, xt0, m0 = _ld_blk(X, ETA, G, b, h, n * C, T, XT, XOFF, H, K, BK, GROUP, GATHER)
    dt = x0.dtype
    u0 = tl.cumsum(g0, 0)
    ub0 = u0 - _gfirst(g0, j, GROUP)
    A00 = _inv_diag(tl.where(strict, _blk_L(x0, ub0, x0, u0, e0, PREC), 0.), IPREC, INV_NG)
    _st_A(A, tok0, m0, 0, A00, C)
    if NB >= 2:
        x1, e1, g1, tok1, xt1, m1 = _ld_blk(X, ETA, G, b, h, n * C + 16, T, XT, XOFF, H, K, BK, GROUP, GATHER)
        u1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
        ub1 = u1 - _gfirst(g1, j, GROUP)
        L10 = _blk_L(x1, ub1, x0, u0, e0, PREC)
        A11 = _inv_diag(tl.where(strict, _blk_L(x1, ub1, x1, u1, e1, PREC), 0.), IPREC, INV_NG)
        A10 = -tl.dot(A11, tl.dot(L10, A00, input_precision=IPREC), input_precision=IPREC)
        _st_A(A, tok0, m0, 16, zero, C)
        _st_A(A, tok1, m1, 0, A10, C)
        _st_A(A, tok1, m1, 16, A11, C)
    if NB >= 4:
        x2, e2, g2, tok2, xt2, m2 = _ld_blk(X, ETA, G, b, h, n * C + 32, T, XT, XOFF, H, K, BK, GROUP, GATHER)
        u2 = tl.cumsum(g2, 0) + tl.sum(g0, 0) + tl.sum(g1, 0)
        ub2 = u2 - _gfirst(g2, j, GROUP)
        x3, e3, g3, tok3, xt3, m3 = _ld_blk(X, ETA, G, b, h, n * C + 48, T, XT, XOFF, H, K, BK, GROUP, GATHER)
        u3 = tl.cumsum(g3, 0) + tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)
        ub3 = u3 - _gfirst(g3, j, GROUP)
        L20 = _blk_L(x2, ub2, x0, u0, e0, PREC)
        L21 = _blk_L(x2, ub2, x1, u1, e1, PREC)
        L30 = _blk_L(x3, ub3, x0, u0, e0, PREC)
        L31 = _blk_L(x3, ub3, x1, u1, e1, PREC)
        L32 = _blk_L(x3, ub3, x2, u2, e2, PREC)
        A22 = _inv_diag(tl.where(strict, _blk_L(x2, ub2, x2, u2, e2, PREC), 0.), IPREC, INV_NG)
        A33 = _inv_diag(tl.where(strict, _blk_L(x3, ub3, x3, u3, e3, PREC), 0.), IPREC, INV_NG)
        A21 = -tl.dot(A22, tl.dot(L21, A11, input_precision=IPREC), input_precision=IPREC)
        A20 = -tl.dot(A22, tl.dot(L20, A00, input_precision=IPREC) + tl.dot(L21, A10, input_precision=IPREC),
                      input_precision=IPREC)
        A32 = -tl.dot(A33, tl.dot(L32, A22, input_precision=IPREC), input_precision=IPREC)
        A31 = -tl.dot(A33, tl.dot(L31, A11, input_precision=IPREC) + tl.dot(L32, A21, input_precision=IPREC),
                      input_precision=IPREC)
        A30 = -tl.dot(A33, tl.dot(L30, A00, input_precision=IPREC) + tl.dot(L31, A10, input_precision=IPREC)
                      + tl.dot(L32, A20, input_precision=IPREC), input_precision=IPREC)
        _st_A(A, tok0, m0, 32, zero, C)
        _st_A(A, tok0, m0, 48, zero, C)
        _st_A(A, tok1, m1, 32, zero, C)
        _st_A(A, tok1, m1, 48, zero, C)
        _st_A(A, tok2, m2, 0, A20, C)
        _st_A(A, tok2, m2, 16, A21, C)
        _st_A(A, tok2, m2, 32, A22, C)
        _st_A(A, tok2, m2, 48, zero, C)
        _st_A(A, tok3, m3, 0, A30, C)
        _st_A(A, tok3, m3, 16, A31, C)
        _st_A(A, tok3, m3, 32, A32, C)
        _st_A(A, tok3, m3, 48, A33, C)
    # Wt = A diag(e^{ub}) X, block rows
    xs0 = (x0.to(tl.float32) * tl.exp(ub0)[:, None]).to(dt)
    km0 = m0[:, None] & kmask[None, :]
    tl.store(WT + tok0[:, None] * K + ck[None, :], tl.dot(A00.to(dt), xs0, input_precision=PREC).to(dt), mask=km0)
    if NB >= 2:
        xs1 = (x1.to(tl.float32) * tl.exp(ub1)[:, None]).to(dt)
        w1 = tl.dot(A10.to(dt), xs0, input_precision=PREC) + tl.dot(A11.to(dt), xs1, input_precision=PREC)
        tl.store(WT + tok1[:, None] * K + ck[None, :], w1.to(dt), mask=m1[:, None] & kmask[None, :])
    if NB >= 4:
        xs2 = (x2.to(tl.float32) * tl.exp(ub2)[:, None]).to(dt)
        xs3 = (x3.to(tl.float32) * tl.exp(ub3)[:, None]).to(dt)
        w2 = (tl.dot(A20.to(dt), xs0, input_precision=PREC) + tl.dot(A21.to(dt), xs1, input_precision=PREC)
              + tl.dot(A22.to(dt), xs2, input_precision=PREC))
        tl.store(WT + tok2[:, None] * K + ck[None, :], w2.to(dt), mask=m2[:, None] & kmask[None, :])
        w3 = (tl.dot(A30.to(dt), xs0, input_precision=PREC) + tl.dot(A31.to(dt), xs1, input_precision=PREC)
              + tl.dot(A32.to(dt), xs2, input_precision=PREC) + tl.dot(A33.to(dt), xs3, input_precision=PREC))
        tl.store(WT + tok3[:, None] * K + ck[None, :], w3.to(dt), mask=m3[:, None] & kmask[None, :])
    # Vt = A V, block rows, per value block
    for vb in range(0, tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        vmask = cv < V
        v0 = tl.load(VV + xt0[:, None] * V + cv[None, :], mask=m0[:, None] & vmask[None, :], other=0.)
        tl.store(VT + tok0[:, None] * V + cv[None, :], tl.dot(A00.to(dt), v0, input_precision=PREC).to(dt),
                 mask=m0[:, None] & vmask[None, :])
        if NB >= 2:
            v1 = tl.load(VV + xt1[:, None] * V + cv[None, :], mask=m1[:, None] & vmask[None, :], other=0.)
            y1 = tl.dot(A10.to(dt), v0, input_precision=PREC) + tl.dot(A11.to(dt), v1, input_precision=PREC)
            tl.store(VT + tok1[:, None] * V + cv[None, :], y1.to(dt), mask=m1[:, None] & vmask[None, :])
        if NB >= 4:
            v2 = tl.load(VV + xt2[:, None] * V + cv[None, :], mask=m2[:, None] & vmask[None, :], other=0.)
            v3 = tl.load(VV + xt3[:, None] * V + cv[None, :], mask=m3[:, None] & vmask[None, :], other=0.)
            y2 = (tl.dot(A20.to(dt), v0, input_precision=PREC) + tl.dot(A21.to(dt), v1, input_precision=PREC)
                  + tl.dot(A22.to(dt), v2, input_precision=PREC))
            tl.store(VT + tok2[:, None] * V + cv[None, :], y2.to(dt), mask=m2[:, None] & vmask[None, :])
            y3 = (tl.dot(A30.to(dt), v0, input_precision=PREC) + tl.dot(A31.to(dt), v1, input_precision=PREC)
                  + tl.dot(A32.to(dt), v2, input_precision=PREC) + tl.dot(A33.to(dt), v3, input_precision=PREC))
            tl.store(VT + tok3[:, None] * V + cv[None, :], y3.to(dt), mask=m3[:, None] & vmask[None, :])


@triton.jit
def _fwd_state(X, VV, ETA, G, WT, VT, S0, HS, R, ST, T, XT, XOFF, NT, H: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               DELTA: tl.constexpr, HAS_S0: tl.constexpr, STORE_ST: tl.constexpr,
               PREC: tl.constexpr, GROUP: tl.constexpr, GATHER: tl.constexpr, CU, CIDX, COFF,
               VARLEN: tl.constexpr, NKB: tl.constexpr = 1):
    """NKB > 1 (linear only; common.linear_state_tiles): program 0-axis index p runs key tile p % NKB of value block
    p // NKB."""
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    i = tl.arange(0, C)
    if NKB > 1:
        ck, kmask, cv, vmask, smask, soff = _state_tile_k(vb, K, V, BK, BV, NKB)
    else:
        ck, kmask, cv, vmask, smask, soff = _state_tile(vb, K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    S = _state_init(S0, bh64, soff, smask, HAS_S0, K, V, BK, BV)
    if VARLEN:  # packed sequences: (b, h) = (sequence, head); its chunks sit at slots coff.. of head h's NT slots
        bos, T, NL, coff = _varlen_seq(CU, COFF, b, C)
        xb = bos + b * XT  # the pair stream: each sequence's XT carried rows (W - 1), then its pairs
        X += xb * H * K
        VV += xb * H * V
        ETA += bos * H
        G += bos * H
        WT += bos * H * K
        VT += bos * H * V
        R += bos * H * V
        HS += coff * K * V
        hs = h.to(tl.int64)
        b = 0
    else:
        NL = NT
        hs = bh64
    for n in range(0, NL):
        _state_put(HS, S, hs, n, NT, soff, smask, K, V)
        rows, rmask, tok, xtok, stok, gmask = _rows_w(b, h, n, i, T, XT, XOFF, H, C, GROUP, GATHER)
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
        dt = x.dtype
        eta = tl.load(ETA + stok, mask=rmask, other=0.).to(tl.float32)
        g = tl.load(G + stok, mask=gmask, other=0.).to(tl.float32)
        u = tl.cumsum(g, 0)
        uC = tl.sum(g, 0)
        vm = rmask[:, None] & vmask[None, :]
        if DELTA:
            wt = tl.load(WT + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
            vt = tl.load(VT + tok[:, None] * V + cv[None, :], mask=vm, other=0.)
            r = vt.to(tl.float32) - tl.dot(wt, S.to(dt), input_precision=PREC)
            tl.store(R + tok[:, None] * V + cv[None, :], r.to(dt), mask=vm)
        else:
            r = tl.load(VV + xtok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        w = r * (eta * tl.exp(tl.minimum(uC - u, 0.)))[:, None]
        S = S * tl.exp(uC) + tl.dot(tl.trans(x), w.to(dt), input_precision=PREC)
    if STORE_ST:
        tl.store(ST + bh64 * K * V + soff, S, mask=smask)


@triton.jit
def _srows(b, h, n, T, H: tl.constexpr, C: tl.constexpr, W: tl.constexpr):
    """SROWS (Falcon-3 in place with C // W >= 16, STEP_ROWS; ours): chunk n's C // W steps as rows of their own. q and
    dO of a step are the same on its W pseudo-tokens and dO, O live on the first only, so the read-out, dU's intra
    part, M and dq are formed on these rows instead of the C pseudo-token rows of which W - 1 in W are zero or copies.
    Returns (j: the chunk's step index, the step rows' offsets (b·T/W + step)·H + h in the step streams, their mask);
    T counts pseudo-tokens."""
    NSC: tl.constexpr = C // W
    j = tl.arange(0, NSC)
    st = n * NSC + j
    return j, (b * (T // W) + st).to(tl.int64) * H + h, st < T // W


@triton.jit
def _at_steps(z, C: tl.constexpr, W: tl.constexpr):
    """[C] per pseudo-token -> [C // W]: each step's first pseudo-token's value, exactly."""
    z2 = tl.reshape(z, [C // W, W])
    return tl.sum(tl.where((tl.arange(0, W) == 0)[None, :], z2, 0.), 1)


@triton.jit
def _from_steps(zs, C: tl.constexpr, W: tl.constexpr):
    """[C // W] per step -> [C] per pseudo-token: at each step's first pseudo-token, zero at the others."""
    return tl.reshape(tl.where((tl.arange(0, W) == 0)[None, :], zs[:, None], 0.), [C])


@triton.jit
def _step_mask(j, i, W: tl.constexpr, READ_AFTER: tl.constexpr):
    """[C // W, C]: which pseudo-tokens step j's read sees (its own step's with READ_AFTER, the earlier steps')."""
    if READ_AFTER:
        return j[:, None] >= (i // W)[None, :]
    else:
        return j[:, None] > (i // W)[None, :]


@triton.jit
def _step_reads(Q, G, stok, gmask, i, b, h, n, T, ck, kmask, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                W: tl.constexpr, READ_AFTER: tl.constexpr):
    """SROWS' common reads of _fwd_out and _bwd_dul: the chunk's log-prefix u per pseudo-token, its steps (_srows),
    their q rows and their read prefixes (u with READ_AFTER, else the prefix before the step)."""
    g = tl.load(G + stok, mask=gmask, other=0.).to(tl.float32)
    u = tl.cumsum(g, 0)
    if READ_AFTER:
        ur = u
    else:
        ur = u - _gfirst(g, i, W)
    j, srow, smk = _srows(b, h, n, T, H, C, W)
    qs = tl.load(Q + srow[:, None] * K + ck[None, :], mask=smk[:, None] & kmask[None, :], other=0.)
    return u, j, srow, smk, qs, _at_steps(ur, C, W)


@triton.jit
def _fwd_out(Q, X, VV, R, ETA, G, HS, O, T, XT, XOFF, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr,
             READ_AFTER: tl.constexpr, PREC: tl.constexpr, GROUP: tl.constexpr, GATHER: tl.constexpr, CU, CIDX,
             COFF, VARLEN: tl.constexpr, SROWS: tl.constexpr = False):
    vb = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    if VARLEN:
        s_, n, bos, T, coff = _varlen_chunk(CU, CIDX, COFF, n)
        xb = bos + s_ * XT  # the pair stream: each sequence's XT carried rows (W - 1), then its pairs
        Q += bos * H * K
        X += xb * H * K
        VV += xb * H * V
        R += bos * H * V
        ETA += bos * H
        G += bos * H
        O += bos * H * V
        HS += coff * K * V
    i = tl.arange(0, C)
    rows, rmask, tok, xtok, stok, gmask = _rows_w(b, h, n, i, T, XT, XOFF, H, C, GROUP, GATHER)
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    vmask = cv < V
    km = rmask[:, None] & kmask[None, :]
    vm = rmask[:, None] & vmask[None, :]
    if SROWS:  # the read-out on the chunk's steps only (_srows)
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
        dt = Q.dtype.element_ty
        eta = tl.load(ETA + stok, mask=rmask, other=0.).to(tl.float32)
        u, j, srow, smk, qs, urs = _step_reads(Q, G, stok, gmask, i, b, h, n, T, ck, kmask, H, K, C, GROUP, READ_AFTER)
        qx = tl.dot(qs, tl.trans(x), input_precision=PREC)
        P = tl.where(_step_mask(j, i, GROUP, READ_AFTER), qx * tl.exp(tl.minimum(urs[:, None] - u[None, :], 0.)), 0.)
        S = tl.load(HS + (bh.to(tl.int64) * NT + n) * K * V + ck[:, None] * V + cv[None, :],
                    mask=kmask[:, None] & vmask[None, :], other=0.)
        if DELTA:
            r = tl.load(R + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        else:
            r = tl.load(VV + xtok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        U = (r * eta[:, None]).to(dt)
        o = tl.dot(qs, S.to(dt), input_precision=PREC) * tl.exp(urs)[:, None]
        o += tl.dot(P.to(dt), U, input_precision=PREC)
        tl.store(O + srow[:, None] * V + cv[None, :], o.to(O.dtype.element_ty), mask=smk[:, None] & vmask[None, :])
    else:
        q = tl.load(Q + stok[:, None] * K + ck[None, :], mask=km, other=0.)
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
        dt = q.dtype
        eta = tl.load(ETA + stok, mask=rmask, other=0.).to(tl.float32)
        g = tl.load(G + stok, mask=gmask, other=0.).to(tl.float32)
        u = tl.cumsum(g, 0)
        if READ_AFTER:
            ur = u
            causal = (i // GROUP)[:, None] >= (i // GROUP)[None, :]
        else:
            ur = u - _gfirst(g, i, GROUP)
            causal = (i // GROUP)[:, None] > (i // GROUP)[None, :]
        qx = tl.dot(q, tl.trans(x), input_precision=PREC)
        P = tl.where(causal, qx * tl.exp(tl.minimum(ur[:, None] - u[None, :], 0.)), 0.)
        S = tl.load(HS + (bh.to(tl.int64) * NT + n) * K * V + ck[:, None] * V + cv[None, :],
                    mask=kmask[:, None] & vmask[None, :], other=0.)
        if DELTA:
            r = tl.load(R + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        else:
            r = tl.load(VV + xtok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        U = (r * eta[:, None]).to(dt)
        o = tl.dot(q, S.to(dt), input_precision=PREC) * tl.exp(ur)[:, None]
        o += tl.dot(P.to(dt), U, input_precision=PREC)
        if GATHER:  # the step's output is its first pseudo-token's
            tl.store(O + stok[:, None] * V + cv[None, :], o.to(O.dtype.element_ty),
                     mask=gmask[:, None] & vmask[None, :])
        else:
            tl.store(O + tok[:, None] * V + cv[None, :], o.to(O.dtype.element_ty), mask=vm)


# ------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_dul(Q, X, G, DO, DU, T, XT, XOFF, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
             GROUP: tl.constexpr, GATHER: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr,
             SROWS: tl.constexpr = False):
    vb = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    if VARLEN:
        s_, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        xb = bos + s_ * XT  # the pair stream: each sequence's XT carried rows (W - 1), then its pairs
        Q += bos * H * K
        X += xb * H * K
        G += bos * H
        DO += bos * H * V
        DU += bos * H * V
    i = tl.arange(0, C)
    rows, rmask, tok, xtok, stok, gmask = _rows_w(b, h, n, i, T, XT, XOFF, H, C, GROUP, GATHER)
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    km = rmask[:, None] & kmask[None, :]
    vm = rmask[:, None] & (cv < V)[None, :]
    if SROWS:  # dU = Pᵀ dO over the chunk's steps only (dO lives on their first pseudo-tokens; _srows)
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
        dt = Q.dtype.element_ty
        u, j, srow, smk, qs, urs = _step_reads(Q, G, stok, gmask, i, b, h, n, T, ck, kmask, H, K, C, GROUP, READ_AFTER)
        xq = tl.dot(x, tl.trans(qs), input_precision=PREC)  # [C, C // W]: Pᵀ built directly
        PT = tl.where(tl.trans(_step_mask(j, i, GROUP, READ_AFTER)),
                      xq * tl.exp(tl.minimum(urs[None, :] - u[:, None], 0.)), 0.)
        dos = tl.load(DO + srow[:, None] * V + cv[None, :], mask=smk[:, None] & (cv < V)[None, :], other=0.).to(dt)
        du = tl.dot(PT.to(dt), dos, input_precision=PREC)
        tl.store(DU + tok[:, None] * V + cv[None, :], du, mask=vm)
    else:
        q = tl.load(Q + stok[:, None] * K + ck[None, :], mask=km, other=0.)
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
        dt = q.dtype
        g = tl.load(G + stok, mask=gmask, other=0.).to(tl.float32)
        u = tl.cumsum(g, 0)
        if READ_AFTER:
            ur = u
            causal = (i // GROUP)[:, None] >= (i // GROUP)[None, :]
        else:
            ur = u - _gfirst(g, i, GROUP)
            causal = (i // GROUP)[:, None] > (i // GROUP)[None, :]
        # Pᵀ built directly (rows s, columns i): no transpose of a dot result feeds a dot (fla #640).
        xq = tl.dot(x, tl.trans(q), input_precision=PREC)
        PT = tl.where(tl.trans(causal), xq * tl.exp(tl.minimum(ur[None, :] - u[:, None], 0.)), 0.)
        if GATHER:  # dO of a step reaches its first pseudo-token only
            do = tl.load(DO + stok[:, None] * V + cv[None, :], mask=gmask[:, None] & (cv < V)[None, :], other=0.).to(dt)
        else:
            do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(dt)
        du = tl.dot(PT.to(dt), do, input_precision=PREC)
        tl.store(DU + tok[:, None] * V + cv[None, :], du, mask=vm)


@triton.jit
def _bwd_dul_state(Q, X, G, DO, DU, DHS, T, XT, XOFF, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
                   CU, CIDX, COFF, VARLEN: tl.constexpr):
    """_bwd_dul for the linear key-split passes (LINEAR_KSPLIT, ours; window 1, no Falcon-3 groups), after _bwd_state:
    DU = Pᵀ dO (the intra-chunk part) + e^{u_C - u} ⊙ (x · dH) (the state part, dH = DHS[n], the gradient at the
    chunk's end), the sum over every key that the key-split pass cannot form. Grid (value tiles, chunks, B·H)."""
    vb = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    if VARLEN:
        s_, n, bos, T, coff = _varlen_chunk(CU, CIDX, COFF, n)
        xb = bos + s_ * XT  # the pair stream: each sequence's XT carried rows (W - 1), then its pairs
        Q += bos * H * K
        X += xb * H * K
        G += bos * H
        DO += bos * H * V
        DU += bos * H * V
        DHS += coff * K * V
    i = tl.arange(0, C)
    rows, rmask, tok, xtok, stok, gmask = _rows_w(b, h, n, i, T, XT, XOFF, H, C, 1, False)
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    vmask = cv < V
    km = rmask[:, None] & kmask[None, :]
    vm = rmask[:, None] & vmask[None, :]
    q = tl.load(Q + stok[:, None] * K + ck[None, :], mask=km, other=0.)
    x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
    dt = q.dtype
    g = tl.load(G + stok, mask=gmask, other=0.).to(tl.float32)
    u = tl.cumsum(g, 0)
    uC = tl.sum(g, 0)
    if READ_AFTER:
        ur = u
        causal = i[:, None] >= i[None, :]
    else:
        ur = u - g
        causal = i[:, None] > i[None, :]
    xq = tl.dot(x, tl.trans(q), input_precision=PREC)  # Pᵀ built directly, as in _bwd_dul
    PT = tl.where(tl.trans(causal), xq * tl.exp(tl.minimum(ur[None, :] - u[:, None], 0.)), 0.)
    do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(dt)
    dH = tl.load(DHS + (bh.to(tl.int64) * NT + n) * K * V + ck[:, None] * V + cv[None, :],
                 mask=kmask[:, None] & vmask[None, :], other=0.)
    du = (tl.dot(PT.to(dt), do, input_precision=PREC)
          + tl.dot(x, dH.to(dt), input_precision=PREC) * tl.exp(tl.minimum(uC - u, 0.))[:, None])
    tl.store(DU + tok[:, None] * V + cv[None, :], du, mask=vm)


@triton.jit
def _bwd_state(Q, X, ETA, G, WT, DO, DU, DST, DHS, DS0, T, XT, XOFF, NT, H: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               DELTA: tl.constexpr, READ_AFTER: tl.constexpr, HAS_DST: tl.constexpr,
               STORE_DS0: tl.constexpr, PREC: tl.constexpr, GROUP: tl.constexpr, GATHER: tl.constexpr, CU, CIDX,
               COFF, VARLEN: tl.constexpr, NKB: tl.constexpr = 1, SROWS: tl.constexpr = False):
    """NKB > 1 (linear only; common.linear_state_tiles): key tile p % NKB of value block p // NKB, and DU is neither
    read nor written (its state part, a sum over every key, is _bwd_dul_state's, after this pass). SROWS: qᵀ dO on the
    chunk's steps (_srows)."""
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    i = tl.arange(0, C)
    if NKB > 1:
        ck, kmask, cv, vmask, smask, soff = _state_tile_k(vb, K, V, BK, BV, NKB)
    else:
        ck, kmask, cv, vmask, smask, soff = _state_tile(vb, K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    dH = _state_init(DST, bh64, soff, smask, HAS_DST, K, V, BK, BV)
    if VARLEN:
        bos, T, NL, coff = _varlen_seq(CU, COFF, b, C)
        xb = bos + b * XT  # the pair stream: each sequence's XT carried rows (W - 1), then its pairs
        Q += bos * H * K
        X += xb * H * K
        ETA += bos * H
        G += bos * H
        WT += bos * H * K
        DO += bos * H * V
        DU += bos * H * V
        DHS += coff * K * V
        hs = h.to(tl.int64)
        b = 0
    else:
        NL = NT
        hs = bh64
    for nn in range(0, NL):
        n = NL - 1 - nn
        _state_put(DHS, dH, hs, n, NT, soff, smask, K, V)
        rows, rmask, tok, xtok, stok, gmask = _rows_w(b, h, n, i, T, XT, XOFF, H, C, GROUP, GATHER)
        km = rmask[:, None] & kmask[None, :]
        vm = rmask[:, None] & vmask[None, :]
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
        if SROWS:
            j, srow, smk = _srows(b, h, n, T, H, C, GROUP)
            q = tl.load(Q + srow[:, None] * K + ck[None, :], mask=smk[:, None] & kmask[None, :], other=0.)
        else:
            q = tl.load(Q + stok[:, None] * K + ck[None, :], mask=km, other=0.)
        dt = x.dtype
        eta = tl.load(ETA + stok, mask=rmask, other=0.).to(tl.float32)
        g = tl.load(G + stok, mask=gmask, other=0.).to(tl.float32)
        u = tl.cumsum(g, 0)
        uC = tl.sum(g, 0)
        if READ_AFTER:
            ur = u
        else:
            ur = u - _gfirst(g, i, GROUP)
        if SROWS:
            do = tl.load(DO + srow[:, None] * V + cv[None, :], mask=smk[:, None] & vmask[None, :],
                         other=0.).to(tl.float32)
        elif GATHER:
            do = tl.load(DO + stok[:, None] * V + cv[None, :], mask=gmask[:, None] & vmask[None, :],
                         other=0.).to(tl.float32)
        else:
            do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        if NKB == 1:
            du = tl.load(DU + tok[:, None] * V + cv[None, :], mask=vm, other=0.)
            du += tl.dot(x, dH.to(dt), input_precision=PREC) * tl.exp(tl.minimum(uC - u, 0.))[:, None]
            tl.store(DU + tok[:, None] * V + cv[None, :], du, mask=vm)
        dHn = dH * tl.exp(uC) + tl.dot(tl.trans(q), (do * tl.exp(_rows_of(ur, C, GROUP, SROWS))[:, None]).to(dt),
                                       input_precision=PREC)
        if DELTA:
            wt = tl.load(WT + tok[:, None] * K + ck[None, :], mask=km, other=0.)
            dHn -= tl.dot(tl.trans(wt), (du * eta[:, None]).to(dt), input_precision=PREC)
        dH = dHn
    if STORE_DS0:
        tl.store(DS0 + bh64 * K * V + soff, dH, mask=smask)


# ------------------------------------------------------------------------------------------------
# backward, per chunk (ours): dq, dx, dv, dη, dg in three kernels, each with at most three fp32 accumulators live in
# its value loop (fla's chunk_bwd_kernel_dqkwg keeps <= 4 at 4 warps):
#   _bwd_cc   (chunks x B·H): the [C, C] adjoints DOU = dO Uᵀ and (delta) dL = -dY Rᵀ over the value blocks, with
#             dY = Aᵀ(η dU) -> dv and dη; after the loop q·xᵀ, x·xᵀ (all of K) give the gate terms Z, Ψ, their row /
#             column sums, and M = DOU ⊙ Er, Gm = dL ⊙ Eb η (input dtype: the operands of the dq, dx dots) to
#             scratch [B, T, H, C]
#   _bwd_dqdx (K tiles x chunks x B·H): dO Sᵀ, U dHᵀ, dY Sᵀ for its key tile over the value blocks (dY read back from
#             dv: the same rows, in the input dtype), then dq and dx with M and Gm, and
#             the row sums q·(dO Sᵀ), x·(U dHᵀ), x·(dY Sᵀ) and Σ dH ⊙ S of its tile to scratch [B, T, H, NKt, 4]
#   _bwd_gate (chunks x B·H): the tiles' sums with _bwd_cc's vectors -> dg (the same reverse cumsum and _gseg)
# The gate-gradient row sums Σ_v dO_iv (q_i S)_v = q_i · (dO_i Sᵀ), and likewise x_i · (U_i dHᵀ), x_i · (dY_i Sᵀ), are
# taken per key tile from the accumulators (no q·S, x·dH, x·S dots in the value loops).
# ------------------------------------------------------------------------------------------------
def _split_cfg(K: int, V: int):
    """The split kernels' tiles and warps (ours): key tiles of 64 (all of K if smaller), value blocks of 32, 4 warps.
    Offline sm_90a builds (Triton 3.6 + its ptxas, bf16, C = 64, default 3 stages, arguments 16-aligned as on the GPU;
    2026-12-03): at K = V = 128 _bwd_cc 240 registers / 48 KB shared / no spill, _bwd_dqdx 227 / 72 KB / none (value
    blocks of 64: 255 registers, 88 and 12 bytes spilled, 88 and 144 KB), against the one-kernel form's 255 / 120 KB / 100
    bytes at 8 warps; at K = V = 64 244 and 219 registers, no spill (one kernel: 255, 340 bytes)."""
    BK = _np2(K)
    return min(64, BK), min(32, _np2(V)), 4


@triton.jit
def _bwd_rows(b, h, n, i, T, XT, XOFF, H: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr,
              GATHER: tl.constexpr):
    """_rows_w plus dxtok, the rows of the pair gradients: per pseudo-token rows (tok) with GATHER (the launcher sums
    each pair's W rows), the pair rows (xtok) otherwise."""
    rows, rmask, tok, xtok, stok, gmask = _rows_w(b, h, n, i, T, XT, XOFF, H, C, GROUP, GATHER)
    if GATHER:
        dxtok = tok
    else:
        dxtok = xtok
    return rmask, tok, xtok, stok, gmask, dxtok


@triton.jit
def _bwd_gates(G, stok, gmask, i, GROUP: tl.constexpr, READ_AFTER: tl.constexpr):
    """The chunk's log-prefixes: (u, u_C, ub, ur, e^{min(u_C - u, 0)})."""
    g = tl.load(G + stok, mask=gmask, other=0.).to(tl.float32)
    u = tl.cumsum(g, 0)
    uC = tl.sum(g, 0)
    ub = u - _gfirst(g, i, GROUP)
    if READ_AFTER:
        ur = u
    else:
        ur = ub
    eC = tl.exp(tl.minimum(uC - u, 0.))
    return u, uC, ub, ur, eC


@triton.jit
def _bwd_cc(Q, X, VV, R, ETA, G, A, DO, DU, DV, DETA, MM, GM, VEC, T, XT, XOFF,
            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, DELTA: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
            GROUP: tl.constexpr, GATHER: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr,
            SROWS: tl.constexpr = False):
    """Per chunk: DOU, dL (value loop), dv, dη; M, Gm to scratch; the gate vectors (d_ur, d_ub, d_u) of the [C, C]
    terms to VEC [B, T, H, 3] (fp32). SROWS: DOU and M on the chunk's steps ([C // W, C]; M to MM [B, T / W, H, C])."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if VARLEN:
        s_, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        xb = bos + s_ * XT  # the pair stream: each sequence's XT carried rows (W - 1), then its pairs
        Q += bos * H * K
        X += xb * H * K
        VV += xb * H * V
        R += bos * H * V
        ETA += bos * H
        G += bos * H
        A += bos * H * C
        DO += bos * H * V
        DU += bos * H * V
        DV += xb * H * V
        DETA += bos * H
        MM += bos * H * C
        GM += bos * H * C
        VEC += bos * H * 3
    i = tl.arange(0, C)
    rmask, tok, xtok, stok, gmask, dxtok = _bwd_rows(b, h, n, i, T, XT, XOFF, H, C, GROUP, GATHER)
    dt = Q.dtype.element_ty
    eta = tl.load(ETA + stok, mask=rmask, other=0.).to(tl.float32)
    u, uC, ub, ur, eC = _bwd_gates(G, stok, gmask, i, GROUP, READ_AFTER)
    if DELTA:
        Ai = tl.load(A + tok[:, None] * C + i[None, :], mask=rmask[:, None], other=0.)
        AiT = tl.trans(Ai).to(dt)
    if SROWS:
        j, srow, smk = _srows(b, h, n, T, H, C, GROUP)
        DOU = tl.zeros([C // GROUP, C], dtype=tl.float32)
    else:
        DOU = tl.zeros([C, C], dtype=tl.float32)
    dL = tl.zeros([C, C], dtype=tl.float32)
    d_eta = tl.zeros([C], dtype=tl.float32)
    for vb in range(0, tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        vmask = cv < V
        vm = rmask[:, None] & vmask[None, :]
        if SROWS:
            do = tl.load(DO + srow[:, None] * V + cv[None, :], mask=smk[:, None] & vmask[None, :], other=0.).to(dt)
        elif GATHER:
            do = tl.load(DO + stok[:, None] * V + cv[None, :], mask=gmask[:, None] & vmask[None, :], other=0.).to(dt)
        else:
            do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(dt)
        dU = tl.load(DU + tok[:, None] * V + cv[None, :], mask=vm, other=0.)
        if DELTA:
            rr = tl.load(R + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        else:
            rr = tl.load(VV + xtok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        Ud = (rr * eta[:, None]).to(dt)
        DOU += tl.dot(do, tl.trans(Ud), input_precision=PREC)
        d_eta += tl.sum(dU * rr, 1)
        if DELTA:
            dR = (dU * eta[:, None]).to(dt)
            dY = tl.dot(AiT, dR, input_precision=PREC)
            tl.store(DV + dxtok[:, None] * V + cv[None, :], dY.to(DV.dtype.element_ty), mask=vm)
            dL -= tl.dot(dY.to(dt), tl.trans(rr.to(dt)), input_precision=PREC)
        else:
            tl.store(DV + dxtok[:, None] * V + cv[None, :], (dU * eta[:, None]).to(DV.dtype.element_ty), mask=vm)
    # after the loop (ours): the [C, C] masks and tiles below are not live in it
    if READ_AFTER:
        causal = (i // GROUP)[:, None] >= (i // GROUP)[None, :]
    else:
        causal = (i // GROUP)[:, None] > (i // GROUP)[None, :]
    strict = (i // GROUP)[:, None] > (i // GROUP)[None, :]
    ck = tl.arange(0, BK)
    km = rmask[:, None] & (ck < K)[None, :]
    if SROWS:
        qs = tl.load(Q + srow[:, None] * K + ck[None, :], mask=smk[:, None] & (ck < K)[None, :], other=0.)
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
        qx = tl.dot(qs, tl.trans(x), input_precision=PREC)
        Er = tl.where(_step_mask(j, i, GROUP, READ_AFTER),
                      tl.exp(tl.minimum(_at_steps(ur, C, GROUP)[:, None] - u[None, :], 0.)), 0.)
        Z = qx * Er * DOU
        d_ur = _from_steps(tl.sum(Z, 1), C, GROUP)
        d_u = -tl.sum(Z, 0)
        d_ub = tl.zeros([C], dtype=tl.float32)
        tl.store(MM + srow[:, None] * C + i[None, :], (DOU * Er).to(dt), mask=smk[:, None])
    else:
        q = tl.load(Q + stok[:, None] * K + ck[None, :], mask=km, other=0.)
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
        qx = tl.dot(q, tl.trans(x), input_precision=PREC)
        Er = tl.where(causal, tl.exp(tl.minimum(ur[:, None] - u[None, :], 0.)), 0.)
        Z = qx * Er * DOU
        d_ur = tl.sum(Z, 1)
        d_u = -tl.sum(Z, 0)
        d_ub = tl.zeros([C], dtype=tl.float32)
        tl.store(MM + tok[:, None] * C + i[None, :], (DOU * Er).to(dt), mask=rmask[:, None])
    if DELTA:
        dL = tl.where(strict, dL, 0.)
        gram = tl.dot(x, tl.trans(x), input_precision=PREC)
        Eb = tl.where(strict, tl.exp(tl.minimum(ub[:, None] - u[None, :], 0.)), 0.)
        tl.store(GM + tok[:, None] * C + i[None, :], (dL * Eb * eta[None, :]).to(dt), mask=rmask[:, None])
        Psi = dL * gram * Eb
        d_eta += tl.sum(Psi, 0)
        PsiE = Psi * eta[None, :]
        d_ub += tl.sum(PsiE, 1)
        d_u -= tl.sum(PsiE, 0)
    tl.store(DETA + tok, d_eta, mask=rmask)
    tl.store(VEC + tok * 3, d_ur, mask=rmask)
    tl.store(VEC + tok * 3 + 1, d_ub, mask=rmask)
    tl.store(VEC + tok * 3 + 2, d_u, mask=rmask)


@triton.jit
def _q_rowsum(q, dq, C: tl.constexpr, W: tl.constexpr, SROWS: tl.constexpr):
    """q·dq per pseudo-token row (with SROWS from the step rows, at each step's first pseudo-token)."""
    if SROWS:
        return _from_steps(tl.sum(q.to(tl.float32) * dq, 1), C, W)
    else:
        return tl.sum(q.to(tl.float32) * dq, 1)


@triton.jit
def _rows_of(z, C: tl.constexpr, W: tl.constexpr, SROWS: tl.constexpr):
    """A per-pseudo-token vector on the kernel's dq rows: itself, or with SROWS its value at each step."""
    if SROWS:
        return _at_steps(z, C, W)
    else:
        return z


@triton.jit
def _bwd_dqdx(Q, X, VV, R, ETA, G, HS, DHS, DO, DV, MM, GM, DQ, DX, PART, T, XT, XOFF, NT,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, DELTA: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
              GROUP: tl.constexpr, GATHER: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr,
              DQSUM: tl.constexpr, VEC=None, DG=None, GATE: tl.constexpr = False, SROWS: tl.constexpr = False):
    """Key tile kt (BK columns) of a chunk: dq, dx from the value loop's dO Sᵀ, U dHᵀ, dY Sᵀ and _bwd_cc's M, Gm;
    the gate row sums of the tile to PART [B, T, H, NKt, 4] (q·dO Sᵀ, x·U dHᵀ, x·dY Sᵀ, Σ dH ⊙ S on the first row).
    GATHER and DQSUM (DQ_SUM="kernel"): dq per step, its W pseudo-tokens' rows summed here in fp32, DQ [B, T/W, H, K].
    GATE (GATE_FOLD, one key tile only, ours): dg here from the row sums and _bwd_cc's VEC, as _bwd_gate would form it
    (no PART, one launch fewer). SROWS (with DQSUM): dO Sᵀ, M x and Mᵀ q on the chunk's steps (_srows; M from MM
    [B, T / W, H, C])."""
    kt = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    NKT: tl.constexpr = (K + BK - 1) // BK
    if VARLEN:
        s_, n, bos, T, coff = _varlen_chunk(CU, CIDX, COFF, n)
        xb = bos + s_ * XT  # the pair stream: each sequence's XT carried rows (W - 1), then its pairs
        Q += bos * H * K
        X += xb * H * K
        VV += xb * H * V
        R += bos * H * V
        ETA += bos * H
        G += bos * H
        DO += bos * H * V
        DV += xb * H * V
        MM += bos * H * C
        GM += bos * H * C
        DQ += bos * H * K
        DX += xb * H * K
        PART += bos * H * NKT * 4
        HS += coff * K * V
        DHS += coff * K * V
        if GATE:
            VEC += bos * H * 3
            DG += bos * H
    i = tl.arange(0, C)
    rmask, tok, xtok, stok, gmask, dxtok = _bwd_rows(b, h, n, i, T, XT, XOFF, H, C, GROUP, GATHER)
    dt = Q.dtype.element_ty
    eta = tl.load(ETA + stok, mask=rmask, other=0.).to(tl.float32)
    u, uC, ub, ur, eC = _bwd_gates(G, stok, gmask, i, GROUP, READ_AFTER)
    ck = kt * BK + tl.arange(0, BK)
    kmask = ck < K
    km = rmask[:, None] & kmask[None, :]
    if SROWS:
        j, srow, smk = _srows(b, h, n, T, H, C, GROUP)
        dq = tl.zeros([C // GROUP, BK], dtype=tl.float32)
    else:
        dq = tl.zeros([C, BK], dtype=tl.float32)
    dxs = tl.zeros([C, BK], dtype=tl.float32)
    dxy = tl.zeros([C, BK], dtype=tl.float32)
    sdh = tl.sum(tl.zeros([C], dtype=tl.float32), 0)
    hbase = (bh.to(tl.int64) * NT + n) * K * V
    for vb in range(0, tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        vmask = cv < V
        vm = rmask[:, None] & vmask[None, :]
        smask = kmask[:, None] & vmask[None, :]
        soff = ck[:, None] * V + cv[None, :]
        S = tl.load(HS + hbase + soff, mask=smask, other=0.).to(tl.float32)  # a no-op for fp32 states (STATE_DTYPE)
        dH = tl.load(DHS + hbase + soff, mask=smask, other=0.).to(tl.float32)
        Sd = S.to(dt)
        if SROWS:
            do = tl.load(DO + srow[:, None] * V + cv[None, :], mask=smk[:, None] & vmask[None, :], other=0.).to(dt)
        elif GATHER:
            do = tl.load(DO + stok[:, None] * V + cv[None, :], mask=gmask[:, None] & vmask[None, :], other=0.).to(dt)
        else:
            do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(dt)
        if DELTA:
            rr = tl.load(R + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        else:
            rr = tl.load(VV + xtok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        Ud = (rr * eta[:, None]).to(dt)
        dq += tl.dot(do, tl.trans(Sd), input_precision=PREC)
        sdh += tl.sum(tl.sum(dH * S, 1), 0)
        dxs += tl.dot(Ud, tl.trans(dH.to(dt)), input_precision=PREC)
        if DELTA:  # dY as _bwd_cc stored it (dv's rows of this chunk), in the input dtype
            dYd = tl.load(DV + dxtok[:, None] * V + cv[None, :], mask=vm, other=0.).to(dt)
            dxy += tl.dot(dYd, tl.trans(Sd), input_precision=PREC)
    if SROWS:
        q = tl.load(Q + srow[:, None] * K + ck[None, :], mask=smk[:, None] & kmask[None, :], other=0.)
    else:
        q = tl.load(Q + stok[:, None] * K + ck[None, :], mask=km, other=0.)
    x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
    if GATE:
        dgr = _dg_rows(ur, uC, ub, eC, tl.load(VEC + tok * 3, mask=rmask, other=0.),
                       tl.load(VEC + tok * 3 + 1, mask=rmask, other=0.), tl.load(VEC + tok * 3 + 2, mask=rmask, other=0.),
                       _q_rowsum(q, dq, C, GROUP, SROWS), tl.sum(x.to(tl.float32) * dxs, 1),
                       tl.sum(x.to(tl.float32) * dxy, 1), tl.where(i == 0, sdh, 0.), i, C, DELTA, READ_AFTER, GROUP)
        if GATHER:  # log γ lives on the first pseudo-token of each step
            tl.store(DG + stok, dgr, mask=gmask)
        else:
            tl.store(DG + tok, dgr, mask=rmask)
    else:
        pbase = PART + tok * (NKT * 4) + kt * 4
        tl.store(pbase, _q_rowsum(q, dq, C, GROUP, SROWS), mask=rmask)
        tl.store(pbase + 1, tl.sum(x.to(tl.float32) * dxs, 1), mask=rmask)
        tl.store(pbase + 2, tl.sum(x.to(tl.float32) * dxy, 1), mask=rmask)
        tl.store(pbase + 3, tl.where(i == 0, sdh, 0.), mask=rmask)
    if SROWS:
        M = tl.load(MM + srow[:, None] * C + i[None, :], mask=smk[:, None], other=0.)
    else:
        M = tl.load(MM + tok[:, None] * C + i[None, :], mask=rmask[:, None], other=0.)
    dq = dq * tl.exp(_rows_of(ur, C, GROUP, SROWS))[:, None] + tl.dot(M, x, input_precision=PREC)
    dx = dxs * eC[:, None]
    # Mᵀq and Gmᵀx are formed as (qᵀM)ᵀ, (xᵀGm)ᵀ: a [C, C] dot result is never transposed and fed
    # to another dot (the Hopper miscompile of Triton 3.4-3.7.0, fla #640).
    dxT = tl.dot(tl.trans(q), M, input_precision=PREC)
    if DELTA:
        Gm = tl.load(GM + tok[:, None] * C + i[None, :], mask=rmask[:, None], other=0.)
        dx += tl.dot(Gm, x, input_precision=PREC)
        dxT += tl.dot(tl.trans(x), Gm, input_precision=PREC)
        dx -= dxy * tl.exp(ub)[:, None]
    dx += tl.trans(dxT)
    if SROWS:
        tl.store(DQ + srow[:, None] * K + ck[None, :], dq.to(DQ.dtype.element_ty), mask=smk[:, None] & kmask[None, :])
    elif GATHER and DQSUM:  # chunk n's C / W steps: rows t·W .. t·W + W - 1 are step t's pseudo-tokens
        NSC: tl.constexpr = C // GROUP
        st = n * NSC + tl.arange(0, NSC)
        srow = (b * (T // GROUP) + st).to(tl.int64) * H + h
        dqs = tl.sum(tl.reshape(dq, [NSC, GROUP, BK]), 1)
        tl.store(DQ + srow[:, None] * K + ck[None, :], dqs.to(DQ.dtype.element_ty),
                 mask=(st < T // GROUP)[:, None] & kmask[None, :])
    else:
        tl.store(DQ + tok[:, None] * K + ck[None, :], dq.to(DQ.dtype.element_ty), mask=km)
    tl.store(DX + dxtok[:, None] * K + ck[None, :], dx.to(DX.dtype.element_ty), mask=km)


@triton.jit
def _dg_rows(ur, uC, ub, eC, d_ur, d_ub, d_u, pq, px, py, sdh, i, C: tl.constexpr, DELTA: tl.constexpr,
             READ_AFTER: tl.constexpr, GROUP: tl.constexpr):
    """A chunk's dlog γ from _bwd_cc's gate vectors (d_ur, d_ub, d_u) and the key-summed row sums pq = q·(dO Sᵀ),
    px = x·(U dHᵀ), py = x·(dY Sᵀ) and sdh = Σ dH ⊙ S (its sum over the rows is the one used)."""
    d_ur += tl.exp(ur) * pq
    Y = eC * px
    duC = tl.sum(sdh, 0) * tl.exp(uC) + tl.sum(Y, 0)
    d_u -= Y
    if DELTA:
        d_ub -= tl.exp(ub) * py
    d_u += d_ur + d_ub
    d_u += tl.where(i == C - 1, duC, 0.)
    dg = tl.cumsum(d_u, 0, reverse=True) - _gseg(d_ub, i, GROUP)
    if not READ_AFTER:
        dg -= _gseg(d_ur, i, GROUP)
    return dg


@triton.jit
def _bwd_gate(G, VEC, PART, DG, T, XT, XOFF, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
              BK: tl.constexpr, DELTA: tl.constexpr, READ_AFTER: tl.constexpr, GROUP: tl.constexpr,
              GATHER: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr):
    """Per chunk: dg from _bwd_cc's vectors and _bwd_dqdx's key-tile row sums."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    NKT: tl.constexpr = (K + BK - 1) // BK
    if VARLEN:
        s_, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        G += bos * H
        VEC += bos * H * 3
        PART += bos * H * NKT * 4
        DG += bos * H
    i = tl.arange(0, C)
    rmask, tok, xtok, stok, gmask, dxtok = _bwd_rows(b, h, n, i, T, XT, XOFF, H, C, GROUP, GATHER)
    u, uC, ub, ur, eC = _bwd_gates(G, stok, gmask, i, GROUP, READ_AFTER)
    d_ur = tl.load(VEC + tok * 3, mask=rmask, other=0.)
    d_ub = tl.load(VEC + tok * 3 + 1, mask=rmask, other=0.)
    d_u = tl.load(VEC + tok * 3 + 2, mask=rmask, other=0.)
    pq = tl.zeros([C], dtype=tl.float32)
    px = tl.zeros([C], dtype=tl.float32)
    py = tl.zeros([C], dtype=tl.float32)
    sdh = tl.zeros([C], dtype=tl.float32)
    for kt in tl.static_range(NKT):
        pbase = PART + tok * (NKT * 4) + kt * 4
        pq += tl.load(pbase, mask=rmask, other=0.)
        px += tl.load(pbase + 1, mask=rmask, other=0.)
        py += tl.load(pbase + 2, mask=rmask, other=0.)
        sdh += tl.load(pbase + 3, mask=rmask, other=0.)
    dg = _dg_rows(ur, uC, ub, eC, d_ur, d_ub, d_u, pq, px, py, sdh, i, C, DELTA, READ_AFTER, GROUP)
    if GATHER:  # log γ lives on the first pseudo-token of each step
        tl.store(DG + stok, dg, mask=gmask)
    else:
        tl.store(DG + tok, dg, mask=rmask)


# ------------------------------------------------------------------------------------------------
# launchers and the autograd function
# ------------------------------------------------------------------------------------------------
def _state_tiles(BK, BVs, K, V, n_seq_heads, dtype, delta, group):
    """(key tile, value tile, key tiles NKB) of the two sequential state passes: the linear passes (no delta, one row
    per step) through common.linear_state_tiles (key-split under LINEAR_KSPLIT=scalar, the default, or =on), the
    delta rule's whole key width with state_bv's value tile."""
    if delta or group != 1:
        return BK, state_bv(BVs, V, n_seq_heads, dtype), 1
    return linear_state_tiles(BK, BVs, K, V, n_seq_heads, dtype)


def chunk_forward(q, x, v, eta, g, S0, *, delta, read_after, C, xoff=0, allow_tf32=False,
                  out_dtype=None, group=1, gather=False, cu_seqlens=None, need_out=True, lean=True):
    """gather (Falcon-3, group = W > 1, ours): q, eta, g are the T steps and x, v the T + W - 1 pairs (no pseudo-token
    expansion on the host): the kernels run over the T·W pseudo-tokens reading them in place; O has the T steps.
    cu_seqlens (B = 1, not with gather): the packed sequences run natively (no padding; S0 and S_T have one row per
    sequence; the per-chunk states of head h sit in NT = common.varlen_chunks slots); x and v are the packed pair
    stream, each sequence's (x.shape[1] - T) / N carried rows (W - 1, for Falcon-3A's scans; none for Falcon-3's
    expansion, whose cu_seqlens count pseudo-tokens) before its pairs.
    need_out=False: no read-out (O is None; a recompute of the saved buffers). lean=False: never Falcon-3's segments
    (lean.py's own calls)."""
    bounds = _lean.lean_bounds(q, x, C, delta, group, gather, xoff, cu_seqlens) if lean else []
    if bounds:  # Falcon-3 in place in time segments (lean.py)
        return _lean.lean_forward(bounds, q, x, v, eta, g, S0, chunk_forward=chunk_forward, group=group,
                                  out_dtype=out_dtype, delta=delta, read_after=read_after, C=C,
                                  allow_tf32=allow_tf32, gather=gather)
    Bo, Ts = q.shape[:2]
    GP = _ds.dsplit_pieces(q, x, v, C, delta, group, gather, xoff, cu_seqlens)
    if GP:  # the delta rule's passes split along the sequence (delta_split.py): every kernel on the piece view
        x, v, q, eta, g = _ds.piece_streams(GP, Ts, gather, x, v, q, eta, g)
    B, T, H, K, V, NT, BK, BVs, BVo, _, _, prec, st, dev = launch(q, v.shape[-1], C, allow_tf32,
                                                                  q.shape[1] * group if gather else 0)
    va, NT, NS = varlen_args(cu_seqlens, q, T, C, NT, B, group if gather else 1, xoff)
    BKs, BVs, NKB = _state_tiles(BK, BVs, K, V, NS * H, q.dtype, delta, group)
    XT = x.shape[1] if cu_seqlens is None else (x.shape[1] - T) // NS  # packed: each sequence's carried pair rows
    if GP and gather:
        XT = _ds.pair_rows(GP, x, Ts)
    f32 = torch.float32
    if delta:
        A = torch.empty(B, T, H, C, dtype=a_dtype(q.dtype), device=dev)
        WT = torch.empty(B, T, H, K, dtype=q.dtype, device=dev)
        VT = torch.empty(B, T, H, V, dtype=q.dtype, device=dev)
        R = torch.empty(B, T, H, V, dtype=q.dtype, device=dev)
        iprec = prec if (q.dtype == torch.float32 or dev.type == "cpu") else "tf32"
        ng = inv_groups(group)
        _fwd_prep[(NT, B * H)](x, v, eta, g, A, WT, VT, T, XT, xoff, H, K, V, C, BK, BVo, prec, iprec, group, gather,
                               *va, ng, **st)
    else:
        A = WT = VT = R = eta  # never read (constexpr-disabled branches)
    HS = torch.empty(B, H, NT, K, V, dtype=state_dtype(q.dtype), device=dev)
    ST = _empty((NS, H, K, V), f32, dev)
    if GP:  # each piece's start state (CARRY) and S_T first; the single pass then runs per piece from CARRY
        S0, STo = _ds.dsplit_forward(x, eta, g, WT, VT, S0, GP, T, XT, NT, H, K, V, C, BKs, BVs, prec, group, gather,
                                     state_opts(st))
    NP = split_pieces(NT, cdiv(V, BVs) * NKB * NS * H, not delta, cu_seqlens is None and group == 1)
    if NP:  # the linear pass in pieces along the sequence (state_split.py; LINEAR_SPLIT)
        fwd_state_split(x, v, eta, g, S0, HS, ST, T, XT, xoff, NT, H, K, V, C, BKs, BVs, NKB, NP, prec,
                        state_opts(st))
    else:
        _fwd_state[(cdiv(V, BVs) * NKB, NS * H)](
            x, v, eta, g, WT, VT, S0 if S0 is not None else eta, HS, R, ST, T, XT, xoff, NT, H, K, V, C,
            BKs, BVs, delta, S0 is not None, True, prec, group, gather, *va, NKB, **state_opts(st))
    O = None
    if need_out:
        O = _empty((B, q.shape[1], H, V), out_dtype or q.dtype, dev)
        _fwd_out[(cdiv(V, BVo), NT, B * H)](
            q, x, v, R, eta, g, HS, O, T, XT, xoff, NT, H, K, V, C, BK, BVo, delta, read_after, prec, group, gather,
            *va, SROWS=step_rows(gather, C, group, dev, read_after), **st)
    if GP:  # back to the call's shapes (HS keeps the pieces' chunks, piece-major, in the same buffer)
        T0 = T * GP
        return (O.view(Bo, Ts, H, V) if O is not None else None, STo,
                (HS.view(Bo, H, NT * GP, K, V), A.view(Bo, T0, H, C), WT.view(Bo, T0, H, K), R.view(Bo, T0, H, V)))
    return O, ST, (HS, A, WT, R)


def chunk_backward(q, x, v, eta, g, saved, dO, dST, *, delta, read_after, C, xoff=0,
                   allow_tf32=False, need_ds0=True, group=1, gather=False, cu_seqlens=None, zero_rest=True,
                   pair_dtype=None, lean=True):
    """zero_rest=False (a caller that writes the pair rows outside [xoff, xoff + T) of dx and dv itself: Falcon-3A's
    delayed form, window_delayed.py): those rows are left unwritten instead of zero-filled. pair_dtype (gather): the
    pair gradients' dtype if not x's (lean.py sums its segments' in fp32). lean=False: as chunk_forward's."""
    bounds = _lean.lean_bounds(q, x, C, delta, group, gather, xoff, cu_seqlens) if lean else []
    if bounds:  # Falcon-3 in place in time segments (lean.py): saved[0] holds the segments' start states
        return _lean.lean_backward(bounds, q, x, v, eta, g, saved[0], dO, dST, chunk_forward=chunk_forward,
                                   chunk_backward=chunk_backward, group=group, need_ds0=need_ds0, delta=delta,
                                   read_after=read_after, C=C, allow_tf32=allow_tf32, gather=gather)
    HS, A, WT, R = saved
    Bo, Ts = q.shape[:2]
    x0, v0 = x, v
    GP = _ds.dsplit_pieces(q, x, v, C, delta, group, gather, xoff, cu_seqlens)
    if GP:  # the forward's piece view (delta_split.py)
        x, v, q, eta, g, dO = _ds.piece_streams(GP, Ts, gather, x, v, q, eta, g, dO)
        Bp, Tp = q.shape[0], q.shape[1] * group if gather else q.shape[1]
        HS = HS.view(Bp, HS.shape[1], HS.shape[2] // GP, *HS.shape[3:])
        A, WT, R = (t.view(Bp, Tp, *t.shape[2:]) for t in (A, WT, R))
    B, T, H, K, V, NT, BK, BVs, BVo, _, _, prec, st, dev = launch(q, v.shape[-1], C, allow_tf32,
                                                                     q.shape[1] * group if gather else 0)
    va, NT, NS = varlen_args(cu_seqlens, q, T, C, NT, B, group if gather else 1, xoff)
    BKs, BVs, NKB = _state_tiles(BK, BVs, K, V, NS * H, q.dtype, delta, group)
    XT = x.shape[1] if cu_seqlens is None else (x.shape[1] - T) // NS  # packed: each sequence's carried pair rows
    if GP and gather:
        XT = _ds.pair_rows(GP, x, Ts)
    f32 = torch.float32
    srows = step_rows(gather, C, group, dev, read_after)
    DU = None
    NP = split_pieces(NT, cdiv(V, BVs) * NKB * NS * H, not delta, cu_seqlens is None and group == 1)
    if NKB == 1 and not NP:  # DU's intra part first, its state part added by _bwd_state
        DU = torch.empty(B, T, H, V, dtype=du_dtype(q.dtype), device=dev)
        _bwd_dul[(cdiv(V, BVo), NT, B * H)](q, x, g, dO, DU, T, XT, xoff, H, K, V, C, BK, BVo,
                                            read_after, prec, group, gather, *va, SROWS=srows, **st)
    DHS = torch.empty(B, H, NT, K, V, dtype=state_dtype(q.dtype), device=dev)
    DS0 = _empty((NS, H, K, V), f32, dev) if need_ds0 else None
    if GP:  # the gradient at each piece's end (DCARRY) and dS_0 first; the single pass then runs per piece from it
        dST, DS0o = _ds.dsplit_backward(q, x, eta, g, WT, dO, DU, dST, need_ds0, GP, T, XT, NT, H, K, V, C, BKs, BVs,
                                        read_after, prec, group, gather, state_opts(st))
        DS0 = _empty((NS, H, K, V), f32, dev) if need_ds0 else None  # the pieces' own (the pass's store), unused
    if NP:  # the linear pass in pieces along the sequence (state_split.py; LINEAR_SPLIT)
        bwd_state_split(q, g, dO, dST, DHS, DS0, T, NT, H, K, V, C, BKs, BVs, NKB, NP, read_after, prec,
                        state_opts(st))
    else:
        _bwd_state[(cdiv(V, BVs) * NKB, NS * H)](
            q, x, eta, g, WT, dO, DU if DU is not None else eta, dST if dST is not None else eta, DHS,
            DS0 if DS0 is not None else eta, T, XT, xoff, NT, H, K, V, C, BKs, BVs, delta, read_after,
            dST is not None, need_ds0, prec, group, gather, *va, NKB, SROWS=srows, **state_opts(st))
    if NKB > 1 or NP:  # the key-split or split linear pass (LINEAR_KSPLIT, LINEAR_SPLIT): all of DU after it
        DU = torch.empty(B, T, H, V, dtype=du_dtype(q.dtype), device=dev)
        _bwd_dul_state[(cdiv(V, BVo), NT, B * H)](q, x, g, dO, DU, DHS, T, XT, xoff, NT, H, K, V, C, BK, BVo,
                                                  read_after, prec, *va, **st)
    # The gradients and scratch are allocated just before the kernel that writes them first, and each fp32 buffer is
    # dropped after its last reader is queued (ours): the caching allocator hands DU's bytes to dq and dx, MM's and
    # DHS's to the gather path's sums (stream order makes the reuse safe). The peak is lower by about DU's size, and
    # with the in-place pseudo-tokens by the scratch's too (est. from the sizes; not yet measured on a GPU).
    # a view of a longer pair stream: rows outside stay 0 (unless the caller writes them: zero_rest=False)
    shifted = zero_rest and not gather and not (xoff == 0 and x.shape[1] == T)

    def grad(shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=dev) if shifted else _empty(shape, dtype, dev)
    # gather: per-pseudo-token gradients of q, x, v, eta (as the expansion's autograd has them), summed below; log γ's
    # lands per step
    dv = grad((B, T, H, V) if gather else v.shape, v.dtype)
    deta = _empty((B, T, H) if gather else eta.shape, eta.dtype, dev)
    BKt, BVt, wt = _split_cfg(K, V)  # scratch in the kernels' rows (tok)
    MM = _empty((B, T // group if srows else T, H, C), q.dtype, dev)  # M = DOU ⊙ Er (per step with SROWS)
    GM = _empty((B, T, H, C), q.dtype, dev) if delta else MM  # Gm = dL ⊙ Eb η
    VEC = _empty((B, T, H, 3), f32, dev)  # d_ur, d_ub, d_u of the [C, C] terms
    _bwd_cc[(NT, B * H)](q, x, v, R, eta, g, A, dO, DU, dv, deta, MM, GM, VEC, T, XT, xoff, H, K, V, C, BK, BVt,
                         delta, read_after, prec, group, gather, *va, SROWS=srows, num_warps=wt, **st)
    DU = None  # its last reader is queued
    dqsum = gather and DQ_SUM == "kernel"  # dq per step from _bwd_dqdx, not per pseudo-token
    dq = _empty((B, T, H, K) if gather and not dqsum else q.shape, q.dtype, dev)
    dx = grad((B, T, H, K) if gather else x.shape, x.dtype)
    if GATE_FOLD == "on" and cdiv(K, BKt) == 1:  # dg inside _bwd_dqdx (one key tile): no PART, no _bwd_gate
        dg = _empty(g.shape, g.dtype, dev)
        _bwd_dqdx[(1, NT, B * H)](q, x, v, R, eta, g, HS, DHS, dO, dv, MM, GM, dq, dx, eta, T, XT, xoff, NT, H, K, V, C,
                                  BKt, BVt, delta, read_after, prec, group, gather, *va, dqsum, VEC, dg, True,
                                  SROWS=srows, num_warps=wt, **st)
        DHS = MM = GM = None
    else:
        PART = _empty((B, T, H, cdiv(K, BKt), 4), f32, dev)  # the key tiles' row sums
        _bwd_dqdx[(cdiv(K, BKt), NT, B * H)](q, x, v, R, eta, g, HS, DHS, dO, dv, MM, GM, dq, dx, PART, T, XT, xoff,
                                             NT, H, K, V, C, BKt, BVt, delta, read_after, prec, group, gather, *va,
                                             dqsum, SROWS=srows, num_warps=wt, **st)
        DHS = MM = GM = None
        dg = _empty(g.shape, g.dtype, dev)
        _bwd_gate[(NT, B * H)](g, VEC, PART, dg, T, XT, xoff, H, K, C, BKt, delta, read_after, group, gather, *va,
                               num_warps=2)
    VEC = PART = None
    if GP:  # back to the call's shapes: per-step and per-pseudo-token rows are piece-major already
        B, x, v, DS0 = Bo, x0, v0, DS0o
        if not gather:
            dx, dv = dx.view(x.shape), dv.view(v.shape)
        dq = dq.view(Bo, -1, *dq.shape[2:])
        deta, dg = deta.view(Bo, -1, *deta.shape[2:]), dg.view(Bo, -1, *dg.shape[2:])
    if gather:
        W = group
        if not dqsum:
            dq = dq.view(B, Ts, W, H, K).sum(2)
        deta = deta.view(B, Ts, W, H).sum(2)
        # pseudo-token (t, m) read pair t + W - 1 - m: each pair's W rows summed in fp32 (pair_sum.py)
        dx = pair_sum(dx.view(B, Ts, W, H, K), x.shape[1], pair_dtype or x.dtype)
        dv = pair_sum(dv.view(B, Ts, W, H, V), v.shape[1], pair_dtype or v.dtype)
    return dq, dx, dv, deta, dg, DS0


from . import delta_split as _ds  # noqa: E402  (its kernels call _rows_w and _gfirst above)
from . import lean as _lean  # noqa: E402
