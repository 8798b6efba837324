"""`backend="triton"`: the Triton implementation of the Falcon core (docs/kernel-contract.md).

    core(q, xw, vw, eta, g, S0, *, delta, window, read_after, chunk_size) -> (o, S_T)

What runs where (docs/kernels-triton.md):
  * scalar gates, window 1, delta or linear (Falcon-1, Falcon-1A): chunk kernels, Triton forward and
    Triton backward (chunk.py);
  * scalar gates, window W > 1, linear (Falcon-3A): by default (since 2026-12-03) ONE scan with the window as a
    banded intra-chunk mask (window_linear.py, 2 <= W <= 16; at chunk <= 32 above K = 64, as K = 128 at chunk 64
    failed on the H200 on 2026-12-02). Proven on the H200: its whole `bench check --variants 3A` sweep, 29 of 29 rows
    without a failure at c2485d2 (the 22 core rows, bf16 and fp32, K = 16/64/128, every chunk size; the public op
    with ragged cu_seqlens and continuation; CUDA-graph decode; its 4 varlen-native rows "not implemented", as it
    has no packed form): benchmarks/results/h200_logs/kernels_2026-12-03b/call3_c2485d2/check_banded3a_sweep/; in
    the same run's `bench kernels` (benchmarks/results/kernels_h200.json) it took 0.56-0.68x the W scans' fwd+bwd
    time at lower peak memory. FALCON_TRITON_3A=scans / core(fused_window=False) keeps the sum of W shifted
    Falcon-1A scans, each one the same Triton kernels (W x the cost of Falcon-1A; proven on the H200), which also
    run every packed call (cu_seqlens) and windows W > 16 whatever the setting;
  * T = 1 without gradients (decoding): one fused kernel (decode.py); on CUDA used for all six, whose
    graph-replayed output was checked on the H200 (Falcon-3 and -3A since 2026-12-03; Falcon-3's graph capture had
    failed there once, with cuSOLVER in its prep, since removed);
  * the op's prep in plain eager calls: for window 1 (Falcon-1, -1A, -2, -2A) one fused kernel each way (prep.py
    here; proven on the H200 2026-12-02 through the public op's rows of `bench check`); for Falcon-3A one forward
    and two backward kernels (prep_window.py; interpreter-tested, on CUDA only with FALCON_TRITON_UNPROVEN=1);
    Falcon-3 and torch.compile use the PyTorch prep (falcon_lab/kernels/prep.py);
  * scalar gates, window W > 1, delta (Falcon-3), W dividing 16: the same chunk kernels on the
    pseudo-token expansion (falcon-math.md §6.6: T·W pseudo-tokens, block-strict mask so every residual
    of a step uses S_{t-1}). Proven on the H200 (W = 4, bf16 and fp32, fwd+bwd, through the op). The default for
    unpacked calls since 2026-12-03 (FALCON_TRITON_3=gather / core(fused_window=True)): the kernels read the
    pseudo-tokens in place from q, η, log γ and the pair stream, so the host makes no W-fold copies of the inputs,
    the output or their gradients (every row of its H200 check sweep it implements passed; −12 to −14 % peak and
    −4 to −14 % fwd+bwd time against the expansion); FALCON_TRITON_3=expand / fused_window=False expands on the host;
  * per-column gates, linear (Falcon-2A): percol.py, the intra-chunk decays by 16-row sub-blocks, the blocks below
    the diagonal as tensor-core dots (also for Falcon-2; the default since 2026-12-03: all 34 rows of `bench check
    --quick --variants 2A,2` passed on the H200, at 0.79-0.84x the time of the exact [C, C, 4]-column broadcast,
    which FALCON_TRITON_2A=exact keeps). Both proven on the H200 (bf16 and fp32, fwd+bwd, through the op);
  * per-column gates with delta (Falcon-2): percol_delta.py, per-column forward/backward substitution
    in the state passes, the rest shared with Falcon-2A. Proven on the H200 (2026-12-02, 3e9d5f3: all 29 rows of
    `bench check --variants 2`, bf16 and fp32, K = V = 16/64/128, every chunk size, the public op, CUDA-graph
    decode and native varlen). Before that its bf16 backward crashed at K = V = 128, C = 64 (issue 15: an
    out-of-range shared/local address in _pcd_bwd_state at 4 warps; now 8 warps) and its fp32 row K = V = 16,
    C = 64 was wrong in every gradient _pcd_bwd_state feeds (now fp32 value tiles >= 32);
  * packed sequences (cu_seqlens) for Falcon-1, -1A, -2, -2A, the Falcon-3A scans and Falcon-3's expansion: the chunk
    kernels read the packed batch (VARLEN branches in chunk.py, percol.py, percol_delta.py, and in the window-1 fused
    prep, prep.py; windowed variants' pair stream packs each sequence's W-1 carried rows before its pairs; Falcon-3's
    pseudo-tokens of sequence s start at cu[s]·W), no padding to [N, T_max]; interpreter-tested against float64 and
    proven on the H200 (bf16 and fp32, C = 16 and 64; Falcon-3's since 2026-12-03); a packed Falcon-3A call runs
    the delayed form's packed kernels (FALCON_TRITON_3A_PACKED=delayed, proven 2026-12-04, the default since), the
    banded scan's packed form (FALCON_TRITON_3A_PACKED=banded, proven 2026-12-04) or, with
    FALCON_TRITON_3A_PACKED=scans or FALCON_TRITON_3A=scans, the W scans natively, and a packed Falcon-3 call its expansion
    under either FALCON_TRITON_3; FALCON_TRITON_VARLEN=pad pads every variant;
CPU tensors run under the Triton interpreter, which needs TRITON_INTERPRET=1 in the environment
before triton is first imported (the tests start a subprocess for that).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..spec import FalconSpec
from .decode import decode_step
from .eig import window_ok as eig_window_ok
from .host import UNPROVEN, env_choice
from .ops import chunk_core, plain_eager
from .prep import fused_prepare
from .window_linear import BW as WINDOW_LINEAR_MAX_W, chunk_for as window_chunk_for

__all__ = ["core", "check", "supports", "decode_step", "interpreter_active", "prep_check", "fused_prepare",
           "varlen_check", "eig_check", "PROVEN_CHUNK", "PROVEN_DECODE", "PROVEN_EIG", "PROVEN_PREP",
           "PROVEN_VARLEN"]


def _read_interpret() -> bool:
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Read once at import (Triton itself reads TRITON_INTERPRET when it is imported): plain module constants
# keep the dispatch below traceable by torch.compile (Dynamo cannot call Triton's C getenv).
_INTERPRET = _read_interpret()
_UNPROVEN = UNPROVEN  # FALCON_TRITON_UNPROVEN (host.py)
_TF32 = env_choice("FALCON_TRITON_TF32", "0", ("0", "1"),
                   "1: fp32 inputs' dots at tf32 (allow_tf32) instead of full precision") == "1"
# Falcon-3A: "banded" (window_linear.py, one scan with the window as a banded intra-chunk mask; the default since
# 2026-12-03: its whole `bench check --variants 3A` sweep, 29/29 rows without a failure on the H200 at c2485d2,
# benchmarks/results/h200_logs/kernels_2026-12-03b/call3_c2485d2/check_banded3a_sweep/ (README.md in
# kernels_2026-12-03b/), at 0.56-0.68x the W scans' fwd+bwd time in the same run's benchmarks/results/kernels_h200.json)
# or "scans" (W Falcon-1A scans, proven on the H200; the opt-out). Windows above the banded kernel's 16 run the scans
# either way; packed calls (cu_seqlens) follow FALCON_TRITON_3A_PACKED too. Ours; `core(fused_window=)` overrides it
# per call.
# "delayed" (ours, written 2026-12-04, twentieth session; window_delayed.py; the default for unpacked calls since then):
# ONE Falcon-1A scan (chunk.py) on the pair stream's oldest slot with each pair's completed weight c_t, plus the W - 1
# pairs still inside a window as a band of row dots (o' + band, memory-bound); unpacked calls with W <= 16 only (packed
# ones follow FALCON_TRITON_3A_PACKED, W > 16 the scans). On the H200 (torch 2.11, Triton 3.6; benchmarks/results/
# h200_logs/kernels_2026-12-04d/call1/) at 0dbc292: all 29 rows of `bench check --variants 3A` with it (NaN-poisoned,
# bf16 + fp32, K = 16/64/128, every chunk size, the public op, CUDA-graph decode; the varlen-native rows run the
# banded scan's packed form), and in one process (switch_ab.py, 2 rounds, GPU time) Falcon-3A's fwd+bwd took 0.526 /
# 0.539 / 0.569 / 0.467x the banded scan's at 16x2048x12x64, 1x32768x6x128, 4x8192x12x64, 16x2048x6x128, peak 923 ->
# 652 MB (K = 64) and 1541 -> 712 MB (K = 128). Then (call 2) the same with the final state's band inside _wd_band_fwd
# and no zero fills (its host time: see window_delayed.py).
_FALCON_3A = env_choice("FALCON_TRITON_3A", "delayed", ("scans", "banded", "delayed"),
                        "Falcon-3A: one scan plus a band (delayed), one banded scan or W Falcon-1A scans (all proven)")
PROVEN_3A_DELAYED = True  # 29/29 rows of the 3A sweep on the H200 (2026-12-04, 0dbc292)
# Falcon-3A's packed calls (cu_seqlens; ours, 2026-12-04, eighteenth session): "banded" (the default since the
# nineteenth session: the one banded scan reads the packed batch: window_linear.py's
# VARLEN branches, each sequence's steps, pairs and chunk slots from the packed plan; interpreter-tested against
# float64; proven on the H200 on 2026-12-04, nineteenth session, at 6cfcede: all 29 rows of `bench check --variants
# 3A` with it, the four varlen-native rows running the banded scan (native = 1), NaN-poisoned, bf16 + fp32;
# benchmarks/results/h200_logs/kernels_2026-12-04c/call1/) or "scans" (the W Falcon-1A scans read it, proven on the H200:
# PROVEN_VARLEN; the default before). Why: a packed Falcon-3A call costs W Falcon-1A scans. Measured on the H200
# (experiments/h200/varlen_bench.py: 48 documents, 32768 tokens, H = 12, K = V = 64, bf16 fwd+bwd, call2/ there):
# 12.30 ms with the scans, 7.29 ms with the banded scan (0.59x; peak 2509 MB either way; two processes back to back).
# "delayed" (ours, 2026-12-04, twentieth session; window_delayed.py's VARLEN branches: the Falcon-1A scan on the packed
# pair stream, the band kernels with each row's sequence; the default since the twenty-first session): interpreter-
# tested against float64; proven on the H200 at d1c5a27 (torch 2.11, Triton 3.6; benchmarks/results/h200_logs/
# kernels_2026-12-04e/call1/check_x_pd/): rows 23-29 of `bench check --variants 3A` with it, every row that takes a
# packed path (the public op with ragged cu_seqlens + continuation, bf16 and fp32; the four varlen-native rows,
# native = 1, NaN-poisoned), all pass; rows 1-22 are unpacked calls, which it does not touch. Timed on the same
# machine (varlen_bench.py, 48 documents, 32768 tokens, H = 12, K = V = 64, bf16 fwd+bwd, one process per form,
# call1/varlen3a_*): 6.07 ms against the banded scan's 7.25 (0.84x; Falcon-1A in the same processes 3.83 / 3.27 ms,
# so 3A / 1A 1.58 against 2.22), peak 2509 MB either way.
_FALCON_3A_PACKED = env_choice("FALCON_TRITON_3A_PACKED", "delayed", ("scans", "banded", "delayed"),
                               "Falcon-3A's packed calls: the delayed form, the one banded scan or the W scans "
                               "(all proven)")
PROVEN_3A_PACKED = True  # the banded scan's packed form on the H200 (29/29 rows, 2026-12-04 at 6cfcede)
PROVEN_3A_PACKED_DELAYED = True  # the delayed form's packed rows (23-29) on the H200 (2026-12-04 at d1c5a27)
# Falcon-3: "gather" (the chunk kernels read the T·W pseudo-tokens in place from q, η, log γ and the pair stream: no
# expanded copies of the inputs, outputs or their gradients; the default for unpacked calls since 2026-12-03,
# fourteenth session: every row of `bench check --variants 3` it implements passed on the H200 with the split
# _bwd_main (3a650c1/71520f4: rows 1-20 and 21-25; rows 26-29 are packed calls, which take the expansion), fwd+bwd
# 8.25 / 12.05 / 8.99 / 7.23 ms against the expansion's 9.60 / 12.60 / 10.36 / 8.35 at the benchmark's four shapes,
# peak 3481 vs 4026 MB at (16, 2048, 12, 64): benchmarks/results/h200_logs/kernels_2026-12-03f/) or "expand" (the
# pseudo-tokens materialised on the host, proven on the H200; what packed calls run). Ours; `core(fused_window=)`
# overrides it per call.
_FALCON_3 = env_choice("FALCON_TRITON_3", "gather", ("expand", "gather"),
                       "Falcon-3 (unpacked calls): pseudo-tokens read in place or expanded on the host (both proven)")
# The op's prep for window 1 with the Triton backend: "fused" (prep.py here, one kernel each way, plain eager calls)
# or "torch" (falcon_lab/kernels/prep.py; under torch.compile as FALCON_TRITON_PREP_COMPILED says). Ours.
_PREP = env_choice("FALCON_TRITON_PREP", "fused", ("fused", "torch"),
                   "the op's prep (features, gates, NLMS step): fused Triton kernels or PyTorch")
# The prep of a call that torch.compile traces (or that runs under a dispatch mode) (ours): "traced" (the PyTorch prep,
# fused by Inductor with the glue around it; the only way until 2026-12-05), "op" (the fused Triton prep as the custom
# operators falcon_lab::prep_fwd / prep_bwd, prep_ops.py: the same kernels as the eager op, opaque to the compiler) or
# "auto" (the default: "op" for Falcon-3, "traced" for the others). Falcon-3's traced prep is the window Gram and 20
# squarings of [W, W] matrices as batched cuBLAS products. On the H200 (2026-12-05, twenty-fourth session, 197829d,
# benchmarks/results/h200_logs/kernels_2026-12-05b/call1/: the small model compiled, T = 2048, B = 16, one process
# per form) "op" took Falcon-3.3 from 158.7k to 253.0k tokens/s (0.32x -> 0.51x the compiled Transformer's 500.8k;
# one step's CUDA time 207.0 -> 125.3 ms, of which 80.4 ms had been 756 cuBLAS gemmSN_NN calls) for +0.6 GiB peak,
# while Falcon-1.3 358.0k vs 355.8k (same), Falcon-2A.3 230.4k vs 235.7k and Falcon-3A.3 347.8k vs 365.8k were
# faster traced: Inductor fuses their elementwise preps into the glue. A packed Falcon-3 call (no fused window prep
# for packed sequences) traces the PyTorch prep but, unless "traced", takes μ_t's squarings from eig.py's kernel as
# the custom operator falcon_lab::top_eigvec (eig_check), not as ~90 traced batched products.
_PREP_COMPILED = env_choice("FALCON_TRITON_PREP_COMPILED", "auto", ("auto", "traced", "op"),
                            "the prep under torch.compile: the PyTorch prep traced, the fused kernels as custom "
                            "operators, or auto (custom operators for Falcon-3 only)")
# Packed sequences (cu_seqlens): "native" (the chunk kernels read the packed batch: Falcon-1, -1A, -2, -2A, 3A scans)
# or "pad" (gathered into right-padded rows [N, T_max] first, every variant). Ours.
_VARLEN = env_choice("FALCON_TRITON_VARLEN", "native", ("native", "pad"),
                     "packed sequences (cu_seqlens): read by the kernels or padded to [N, T_max] first")


def interpreter_active() -> bool:
    return _INTERPRET


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _unproven_enabled() -> bool:
    return _UNPROVEN


# Variants proven on the H200 (torch 2.11, Triton 3.6) against the float64 loop, forward and backward,
# bf16 and fp32, NaN-poisoned outputs: benchmarks/results/triton_check_h200_final.md (commit 9f41112).
PROVEN_CHUNK = {"1", "1A", "3A", "3", "2A", "2"}  # Falcon-3 with a window dividing 16
# Falcon-2: all 29 rows of `bench check --variants 2` (2026-12-02, 3e9d5f3, one process, NaN-poisoned outputs):
# benchmarks/results/h200_logs/kernels_2026-12-02f/call1_3e9d5f3/check_f2/.
# The fused decode step's graph-replayed output was checked for Falcon-1 and Falcon-2A (run 4), Falcon-1A and
# Falcon-2 (2026-12-02, kernels_2026-12-02e: `bench check` decode-graph rows, 1.3e-7 and 1.4e-7); the Falcon-3
# capture failed once (cudaErrorStreamCaptureInvalidated, with cuSOLVER in the prep) and 3A was not reached.
# Falcon-3 and -3A: their decode-graph rows in the whole sweeps of 2026-12-03 (5bb2636; kernels_2026-12-03/).
PROVEN_DECODE = {"1", "1A", "2", "2A", "3", "3A"}


# The fused prep (prep.py) on the H200 (torch 2.11, Triton 3.6, 2026-12-02 at 9549d0c): every public-op row of
# `bench check` (ragged cu_seqlens, continuation from a state, bf16 and fp32, gradients of q, k, v, beta, lam) for
# Falcon-1, -1A, -2A and -2 and their CUDA-graph decode rows passed with it, and `bench kernels` checked every
# window-1 op against float64 before timing it: benchmarks/results/h200_logs/kernels_2026-12-02e/.
# Since then their code shares helpers with Falcon-3A's windowed prep (prep_window.py): the same arithmetic (a
# per-column sum now divides before summing), interpreter-tested, not re-run on the GPU (experiments/h200/NEXT.md).
# Falcon-3A's windowed prep (prep_window.py): its public-op rows with FALCON_TRITON_VARLEN=pad (2/2) and its packed
# branch inside the varlen-native rows (4/4) passed on the H200 (2026-12-03, 1df2a02):
# benchmarks/results/h200_logs/kernels_2026-12-03/call2_1df2a02/check_prep3a/ and check_varlen3a/.
# Falcon-3's whole prep fused (prep_window.py with eig: the window Gram, μ_t by the squarings in registers, the gates,
# the key gradients): the 7 rows of its `bench check` whose prep runs (public op bf16 and fp32, CUDA-graph decode,
# varlen-native) passed on the H200 (2026-12-03, 5e0a3b1), and `bench kernels` checked it against float64 before
# timing it: fwd+bwd 16.88 -> 11.58 ms, peak 4526 -> 3744 MB at (16, 2048, 12, 64) against the PyTorch prep + eig.py,
# same call (benchmarks/results/h200_logs/kernels_2026-12-03c/call1_5e0a3b1/check_f3prep/, kernels_f3prep_*/).
PROVEN_PREP = {"1", "1A", "2", "2A", "3A", "3"}

# Native packed sequences (chunk.py's VARLEN kernels, 2026-12-02): interpreter-tested against float64. The GPU
# check's varlen-native rows (bf16 and fp32, C = 16 and 64, per-sequence states and final states, every gradient)
# run the fused prep's packed branch as well, so passing them proves both. On the H200 (torch 2.11, Triton 3.6):
# Falcon-2's four rows passed at 3e9d5f3 (kernels_2026-12-02f/call1_3e9d5f3/check_f2/), and `bench check --variants
# 1,1A,2A,3A --kinds varlen-native` exited 0 with 16 of 16 rows passing at ac9f58e (call4_ac9f58e/: that call's
# row log did not come back, its exit code and counts did). Falcon-3 (its host expansion, FALCON_TRITON_3=expand,
# packed): 4/4 varlen-native rows on 2026-12-03 at 1df2a02 (kernels_2026-12-03/call2_1df2a02/check_f3varlen/).
PROVEN_VARLEN: set = {"1", "1A", "2", "2A", "3", "3A"}


def varlen_check(spec: FalconSpec, *, window: int, device_type: str = "cuda") -> tuple[bool, str]:
    """(whether a Triton-backend call with cu_seqlens runs the packed batch natively, why); else it is padded."""
    if _VARLEN != "native":
        return False, "FALCON_TRITON_VARLEN=pad"
    # Falcon-3A: `core` runs a packed call in its delayed form (FALCON_TRITON_3A_PACKED=delayed, the default, proven:
    # PROVEN_3A_PACKED_DELAYED), as its banded scan (=banded, proven: PROVEN_3A_PACKED) or as the W scans, natively
    # every way (proven: "3A" in PROVEN_VARLEN)
    if device_type == "cuda" and not (spec.variant in PROVEN_VARLEN or _unproven_enabled()):
        return False, (f"the native packed-sequence kernels of {spec.label} are not proven on the H200 "
                       "(FALCON_TRITON_UNPROVEN=1 runs them anyway)")
    if spec.window(window) != 1 and not spec.delta:
        W = spec.window(window)
        how = ("its delayed form" if _delayed_3a(W, None, True) else "its banded scan" if _banded_3a(W, None, True)
               else "its W scans")
        return True, f"native packed sequences (chunk kernels read cu_seqlens; Falcon-3A as {how})"
    if spec.window(window) != 1:  # the in-place pseudo-tokens (FALCON_TRITON_3=gather) have no packed form
        return True, "native packed sequences (chunk kernels read cu_seqlens; Falcon-3 on its host expansion)"
    return True, "native packed sequences (chunk kernels read cu_seqlens)"


def prep_check(spec: FalconSpec, *, window: int, dtype: torch.dtype, device_type: str = "cuda") -> tuple[bool, str]:
    """(whether a Triton-backend call prepares its core inputs with the fused prep kernels, why)."""
    if _PREP != "fused":
        return False, "FALCON_TRITON_PREP=torch"
    W = spec.window(window)
    if W != 1 and spec.delta and not eig_window_ok(W):
        return False, f"Falcon-3's fused prep (μ_t's squarings in the kernel) takes windows 2, 4, 8, 16, got {W}"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False, f"the fused prep computes in fp32 at most, got {dtype}"
    traced = not plain_eager()
    as_op = _PREP_COMPILED == "op" or (_PREP_COMPILED == "auto" and spec.delta and W != 1)
    if traced and not as_op:
        return False, (f"torch.compile / a dispatch mode: the PyTorch prep is traced (Inductor fuses it; "
                       f"FALCON_TRITON_PREP_COMPILED={_PREP_COMPILED}; =op runs the fused kernels as custom operators)")
    if device_type == "cuda" and not (spec.variant in PROVEN_PREP or _unproven_enabled()):
        return False, (f"the fused prep of {spec.label} is not proven on the H200 "
                       "(FALCON_TRITON_UNPROVEN=1 runs it anyway)")
    if traced:
        return True, "fused prep kernels as custom operators (torch.compile / a dispatch mode; prep_ops.py)"
    return True, "fused prep kernels"


# Falcon-3's μ_t squarings in one kernel (eig.py, ours): on the H200 (2026-12-03, 81ff606) the rows of Falcon-3's
# `bench check` whose prep runs it (public op bf16 and fp32 with ragged cu_seqlens and continuation, CUDA-graph
# decode, the four varlen-native rows) passed 7 of 7, and `bench kernels` checked it against float64 before timing
# it: benchmarks/results/h200_logs/kernels_2026-12-03b/call4_81ff606/ (check_eig/, kernels_eig_*/).
PROVEN_EIG = True


def eig_check(spec: FalconSpec, *, window: int, device_type: str = "cuda") -> tuple[bool, str]:
    """(whether a Triton-backend Falcon-3 call takes μ_t's top eigenvector from the one-kernel squarings (eig.py) in
    its otherwise PyTorch prep, why)."""
    W = spec.window(window)
    if not (spec.delta and W > 1):
        return False, "only Falcon-3 (window > 1, regression) has μ_t"
    if _PREP != "fused":
        return False, "FALCON_TRITON_PREP=torch"
    if not eig_window_ok(W):
        return False, f"the one-kernel squarings take windows 2, 4, 8, 16, got {W}"
    if not plain_eager() and _PREP_COMPILED == "traced":
        return False, ("torch.compile / a dispatch mode: the PyTorch squarings are traced (FALCON_TRITON_PREP_COMPILED="
                       "traced)")
    if device_type == "cuda" and not (PROVEN_EIG or _unproven_enabled()):
        return False, "the one-kernel squarings are not proven on the H200 (FALCON_TRITON_UNPROVEN=1 runs them anyway)"
    return True, "μ_t's squarings in one Triton kernel (eig.py)"


def check(spec: FalconSpec, *, window: int, T: int = 2, grad: bool = True,
          device_type: str = "cuda") -> tuple[bool, str]:
    """(whether `core` runs this configuration with Triton on this device type, why). On CUDA only
    variants proven on the H200 run unless FALCON_TRITON_UNPROVEN=1; the interpreter (CPU, CI) runs
    every kernel that exists."""
    unproven_ok = device_type == "cpu" or interpreter_active() or _unproven_enabled()
    W = spec.window(window)
    if T == 1 and not grad:
        if spec.variant in PROVEN_DECODE:
            return True, "fused decode kernel, proven on the H200"
        if unproven_ok:
            return True, "fused decode kernel (unproven on a GPU; interpreter or FALCON_TRITON_UNPROVEN=1)"
        return False, f"the decode kernel is not proven on the H200 for {spec.label}"
    if spec.per_column and W > 1:
        return False, "no per-column windowed kernel"
    if spec.delta and W > 1 and 16 % W:
        return False, f"Falcon-3's pseudo-token tiles need a window dividing 16, got {W}"
    if spec.variant in PROVEN_CHUNK:
        return True, "chunk kernels, proven on the H200"
    if unproven_ok:
        return True, "chunk kernels (unproven on a GPU; interpreter or FALCON_TRITON_UNPROVEN=1)"
    return False, (f"the {spec.label} chunk kernels are not proven on the H200 "
                   "(FALCON_TRITON_UNPROVEN=1 runs them anyway)")


def supports(spec: FalconSpec, *, window: int, T: int = 2, grad: bool = True, device_type: str = "cuda") -> bool:
    """Whether `core` runs this configuration with Triton (see `check` for why not)."""
    return check(spec, window=window, T=T, grad=grad, device_type=device_type)[0]


def core(q, xw, vw, eta, g, S0: Optional[torch.Tensor], *, delta: bool, window: int,
         read_after: bool, chunk_size: int, allow_tf32: Optional[bool] = None,
         fused_window: Optional[bool] = None, cu_seqlens: Optional[torch.Tensor] = None):
    """The Falcon core on Triton (shapes and semantics in docs/kernel-contract.md).

    cu_seqlens ([N+1] token offsets; B = 1; window 1, or window W > 1 (Falcon-3A's W scans or its banded scan,
    Falcon-3's expansion) with xw / vw the packed pair stream of T + N (W - 1) rows, each sequence's W - 1 carried
    rows before its pairs): the packed sequences run natively, each from its own S0 row (S0 and the returned S_T are
    [N, H, K, V]); no padding.

    fused_window: the window inside the kernels: Falcon-3A (window > 1, no delta) in one banded scan (True; with
    FALCON_TRITON_3A=delayed, calls run the delayed form: one Falcon-1A scan plus a band) or as W Falcon-1A scans
    (False), None following FALCON_TRITON_3A (default "delayed" since 2026-12-04, proven on the H200; a window above
    16 runs the scans; with cu_seqlens, FALCON_TRITON_3A_PACKED decides too, default the delayed form);
    Falcon-3 with its pseudo-tokens read in place (True) or expanded on the host (False), None following
    FALCON_TRITON_3 (default "gather" since 2026-12-03, proven on the H200; with cu_seqlens the expansion).

    allow_tf32: fp32 inputs use full-precision ("ieee") dots unless this is True (or the environment
    sets FALCON_TRITON_TF32=1). 16-bit inputs always use tensor-core dots with fp32 accumulation.
    """
    if q.device.type == "cpu":
        if not interpreter_active():
            raise RuntimeError(
                "backend='triton' on CPU tensors runs the Triton interpreter, which needs "
                "TRITON_INTERPRET=1 in the environment before triton is imported; use backend='torch' "
                "or move the tensors to CUDA")
    elif q.device.type != "cuda":
        raise RuntimeError(f"backend='triton' needs CUDA (or CPU under TRITON_INTERPRET=1) tensors, got {q.device}")
    if q.dtype == torch.float64:
        raise NotImplementedError("backend='triton' computes in fp32 at most; float64 inputs need backend='torch'")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q: unsupported dtype {q.dtype}")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    B, T, H, K = q.shape
    V = vw.shape[-1]
    if K > 256 or V > 256:
        raise ValueError(f"head sizes up to 256 are supported, got K={K}, V={V}")
    per_column = eta.dim() == 4
    W = int(window)
    rows = T + (W - 1) * (cu_seqlens.shape[0] - 1 if cu_seqlens is not None else 1)
    if xw.shape[1] != rows or vw.shape[1] != rows:
        raise ValueError(f"xw/vw must have T + (window - 1) x sequences = {rows} rows, got {xw.shape[1]}, "
                         f"{vw.shape[1]}")
    tf32 = allow_tf32 if allow_tf32 is not None else _TF32
    grad = _needs_grad(q, xw, vw, eta, g, S0)
    if T == 1 and not grad:
        return decode_step(q, xw.to(q.dtype), vw.to(q.dtype), eta, g, S0, delta=delta, window=W,
                           read_after=read_after)
    if per_column and W > 1:
        raise NotImplementedError(f"backend='triton' has no chunk kernel for per-column gates with window={W}; "
                                  "use backend='torch'")
    if cu_seqlens is not None and ((W != 1 and fused_window and (delta or W > WINDOW_LINEAR_MAX_W)) or B != 1):
        raise NotImplementedError("backend='triton' runs packed sequences (cu_seqlens) natively with B = 1 for "
                                  "Falcon-1, -1A, -2, -2A, Falcon-3A (its W scans, or its banded scan up to window "
                                  f"{WINDOW_LINEAR_MAX_W}) and Falcon-3's expansion, got window={W}, delta={delta}, "
                                  f"fused_window={fused_window}, B={B}")
    spec = FalconSpec.from_flags(delta=delta, per_column=per_column, windowed=W > 1)
    ok, why = check(spec, window=W, T=T, grad=grad, device_type=q.device.type)
    if not ok:
        raise NotImplementedError(f"backend='triton' has no chunk kernel for {spec.label} (window={W}) on "
                                  f"{q.device.type}: {why}; use backend='torch'")
    q = q.contiguous()
    xw = xw.to(q.dtype).contiguous()
    vw = vw.to(q.dtype).contiguous()
    eta = eta.float().contiguous()
    g = g.float().contiguous()
    S0 = S0.float().contiguous() if S0 is not None else None
    if per_column:
        return chunk_core(q, xw, vw, eta, g, S0, "percol_delta" if delta else "percol", (read_after, chunk_size, tf32),
                          cu_seqlens)
    # scalar family cfg: (delta, read_after, C, xoff, allow_tf32, out_fp32, group, gather) (ops.py)
    if W == 1:
        return chunk_core(q, xw, vw, eta, g, S0, "scalar", (delta, read_after, chunk_size, 0, tf32, False, 1, 0),
                          cu_seqlens)
    if delta:  # Falcon-3: pseudo-token (t, m) = pair xw[t + W-1-m]; decay on m = 0; groups of W
        if cu_seqlens is None and (fused_window if fused_window is not None else _FALCON_3 == "gather"):
            # the kernels read the pseudo-tokens in place (no expansion on the host; chunk.py _rows_w)
            return chunk_core(q, xw, vw, eta, g, S0, "scalar", (True, read_after, chunk_size, 0, tf32, False, W, 1))
        qe, xe, ve, ee, ge = _expand_window(q, xw, vw, eta, g, W, cu_seqlens)
        # packed: sequence s's T_s steps are its T_s·W pseudo-tokens, from cu[s]·W (a multiple of W, so the chunks of
        # each sequence start on a group boundary: C is a multiple of W)
        cu_e = cu_seqlens * W if cu_seqlens is not None else None
        o_e, s = chunk_core(qe, xe, ve, ee, ge, S0, "scalar", (True, read_after, chunk_size, 0, tf32, False, W, 0),
                            cu_e)
        # a copy of the every-W-th rows, so that the W-fold o_e is freed after the forward instead of living as the
        # returned view's storage until the backward (ours: 201 -> 50 MB kept at (16, 2048, 12, 64) bf16, W = 4)
        return o_e.view(B, T, W, H, V)[:, :, 0].contiguous(), s
    if _delayed_3a(W, fused_window, cu_seqlens is not None):
        proven = PROVEN_3A_PACKED_DELAYED if cu_seqlens is not None else PROVEN_3A_DELAYED
        if q.device.type == "cuda" and not (proven or _unproven_enabled()):
            raise RuntimeError("Falcon-3A's delayed form is not proven on the H200 for "
                               f"{'packed' if cu_seqlens is not None else 'unpacked'} calls; it runs on CUDA only "
                               "with FALCON_TRITON_UNPROVEN=1 (FALCON_TRITON_3A=banded, _PACKED=banded are proven)")
        return chunk_core(q, xw, vw, eta, g, S0, "window_delayed", (read_after, chunk_size, W, tf32), cu_seqlens)
    if _banded_3a(W, fused_window, cu_seqlens is not None):
        if cu_seqlens is not None and q.device.type == "cuda" and not (PROVEN_3A_PACKED or _unproven_enabled()):
            raise RuntimeError("Falcon-3A's banded scan on packed sequences is not proven on the H200; it runs on "
                               "CUDA only with FALCON_TRITON_UNPROVEN=1 (FALCON_TRITON_3A_PACKED=scans is proven)")
        C = window_chunk_for(q.shape[-1], chunk_size)  # K = 128, C = 64 failed on the H200 (window_linear.py)
        return chunk_core(q, xw, vw, eta, g, S0, "window_linear", (read_after, C, W, tf32), cu_seqlens)
    # Falcon-3A: S = Σ_m S^(m), scan m writes the pairs W-1-m rows back (falcon-math.md §4.1).
    o_sum, s_sum = None, None
    for m in range(W):
        o_m, s_m = chunk_core(q, xw, vw, eta, g, S0 if m == 0 else None, "scalar",
                              (False, read_after, chunk_size, W - 1 - m, tf32, True, 1, 0), cu_seqlens)
        o_sum = o_m if o_sum is None else o_sum + o_m
        s_sum = s_m if s_sum is None else s_sum + s_m
    return o_sum.to(q.dtype), s_sum


def _delayed_3a(W: int, fused_window: Optional[bool], packed: bool) -> bool:
    """Whether a Falcon-3A call (window W > 1, no delta) runs the delayed form (one Falcon-1A scan plus a band,
    window_delayed.py): FALCON_TRITON_3A=delayed for unpacked calls, FALCON_TRITON_3A_PACKED=delayed (with
    FALCON_TRITON_3A not "scans") for packed ones, fused_window not False (True asks for a window inside the kernels:
    this form or the banded scan); windows up to 16, as the banded scan (the weights' loops unroll W²)."""
    if fused_window is False or W > WINDOW_LINEAR_MAX_W:
        return False
    if packed:
        return _FALCON_3A_PACKED == "delayed" and _FALCON_3A != "scans"
    return _FALCON_3A == "delayed"


def _banded_3a(W: int, fused_window: Optional[bool], packed: bool) -> bool:
    """Whether a Falcon-3A call (window W > 1, no delta) runs the one banded scan: fused_window if given, else
    FALCON_TRITON_3A (and, for packed calls, FALCON_TRITON_3A_PACKED) with W within the kernel's tile (checked after
    _delayed_3a: under FALCON_TRITON_3A=delayed the packed calls it leaves run the banded scan)."""
    if fused_window is not None:
        return fused_window
    return (_FALCON_3A in ("banded", "delayed") and W <= WINDOW_LINEAR_MAX_W
            and (not packed or _FALCON_3A_PACKED == "banded"))


def _expand_window(q, xw, vw, eta, g, W: int, cu_seqlens: Optional[torch.Tensor] = None):
    """Falcon-3 as a WY recurrence over T·W pseudo-tokens (falcon-math.md §6.6): pseudo-token (t, m)
    carries the pair xw[t + W-1-m] with step η_t; log γ_t sits on m = 0 only, so the decay prefix is
    constant inside a group; the kernels' GROUP = W masks make the groups block-strict (Jacobi).
    cu_seqlens (B = 1): xw / vw are the packed pair stream (each sequence's W-1 carried rows before its pairs), so
    token t of sequence s has its pair at row t + (s + 1)(W-1) (ours; as kernels/prep.py packs it)."""
    B, T, H, K = q.shape
    if cu_seqlens is None:
        xs = torch.stack([xw[:, W - 1 - m: W - 1 - m + T] for m in range(W)], dim=2)
        vs = torch.stack([vw[:, W - 1 - m: W - 1 - m + T] for m in range(W)], dim=2)
    else:
        t = torch.arange(T, device=q.device)
        seq = torch.searchsorted(cu_seqlens[1:].to(q.device), t, right=True)
        pair = t + (seq + 1) * (W - 1)  # [T]: token t's own pair row
        rows = pair[:, None] - torch.arange(W, device=q.device)[None, :]  # [T, W]: pseudo-token (t, m)'s pair
        xs, vs = xw[:, rows], vw[:, rows]
    qe = q[:, :, None].expand(B, T, W, H, K)
    ee = eta[:, :, None].expand(B, T, W, H)
    ge = torch.cat([g[:, :, None], g.new_zeros(B, T, W - 1, H)], dim=2)
    return tuple(t.reshape(B, T * W, *t.shape[3:]).contiguous() for t in (qe, xs, vs, ee, ge))
