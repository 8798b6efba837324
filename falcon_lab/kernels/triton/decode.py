"""One fused Triton kernel for a single decoding step (T = 1 with a carried state), all six variants.

    S' = γ ⊙ S + η ⊙ Σ_{m<W} x_m (v_m - [delta] Sᵀ x_m)ᵀ ,   o = S'ᵀ q (read after) | Sᵀ q (before)

with γ, η scalars per (b, h) or per value column (variants 2/2A). All W residuals use the old S
(Jacobi). One launch per layer, no host synchronisation and fixed shapes, so it can be captured in
a CUDA graph. Forward only (decoding); training goes through the chunk kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _empty, _np2, cdiv


@triton.jit
def _decode_step(Q, XW, VW, ETA, G, S0, O, SN, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr,
                 PERCOL: tl.constexpr, READ_AFTER: tl.constexpr, HAS_S0: tl.constexpr):
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    vmask = cv < V
    smask = kmask[:, None] & vmask[None, :]
    soff = bh.to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    if HAS_S0:
        S = tl.load(S0 + soff, mask=smask, other=0.).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    q = tl.load(Q + bh.to(tl.int64) * K + ck, mask=kmask, other=0.).to(tl.float32)
    if PERCOL:
        eta = tl.load(ETA + bh.to(tl.int64) * V + cv, mask=vmask, other=0.).to(tl.float32)
        g = tl.load(G + bh.to(tl.int64) * V + cv, mask=vmask, other=0.).to(tl.float32)
        acc = S * tl.exp(g)[None, :]
    else:
        eta = tl.load(ETA + bh).to(tl.float32)
        g = tl.load(G + bh).to(tl.float32)
        acc = S * tl.exp(g)
    for m in tl.static_range(W):
        row = (b * W + m).to(tl.int64) * H + h
        x = tl.load(XW + row * K + ck, mask=kmask, other=0.).to(tl.float32)
        v = tl.load(VW + row * V + cv, mask=vmask, other=0.).to(tl.float32)
        if DELTA:
            v = v - tl.sum(S * x[:, None], 0)
        acc += x[:, None] * (eta * v)[None, :]
    if READ_AFTER:
        o = tl.sum(acc * q[:, None], 0)
    else:
        o = tl.sum(S * q[:, None], 0)
    tl.store(O + bh.to(tl.int64) * V + cv, o.to(O.dtype.element_ty), mask=vmask)
    tl.store(SN + soff, acc, mask=smask)


def decode_step(q, xw, vw, eta, g, S0, *, delta: bool, window: int, read_after: bool):
    """q [B,1,H,K], xw [B,W,H,K], vw [B,W,H,V], eta/g [B,1,H] or [B,1,H,V], S0 [B,H,K,V] or None."""
    B, T, H, K = q.shape
    assert T == 1, "decode_step takes exactly one token"
    V = vw.shape[-1]
    W = window
    BK = _np2(K)
    BV = min(_np2(V), 64 if BK <= 64 else 32)
    O = _empty((B, 1, H, V), q.dtype, q.device)
    SN = _empty((B, H, K, V), torch.float32, q.device)
    s0 = S0.float().contiguous() if S0 is not None else eta
    _decode_step[(cdiv(V, BV), B * H)](
        q.contiguous(), xw.contiguous(), vw.contiguous(), eta.float().contiguous(),
        g.float().contiguous(), s0, O, SN, H, K, V, W, BK, BV, delta, eta.dim() == 4, read_after,
        S0 is not None)
    return O, SN
