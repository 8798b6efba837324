"""The language-model loss's per-chunk body: logits -> per-row NLL and, in place, their gradient.

    xent_rows_(z, y, scale=1.0, ignore_index=-100, grad=True, backend=None) -> nll [C] fp32
        z [C, V]: one chunk's logits before the logit scale (the matmul's output, bf16/fp16/fp32).
        y [C]: int64 labels; rows whose label is `ignore_index` count 0.
        nll[r] = logsumexp(scale*z[r]) - scale*z[r, y[r]]    (0 for ignored rows)
        grad=True also overwrites z with dnll/dz = scale*(softmax(scale*z) - onehot(y)) (0 on ignored
        rows), in z's dtype: the chunked loss then multiplies it into dh and dW without another buffer.

Two implementations with one signature (the `modules` convention):
  * torch: the fp32 softmax form (a float copy of z, its log-sum-exp, softmax, scatter, scale, cast
    back) -- five to six full passes over [C, V] in fp32; what runs on CPU.
  * Triton (ours): one program per row, two passes over the row in z's dtype -- an online max /
    sum-of-exponentials (fp32 registers) for the log-sum-exp, then the gradient written over the row.
    It reads z twice and writes it once, with no fp32 copy of the logits.
backend: None = Triton for CUDA tensors (triton installed), else torch; "torch" forces torch;
"triton" forces Triton (CPU tensors need TRITON_INTERPRET=1 before triton is first imported).
"""
from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["xent_rows_", "xent_rows_torch_", "XENT_BACKENDS"]

XENT_BACKENDS = (None, "torch", "triton")
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def xent_rows_torch_(z: torch.Tensor, y: torch.Tensor, scale: float = 1.0, ignore_index: int = -100,
                     grad: bool = True) -> torch.Tensor:
    """xent_rows_ in PyTorch ops (softmax in fp32)."""
    zf = z.float() * scale
    keep = y != ignore_index
    yk = torch.where(keep, y, torch.zeros_like(y))
    lse = torch.logsumexp(zf, dim=-1)
    zy = zf.gather(1, yk[:, None])[:, 0]
    nll = torch.where(keep, lse - zy, torch.zeros_like(lse))
    if grad:
        gz = torch.softmax(zf, dim=-1)
        gz.scatter_add_(1, yk[:, None], -torch.ones_like(zy)[:, None])
        gz.mul_((keep.to(gz.dtype) * scale)[:, None])
        z.copy_(gz)
    return nll


_K = {}


def _kernels():
    if _K:
        return _K
    import triton
    import triton.language as tl

    @triton.jit
    def xent_rows_kernel(Z, Y, NLL, stride_z, V, scale, ignore_index, GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        zrow = Z + row * stride_z
        y = tl.load(Y + row)
        cols = tl.arange(0, BLOCK)
        # pass 1: online log-sum-exp of scale*z over the row
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        for off in range(0, V, BLOCK):
            c = off + cols
            z = tl.load(zrow + c, mask=c < V, other=float("-inf")).to(tl.float32) * scale
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        keep = y != ignore_index
        yk = tl.where(keep, y, 0)
        zy = tl.load(zrow + yk).to(tl.float32) * scale
        tl.store(NLL + row, tl.where(keep, lse - zy, 0.0))
        if GRAD:
            # pass 2: the gradient over the row, in place
            gs = tl.where(keep, scale, 0.0)
            for off in range(0, V, BLOCK):
                c = off + cols
                z = tl.load(zrow + c, mask=c < V, other=0.0).to(tl.float32) * scale
                p = tl.exp(z - lse)
                p = tl.where(c == yk, p - 1.0, p) * gs
                tl.store(zrow + c, p.to(Z.dtype.element_ty), mask=c < V)

    _K["rows"] = xent_rows_kernel
    return _K


def _xent_rows_triton_(z, y, scale, ignore_index, grad):
    import triton

    C, V = z.shape
    nll = torch.empty(C, dtype=torch.float32, device=z.device)
    if C == 0:
        return nll
    BLOCK = min(int(os.environ.get("FALCON_XENT_BLOCK", 8192)), triton.next_power_of_2(V))  # env: tests
    _kernels()["rows"][(C,)](z, y, nll, z.stride(0), V, float(scale), int(ignore_index), GRAD=bool(grad),
                             BLOCK=BLOCK, num_warps=8 if BLOCK >= 2048 else 4)
    return nll


def xent_rows_(z: torch.Tensor, y: torch.Tensor, scale: float = 1.0, ignore_index: int = -100,
               grad: bool = True, backend: str | None = None) -> torch.Tensor:
    """Per-row NLL of one chunk of logits; with grad=True, z becomes its gradient (see the module doc)."""
    if backend not in XENT_BACKENDS:
        raise ValueError(f"backend must be one of {XENT_BACKENDS}, got {backend!r}")
    if z.dim() != 2 or y.shape != z.shape[:1]:
        raise ValueError(f"xent_rows_: z must be [C, V] and y [C], got {tuple(z.shape)} and {tuple(y.shape)}")
    use_triton = backend == "triton" or (backend is None and z.is_cuda and _HAVE_TRITON
                                         and z.dtype in (torch.float32, torch.float16, torch.bfloat16))
    if use_triton:
        if z.stride(1) != 1:
            raise ValueError("xent_rows_ (triton): z's rows must be contiguous")
        return _xent_rows_triton_(z, y.contiguous(), scale, ignore_index, grad)
    return xent_rows_torch_(z, y, scale, ignore_index, grad)
