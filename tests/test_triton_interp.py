"""backend="triton" kernels under the Triton interpreter (TRITON_INTERPRET=1) against a float64 loop.

Triton reads TRITON_INTERPRET when it is imported, and other tests of this pytest process may have
imported it already, so the cases run in ONE subprocess with the variable set (tests/triton_interp_cases.py)
and each case is checked here. Tiny sizes; fp32 and fp16 only (bf16 arithmetic is wrong in the
interpreter, platform-notes.md).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from interp_helpers import import_many_with, run_interp_cases

HERE = Path(__file__).resolve().parent


def _c(id, **kw):
    base = dict(B=2, T=37, H=2, K=16, V=32, W=1, delta=True, after=True, C=16, dtype="float32", seed=1)
    base.update(kw)
    base["id"] = id
    return base


CASES = []
for delta in (True, False):
    v = "F1" if delta else "F1A"
    for after in (True, False):
        CASES.append(_c(f"{v}-{'after' if after else 'before'}-C16", delta=delta, after=after))
    CASES.append(_c(f"{v}-C32-K48-V16", delta=delta, C=32, T=70, K=48, V=16, B=1, seed=2))
    CASES.append(_c(f"{v}-C64-T65", delta=delta, C=64, T=65, B=1, H=1, K=32, V=32, seed=3, state_bv="off"))
    CASES.append(_c(f"{v}-strong-decay-C64", delta=delta, C=64, T=64, B=1, H=1, strong=True, seed=4))
    CASES.append(_c(f"{v}-no-S0-no-dST", delta=delta, s0=False, no_dst=True, seed=5))
    CASES.append(_c(f"{v}-fp16", delta=delta, dtype="float16", seed=6))
# A's storage (ours): the cases above store it in the inputs' dtype (FALCON_TRITON_A_DTYPE=input, the default; Falcon-3
# in place too since 2026-12-03's fifteenth session); here Falcon-1 in fp16 on F1-fp16's inputs with A in fp32
# (=fp32, the opt-out: a store rounds as the readers' cast does, so the same errors), Falcon-3's expansion in fp16 at
# C = 64 with =input
CASES.append(_c("F1-fp16-a-fp32", delta=True, dtype="float16", seed=6, a_dtype="fp32"))
CASES.append(_c("F3-W4-fp16-C64-a-input", delta=True, W=4, C=64, T=40, B=1, H=1, K=32, V=16, dtype="float16", seed=12,
                a_dtype="input", fused=False))
# Falcon-3A as W Falcon-1A scans (fused_window=False: what FALCON_TRITON_3A=scans and every packed call run)
CASES.append(_c("F3A-W3-after-no-dST", delta=False, W=3, no_dst=True, seed=7, fused=False))
CASES.append(_c("F3A-W4-before-C32", delta=False, W=4, after=False, C=32, T=45, seed=8, fused=False))
# Falcon-3A in one banded scan (window_linear.py, fused_window=True, the cases pin FALCON_TRITON_3A=banded; the default
# 2026-12-03 to 2026-12-04, packed calls' still): windows 2-16, every chunk size, awkward T
CASES.append(_c("F3A-banded-W3-after", delta=False, W=3, seed=7, fused=True))
CASES.append(_c("F3A-banded-W4-before-C32", delta=False, W=4, after=False, C=32, T=45, seed=8, fused=True))
CASES.append(_c("F3A-banded-W8-strong-decay", delta=False, W=8, T=50, strong=True, seed=24, fused=True))
CASES.append(_c("F3A-banded-W16-C32-no-S0-no-dST", delta=False, W=16, C=32, T=40, B=1, H=1, K=48, V=16, s0=False,
                no_dst=True, seed=25, fused=True))
CASES.append(_c("F3A-banded-W3-C64-T65", delta=False, W=3, C=64, T=65, B=1, H=1, K=16, V=16, seed=27, fused=True))
CASES.append(_c("F3A-banded-W2-fp16", delta=False, W=2, dtype="float16", seed=26, fused=True))
CASES.append(_c("F3A-banded-K16-V80-two-value-blocks", delta=False, W=4, T=40, B=1, H=1, K=16, V=80, seed=31,
                fused=True))
# the banded scan's backward (its read-out row sum off the dq accumulator, ours): W = 8 with strong decay and several
# value blocks, fp16 with the read order before (the forms it replaced, FALCON_TRITON_3A_BWD=dots / split, and their
# cases are gone since 2026-12-03)
WL_MORE = [("W8-C64-K48-V80-strong-decay", dict(W=8, C=64, T=70, B=1, H=1, K=48, V=80, strong=True)), (
    "W2-before-fp16", dict(W=2, after=False, dtype="float16"))]
CASES += [_c(f"F3A-banded-{n}", delta=False, seed=131 + i, fused=True, **kw) for i, (n, kw) in enumerate(WL_MORE)]
# ... and its value block (FALCON_TRITON_3A_BWD_BV, default 32, ours) at 16 and at 64 (the forward's at K <= 64, the
# value block of the kernel proven before): several blocks, a masked rest
CASES.append(_c("F3A-banded-bv16-W4-K48-V80", delta=False, W=4, T=40, B=1, H=1, K=48, V=80, seed=140,
                fused=True, wl_bwd_bv="16"))
CASES.append(_c("F3A-banded-bv64-W3-before-C64-K16-V80", delta=False, W=3, after=False, C=64, T=65, B=1, H=1,
                K=16, V=80, seed=141, fused=True, wl_bwd_bv="64"))
# ... and its forward state pass's weights m_o, m_c by shifted loads (wl_weights="shifted": FALCON_TRITON_3A_WEIGHTS=
# shifted, the opt-out since band sums became the default on 2026-12-04; every other banded case runs the band):
# W = 2 / 3 / 4 / 8 / 16, both read orders, every chunk size, awkward T (rows past T
# inside the last chunk), strong decay, fp16, several value blocks
WL_BAND = [("W4-before-C32", dict(W=4, after=False, C=32, T=45)),
           ("W16-C32-no-S0-no-dST", dict(W=16, C=32, T=40, B=1, H=1, K=48, V=16, s0=False, no_dst=True)),
           ("W3-C64-T65-K16-V80", dict(W=3, C=64, T=65, B=1, H=1, K=16, V=80)),
           ("W8-C16-strong-decay", dict(W=8, C=16, T=50, strong=True)),
           ("W2-fp16", dict(W=2, dtype="float16"))]
CASES += [_c(f"F3A-shifted-{n}", delta=False, seed=150 + i, fused=True, wl_weights="shifted", **kw)
          for i, (n, kw) in enumerate(WL_BAND)]
# Falcon-3A as one Falcon-1A scan of completed pair weights plus a band (delayed=True: FALCON_TRITON_3A=delayed,
# window_delayed.py, ours): both read orders, W = 2 / 4 / 16 (W > T), every chunk size, strong decay, fp16, no S0 /
# no dS_T, K != V with masked tiles
WD = [("W4-after-C16", dict(W=4)),
      ("W4-before-C32-T45", dict(W=4, after=False, C=32, T=45)),
      ("W16-C64-T12-no-S0-no-dST", dict(W=16, C=64, T=12, B=1, H=1, K=48, V=16, s0=False, no_dst=True)),
      ("W8-strong-decay-K48-V80", dict(W=8, T=50, B=1, H=1, K=48, V=80, strong=True)),
      ("W2-before-fp16", dict(W=2, after=False, dtype="float16"))]
CASES += [_c(f"F3A-delayed-{n}", delta=False, seed=160 + i, fused=True, delayed=True, **kw)
          for i, (n, kw) in enumerate(WD)]
# The linear state passes split over key tiles (ksplit: FALCON_TRITON_LINEAR_KSPLIT=on, ours; "scalar", chunk.py's only,
# the default since 2026-12-04, twenty-first session; here with the smallest key tile
# lowered to 16 so that K = 32 / 48 split in two / three and K = 80 in five with a masked rest): Falcon-1A both read
# orders, several value blocks, no S0 / no dS_T, strong decay, fp16; Falcon-3A's delayed form (its Falcon-1A scan
# with xoff = 0) and its W scans (xoff > 0)
KS = [("F1A-after-K32", dict(delta=False, K=32)),
      ("F1A-before-C32-K48-V80", dict(delta=False, after=False, C=32, T=70, K=48, V=80, B=1)),
      ("F1A-C64-T65-K80-no-S0-no-dST", dict(delta=False, C=64, T=65, B=1, H=1, K=80, V=32, s0=False, no_dst=True)),
      ("F1A-strong-decay-K32", dict(delta=False, C=64, T=64, B=1, H=1, K=32, strong=True)),
      ("F1A-fp16-K32", dict(delta=False, K=32, dtype="float16")),
      ("F3A-delayed-W4-K32", dict(delta=False, W=4, K=32, fused=True, delayed=True)),
      ("F3A-scans-W3-before-K48", dict(delta=False, W=3, K=48, after=False, C=32, T=45, fused=False)),
      # Falcon-2A's state passes (percol.py: _pc_bwd_cols stores DU fresh, _pc_bwd_main adds its state part): both
      # read orders, several value blocks with a masked rest, strong decay with no S0 / dS_T, fp16, the broadcast
      # diagonal blocks; and a Falcon-2 case (its own state passes never split; the shared kernels as before)
      ("F2A-after-K32", dict(delta=False, per_col=True, K=32)),
      ("F2A-before-C32-K48-V80", dict(delta=False, per_col=True, after=False, C=32, T=45, B=1, K=48, V=80)),
      ("F2A-C64-strong-decay-no-S0-no-dST-K32", dict(delta=False, per_col=True, C=64, T=70, B=1, H=1, K=32, V=16,
                                                     strong=True, s0=False, no_dst=True)),
      ("F2A-fp16-C64-K32", dict(delta=False, per_col=True, C=64, T=70, B=1, K=32, dtype="float16")),
      ("F2A-broadcast-K32", dict(delta=False, per_col=True, K=32, diag="broadcast"))]
CASES += [_c(f"ksplit-{n}", seed=190 + i, ksplit=True, **kw) for i, (n, kw) in enumerate(KS)]
CASES.append(_c("ksplit-F2-C32-K32-unsplit", delta=True, per_col=True, C=32, T=45, B=1, K=32, seed=205, ksplit=True,
                ksplit_none=True))
# _fwd_prep's diagonal-block inverses: the product of dots (FALCON_TRITON_A_INV=prod, ours, truncated at L's
# nilpotency index 16 / W) is the default since 2026-12-05 and runs in every delta case above; these keep the
# substitution (a_inv="subst", the former default) covered: Falcon-1 with one, two and four blocks a chunk, fp16,
# strong decay; Falcon-3 in place at W = 2, 4, 8 and on its host expansion
AINV = [("F1-C64-T65", dict(delta=True, C=64, T=65, B=1, H=1, K=32, V=32)),
        ("F1-fp16-C32-before", dict(delta=True, C=32, T=45, after=False, dtype="float16")),
        ("F1-strong-decay-C64", dict(delta=True, C=64, T=64, B=1, H=1, strong=True)),
        ("F3-gather-W4-C64", dict(delta=True, W=4, C=64, T=40, B=1, H=2, K=32, V=16, fused=True)),
        ("F3-gather-W2-before-C32-strong-decay", dict(delta=True, W=2, after=False, C=32, T=45, B=1, K=16, V=16,
                                                      strong=True, fused=True)),
        ("F3-gather-W8-fp16", dict(delta=True, W=8, T=12, K=16, V=16, dtype="float16", fused=True)),
        ("F3-expand-W4", dict(delta=True, W=4, T=23, fused=False))]
CASES += [_c(f"ainv-subst-{n}", a_inv="subst", seed=230 + i, **kw) for i, (n, kw) in enumerate(AINV)]
# the backward's dU buffer: in the inputs' dtype (FALCON_TRITON_DU_DTYPE=input, ours, as fla keeps its dv) by
# default since 2026-12-05; these keep fp32 (du_dtype="fp32", the former default) covered at fp16, where the two
# differ: Falcon-1 and -1A both read orders, Falcon-3 in place, Falcon-3A's delayed form, the key-split pass
DUD = [("F1-fp16-C64", dict(delta=True, C=64, T=65, B=1, H=1, K=32, V=32)),
       ("F1A-fp16-before-C32", dict(delta=False, C=32, T=45, after=False)),
       ("F3-gather-W4-fp16-C64", dict(delta=True, W=4, C=64, T=40, B=1, H=2, K=32, V=16, fused=True)),
       ("F3A-delayed-W4-fp16", dict(delta=False, W=4, fused=True, delayed=True)),
       ("F1A-fp16-ksplit-K32", dict(delta=False, K=32, ksplit=True))]
CASES += [_c(f"du-fp32-{n}", du_dtype="fp32", dtype="float16", seed=240 + i, **kw) for i, (n, kw) in enumerate(DUD)]
# the linear state passes split along the sequence (split=L: FALCON_TRITON_LINEAR_SPLIT=on with pieces of L chunks
# instead of 32, ours, opt-in and unproven; state_split.py): Falcon-1A both read orders, pieces of one and two chunks
# with a short last piece, the key split too (K = 48 in tiles of 16, a masked value tile), strong decay, no S0 / dS_T,
# fp16; Falcon-3A's delayed form and its W scans (pair stream read at an offset); Falcon-2A's per-column passes;
# `split_off` 0 when every pass split; Falcon-1 (delta) and a packed call, which must not split (`split_on` 0)
SPLIT = [("F1A-after-L1", dict(delta=False, split=1)),
         ("F1A-before-C16-T70-L2", dict(delta=False, after=False, T=70, B=1, split=2)),
         ("F1A-C32-K48-V80-ksplit-L2", dict(delta=False, C=32, T=70, B=1, K=48, V=80, ksplit=True, split=2)),
         ("F1A-strong-decay-no-S0-no-dST-L1", dict(delta=False, C=16, T=64, B=1, H=1, K=32, strong=True, s0=False,
                                                   no_dst=True, split=1)),
         ("F1A-fp16-L1", dict(delta=False, dtype="float16", split=1)),
         ("F3A-delayed-W4-L1", dict(delta=False, W=4, fused=True, delayed=True, split=1)),
         ("F3A-scans-W3-before-L2", dict(delta=False, W=3, after=False, T=70, B=1, fused=False, scans=True, split=2)),
         ("F1-unsplit", dict(delta=True, split=1, split_none=True)),
         # Falcon-2A (percol.py: the decays per value column; DU's state part then in _pc_bwd_main)
         ("F2A-after-L1", dict(delta=False, per_col=True, split=1)),
         ("F2A-before-C32-K48-V80-ksplit-L2", dict(delta=False, per_col=True, after=False, C=32, T=70, B=1, K=48,
                                                   V=80, ksplit=True, split=2)),
         ("F2A-C16-strong-decay-no-S0-no-dST-L1", dict(delta=False, per_col=True, T=64, B=1, H=1, K=32, V=16,
                                                       strong=True, s0=False, no_dst=True, split=1)),
         ("F2A-fp16-C32-L1", dict(delta=False, per_col=True, C=32, T=100, B=1, dtype="float16", split=1))]
CASES += [_c(f"seqsplit-{n}", seed=260 + i, **kw) for i, (n, kw) in enumerate(SPLIT)]
# the delta rule's state passes split along the sequence (dsplit=L: FALCON_TRITON_DELTA_SPLIT=on with pieces of L
# chunks instead of 32, ours, opt-in and unproven; delta_split.py: pieces as a batch, each piece's transition as K
# identity columns, a carry over the pieces, then the proven passes per piece): Falcon-1 both read orders, pieces of
# one and two chunks, masked key and value tiles (K = 48, V = 80: the transition's columns in tiles of the value
# tile), no S0 / dS_T, fp16 with strong decay; Falcon-3 in place (its pair stream copied per piece with W - 1 rows of
# overlap; B = 1 too, where a reshape alone returned the overlapping view itself), fp16 before, no dS_T;
# `dsplit_off` 0 when every call split; calls it must leave whole (`dsplit_on` 0): T not a multiple of the chunk
# (Falcon-1 and -3), Falcon-1A (the linear rule)
DSPLIT = [("F1-after-L1", dict(T=64, dsplit=1)),
          ("F1-before-C32-K48-V80-L2", dict(after=False, C=32, T=128, B=1, K=48, V=80, dsplit=2)),
          ("F1-no-S0-no-dST-L1", dict(T=48, B=1, s0=False, no_dst=True, dsplit=1)),
          ("F1-fp16-strong-decay-C32-L1", dict(C=32, T=64, B=1, dtype="float16", strong=True, dsplit=1)),
          ("F3-W4-L1", dict(W=4, T=16, dsplit=1)),
          ("F3-W2-before-fp16-no-dST-C32-L2", dict(W=2, after=False, C=32, T=64, B=1, K=32, dtype="float16",
                                                    no_dst=True, dsplit=2)),
          ("F1-T37-unsplit", dict(dsplit=1, dsplit_none=True)),
          ("F3-W4-T17-unsplit", dict(W=4, T=17, B=1, dsplit=1, dsplit_none=True)),
          ("F1A-unsplit", dict(delta=False, T=64, dsplit=1, dsplit_none=True))]
CASES += [_c(f"dsplit-{n}", seed=300 + i, **kw) for i, (n, kw) in enumerate(DSPLIT)]
# Falcon-3 in place with the step-only terms on the chunk's steps (step_rows="on": FALCON_TRITON_3_STEP_ROWS=on, ours;
# chunk.py _srows; read-before is unproven on the H200): W = 4 at C = 64 over a short last chunk, W = 2 at C = 32 read
# before with fp16, strong decay and dlog γ folded into _bwd_dqdx (GATE_FOLD), masked key and value tiles (K = 48,
# V = 80) with the delta split's piece view; `srows_off` 0 when every call ran them; W = 4 at C = 32 (8 steps a chunk,
# below a dot's side) must keep the pseudo-token rows (`srows_on` 0)
SROWS = [("F3-W4-C64", dict(W=4, C=64, T=40, B=1, H=2, K=32, V=16)),
         ("F3-W2-before-C32-fp16-strong-gatefold", dict(W=2, after=False, C=32, T=45, B=1, K=16, V=16,
                                                          dtype="float16", strong=True, gate_fold="on")),
         ("F3-W4-C64-K48-V80-dsplit", dict(W=4, C=64, T=32, B=2, H=1, K=48, V=80, dsplit=1)),
         ("F3-W4-C32-unapplied", dict(W=4, C=32, T=12, B=1, K=16, V=16, srows_none=True))]
CASES += [_c(f"srows-{n}", step_rows="on", seed=340 + i, **kw) for i, (n, kw) in enumerate(SROWS)]
# ... the default since 2026-12-05 is "after" (read-after calls only, what the H200 proved; every Falcon-3 case above
# at C / W >= 16 runs it): a read-before call keeps the pseudo-token rows there, and "off" (the former default) stays
# covered at W = 4, C = 64
CASES += [_c("srows-after-F3-W2-before-C32-unapplied", W=2, after=False, C=32, T=45, B=1, K=16, V=16, seed=350,
             srows_none=True),
          _c("srows-off-F3-W4-C64", step_rows="off", W=4, C=64, T=40, B=1, H=2, K=32, V=16, seed=351,
             srows_none=True)]
# Falcon-3 in place in time segments, the forward recomputed in the backward (lean=S: FALCON_TRITON_3_LEAN=on with S
# segments, ours, opt-in and unproven; lean.py): both read orders, a short last segment, no S0 / dS_T, fp16, masked
# key and value tiles, with the delta split inside the segments; `lean_off` 0 when the forward and backward both ran
# in segments, `saved_meta_off` 0 when its saved buffers are what the custom operator's fakes say; Falcon-1 and a
# call of one segment must stay whole (`lean_on` 0)
LEAN = [("F3-W4-after-S4", dict(W=4, T=40, lean=4)),
        ("F3-W2-before-fp16-no-S0-no-dST-S2", dict(W=2, after=False, T=45, B=1, dtype="float16", s0=False,
                                                    no_dst=True, lean=2, lean_meta=True)),
        ("F3-W4-C32-K48-V80-S8", dict(W=4, C=32, T=70, B=1, K=48, V=80, lean=8)),
        ("F3-W4-S2-dsplit", dict(W=4, T=32, lean=2, dsplit=1)),
        ("F1-whole", dict(T=64, lean=4, lean_none=True)),
        ("F3-W4-one-segment", dict(W=4, T=3, B=1, lean=2, lean_none=True))]
CASES += [_c(f"lean-{n}", seed=320 + i, **kw) for i, (n, kw) in enumerate(LEAN)]
# dlog γ inside _bwd_dqdx where one key tile covers K (gate_fold="on": FALCON_TRITON_GATE_FOLD=on, ours, opt-in and
# unproven): Falcon-1 and -1A both read orders, Falcon-3 in place (dg on each step's first pseudo-token), Falcon-3A's
# delayed form (its weights' backward adds to this dg), K = 80 (two key tiles: _bwd_gate as before), packed Falcon-1A
GF = [("F1-after-C32", dict(delta=True, C=32, T=45)),
      ("F1A-before-C64-K64", dict(delta=False, after=False, C=64, T=70, B=1, K=64)),
      ("F3-gather-W4-C64-before", dict(delta=True, W=4, C=64, T=40, B=1, after=False, K=32, V=16, fused=True)),
      ("F3A-delayed-W4", dict(delta=False, W=4, fused=True, delayed=True)),
      ("F1-K80-two-tiles", dict(delta=True, C=32, T=45, B=1, K=80, V=16))]
CASES += [_c(f"gatefold-{n}", gate_fold="on", seed=280 + i, **kw) for i, (n, kw) in enumerate(GF)]
# Falcon-3 on its host expansion (fused_window=False: FALCON_TRITON_3=expand, and every packed call)
CASES.append(_c("F3-W4-after", delta=True, W=4, seed=9, fused=False))
CASES.append(_c("F3-W2-before-C32", delta=True, W=2, after=False, C=32, T=45, B=1, K=16, V=16, seed=10,
                fused=False))
CASES.append(_c("F3-W4-C64-strong-decay-no-dST", delta=True, W=4, C=64, T=40, B=1, H=1, K=32, V=16, strong=True,
                no_dst=True, seed=12, fused=False))
# Falcon-3 with its pseudo-tokens read in place by the kernels (fused_window=True: FALCON_TRITON_3=gather, the default
# for unpacked calls since 2026-12-03: no host expansion)
CASES.append(_c("F3-gather-W4-after", delta=True, W=4, seed=9, fused=True))
CASES.append(_c("F3-gather-W2-before-C32", delta=True, W=2, after=False, C=32, T=45, B=1, K=16, V=16, seed=10,
                fused=True))
CASES.append(_c("F3-gather-W4-C64-strong-decay-no-dST", delta=True, W=4, C=64, T=40, B=1, H=1, K=32, V=16,
                strong=True, no_dst=True, seed=12, fused=True))
CASES.append(_c("F3-gather-W8-fp16-no-S0", delta=True, W=8, T=23, K=16, V=16, dtype="float16", s0=False, seed=33,
                fused=True))
# ... the cases above run the defaults: the pair gradients summed by pair_sum.py's kernel (FALCON_TRITON_3_PAIR_SUM=
# triton) and dq summed per step inside _bwd_dqdx (FALCON_TRITON_3_DQ_SUM=kernel), both since 2026-12-03; these run the
# host's sums (pair_sum="torch": the W strided += loop; dq_sum="host": dq W-fold, summed by the launcher) and the
# default's dq sum with two key tiles (K = 96)
CASES.append(_c("F3-gather-W4-C64-hostsums", delta=True, W=4, C=64, T=40, B=2, H=2, K=32, V=16, seed=12, fused=True,
                pair_sum="torch", dq_sum="host"))
CASES.append(_c("F3-gather-W2-fp16-before-hostpairsum", delta=True, W=2, after=False, C=32, T=45, B=1, K=16,
                V=16, dtype="float16", seed=10, fused=True, pair_sum="torch"))
CASES.append(_c("F3-gather-W4-C64-K96", delta=True, W=4, C=64, T=40, B=2, H=2, K=96, V=16, seed=12, fused=True))
CASES.append(_c("F3-gather-W8-fp16-hostdq", delta=True, W=8, T=23, K=16, V=16, dtype="float16", seed=33, fused=True,
                dq_sum="host"))
CASES.append(_c("F3-gather-W2-before-C32-strong-decay", delta=True, W=2, after=False, C=32, T=45, B=1, K=16,
                V=16, strong=True, seed=10, fused=True))
CASES.append(_c("F2A-after", delta=False, per_col=True, seed=13, diag="broadcast"))  # the diagonal blocks' opt-out
CASES.append(_c("F2A-before-C32-V20", delta=False, per_col=True, after=False, C=32, T=45, B=1, K=16, V=20, seed=14))
CASES.append(_c("F2A-C64-strong-decay-no-S0-no-dST", delta=False, per_col=True, C=64, T=70, B=1, H=1, K=32, V=16,
                strong=True, s0=False, no_dst=True, seed=15, intra="exact"))
CASES.append(_c("F2A-fp16", delta=False, per_col=True, dtype="float16", seed=16, intra="exact"))
# the state passes with value tiles of 16 (FALCON_TRITON_STATE_BV=16): three value blocks (V = 48); the other cases run
# the default (=auto: tiles by the programs per head), F1-C64-T65 the pass's own tile (=off, the form before auto)
CASES.append(_c("F1-state-bv16", delta=True, K=32, V=48, T=40, B=1, H=1, seed=17, state_bv="16"))
CASES.append(_c("F1A-state-bv16-before-C32", delta=False, K=32, V=48, T=40, B=1, H=1, C=32, after=False, seed=18,
                state_bv="16"))
CASES.append(_c("F3-state-bv16", delta=True, W=2, K=16, V=48, T=20, B=1, H=1, seed=20, state_bv="16", fused=False))
# the per-chunk states HS, DHS stored in fp32 (state_dtype="fp32": FALCON_TRITON_STATE_DTYPE=fp32, the opt-out since
# the inputs' dtype became the default on 2026-12-04; fp16 here, where the two differ): Falcon-1 and -1A both read
# orders and every chunk size, Falcon-3 in place and on its expansion, Falcon-3A's scans; the window-1 cases also
# check the saved states' dtype and the custom operator's fake outputs (hs_dtype_off, saved_meta_off: 0 when they
# agree)
STATE_IN = [("F1-after-C16", dict(delta=True)), ("F1-before-C64-T65", dict(delta=True, after=False, C=64, T=65, B=1)),
            ("F1A-C32-K48", dict(delta=False, C=32, T=70, K=48, V=16, B=1)),
            ("F1A-before-strong-decay-C64", dict(delta=False, after=False, C=64, T=64, B=1, H=1, strong=True)),
            ("F3-gather-W4-C64", dict(delta=True, W=4, C=64, T=40, B=1, H=1, K=32, V=16, fused=True)),
            ("F3-expand-W2", dict(delta=True, W=2, T=23, fused=False)),
            ("F3A-scans-W3", dict(delta=False, W=3, fused=False))]
CASES += [_c(f"state-fp32-fp16-{n}", dtype="float16", seed=180 + i, state_dtype="fp32", **kw)
          for i, (n, kw) in enumerate(STATE_IN)]
# ... and two naming the default ("input") so its saved states' dtype and fake outputs stay checked too
CASES += [_c(f"state-input-fp16-{n}", dtype="float16", seed=190 + i, state_dtype="input", **kw)
          for i, (n, kw) in enumerate(STATE_IN[:3:2])]
# Falcon-2A / -2's intra-chunk term: every per-column case runs the default, by 16-row sub-blocks (FALCON_TRITON_2A=
# blocked; C = 16 is one block), except those naming intra="exact" (the [C, C, 4] broadcast, FALCON_TRITON_2A=exact)
CASES.append(_c("F2A-blocked-C64-V48", delta=False, per_col=True, C=64, T=70, B=1, V=48, seed=13, intra="blocked"))
CASES.append(_c("F2A-blocked-before-C32-strong-decay", delta=False, per_col=True, after=False, C=32, T=45, B=1, K=16,
                V=20, strong=True, seed=14, intra="blocked"))
CASES.append(_c("F2A-blocked-fp16-C64", delta=False, per_col=True, C=64, T=70, B=1, dtype="float16", seed=16,
                intra="blocked"))
CASES.append(_c("F2-blocked-C64-strong-decay", delta=True, per_col=True, C=64, T=70, B=1, H=1, K=32, V=16,
                strong=True, seed=19, intra="blocked"))
# ... the blocked forward term with one program per chunk (fwd_grid="chunk": FALCON_TRITON_2A_FWD_GRID=chunk, the
# opt-out; the cases above run the default, one program per sub-block) and _pc_bwd_rows by value tiles of 16
# (rows_bv="16": FALCON_TRITON_2A_ROWS_BV=16, opt-in, slower on the H200)
CASES.append(_c("F2A-chunkgrid-C64-V48-rows16", delta=False, per_col=True, C=64, T=70, B=1, V=48, seed=13,
                intra="blocked", fwd_grid="chunk", rows_bv="16"))
CASES.append(_c("F2A-sb-before-C32-strong-decay", delta=False, per_col=True, after=False, C=32, T=45, B=1, K=16,
                V=20, strong=True, seed=14, intra="blocked", fwd_grid="block"))
CASES.append(_c("F2-chunkgrid-fp16-C64-no-S0-rows16", delta=True, per_col=True, C=64, T=70, B=1, H=1, K=32, V=32,
                dtype="float16", s0=False, seed=19, intra="blocked", fwd_grid="chunk", rows_bv="16"))
# ... _pc_bwd_rows: the cases above run the default (FALCON_TRITON_2A_ROWS_GRID=tile since 2026-12-03: one program per
# sub-block and value tile, M's parts summed in _pc_bwd_main; two parts at V = 48, three with 16-column tiles); the
# "rowsblock" cases one program per sub-block, its value tiles in turn (rows_grid="block")
CASES.append(_c("F2A-rowsblock-C64-V48", delta=False, per_col=True, C=64, T=70, B=1, V=48, seed=13, intra="blocked",
                rows_grid="block"))
CASES.append(_c("F2A-rowstile-rows16-before-C32-strong-decay", delta=False, per_col=True, after=False, C=32, T=45, B=1,
                K=16, V=48, strong=True, seed=14, intra="blocked", rows_bv="16"))
CASES.append(_c("F2-rowsblock-fp16-C64-V64", delta=True, per_col=True, C=64, T=70, B=1, H=1, K=32, V=64,
                dtype="float16", seed=19, intra="blocked", rows_grid="block"))
# the diagonal sub-blocks by two references and tensor-core dots (diag="split": FALCON_TRITON_2A_DIAG=split, ours, the
# default since 2026-12-04, so every Falcon-2A / -2 case here without `diag` runs it; "F2A-after" and "F2-after" pin
# the broadcast): the fallback inside one call under a lowered bound (span 8: between the strong-decay cases' smallest
# and largest half-block spans; its errors differ from both span 0 and span 60, so some tiles take the dots and others
# the broadcast), fp16 with strong decay (fp32 operands: bound e^60); "split16" feeds the dots the inputs' dtype (fp16:
# bound e^4, so its strong-decay tiles take the broadcast)
DIAG = [("F2A-C64-V48-fp16-strong-decay", dict(delta=False, C=64, T=70, B=1, V=48, dtype="float16", strong=True,
                                               seed=202)),
        ("F2A-C64-mixed-tiles", dict(delta=False, C=64, T=70, B=1, H=1, strong=True, diag_spans={"other": 8.},
                                     seed=203)),
        ("F2-C32-strong-decay-mixed-tiles", dict(delta=True, C=32, T=45, B=1, K=16, V=20, strong=True,
                                                  diag_spans={"other": 8.}, seed=205)),
        ("F2-fp16-C16", dict(delta=True, dtype="float16", seed=206))]
CASES += [_c(f"{n.split('-')[0]}-split-{n.split('-', 1)[1]}", per_col=True, diag="split", **kw) for n, kw in DIAG[:3]]
CASES += [_c(f"{n.split('-')[0]}-split16-{n.split('-', 1)[1]}", per_col=True, diag="split16", **dict(kw, seed=210 + i))
          for i, (n, kw) in enumerate(d for d in DIAG if "fp16" in d[0])]
CASES.append(_c("F2-after", delta=True, per_col=True, seed=17, diag="broadcast"))
# the blocked backward's intra pass in one kernel (bwd_intra="fused": FALCON_TRITON_2A_BWD_INTRA=fused, ours, opt-in
# and unproven; _pc_bwd_intra, the later blocks' du through a [K, BV] sum): four and two sub-blocks, both read orders,
# value tiles with a masked rest (V = 48, 80), masked keys (K = 48), strong decay with the split / broadcast diagonal
# blocks mixed in one call, the broadcast alone, fp16 with the split16 dots, Falcon-2 (R for v), the key-split state
# pass (DU stored fresh) and packed sequences
FUSED = [("F2A-C64-V48", dict(delta=False, C=64, T=70, B=1, V=48)),
         ("F2A-before-C32-strong-decay", dict(delta=False, after=False, C=32, T=45, B=1, K=16, V=48, strong=True)),
         ("F2A-C64-mixed-tiles", dict(delta=False, C=64, T=70, B=1, H=1, strong=True, diag_spans={"other": 8.})),
         ("F2A-broadcast-before-C32", dict(delta=False, after=False, C=32, T=45, B=1, diag="broadcast")),
         ("F2A-split16-fp16-C64-K48-V80", dict(delta=False, C=64, T=70, B=1, H=1, K=48, V=80, dtype="float16",
                                               diag="split16")),
         ("F2-fp16-C64-no-S0", dict(delta=True, C=64, T=70, B=1, H=1, K=32, dtype="float16", s0=False)),
         ("F2A-ksplit-C64-K32", dict(delta=False, C=64, T=70, B=1, K=32, ksplit=True))]
CASES += [_c(f"fused-intra-{n}", per_col=True, bwd_intra="fused", seed=220 + i, **kw) for i, (n, kw) in enumerate(FUSED)]
# ... and the forward's inter-chunk term: inside the sub-block kernel (FALCON_TRITON_2A_FWD_INTER=fold, ours) by
# default since 2026-12-05, so these keep its own kernel (fwd_inter="kernel", the former default) covered, with the
# fused backward: both read orders, masked tiles, fp16, Falcon-2, packed sequences
CASES += [_c(f"inter-kernel-{n}", per_col=True, bwd_intra="fused", fwd_inter="kernel", seed=250 + i, **kw)
          for i, (n, kw) in enumerate(FUSED[:2] + FUSED[4:6])]
CASES.append(_c("F2-before-C32-V20", delta=True, per_col=True, after=False, C=32, T=45, B=1, K=16, V=20, seed=18))
CASES.append(_c("F2-C64-strong-decay-no-S0-no-dST", delta=True, per_col=True, C=64, T=70, B=1, H=1, K=32, V=16,
                strong=True, s0=False, no_dst=True, seed=19, intra="exact"))
CASES.append(_c("F2-fp16", delta=True, per_col=True, dtype="float16", seed=20, intra="exact"))
CASES.append(_c("F2-K48-V80-before", delta=True, per_col=True, after=False, T=50, B=1, H=1, K=48, V=80, seed=22))
# Falcon-2's per-column solves (ours): the cases above run the defaults (both state passes by 16-row sub-blocks with the
# diagonal blocks' precomputed inverses, FALCON_TRITON_2_SOLVE=blocked_inv since 2026-12-04, and the solve's own
# gradients by sub-blocks, FALCON_TRITON_2_BWD_SOLVE=blocked; C = 16 keeps the broadcast); here the row substitution and
# the broadcast proven before (=rows, =exact), both passes by sub-blocks (=blocked, on CUDA only with
# FALCON_TRITON_UNPROVEN=1; every dot of its reverse pass on fp32 operands, the transposed solve's among them, with
# FALCON_TRITON_2_BLK_BWD=4,32,x32,s1: three value tiles here, as in the bf16 builds that fail on the H200), and the
# broadcast under the blocked forward
CASES.append(_c("F2-rows-exact-C64-strong-decay", delta=True, per_col=True, C=64, T=70, B=1, H=1, K=32, V=16,
                strong=True, seed=19, solve="rows", bwd_solve="exact"))
CASES.append(_c("F2-rows-exact-fp16-C32-K48-V80", delta=True, per_col=True, C=32, T=70, B=1, H=1, K=48, V=80,
                dtype="float16", seed=23, solve="rows", bwd_solve="exact"))
CASES.append(_c("F2-solve-blocked-C64-strong-decay", delta=True, per_col=True, C=64, T=70, B=1, H=1, K=32, V=16,
                strong=True, seed=19, solve="blocked"))
CASES.append(_c("F2-solve-blocked-before-C32-V20", delta=True, per_col=True, after=False, C=32, T=45, B=1, K=16, V=20,
                seed=18, solve="blocked"))
CASES.append(_c("F2-solve-blocked-x32dot-fp16-C64-K48-V80", delta=True, per_col=True, C=64, T=70, B=1, H=1, K=48,
                V=80, dtype="float16", seed=24, solve="blocked", blk_bwd=[4, 32, 2, True]))
CASES.append(_c("F2-rows-exact-before-C32-V20", delta=True, per_col=True, after=False, C=32, T=45, B=1, K=16, V=20,
                seed=18, solve="rows", bwd_solve="exact"))
CASES.append(_c("F2-exact-fp16-C64-K48-V80", delta=True, per_col=True, C=64, T=70, B=1, H=1, K=48, V=80,
                dtype="float16", seed=22, bwd_solve="exact"))
# ... the forward pass with the diagonal blocks' precomputed inverses alone (solve="inv": FALCON_TRITON_2_SOLVE=inv,
# proven; _pcd_blk_inv): every chunk size (C = 16: one sub-block), both read orders, strong decay,
# no S0, fp16, two value tiles of the inverse kernel and a masked rest (V = 80), awkward T
F2_INV = [("C64-strong-decay-no-S0", dict(C=64, T=70, B=1, H=1, K=32, V=16, strong=True, s0=False)),
          ("before-C32-V20", dict(after=False, C=32, T=45, B=1, K=16, V=20)),
          ("C16", dict(C=16, T=37)),
          ("fp16-C64-K48-V80", dict(C=64, T=70, B=1, H=1, K=48, V=80, dtype="float16"))]
CASES += [_c(f"F2-inv-{n}", delta=True, per_col=True, seed=160 + i, solve="inv", **kw)
          for i, (n, kw) in enumerate(F2_INV)]
# ... and the forward pass by sub-blocks with substitutions inside, the reverse by rows (solve="fwd", the default before
# 2026-12-04, proven; the default "blocked_inv" is "inv" and the reverse pass by sub-blocks with the same inverses,
# transposed, which every F2 case above without a solve= runs)
CASES += [_c(f"F2-fwd-{n}", delta=True, per_col=True, seed=170 + i, solve="fwd", **kw)
          for i, (n, kw) in enumerate(F2_INV)]
# ... and _pcd_blk_inv by substitution steps over one [16, 16, BV] tile (inv_form="tile": FALCON_TRITON_2_INV=tile,
# proven, the default before 2026-12-04; every other F2 case runs the product form with 16-column tiles: at V = 20 and
# 80 a masked rest)
CASES += [_c(f"F2-invtile-{n}", delta=True, per_col=True, seed=175 + i, inv_form="tile", **kw)
          for i, (n, kw) in enumerate(F2_INV[:3:2])]
# ... and the inverses formed inside both state passes (solve="fused_inv": FALCON_TRITON_2_SOLVE=fused_inv, opt-in,
# proven on the H200; no INV tensor; 16-column tiles, at V = 20 and 80 a masked rest)
CASES += [_c(f"F2-fused-{n}", delta=True, per_col=True, seed=190 + i, solve="fused_inv", **kw)
          for i, (n, kw) in enumerate(F2_INV)]
# ... the backward reading the forward's inverses (inv_keep="save": FALCON_TRITON_2_INV_KEEP=save, opt-in, proven on the
# H200 2026-12-04) with both value tiles of _pcd_bwd_solve_blk (FALCON_TRITON_2_SOLVE_BLK_BV: 64 the default since then,
# which every other F2 case runs; at V = 80 it leaves a masked rest), and _pc_fwd_intra_sb's former 32-column tile
# (FALCON_TRITON_2A_FWD_SB_BV=32) for Falcon-2A. The interpreter ignores num_warps (the _WARPS switches): the tiles are
# what these cases vary.
CASES += [_c(f"F2-invkeep-{n}-bv{bv}", delta=True, per_col=True, seed=180 + i, inv_keep="save", solve_blk_bv=bv, **kw)
          for i, ((n, kw), bv) in enumerate(zip([F2_INV[0], F2_INV[3]], ("32", "64")))]
CASES.append(_c("F2A-fwdsb-bv32-fp16-C64-K48-V80", delta=False, per_col=True, C=64, T=70, B=1, H=1, K=48, V=80,
                dtype="float16", seed=186, fwd_sb_bv="32"))
# chunk.py's backward in three kernels (_bwd_cc, _bwd_dqdx, _bwd_gate): beside the cases above, K = 80 (two key tiles
# of 64 and a partial one's mask) and Falcon-1A with K = 128, V = 80 (two key tiles, value blocks of 64 and a masked
# rest)
SPLIT = [("F1-K80-C32-T45", dict(C=32, T=45, B=1, K=80, V=16)), ("F1A-before-K128-V80", dict(
    delta=False, after=False, T=40, B=1, H=1, K=128, V=80))]
CASES += [_c(f"bwd-split-{n}", seed=118 + i, **kw) for i, (n, kw) in enumerate(SPLIT)]
DECODE = []
for delta in (True, False):
    for per_col, W in ((False, 1), (True, 1), (False, 4)):
        name = {(False, 1): "1", (True, 1): "2", (False, 4): "3"}[(per_col, W)] + ("" if delta else "A")
        for after in (True, False):
            DECODE.append(dict(id=f"decode-F{name}-{'after' if after else 'before'}", decode=True, B=2, H=2,
                               K=16, V=32, W=W, delta=delta, after=after, per_col=per_col, seed=11))


# Falcon-3A's cases here pin its W scans (`scans`: what FALCON_TRITON_3A=scans sets); the banded default has its own
# below (BANDED)
COMPILE = [dict(id=f"compile-fullgraph-F{v}", compile=True, variant=v, seed=23, scans=v == "3A")
           for v in ("1", "1A", "2A", "3A")]
# Falcon-2 with the forward's block inverses kept for the backward: the custom operator's fake saved shapes
COMPILE.append(dict(id="compile-fullgraph-F2-invkeep", compile=True, variant="2", seed=24, inv_keep="save"))
# Falcon-3's block with its fused prep as custom operators (prep_ops.py; the default under compile since 2026-12-05;
# window 1's operators are checked in tests/test_triton_prep.py)
COMPILE.append(dict(id="compile-fullgraph-prep-op-F3", compile=True, variant="3", seed=25, prep_op=True))
RECOMPUTE = [dict(id=f"recompute-F{v}", recompute=True, variant=v, seed=29) for v in ("1A", "2A")]
API = [dict(id=f"api-varlen-continuation-F{v}", api=True, variant=v, dtype="float32", seed=21, scans=v == "3A")
       for v in ("1", "1A", "3A", "3", "2A", "2")]


# packed sequences run natively by the chunk kernels (cu_seqlens read in the kernels, no padding)
VARLEN = [dict(id=f"varlen-native-F{v}-{dt}-C{C}", varlen=True, variant=v, dtype=dt, C=C, seed=40 + i)
          for i, (v, dt, C) in enumerate([("1", "float32", 16), ("1", "float16", 32), ("1A", "float32", 16),
                                          ("1A", "float16", 64), ("1", "float32", 64)])]
VARLEN += [dict(id=f"varlen-native-F{v}-read-before-no-shift", varlen=True, variant=v, dtype="float32", C=32,
                read="before", shift=False, seed=50 + i) for i, v in enumerate(("1", "1A"))]
VARLEN += [dict(id=f"varlen-native-F{v}-{dt}-C{C}-{rd}", varlen=True, variant=v, dtype=dt, C=C, read=rd,
                shift=(rd == "after"), seed=60 + i)
           for i, (v, dt, C, rd) in enumerate([("2A", "float32", 16, "after"), ("2A", "float16", 32, "before"),
                                               ("2", "float32", 16, "after"), ("2", "float16", 64, "before")])]
# Falcon-3A (window 4, the W scans: FALCON_TRITON_3A_PACKED=scans, the packed default before 2026-12-04) on the packed
# pair stream: each sequence's carried tails, their gradients
VARLEN += [dict(id=f"varlen-native-F3A-scans-{dt}-C{C}-{rd}", varlen=True, variant="3A", dtype=dt, C=C, read=rd,
                shift=(rd == "after"), seed=80 + i, packed3a="scans")
           for i, (dt, C, rd) in enumerate([("float32", 16, "after"), ("float32", 32, "before"), ("float16", 64, "after")])]
# ... and on the banded scan's packed form (FALCON_TRITON_3A_PACKED=banded, proven on the H200 and the default since
# 2026-12-04; the lengths 1, C-1, C, C+1, 3C+5 leave two empty chunk slots in the plan)
VARLEN += [dict(id=f"varlen-native-F3A-banded-{dt}-C{C}-{rd}", varlen=True, variant="3A", dtype=dt, C=C, read=rd,
                shift=(rd == "after"), seed=84 + i, banded=True, packed3a="banded")
           for i, (dt, C, rd) in enumerate([("float32", 16, "after"), ("float32", 32, "before"),
                                            ("float16", 64, "after")])]
# ... and on the delayed form's packed branches (FALCON_TRITON_3A_PACKED=delayed, ours, proven on the H200 and the default
# since 2026-12-04, twenty-first session: the Falcon-1A scan on the packed pair stream, the band kernels with each row's
# sequence; `delayed_off` 0 when the form ran)
VARLEN += [dict(id=f"varlen-native-F3A-delayed-{dt}-C{C}-{rd}", varlen=True, variant="3A", dtype=dt, C=C, read=rd,
                shift=(rd == "after"), seed=87 + i, delayed=True, packed3a="delayed")
           for i, (dt, C, rd) in enumerate([("float32", 16, "after"), ("float32", 32, "before"),
                                            ("float16", 64, "after")])]
# Falcon-3 (window 4) on its host expansion of the packed pair stream: sequence s's pseudo-tokens from cu[s]·W
VARLEN += [dict(id=f"varlen-native-F3-{dt}-C{C}-{rd}", varlen=True, variant="3", dtype=dt, C=C, read=rd,
                shift=(rd == "after"), seed=90 + i)
           for i, (dt, C, rd) in enumerate([("float32", 16, "after"), ("float32", 32, "before"),
                                            ("float16", 64, "after")])]
VARLEN += [dict(id=f"varlen-native-F{v}-C64-chunkgrid-rows16", varlen=True, variant=v, dtype="float32", C=64,
                seed=64 + i, fwd_grid="chunk", rows_bv="16") for i, v in enumerate(("2A", "2"))]
VARLEN.append(dict(id="varlen-native-F2A-C64-fused-intra-before", varlen=True, variant="2A", dtype="float16", C=64,
                   read="before", shift=False, seed=74, bwd_intra="fused", fwd_inter="kernel"))
VARLEN.append(dict(id="varlen-native-F1A-float32-C16-seqsplit-unsplit", varlen=True, variant="1A", dtype="float32", C=16,
                   seed=78, split=1, split_none=True))
VARLEN.append(dict(id="varlen-native-F1-float32-C16-dsplit-unsplit", varlen=True, variant="1", dtype="float32", C=16,
                   seed=80, dsplit=1, dsplit_none=True))  # packed calls keep the single pass (delta_split.py)
VARLEN.append(dict(id="varlen-native-F1A-float32-C32-gatefold", varlen=True, variant="1A", dtype="float32", C=32,
                   seed=79, gate_fold="on"))
VARLEN += [dict(id=f"varlen-native-F{v}-C32-rowsblock", varlen=True, variant=v, dtype="float32", C=32, seed=66 + i,
                rows_grid="block") for i, v in enumerate(("2A", "2"))]
VARLEN += [dict(id=f"varlen-native-F2-C32-{sv}", varlen=True, variant="2", dtype="float32", C=32, seed=68 + i,
                solve=sv) for i, sv in enumerate(("inv", "fwd"))]
VARLEN.append(dict(id="varlen-native-F2-C32-invtile", varlen=True, variant="2", dtype="float32", C=32, seed=70,
                   inv_form="tile"))
VARLEN.append(dict(id="varlen-native-F2-C32-fused", varlen=True, variant="2", dtype="float32", C=32, seed=72,
                   solve="fused_inv"))
VARLEN.append(dict(id="varlen-native-F2-C32-invkeep", varlen=True, variant="2", dtype="float32", C=32, seed=71,
                   inv_keep="save"))
# the same with the PyTorch prep on the packed batch (torch.compile's path; FALCON_TRITON_PREP=torch) instead of the
# ... the linear state passes split over key tiles on packed sequences (ksplit, K = 32: two key tiles of 16; the delayed
# Falcon-3A's packed form with it too)
VARLEN += [dict(id=f"varlen-native-F{v}-ksplit-K32-{dt}-C{C}-{rd}", varlen=True, variant=v, dtype=dt, C=C, read=rd,
                shift=(rd == "after"), seed=95 + i, ksplit=True, K=32, **kw)
           for i, (v, dt, C, rd, kw) in enumerate([("1A", "float32", 16, "after", {}),
                                                    ("1A", "float16", 32, "before", {}),
                                                    ("3A", "float32", 16, "after", dict(packed3a="delayed")),
                                                    ("2A", "float32", 16, "after", {}),
                                                    ("2A", "float16", 32, "before", {})])]
# fused prep kernels' packed branch
VARLEN += [dict(id=f"varlen-native-F{v}-torch-prep", varlen=True, variant=v, dtype="float32", C=16, prep="torch",
                seed=70 + i) for i, v in enumerate(("1", "2A"))]


# the public op (ragged cu_seqlens, continuation) and a compiled block with Falcon-3A on the banded scan, the default
# since 2026-12-03 (FALCON_TRITON_3A=banded, set for the case so that the environment cannot change it)
BANDED = [dict(API[2], id="api-varlen-continuation-F3A-banded", banded=True, scans=False, packed3a="scans"),
          dict(COMPILE[3], id="compile-fullgraph-F3A-banded", banded=True, scans=False),
          dict(API[2], id="api-varlen-continuation-F3A-banded-packed", banded=True, scans=False, packed3a="banded")]
# ... and on the delayed form (FALCON_TRITON_3A=delayed: one Falcon-1A scan plus a band, unpacked calls; the packed
# call takes the banded scan), through the public op and a compiled block (its custom operator's fake outputs)
DELAYED = [dict(API[2], id="api-varlen-continuation-F3A-delayed", delayed=True, scans=False, packed3a="banded"),
           dict(COMPILE[3], id="compile-fullgraph-F3A-delayed", delayed=True, scans=False)]


@pytest.fixture(scope="module")
def results():
    # timeout: a hang guard only. The whole file, its 232 cases and the switch rows, took 232 s on the 2-core machine
    # (2026-12-04, twenty-second session; the switch rows' typo imports through one forking interpreter since then:
    # 80 s as 35 interpreter starts before). Its 177 cases took 233 s alone (2026-12-04, twentieth session,
    # with interp_case_helpers' device calls skipping the interpreter's re-patching: 376 s without; 443 s of case time
    # over the two worker processes). Its 161 cases took 279 s in the nineteenth session, and beside another test file
    # under `./lab test`'s two workers they came to the 600 s this guard had (a fresh-clone run of .ci/run at aaec578
    # stopped there, one at 8d58086 passed), so it allows 1200 s.
    return run_interp_cases("triton_interp_cases.py", CASES + DECODE + API + COMPILE + RECOMPUTE + BANDED + DELAYED +
                            VARLEN,
                            timeout=1200)


def test_banded_falcon_3a_chunk_cap(monkeypatch):
    """window_linear.chunk_for: the asked chunk, capped at 32 above K = 64 (a failure on the H200), and at 32 for every
    K under FALCON_TRITON_3A_CHUNK=32."""
    import falcon_lab.kernels.triton.window_linear as wl

    monkeypatch.setattr(wl, "WL_CHUNK", "64")
    assert (wl.chunk_for(64, 64), wl.chunk_for(128, 64), wl.chunk_for(64, 16)) == (64, 32, 16)
    monkeypatch.setattr(wl, "WL_CHUNK", "32")
    assert (wl.chunk_for(64, 64), wl.chunk_for(16, 64), wl.chunk_for(128, 64), wl.chunk_for(64, 16)) == (32, 32, 32, 16)


def test_banded_falcon_3a_through_the_public_op_and_compile(results):
    """With the one-scan kernel set (FALCON_TRITON_3A=banded, the default 2026-12-03 to 2026-12-04), chunk_falcon's
    Falcon-3A runs it: varlen (the case pins FALCON_TRITON_3A_PACKED=scans: the packed call runs the W scans
    natively) and continuation (the banded kernel) against the float64 recurrence, and a compiled block (fullgraph)
    against eager."""
    api, comp = (results.get(c["id"]) for c in BANDED[:2])
    assert api is not None and "error" not in api, api
    assert api["res"]["window_linear_calls"] > 0, api  # the banded kernel did run (the continuation's calls)
    for k, e in api["res"].items():
        if k != "window_linear_calls":
            assert e <= 2e-5, f"{k} relative error {e:.3e}"
    assert comp is not None and "error" not in comp, comp
    assert comp["res"]["max_abs_diff"] <= 1e-6, comp


def test_banded_falcon_3a_packed_through_the_public_op(results):
    """With FALCON_TRITON_3A_PACKED=banded (the default 2026-12-04, nineteenth to twentieth session) the packed call
    takes the banded scan too (one more forward call of it than with =scans, where the packed call runs the W scans),
    against the float64 recurrence. The packed default is the delayed form since the twenty-first session."""
    import falcon_lab.kernels.triton as kt

    if "FALCON_TRITON_3A_PACKED" not in os.environ:
        assert kt._FALCON_3A_PACKED == "delayed", "the delayed form is the packed default since the H200 proved it"
    base, packed = results.get(BANDED[0]["id"]), results.get(BANDED[2]["id"])
    assert packed is not None and "error" not in packed, packed
    assert packed["res"]["window_linear_calls"] == base["res"]["window_linear_calls"] + 1, (base, packed)
    for k, e in packed["res"].items():
        if k != "window_linear_calls":
            assert e <= 2e-5, f"{k} relative error {e:.3e}"


def test_split_diagonal_blocks_are_the_default_and_their_bounds(monkeypatch):
    """FALCON_TRITON_2A_DIAG=split is the default (proven on the H200, 2026-12-04): 16-bit inputs' diagonal dots take
    fp32 operands at tf32 with the e^60 bound, fp32 inputs their own precision; split16 keeps the inputs' dtype (fp16:
    e^4); the broadcast passes span 0, which compiles the broadcast alone."""
    import torch

    import falcon_lab.kernels.triton.percol as kp

    if "FALCON_TRITON_2A_DIAG" not in os.environ:
        assert kp.DIAG == "split"
    monkeypatch.setattr(kp, "DIAG", "split")
    assert kp.diag_args(torch.bfloat16, "ieee") == (60., True, "tf32")
    assert kp.diag_args(torch.float16, "ieee") == (60., True, "tf32")
    assert kp.diag_args(torch.float32, "tf32x3") == (60., False, "tf32x3")
    monkeypatch.setattr(kp, "DIAG", "split16")
    assert kp.diag_args(torch.float16, "ieee") == (4., False, "ieee")
    assert kp.diag_args(torch.bfloat16, "ieee") == (60., False, "ieee")
    monkeypatch.setattr(kp, "DIAG", "broadcast")
    assert kp.diag_args(torch.bfloat16, "ieee") == (0., False, "ieee")


def test_delayed_falcon_3a_through_the_public_op_and_compile(results):
    """FALCON_TRITON_3A=delayed (window_delayed.py): chunk_falcon's Falcon-3A (ragged cu_seqlens on the banded scan's
    packed form, continuation on the delayed form) against the float64 recurrence, and a compiled block (fullgraph,
    the custom operator's fake outputs) against eager."""
    import falcon_lab.kernels.triton as kt

    if "FALCON_TRITON_3A" not in os.environ:
        assert kt._FALCON_3A == "delayed", "the delayed form is the default since the H200 proved it (2026-12-04)"
    api, comp = (results.get(c["id"]) for c in DELAYED)
    assert api is not None and "error" not in api, api
    for k, e in api["res"].items():
        if k != "window_linear_calls":
            assert e <= 2e-5, f"{k} relative error {e:.3e}"
    assert comp is not None and "error" not in comp, comp
    assert comp["res"]["max_abs_diff"] <= 1e-6, comp


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_chunk_kernels_match_float64(results, case):
    r = results.get(case["id"])
    assert r is not None, f"case {case['id']} did not run"
    assert "error" not in r, r.get("error")
    # fp32: full-precision dots, errors ~1e-7 measured; fp16 operands: ~5e-4 measured
    lim = 3e-3 if case["dtype"] == "float16" else 2e-5
    res = r["res"]
    assert set(res) >= {"o", "S_T", "dq", "dxw", "dvw", "deta", "dg"}
    for k, e in res.items():
        assert e <= lim, f"{case['id']}: {k} relative error {e:.3e} > {lim:.0e} ({res})"


@pytest.mark.parametrize("case", DECODE, ids=[c["id"] for c in DECODE])
def test_decode_kernel_matches_float64(results, case):
    r = results.get(case["id"])
    assert r is not None and "error" not in r, r
    for k, e in r["res"].items():
        assert e <= 2e-6, f"{case['id']}: {k} relative error {e:.3e}"


def test_cpu_without_interpreter_gives_clear_error():
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "import torch\nfrom falcon_lab.kernels.triton import core\n"
            "q = torch.zeros(1, 4, 1, 16); v = torch.zeros(1, 4, 1, 16); e = torch.zeros(1, 4, 1)\n"
            "try:\n    core(q, q, v, e, e, None, delta=True, window=1, read_after=True, chunk_size=16)\n"
            "except RuntimeError as err:\n    print('ERR', err)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "ERR" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("case", API, ids=[c["id"] for c in API])
def test_public_op_triton_backend_varlen_and_continuation(results, case):
    """chunk_falcon(backend="triton") against recurrent_falcon in float64: ragged cu_seqlens (lengths
    1, 7, 30) forward and gradients of q, k, v, beta, lam; and a sequence split at 21 of 50 continued
    from the returned FalconState."""
    r = results.get(case["id"])
    assert r is not None and "error" not in r, r
    assert set(r["res"]) == {"o", "dq", "dk", "dv", "dbeta", "dlam", "o_continuation"}
    for k, e in r["res"].items():
        assert e <= 2e-5, f"{case['id']}: {k} relative error {e:.3e}"


@pytest.mark.parametrize("case", COMPILE, ids=[c["id"] for c in COMPILE])
def test_block_compiles_without_graph_break(results, case):
    """The Triton cores (falcon_lab::chunk_core_fwd/bwd) and fused modules are custom operators:
    torch.compile(fullgraph=True) traces a whole decoder block, forward and backward, and agrees with
    eager (aot_eager backend: the graph is what Inductor would get; Inductor itself needs the GPU run)."""
    r = results.get(case["id"])
    assert r is not None and "error" not in r, r
    assert r["res"]["max_abs_diff"] <= 1e-6, r
    if case.get("prep_op"):  # the prep ran as the operator (traced once; no graph break above)
        assert r["res"]["prep_op_calls"] >= 1, r


@pytest.mark.parametrize("case", RECOMPUTE, ids=[c["id"] for c in RECOMPUTE])
def test_recompute_keeps_the_core_and_changes_nothing(results, case):
    """mixer.recompute (selective activation checkpointing of the glue): same output and gradients,
    eager and compiled, and the Triton core's forward runs once per step (its outputs are kept)."""
    r = results.get(case["id"])
    assert r is not None and "error" not in r, r
    res = r["res"]
    assert res["plain_core_calls"] == 1 and res["recompute_core_calls"] == 1, res
    assert res["plain_glue_calls"] == 1 and res["recompute_glue_calls"] == 2, res  # recomputed in backward
    assert res["recompute_compiled_core_calls"] == 1, res
    assert res["recompute_max_abs_diff"] <= 1e-6 and res["recompute_compiled_max_abs_diff"] <= 1e-6, res


@pytest.mark.parametrize("case", VARLEN, ids=[c["id"] for c in VARLEN])
def test_packed_sequences_run_natively_and_match_float64(results, case):
    """chunk_falcon(backend="triton", cu_seqlens=...) with the packed batch read by the chunk kernels and the fused prep
    (no padding): lengths 1, C-1, C, C+1, 3C+5 (chunk slots past the last chunk included), each sequence from its own
    state; output, final state (S, last_k, seen) and the gradients of q, k, v, beta, lam, S0 and the carried last keys
    against recurrent_falcon in float64."""
    from falcon_lab.benchmarking.gpu_check import varlen_judge

    r = results.get(case["id"])
    assert r is not None and "error" not in r, r
    res = r["res"]
    assert res["native"] == 1.0, "the call was padded, not run natively"
    assert res["seen"] == 0.0 and res["last_k"] == 0.0, res
    lim = 3e-3 if case["dtype"] == "float16" else 2e-5
    assert varlen_judge(res, lambda errs: all(e <= lim for e in errs.values())), res


# The kernels' switches (read once at import): (module, attribute, variable, default, a typo, what the typo's error
# says). The defaults are the forms proven on the H200 and measured faster there (see each module); every other
# choice is interpreter-tested above. None: no default asserted / no typo tried.
KT = "falcon_lab.kernels.triton."
SWITCHES = [
    # the blocked intra-chunk term (0.8x the exact broadcast's time); =exact keeps the broadcast
    (KT + "percol", "INTRA", "FALCON_TRITON_2A", "blocked", "block",
     "FALCON_TRITON_2A must be 'exact' or 'blocked', got 'block'"),
    # the triangular inverse A's storage between forward and backward: the inputs' dtype (every path)
    (KT + "chunk", "A_DTYPE", "FALCON_TRITON_A_DTYPE", "input", "bf16",
     "FALCON_TRITON_A_DTYPE must be 'input' or 'fp32', got 'bf16'"),
    # the blocked forward term's grid and _pc_bwd_rows' value tile
    (KT + "percol", "FWD_GRID", "FALCON_TRITON_2A_FWD_GRID", "block", "blocks",
     "FALCON_TRITON_2A_FWD_GRID must be 'block' or 'chunk', got 'blocks'"),
    (KT + "percol", "ROWS_BV", "FALCON_TRITON_2A_ROWS_BV", "32", "128",
     "FALCON_TRITON_2A_ROWS_BV must be '32' or '16', got '128'"),
    (KT + "percol", "ROWS_GRID", "FALCON_TRITON_2A_ROWS_GRID", "tile", "tiles",
     "FALCON_TRITON_2A_ROWS_GRID must be 'tile' or 'block', got 'tiles'"),
    (KT + "percol", "BWD_INTRA", "FALCON_TRITON_2A_BWD_INTRA", "split", "fuse",
     "FALCON_TRITON_2A_BWD_INTRA must be 'split' or 'fused', got 'fuse'"),
    (KT + "percol", "FWD_INTER", "FALCON_TRITON_2A_FWD_INTER", "fold", "folded",
     "FALCON_TRITON_2A_FWD_INTER must be 'kernel' or 'fold', got 'folded'"),
    (KT + "common", "FP32_DOT", "FALCON_TRITON_FP32_DOT", "tf32x3", "fp64",
     "FALCON_TRITON_FP32_DOT must be 'tf32x3', 'ieee' or 'tf32', got 'fp64'"),
    (KT + "chunk", "A_INV", "FALCON_TRITON_A_INV", "prod", "product",
     "FALCON_TRITON_A_INV must be 'subst' or 'prod', got 'product'"),
    (KT + "chunk", "DU_DTYPE", "FALCON_TRITON_DU_DTYPE", "input", "bf16",
     "FALCON_TRITON_DU_DTYPE must be 'fp32' or 'input', got 'bf16'"),
    (KT + "state_split", "LINEAR_SPLIT", "FALCON_TRITON_LINEAR_SPLIT", "on", "yes",
     "FALCON_TRITON_LINEAR_SPLIT must be 'off' or 'on', got 'yes'"),
    (KT + "state_split", "SPLIT_LEN", "FALCON_TRITON_LINEAR_SPLIT_LEN", 32, "3",
     "FALCON_TRITON_LINEAR_SPLIT_LEN must be '2', '4', '8', '16', '32' or '64', got '3'"),
    (KT + "prep_window", "GATES", "FALCON_TRITON_3_PREP_GATES", "stat", "mu",
     "FALCON_TRITON_3_PREP_GATES must be 'recompute' or 'stat', got 'mu'"),
    (KT + "lean", "LEAN", "FALCON_TRITON_3_LEAN", "off", "yes", "FALCON_TRITON_3_LEAN must be 'off' or 'on', got 'yes'"),
    (KT + "lean", "LEAN_SEGMENTS", "FALCON_TRITON_3_LEAN_SEGMENTS", 4, "3",
     "FALCON_TRITON_3_LEAN_SEGMENTS must be '2', '4', '8' or '16', got '3'"),
    (KT + "delta_split", "DELTA_SPLIT", "FALCON_TRITON_DELTA_SPLIT", "on", "yes",
     "FALCON_TRITON_DELTA_SPLIT must be 'off' or 'on', got 'yes'"),
    (KT + "delta_split", "DELTA_SPLIT_LEN", "FALCON_TRITON_DELTA_SPLIT_LEN", 32, "3",
     "FALCON_TRITON_DELTA_SPLIT_LEN must be '1', '2', '4', '8', '16', '32' or '64', got '3'"),
    (KT + "chunk", "GATE_FOLD", "FALCON_TRITON_GATE_FOLD", "off", "yes",
     "FALCON_TRITON_GATE_FOLD must be 'off' or 'on', got 'yes'"),
    (KT + "chunk", "DQ_SUM", "FALCON_TRITON_3_DQ_SUM", "kernel", "gpu",
     "FALCON_TRITON_3_DQ_SUM must be 'kernel' or 'host', got 'gpu'"),
    (KT + "pair_sum", "PAIR_SUM", "FALCON_TRITON_3_PAIR_SUM", "triton", "cuda",
     "FALCON_TRITON_3_PAIR_SUM must be 'triton' or 'torch', got 'cuda'"),
    # the banded 3A's backward value block
    (KT + "window_linear", "WL_BWD_BV", "FALCON_TRITON_3A_BWD_BV", "32", "48",
     "FALCON_TRITON_3A_BWD_BV must be '16', '32', '64' or '128', got '48'"),
    (KT[:-1], "_FALCON_3A_PACKED", "FALCON_TRITON_3A_PACKED", "delayed", "band",
     "FALCON_TRITON_3A_PACKED must be 'scans', 'banded' or 'delayed', got 'band'"),
    # Falcon-3A's delayed form (one Falcon-1A scan plus a band) and the split diagonal blocks of Falcon-2A / -2
    (KT[:-1], "_FALCON_3A", "FALCON_TRITON_3A", "delayed", "delay",
     "FALCON_TRITON_3A must be 'scans', 'banded' or 'delayed', got 'delay'"),
    (KT + "percol", "DIAG", "FALCON_TRITON_2A_DIAG", "split", "dots",
     "FALCON_TRITON_2A_DIAG must be 'broadcast', 'split' or 'split16', got 'dots'"),
    (KT + "window_linear", "WL_WEIGHTS", "FALCON_TRITON_3A_WEIGHTS", "band", "bands",
     "FALCON_TRITON_3A_WEIGHTS must be 'shifted' or 'band', got 'bands'"),
    (KT + "window_linear", "WL_CHUNK", "FALCON_TRITON_3A_CHUNK", "64", "16",
     "FALCON_TRITON_3A_CHUNK must be '64' or '32', got '16'"),
    (KT + "chunk", "STATE_DTYPE", "FALCON_TRITON_STATE_DTYPE", "input", "bf16",
     "FALCON_TRITON_STATE_DTYPE must be 'fp32' or 'input', got 'bf16'"),
    (KT + "common", "LINEAR_KSPLIT", "FALCON_TRITON_LINEAR_KSPLIT", "scalar", "yes",
     "FALCON_TRITON_LINEAR_KSPLIT must be 'off', 'scalar' or 'on', got 'yes'"),
    # the on/off switches take 0 or 1 only (any other value used to mean "off", silently)
    (KT + "common", "POISON", "FALCON_TRITON_POISON", None, "true",
     "FALCON_TRITON_POISON must be '0' or '1', got 'true'"),
    (KT + "host", "UNPROVEN", "FALCON_TRITON_UNPROVEN", None, "yes",
     "FALCON_TRITON_UNPROVEN must be '0' or '1', got 'yes'"),
    (KT[:-1], "_TF32", "FALCON_TRITON_TF32", None, "on", "FALCON_TRITON_TF32 must be '0' or '1', got 'on'"),
    # Falcon-3's step-only terms on the chunk's steps (chunk.py _srows)
    (KT + "chunk", "STEP_ROWS", "FALCON_TRITON_3_STEP_ROWS", "after", "yes",
     "FALCON_TRITON_3_STEP_ROWS must be 'off', 'after' or 'on', got 'yes'"),
    # the prep under torch.compile: Falcon-3's as custom operators (prep_ops.py), the others traced
    (KT[:-1], "_PREP_COMPILED", "FALCON_TRITON_PREP_COMPILED", "auto", "ops",
     "FALCON_TRITON_PREP_COMPILED must be 'auto', 'traced' or 'op', got 'ops'"),
    # Falcon-2's forward state pass by sub-blocks; =rows the row substitution, =blocked both passes by blocks
    (KT + "percol_delta", "SOLVE", "FALCON_TRITON_2_SOLVE", "blocked_inv", "block",
     "FALCON_TRITON_2_SOLVE must be 'rows', 'fwd', 'blocked', 'inv', 'blocked_inv' or 'fused_inv', got 'block'"),
    (KT + "percol_delta", "INV_FORM", "FALCON_TRITON_2_INV", "prod", "rows",
     "FALCON_TRITON_2_INV must be 'tile' or 'prod', got 'rows'"),
    (KT + "percol_delta", "INV_WARPS", "FALCON_TRITON_2_INV_WARPS", "4", "2",
     "FALCON_TRITON_2_INV_WARPS must be '4' or '8', got '2'"),
    (KT + "percol_delta", "INV_KEEP", "FALCON_TRITON_2_INV_KEEP", "recompute", "keep",
     "FALCON_TRITON_2_INV_KEEP must be 'recompute' or 'save', got 'keep'"),
    (KT + "percol_delta", "SOLVE_BLK_WARPS", "FALCON_TRITON_2_SOLVE_BLK_WARPS", "4", "16",
     "FALCON_TRITON_2_SOLVE_BLK_WARPS must be '8' or '4', got '16'"),
    (KT + "percol_delta", "SOLVE_BLK_BV", "FALCON_TRITON_2_SOLVE_BLK_BV", "64", "16",
     "FALCON_TRITON_2_SOLVE_BLK_BV must be '32' or '64', got '16'"),
    (KT + "percol", "FWD_SB_WARPS", "FALCON_TRITON_2A_FWD_SB_WARPS", "4", "2",
     "FALCON_TRITON_2A_FWD_SB_WARPS must be '4' or '8', got '2'"),
    (KT + "percol", "FWD_SB_BV", "FALCON_TRITON_2A_FWD_SB_BV", "64", "128",
     "FALCON_TRITON_2A_FWD_SB_BV must be '32' or '64', got '128'"),
    # ... and its solve's gradients by sub-blocks; =exact the broadcast
    (KT + "percol_delta", "BWD_SOLVE", "FALCON_TRITON_2_BWD_SOLVE", "blocked", None, None),
    # the blocked reverse pass's launch ("4,0,x32", the one proven on the H200)
    (KT + "percol_delta", "BLK_BWD", "FALCON_TRITON_2_BLK_BWD", (4, 0, 2, False), "3,0",
     "FALCON_TRITON_2_BLK_BWD must be 'warps,bv'"),
]


@pytest.fixture(scope="module")
def typo_imports():
    """Each switch's typo imported in a fresh falcon_lab (interp_helpers.import_many_with: one interpreter, a fork per
    switch; 35 interpreter starts took 80 s of the suite's 300 s on the 2-core machine): var -> dict(returncode,
    stderr)."""
    rows = [s for s in SWITCHES if s[4] is not None]
    outs = import_many_with([(module, {var: typo}) for module, _a, var, _d, typo, _m in rows])
    return {s[2]: o for s, o in zip(rows, outs)}


@pytest.mark.parametrize("module, attr, var, default, typo, msg", SWITCHES, ids=[s[2] for s in SWITCHES])
def test_kernel_switch_defaults_and_typos(module, attr, var, default, typo, msg, typo_imports):
    """Each switch defaults to its proven form unless the environment sets it, and a typo is refused at import,
    naming the variable."""
    import importlib

    if default is not None and var not in os.environ:
        assert getattr(importlib.import_module(module), attr) == default
    if typo is not None:
        out = typo_imports[var]
        assert out["returncode"] != 0 and msg in out["stderr"], out["stderr"][-500:]


def test_unproven_forms_are_refused_on_cuda_only(monkeypatch):
    """host.refuse_unproven, the one gate of every opt-in kernel form not yet proven on the H200: a CUDA device is
    refused, naming the setting and the proven value, unless FALCON_TRITON_UNPROVEN=1; CPU tensors (the interpreter)
    pass."""
    import torch

    from falcon_lab.kernels.triton import host

    monkeypatch.setattr(host, "UNPROVEN", False)
    with pytest.raises(RuntimeError, match=r"FALCON_TRITON_A_INV=prod is not yet proven on the H200; .*"
                                           r"FALCON_TRITON_UNPROVEN=1 \(=subst is proven\)"):
        host.refuse_unproven(torch.device("cuda"), "FALCON_TRITON_A_INV=prod", "=subst")
    host.refuse_unproven(torch.device("cpu"), "FALCON_TRITON_A_INV=prod", "=subst")
    monkeypatch.setattr(host, "UNPROVEN", True)
    host.refuse_unproven(torch.device("cuda"), "FALCON_TRITON_A_INV=prod", "=subst")


def test_forking_importer_sees_a_fresh_environment():
    """import_many_with's children import falcon_lab afresh: a valid value is taken, a typo is refused, the same
    switch in two children is read twice (not cached between them)."""
    import json as _json

    outs = import_many_with([("falcon_lab.kernels.triton.chunk", {"FALCON_TRITON_A_INV": "prod"}),
                             ("falcon_lab.kernels.triton.chunk", {"FALCON_TRITON_A_INV": "nope"}),
                             ("falcon_lab.kernels.triton.chunk", {"FALCON_TRITON_A_INV": "subst"})])
    assert [o["returncode"] for o in outs] == [0, 1, 0], _json.dumps(outs)[-1000:]
    assert "FALCON_TRITON_A_INV must be 'subst' or 'prod', got 'nope'" in outs[1]["stderr"]
