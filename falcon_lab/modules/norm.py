"""Fused norms: the output RMSNorm x SiLU gate, and the per-head q/k normalisation.

    rms_norm_gated(x, weight=None, gate=None, eps=1e-6, backend=None)
        y = x * rsqrt(mean(x^2) + eps) * weight * silu(gate)      (weight, gate optional)
    qk_norm(u, kind, eps, gain=None, backend=None)
        "rmsnorm": y = u * rsqrt(mean(u^2) + eps) * gain;  "l2": y = u * rsqrt(sum(u^2) + eps) * gain

The last dim D (<= 256 for Triton) is normalised, everything before it is rows. `weight`/`gain` is [D],
or [H, D] applied per head to u [..., H, D]. The output dtype is the input's: an fp32 gain under bf16
autocast does not promote the result (today's base.RMSNorm `y * weight` does; ours: cast the gain).

Choices that are ours: eps inside the root, added to mean(x^2) (rmsnorm) or to sum(x^2) (l2), as
base.rms_normalize / base.l2_normalize; the statistic is taken in fp32 (fp64 for fp64 inputs).

Two implementations with one signature:
  * torch (`*_torch`): the statistic in fp32, then the products in x's dtype with weight/gate cast to it,
    the numerics of base.py: bit-equal to rms_normalize / l2_normalize in every dtype and to base.RMSNorm
    in fp32 (in bf16 base.RMSNorm multiplies by the fp32 weight and returns fp32; we round to bf16).
    This is what runs on CPU, and what torch.compile fuses with backend="torch".
  * Triton: one program per BLOCK_ROWS rows x the whole (power-of-two padded, masked) D, fp32 math after
    each load. The forward saves its inputs and the per-row rstd [rows] fp32; the backward recomputes
    x_hat and silu(gate). d(weight) comes from per-program fp32 partials [programs, H, D] summed with
    .sum(0) (deterministic), returned in weight's dtype. Registered as torch.library custom ops
    (falcon_lab::rms_norm_gated_fwd/_bwd, falcon_lab::qk_norm_fwd/_bwd) with fake and autograd
    registrations, so torch.compile traces through them without a graph break.
backend: None = Triton for CUDA tensors (fp16/bf16/fp32, D <= 256, triton installed), else torch;
"torch" forces torch; "triton" forces Triton (CPU tensors need TRITON_INTERPRET=1 before triton is
first imported). A gain of another broadcastable shape always runs the torch path.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["rms_norm_gated", "rms_norm_gated_torch", "qk_norm", "qk_norm_torch", "RMSNorm",
           "FusedRMSNormGated"]

QK_KINDS = ("rmsnorm", "l2")
MAX_D = 256
_HAVE_TRITON = importlib.util.find_spec("triton") is not None
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------- torch
def _stat(x: torch.Tensor, mean: bool) -> torch.Tensor:
    xf = x.double() if x.dtype == torch.float64 else x.float()
    sq = xf.pow(2)
    return sq.mean(-1, keepdim=True) if mean else sq.sum(-1, keepdim=True)


def rms_norm_gated_torch(x, weight=None, gate=None, eps: float = 1e-6):
    """rms_norm_gated in PyTorch ops (autograd by PyTorch); output x.dtype."""
    y = x * torch.rsqrt(_stat(x, True) + eps).to(x.dtype)
    if weight is not None:
        y = y * weight.to(x.dtype)
    if gate is not None:
        y = y * F.silu(gate).to(x.dtype)
    return y


def qk_norm_torch(u, kind: str, eps: float, gain=None):
    """qk_norm in PyTorch ops; output u.dtype; gain of any shape that broadcasts against u."""
    if kind not in QK_KINDS:
        raise ValueError(f"kind must be one of {QK_KINDS}, got {kind!r}")
    y = u * torch.rsqrt(_stat(u, kind == "rmsnorm") + eps).to(u.dtype)
    return y * gain.to(u.dtype) if gain is not None else y


# ---------------------------------------------------------------------------------------- triton
triton = tl = None  # imported by _kernels()
_K = {}  # built on first use: the interpreter choice is made when @triton.jit runs


def _kernels():
    if _K:
        return _K
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def norm_fwd(X, W, G, Y, RSTD, M, D, HW, eps, scale, HAS_W: tl.constexpr, HAS_G: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        # grid (cdiv(M, BLOCK_ROWS), HW): rows n*HW + h of the [M*HW, D] input, all of head h
        pid = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        n = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_D)
        rmask = n < M
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        row = n * HW + h
        offs = row[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) * scale + eps)
        y = x * rstd[:, None]
        if HAS_W:
            w = tl.load(W + h * D + cols, mask=cmask, other=0.0).to(tl.float32)
            y = y * w[None, :]
        if HAS_G:
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            y = y * (g * tl.sigmoid(g))
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd, mask=rmask)

    @triton.jit
    def norm_bwd(DY, X, W, G, RSTD, DX, DG, DWP, M, D, HW, scale, HAS_W: tl.constexpr,
                 HAS_G: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        n = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_D)
        rmask = n < M
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        row = n * HW + h
        offs = row[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=rmask, other=0.0)
        xh = x * rstd[:, None]  # 0 on masked rows and columns, so they add nothing to the sums
        da = dy  # gradient of a = x_hat * w
        if HAS_W:
            w = tl.load(W + h * D + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_G:
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            sg = tl.sigmoid(g)
            a = xh
            if HAS_W:
                a = xh * w[None, :]
            dg = dy * a * sg * (1.0 + g * (1.0 - sg))
            tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
            da = dy * (g * sg)
        dxh = da
        if HAS_W:
            tl.store(DWP + (pid * HW + h) * D + cols, tl.sum(da * xh, axis=0), mask=cmask)
            dxh = da * w[None, :]
        proj = tl.sum(dxh * xh, axis=1) * scale
        dx = rstd[:, None] * (dxh - xh * proj[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)

    knobs = getattr(triton, "knobs", None)  # older triton without knobs reads the variable itself
    interp = knobs.runtime.interpret if knobs is not None else os.environ.get("TRITON_INTERPRET", "0") == "1"
    _K.update(fwd=norm_fwd, bwd=norm_bwd, interpret=bool(interp))
    return _K


def _blocks(D: int):
    """(BLOCK_ROWS, BLOCK_D, num_warps): 4096-element tiles, 4 warps. On the H200 (Triton 3.6, bf16,
    16.7M elements) the forward/backward kernels took 34/80 us at D=128, 43/113 us at D=256 and
    86/165 us at D=64; 2048-element tiles or 8 warps were no faster beyond the noise."""
    block_d = max(16, 1 << (D - 1).bit_length())
    return max(1, 4096 // block_d), block_d, 4


def _kernels_for(x: torch.Tensor):
    if not _HAVE_TRITON:
        raise RuntimeError("backend='triton' needs the triton package; use backend='torch'")
    k = _kernels()
    if x.device.type == "cpu" and not k["interpret"]:
        raise RuntimeError("backend='triton' on CPU tensors runs the Triton interpreter, which needs "
                           "TRITON_INTERPRET=1 in the environment before triton is first imported; "
                           "use backend='torch' or CUDA tensors")
    if x.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"backend='triton' needs CUDA (or CPU under TRITON_INTERPRET=1) tensors, got {x.device}")
    return k


def _hw(w: Optional[torch.Tensor]) -> int:
    return 1 if w is None or w.dim() == 1 else w.shape[0]


def _fwd_impl(x, w, g, eps: float, scale_mean: bool):
    k = _kernels_for(x)
    D, HW = x.shape[-1], _hw(w)
    M = x.numel() // (D * HW)
    x2 = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(M * HW, dtype=torch.float32, device=x.device)
    if M > 0:
        br, bd, nw = _blocks(D)
        k["fwd"][(-(-M // br), HW)](
            x2, w.contiguous() if w is not None else x2, g.contiguous() if g is not None else x2, y, rstd,
            M, D, HW, eps, 1.0 / D if scale_mean else 1.0, HAS_W=w is not None, HAS_G=g is not None,
            BLOCK_ROWS=br, BLOCK_D=bd, num_warps=nw)
    return y, rstd


def _bwd_impl(dy, x, w, g, rstd, scale_mean: bool):
    k = _kernels_for(x)
    D, HW = x.shape[-1], _hw(w)
    M = x.numel() // (D * HW)
    br, bd, nw = _blocks(D)
    nprog = -(-M // br)
    x2 = x.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dg = torch.empty(g.shape, dtype=g.dtype, device=x.device) if g is not None else x.new_empty(0)
    dwp = torch.zeros(nprog, HW, D, dtype=torch.float32, device=x.device) if w is not None else None
    if M > 0:
        k["bwd"][(nprog, HW)](
            dy.contiguous(), x2, w.contiguous() if w is not None else x2, g.contiguous() if g is not None else x2,
            rstd, dx, dg if g is not None else x2, dwp if dwp is not None else rstd, M, D, HW,
            1.0 / D if scale_mean else 1.0, HAS_W=w is not None, HAS_G=g is not None,
            BLOCK_ROWS=br, BLOCK_D=bd, num_warps=nw)
    dw = dwp.sum(0).reshape(w.shape).to(w.dtype) if w is not None else x.new_empty(0)
    return dx, dw, dg


# ---------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("falcon_lab::rms_norm_gated_fwd", mutates_args=())
def _rng_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], gate: Optional[torch.Tensor],
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(x, weight, gate, eps, True)


@torch.library.custom_op("falcon_lab::rms_norm_gated_bwd", mutates_args=())
def _rng_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], gate: Optional[torch.Tensor],
             rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dgate); a missing weight/gate gives an empty tensor in its place."""
    return _bwd_impl(dy, x, weight, gate, rstd, True)


@torch.library.custom_op("falcon_lab::qk_norm_fwd", mutates_args=())
def _qk_fwd(u: torch.Tensor, gain: Optional[torch.Tensor], eps: float, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(u, gain, None, eps, kind == "rmsnorm")


@torch.library.custom_op("falcon_lab::qk_norm_bwd", mutates_args=())
def _qk_bwd(dy: torch.Tensor, u: torch.Tensor, gain: Optional[torch.Tensor], rstd: torch.Tensor,
            kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw, _ = _bwd_impl(dy, u, gain, None, rstd, kind == "rmsnorm")
    return dx, dw


def _fake_fwd(x, w):
    return x.new_empty(x.shape), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


def _fake_grads(x, w):
    return x.new_empty(x.shape), (w.new_empty(w.shape) if w is not None else x.new_empty(0))


_rng_fwd.register_fake(lambda x, weight, gate, eps: _fake_fwd(x, weight))
_qk_fwd.register_fake(lambda u, gain, eps, kind: _fake_fwd(u, gain))
_rng_bwd.register_fake(lambda dy, x, weight, gate, rstd: (
    *_fake_grads(x, weight), gate.new_empty(gate.shape) if gate is not None else x.new_empty(0)))
_qk_bwd.register_fake(lambda dy, u, gain, rstd, kind: _fake_grads(u, gain))


def _rng_setup(ctx, inputs, output):
    x, weight, gate, _ = inputs
    ctx.save_for_backward(x, weight, gate, output[1])


def _rng_backward(ctx, dy, _drstd):
    x, weight, gate, rstd = ctx.saved_tensors
    dx, dw, dg = torch.ops.falcon_lab.rms_norm_gated_bwd(dy, x, weight, gate, rstd)
    return dx, (dw if weight is not None else None), (dg if gate is not None else None), None


def _qk_setup(ctx, inputs, output):
    u, gain, _, kind = inputs
    ctx.kind = kind
    ctx.save_for_backward(u, gain, output[1])


def _qk_backward(ctx, dy, _drstd):
    u, gain, rstd = ctx.saved_tensors
    du, dg = torch.ops.falcon_lab.qk_norm_bwd(dy, u, gain, rstd, ctx.kind)
    return du, (dg if gain is not None else None), None, None


_rng_fwd.register_autograd(_rng_backward, setup_context=_rng_setup)
_qk_fwd.register_autograd(_qk_backward, setup_context=_qk_setup)


# ------------------------------------------------------------------------------------ dispatch
def _use_triton(x: torch.Tensor, w: Optional[torch.Tensor], backend: Optional[str]) -> bool:
    """True for the Triton op. Shapes it cannot take (a gain neither [D] nor [H, D] over u's last two
    dims) go to torch whatever the backend; so does fp64, D > 256, or a non-CUDA tensor for None."""
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return False
    D = x.shape[-1]
    if w is not None and not (w.shape == (D,) or (w.dim() == 2 and x.dim() >= 2 and w.shape == x.shape[-2:])):
        return False
    if backend is None:
        return x.is_cuda and _HAVE_TRITON and x.dtype in _TRITON_DTYPES and D <= MAX_D
    if not _HAVE_TRITON:
        raise RuntimeError("backend='triton' needs the triton package; use backend='torch'")
    if x.dtype not in _TRITON_DTYPES:
        raise NotImplementedError(f"backend='triton' takes fp16/bf16/fp32, got {x.dtype}; use backend='torch'")
    if D > MAX_D:
        raise ValueError(f"backend='triton' normalises D <= {MAX_D}, got {D}")
    return True


def rms_norm_gated(x: torch.Tensor, weight: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
                   eps: float = 1e-6, backend: Optional[str] = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight * silu(gate); output dtype x.dtype. weight [D] or None,
    gate x's shape or None."""
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} must equal x shape {tuple(x.shape)}")
    if _use_triton(x, weight, backend):
        return torch.ops.falcon_lab.rms_norm_gated_fwd(x, weight, gate, float(eps))[0]
    return rms_norm_gated_torch(x, weight, gate, eps)


def qk_norm(u: torch.Tensor, kind: str, eps: float, gain: Optional[torch.Tensor] = None,
            backend: Optional[str] = None) -> torch.Tensor:
    """kind "rmsnorm": u * rsqrt(mean(u^2) + eps); "l2": u * rsqrt(sum(u^2) + eps); times gain ([D],
    or [H, D] per head of u [..., H, D]); output dtype u.dtype."""
    if kind not in QK_KINDS:
        raise ValueError(f"kind must be one of {QK_KINDS}, got {kind!r}")
    if _use_triton(u, gain, backend):
        return torch.ops.falcon_lab.qk_norm_fwd(u, gain, float(eps), kind)[0]
    return qk_norm_torch(u, kind, eps, gain)


# -------------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    """Drop-in for layers.base.RMSNorm (same `weight` parameter, same state_dict); output x.dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, gain: bool = True, backend: Optional[str] = None):
        super().__init__()
        self.dim, self.eps, self.backend = dim, eps, backend
        if gain:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def forward(self, x):
        return rms_norm_gated(x, self.weight, None, self.eps, self.backend)

    def extra_repr(self):
        return f"{self.dim}, eps={self.eps}, gain={self.weight is not None}, backend={self.backend}"


class FusedRMSNormGated(nn.Module):
    """RMSNorm(x) * weight * silu(gate) in one kernel: Falcon's output path o_norm(o) * silu(g_proj(h))."""

    def __init__(self, dim: int, eps: float = 1e-6, backend: Optional[str] = None):
        super().__init__()
        self.dim, self.eps, self.backend = dim, eps, backend
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        return rms_norm_gated(x, self.weight, gate, self.eps, self.backend)

    def extra_repr(self):
        return f"{self.dim}, eps={self.eps}, backend={self.backend}"
