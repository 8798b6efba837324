"""Falcon-3's μ_t helper: the top eigenvector of many small symmetric PSD matrices (the W x W window Grams), in one
Triton kernel (ours).

`prep._largest_eig` takes μ_t (the window Gram's largest eigenvalue) by repeated squaring of the trace-normalised
matrix, P <- (P / tr P)^2, which turns it into its top eigenprojector; a column of P is then a top eigenvector v,
and μ_t is the Rayleigh quotient vᵀGv / vᵀv (with eigvalsh's gradient, v held constant). In PyTorch the squarings
are ~90 launches of batched 4 x 4 products over B·T·H matrices, the largest share of Falcon-3's prep. Here one
program holds BL matrices in registers and runs all the squarings, the diagonal argmax and the column pick; the
Rayleigh quotient and its gradient stay in PyTorch (`prep._largest_eig`), so the arithmetic that reaches the
loss is unchanged. The products are written as W rank-1 updates (Σ_k c_k c_kᵀ, P symmetric), not as a sum of a
broadcast product, which Triton's combiner would turn into a tf32 dot (tests/test_triton_lint.py).

Status: interpreter-tested against the PyTorch squarings and float64 eigvalsh (tests/test_triton_eig.py); proven on
the H200 on 2026-12-03 (the 7 rows of Falcon-3's `bench check` whose prep runs it) and on there by default
(`eig_check`, `PROVEN_EIG` in falcon_lab/kernels/triton/__init__.py). Same run, (16, 2048, 12, 64) bf16, the public
Falcon-3 op: 29.5 ms fwd+bwd with the PyTorch squarings, 16.9 ms with this kernel (host submit 25.4 -> 11.7 ms;
benchmarks/results/h200_logs/kernels_2026-12-03b/call4_81ff606/).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SQUARINGS = 20  # fp32, as prep._largest_eig (its error bound is there)
TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny: prep._largest_eig's clamp of the trace
SQUARINGS_C = tl.constexpr(SQUARINGS)  # the same two as constexpr globals, for jit code elsewhere (prep_window.py)
TINY_C = tl.constexpr(TINY)


def window_ok(n: int) -> bool:
    """Whether the squarings here take windows of n rows: powers of two from 2 to 16 (tl.arange's sizes)."""
    return 2 <= n <= 16 and not n & (n - 1)


@triton.jit
def _squarings_top(p, i, BL: tl.constexpr, W: tl.constexpr, SQ: tl.constexpr, TINY_: tl.constexpr):
    """[BL, W, W] symmetric PSD matrices p (i = tl.arange(0, W)) -> [BL, W], a top eigenvector of each: SQ squarings
    of the trace-normalised matrix, then the column of the largest diagonal. Also Falcon-3's fused prep's
    (prep_window._win_eig)."""
    eye = (i[:, None] == i[None, :])[None, :, :]
    for _ in tl.static_range(SQ):
        tr = tl.sum(tl.sum(tl.where(eye, p, 0.), 2), 1)
        p = p / tl.maximum(tr, TINY_)[:, None, None]
        q = tl.zeros([BL, W, W], dtype=tl.float32)
        for k in tl.static_range(W):
            c = tl.sum(tl.where((i == k)[None, None, :], p, 0.), 2)  # column k = row k (P is symmetric)
            q += c[:, :, None] * c[:, None, :]
        p = q
    d = tl.sum(tl.where(eye, p, 0.), 2)  # [BL, W]: the diagonal
    col = tl.argmax(d, 1)
    return tl.sum(tl.where(i[None, None, :] == col[:, None, None], p, 0.), 2)  # column `col` of P


@triton.jit
def _top_eigvec(G, VOUT, N, W: tl.constexpr, BL: tl.constexpr, SQ: tl.constexpr, TINY_: tl.constexpr):
    r = tl.program_id(0) * BL + tl.arange(0, BL)
    m = r < N
    r64 = r.to(tl.int64)
    i = tl.arange(0, W)
    p = tl.load(G + r64[:, None, None] * (W * W) + i[None, :, None] * W + i[None, None, :], mask=m[:, None, None],
                other=0.)
    v = _squarings_top(p, i, BL, W, SQ, TINY_)
    tl.store(VOUT + r64[:, None] * W + i[None, :], v, mask=m[:, None])


def _launch(gram: torch.Tensor) -> torch.Tensor:
    n = gram.shape[-1]
    g = gram.reshape(-1, n, n).contiguous()
    N = g.shape[0]
    v = torch.empty(N, n, dtype=torch.float32, device=g.device)
    BL = max(1, 1024 // (n * n))  # matrices per program: 1024 fp32 elements of P per program
    if N:
        _top_eigvec[(triton.cdiv(N, BL),)](g, v, N, n, BL, SQUARINGS, TINY)
    return v.view(*gram.shape[:-1], 1)


# The same kernel as a custom operator (ours, 2026-12-05): under torch.compile (a packed Falcon-3 call, whose window
# prep has no fused form, traces the PyTorch prep) the squarings stay one kernel instead of ~90 traced products.
@torch.library.custom_op("falcon_lab::top_eigvec", mutates_args=())
def top_eigvec_op(gram: torch.Tensor) -> torch.Tensor:
    return _launch(gram)


@top_eigvec_op.register_fake
def _(gram):
    return gram.new_empty(gram.shape[:-1] + (1,))


def top_eigvec(gram: torch.Tensor) -> torch.Tensor:
    """[.., n, n] symmetric PSD fp32 matrices (n a power of two <= 16) -> [.., n, 1] fp32, a top eigenvector of each
    (unnormalised; zero for a zero matrix), without gradient: what prep._largest_eig's squaring loop computes. Through
    the custom operator while torch.compile traces or a dispatch mode is active."""
    from .ops import plain_eager

    n = gram.shape[-1]
    if gram.dtype != torch.float32 or not window_ok(n) or gram.shape[-2] != n:
        raise ValueError(f"top_eigvec takes fp32 [.., n, n] with n a power of two in 2..16, got {gram.dtype} "
                         f"{tuple(gram.shape)}")
    if not plain_eager():
        return top_eigvec_op(gram.detach())
    return _launch(gram.detach())
