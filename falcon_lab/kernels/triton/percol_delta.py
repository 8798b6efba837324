"""Triton chunk kernels for per-value-column gates, regression objective (Falcon-2), forward and backward.

    S_t = S_{t-1} diag(γ_t) + x_t (η_t ⊙ (v_t - S_{t-1}ᵀ x_t))ᵀ ,   γ_t, η_t ∈ R^V

Per chunk of C steps with start state S, per value column c (falcon-math.md §6.5, stable form; u the
inclusive and u⁻ the exclusive local log-decay prefix of column c):

    (I + L_c) R_c = V_c - e^{u⁻_c} ⊙ (X S)_c ,   L_c[i, s] = [s < i] (x_i·x_s) e^{u⁻_{i,c} - u_{s,c}} η_{s,c}
    O_c = e^{u^r_c} ⊙ (Q S)_c + Σ_{s ≤ i | s < i} (q_i·x_s) e^{u^r_{i,c} - u_{s,c}} η_{s,c} R_{s,c}
    S'_c = e^{u_{C,c}} S_c + Xᵀ (e^{u_C - u} ⊙ η ⊙ R)_c

Given R, the read-out and the state update are Falcon-2A's with R in place of V, so the output pass and
most of the backward reuse percol.py's kernels. New here (ours):
  * the sequential state pass solves the d_v per-column unit-lower-triangular systems by forward
    substitution, a [C, BV] update per step (the systems cannot share an inverse across columns, so
    there is no tensor-core form; falcon-math.md §6.5 cost caveat), and stores R;
  * backward: dU (the gradient of η ⊙ R) from the read-out and the carried state, the transposed
    solves by backward substitution inside the reverse state pass (dS needs Xᵀ of their result), then
    the solve's own gradients (of the Gram, the decays, η, v and X S) in a parallel pass.
Every exponent is a difference u_a - u_b with b <= a, so it is <= 0.

Status: tested under the Triton interpreter against the float64 loop (tests/test_triton_interp.py) and proven
on the H200 (2026-12-02, 3e9d5f3: all 29 rows of `bench check --variants 2`, bf16 and fp32, K = V = 16/64/128,
every chunk size, the public op, CUDA-graph decode, native varlen; on by default). History (issue 15): at
Triton's default 4 warps _pcd_bwd_state read an out-of-range shared/local address at K = V = 128, C = 64 bf16
(compute-sanitizer), fixed by its 8-warp launch; its fp32 build at K = 16, C = 64 (wgmma n8) was 1e-4 off, fixed
by fp32 value tiles >= 32. Since 2026-12-03 the forward state pass solves by 16-row sub-blocks and the solve's own
gradients run by sub-blocks (SOLVE = "fwd", BWD_SOLVE = "blocked" below: the whole sweep again, 29/29, and -11 to
-22 % fwd+bwd); the reverse state pass still substitutes row by row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk import a_dtype
from .common import (_chunk_rows, _empty, _np2, _prec, _state_init, _state_put, _state_tile, _varlen_chunk,
                     _varlen_seq, cdiv, launch, varlen_args)
from .host import SWITCHES, env_choice, env_value, refuse_unproven
from .percol import SB, bwd_intra_main, fwd_out

# The per-column solves inside the two sequential state passes (ours): "fwd" (the default since 2026-12-03: the forward
# pass by SBS = 16-row sub-blocks, the off-diagonal coupling as tensor-core dots through a [K, BV] accumulator, only the
# diagonal blocks substituted; the reverse pass by rows), "rows" (C-step substitution over the whole [C, BV] chunk in
# both passes, proven on the H200 on 2026-12-02, the default before) or "blocked" (both passes by sub-blocks). The same
# arithmetic, right under the interpreter. On the H200 "fwd" with BWD_SOLVE="blocked" passed all 29 rows of
# `bench check --variants 2` (bf16 and fp32, K = V = 16/64/128, every chunk size, the public op, CUDA-graph decode,
# native varlen; 2026-12-03 at 12b0470, benchmarks/results/h200_logs/kernels_2026-12-03d/) and took Falcon-2's
# fwd+bwd from 33.9 / 111.5 / 60.7 / 32.7 ms to 30.2 / 88.2 / 47.2 / 28.3 ms ("rows" / "exact") at (16, 2048, 12,
# 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128), same call. The reverse pass by blocks
# (_pcd_bwd_state_blk, "blocked") is proven with its launch FALCON_TRITON_2_BLK_BWD="4,0,x32" (the default launch:
# 4 warps, the pass's value tile, q and x cast up after their loads so every dot of the kernel runs on fp32 operands
# at fp32 dot precision, the code its fp32 builds compile): all 29 rows of `bench check --variants 2` on the H200
# (2026-12-03, fourteenth session, 71520f4, benchmarks/results/h200_logs/kernels_2026-12-03f/). It is not the default:
# in one process against "fwd" its fwd+bwd GPU time was 0.89 / 1.07 / 0.99 / 0.98x at the four shapes above (faster
# only at (16, 2048, 12, 64)). Other launches stay behind FALCON_TRITON_UNPROVEN=1 on CUDA: with 16-bit dots at
# 4 warps bf16 K = 128 gave every gradient through dH wrong (also with one pipeline stage, ",s1", and with fp32
# operands in the transposed solve only, ",f32"; memcheck clean each time), and at 8 warps fp32 read shared or local
# memory out of range (K = 64, tile 64; K = 128, tile 16; in _bwd_solve_blocked's loop over sub-blocks, last first)
# (kernels_2026-12-03c/-d/-e). FALCON_TRITON_2_BLK_BWD="warps,bv[,f32|,x32][,s1]" sets that launch (ours).
# "inv" (ours, 2026-12-03, sixteenth session; proven on the H200 2026-12-04, below): the forward pass by sub-blocks as
# "fwd", but the diagonal blocks' substitutions (16 dependent steps of [16, BV] work, each with three cross-thread row
# extractions, on the sequential path) replaced by precomputed inverses: _pcd_blk_inv, one program per sub-block, head
# and value tile (all in parallel), writes M = (I + L_aa)^{-1} per column, [16, 16] per sub-block and column, in A's
# dtype (chunk.a_dtype: FALCON_TRITON_A_DTYPE), and the pass applies it as one [16, 16, BV] multiply and sum. Why: at
# (1, 32768, 6, 128) the forward pass by sub-blocks took 28.0 of Falcon-2's 86 ms (kernels_2026-12-03h), ~55 us a chunk
# on 24 programs. Cost: 16 values per token, head and column (16x v's size; 0.8 GB in bf16 at (16, 2048, 12, 64)), alive
# during the forward state pass only. The reverse pass stays by rows. First H200 numbers (one round, 50060de,
# kernels_2026-12-03h/call10): Falcon-2's fwd+bwd 85.7 -> 68.3 ms at (1, 32768, 6, 128), 27.3 -> 25.3 ms at (16, 2048,
# 12, 64) (the forward pass and _pcd_blk_inv 27.8 -> 10.2 and 5.3 -> 3.3 ms), peak unchanged.
# "blocked_inv" (ours, same session; proven 2026-12-04 and the default since, below): "inv" and the reverse pass by
# sub-blocks (_pcd_bwd_state_blk, its proven launch FALCON_TRITON_2_BLK_BWD) with the same inverses, recomputed in the
# backward, transposed: drhs_s = Σ_i M[i, s] d_i for the diagonal blocks (the reverse pass by rows took 44.7 of the 86
# ms above).
# On the H200 (2026-12-04, seventeenth session, kernels_2026-12-04): "inv" and "blocked_inv" pass the whole check
# sweep (29/29 rows each, NaN-poisoned, bf16 + fp32, varlen); in one process (2 rounds, GPU time) "inv" is 0.928 /
# 0.797 / 0.773 / 0.962x and "blocked_inv" 0.777 / 0.581 / 0.532 / 0.865x "fwd"'s time at 16x2048x12x64,
# 1x32768x6x128, 4x8192x12x64, 16x2048x6x128 (op peak +48 MB): "blocked_inv" the default since then. Its reverse pass
# with 16-bit dots (FALCON_TRITON_2_BLK_BWD=4,0) fails the gradients (rows 1, 7, 10, 23, 27: 0.16-0.42 off) as before.
# "fused_inv" (ours, 2026-12-04, nineteenth session; proven, opt-in): "blocked_inv" with each diagonal block's
# inverses formed inside the two state passes (_inv_prod, the product form of INV_FORM="prod", per sub-block on the
# sequential path) instead of by _pcd_blk_inv: no INV tensor (16 values per token, head and column; 0.8 GB at
# (16, 2048, 12, 64) bf16) and no _pcd_blk_inv launches (2 x 1.43 ms there, kernels_2026-12-04c/call3), for more
# latency per sub-block in the passes. Value tiles of FUSED_BV = 16 columns in both passes. On the H200 (51178bf,
# kernels_2026-12-04c/call5): all 29 rows of `bench check --variants 2` pass with it (16 columns); in one process
# against "blocked_inv" Falcon-2's fwd+bwd was 0.991 / 1.217 / 0.972 / 1.217x at (16, 2048, 12, 64),
# (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128) (32 columns 1.12-1.87x): a little faster at K = 64,
# slower at K = 128, where the passes spill (offline, sm_90a: the reverse pass 1.6-2 KB of stack at K = 128 either
# way, the forward 64 -> 256 bytes) and the latency the passes gain is on the sequential path; the op's peak only
# -48 MB (INV was freed before the peak, which is in the backward). Not the default.
SOLVE = env_choice("FALCON_TRITON_2_SOLVE", "blocked_inv",
                   ("rows", "fwd", "blocked", "inv", "blocked_inv", "fused_inv"),
                   "Falcon-2: the state passes' per-column solves by rows, 16-row sub-blocks or block inverses, "
                   "precomputed or formed in the passes (proven: blocked_inv, fused_inv, inv, fwd, rows)")
FUSED_BV = 16  # the fused passes' value tile: 32 columns spilled and took 1.12-1.87x the time (call5)
# How _pcd_blk_inv forms the inverses (ours): "prod" (the default since 2026-12-04, nineteenth session) or "tile" (the
# form proven first, the default before: the whole strictly lower [16, 16, BV] L as one register tile, then 16
# dependent substitution steps, each taking row i out of it by a masked sum, with a cross-warp layout conversion per
# step). "prod": the product (I - L)(I + L²)(I + L⁴)(I + L⁸) of the nilpotent L as six batched [16, 16] tensor-core
# dots per column (mma.sync, offline sm_90a: 127 registers, no spills, no loop), L built column first ([BV, 16, 16]);
# tf32 dots for 16-bit inputs (the inverses are stored in the 16-bit A dtype), IEEE fp32 for fp32 inputs. Why: the
# H200 profile (kernels_2026-12-04/call5) put _pcd_blk_inv at 4.21 of Falcon-2's 21.4 ms at (16, 2048, 12, 64), two
# launches (the forward's and the backward's recompute). On the H200 (kernels_2026-12-04c, 6cfcede / 1056560): all 29
# rows of `bench check --variants 2` pass with it (16-column tiles; NaN-poisoned, bf16 + fp32, varlen), and in one
# process (2 rounds, GPU time) Falcon-2's fwd+bwd was 0.925 / 0.975 / 0.935 / 0.938x "tile"'s at 16x2048x12x64,
# 1x32768x6x128, 4x8192x12x64, 16x2048x6x128 (the two launches 4.20 -> 2.83 ms at the first; 32-column tiles
# 0.935-0.977x, unproven). A third form, "rows" (each row of L formed in its step), was 1.06-1.34x slower than "tile"
# (kernels_2026-12-04/call6) and is gone.
INV_FORM = env_choice("FALCON_TRITON_2_INV", "prod", ("tile", "prod"),
                      "Falcon-2: _pcd_blk_inv as a product of batched tensor-core dots or by substitution steps over "
                      "one [16, 16, BV] tile (both proven)")
# ... "prod"'s value tile (ours): 16 columns a program ([BV, 16, 16] fp32 tiles: L, the product and one power alive at
# once); 32 needed 255 registers and spilled at 4 warps offline and took 1.01x the time on the H200 (call2 of
# kernels_2026-12-04c), so it is not a switch.
INV_BV = 16
# ... and its launch's warps (ours): 4 (proven) or 8 (unproven). Offline (sm_90a, Triton 3.6, bf16, K = 64, C = 64,
# 32-column tiles) 4 warps need 247 registers a thread with the tile, 235 with rows (2 programs, 8 warps, an SM); at 8
# warps 134 / 125 (16 warps an SM) and 872 / 624 SASS instructions against 1360 / 984. On the H200 (2026-12-04, one
# round contended by a check process, kernels_2026-12-04/call6) the kernel's time at (16, 2048, 12, 64) /
# (1, 32768, 6, 128): tile, 4 warps 4.20 / 5.52 ms; tile, 8: 6.53 / 4.72; rows, 4: 5.63 / 5.83; rows, 8: 6.15 / 6.11;
# rows 1-5 of Falcon-2's check passed with rows at 8 warps. Neither was the default. With the product form (2026-12-04,
# nineteenth session, kernels_2026-12-04c/call4): 8 warps pass all 29 rows of `bench check --variants 2` but take
# 1.010-1.026x the time (the two launches 2.83 -> 3.28 ms at (16, 2048, 12, 64)); 4 stays the default.
INV_WARPS = env_choice("FALCON_TRITON_2_INV_WARPS", "4", ("4", "8"),
                       "Falcon-2: _pcd_blk_inv's warps (8: proven with INV_FORM=prod only)")
# Whether the backward reuses the forward's block inverses (ours, 2026-12-04, eighteenth session): "recompute" (the
# default: with SOLVE="blocked_inv" the backward launches _pcd_blk_inv again) or "save" (the forward's INV is kept as
# a saved tensor and the backward reads it: one launch fewer). The same values either way (the same kernel on the
# same inputs). Proven on the H200 (28242485: all 29 rows of `bench check --variants 2` with it) and timed in one
# process (kernels_2026-12-04b/call2; with this launch of _pcd_bwd_solve_blk below): 0.891 / 0.956 / 0.903 / 0.896x
# the time at (16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128) (-2.1 ms each), but the
# op's peak +720 MB (1873 -> 2593 MB at K = 64, 2064 -> 2784 at K = 128): INV, 16 values per token, head and column
# in A's dtype, stays alive from the forward through the whole backward (recomputed, it is freed before the
# backward's later kernels allocate theirs), and in a model through every layer's forward. Not the default for
# that memory; a speed-for-memory knob. With the product form (kernels_2026-12-04c/call4) it saves one 1.4 ms launch:
# 0.916 / 0.967 / 0.926 / 0.920x at the same four shapes, the same +720 MB.
INV_KEEP = env_choice("FALCON_TRITON_2_INV_KEEP", "recompute", ("recompute", "save"),
                      "Falcon-2: the backward recomputes the forward's block inverses or reuses them (both proven; "
                      "save: +16 values per token, head and column kept)")
# _pcd_bwd_solve_blk's launch (ours): warps and value tile. 8 warps with 32-column tiles were the proven launch until
# 2026-12-04; in one process on the H200 (kernels_2026-12-04b/call2, eighteenth session, after the profile put the
# kernel at 4.65 of Falcon-2's 21.4 ms at (16, 2048, 12, 64)) 4 warps with 64-column tiles took Falcon-2's fwd+bwd to
# 0.905 / 0.962 / 0.914 / 0.916x at the four shapes above (the kernel 4.65 -> ~2.6 ms at the first; 64 columns alone
# 0.94-1.00x, 4 warps alone 0.91-0.96x; at K = 128 the tile is at most 32): the default since then, proven at 8c614f9
# (all 29 rows of `bench check --variants 2`, kernels_2026-12-04b/call3-4). 8 warps and 32 columns stay selectable.
SOLVE_BLK_WARPS = env_choice("FALCON_TRITON_2_SOLVE_BLK_WARPS", "4", ("8", "4"),
                             "Falcon-2: _pcd_bwd_solve_blk's warps (both proven)")
SOLVE_BLK_BV = env_choice("FALCON_TRITON_2_SOLVE_BLK_BV", "64", ("32", "64"),
                          "Falcon-2: _pcd_bwd_solve_blk's value tile (both proven)")

def keeps_inv() -> bool:
    """Whether the forward hands its block inverses to the backward (SOLVE="blocked_inv", INV_KEEP="save")."""
    return SOLVE == "blocked_inv" and INV_KEEP == "save"
try:
    _blk = env_value("FALCON_TRITON_2_BLK_BWD", "4,0,x32",
                     "Falcon-2: the reverse pass by sub-blocks' launch, 'warps,bv[,f32|,x32][,s1]' (proven: 4,0,x32)"
                     ).split(",")
    assert len(_blk) >= 2 and set(_blk[2:]) <= {"f32", "x32", "s1"} and len(set(_blk[2:])) == len(_blk) - 2
    assert not {"f32", "x32"} <= set(_blk[2:])
    # (warps, value tile or 0, fp32 dot operands: 0 none, 1 the solve's ("f32"), 2 every dot ("x32"), one stage)
    BLK_BWD = (int(_blk[0]), int(_blk[1]), 2 if "x32" in _blk[2:] else int("f32" in _blk[2:]), "s1" in _blk[2:])
    assert BLK_BWD[0] in (1, 2, 4, 8, 16) and BLK_BWD[1] in (0, 16, 32, 64, 128)
except (ValueError, AssertionError):
    raise ValueError("FALCON_TRITON_2_BLK_BWD must be 'warps,bv' with optional ',f32' or ',x32' and ',s1' (warps 1-16, "
                     "a power of two; bv 0 = the pass's value tile, or 16-128), got "
                     f"{SWITCHES['FALCON_TRITON_2_BLK_BWD']['value']!r}") from None


PROVEN_BLK_BWD = (4, 0, 2, False)  # "4,0,x32": the launch whose whole check sweep passed on the H200


# The solve's own gradients (pass 1 of _pcd_bwd_solve): "blocked" (_pcd_bwd_solve_blk, 16-row sub-blocks with
# tensor-core dots off the diagonal, ours; the default since 2026-12-03, proven with SOLVE="fwd" in the sweep above) or
# "exact" (the [C, C, 4] broadcast, proven 2026-12-02, the default before).
BWD_SOLVE = env_choice("FALCON_TRITON_2_BWD_SOLVE", "blocked", ("exact", "blocked"),
                       "Falcon-2: the solve's own gradients by 16-row sub-blocks or a [C, C, 4] broadcast (proven)")


@triton.jit
def _pcd_fwd_state(X, VV, ETA, G, S0, HS, RR, ST, T, NT, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   HAS_S0: tl.constexpr, PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr):
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    i = tl.arange(0, C)
    ck, kmask, cv, vmask, smask, soff = _state_tile(vb, K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    S = _state_init(S0, bh64, soff, smask, HAS_S0, K, V, BK, BV)
    if VARLEN:  # packed sequences (common.varlen): (b, h) = (sequence, head), pointers moved to its first token
        bos, T, NL, coff = _varlen_seq(CU, COFF, b, C)
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        RR += bos * H * V
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
        off = tok[:, None] * V + cv[None, :]
        v = tl.load(VV + off, mask=vm, other=0.).to(tl.float32)
        eta = tl.load(ETA + off, mask=vm, other=0.)
        g = tl.load(G + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        up = u - g
        uC = tl.sum(g, 0)
        gram = tl.dot(x, tl.trans(x), input_precision=PREC)  # [C, C]
        R = v - tl.exp(up) * tl.dot(x, S.to(x.dtype), input_precision=PREC)
        # forward substitution, column-oriented: R_s is final once rows < s are done
        for s in range(0, C):
            sel = i == s
            r_s = tl.sum(tl.where(sel[:, None], R, 0.), 0)
            u_s = tl.sum(tl.where(sel[:, None], u, 0.), 0)
            e_s = tl.sum(tl.where(sel[:, None], eta, 0.), 0)
            g_s = tl.sum(tl.where(sel[None, :], gram, 0.), 1)  # (x_i·x_s) over i
            coef = tl.where((i > s)[:, None], g_s[:, None] * tl.exp(tl.minimum(up - u_s[None, :], 0.)), 0.)
            R = R - coef * (e_s * r_s)[None, :]
        tl.store(RR + off, R, mask=vm)
        w = R * eta * tl.exp(tl.minimum(uC[None, :] - u, 0.))
        S = S * tl.exp(uC)[None, :] + tl.dot(tl.trans(x), w.to(x.dtype), input_precision=PREC)
    tl.store(ST + bh64 * K * V + soff, S, mask=smask)


@triton.jit
def _pcd_bwd_dui(Q, X, G, DO, DUI, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, SB: tl.constexpr, READ_AFTER: tl.constexpr, PREC: tl.constexpr, CU, CIDX, COFF,
                 VARLEN: tl.constexpr):
    """The read-out's gradient of U = η ⊙ R: Σ_i (q_i·x_s) e^{u^r_i - u_s} dO_i (state-independent)."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if VARLEN:  # program n is chunk slot n (common.varlen); B = 1, so bh is the head
        _s, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        Q += bos * H * K
        X += bos * H * K
        G += bos * H * V
        DO += bos * H * V
        DUI += bos * H * V
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
        g = tl.load(G + off, mask=vm, other=0.)
        do = tl.load(DO + off, mask=vm, other=0.).to(tl.float32)
        u = tl.cumsum(g, 0)
        if READ_AFTER:
            ur = u
        else:
            ur = u - g
        D = tl.exp(tl.minimum(ur[:, None, :] - u[None, :, :], 0.))
        tl.store(DUI + off, tl.sum(P[:, :, None] * D * do[:, None, :], 0), mask=vm)


@triton.jit
def _pcd_bwd_state(Q, X, ETA, G, DO, DUI, DST, DHS, DSU, DRHS, DS0, T, NT, H: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   READ_AFTER: tl.constexpr, HAS_DST: tl.constexpr, STORE_DS0: tl.constexpr,
                   PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr):
    """Reverse state pass: dH (the gradient of the state after each chunk), the state part of dU, and
    drhs = (I + L)^{-T} (η ⊙ dU) by backward substitution; the solve's right-hand side reads S, so
    dH gains Xᵀ(-e^{u⁻} ⊙ drhs)."""
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
        X += bos * H * K
        ETA += bos * H * V
        G += bos * H * V
        DO += bos * H * V
        DUI += bos * H * V
        DSU += bos * H * V
        DRHS += bos * H * V
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
        off = tok[:, None] * V + cv[None, :]
        x = tl.load(X + tok[:, None] * K + ck[None, :], mask=km, other=0.)
        q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=km, other=0.)
        dt = x.dtype
        eta = tl.load(ETA + off, mask=vm, other=0.)
        g = tl.load(G + off, mask=vm, other=0.)
        do = tl.load(DO + off, mask=vm, other=0.).to(tl.float32)
        u = tl.cumsum(g, 0)
        up = u - g
        uC = tl.sum(g, 0)
        if READ_AFTER:
            ur = u
        else:
            ur = up
        dsu = tl.dot(x, dH.to(dt), input_precision=PREC) * tl.exp(tl.minimum(uC[None, :] - u, 0.))
        tl.store(DSU + off, dsu, mask=vm)
        d = eta * (tl.load(DUI + off, mask=vm, other=0.) + dsu)
        gram = tl.dot(x, tl.trans(x), input_precision=PREC)
        # backward substitution with (I + L)ᵀ: d_r is final once rows > r are done
        for rr in range(0, C):
            r = C - 1 - rr
            sel = i == r
            d_r = tl.sum(tl.where(sel[:, None], d, 0.), 0)
            up_r = tl.sum(tl.where(sel[:, None], up, 0.), 0)
            g_r = tl.sum(tl.where(sel[:, None], gram, 0.), 0)  # (x_r·x_s) over s
            coef = tl.where((i < r)[:, None], g_r[:, None] * tl.exp(tl.minimum(up_r[None, :] - u, 0.)) * eta, 0.)
            d = d - coef * d_r[None, :]
        tl.store(DRHS + off, d, mask=vm)
        dpx = -tl.exp(up) * d
        dH = dH * tl.exp(uC)[None, :] + tl.dot(tl.trans(q), (do * tl.exp(ur)).to(dt), input_precision=PREC) \
            + tl.dot(tl.trans(x), dpx.to(dt), input_precision=PREC)
    if STORE_DS0:
        tl.store(DS0 + bh64 * K * V + soff, dH, mask=smask)


@triton.jit
def _pcd_bwd_solve(X, ETA, G, HS, RR, DRHS, SUP, SU, DX32, DX, DV, DETA, DG, T, NT, H: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   SB: tl.constexpr, PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr,
                   PASS1: tl.constexpr):
    """The solve's own gradients, added to what _pc_bwd_main wrote (DX32 in fp32, DETA, DG). With
    dL[i, s] = -drhs_i R_s (s < i) and ℓ the entries of L: dGram = Σ_c dL e^{u⁻_i - u_s} η_s,
    dη_s = Σ_i dL (x_i·x_s) e^{..}, du⁻_i = Σ_s dL ℓ, du_s = -Σ_i dL ℓ; from the right-hand side
    v - e^{u⁻} ⊙ (X S): dv = drhs, du⁻ = -drhs e^{u⁻} (X S), dX = (-e^{u⁻} drhs) Sᵀ."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, coff = _varlen_chunk(CU, CIDX, COFF, n)
        X += bos * H * K
        ETA += bos * H * V
        G += bos * H * V
        RR += bos * H * V
        DRHS += bos * H * V
        SUP += bos * H * V
        SU += bos * H * V
        DX32 += bos * H * K
        DX += bos * H * K
        DV += bos * H * V
        DETA += bos * H * V
        DG += bos * H * V
        HS += coff * K * V
    i = tl.arange(0, C)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    ck = tl.arange(0, BK)
    kmask = ck < K
    km = rmask[:, None] & kmask[None, :]
    x = tl.load(X + tok[:, None] * K + ck[None, :], mask=km, other=0.)
    dt = x.dtype
    strict = i[:, None] > i[None, :]
    gram = tl.where(strict, tl.dot(x, tl.trans(x), input_precision=PREC), 0.)
    dgram = tl.zeros([C, C], dtype=tl.float32)
    # pass 1: the [C, C, SB] terms of the per-column systems, SB columns at a time (or _pcd_bwd_solve_blk's, before)
    for vb in range(0, tl.cdiv(V, SB) if PASS1 else 0):
        cv = vb * SB + tl.arange(0, SB)
        vm = rmask[:, None] & (cv < V)[None, :]
        off = tok[:, None] * V + cv[None, :]
        eta = tl.load(ETA + off, mask=vm, other=0.)
        g = tl.load(G + off, mask=vm, other=0.)
        R = tl.load(RR + off, mask=vm, other=0.)
        d = tl.load(DRHS + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        up = u - g
        E = tl.where(strict[:, :, None], tl.exp(tl.minimum(up[:, None, :] - u[None, :, :], 0.)), 0.)
        dLE = -d[:, None, :] * R[None, :, :] * E                   # dL ⊙ e^{u⁻_i - u_s}: [i, s, c]
        dgram += tl.sum(dLE * eta[None, :, :], 2)
        Z = dLE * gram[:, :, None]                                  # dL ⊙ ℓ / η_s
        tl.store(DETA + off, tl.load(DETA + off, mask=vm, other=0.) + tl.sum(Z, 0), mask=vm)
        Z = Z * eta[None, :, :]
        tl.store(SUP + off, tl.sum(Z, 1), mask=vm)
        tl.store(SU + off, -tl.sum(Z, 0), mask=vm)
        tl.store(DV + off, d.to(DV.dtype.element_ty), mask=vm)
    tl.debug_barrier()
    dx = tl.zeros([C, BK], dtype=tl.float32)
    hbase = (bh.to(tl.int64) * NT + n) * K * V
    # pass 2: the right-hand side's terms by value blocks, and the log-decay gradient of the solve
    for vb in range(0, tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        vmask = cv < V
        vm = rmask[:, None] & vmask[None, :]
        off = tok[:, None] * V + cv[None, :]
        S = tl.load(HS + hbase + ck[:, None] * V + cv[None, :], mask=kmask[:, None] & vmask[None, :], other=0.)
        g = tl.load(G + off, mask=vm, other=0.)
        d = tl.load(DRHS + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        up = u - g
        dpx = -tl.exp(up) * d
        d_up = tl.load(SUP + off, mask=vm, other=0.) + dpx * tl.dot(x, S.to(dt), input_precision=PREC)
        tot = tl.load(SU + off, mask=vm, other=0.) + d_up
        dg = tl.cumsum(tot, 0, reverse=True) - d_up
        tl.store(DG + off, tl.load(DG + off, mask=vm, other=0.) + dg, mask=vm)
        dx += tl.dot(dpx.to(dt), tl.trans(S.to(dt)), input_precision=PREC)
    if PASS1:
        dgs = dgram + tl.trans(dgram)
        dx += tl.dot(dgs.to(dt), x, input_precision=PREC)
    dx += tl.load(DX32 + tok[:, None] * K + ck[None, :], mask=km, other=0.)
    tl.store(DX + tok[:, None] * K + ck[None, :], dx.to(DX.dtype.element_ty), mask=km)


@triton.jit
def _pcd_fwd_state_blk(X, VV, ETA, G, S0, HS, RR, ST, T, NT, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   HAS_S0: tl.constexpr, PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr,
                   SBS: tl.constexpr, INV, USE_INV: tl.constexpr, PPREC: tl.constexpr):
    """_pcd_fwd_state with the per-column solves by SBS-row sub-blocks (_fwd_solve_blocked; ours), USE_INV 1: with the
    diagonal blocks' inverses INV from _pcd_blk_inv; 2: with those inverses formed in the pass (dots at PPREC)."""
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    i = tl.arange(0, C)
    ck, kmask, cv, vmask, smask, soff = _state_tile(vb, K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    S = _state_init(S0, bh64, soff, smask, HAS_S0, K, V, BK, BV)
    if VARLEN:  # packed sequences (common.varlen): (b, h) = (sequence, head), pointers moved to its first token
        bos, T, NL, coff = _varlen_seq(CU, COFF, b, C)
        X += bos * H * K
        VV += bos * H * V
        ETA += bos * H * V
        G += bos * H * V
        RR += bos * H * V
        HS += coff * K * V
        if USE_INV == 1:
            INV += bos * H * SBS * V
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
        off = tok[:, None] * V + cv[None, :]
        v = tl.load(VV + off, mask=vm, other=0.).to(tl.float32)
        g = tl.load(G + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        up = u - g
        uC = tl.sum(g, 0)
        R = v - tl.exp(up) * tl.dot(x, S.to(x.dtype), input_precision=PREC)
        # the right-hand sides of the whole chunk, then the solve by SBS-row sub-blocks (_fwd_solve_blocked)
        tl.store(RR + off, R, mask=vm)
        tl.debug_barrier()
        A = _fwd_solve_blocked(X, ETA, G, RR, b, h, n, T, ck, kmask, cv, vmask, H, K, V, C, BK, BV, SBS, PREC,
                               INV, USE_INV, PPREC)
        S = S * tl.exp(uC)[None, :] + A
    tl.store(ST + bh64 * K * V + soff, S, mask=smask)


@triton.jit
def _pcd_bwd_state_blk(Q, X, ETA, G, DO, DUI, DST, DHS, DSU, DRHS, DS0, T, NT, H: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   READ_AFTER: tl.constexpr, HAS_DST: tl.constexpr, STORE_DS0: tl.constexpr,
                   PREC: tl.constexpr, CU, CIDX, COFF, VARLEN: tl.constexpr, SBS: tl.constexpr,
                   F32DOT: tl.constexpr, PREC32: tl.constexpr, INV, USE_INV: tl.constexpr, PPREC: tl.constexpr):
    """_pcd_bwd_state with the transposed solves by SBS-row sub-blocks (_bwd_solve_blocked; ours, experimental;
    F32DOT 1: the solve's dots on fp32 operands at precision PREC32; 2: every dot here, q and x cast up on load;
    USE_INV 1: the diagonal blocks solved with the transposes of _pcd_blk_inv's inverses INV; 2: of inverses formed
    in the pass, dots at PPREC).
    Reverse state pass: dH (the gradient of the state after each chunk), the state part of dU, and
    drhs = (I + L)^{-T} (η ⊙ dU) by backward substitution; the solve's right-hand side reads S, so
    dH gains Xᵀ(-e^{u⁻} ⊙ drhs)."""
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
        X += bos * H * K
        ETA += bos * H * V
        G += bos * H * V
        DO += bos * H * V
        DUI += bos * H * V
        DSU += bos * H * V
        DRHS += bos * H * V
        DHS += coff * K * V
        if USE_INV == 1:
            INV += bos * H * SBS * V
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
        off = tok[:, None] * V + cv[None, :]
        x = tl.load(X + tok[:, None] * K + ck[None, :], mask=km, other=0.)
        q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=km, other=0.)
        if F32DOT == 2:
            x = x.to(tl.float32)
            q = q.to(tl.float32)
        OPREC: tl.constexpr = PREC32 if F32DOT == 2 else PREC  # the dots outside the solve
        dt = x.dtype
        eta = tl.load(ETA + off, mask=vm, other=0.)
        g = tl.load(G + off, mask=vm, other=0.)
        do = tl.load(DO + off, mask=vm, other=0.).to(tl.float32)
        u = tl.cumsum(g, 0)
        up = u - g
        uC = tl.sum(g, 0)
        if READ_AFTER:
            ur = u
        else:
            ur = up
        dsu = tl.dot(x, dH.to(dt), input_precision=OPREC) * tl.exp(tl.minimum(uC[None, :] - u, 0.))
        tl.store(DSU + off, dsu, mask=vm)
        d = eta * (tl.load(DUI + off, mask=vm, other=0.) + dsu)
        tl.store(DRHS + off, d, mask=vm)
        tl.debug_barrier()
        xd = _bwd_solve_blocked(X, ETA, G, DRHS, b, h, n, T, ck, kmask, cv, vmask, H, K, V, C, BK, BV, SBS,
                                PREC32 if F32DOT > 0 else PREC, F32DOT > 0, INV, USE_INV, PPREC)
        dH = dH * tl.exp(uC)[None, :] + tl.dot(tl.trans(q), (do * tl.exp(ur)).to(dt), input_precision=OPREC) - xd
    if STORE_DS0:
        tl.store(DS0 + bh64 * K * V + soff, dH, mask=smask)


@triton.jit
def _inv_prod(gram, etaT, uT, upT, j, PPREC: tl.constexpr):
    """The per-column inverses M = (I + L)^{-1} of one 16-row diagonal block as the product (I - L)(I + L²)(I + L⁴)
    (I + L⁸) (ours; L strictly lower triangular, so L^16 = 0): L[c, i, s] = [s < i] gram[i, s] e^{u⁻_{i,c} - u_{s,c}}
    η_{s,c} built column first from the transposed [BV, 16] tiles etaT, uT, upT, then six batched [16, 16]
    tensor-core dots at PPREC. Returns M as [BV (c), 16 (i), 16 (s)] in fp32."""
    L = tl.where((j[None, :] < j[:, None])[None, :, :],
                 gram[None, :, :] * tl.exp(tl.minimum(upT[:, :, None] - uT[:, None, :], 0.)) * etaT[:, None, :], 0.)
    P = tl.where((j[:, None] == j[None, :])[None, :, :], 1., 0.) - L
    L2 = tl.dot(L, L, input_precision=PPREC)
    P += tl.dot(P, L2, input_precision=PPREC)
    L4 = tl.dot(L2, L2, input_precision=PPREC)
    P += tl.dot(P, L4, input_precision=PPREC)
    L8 = tl.dot(L4, L4, input_precision=PPREC)
    P += tl.dot(P, L8, input_precision=PPREC)
    return P


@triton.jit
def _pcd_blk_inv(X, ETA, G, INV, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, SBS: tl.constexpr, PREC: tl.constexpr, CU, CIDX, COFF,
                 VARLEN: tl.constexpr, PROD: tl.constexpr, PPREC: tl.constexpr):
    """Program (chunk·NB + a, b·H + h, value tile vb), SOLVE="inv" (ours): the inverse M = (I + L)^{-1} of sub-block
    a's diagonal block per value column, L[i, s, c] = [s < i] (x_i·x_s) e^{u⁻_{i,c} - u_{s,c}} η_{s,c} with the
    sub-block's own log-prefix (what _subst_fwd substitutes). Stored as INV[b, t, h, s, c] = M[t - t_a, s, c] for the
    sub-block's rows t (t_a its first row). Two forms of the same inverse (INV_FORM):
    PROD = False ("tile"): by rows, M_i = e_i - Σ_{s<i} L[i, s] M_s (rows not yet formed are 0, and L[i, s] is 0 for
    s >= i), 16 dependent steps over the whole [SBS, SBS, BV] L in registers, each with a masked cross-thread sum.
    PROD = True ("prod"): L is strictly lower triangular, so L^SBS = 0 and (I + L)^{-1} = (I - L)(I + L²)(I + L⁴)
    (I + L⁸) at SBS = 16 (each factor doubles the power that cancels: (I + L)(I - L) = I - L², ...). L is built as
    [BV, SBS, SBS] (the column first) and the six products are batched [SBS, SBS] tensor-core dots at PPREC, no
    dependent steps."""
    NB: tl.constexpr = C // SBS
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    vb = tl.program_id(2)
    n = pid // NB
    a = pid % NB
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        X += bos * H * K
        ETA += bos * H * V
        G += bos * H * V
        INV += bos * H * SBS * V
    j = tl.arange(0, SBS)
    _r, rmask, tok, _x = _chunk_rows(b, h, n * NB + a, j, T, T, 0, H, SBS)
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    x = tl.load(X + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & (ck < K)[None, :], other=0.)
    gram = tl.dot(x, tl.trans(x), input_precision=PREC)
    if PROD:
        # the column first: [BV (c), SBS (row i or s)]
        vmT = (cv < V)[:, None] & rmask[None, :]
        offT = tok[None, :] * V + cv[:, None]
        gT = tl.load(G + offT, mask=vmT, other=0.)
        uT = tl.cumsum(gT, 1)
        P = _inv_prod(gram, tl.load(ETA + offT, mask=vmT, other=0.), uT, uT - gT, j, PPREC)  # [c, i, s]
        tl.store(INV + (tok[None, :, None] * SBS + j[None, None, :]) * V + cv[:, None, None],
                 P.to(INV.dtype.element_ty), mask=vmT[:, :, None])
    else:
        vm = rmask[:, None] & (cv < V)[None, :]
        off = tok[:, None] * V + cv[None, :]
        eta = tl.load(ETA + off, mask=vm, other=0.)
        g = tl.load(G + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        up = u - g
        M = tl.zeros([SBS, SBS, BV], dtype=tl.float32)
        L = tl.where((j[None, :] < j[:, None])[:, :, None],
                     gram[:, :, None] * tl.exp(tl.minimum(up[:, None, :] - u[None, :, :], 0.)) * eta[None, :, :], 0.)
        for i in range(0, SBS):
            sel = (j == i)[:, None, None]
            Li = tl.sum(tl.where(sel, L, 0.), 0)  # [s, c]
            Mi = tl.where((j == i)[:, None], 1., 0.) - tl.sum(Li[:, None, :] * M, 0)  # [s', c]: row i of M
            M = tl.where(sel, Mi[None, :, :], M)
        tl.store(INV + (tok[:, None, None] * SBS + j[None, :, None]) * V + cv[None, None, :],
                 M.to(INV.dtype.element_ty), mask=vm[:, None, :])


@triton.jit
def _ld_inv(INV, tok, j, cv, vm, V: tl.constexpr, SBS: tl.constexpr):
    """The sub-block's inverse blocks M [SBS (row i), SBS (column s), BV] in fp32, as _pcd_blk_inv stored them for
    the rows tok (vm: their row and column mask)."""
    return tl.load(INV + (tok[:, None, None] * SBS + j[None, :, None]) * V + cv[None, None, :],
                   mask=vm[:, None, :], other=0.).to(tl.float32)


@triton.jit
def _subst_fwd(R, gram, eta, u, up, i, N: tl.constexpr):
    """(I + L) R_new = R for one diagonal block by forward substitution, column-oriented (R_s is final once the
    rows < s are done); L[i, s] = [s < i] gram[i, s] e^{u⁻_i - u_s} η_s per value column; rows i = tl.arange."""
    for s in range(0, N):
        sel = i == s
        r_s = tl.sum(tl.where(sel[:, None], R, 0.), 0)
        u_s = tl.sum(tl.where(sel[:, None], u, 0.), 0)
        e_s = tl.sum(tl.where(sel[:, None], eta, 0.), 0)
        g_s = tl.sum(tl.where(sel[None, :], gram, 0.), 1)  # (x_i·x_s) over i
        coef = tl.where((i > s)[:, None], g_s[:, None] * tl.exp(tl.minimum(up - u_s[None, :], 0.)), 0.)
        R = R - coef * (e_s * r_s)[None, :]
    return R


@triton.jit
def _subst_bwd(d, gram, eta, u, up, i, N: tl.constexpr):
    """(I + L)ᵀ d_new = d for one diagonal block by backward substitution (d_r is final once the rows > r are
    done); L as in _subst_fwd."""
    for rr in range(0, N):
        r = N - 1 - rr
        sel = i == r
        d_r = tl.sum(tl.where(sel[:, None], d, 0.), 0)
        up_r = tl.sum(tl.where(sel[:, None], up, 0.), 0)
        g_r = tl.sum(tl.where(sel[:, None], gram, 0.), 0)  # (x_r·x_s) over s
        coef = tl.where((i < r)[:, None], g_r[:, None] * tl.exp(tl.minimum(up_r[None, :] - u, 0.)) * eta, 0.)
        d = d - coef * d_r[None, :]
    return d


@triton.jit
def _fwd_solve_blocked(X, ETA, G, RR, b, h, n, T, ck, kmask, cv, vmask, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SBS: tl.constexpr,
                       PREC: tl.constexpr, INV, USE_INV: tl.constexpr, PPREC: tl.constexpr):
    """Chunk n's per-column systems (I + L) R = RHS (RHS in RR, overwritten by R) by SBS-row sub-blocks (ours):
    for s in an earlier sub-block and i in sub-block a, L[i, s] = (x_i·x_s) e^{u⁻_i - u_s} η_s factors through the
    sub-block start a0 as e^{u⁻_i - u_{a0}} · (x_i · A) with A = Σ_s x_s (e^{u_{a0} - u_s} η_s R_s)ᵀ, a [K, BV]
    accumulator: the off-diagonal blocks become tensor-core dots, only the diagonal [SBS, SBS] blocks are
    substituted (SBS steps of [SBS, BV] work instead of C steps of [C, BV]), or, USE_INV = 1 (SOLVE="inv",
    "blocked_inv"), solved with their inverses from _pcd_blk_inv (INV [B, T, H, SBS, V]), or, USE_INV = 2
    (SOLVE="fused_inv"), with their inverses formed here (_inv_prod's product, dots at PPREC; no INV tensor). Every
    exponent is a within-sub-block difference <= 0.
    Returns A at the chunk end, Xᵀ (e^{u_C - u} ⊙ η ⊙ R): the state update's increment."""
    j = tl.arange(0, SBS)
    A = tl.zeros([BK, BV], dtype=tl.float32)
    for a in range(0, C // SBS):
        rows, rmask, tok, _ = _chunk_rows(b, h, n, a * SBS + j, T, T, 0, H, C)
        xa = tl.load(X + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
        vm = rmask[:, None] & vmask[None, :]
        off = tok[:, None] * V + cv[None, :]
        ea = tl.load(ETA + off, mask=vm, other=0.)
        ga = tl.load(G + off, mask=vm, other=0.)
        ua = tl.cumsum(ga, 0)
        upa = ua - ga
        gs = tl.sum(ga, 0)
        ra = tl.load(RR + off, mask=vm, other=0.) - tl.exp(upa) * tl.dot(xa, A.to(xa.dtype), input_precision=PREC)
        if USE_INV == 1:  # R_a[i, c] = Σ_s M[i, s, c] rhs[s, c]
            ra = tl.sum(_ld_inv(INV, tok, j, cv, vm, V, SBS) * ra[None, :, :], 1)
        elif USE_INV == 2:  # the same with M [c, i, s] formed here
            M = _inv_prod(tl.dot(xa, tl.trans(xa), input_precision=PREC), tl.trans(ea), tl.trans(ua), tl.trans(upa),
                          j, PPREC)
            ra = tl.trans(tl.sum(M * tl.trans(ra)[:, None, :], 2))
        else:
            ra = _subst_fwd(ra, tl.dot(xa, tl.trans(xa), input_precision=PREC), ea, ua, upa, j, SBS)
        tl.store(RR + off, ra, mask=vm)
        w = ra * ea * tl.exp(tl.minimum(gs[None, :] - ua, 0.))
        A = A * tl.exp(gs)[None, :] + tl.dot(tl.trans(xa), w.to(xa.dtype), input_precision=PREC)
    return A


@triton.jit
def _bwd_solve_blocked(X, ETA, G, DRHS, b, h, n, T, ck, kmask, cv, vmask, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SBS: tl.constexpr,
                       PREC: tl.constexpr, F32DOT: tl.constexpr, INV, USE_INV: tl.constexpr, PPREC: tl.constexpr):
    """The transposed solve (I + L)ᵀ drhs = d of chunk n (d in DRHS, overwritten by drhs) by SBS-row sub-blocks,
    last first (ours): for s in sub-block a and i in a later one, L[i, s] drhs_i = η_s e^{u_{a1} - u_s} (x_s · Gc)
    with a1 the sub-block's last row and Gc = Σ_i x_i (e^{u⁻_i - u_{a1}} drhs_i)ᵀ, a [K, BV] accumulator.
    Returns Gc at the chunk start, Xᵀ (e^{u⁻} ⊙ drhs): minus the solve's right-hand side's part of dH.
    F32DOT: the key tile cast to fp32 first, so every dot here runs on fp32 operands (at PREC). USE_INV: the diagonal
    block's transposed system solved as drhs_s = Σ_i M[i, s] d_i with M from _pcd_blk_inv (INV, USE_INV = 1) or formed
    here (_inv_prod, USE_INV = 2), not substituted."""
    j = tl.arange(0, SBS)
    Gc = tl.zeros([BK, BV], dtype=tl.float32)
    NB: tl.constexpr = C // SBS
    for aa in range(0, NB):
        a = NB - 1 - aa
        rows, rmask, tok, _ = _chunk_rows(b, h, n, a * SBS + j, T, T, 0, H, C)
        xa = tl.load(X + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
        if F32DOT:
            xa = xa.to(tl.float32)
        vm = rmask[:, None] & vmask[None, :]
        off = tok[:, None] * V + cv[None, :]
        ea = tl.load(ETA + off, mask=vm, other=0.)
        ga = tl.load(G + off, mask=vm, other=0.)
        ua = tl.cumsum(ga, 0)
        upa = ua - ga
        gs = tl.sum(ga, 0)
        da = tl.load(DRHS + off, mask=vm, other=0.) \
            - ea * tl.exp(tl.minimum(gs[None, :] - ua, 0.)) * tl.dot(xa, Gc.to(xa.dtype), input_precision=PREC)
        if USE_INV == 1:  # drhs[s, c] = Σ_i M[i, s, c] d[i, c]
            da = tl.sum(_ld_inv(INV, tok, j, cv, vm, V, SBS) * da[:, None, :], 0)
        elif USE_INV == 2:  # the same with M [c, i, s] formed here
            M = _inv_prod(tl.dot(xa, tl.trans(xa), input_precision=PREC), tl.trans(ea), tl.trans(ua), tl.trans(upa),
                          j, PPREC)
            da = tl.trans(tl.sum(M * tl.trans(da)[:, :, None], 1))
        else:
            da = _subst_bwd(da, tl.dot(xa, tl.trans(xa), input_precision=PREC), ea, ua, upa, j, SBS)
        tl.store(DRHS + off, da, mask=vm)
        Gc = Gc * tl.exp(gs)[None, :] + tl.dot(tl.trans(xa), (tl.exp(upa) * da).to(xa.dtype), input_precision=PREC)
    return Gc


@triton.jit
def _pcd_bwd_solve_blk(X, ETA, G, RR, DRHS, SUP, SU, DX32, DV, DETA, T, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                       CU, CIDX, COFF, VARLEN: tl.constexpr):
    """Pass 1 of _pcd_bwd_solve by 16-row sub-blocks (ours, FALCON_TRITON_2_SOLVE=blocked): program (chunk·NB + a,
    b·H + h) owns the rows of sub-block a. With E[i, s] = e^{u⁻_i - u_s} (s < i), ηR = η ⊙ R and gram = X Xᵀ:
    P1_i = Σ_s gram E ηR_s, P2_s = Σ_i gram E d_i, dgram[i, s] = -Σ_c d_i E ηR_s; then SUP = -d ⊙ P1, SU = ηR ⊙ P2,
    dη += -R ⊙ P2, dv = d and dX += (dgram + dgramᵀ) X for its rows. The diagonal [16, 16] block is the exact
    broadcast; against earlier rows s (ρ the log-prefix before the block) E = e^{u⁻_i - ρ} e^{ρ - u_s}, against later
    rows i (ρ' the prefix at the block's end) E = e^{u⁻_i - ρ'} e^{ρ' - u_s}: tensor-core dots, every exponent <= 0.
    _pcd_bwd_solve then runs only its pass 2 (the right-hand side's terms and d log γ, which scan the chunk)."""
    NB: tl.constexpr = C // 16
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    n = pid // NB
    a = pid % NB
    b = bh // H
    h = bh % H
    if VARLEN:
        _s, n, bos, T, _c = _varlen_chunk(CU, CIDX, COFF, n)
        X += bos * H * K
        ETA += bos * H * V
        G += bos * H * V
        RR += bos * H * V
        DRHS += bos * H * V
        SUP += bos * H * V
        SU += bos * H * V
        DX32 += bos * H * K
        DV += bos * H * V
        DETA += bos * H * V
    i = tl.arange(0, C)
    j = tl.arange(0, 16)
    rows, rmask, tok, _ = _chunk_rows(b, h, n, i, T, T, 0, H, C)
    _r, ma, ta, _x = _chunk_rows(b, h, n * NB + a, j, T, T, 0, H, 16)
    ck = tl.arange(0, BK)
    kmask = ck < K
    x = tl.load(X + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
    dt = x.dtype
    xa = tl.load(X + ta[:, None] * K + ck[None, :], mask=ma[:, None] & kmask[None, :], other=0.)
    before = i < a * 16
    after = i >= a * 16 + 16
    strict = j[:, None] > j[None, :]
    grow = tl.dot(xa, tl.trans(x), input_precision=PREC)  # [16, C]: x_a · x_s (gram is symmetric)
    gaa = tl.where(strict, tl.dot(xa, tl.trans(xa), input_precision=PREC), 0.)
    g_bef = tl.where(before[None, :], grow, 0.).to(dt)
    g_aft = tl.where(after[None, :], grow, 0.).to(dt)
    dg_row = tl.zeros([16, C], dtype=tl.float32)  # dgram[i in a, s before a]
    dg_col = tl.zeros([16, C], dtype=tl.float32)  # dgram[i after a, s in a], as [s, i]
    dg_aa = tl.zeros([16, 16], dtype=tl.float32)
    for vb in range(0, tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        vmask = cv < V
        vm = rmask[:, None] & vmask[None, :]
        va = ma[:, None] & vmask[None, :]
        off = tok[:, None] * V + cv[None, :]
        offa = ta[:, None] * V + cv[None, :]
        g = tl.load(G + off, mask=vm, other=0.)
        u = tl.cumsum(g, 0)
        up = u - g
        eR = tl.load(ETA + off, mask=vm, other=0.) * tl.load(RR + off, mask=vm, other=0.)
        d = tl.load(DRHS + off, mask=vm, other=0.)
        rho = tl.sum(tl.where(before[:, None], g, 0.), 0)
        rho_e = tl.sum(tl.where(after[:, None], 0., g), 0)
        ga = tl.load(G + offa, mask=va, other=0.)
        ea = tl.load(ETA + offa, mask=va, other=0.)
        Ra = tl.load(RR + offa, mask=va, other=0.)
        da = tl.load(DRHS + offa, mask=va, other=0.)
        ua = tl.cumsum(ga, 0) + rho[None, :]
        upa = ua - ga
        eRa = ea * Ra
        E = tl.where(strict[:, :, None], tl.exp(tl.minimum(upa[:, None, :] - ua[None, :, :], 0.)), 0.)
        GE = gaa[:, :, None] * E
        p1 = tl.sum(GE * eRa[None, :, :], 1)  # [16 (i), BV]
        p2 = tl.sum(GE * da[:, None, :], 0)  # [16 (s), BV]
        dg_aa -= tl.sum(E * da[:, None, :] * eRa[None, :, :], 2)
        w1 = tl.where(before[:, None], tl.exp(tl.minimum(rho[None, :] - u, 0.)) * eR, 0.)
        w2 = tl.where(after[:, None], tl.exp(tl.minimum(up - rho_e[None, :], 0.)) * d, 0.)
        da_l = da * tl.exp(tl.minimum(upa - rho[None, :], 0.))
        eRa_r = eRa * tl.exp(tl.minimum(rho_e[None, :] - ua, 0.))
        p1 += tl.exp(tl.minimum(upa - rho[None, :], 0.)) * tl.dot(g_bef, w1.to(dt), input_precision=PREC)
        p2 += tl.exp(tl.minimum(rho_e[None, :] - ua, 0.)) * tl.dot(g_aft, w2.to(dt), input_precision=PREC)
        dg_row -= tl.dot(da_l.to(dt), tl.trans(w1.to(dt)), input_precision=PREC)
        dg_col -= tl.dot(eRa_r.to(dt), tl.trans(w2.to(dt)), input_precision=PREC)
        tl.store(DETA + offa, tl.load(DETA + offa, mask=va, other=0.) - Ra * p2, mask=va)
        tl.store(SUP + offa, -da * p1, mask=va)
        tl.store(SU + offa, eRa * p2, mask=va)
        tl.store(DV + offa, da.to(DV.dtype.element_ty), mask=va)
    dx = tl.dot((dg_row + dg_col).to(dt), x, input_precision=PREC) \
        + tl.dot((dg_aa + tl.trans(dg_aa)).to(dt), xa, input_precision=PREC)
    dxo = ta[:, None] * K + ck[None, :]
    km = ma[:, None] & kmask[None, :]
    tl.store(DX32 + dxo, tl.load(DX32 + dxo, mask=km, other=0.) + dx, mask=km)


def _check_layout(**named):
    """The kernels index every tensor as a dense row-major block of the shape given here (token rows
    (b*T + t)*H + h times K or V; states (b*H + h)*K*V; per-chunk states ((b*H + h)*NT + n)*K*V), with
    masks only for the tile padding (rows >= T, columns >= K or V). Every load/store is in bounds
    exactly when each tensor holds at least that many elements in that layout: refuse anything else
    rather than read or write past it (issue 15)."""
    for name, (t, shape) in named.items():
        if t is None:
            continue
        if tuple(t.shape) != tuple(shape) or not t.is_contiguous():
            raise ValueError(f"Falcon-2 Triton kernels: {name} must be a contiguous {tuple(shape)} tensor, got "
                             f"shape {tuple(t.shape)}, strides {t.stride()}")


def _pprec(prec: str) -> str:
    """The product-form inverses' dot precision (_inv_prod): tf32 for 16-bit inputs (whose dots run at "tf32"), IEEE
    fp32 FMA for fp32 inputs."""
    return "tf32" if prec == "tf32" else "ieee"


def block_inverses(x, eta, g, NT, C, BK, prec, va, st):
    """SOLVE="inv" / "blocked_inv": every 16-row sub-block's per-column inverse (I + L_aa)^{-1}, [B, T, H, 16, V] in
    A's dtype (_pcd_blk_inv), over NT chunks (slots, for packed sequences)."""
    B, T, H, K = x.shape
    V = eta.shape[-1]
    INV = torch.empty(B, T, H, 16, V, dtype=a_dtype(x.dtype), device=x.device)
    prod = INV_FORM == "prod"
    BVi = min(INV_BV if prod else 32, _np2(V))
    _pcd_blk_inv[(NT * (C // 16), B * H, cdiv(V, BVi))](x, eta, g, INV, T, H, K, V, C, BK, BVi, 16, prec, *va,
                                                       prod, _pprec(prec), num_warps=int(INV_WARPS), **st)
    return INV


def percol_delta_forward(q, x, v, eta, g, S0, *, read_after, C, allow_tf32, cu_seqlens=None):
    """Falcon-2 core forward (per-column γ, η; regression; window 1) -> (O, S_T, saved for backward). cu_seqlens
    (B = 1): the packed sequences run natively (chunk.chunk_forward's convention)."""
    B, T, H, K, V, NT, BK, BVs, BVo, BVm, wm, prec, st, dev = launch(q, v.shape[-1], C, allow_tf32)
    va, NT, NS = varlen_args(cu_seqlens, q, T, C, NT, B)
    # bounds precondition of every pointer below (window 1: x and v have T rows, not T + W - 1)
    _check_layout(q=(q, (B, T, H, K)), x=(x, (B, T, H, K)), v=(v, (B, T, H, V)), eta=(eta, (B, T, H, V)),
                  g=(g, (B, T, H, V)), S0=(S0, (NS, H, K, V)))
    f32 = torch.float32
    HS = torch.empty(B, H, NT, K, V, dtype=f32, device=dev)
    RR = torch.empty(B, T, H, V, dtype=f32, device=dev)
    ST = _empty((NS, H, K, V), f32, dev)
    inv = SOLVE in ("inv", "blocked_inv")
    # with the inverses, value tiles of at most 32 columns: the applied inverse block is [16, 16, BV] fp32 (offline,
    # sm_90a, 4 warps: at K = 64 with the pass's 64 columns the stack grew 392 -> 576 bytes; with 32, none)
    BVs = min(BVs, 32) if inv else min(BVs, FUSED_BV) if SOLVE == "fused_inv" else BVs
    fargs = (x, v, eta, g, S0 if S0 is not None else eta, HS, RR, ST, T, NT, H, K, V, C, BK, BVs, S0 is not None,
             prec, *va)
    pprec = _pprec(prec)
    if inv:
        INV = block_inverses(x, eta, g, NT, C, BK, prec, va, st)
        _pcd_fwd_state_blk[(cdiv(V, BVs), NS * H)](*fargs, 16, INV, 1, pprec, **st)
    elif SOLVE == "fused_inv":
        _pcd_fwd_state_blk[(cdiv(V, BVs), NS * H)](*fargs, 16, eta, 2, pprec, **st)
    elif SOLVE in ("fwd", "blocked") and C > 16:
        _pcd_fwd_state_blk[(cdiv(V, BVs), NS * H)](*fargs, 16, eta, 0, pprec, **st)
    else:
        _pcd_fwd_state[(cdiv(V, BVs), NS * H)](*fargs, **st)
    O = fwd_out(q, x, RR, eta, g, HS, T, NT, H, K, V, C, BK, BVo, read_after, prec, va, st)
    # the block inverses for the backward (INV_KEEP="save"), or an empty stand-in: the saved list keeps one arity
    kept = INV if keeps_inv() else torch.empty(0, dtype=f32, device=dev)
    return O, ST, (HS, RR, kept)


def percol_delta_backward(q, x, v, eta, g, saved, dO, dST, *, read_after, C, allow_tf32, need_ds0,
                          cu_seqlens=None):
    """Falcon-2 core backward -> (dq, dx, dv, deta, dg, dS0 or None). saved: (HS, RR, the forward's block inverses
    or an empty tensor)."""
    HS, RR, kept = saved
    v_dtype = v.dtype
    B, T, H, K, V, NT, BK, BVs, BVo, BVm, wm, prec, st, dev = launch(q, RR.shape[-1], C, allow_tf32)
    va, NT, NS = varlen_args(cu_seqlens, q, T, C, NT, B)
    f32 = torch.float32
    if dO is None:
        dO = torch.zeros(B, T, H, V, dtype=q.dtype, device=dev)
    dO = dO.contiguous()
    dST = dST.contiguous().float() if dST is not None else None
    # bounds precondition of every pointer below, the saved HS / RR included
    _check_layout(q=(q, (B, T, H, K)), x=(x, (B, T, H, K)), v=(v, (B, T, H, V)), eta=(eta, (B, T, H, V)),
                  g=(g, (B, T, H, V)), HS=(HS, (B, H, NT, K, V)), RR=(RR, (B, T, H, V)), dO=(dO, (B, T, H, V)),
                  dST=(dST, (NS, H, K, V)))
    DUI = torch.empty(B, T, H, V, dtype=f32, device=dev)
    _pcd_bwd_dui[(NT, B * H)](q, x, g, dO, DUI, T, H, K, V, C, BK, SB, read_after, prec, *va, num_warps=8, **st)
    DHS = torch.empty(B, H, NT, K, V, dtype=f32, device=dev)
    DSU = torch.empty(B, T, H, V, dtype=f32, device=dev)
    DRHS = torch.empty(B, T, H, V, dtype=f32, device=dev)
    DS0 = _empty((NS, H, K, V), f32, dev) if need_ds0 else None
    # num_warps=8 like the other backward launches here (issue 15). At Triton's default of 4 warps this kernel crashed
    # on the H200 (Triton 3.6) in bf16 with BK = 128, C = 64, dST and dS0: compute-sanitizer memcheck reported
    # "out-of-range shared or local address" at the dH update (its two tl.dot), i.e. inside the compiled
    # kernel, not in our pointers. The same row passed at 8 warps, with fp32 q/x and with C = 32
    # (benchmarks/results/h200_logs/falcon2_crash_2026-12-02b/). The 8-warp launch is the candidate fix, not
    # yet proven by the full `bench check --variants 2` sweep on the GPU.
    # fp32 value tiles of at least 32 columns here (ours, a candidate, NOT yet run on the GPU): the one fp32 row that
    # fails on the H200 (K = V = 16, C = 64: every gradient from this kernel 1e-4 off, 2026-12-02) is the only build
    # with wgmma m64n8k8 instructions (Triton 3.6); with BV = 32 it compiles to the m64n16k8 / m64n32k8 / mma.sync
    # mix of the builds that pass (experiments/h200/pcd_offline_compile.py). Masked columns cost nothing in bounds.
    BVb = max(BVs, 32) if q.dtype == torch.float32 else BVs
    rev_inv = SOLVE in ("blocked_inv", "fused_inv")  # the reverse pass by sub-blocks with the diagonal blocks' inverses
    rev_blk = rev_inv or (SOLVE == "blocked" and C > 16)
    if rev_blk:
        if BLK_BWD != PROVEN_BLK_BWD:  # other launches of the reverse pass by sub-blocks: 16-bit dots failed there
            refuse_unproven(dev, f"FALCON_TRITON_2_SOLVE={SOLVE} with FALCON_TRITON_2_BLK_BWD other than '4,0,x32'",
                            "'4,0,x32'")
        BVb = BLK_BWD[1] or BVb
        if rev_inv:
            BVb = min(BVb, 32)  # the [16, 16, BV] fp32 inverse block, as in the forward
        if SOLVE == "fused_inv":
            BVb = min(BVb, FUSED_BV)
    bargs = (q, x, eta, g, dO, DUI, dST if dST is not None else eta, DHS, DSU, DRHS, DS0 if DS0 is not None else eta,
             T, NT, H, K, V, C, BK, BVb, read_after, dST is not None, need_ds0, prec, *va)
    if rev_blk:
        if not rev_inv or SOLVE == "fused_inv":
            INV = eta
        elif kept.numel():  # the forward's (INV_KEEP="save")
            _check_layout(INV=(kept, (B, T, H, 16, V)))
            INV = kept
        else:
            INV = block_inverses(x, eta, g, NT, C, BK, prec, va, st)
        _pcd_bwd_state_blk[(cdiv(V, BVb), NS * H)](*bargs, 16, BLK_BWD[2], _prec(torch.float32, allow_tf32, dev, K, V),
                                                   INV, 2 if SOLVE == "fused_inv" else int(rev_inv), _pprec(prec),
                                                   num_warps=BLK_BWD[0],
                                                   **({**st, "num_stages": 1} if BLK_BWD[3] else st))
        del INV
    else:
        _pcd_bwd_state[(cdiv(V, BVb), NS * H)](*bargs, num_warps=8, **st)
    # Falcon-2A's backward with R as the values: dq (final), the read-out and state-update parts of
    # dx, dη and d log γ. Its "dv" is η ⊙ dU, already used above: written over the spent DUI.
    DGR = torch.empty(B, T, H, V, dtype=f32, device=dev)
    DGU = torch.empty(B, T, H, V, dtype=f32, device=dev)
    dq = _empty(q.shape, q.dtype, dev)
    dx32 = _empty(x.shape, f32, dev)
    deta = _empty(eta.shape, eta.dtype, dev)
    dg = _empty(g.shape, g.dtype, dev)
    bwd_intra_main(q, x, RR, eta, g, HS, DHS, dO, DSU, DGR, DGU, dq, dx32, DUI, deta, dg, T, NT, H, K, V, C, BK, BVm,
                   read_after, prec, va, st)
    dx = _empty(x.shape, x.dtype, dev)
    dv = _empty((B, T, H, V), v_dtype, dev)
    blk = BWD_SOLVE == "blocked" and C > 16
    if blk:
        _pcd_bwd_solve_blk[(NT * (C // 16), B * H)](x, eta, g, RR, DRHS, DGR, DGU, dx32, dv, deta, T, H, K, V, C,
                                                    BK, min(int(SOLVE_BLK_BV), BVm), prec, *va,
                                                    num_warps=int(SOLVE_BLK_WARPS), **st)
    _pcd_bwd_solve[(NT, B * H)](x, eta, g, HS, RR, DRHS, DGR, DGU, dx32, dx, dv, deta, dg, T, NT, H, K, V,
                                C, BK, BVm, SB, prec, *va, not blk, num_warps=8, **st)
    return dq, dx, dv, deta, dg, DS0
