"""The Triton cores as PyTorch custom operators (`torch.library.custom_op`), so that torch.compile
traces a whole decoder block around them without a graph break, and autograd runs their Triton
backward.

Two operators serve every kernel family:

    falcon_lab::chunk_core_fwd(q, x, v, eta, g, S0?, family, cfg) -> [O, S_T, *saved]
    falcon_lab::chunk_core_bwd(q, x, v, eta, g, saved, dO, dST?, family, cfg, need_ds0) -> [dq, dx, dv, deta, dg, dS0]

`family` names the kernel set ("scalar": chunk.py, Falcon-1/1A and the scans of 3/3A; "percol":
percol.py, Falcon-2A; "percol_delta": percol_delta.py, Falcon-2; "window_linear": window_linear.py, Falcon-3A
in one scan, the default since proven on the H200 on 2026-12-03; "window_delayed": window_delayed.py, Falcon-3A as one
Falcon-1A scan of completed pair weights plus a band); `cfg` is its integer configuration
(see _FAMILIES). Each family contributes a forward, a backward and the shapes of what its forward saves
(for the fake tensors compile traces with). The inputs q, x, v, eta, g are saved by autograd itself;
only the family's intermediate tensors are extra outputs (custom operators may not return views of their
inputs, so unused slots are empty tensors).

Plain eager calls (no torch.compile tracing, no dispatch mode active) skip the operator and run the same family
functions through a `torch.autograd.Function` (ours): a custom operator with `register_autograd` costs about
2.5x an autograd.Function's CPU time per forward+backward (718 vs 270 us on a 2-core CPU,
experiments/h200/custom_op_overhead.py), and at (16, 2048, 12, 64) on the H200 the Falcon ops are bound by the
host, not by their kernels (benchmarks/results/h200_logs/kernels_2026-12-02e/: 3.51 vs 2.82 ms per Falcon-1
fwd+bwd through the operator and the Function). Under torch.compile, selective checkpointing
(`FalconMixer.recompute`, which keeps `falcon_lab::chunk_core_fwd`'s outputs), fake tensors or any other
TorchDispatchMode the registered operator runs, so those still see one opaque op.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .chunk import a_dtype, chunk_backward, chunk_forward, state_dtype
from .common import varlen_chunks
from .host import next_pow2
from .lean import lean_bounds, saved_shape as lean_saved_shape
from .percol import percol_backward, percol_forward
from .percol_delta import keeps_inv, percol_delta_backward, percol_delta_forward
from .window_delayed import window_delayed_backward, window_delayed_forward
from .window_linear import window_linear_backward, window_linear_forward


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _chunk_slots(T: int, C: int, cu) -> int:
    """Per-chunk state slots of a call: ceil(T / C), or the packed sequences' bound (common.varlen_chunks)."""
    return varlen_chunks(T, cu.shape[0] - 1, C) if cu is not None else _cdiv(T, C)


# ---- the families ---------------------------------------------------------------------------------
# scalar cfg: [delta, read_after, C, xoff, allow_tf32, out_fp32, group, gather] (gather: Falcon-3's pseudo-tokens read
# in place by the kernels, q/eta/g with T steps and x/v with T + group - 1 pairs; else every input has the kernel's rows)
# cu (cu_seqlens, window 1, B = 1; scalar and percol families): packed sequences run natively; S0, S_T and dS0 have
# one row per sequence
def _scalar_fwd(q, x, v, eta, g, S0, cfg, cu=None):
    delta, read_after, C, xoff, tf32, out_f32, group, gather = cfg
    O, ST, (HS, A, WT, R) = chunk_forward(q, x, v, eta, g, S0, delta=bool(delta), read_after=bool(read_after),
                                          C=C, xoff=xoff, allow_tf32=bool(tf32),
                                          out_dtype=torch.float32 if out_f32 else None, group=group,
                                          gather=bool(gather), cu_seqlens=cu)
    if not delta:  # the delta-only buffers are not made (chunk_forward hands back eta in their place)
        A, WT, R = (eta.new_empty(0) for _ in range(3))
    return [O, ST, HS, A, WT, R]


def _scalar_bwd(q, x, v, eta, g, saved, dO, dST, cfg, need_ds0, cu=None):
    delta, read_after, C, xoff, tf32, _, group, gather = cfg
    HS, A, WT, R = saved
    if not delta:
        A = WT = R = eta  # never read by the kernels (constexpr-disabled branches)
    return chunk_backward(q, x, v, eta, g, (HS, A, WT, R), dO, dST, delta=bool(delta), read_after=bool(read_after),
                          C=C, xoff=xoff, allow_tf32=bool(tf32), need_ds0=need_ds0, group=group, gather=bool(gather),
                          cu_seqlens=cu)


def _scalar_saved_shapes(q, x, v, cfg, cu=None):
    delta, _, C, xoff, _, _, group, gather = cfg
    bounds = lean_bounds(q, x, C, bool(delta), group, bool(gather), xoff, cu)
    if bounds:  # Falcon-3 in segments (lean.py): the segments' start states, the other slots empty
        return [(lean_saved_shape(q, v, len(bounds)), torch.float32)] + [((0,), q.dtype)] * 3
    B, T, H, K = q.shape
    T = T * group if gather else T
    V = v.shape[-1]
    hs = ((B, H, _chunk_slots(T, C, cu), K, V), state_dtype(q.dtype))
    if not delta:
        return [hs] + [((0,), torch.float32)] * 3
    return [hs, ((B, T, H, C), a_dtype(q.dtype)), ((B, T, H, K), q.dtype), ((B, T, H, V), q.dtype)]


# percol / percol_delta cfg: [read_after, C, allow_tf32]
def _percol_fwd(fwd):
    def f(q, x, v, eta, g, S0, cfg, cu=None):
        read_after, C, tf32 = cfg
        O, ST, saved = fwd(q, x, v, eta, g, S0, read_after=bool(read_after), C=C, allow_tf32=bool(tf32),
                           cu_seqlens=cu)
        return [O, ST, *saved]
    return f


def _percol_bwd(bwd):
    def f(q, x, v, eta, g, saved, dO, dST, cfg, need_ds0, cu=None):
        read_after, C, tf32 = cfg
        return bwd(q, x, v, eta, g, tuple(saved), dO, dST, read_after=bool(read_after), C=C, allow_tf32=bool(tf32),
                   need_ds0=need_ds0, cu_seqlens=cu)
    return f


def _percol_saved_shapes(with_r: bool):
    def f(q, x, v, cfg, cu=None):
        _, C, _ = cfg
        B, T, H, K = q.shape
        V = v.shape[-1]
        out = [((B, H, _chunk_slots(T, C, cu), K, V), torch.float32)]
        if not with_r:
            return out
        kept = ((B, T, H, 16, V), a_dtype(q.dtype)) if keeps_inv() else ((0,), torch.float32)
        return out + [((B, T, H, V), torch.float32), kept]
    return f


# window_linear / window_delayed cfg: [read_after, C, W, allow_tf32] (Falcon-3A in one banded scan / as one Falcon-1A
# scan of completed weights plus a band; cu: packed sequences)
def _window_fwd(fwd):
    def f(q, x, v, eta, g, S0, cfg, cu=None):
        read_after, C, W, tf32 = cfg
        O, ST, saved = fwd(q, x, v, eta, g, S0, read_after=bool(read_after), C=C, W=W, allow_tf32=bool(tf32),
                           cu_seqlens=cu)
        return [O, ST, *saved]
    return f


def _window_bwd(bwd):
    def f(q, x, v, eta, g, saved, dO, dST, cfg, need_ds0, cu=None):
        read_after, C, W, tf32 = cfg
        return bwd(q, x, v, eta, g, tuple(saved), dO, dST, read_after=bool(read_after), C=C, W=W,
                   allow_tf32=bool(tf32), need_ds0=need_ds0, cu_seqlens=cu)
    return f


def _wl_saved_shapes(q, x, v, cfg, cu=None):
    B, T, H, K = q.shape
    return [((B, H, _chunk_slots(T, cfg[1], cu), K, v.shape[-1]), torch.float32)]


def _wd_saved_shapes(q, x, v, cfg, cu=None):
    B, T, H, K = q.shape
    WP = next_pow2(cfg[2])
    return [((B, H, _chunk_slots(T, cfg[1], cu), K, v.shape[-1]), state_dtype(q.dtype)),
            ((B, T, H, WP), torch.float32), ((B, T, H), torch.float32)]


_FAMILIES = {
    "scalar": (_scalar_fwd, _scalar_bwd, _scalar_saved_shapes),
    "percol": (_percol_fwd(percol_forward), _percol_bwd(percol_backward), _percol_saved_shapes(False)),
    "percol_delta": (_percol_fwd(percol_delta_forward), _percol_bwd(percol_delta_backward), _percol_saved_shapes(True)),
    "window_linear": (_window_fwd(window_linear_forward), _window_bwd(window_linear_backward), _wl_saved_shapes),
    "window_delayed": (_window_fwd(window_delayed_forward), _window_bwd(window_delayed_backward), _wd_saved_shapes),
}


def _out_dtype(q, family, cfg):
    return torch.float32 if family == "scalar" and cfg[5] else q.dtype


# ---- the operators ----------------------------------------------------------------------------------
@torch.library.custom_op("falcon_lab::chunk_core_fwd", mutates_args=())
def chunk_core_fwd(q: torch.Tensor, x: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, g: torch.Tensor,
                   S0: Optional[torch.Tensor], family: str, cfg: List[int],
                   cu_seqlens: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    return _FAMILIES[family][0](q, x, v, eta, g, S0, list(cfg), cu_seqlens)


def _states(q, v, cu):
    """Rows of S0 / S_T / dS0: the batch, or the packed sequences."""
    return cu.shape[0] - 1 if cu is not None else q.shape[0]


@chunk_core_fwd.register_fake
def _(q, x, v, eta, g, S0, family, cfg, cu_seqlens=None):
    B, T, H, _ = q.shape
    V = v.shape[-1]
    O = q.new_empty((B, T, H, V), dtype=_out_dtype(q, family, cfg))
    ST = q.new_empty((_states(q, v, cu_seqlens), H, q.shape[-1], V), dtype=torch.float32)
    return [O, ST] + [q.new_empty(s, dtype=d) for s, d in _FAMILIES[family][2](q, x, v, list(cfg), cu_seqlens)]


def _family_bwd(q, x, v, eta, g, saved, dO, dST, family, cfg, need_ds0, cu_seqlens=None):
    dST = dST.contiguous().float() if dST is not None else None
    return _FAMILIES[family][1](q, x, v, eta, g, list(saved), dO.contiguous(), dST, cfg, need_ds0, cu_seqlens)


@torch.library.custom_op("falcon_lab::chunk_core_bwd", mutates_args=())
def chunk_core_bwd(q: torch.Tensor, x: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, g: torch.Tensor,
                   saved: List[torch.Tensor], dO: torch.Tensor, dST: Optional[torch.Tensor], family: str,
                   cfg: List[int], need_ds0: bool, cu_seqlens: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    grads = _family_bwd(q, x, v, eta, g, saved, dO, dST, family, list(cfg), need_ds0, cu_seqlens)
    dS0 = grads[5] if grads[5] is not None else q.new_empty(0, dtype=torch.float32)
    return [*grads[:5], dS0]


@chunk_core_bwd.register_fake
def _(q, x, v, eta, g, saved, dO, dST, family, cfg, need_ds0, cu_seqlens=None):
    H, K, V = q.shape[2], q.shape[3], v.shape[-1]
    dS0 = q.new_empty((_states(q, v, cu_seqlens), H, K, V) if need_ds0 else (0,), dtype=torch.float32)
    return [torch.empty_like(q), torch.empty_like(x), torch.empty_like(v), torch.empty_like(eta),
            torch.empty_like(g), dS0]


def _setup_context(ctx, inputs, output):
    q, x, v, eta, g, S0, family, cfg, *rest = inputs  # a traced call may leave cu_seqlens = None out
    cu = rest[0] if rest else None
    ctx.save_for_backward(q, x, v, eta, g, *output[2:], *([cu] if cu is not None else []))
    ctx.family, ctx.cfg, ctx.has_s0, ctx.has_cu = family, list(cfg), S0 is not None, cu is not None
    # Gradients of outputs nobody used arrive as None, not as zero tensors: the saved intermediates (HS, A, WT, R
    # are outputs here only because a custom operator must return them) would otherwise get zero-filled
    # gradients of their full size in every backward (at (16, 2048, 12, 64): ~305 MB for Falcon-1's HS, A, WT, R,
    # ~104 MB for Falcon-1A's HS, W times that for Falcon-3's expansion; the H200 bench's peaks rose by 288 and
    # 96 MB between f0999d9 and 273f685, across the change to custom operators), and an unused final state a zero
    # dS_T that the kernels then read.
    ctx.set_materialize_grads(False)


def _grads(ctx, dO, dST, bwd):
    """The core's input gradients from dO, dS_T (either may be None) through `bwd` (the backward operator or
    the family's function itself): what both the operator's autograd and the eager Function return."""
    q, x, v, eta, g, *saved = ctx.saved_tensors
    cu = saved.pop() if ctx.has_cu else None
    if dO is None:
        dO = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=_out_dtype(q, ctx.family, ctx.cfg), device=q.device)
    need_ds0 = bool(ctx.has_s0 and ctx.needs_input_grad[5])
    dq, dx, dv, deta, dg, dS0 = bwd(q, x, v, eta, g, saved, dO, dST, ctx.family, ctx.cfg, need_ds0, cu)
    return dq, dx, dv, deta, dg, (dS0 if need_ds0 else None), None, None, None


def _backward(ctx, grads):
    # one gradient per input the call passed: a traced call that leaves the default cu_seqlens out has one fewer
    return _grads(ctx, grads[0], grads[1], chunk_core_bwd)[:len(ctx.needs_input_grad)]


chunk_core_fwd.register_autograd(_backward, setup_context=_setup_context)


class _ChunkCore(torch.autograd.Function):
    """The operator's forward and backward without the operator's dispatch (plain eager calls only)."""

    @staticmethod
    def forward(ctx, q, x, v, eta, g, S0, family, cfg, cu_seqlens):
        out = _FAMILIES[family][0](q, x, v, eta, g, S0, cfg, cu_seqlens)
        _setup_context(ctx, (q, x, v, eta, g, S0, family, cfg, cu_seqlens), out)
        return out[0], out[1]

    @staticmethod
    def backward(ctx, dO, dST):
        return _grads(ctx, dO, dST, _family_bwd)


def plain_eager() -> bool:
    """True outside torch.compile tracing and with no TorchDispatchMode active: where the Triton backend may run
    its kernels through autograd.Functions (the core's `_ChunkCore`, the fused prep) instead of the operator."""
    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


def chunk_core(q, x, v, eta, g, S0, family: str, cfg, cu_seqlens=None) -> tuple:
    """(O, S_T) of one Triton kernel family: through the custom operator while torch.compile traces or a
    dispatch mode is active (selective checkpointing, fake tensors), else through `_ChunkCore` (same functions,
    less host time). cu_seqlens: packed sequences run natively (scalar family, window 1)."""
    cfg = [int(c) for c in cfg]
    if not plain_eager():
        out = chunk_core_fwd(q, x, v, eta, g, S0, family, cfg, cu_seqlens)
        return out[0], out[1]
    return _ChunkCore.apply(q, x, v, eta, g, S0, family, cfg, cu_seqlens)
