"""Triton chunk kernels for per-value-column gates, linear objective (Falcon-2A), forward and backward.

    S_t = S_{t-1} diag(γ_t) + x_t (η_t ⊙ v_t)ᵀ ,   γ_t, η_t ∈ R^V

Per column c with local log-prefix u_{:,c} (falcon-math.md §6.2):
    o_{i,c}   = e^{ur_{i,c}} (Q S)_{i,c} + Σ_{s<=i | s<i} (q_i·x_s) e^{ur_{i,c} - u_{s,c}} η_{s,c} v_{s,c}
    S_out     = S diag(e^{u_C}) + Xᵀ (e^{u_C - u} ⊙ η ⊙ V)
The intra-chunk term has a different decay per column, so it is not one matmul; it is computed exactly
as a [C, C, SB] broadcast over SB = 4 columns at a time (every exponent <= 0; the GLA-style factorisation
e^{u_i} e^{-u_s} would overflow fp32 under the clamp-firing decays this op allows). Inter-chunk parts
(Q S, Xᵀ W, state passes) are tensor-core dots as in chunk.py.

The default since 2026-12-03 (FALCON_TRITON_2A=blocked, ours, after fla's GLA sub-chunking; FALCON_TRITON_2A=exact
keeps the broadcast above): the chunk in 16-row sub-blocks; a diagonal
block keeps the exact [16, 16, BV] broadcast, and every row of block a against the rows before it is ONE tensor-core
dot, with e^{ur_i - u_s} = e^{ur_i - ρ_a} e^{ρ_a - u_s} split at ρ_a, the log-prefix just before block a: both
exponents <= 0, so nothing overflows (since 2026-12-04 the diagonal blocks too run as dots, with two references per block
and the broadcast as the fallback: DIAG below). Forward: _pc_fwd_intra_blk; backward: _pc_bwd_rows (M and the read-prefix
gradient, by output rows) and _pc_bwd_cols (dU's intra part and the log-prefix gradient, by source rows) before
_pc_bwd_main, which then skips its broadcast pass. The broadcast work falls from C·C to 16·C per column. Why: in a
Falcon-2A training step on the H200 _pc_bwd_main and _pc_fwd_intra were 37 % and 22 % of the CUDA time
(benchmarks/results/h200_logs/fast_layers/stage_f.log). On the H200 (torch 2.11, Triton 3.6, 5bb2636): all 34 rows of
`bench check --quick --variants 2A,2` passed with it (bf16 and fp32, core, public op, varlen, CUDA-graph decode), and
in one process Falcon-2A's fwd+bwd took 0.79-0.84x the exact form's time at the four benchmark shapes (12.0 -> 9.9 ms
at (16, 2048, 12, 64)), Falcon-2's 0.92-0.98x, at +7 % peak memory (benchmarks/results/h200_logs/kernels_2026-12-03/).

Status: tested under the Triton interpreter against float64 and proven on the H200 (run 4: bf16 and fp32,
forward and backward, through the op; benchmarks/results/triton_check_h200_final.md); speed not measured.
The Falcon-2 kernels (percol_delta.py) reuse the read-out and backward kernels here with R for V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common
from .common import (_chunk_rows, _empty, _np2, _state_init, _state_put, _state_tile, _state_tile_k, _varlen_chunk,
                     _varlen_seq, cdiv, launch, linear_state_tiles, varlen_args)
from .host import env_choice
from .state_split import bwd_state_split, fwd_state_split, split_pieces

SB = 4  # columns per [C, C, SB] broadcast tile (ours: 64*64*4 fp32 = 64 KB per program)
# The intra-chunk term: "blocked" (16-row sub-blocks, the off-diagonal blocks as tensor-core dots: ours, the default)
# or "exact" (the [C, C, SB] broadcast). Both proven on the H200. Falcon-2 shares it.
INTRA = env_choice("FALCON_TRITON_2A", "blocked", ("exact", "blocked"),
                   "Falcon-2A/-2: the intra-chunk term by 16-row sub-blocks or the [C, C, 4] broadcast (both proven)")
# The blocked forward term's grid (ours): "block" (_pc_fwd_intra_sb: one program per sub-block, as _pc_bwd_cols; the
# default since 2026-12-03, fifteenth session) or "chunk" (_pc_fwd_intra_blk: one program per chunk and value tile,
# its sub-blocks in turn; the default before). Why: the H200 profile of Falcon-2A at (16, 2048, 12, 64) put
# _pc_fwd_intra_blk at 3.40 ms of a 9.9 ms fwd+bwd while _pc_bwd_cols, the same broadcast per sub-block, took 0.85 ms.
# On the H200 (torch 2.11, Triton 3.6, 134006c; benchmarks/results/h200_logs/kernels_2026-12-03g/) with "block": all
# 29 rows of `bench check --variants 2A` and of `--variants 2` pass (bf16 and fp32, NaN-poisoned outputs, varlen,
# decode); in one process (switch_ab.py, GPU time) Falcon-2A's fwd+bwd took 0.848 / 0.856 / 0.854 / 0.828x the
# "chunk" grid's at (16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128) (9.97 -> 8.46 ms at
# the first) and Falcon-2's 0.956 / 0.980 / 0.971 / 0.944x; the kernel itself 3.24 -> 1.60-1.87 ms.
FWD_GRID = env_choice("FALCON_TRITON_2A_FWD_GRID", "block", ("block", "chunk"),
                      "Falcon-2A/-2: the blocked forward term, one program per sub-block or per chunk (both proven)")
# _pc_fwd_intra_sb's launch (ours): warps and value tile. 4 warps with 32-column tiles were the proven launch until
# 2026-12-04; in one process on the H200 (kernels_2026-12-04b/call2, eighteenth session, after the profile put the
# kernel at 1.91 of Falcon-2A's 7.1 ms at (16, 2048, 12, 64): with 32-column tiles at V = 64 two programs per sub-block
# each loaded the chunk's keys and formed the same [16, C] dot) 4 warps with 64-column tiles took the kernel from
# 1.90 to 1.16 ms and Falcon-2A's fwd+bwd to 0.896 / 0.941 / 0.900 / 0.924x at (16, 2048, 12, 64), (1, 32768, 6,
# 128), (4, 8192, 12, 64), (16, 2048, 6, 128); 8 warps were slower (1.04-1.08x with 64 columns, 1.13-1.18x with 32).
# The default since then, proven at 8c614f9 (all 29 rows of `bench check --variants 2A` and of `--variants 2`,
# kernels_2026-12-04b/call3-4; 8 warps with 64 columns passed the 2A sweep too, at 28242485).
# The forward's inter-chunk term (ours): "kernel" (_pc_fwd_inter writes e^{ur} ⊙ (q S) to an fp32 OF that
# _pc_fwd_intra_sb adds; proven, the default) or "fold" (_pc_fwd_intra_sb forms it from HS itself: one launch and
# OF's write and read fewer; _pc_fwd_inter took 0.09 of Falcon-2A's 4.4 ms at (16, 2048, 12, 64), kernels_2026-12-04e/
# call1). Written 2026-12-04 (twenty-second session). Falcon-2 shares it. On the H200 (2026-12-05,
# benchmarks/results/h200_logs/kernels_2026-12-05/): the whole 2A and 2 sweeps pass with "fold" (29/29 each, beside
# BWD_INTRA=fused), and in one process it is 0.992-1.000x (2A) and 0.997-1.001x (2) the GPU time of "kernel" at the four
# shapes: one launch fewer for the same time, the default since.
FWD_INTER = env_choice("FALCON_TRITON_2A_FWD_INTER", "fold", ("kernel", "fold"),
                       "Falcon-2A/-2: the forward's inter-chunk term in its own kernel or in the sub-block kernel (both "
                       "proven)")
FWD_SB_WARPS = env_choice("FALCON_TRITON_2A_FWD_SB_WARPS", "4", ("4", "8"),
                          "Falcon-2A/-2: _pc_fwd_intra_sb's warps (proven: 4; 8 with 64-column tiles)")
FWD_SB_BV = env_choice("FALCON_TRITON_2A_FWD_SB_BV", "64", ("32", "64"),
                       "Falcon-2A/-2: _pc_fwd_intra_sb's value tile (both proven)")
# _pc_bwd_rows' value tile (ours): "32" (the default, proven) or "16" (half the [16, 16, BV] broadcast per step of its
# value loop; written after the same profile put _pc_bwd_rows at 4.09 ms of Falcon-2A's 9.9, the largest kernel). In
# the same process on the H200 "16" was slower at every shape (1.03-1.06x Falcon-2A's fwd+bwd; kernels_2026-12-03g),
# so it stays opt-in and unproven (interpreter-tested only).
# A "64" (2026-12-04, eighteenth session: one program per sub-block at V = 64, half M's scratch parts, -96 MB peak) was
# slower in one process on the H200 (kernels_2026-12-04b/call5: Falcon-2A 1.036-1.050x), as were 64-column tiles for
# _pc_bwd_cols (1.002-1.014x); both were removed in the nineteenth session (_pc_bwd_cols keeps 32 columns).
ROWS_BV = env_choice("FALCON_TRITON_2A_ROWS_BV", "32", ("32", "16"),
                     "Falcon-2A/-2: _pc_bwd_rows' value tile (16: opt-in, unproven, slower)")
# _pc_bwd_rows' grid (ours): "tile" (one program per sub-block and value tile, 4 warps, as _pc_bwd_cols; its parts of
# M side by side in an fp32 scratch of V / BV times M's size, summed in _pc_bwd_main; the default since 2026-12-03,
# sixteenth session: the 2A and 2 sweeps 58/58 on the H200, Falcon-2A 0.82-0.92x and Falcon-2 0.94-0.99x the time in
# one process at the four shapes, +96-144 MB peak) or "block" (one program per sub-block, its value tiles in turn;
# proven).
# The blocked backward's intra-chunk pass (ours): "split" (_pc_bwd_rows, then _pc_bwd_cols: 2·NB programs per chunk
# and value tile, each loading the chunk's keys, g and U; proven, the default) or "fused" (_pc_bwd_intra: one program per
# chunk and value tile, the sub-blocks last to first, the later blocks' part of du through a [K, BV] sum; written
# 2026-12-04, twenty-second session, after the H200 profile put _pc_bwd_rows + _pc_bwd_cols at 2.18 of Falcon-2A's
# 4.4 ms at (16, 2048, 12, 64). On the H200 (2026-12-05, benchmarks/results/h200_logs/kernels_2026-12-05/) the whole 2A
# and 2 sweeps pass with "fused" (29/29 each), but it is slower in one process: 1.013-1.120x (2A) and 1.004-1.023x (2)
# the GPU time of "split" (1.12x at (16, 2048, 6, 128), where its 8-warp program holds a [K, BV] sum at K = 128):
# proven, but "split" stays the default.
BWD_INTRA = env_choice("FALCON_TRITON_2A_BWD_INTRA", "split", ("split", "fused"),
                       "Falcon-2A/-2: the blocked backward's intra-chunk pass as two kernels (proven, faster) or one")
# _pc_bwd_intra's launch (ours; offline ptxas for sm_90 with Triton 3.6, 2026-12-04, `ptx_fingerprint.py --stage cubin`):
# at 8 warps with 32-column tiles bf16 K = 64 compiles without a stack (255 registers; 304 B of stack at 4 warps) and
# K = 128 with 168 B (584 B at 4 warps; 16-column tiles were no better). Not timed: switch_ab.py can set FUSED_WARPS.
FUSED_BV = 32
FUSED_WARPS = 8
ROWS_GRID = env_choice("FALCON_TRITON_2A_ROWS_GRID", "tile", ("tile", "block"),
                       "Falcon-2A/-2: _pc_bwd_rows per sub-block and value tile, or per sub-block")
# The diagonal [16, 16] blocks of the blocked intra-chunk term (ours, 2026-12-04, twentieth session): "broadcast" (the
# exact [16, 16, BV] broadcast, e^{ur_i - u_s} per row pair and column: 16 exponentials per output element, on CUDA
# cores; proven) or "split" / "split16" (two reference points per block: rows 0-7 against ρ, the log-prefix before the
# block, rows 8-15 against σ, the log-prefix after its row 7, so e^{ur_i - u_s} = e^{ur_i - ref} e^{ref - u_s} with the
# first factor <= 1 and the second <= e^{span}, span the largest log-decay of a half-block in the tile; the block's term
# is then two [16, 16] x [16, BV] tensor-core dots (_pc_fwd_intra_sb, _pc_bwd_rows' dgr, _pc_bwd_cols) or two [16, BV]
# x [BV, 16] (_pc_bwd_rows' M), with one exponential per element and reference). "split" feeds those dots fp32
# operands at tf32 for 16-bit inputs (10 mantissa bits where bf16 has 7: the diagonal blocks hold the largest terms),
# "split16" the inputs' dtype. Where a tile's span exceeds the operands' bound (e^60; e^4 for fp16 operands, whose
# largest value is 65504) that tile takes the broadcast, so the result is exact for every decay the op allows
# (eps_gamma > 0 is the user's: γ may be arbitrarily small). On the H200 (2026-12-04, 89d24ce, kernels_2026-12-04d/
# call3): "split16" passed all 29 rows of `bench check --variants 2A` and of `--variants 2` (bf16 errors up to 2-3x the
# broadcast's: Falcon-2's dλ 3.5e-3 -> 1.0e-2 in the public-op row, within the 4e-2 tolerance), and in one process
# Falcon-2A took 0.695 / 0.786 / 0.718 / 0.720x and Falcon-2 0.885 / 0.957 / 0.900 / 0.895x the broadcast's GPU time
# at 16x2048x12x64, 1x32768x6x128, 4x8192x12x64, 16x2048x6x128. "split" (tf32 operands), the default since e3905cd:
# all 58 rows again at e3905cd (bf16 errors back at the broadcast's level: Falcon-2's public-op dλ 3.8e-3), and in one
# process Falcon-2A 0.710 / 0.795 / 0.731 / 0.732x and Falcon-2 0.889 / 0.959 / 0.904 / 0.899x the broadcast's time
# (split16 1-2 % faster than split; kernels_2026-12-04d/call4).
DIAG = env_choice("FALCON_TRITON_2A_DIAG", "split", ("broadcast", "split", "split16"),
                  "Falcon-2A/-2: the diagonal sub-blocks as the exact broadcast or two-reference dots (tf32 / input "
                  "dtype operands)")
DIAG_SPANS = {"float16": 4., "other": 60.}  # the bound per operand dtype (tests lower it to reach the fallback)


def diag_args(dtype: torch.dtype, prec: str) -> tuple:
    """(span, fp32 operands, the dots' precision) of the split diagonal blocks for inputs of `dtype` whose other dots
    run at `prec`; span 0 when DIAG is "broadcast" (every tile takes the broadcast)."""
    if DIAG == "broadcast":
        return 0., False, prec
    f32 = DIAG == "split" and dtype != torch.float32
    span = DIAG_SPANS["float16" if dtype == torch.float16 and not f32 else "other"]
    return span, f32, ("tf32" if f32 else prec)


@triton.jit
def _pc_fwd_state(X, VV, ETA, G, S0, HS, ST, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr,
                  PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr, NKB: tl.constexpr = 1):
    """NKB > 1 (common.linear_state_tiles, LINEAR_KSPLIT): key tile p % NKB of value block p // NKB."""
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
    if VARLEN:  # packed sequences (common.varlen): (b, h) = (sequence, head), pointers moved to its first token
        bos, T, NL, coff = _varlen_seq(CU, COFF, b, C)
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        HS += coff * K * V
        hs = h.to(tl.int64)
        b = 0
    else:
        NL = NT
        hs = bh64
    for n in range(0, NL):
        _state_put(HS, S, hs, n, NT, soff, smask, K, V)
        rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
        x = tl.load(X + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
        vm = rmask[:, None] & vmask[None, :]
        v = tl.load(VV + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        eta = tl.load(ETA + tok[:, None] * V + cv[None, :], mask=vm, other=0.)
        g = tl.load(G + tok[:, None] * V + cv[None, :], mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        uC = tl.sum(g, 0)
        w = v * eta * tl.exp(tl.minimum(uC[None, :] - u, 0.))
        S = S * tl.exp(uC)[None, :] + tl.dot(tl.trans(x), w.to(x.dtype), input_precision=PREC)
    tl.store(ST + bh64 * K * V + soff, S, mask=smask)


@triton.jit
def _pc_fwd_inter(Q, G, HS, OF, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr, CU, CIDX, COFF,
                  VARLEN: tl.constexpr):
    vb = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    if VARLEN:  # program n is chunk slot n (common.varlen); B = 1, so bh is the head
        _s, n, bos, T, coff = _varlen_chunk(CU, CIDX, COFF, n)
        Q += bos * H * K
        G += bos * H * V
        OF += bos * H * V
        HS += coff * K * V
    i = tl.arange(0, C)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    vmask = cv < V
    vm = rmask[:, None] & vmask[None, :]
    q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
    g = tl.load(G + tok[:, None] * V + cv[None, :], mask=vm, other=0.)
    u = tl.cumsum(g, 0)
    if READ_AFTER:
        ur = u
    else:
        ur = u - g
    S = tl.load(HS + (bh.to(tl.int64) * NT + n) * K * V + ck[:, None] * V + cv[None, :],
                mask=kmask[:, None] & vmask[None, :], other=0.)
    o = tl.dot(q, S.to(q.dtype), input_precision=PREC) * tl.exp(ur)
    tl.store(OF + tok[:, None] * V + cv[None, :], o, mask=vm)


@triton.jit
def _pc_fwd_intra(Q, X, VV, ETA, G, OF, O, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr, READ_AFTER: tl.constexpr,
                  PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr):
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        Q += bos * H * K
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        OF += bos * H * V
        O += bos * H * V
    i = tl.arange(0, C)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    ck = tl.arange(0, BK)
    km = rmask[:, None] & (ck < K)[None, :]
    q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=km, other=0.)
    x = tl.load(X + tok[:, None] * K + ck[None, :], mask=km, other=0.)
    if READ_AFTER:
        causal = i[:, None] >= i[None, :]
    else:
        causal = i[:, None] > i[None, :]
    P = tl.where(causal, tl.dot(q, tl.trans(x), input_precision=PREC), 0.)
    for vb in range(0, tl.cdiv(V, SB)):
        cv = vb * SB + tl.arange(0, SB)
        vm = rmask[:, None] & (cv < V)[None, :]
        off = tok[:, None] * V + cv[None, :]
        v = tl.load(VV + off, mask=vm, other=0.).to(tl.float32)
        eta = tl.load(ETA + off, mask=vm, other=0.)
        g = tl.load(G + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        if READ_AFTER:
            ur = u
        else:
            ur = u - g
        D = tl.exp(tl.minimum(ur[:, None, :] - u[None, :, :], 0.))
        intra = tl.sum(P[:, :, None] * D * (v * eta)[None, :, :], 1)
        of = tl.load(OF + off, mask=vm, other=0.)
        tl.store(O + off, (of + intra).to(O.dtype.element_ty), mask=vm)


@triton.jit
def _blk_prefix(g, gblk, i, a, READ_AFTER: tl.constexpr):
    """Sub-block a (16 rows) of a chunk whose per-column log-decays are g [C, BV] (rows i): (ρ: the log-prefix before
    the block, its rows' log-prefix u and read prefix ur (u, or u - g when reading before the write)), from the
    block's own rows gblk [16, BV]."""
    rho = tl.sum(tl.where((i < a * 16)[:, None], g, 0.), 0)
    u = tl.cumsum(gblk, 0) + rho[None, :]
    if READ_AFTER:
        ur = u
    else:
        ur = u - gblk
    return rho, u, ur


@triton.jit
def _causal16(j, READ_AFTER: tl.constexpr):
    """The [16, 16] read mask inside a sub-block: s <= i (read after the write) or s < i."""
    if READ_AFTER:
        causal = j[:, None] >= j[None, :]
    else:
        causal = j[:, None] > j[None, :]
    return causal


@triton.jit
def _split_refs(rho, ua, ura, j, DSPAN: tl.constexpr):
    """The two references of a diagonal sub-block (DIAG="split", ours): rows 0-7 against ρ (the log-prefix before the
    block), rows 8-15 against σ (u at the block's row 7). Returns the row factors er0 = e^{ur_i - ρ} (rows 0-7, else
    0) and er1 = e^{ur_i - σ} (rows 8-15), both <= 1; the source factors ec0 = e^{ρ - u_s} (rows 0-7, else 0) and
    ec1 = e^{σ - u_s}, both <= e^{span}; and whether span <= DSPAN (the largest ρ - u_s over rows 0-7 and σ - u_s over
    rows 8-15 of the [16, BV] tile). Then e^{ur_i - u_s} = er0_i ec0_s + er1_i ec1_s for every s <= i."""
    lo = (j < 8)[:, None]
    sigma = tl.sum(tl.where((j == 7)[:, None], ua, 0.), 0)
    d0 = tl.where(lo, rho[None, :] - ua, 0.)
    d1 = sigma[None, :] - ua
    span = tl.maximum(tl.max(tl.max(d0, 1), 0), tl.max(tl.max(tl.where(lo, 0., d1), 1), 0))
    ref = tl.where(lo, rho[None, :], sigma[None, :])
    er = tl.exp(tl.minimum(ura - ref, 0.))
    er0 = tl.where(lo, er, 0.)
    er1 = tl.where(lo, 0., er)
    ec0 = tl.where(lo, tl.exp(tl.minimum(d0, DSPAN)), 0.)
    ec1 = tl.exp(tl.minimum(d1, DSPAN))
    return er0, er1, ec0, ec1, span <= DSPAN


@triton.jit
def _pc_fwd_intra_blk(Q, X, VV, ETA, G, OF, O, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr,
                      PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr):
    """_pc_fwd_intra with the intra-chunk term by 16-row sub-blocks (ours, after fla's GLA sub-chunking; with
    FWD_GRID="chunk"): the diagonal [16, 16] blocks exactly as a [16, 16, BV] broadcast; block a's rows against all
    earlier rows as one tensor-core dot, e^{ur_i - u_s} = e^{ur_i - ρ_a} e^{ρ_a - u_s} with ρ_a the log-prefix just
    before block a, both factors <= 0 in the exponent (u never increases), so nothing overflows. Grid: (value tiles,
    chunks, B·H)."""
    vb = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        Q += bos * H * K
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        OF += bos * H * V
        O += bos * H * V
    i = tl.arange(0, C)
    j = tl.arange(0, 16)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    vmask = cv < V
    vm = rmask[:, None] & vmask[None, :]
    off = tok[:, None] * V + cv[None, :]
    x = tl.load(X + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
    dt = x.dtype
    g = tl.load(G + off, mask=vm, other=0.)
    U = tl.load(VV + off, mask=vm, other=0.).to(tl.float32) * tl.load(ETA + off, mask=vm, other=0.)
    u = tl.cumsum(g, 0)
    for a in tl.static_range(C // 16):
        _r, ma, ta, _x = _chunk_rows(b, h, n * (C // 16) + a, j, T, T, 0, H, 16)
        ka = ma[:, None] & kmask[None, :]
        va = ma[:, None] & vmask[None, :]
        offa = ta[:, None] * V + cv[None, :]
        qa = tl.load(Q + ta[:, None] * K + ck[None, :], mask=ka, other=0.)
        xa = tl.load(X + ta[:, None] * K + ck[None, :], mask=ka, other=0.)
        ga = tl.load(G + offa, mask=va, other=0.)
        Ua = tl.load(VV + offa, mask=va, other=0.).to(tl.float32) * tl.load(ETA + offa, mask=va, other=0.)
        rho, ua, ura = _blk_prefix(g, ga, i, a, READ_AFTER)
        Paa = tl.where(_causal16(j, READ_AFTER), tl.dot(qa, tl.trans(xa), input_precision=PREC), 0.)
        D = tl.exp(tl.minimum(ura[:, None, :] - ua[None, :, :], 0.))
        intra = tl.sum(Paa[:, :, None] * D * Ua[None, :, :], 1)
        if a > 0:
            before = i < a * 16
            Poff = tl.where(before[None, :], tl.dot(qa, tl.trans(x), input_precision=PREC), 0.)
            Wt = tl.where(before[:, None], tl.exp(tl.minimum(rho[None, :] - u, 0.)), 0.) * U
            intra += tl.exp(tl.minimum(ura - rho[None, :], 0.)) * tl.dot(Poff.to(dt), Wt.to(dt), input_precision=PREC)
        of = tl.load(OF + offa, mask=va, other=0.)
        tl.store(O + offa, (of + intra).to(O.dtype.element_ty), mask=va)


@triton.jit
def _pc_fwd_intra_sb(Q, X, VV, ETA, G, OF, O, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr,
                     PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr, DSPAN: tl.constexpr, D32: tl.constexpr,
                     DPREC: tl.constexpr, HS, NT, INTER: tl.constexpr = False):
    """_pc_fwd_intra_blk's arithmetic with one program per sub-block instead of per chunk (ours, FWD_GRID="block", the
    default), laid out as _pc_bwd_cols: the 16 rows of sub-block a of a chunk and one value tile, its diagonal
    [16, 16, BV] broadcast, then its rows against the earlier rows (loaded masked to them) as one tensor-core dot.
    Grid: (value tiles, chunks·NB, B·H). INTER (FWD_INTER="fold", ours): the inter-chunk term e^{ur} ⊙ (q S) of the
    block's rows from the chunk's state HS[n] here, instead of _pc_fwd_inter's OF."""
    NB: tl.constexpr = C // 16
    vb = tl.program_id(0)
    pid = tl.program_id(1)
    bh = tl.program_id(2)
    n = pid // NB
    a = pid % NB
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        Q += bos * H * K
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        OF += bos * H * V
        O += bos * H * V
        if INTER:
            HS += _c * K * V
    i = tl.arange(0, C)
    j = tl.arange(0, 16)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    _r, ma, ta, _x = _chunk_rows(b, h, n * NB + a, j, T, T, 0, H, 16)
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    vmask = cv < V
    before = i < a * 16
    vbm = rmask[:, None] & vmask[None, :] & before[:, None]
    off = tok[:, None] * V + cv[None, :]
    ka = ma[:, None] & kmask[None, :]
    va = ma[:, None] & vmask[None, :]
    offa = ta[:, None] * V + cv[None, :]
    qa = tl.load(Q + ta[:, None] * K + ck[None, :], mask=ka, other=0.)
    xa = tl.load(X + ta[:, None] * K + ck[None, :], mask=ka, other=0.)
    dt = qa.dtype
    g = tl.load(G + off, mask=vbm, other=0.)  # the rows before the block: ρ and their log-prefix
    ga = tl.load(G + offa, mask=va, other=0.)
    Ua = tl.load(VV + offa, mask=va, other=0.).to(tl.float32) * tl.load(ETA + offa, mask=va, other=0.)
    rho, ua, ura = _blk_prefix(g, ga, i, a, READ_AFTER)
    Paa = tl.where(_causal16(j, READ_AFTER), tl.dot(qa, tl.trans(xa), input_precision=PREC), 0.)
    ok = False  # DIAG="split" (DSPAN > 0): two tensor-core dots where the tile's span allows, else the broadcast
    if DSPAN > 0:
        er0, er1, ec0, ec1, ok = _split_refs(rho, ua, ura, j, DSPAN)
    if ok:
        ddt = tl.float32 if D32 else dt
        Pd = Paa.to(ddt)
        intra = (er0 * tl.dot(Pd, (Ua * ec0).to(ddt), input_precision=DPREC)
                 + er1 * tl.dot(Pd, (Ua * ec1).to(ddt), input_precision=DPREC))
    else:
        intra = tl.sum(Paa[:, :, None] * tl.exp(tl.minimum(ura[:, None, :] - ua[None, :, :], 0.)) * Ua[None, :, :], 1)
    if a > 0:
        x = tl.load(X + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :] & before[:, None],
                    other=0.)
        U = tl.load(VV + off, mask=vbm, other=0.).to(tl.float32) * tl.load(ETA + off, mask=vbm, other=0.)
        u = tl.cumsum(g, 0)
        Wt = tl.where(before[:, None], tl.exp(tl.minimum(rho[None, :] - u, 0.)), 0.) * U
        Poff = tl.dot(qa, tl.trans(x), input_precision=PREC)  # x is zero from the block on
        intra += tl.exp(tl.minimum(ura - rho[None, :], 0.)) * tl.dot(Poff.to(dt), Wt.to(dt), input_precision=PREC)
    if INTER:
        S = tl.load(HS + (bh.to(tl.int64) * NT + n) * K * V + ck[:, None] * V + cv[None, :],
                    mask=kmask[:, None] & vmask[None, :], other=0.)
        of = tl.dot(qa, S.to(dt), input_precision=PREC) * tl.exp(ura)
    else:
        of = tl.load(OF + offa, mask=va, other=0.)
    tl.store(O + offa, (of + intra).to(O.dtype.element_ty), mask=va)


@triton.jit
def _pc_bwd_state(Q, X, G, DO, DST, DHS, DU, DS0, T, NT, H: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  READ_AFTER: tl.constexpr, HAS_DST: tl.constexpr, STORE_DS0: tl.constexpr,
                  PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr, NKB: tl.constexpr = 1):
    """NKB > 1 (LINEAR_KSPLIT): key tile p % NKB of value block p // NKB, and no DU (its state part, a sum over every
    key, is _pc_bwd_main's: STATE_DU)."""
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
        Q += bos * H * K
        X += bos * H * K
        G += bos * H * V
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
        rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
        km = rmask[:, None] & kmask[None, :]
        vm = rmask[:, None] & vmask[None, :]
        x = tl.load(X + tok[:, None] * K + ck[None, :], mask=km, other=0.)
        q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=km, other=0.)
        dt = x.dtype
        g = tl.load(G + tok[:, None] * V + cv[None, :], mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        uC = tl.sum(g, 0)
        if READ_AFTER:
            ur = u
        else:
            ur = u - g
        do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        if NKB == 1:
            du = tl.dot(x, dH.to(dt), input_precision=PREC) * tl.exp(tl.minimum(uC[None, :] - u, 0.))
            tl.store(DU + tok[:, None] * V + cv[None, :], du, mask=vm)
        dH = dH * tl.exp(uC)[None, :] + tl.dot(tl.trans(q), (do * tl.exp(ur)).to(dt), input_precision=PREC)
    if STORE_DS0:
        tl.store(DS0 + bh64 * K * V + soff, dH, mask=smask)


@triton.jit
def _pc_bwd_rows(Q, X, VV, ETA, G, DO, DGR, MM, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
                 CU, CIDX, COFF, VARLEN: tl.constexpr, NMP: tl.constexpr, DSPAN: tl.constexpr,
                 D32: tl.constexpr, DPREC: tl.constexpr):
    """Blocked backward, by output rows (ours, the default; see _pc_fwd_intra_blk): for the 16 rows i of block a of a
    chunk, M[i, s] = Σ_c e^{ur_ic - u_sc} U_sc dO_ic (causal; all s) into MM, and DGR[i, c] = dO_ic · (the intra-chunk
    term of o_ic). Program (chunk·NB + a, b·H + h); the value tiles loop inside (M sums over all of them). NMP > 1
    (ROWS_GRID="tile", ours): program (chunk·NB + a, b·H + h, value tile vb) does one tile and writes its part of M
    to slot vb of MM's NMP slots per row ([.., NMP, C]), which _pc_bwd_main sums; NMP = 1 compiles to the one-program
    form."""
    NB: tl.constexpr = C // 16
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    n = pid // NB
    a = pid % NB
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        Q += bos * H * K
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        DO += bos * H * V
        DGR += bos * H * V
        MM += bos * H * (C * NMP)
    if NMP > 1:
        vb0 = tl.program_id(2)
        vb1 = vb0 + 1
        MM += vb0 * C
    else:
        vb0 = 0
        vb1 = tl.cdiv(V, BV)
    i = tl.arange(0, C)
    j = tl.arange(0, 16)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    _r, ma, ta, _x = _chunk_rows(b, h, n * NB + a, j, T, T, 0, H, 16)
    ck = tl.arange(0, BK)
    kmask = ck < K
    x = tl.load(X + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
    dt = x.dtype
    qa = tl.load(Q + ta[:, None] * K + ck[None, :], mask=ma[:, None] & kmask[None, :], other=0.)
    xa = tl.load(X + ta[:, None] * K + ck[None, :], mask=ma[:, None] & kmask[None, :], other=0.)
    causal = _causal16(j, READ_AFTER)
    before = i < a * 16
    Paa = tl.where(causal, tl.dot(qa, tl.trans(xa), input_precision=PREC), 0.)
    Poff = tl.where(before[None, :], tl.dot(qa, tl.trans(x), input_precision=PREC), 0.)
    Mdiag = tl.zeros([16, 16], dtype=tl.float32)
    Moff = tl.zeros([16, C], dtype=tl.float32)
    for vb in range(vb0, vb1):
        cv = vb * BV + tl.arange(0, BV)
        vmask = cv < V
        vm = rmask[:, None] & vmask[None, :]
        va = ma[:, None] & vmask[None, :]
        off = tok[:, None] * V + cv[None, :]
        offa = ta[:, None] * V + cv[None, :]
        g = tl.load(G + off, mask=vm, other=0.)
        U = tl.load(VV + off, mask=vm, other=0.).to(tl.float32) * tl.load(ETA + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        ga = tl.load(G + offa, mask=va, other=0.)
        Ua = tl.load(VV + offa, mask=va, other=0.).to(tl.float32) * tl.load(ETA + offa, mask=va, other=0.)
        doa = tl.load(DO + offa, mask=va, other=0.).to(tl.float32)
        rho, ua, ura = _blk_prefix(g, ga, i, a, READ_AFTER)
        ok = False  # DIAG="split" (DSPAN > 0; see _split_refs)
        if DSPAN > 0:
            er0, er1, ec0, ec1, ok = _split_refs(rho, ua, ura, j, DSPAN)
        if ok:
            ddt = tl.float32 if D32 else dt
            B0 = (Ua * ec0).to(ddt)
            B1 = (Ua * ec1).to(ddt)
            Pd = Paa.to(ddt)
            Mdiag += (tl.dot((doa * er0).to(ddt), tl.trans(B0), input_precision=DPREC)
                      + tl.dot((doa * er1).to(ddt), tl.trans(B1), input_precision=DPREC))
            dgr = doa * (er0 * tl.dot(Pd, B0, input_precision=DPREC) + er1 * tl.dot(Pd, B1, input_precision=DPREC))
        else:
            DU3 = tl.exp(tl.minimum(ura[:, None, :] - ua[None, :, :], 0.)) * Ua[None, :, :] * doa[:, None, :]
            Mdiag += tl.sum(DU3, 2)
            dgr = tl.sum(Paa[:, :, None] * DU3, 1)
        alpha_do = tl.exp(tl.minimum(ura - rho[None, :], 0.)) * doa
        betaU = (tl.where(before[:, None], tl.exp(tl.minimum(rho[None, :] - u, 0.)), 0.) * U).to(dt)
        Moff += tl.dot(alpha_do.to(dt), tl.trans(betaU), input_precision=PREC)
        dgr += alpha_do * tl.dot(Poff.to(dt), betaU, input_precision=PREC)
        tl.store(DGR + offa, dgr, mask=va)
    # M's rows of block a: the diagonal block's columns a·16 + j' from Mdiag, every other column from Moff (zero
    # right of the diagonal), as two stores to disjoint columns. Not as sum(Mdiag[:, :, None] * sel[None, :, :], 1)
    # with a 0/1 selection matrix: Triton's combiner rewrites a sum of two broadcast operands' product into a tt.dot
    # at tf32, which rounded M to tf32 on the H200 (fp32 dq, dk 3.8e-4 off, 2026-12-02; tests/test_triton_lint.py).
    offdiag = (i < a * 16) | (i >= a * 16 + 16)
    tl.store(MM + ta[:, None] * (C * NMP) + i[None, :], Moff, mask=ma[:, None] & offdiag[None, :])
    tl.store(MM + ta[:, None] * (C * NMP) + (a * 16 + j)[None, :], tl.where(causal, Mdiag, 0.), mask=ma[:, None])


@triton.jit
def _pc_bwd_cols(Q, X, VV, ETA, G, DO, DU, DGU, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
                 CU, CIDX, COFF, VARLEN: tl.constexpr, DSPAN: tl.constexpr, D32: tl.constexpr,
                 DPREC: tl.constexpr, DU_FRESH: tl.constexpr = False):
    """Blocked backward, by source rows (ours, the default): for the 16 rows s of block b of a chunk and one value tile,
    du_sc = Σ_i P[i, s] e^{ur_ic - u_sc} dO_ic (added to DU, which holds the state part) and DGU[s, c] = -U_sc du_sc;
    the later blocks a > b as tensor-core dots with e^{ur_i - ρ_a} e^{ρ_a - u_s}. Program (value tile, chunk·NB + b,
    b·H + h). DU_FRESH (the key-split state pass, LINEAR_KSPLIT): DU holds nothing yet; du is stored as it is."""
    NB: tl.constexpr = C // 16
    vb = tl.program_id(0)
    pid = tl.program_id(1)
    bh = tl.program_id(2)
    n = pid // NB
    blk = pid % NB
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        Q += bos * H * K
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        DO += bos * H * V
        DU += bos * H * V
        DGU += bos * H * V
    i = tl.arange(0, C)
    j = tl.arange(0, 16)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    _r, mb, tb, _x = _chunk_rows(b, h, n * NB + blk, j, T, T, 0, H, 16)
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    vmask = cv < V
    vm = rmask[:, None] & vmask[None, :]
    vbm = mb[:, None] & vmask[None, :]
    offb = tb[:, None] * V + cv[None, :]
    g = tl.load(G + tok[:, None] * V + cv[None, :], mask=vm, other=0.)
    xb = tl.load(X + tb[:, None] * K + ck[None, :], mask=mb[:, None] & kmask[None, :], other=0.)
    qb = tl.load(Q + tb[:, None] * K + ck[None, :], mask=mb[:, None] & kmask[None, :], other=0.)
    dt = xb.dtype
    gb = tl.load(G + offb, mask=vbm, other=0.)
    _rhob, ub, urb = _blk_prefix(g, gb, i, blk, READ_AFTER)
    dob = tl.load(DO + offb, mask=vbm, other=0.).to(tl.float32)
    Pbb = tl.where(_causal16(j, READ_AFTER), tl.dot(qb, tl.trans(xb), input_precision=PREC), 0.)  # [i, s]
    ok = False  # DIAG="split" (DSPAN > 0; see _split_refs): du_s = Σ_h ec_h,s (Pᵀ (dO ⊙ er_h))_s
    if DSPAN > 0:
        er0, er1, ec0, ec1, ok = _split_refs(_rhob, ub, urb, j, DSPAN)
    if ok:
        ddt = tl.float32 if D32 else dt
        PT = tl.trans(Pbb).to(ddt)
        du = (ec0 * tl.dot(PT, (dob * er0).to(ddt), input_precision=DPREC)
              + ec1 * tl.dot(PT, (dob * er1).to(ddt), input_precision=DPREC))
    else:
        du = tl.sum(Pbb[:, :, None] * tl.exp(tl.minimum(urb[:, None, :] - ub[None, :, :], 0.)) * dob[:, None, :], 0)
    for a in range(blk + 1, NB):
        _r2, ma, ta, _x2 = _chunk_rows(b, h, n * NB + a, j, T, T, 0, H, 16)
        va = ma[:, None] & vmask[None, :]
        offa = ta[:, None] * V + cv[None, :]
        qa = tl.load(Q + ta[:, None] * K + ck[None, :], mask=ma[:, None] & kmask[None, :], other=0.)
        ga = tl.load(G + offa, mask=va, other=0.)
        doa = tl.load(DO + offa, mask=va, other=0.).to(tl.float32)
        rho, ua, ura = _blk_prefix(g, ga, i, a, READ_AFTER)
        alpha_do = (tl.exp(tl.minimum(ura - rho[None, :], 0.)) * doa).to(dt)
        PT = tl.dot(xb, tl.trans(qa), input_precision=PREC)  # P[i in a, s in b]ᵀ, built as such (fla #640)
        du += tl.exp(tl.minimum(rho[None, :] - ub, 0.)) * tl.dot(PT.to(dt), alpha_do, input_precision=PREC)
    Ub = tl.load(VV + offb, mask=vbm, other=0.).to(tl.float32) * tl.load(ETA + offb, mask=vbm, other=0.)
    if DU_FRESH:
        tl.store(DU + offb, du, mask=vbm)
    else:
        tl.store(DU + offb, tl.load(DU + offb, mask=vbm, other=0.) + du, mask=vbm)
    tl.store(DGU + offb, -Ub * du, mask=vbm)


@triton.jit
def _pc_bwd_intra(Q, X, VV, ETA, G, DO, DU, DGU, DGR, MM, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr,
                  CU, CIDX, COFF, VARLEN: tl.constexpr, NMP: tl.constexpr, DSPAN: tl.constexpr, D32: tl.constexpr,
                  DPREC: tl.constexpr, DU_FRESH: tl.constexpr):
    """_pc_bwd_rows and _pc_bwd_cols in one program per chunk and value tile (BWD_INTRA="fused", ours): the chunk's
    keys, g, U and the tile's log-prefix are loaded once instead of by 2·NB programs, and the sub-blocks a run last to
    first. Block a's rows (M's rows into slot vb of MM's NMP parts, DGR) as in _pc_bwd_rows; its source rows' du from
    the later blocks through a [K, BV] sum instead of one [16, 16] dot per block pair:
        du_s = e^{ρ_{a+1} - u_s} (x_s · Gs_a),   Gs_a = Σ_{a' > a} e^{ρ_a' - ρ_{a+1}} q_a'ᵀ (e^{ur - ρ_a'} ⊙ dO)_a'
    (ρ_a the log-prefix before block a, ρ_{a+1} after it; every exponent <= 0), Gs_{a-1} = Y_a + e^{ρ_{a+1} - ρ_a} Gs_a
    with Y_a = q_aᵀ (e^{ur - ρ_a} ⊙ dO)_a, plus the diagonal block's du as in _pc_bwd_cols (split or broadcast).
    Grid: (value tiles, chunks, B·H)."""
    NB: tl.constexpr = C // 16
    vb = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        Q += bos * H * K
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        DO += bos * H * V
        DU += bos * H * V
        DGU += bos * H * V
        DGR += bos * H * V
        MM += bos * H * (C * NMP)
    MM += vb * C
    i = tl.arange(0, C)
    j = tl.arange(0, 16)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    vmask = cv < V
    vm = rmask[:, None] & vmask[None, :]
    off = tok[:, None] * V + cv[None, :]
    causal = _causal16(j, READ_AFTER)
    Gs = tl.zeros([BK, BV], dtype=tl.float32)
    for r in range(0, NB):
        a = NB - 1 - r
        # the chunk's rows are (re)loaded in each step, from L2: only Gs lives across the steps (keeping x, g, U and
        # u in registers through the loop spilled at K = 128, offline ptxas for sm_90)
        x = tl.load(X + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
        dt = x.dtype
        g = tl.load(G + off, mask=vm, other=0.)
        _r, ma, ta, _x = _chunk_rows(b, h, n * NB + a, j, T, T, 0, H, 16)
        ka = ma[:, None] & kmask[None, :]
        va = ma[:, None] & vmask[None, :]
        offa = ta[:, None] * V + cv[None, :]
        qa = tl.load(Q + ta[:, None] * K + ck[None, :], mask=ka, other=0.)
        xa = tl.load(X + ta[:, None] * K + ck[None, :], mask=ka, other=0.)
        ga = tl.load(G + offa, mask=va, other=0.)
        Ua = tl.load(VV + offa, mask=va, other=0.).to(tl.float32) * tl.load(ETA + offa, mask=va, other=0.)
        doa = tl.load(DO + offa, mask=va, other=0.).to(tl.float32)
        rho, ua, ura = _blk_prefix(g, ga, i, a, READ_AFTER)
        rho1 = rho + tl.sum(ga, 0)  # the log-prefix after the block
        Paa = tl.where(causal, tl.dot(qa, tl.trans(xa), input_precision=PREC), 0.)  # [i, s]
        ok = False  # DIAG="split" (DSPAN > 0; see _split_refs)
        if DSPAN > 0:
            er0, er1, ec0, ec1, ok = _split_refs(rho, ua, ura, j, DSPAN)
        if ok:
            ddt = tl.float32 if D32 else dt
            B0 = (Ua * ec0).to(ddt)
            B1 = (Ua * ec1).to(ddt)
            Pd = Paa.to(ddt)
            D0 = (doa * er0).to(ddt)
            D1 = (doa * er1).to(ddt)
            Mdiag = tl.dot(D0, tl.trans(B0), input_precision=DPREC) + tl.dot(D1, tl.trans(B1), input_precision=DPREC)
            dgr = doa * (er0 * tl.dot(Pd, B0, input_precision=DPREC) + er1 * tl.dot(Pd, B1, input_precision=DPREC))
            PT = tl.trans(Paa).to(ddt)
            du = ec0 * tl.dot(PT, D0, input_precision=DPREC) + ec1 * tl.dot(PT, D1, input_precision=DPREC)
        else:  # the broadcast, with at most two [16, 16, BV] tensors alive: E3 until F3 = P ⊙ E3 replaces it
            E3 = tl.exp(tl.minimum(ura[:, None, :] - ua[None, :, :], 0.))
            Mdiag = tl.sum(E3 * Ua[None, :, :] * doa[:, None, :], 2)
            F3 = Paa[:, :, None] * E3
            dgr = doa * tl.sum(F3 * Ua[None, :, :], 1)
            du = tl.sum(F3 * doa[:, None, :], 0)
        alpha_do = tl.exp(tl.minimum(ura - rho[None, :], 0.)) * doa
        before = i < a * 16
        U = tl.load(VV + off, mask=vm, other=0.).to(tl.float32) * tl.load(ETA + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        betaU = (tl.where(before[:, None], tl.exp(tl.minimum(rho[None, :] - u, 0.)), 0.) * U).to(dt)
        Poff = tl.where(before[None, :], tl.dot(qa, tl.trans(x), input_precision=PREC), 0.)
        Moff = tl.dot(alpha_do.to(dt), tl.trans(betaU), input_precision=PREC)
        dgr += alpha_do * tl.dot(Poff.to(dt), betaU, input_precision=PREC)
        tl.store(DGR + offa, dgr, mask=va)
        # M's rows of block a in two stores to disjoint columns (see _pc_bwd_rows)
        offdiag = (i < a * 16) | (i >= a * 16 + 16)
        tl.store(MM + ta[:, None] * (C * NMP) + i[None, :], Moff, mask=ma[:, None] & offdiag[None, :])
        tl.store(MM + ta[:, None] * (C * NMP) + (a * 16 + j)[None, :], tl.where(causal, Mdiag, 0.), mask=ma[:, None])
        # the later blocks' part of du (Gs is zero for the last block)
        du += tl.exp(tl.minimum(rho1[None, :] - ua, 0.)) * tl.dot(xa, Gs.to(dt), input_precision=PREC)
        if DU_FRESH:
            tl.store(DU + offa, du, mask=va)
        else:
            tl.store(DU + offa, tl.load(DU + offa, mask=va, other=0.) + du, mask=va)
        tl.store(DGU + offa, -Ua * du, mask=va)
        Gs = tl.exp(rho1 - rho)[None, :] * Gs + tl.dot(tl.trans(qa), alpha_do.to(dt), input_precision=PREC)


@triton.jit
def _pc_bwd_main(Q, X, VV, ETA, G, HS, DHS, DO, DU, DGR, DGU, DQ, DX, DV, DETA, DG, T, NT,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, SB: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr, CU, CIDX, COFF,
                 VARLEN: tl.constexpr, MM, BLOCKED: tl.constexpr, NMP: tl.constexpr, STATE_DU: tl.constexpr = False):
    """STATE_DU (the key-split state pass, LINEAR_KSPLIT; blocked only): DU holds the intra-chunk part only, and the
    state part e^{u_C - u} ⊙ (x · dH), which the value loop forms anyway for the gate term Y, is added here."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, coff = _varlen_chunk(CU, CIDX, COFF, n)
        Q += bos * H * K
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        DO += bos * H * V
        DU += bos * H * V
        DGR += bos * H * V
        DGU += bos * H * V
        DQ += bos * H * K
        DX += bos * H * K
        DV += bos * H * V
        DETA += bos * H * V
        DG += bos * H * V
        HS += coff * K * V
        DHS += coff * K * V
        if BLOCKED:
            MM += bos * H * (C * NMP)
    i = tl.arange(0, C)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    ck = tl.arange(0, BK)
    kmask = ck < K
    km = rmask[:, None] & kmask[None, :]
    q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=km, other=0.)
    x = tl.load(X + tok[:, None] * K + ck[None, :], mask=km, other=0.)
    dt = q.dtype
    if READ_AFTER:
        causal = i[:, None] >= i[None, :]
    else:
        causal = i[:, None] > i[None, :]
    if BLOCKED:  # pass 1 ran as _pc_bwd_rows / _pc_bwd_cols: M, DGR, DGU and DU's intra part are in memory
        M = tl.load(MM + tok[:, None] * (C * NMP) + i[None, :], mask=rmask[:, None], other=0.)
        for p in tl.static_range(1, NMP):  # _pc_bwd_rows' per-value-tile parts of M (ROWS_GRID="tile")
            M += tl.load(MM + p * C + tok[:, None] * (C * NMP) + i[None, :], mask=rmask[:, None], other=0.)
    else:
        P = tl.where(causal, tl.dot(q, tl.trans(x), input_precision=PREC), 0.)
        M = tl.zeros([C, C], dtype=tl.float32)
        # pass 1: the per-column intra-chunk terms, SB columns at a time
        for vb in range(0, tl.cdiv(V, SB)):
            cv = vb * SB + tl.arange(0, SB)
            vm = rmask[:, None] & (cv < V)[None, :]
            off = tok[:, None] * V + cv[None, :]
            v = tl.load(VV + off, mask=vm, other=0.).to(tl.float32)
            eta = tl.load(ETA + off, mask=vm, other=0.)
            g = tl.load(G + off, mask=vm, other=0.)
            do = tl.load(DO + off, mask=vm, other=0.).to(tl.float32)
            u = tl.cumsum(g, 0)
            if READ_AFTER:
                ur = u
            else:
                ur = u - g
            D = tl.exp(tl.minimum(ur[:, None, :] - u[None, :, :], 0.))
            DU3 = D * (v * eta)[None, :, :] * do[:, None, :]          # [i, s, c]
            M += tl.sum(DU3, 2)
            Z3 = P[:, :, None] * DU3
            du_intra = tl.sum(P[:, :, None] * D * do[:, None, :], 0)  # Σ_i
            tl.store(DU + off, tl.load(DU + off, mask=vm, other=0.) + du_intra, mask=vm)
            tl.store(DGR + off, tl.sum(Z3, 1), mask=vm)
            tl.store(DGU + off, -tl.sum(Z3, 0), mask=vm)
    tl.debug_barrier()
    M = tl.where(causal, M, 0.)
    dq = tl.zeros([C, BK], dtype=tl.float32)
    dxs = tl.zeros([C, BK], dtype=tl.float32)
    hbase = (bh.to(tl.int64) * NT + n) * K * V
    # pass 2: inter-chunk terms by value blocks, and the per-column η, v, log γ gradients
    for vb in range(0, tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        vmask = cv < V
        vm = rmask[:, None] & vmask[None, :]
        off = tok[:, None] * V + cv[None, :]
        soff = ck[:, None] * V + cv[None, :]
        S = tl.load(HS + hbase + soff, mask=kmask[:, None] & vmask[None, :], other=0.)
        dH = tl.load(DHS + hbase + soff, mask=kmask[:, None] & vmask[None, :], other=0.)
        v = tl.load(VV + off, mask=vm, other=0.).to(tl.float32)
        eta = tl.load(ETA + off, mask=vm, other=0.)
        g = tl.load(G + off, mask=vm, other=0.)
        do = tl.load(DO + off, mask=vm, other=0.).to(tl.float32)
        dU = tl.load(DU + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        uC = tl.sum(g, 0)
        if READ_AFTER:
            ur = u
        else:
            ur = u - g
        eC = tl.exp(tl.minimum(uC[None, :] - u, 0.))
        U = v * eta
        qS = tl.dot(q, S.to(dt), input_precision=PREC)
        d_ur = tl.load(DGR + off, mask=vm, other=0.) + tl.exp(ur) * do * qS
        if STATE_DU:
            xdh = tl.dot(x, dH.to(dt), input_precision=PREC) * eC
            dU += xdh
            Y = xdh * U
        else:
            Y = eC * tl.dot(x, dH.to(dt), input_precision=PREC) * U
        d_uC = tl.exp(uC) * tl.sum(dH * S, 0) + tl.sum(Y, 0)
        d_u = tl.load(DGU + off, mask=vm, other=0.) - Y + d_ur
        d_u += tl.where(i[:, None] == C - 1, d_uC[None, :], 0.)
        dg = tl.cumsum(d_u, 0, reverse=True)
        if not READ_AFTER:
            dg -= d_ur
        tl.store(DG + off, dg, mask=vm)
        tl.store(DETA + off, dU * v, mask=vm)
        tl.store(DV + off, (dU * eta).to(DV.dtype.element_ty), mask=vm)
        dq += tl.dot((do * tl.exp(ur)).to(dt), tl.trans(S.to(dt)), input_precision=PREC)
        dxs += tl.dot((U * eC).to(dt), tl.trans(dH.to(dt)), input_precision=PREC)
    Md = M.to(dt)
    dq += tl.dot(Md, x, input_precision=PREC)
    dx = dxs + tl.trans(tl.dot(tl.trans(q), Md, input_precision=PREC))
    tl.store(DQ + tok[:, None] * K + ck[None, :], dq.to(DQ.dtype.element_ty), mask=km)
    tl.store(DX + tok[:, None] * K + ck[None, :], dx.to(DX.dtype.element_ty), mask=km)


def fwd_out(q, x, v, eta, g, HS, T, NT, H, K, V, C, BK, BVo, read_after, prec, va, st):
    """The read-out O from the per-chunk states HS (Falcon-2A; Falcon-2 with R for v): the inter-chunk term into OF
    (_pc_fwd_inter), then fwd_intra; or, with FWD_INTER="fold" (the blocked sub-block grid only), both in
    _pc_fwd_intra_sb."""
    B = q.shape[0]
    O = _empty((B, T, H, V), q.dtype, q.device)
    if FWD_INTER == "fold" and INTRA == "blocked" and FWD_GRID == "block":
        fwd_intra(q, x, v, eta, g, O, O, T, NT, H, K, V, C, BK, read_after, prec, va, st, HS=HS)
        return O
    OF = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
    _pc_fwd_inter[(cdiv(V, BVo), NT, B * H)](q, g, HS, OF, T, NT, H, K, V, C, BK, BVo, read_after,
                                             prec, *va, **st)
    fwd_intra(q, x, v, eta, g, OF, O, T, NT, H, K, V, C, BK, read_after, prec, va, st)
    return O


def fwd_intra(q, x, v, eta, g, OF, O, T, NT, H, K, V, C, BK, read_after, prec, va, st, HS=None):
    """O = OF + the intra-chunk term: by 16-row sub-blocks with tensor-core dots between them, one program per
    sub-block (_pc_fwd_intra_sb; the default, ours) or per chunk (_pc_fwd_intra_blk, FWD_GRID="chunk"), or, with
    FALCON_TRITON_2A=exact, the [C, C, 4]-column broadcast. All three proven on the H200. B = O.shape[0]. HS given
    (sub-block grid only; fwd_out's fold): the inter-chunk term from HS instead of OF (OF unread)."""
    B = O.shape[0]
    BVi = min(32, _np2(V))  # the blocked term's value tile
    if INTRA == "blocked" and FWD_GRID == "block":
        BVi = min(int(FWD_SB_BV), _np2(V))
        _pc_fwd_intra_sb[(cdiv(V, BVi), NT * (C // 16), B * H)](q, x, v, eta, g, OF, O, T, H, K, V, C, BK, BVi,
                                                                read_after, prec, *va, *diag_args(q.dtype, prec),
                                                                HS if HS is not None else q, NT, HS is not None,
                                                                num_warps=int(FWD_SB_WARPS), **st)
    elif INTRA == "blocked":
        _pc_fwd_intra_blk[(cdiv(V, BVi), NT, B * H)](q, x, v, eta, g, OF, O, T, H, K, V, C, BK, BVi, read_after,
                                                     prec, *va, num_warps=8, **st)
    else:
        _pc_fwd_intra[(NT, B * H)](q, x, v, eta, g, OF, O, T, H, K, V, C, BK, SB, read_after, prec, *va,
                                   num_warps=8, **st)


def bwd_intra_main(q, x, v, eta, g, HS, DHS, dO, DU, DGR, DGU, dq, dx, dv, deta, dg, T, NT, H, K, V, C, BK, BVm,
                   read_after, prec, va, st, state_du=False):
    """The per-chunk backward after the reverse state pass (DU holds the state part of dU): by default (blocked; ours)
    _pc_bwd_rows (M, DGR) and _pc_bwd_cols (DU's intra part, DGU) first (or both in _pc_bwd_intra:
    FALCON_TRITON_2A_BWD_INTRA=fused), then _pc_bwd_main without its broadcast pass; with FALCON_TRITON_2A=exact,
    _pc_bwd_main alone. Falcon-2 calls it with R for v. state_du (the key-split
    state pass, blocked only): DU starts empty, _pc_bwd_cols stores its intra part and _pc_bwd_main adds the state
    part from DHS."""
    B = q.shape[0]
    blocked = INTRA == "blocked"
    MM = q
    NMP = 1
    if blocked:
        NB = C // 16
        BVi = min(32, _np2(V))
        dg_args = diag_args(q.dtype, prec)
        fused = BWD_INTRA == "fused"
        BVr = min(FUSED_BV, _np2(V)) if fused else min(int(ROWS_BV), _np2(V))
        NMP = cdiv(V, BVr) if fused or ROWS_GRID == "tile" else 1  # M's parts, one per value tile, summed in main
        MM = torch.empty(B, T, H, NMP, C, dtype=torch.float32, device=q.device)
        if fused:
            _pc_bwd_intra[(NMP, NT, B * H)](q, x, v, eta, g, dO, DU, DGU, DGR, MM, T, H, K, V, C, BK, BVr, read_after,
                                            prec, *va, NMP, *dg_args, state_du, num_warps=FUSED_WARPS,
                                            **st)
        else:
            _pc_bwd_rows[(NT * NB, B * H, NMP)](q, x, v, eta, g, dO, DGR, MM, T, H, K, V, C, BK, BVr, read_after,
                                               prec, *va, NMP, *dg_args, num_warps=4 if NMP > 1 else 8, **st)
            _pc_bwd_cols[(cdiv(V, BVi), NT * NB, B * H)](q, x, v, eta, g, dO, DU, DGU, T, H, K, V, C, BK, BVi,
                                                        read_after, prec, *va, *dg_args, state_du, num_warps=4, **st)
    elif state_du:
        raise ValueError("the key-split state pass (FALCON_TRITON_LINEAR_KSPLIT=on) needs the blocked intra-chunk term")
    _pc_bwd_main[(NT, B * H)](q, x, v, eta, g, HS, DHS, dO, DU, DGR, DGU, dq, dx, dv, deta, dg, T, NT, H, K,
                              V, C, BK, BVm, SB, read_after, prec, *va, MM, blocked, NMP, state_du, num_warps=8,
                              **st)


def _state_tiles(BK: int, BVs: int, K: int, V: int, n_seq_heads: int, dtype) -> tuple:
    """(key tile, value tile, key tiles NKB) of the two state passes: the launch proven first (all of K, _cfg's value
    tile) unless LINEAR_KSPLIT=on (proven; opt-in: 1.029x Falcon-2A's time at 16x2048x12x64, 0.968x at 4x8192x12x64)
    with the blocked intra-chunk term (whose _pc_bwd_cols / _pc_bwd_main then form DU without the pass: DU_FRESH,
    STATE_DU), where common.linear_state_tiles decides."""
    if common.LINEAR_KSPLIT != "on" or INTRA != "blocked":
        return BK, BVs, 1
    return linear_state_tiles(BK, BVs, K, V, n_seq_heads, dtype)


def _split(NT: int, programs: int, cu_seqlens) -> int:
    """Pieces of a split state pass (state_split.split_pieces) for Falcon-2A: dense calls with the blocked intra-chunk
    term (whose backward adds DU's state part in _pc_bwd_main: state_du)."""
    return split_pieces(NT, programs, INTRA == "blocked", cu_seqlens is None)


def percol_forward(q, x, v, eta, g, S0, *, read_after, C, allow_tf32, cu_seqlens=None):
    """Falcon-2A core forward (per-column γ, η; linear; window 1) -> (O, S_T, saved for backward). cu_seqlens
    (B = 1): the packed sequences run natively (chunk.chunk_forward's convention)."""
    B, T, H, K, V, NT, BK, BVs, BVo, BVm, wm, prec, st, dev = launch(q, v.shape[-1], C, allow_tf32)
    va, NT, NS = varlen_args(cu_seqlens, q, T, C, NT, B)
    f32 = torch.float32
    HS = torch.empty(B, H, NT, K, V, dtype=f32, device=dev)
    ST = _empty((NS, H, K, V), f32, dev)
    BKs, BVs, NKB = _state_tiles(BK, BVs, K, V, NS * H, q.dtype)
    NP = _split(NT, cdiv(V, BVs) * NKB * NS * H, cu_seqlens)
    if NP:  # the pass in pieces along the sequence (state_split.py; LINEAR_SPLIT)
        fwd_state_split(x, v, eta, g, S0, HS, ST, T, T, 0, NT, H, K, V, C, BKs, BVs, NKB, NP, prec, st, per_col=True)
    else:
        _pc_fwd_state[(cdiv(V, BVs) * NKB, NS * H)](x, v, eta, g, S0 if S0 is not None else eta, HS, ST, T, NT,
                                                    H, K, V, C, BKs, BVs, S0 is not None, prec, *va, NKB, **st)
    O = fwd_out(q, x, v, eta, g, HS, T, NT, H, K, V, C, BK, BVo, read_after, prec, va, st)
    return O, ST, (HS,)


def percol_backward(q, x, v, eta, g, saved, dO, dST, *, read_after, C, allow_tf32, need_ds0, cu_seqlens=None):
    """Falcon-2A core backward -> (dq, dx, dv, deta, dg, dS0 or None)."""
    (HS,) = saved
    B, T, H, K, V, NT, BK, BVs, BVo, BVm, wm, prec, st, dev = launch(q, v.shape[-1], C, allow_tf32)
    va, NT, NS = varlen_args(cu_seqlens, q, T, C, NT, B)
    f32 = torch.float32
    if dO is None:
        dO = torch.zeros(B, T, H, V, dtype=q.dtype, device=dev)
    dO = dO.contiguous()
    dST = dST.contiguous().float() if dST is not None else None
    DHS = torch.empty(B, H, NT, K, V, dtype=f32, device=dev)
    DU = torch.empty(B, T, H, V, dtype=f32, device=dev)
    DS0 = _empty((NS, H, K, V), f32, dev) if need_ds0 else None
    BKs, BVs, NKB = _state_tiles(BK, BVs, K, V, NS * H, q.dtype)
    NP = _split(NT, cdiv(V, BVs) * NKB * NS * H, cu_seqlens)
    if NP:  # the pass in pieces along the sequence (state_split.py; LINEAR_SPLIT): DU's state part in _pc_bwd_main
        bwd_state_split(q, g, dO, dST, DHS, DS0, T, NT, H, K, V, C, BKs, BVs, NKB, NP, read_after, prec, st,
                        per_col=True)
    else:
        _pc_bwd_state[(cdiv(V, BVs) * NKB, NS * H)](
            q, x, g, dO, dST if dST is not None else eta, DHS, DU, DS0 if DS0 is not None else eta, T, NT, H, K,
            V, C, BKs, BVs, read_after, dST is not None, need_ds0, prec, *va, NKB, **st)
    DGR = torch.empty(B, T, H, V, dtype=f32, device=dev)
    DGU = torch.empty(B, T, H, V, dtype=f32, device=dev)
    dq = _empty(q.shape, q.dtype, dev)
    dx = _empty(x.shape, x.dtype, dev)
    dv = _empty(v.shape, v.dtype, dev)
    deta = _empty(eta.shape, eta.dtype, dev)
    dg = _empty(g.shape, g.dtype, dev)
    bwd_intra_main(q, x, v, eta, g, HS, DHS, dO, DU, DGR, DGU, dq, dx, dv, deta, dg, T, NT, H, K, V, C, BK, BVm,
                   read_after, prec, va, st, state_du=NKB > 1 or NP > 0)
    return dq, dx, dv, deta, dg, DS0
