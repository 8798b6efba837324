"""The fused preps (prep.py: window 1; prep_window.py: Falcon-3A and Falcon-3) as PyTorch custom operators, so that a
torch.compile'd model can run them as one opaque op each way instead of tracing the PyTorch prep (ours):

    falcon_lab::prep_fwd(k, beta, lam, last_k?, tail_x?, seen, valid?, seq?, cu?, cfg) -> [x, eta, g, stat, vh]
    falcon_lab::prep_bwd(k, beta, lam, last_k?, tail_x?, seen, valid?, seq?, cu?, vh, stat, dx?, deta?, dg?, cfg,
                         need_dlast, need_dtail) -> [dk, dbeta, dlam, dlast, dtail]

cfg = [shift, nlms, scaled, eps, eps_gamma, W, eig] (floats); W = 1 runs prep.py's kernels (seq, cu: packed
sequences), W > 1 prep_window.py's (eig: Falcon-3's μ_t). vh is Falcon-3's per-row top eigenvectors (empty otherwise),
the one tensor besides the inputs the backward reads (and stat, with prep_window.GATES = "stat"). Plain eager calls go
through `_Prep`, an autograd.Function over the same functions (less host time, as ops.py's `_ChunkCore`).

Why: under torch.compile the Triton backend used to trace the PyTorch prep (`kernels/prep.py`) for Inductor to fuse.
For Falcon-3 that is the window Gram and 20 squarings of [B, T, H, W, W] as batched matrix products (plus autograd
through the Rayleigh quotient), where the eager op runs one fused kernel each way (`_win_fwd`, `_win_bwd_*`). Which
of the two a compiled call takes is `COMPILED` (falcon_lab/kernels/triton/__init__.py, prep_check).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .ops import plain_eager
from .prep import w1_prep_backward, w1_prep_forward
from .prep_window import keeps_stat, window_prep_backward, window_prep_forward


def _cfg(cfg):
    shift, nlms, scaled, eps, eps_gamma, W, eig = cfg
    return bool(shift), bool(nlms), bool(scaled), float(eps), float(eps_gamma), int(W), bool(eig)


def _forward(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg):
    """(x, eta, g, stat, vh) of one call (vh empty unless Falcon-3)."""
    cfg = _cfg(cfg)
    if cfg[5] == 1:
        vh = k.new_empty(0, dtype=torch.float32)  # no eigenvectors at window 1
        return (*w1_prep_forward(k, beta, lam, last_k, seen, valid, seq, cu, cfg[:5]), vh)
    return window_prep_forward(k, beta, lam, last_k, tail_x, seen, valid, cfg)


def _backward(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, vh, stat, dx, deta, dg, cfg, need_dlast,
              need_dtail):
    """(dk, dbeta, dlam, dlast, dtail) of one call (dlast, dtail None unless asked for)."""
    cfg = _cfg(cfg)
    if cfg[5] == 1:
        return (*w1_prep_backward(k, beta, lam, last_k, seen, valid, seq, cu, cfg[:5], dx, deta, dg, need_dlast),
                None)
    return window_prep_backward(k, beta, lam, last_k, tail_x, seen, valid, vh, stat, cfg, dx, deta, dg, need_dlast,
                                need_dtail)


# ---- the operators ----------------------------------------------------------------------------------
@torch.library.custom_op("falcon_lab::prep_fwd", mutates_args=())
def prep_fwd(k: torch.Tensor, beta: torch.Tensor, lam: torch.Tensor, last_k: Optional[torch.Tensor],
             tail_x: Optional[torch.Tensor], seen: torch.Tensor, valid: Optional[torch.Tensor],
             seq: Optional[torch.Tensor], cu: Optional[torch.Tensor], cfg: List[float]) -> List[torch.Tensor]:
    return list(_forward(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg))


@prep_fwd.register_fake
def _(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg):
    B, T, H, K = k.shape
    W, eig = int(cfg[5]), bool(cfg[6])
    x = k.new_empty((B, T + W - 1, H, K))
    gates = beta.shape if W == 1 else (B, T, H)
    f32 = dict(dtype=torch.float32)
    vh = k.new_empty((B, T, H, W) if eig else (0,), **f32)
    return [x, k.new_empty(gates, **f32), k.new_empty(gates, **f32), k.new_empty((B, T, H), **f32), vh]


@torch.library.custom_op("falcon_lab::prep_bwd", mutates_args=())
def prep_bwd(k: torch.Tensor, beta: torch.Tensor, lam: torch.Tensor, last_k: Optional[torch.Tensor],
             tail_x: Optional[torch.Tensor], seen: torch.Tensor, valid: Optional[torch.Tensor],
             seq: Optional[torch.Tensor], cu: Optional[torch.Tensor], vh: torch.Tensor, stat: torch.Tensor,
             dx: Optional[torch.Tensor], deta: Optional[torch.Tensor], dg: Optional[torch.Tensor], cfg: List[float],
             need_dlast: bool, need_dtail: bool) -> List[torch.Tensor]:
    dk, dbeta, dlam, dlast, dtail = _backward(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, vh, stat, dx, deta,
                                              dg, cfg, need_dlast, need_dtail)
    return [dk, dbeta, dlam, dlast if dlast is not None else k.new_empty(0),
            dtail if dtail is not None else k.new_empty(0)]


@prep_bwd.register_fake
def _(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, vh, stat, dx, deta, dg, cfg, need_dlast, need_dtail):
    need_dlast = need_dlast and bool(cfg[0]) and last_k is not None
    need_dtail = need_dtail and tail_x is not None
    return [torch.empty_like(k), torch.empty_like(beta), torch.empty_like(lam),
            torch.empty_like(last_k) if need_dlast else k.new_empty(0),
            torch.empty_like(tail_x) if need_dtail else k.new_empty(0)]


def _setup_context(ctx, inputs, output):
    k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg = inputs
    _, _, _, stat, vh = output
    ctx.cfg = list(cfg)
    ctx.has = [t is not None for t in (last_k, tail_x, valid, seq, cu)]
    kept = [t for t in (last_k, tail_x, valid, seq, cu) if t is not None]
    ctx.save_for_backward(k, beta, lam, seen, vh, stat if keeps_stat(_cfg(cfg)) else None, *kept)
    ctx.set_materialize_grads(False)  # gradients of unused outputs arrive as None (stat, vh: never differentiable)


def _saved(ctx):
    k, beta, lam, seen, vh, stat, *kept = ctx.saved_tensors
    it = iter(kept)
    last_k, tail_x, valid, seq, cu = (next(it) if h else None for h in ctx.has)
    return k, beta, lam, last_k, tail_x, seen, valid, seq, cu, vh, stat


def _op_backward(ctx, grads):
    dx, deta, dg = grads[:3]
    k, beta, lam, last_k, tail_x, seen, valid, seq, cu, vh, stat = _saved(ctx)
    need_dlast, need_dtail = bool(ctx.needs_input_grad[3]), bool(ctx.needs_input_grad[4])
    dk, dbeta, dlam, dlast, dtail = prep_bwd(k, beta, lam, last_k, tail_x, seen, valid, seq, cu,
                                             vh if vh is not None else k.new_empty(0, dtype=torch.float32),
                                             stat if stat is not None else k.new_empty(0, dtype=torch.float32),
                                             dx, deta, dg, ctx.cfg, need_dlast, need_dtail)
    return (dk, dbeta, dlam, dlast if dlast.numel() else None, dtail if dtail.numel() else None,
            None, None, None, None, None)


prep_fwd.register_autograd(_op_backward, setup_context=_setup_context)


class _Prep(torch.autograd.Function):
    """The operators' forward and backward without their dispatch (plain eager calls only)."""

    @staticmethod
    def forward(ctx, k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg):
        out = _forward(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg)
        _setup_context(ctx, (k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg), out)
        ctx.mark_non_differentiable(out[3])
        return out[:4]

    @staticmethod
    def backward(ctx, dx, deta, dg, _dstat):
        k, beta, lam, last_k, tail_x, seen, valid, seq, cu, vh, stat = _saved(ctx)
        dk, dbeta, dlam, dlast, dtail = _backward(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, vh, stat, dx,
                                                  deta, dg, ctx.cfg, ctx.needs_input_grad[3],
                                                  ctx.needs_input_grad[4])
        return dk, dbeta, dlam, dlast, dtail, None, None, None, None, None


def prep_core(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg):
    """(x, eta, g, stat) of the fused prep (x: the pair stream, T + W - 1 rows): through the custom operator while
    torch.compile traces or a dispatch mode is active, else through `_Prep` (same functions, less host time)."""
    cfg = [float(c) for c in cfg]
    if not plain_eager():
        out = prep_fwd(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg)
        return out[0], out[1], out[2], out[3]
    return _Prep.apply(k, beta, lam, last_k, tail_x, seen, valid, seq, cu, cfg)
