"""Causal depthwise short convolution (+ SiLU): a PyTorch implementation and a fused Triton kernel.

    y[b,t,d] = act( Σ_{j=0}^{K-1} w[d, K-1-j] · xp[b, t-j, d] ),   xp = concat(cache or zeros, x) along T

x [B, T, D], weight [D, K], cache [B, K-1, D] (the K-1 inputs before x: decoding, continuation),
pos [T] (position of each token inside its own sequence, packed varlen batches with B = 1): the term
j is dropped where pos[t] < j, so nothing leaks across a sequence start. act = SiLU or identity.
Both paths return (y, new_cache), new_cache = the last K-1 rows of xp, in x's dtype.

Choices that are ours (the Falcon paper specifies no short convolution): kernel size 4 + SiLU as
defaults (fla's ShortConvolution defaults), no bias, weight init uniform ±1/sqrt(K), output in x's
dtype (an fp32 weight under bf16 autocast does not promote y to fp32).

Paths:
  * `short_conv_torch`: shifted multiply-adds in x's dtype (weight cast to x.dtype), which
    torch.compile/Inductor fuses; any device, differentiable in x, weight and cache.
  * Triton (`falcon_lab::short_conv_fwd` / `short_conv_bwd` custom ops, so torch.compile traces
    around them): loads in the storage dtype, fp32 accumulation, y in x.dtype. The backward recomputes
    the convolution once (autograd keeps only x, weight, cache, pos) in two passes: dz = dy·act'(z) into
    an fp32 buffer with the dweight partials, then dx from K shifted reads of dz (one pass that
    recomputed dz at every shift cost 0.94 ms per call on the H200 at 32768 x 2304, six times its
    memory traffic). dx in x.dtype; dweight summed in fp32 over deterministic per-program partial
    sums, returned in weight's dtype. The cache
    is an input, not differentiated. CUDA, or CPU under TRITON_INTERPRET=1 (set before triton is
    imported), which the tests use.
"""

import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path works without triton
    triton = None


def _interpreter_active() -> bool:
    if triton is None:
        return False
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Fixed at import (TRITON_INTERPRET is read when triton is imported); a plain bool keeps dynamo happy.
_INTERPRET = _interpreter_active()
# Tile sizes (ours, no autotuning): BLOCK_T rows x BLOCK_D channels per program, num_warps 4.
BLOCK_T = 64
BLOCK_D = 64
NUM_WARPS = 4


def short_conv_torch(x: torch.Tensor, weight: torch.Tensor, cache: Optional[torch.Tensor] = None,
                     pos: Optional[torch.Tensor] = None, activation: bool = True, split: int = 1):
    """PyTorch path: x [B,T,D], weight [D,K], cache [B,K-1,D] | None, pos [T] | None -> (y, new_cache);
    split > 1: y as [split, B, T, D/split] (see short_conv)."""
    B, T, D = x.shape
    K = weight.shape[1]
    w = weight.to(x.dtype)
    prev = cache.to(x.dtype) if cache is not None else x.new_zeros(B, K - 1, D)
    xp = torch.cat([prev, x], dim=1)  # [B, T+K-1, D]
    y = x * w[:, K - 1]
    for j in range(1, K):
        term = xp[:, K - 1 - j: K - 1 - j + T] * w[:, K - 1 - j]
        if pos is not None:
            term = torch.where((pos >= j)[None, :, None], term, 0)
        y = y + term
    y = F.silu(y) if activation else y
    if split > 1:
        y = y.view(B, T, split, D // split).permute(2, 0, 1, 3).contiguous()
    return y, xp[:, T:]


# ------------------------------------------------------------------------------------------------
# Triton kernels. Grid (cdiv(T, BT), cdiv(D, BD), B); every load/store is masked to t < T, d < D,
# cache rows 0..K-2 (a source row t-j < 0 reads cache row K-1+t-j >= 0 since j <= K-1).
# ------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _load_xp(X, C, xb, cb, src, cols, dmask, T, D, K: tl.constexpr, HAS_CACHE: tl.constexpr):
        """xp rows `src` (may be negative: cache rows; >= T: zero) as an fp32 [BT, BD] tile."""
        inx = (src >= 0) & (src < T)
        offs = xb + tl.where(inx, src, 0).to(tl.int64)[:, None] * D + cols[None, :]
        v = tl.load(X + offs, mask=inx[:, None] & dmask[None, :], other=0.).to(tl.float32)
        if HAS_CACHE:
            inc = src < 0
            crow = tl.where(inc, src + (K - 1), 0).to(tl.int64)
            c = tl.load(C + cb + crow[:, None] * D + cols[None, :], mask=inc[:, None] & dmask[None, :], other=0.)
            v += c.to(tl.float32)
        return v

    @triton.jit
    def _conv_rows(X, C, P, Wt, xb, cb, rows, cols, dmask, T, D, K: tl.constexpr, BT: tl.constexpr,
                   BD: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_POS: tl.constexpr):
        """Pre-activation z (fp32 [BT, BD]) at `rows`; finite (partial sums) for rows >= T."""
        rmask = rows < T
        if HAS_POS:
            p = tl.load(P + rows, mask=rmask, other=0)
        z = tl.zeros([BT, BD], dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(Wt + cols * K + (K - 1 - j), mask=dmask, other=0.).to(tl.float32)
            term = _load_xp(X, C, xb, cb, rows - j, cols, dmask, T, D, K, HAS_CACHE) * w[None, :]
            if HAS_POS:
                term = tl.where((p >= j)[:, None], term, 0.)
            z += term
        return z

    @triton.jit
    def _y_offsets(b, rows, cols, T, DG, BTDG):
        """Offsets of (b, rows, cols) in the output layout [split, B, T, DG] (split = D / DG; DG = D is
        the plain [B, T, D] layout)."""
        g = cols // DG
        return (g.to(tl.int64) * BTDG + b * T * DG)[None, :] + rows.to(tl.int64)[:, None] * DG + (cols - g * DG)[None, :]

    @triton.jit
    def _short_conv_fwd_kernel(X, C, P, Wt, Y, T, D, DG, BTDG, K: tl.constexpr, BT: tl.constexpr,
                               BD: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_POS: tl.constexpr, ACT: tl.constexpr):
        pid_t = tl.program_id(0)
        b = tl.program_id(2).to(tl.int64)
        rows = pid_t * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        dmask = cols < D
        xb = b * T * D
        cb = b * (K - 1) * D
        z = _conv_rows(X, C, P, Wt, xb, cb, rows, cols, dmask, T, D, K, BT, BD, HAS_CACHE, HAS_POS)
        if ACT:
            z = z * tl.sigmoid(z)
        offs = _y_offsets(b, rows, cols, T, DG, BTDG)
        tl.store(Y + offs, z.to(Y.dtype.element_ty), mask=(rows < T)[:, None] & dmask[None, :])

    @triton.jit
    def _short_conv_dz_kernel(X, C, P, Wt, DY, DZ, DWP, T, D, DG, BTDG, K: tl.constexpr, BT: tl.constexpr,
                              BD: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_POS: tl.constexpr,
                              ACT: tl.constexpr):
        """Backward, pass 1: dz = dy · act'(z) (the convolution recomputed once) into DZ (fp32, x's
        layout), and this tile's dweight partial Σ_t dz[t] · xp[t-j] (· [pos[t] >= j])."""
        pid_t = tl.program_id(0)
        b = tl.program_id(2).to(tl.int64)
        rows = pid_t * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        dmask = cols < D
        rmask = rows < T
        mask = rmask[:, None] & dmask[None, :]
        xb = b * T * D
        cb = b * (K - 1) * D
        dz = tl.load(DY + _y_offsets(b, rows, cols, T, DG, BTDG), mask=mask, other=0.).to(tl.float32)
        if ACT:
            z = _conv_rows(X, C, P, Wt, xb, cb, rows, cols, dmask, T, D, K, BT, BD, HAS_CACHE, HAS_POS)
            sg = tl.sigmoid(z)
            dz = dz * sg * (1. + z * (1. - sg))
        tl.store(DZ + xb + rows.to(tl.int64)[:, None] * D + cols[None, :], dz, mask=mask)
        if HAS_POS:
            p0 = tl.load(P + rows, mask=rmask, other=0)
        part = (b * tl.num_programs(0) + pid_t) * D * K
        for j in tl.static_range(K):
            g = dz * _load_xp(X, C, xb, cb, rows - j, cols, dmask, T, D, K, HAS_CACHE)
            if HAS_POS:
                g = tl.where((p0 >= j)[:, None], g, 0.)
            tl.store(DWP + part + cols * K + (K - 1 - j), tl.sum(g, 0), mask=dmask)

    @triton.jit
    def _short_conv_dx_kernel(DZ, P, Wt, DX, T, D, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                              HAS_POS: tl.constexpr):
        """Backward, pass 2: dx[s] = Σ_j w[:, K-1-j] · dz[s+j] (· [pos[s+j] >= j]), s+j < T."""
        pid_t = tl.program_id(0)
        b = tl.program_id(2).to(tl.int64)
        rows = pid_t * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        dmask = cols < D
        xb = b * T * D
        dx = tl.zeros([BT, BD], dtype=tl.float32)
        for j in tl.static_range(K):
            r = rows + j
            rm = r < T
            dz = tl.load(DZ + xb + tl.where(rm, r, 0).to(tl.int64)[:, None] * D + cols[None, :],
                         mask=rm[:, None] & dmask[None, :], other=0.)
            if HAS_POS:
                pr = tl.load(P + r, mask=rm, other=0)
                dz = tl.where((pr >= j)[:, None], dz, 0.)
            w = tl.load(Wt + cols * K + (K - 1 - j), mask=dmask, other=0.).to(tl.float32)
            dx += dz * w[None, :]
        offs = xb + rows.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=(rows < T)[:, None] & dmask[None, :])


def _alloc(shape, dtype, device):
    """torch.empty, or NaN-filled under FALCON_TRITON_POISON=1 (catches unwritten outputs)."""
    poison = os.environ.get("FALCON_TRITON_POISON", "0")  # read per call: the checks set it after import
    if poison not in ("0", "1"):
        raise ValueError(f"FALCON_TRITON_POISON must be '0' or '1', got {poison!r}")
    if poison == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_args(x, weight, cache, pos):
    B, T, D = x.shape
    K = weight.shape[1]
    grid = (-(-T // BLOCK_T), -(-D // BLOCK_D), B)  # not triton.cdiv: ~12 us per host call in Triton 3.6
    x = x.contiguous()
    c = cache.contiguous() if cache is not None else x
    p = pos.contiguous() if pos is not None else x
    meta = dict(K=K, BT=BLOCK_T, BD=BLOCK_D, HAS_CACHE=cache is not None, HAS_POS=pos is not None,
                num_warps=NUM_WARPS)
    return grid, x, c, p, weight.contiguous(), meta


def _out_shape(x, split):
    B, T, D = x.shape
    return (B, T, D) if split == 1 else (split, B, T, D // split)


@torch.library.custom_op("falcon_lab::short_conv_fwd", mutates_args=())
def _short_conv_fwd(x: torch.Tensor, weight: torch.Tensor, cache: Optional[torch.Tensor],
                    pos: Optional[torch.Tensor], activation: bool, split: int = 1) -> torch.Tensor:
    y = _alloc(_out_shape(x, split), x.dtype, x.device)
    if x.numel():
        B, T, D = x.shape
        grid, xc, c, p, w, meta = _launch_args(x, weight, cache, pos)
        _short_conv_fwd_kernel[grid](xc, c, p, w, y, T, D, D // split, B * T * (D // split), ACT=activation, **meta)
    return y


@_short_conv_fwd.register_fake
def _(x, weight, cache, pos, activation, split=1):
    return x.new_empty(_out_shape(x, split))


@torch.library.custom_op("falcon_lab::short_conv_bwd", mutates_args=())
def _short_conv_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cache: Optional[torch.Tensor],
                    pos: Optional[torch.Tensor], activation: bool, split: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, D = x.shape
    dx = _alloc(x.shape, x.dtype, x.device)
    if not x.numel():
        return dx, torch.zeros_like(weight)
    grid, xc, c, p, w, meta = _launch_args(x, weight, cache, pos)
    dz = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dwp = _alloc((grid[0] * B, D, weight.shape[1]), torch.float32, x.device)
    _short_conv_dz_kernel[grid](xc, c, p, w, dy.contiguous(), dz, dwp, T, D, D // split, B * T * (D // split),
                                ACT=activation, **meta)
    _short_conv_dx_kernel[grid](dz, p, w, dx, T, D, K=meta["K"], BT=meta["BT"], BD=meta["BD"],
                                HAS_POS=meta["HAS_POS"], num_warps=meta["num_warps"])
    return dx, dwp.sum(0).to(weight.dtype)


@_short_conv_bwd.register_fake
def _(dy, x, weight, cache, pos, activation, split=1):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, cache, pos, activation, split = inputs
    ctx.save_for_backward(x, weight, cache, pos)
    ctx.activation, ctx.split = activation, split


def _backward(ctx, dy):
    x, weight, cache, pos = ctx.saved_tensors
    dx, dw = torch.ops.falcon_lab.short_conv_bwd(dy, x, weight, cache, pos, ctx.activation, ctx.split)
    return dx, dw, None, None, None, None


_short_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_triton(x: torch.Tensor, K: int) -> None:
    if K > 8:
        raise ValueError(f"backend='triton' takes kernel sizes 1..8, got {K}; use backend='torch'")
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package; use backend='torch'")
    if x.device.type == "cpu" and not _INTERPRET:
        raise RuntimeError("backend='triton' on CPU tensors runs the Triton interpreter, which needs "
                           "TRITON_INTERPRET=1 in the environment before triton is imported; use "
                           "backend='torch' or move the tensors to CUDA")
    if x.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"backend='triton' needs CUDA (or CPU under TRITON_INTERPRET=1) tensors, got {x.device}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"backend='triton' takes fp32/fp16/bf16 inputs, got {x.dtype}; use backend='torch'")


def short_conv(x: torch.Tensor, weight: torch.Tensor, cache: Optional[torch.Tensor] = None,
               pos: Optional[torch.Tensor] = None, activation: bool = True, backend: Optional[str] = None,
               split: int = 1):
    """(y, new_cache) of the causal depthwise convolution (module docstring). backend: None = Triton
    for CUDA fp32/fp16/bf16 tensors (torch for a decoding step: T == 1, cache, no grad), else torch;
    "torch"; "triton" (CUDA, or CPU under TRITON_INTERPRET=1).
    split: y comes back as [split, B, T, D/split], channel c in slice c // (D/split): q, k and v convolved
    together come out as three contiguous tensors (`y.unbind(0)`), with no copy after the kernel (ours)."""
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    B, T, D = x.shape
    K = weight.shape[1]
    if split < 1 or D % split:
        raise ValueError(f"split must divide the channels D={D}, got {split}")
    if weight.dim() != 2 or weight.shape[0] != D or K < 1:
        raise ValueError(f"weight must be [D={D}, K >= 1], got {tuple(weight.shape)}")
    if cache is not None and cache.shape != (B, K - 1, D):
        raise ValueError(f"cache must be [{B}, {K - 1}, {D}], got {tuple(cache.shape)}")
    if pos is not None and (pos.shape != (T,) or pos.device != x.device):
        raise ValueError(f"pos must be [T={T}] on {x.device}, got {tuple(pos.shape)} on {pos.device}")
    if backend is None:
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        decode = T == 1 and cache is not None and not grad
        use_triton = (triton is not None and x.is_cuda and not decode and K <= 8
                      and x.dtype in (torch.float32, torch.float16, torch.bfloat16))
    else:
        use_triton = backend == "triton"
    if not use_triton:
        return short_conv_torch(x, weight, cache, pos, activation, split)
    _check_triton(x, K)
    c = cache.detach() if cache is not None else None
    y = torch.ops.falcon_lab.short_conv_fwd(x, weight, c, pos, activation, int(split))
    if K == 1:
        new_cache = x.new_zeros(B, 0, D)
    elif T >= K - 1:
        new_cache = x[:, T - (K - 1):]
    else:
        prev = c.to(x.dtype) if c is not None else x.new_zeros(B, K - 1, D)
        new_cache = torch.cat([prev[:, T:], x], dim=1)
    return y, new_cache


class ShortConvolution(nn.Module):
    """Depthwise causal convolution (kernel `size`, no bias) + optional SiLU, with a decode cache.
    Ours: kernel 4 + SiLU by default (fla's default; the paper gives neither)."""

    def __init__(self, channels: int, size: int = 4, activation: bool = True, backend: Optional[str] = None,
                 split: int = 1):
        super().__init__()
        self.channels, self.size, self.activation, self.backend = channels, size, activation, backend
        self.split = split  # forward's y as [split, B, T, channels/split] (short_conv)
        self.weight = nn.Parameter(torch.empty(channels, size))
        nn.init.uniform_(self.weight, -1.0 / size ** 0.5, 1.0 / size ** 0.5)

    def forward(self, x, cache=None, pos=None):
        """x [B, T, C]; cache [B, size-1, C] or None; pos [T] or None. Returns (y, new_cache)."""
        return short_conv(x, self.weight, cache, pos, self.activation, self.backend, self.split)

    def extra_repr(self) -> str:
        return f"{self.channels}, size={self.size}, activation={self.activation}, backend={self.backend}"
