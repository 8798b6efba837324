"""The pair gradients of Falcon-3's in-place pseudo-tokens, summed in one kernel (ours).

With FALCON_TRITON_3=gather (chunk.py, `gather=True`) pseudo-token (t, m) of step t reads pair t + W - 1 - m of the
pair stream (x, v: T + W - 1 rows), and the backward writes one gradient row per pseudo-token: dxe, dve of shape
[B, T, W, H, D]. The gradient of pair p is the sum of its W readers,

    dx[p] = Σ_m dxe[p - (W - 1) + m, m]      (the terms whose step index lies in 0 .. T - 1)

in fp32, in the order m = 0, 1, ..., W - 1, rounded once to the pair stream's dtype. chunk_backward used to form it on
the host as W strided `+=` into an fp32 buffer per tensor, then a cast: on the H200 at (16, 2048, 12, 64), W = 4,
Falcon-3's fwd+bwd (8.2 ms) ran 13 `aten::add_` per call, 1.13 ms (those 8 and the autograd engine's gradient
accumulations; benchmarks/results/h200_logs/kernels_2026-12-03g/call4/profile1/). Here it is one read of dxe and one
write of dx, the same additions in the same order (so the same result; Triton's CPU interpreter rounds bf16 casts
toward zero, so there one bf16 step off), and no fp32 buffer. FALCON_TRITON_3_PAIR_SUM=triton selects it (the
default since 2026-12-03, sixteenth session: Falcon-3's 25 check rows passed with it on the H200,
benchmarks/results/h200_logs/kernels_2026-12-03h/call1/); =torch keeps the host loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host import cdiv, env_choice, next_pow2

PAIR_SUM = env_choice("FALCON_TRITON_3_PAIR_SUM", "triton", ("triton", "torch"),
                      "Falcon-3 in place: the pair gradients summed in one kernel or on the host")


@triton.jit
def _pair_sum(SRC, DST, TS, XT, H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
              BD: tl.constexpr):
    """Program (pair-row block, b·H + h): rows p of DST [B, XT, H, D] from SRC [B, TS, W, H, D]."""
    pb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    p = pb * BT + tl.arange(0, BT)
    cd = tl.arange(0, BD)
    dmask = cd < D
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for m in tl.static_range(W):
        t = p - (W - 1) + m
        ok = (t >= 0) & (t < TS)
        row = ((b * TS + t) * W + m) * H + h
        acc += tl.load(SRC + row[:, None] * D + cd[None, :], mask=ok[:, None] & dmask[None, :], other=0.).to(
            tl.float32)
    out = (b * XT + p) * H + h
    tl.store(DST + out[:, None] * D + cd[None, :], acc.to(DST.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=(p < XT)[:, None] & dmask[None, :])


def pair_sum(src: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """src [B, T, W, H, D] (per pseudo-token) -> [B, rows, H, D] in `dtype`: row p the sum over m of
    src[:, p - (W - 1) + m, m] (zero where no step reads it; rows >= T + W - 1 too)."""
    B, Ts, W, H, D = src.shape
    src = src.contiguous()
    dst = torch.empty(B, rows, H, D, dtype=dtype, device=src.device)
    if PAIR_SUM == "triton":
        BD = next_pow2(D)
        BT = max(1, min(64, 4096 // BD))
        _pair_sum[(cdiv(rows, BT), B * H)](src, dst, Ts, rows, H, D, W, BT, BD)
        return dst
    acc = torch.zeros(B, rows, H, D, dtype=torch.float32, device=src.device)
    for m in range(W):
        acc[:, W - 1 - m:W - 1 - m + Ts] += src[:, :, m]
    return dst.copy_(acc)
