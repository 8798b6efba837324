"""Chunked PyTorch forms of the core (kernel-contract.md), stable-exponent (falcon-math.md §6).

Every exponent is a difference u_i - u_s of local log-decay prefixes with s <= i, so it is <= 0; no
value is ever divided by a decay prefix (the paper's renormalised form overflows fp32 under strong
decay). Everything that does not depend on the carried state is computed for all chunks at once;
the only Python loop is the inter-chunk state pass (phase 2). Differentiable by autograd.

Per chunk, with u the inclusive log-decay prefix, u⁻ the exclusive one, u^r = u (read after) or u⁻
(read before), and pseudo-tokens (i, m) = the m-th pair of step i's window (W = 1: one per step):

    (I + L) R = V_p - diag(e^{u⁻}) X_p S_in,   L_{(i,m),(s,m')} = [s < i] e^{u⁻_i - u_s} η_s x_{i,m}·x_{s,m'}
    O = diag(e^{u^r}) Q S_in + ((Q X_pᵀ) ⊙ [s ≤ i or s < i] e^{u^r_i - u_s} η_s) R
    S_out = e^{u_C} S_in + X_pᵀ ((e^{u_C - u_s} η_s) ⊙ R)

(regression / "delta"; the inner-product forms are the same with R = V_p, and use a banded window
matrix instead of pseudo-tokens). For Falcon-3 the time chunk is chunk_size // W so that the
block-triangular system stays chunk_size pseudo-tokens wide (falcon-math.md §6.6, trick 4: ours);
for Falcon-2/2A, whose decay masks are per value column, time is tiled by at most 8 steps (ours).
The tiling changes cost only: every tile size gives the same result to rounding.

Under torch.compile (ours): the form's Python loops over chunks / tiles would be traced and unrolled
into the compiled graph (Falcon-2 at T = 512: 64 tiles x the per-tile ops, forward and backward; its
compile did not finish on the H200), so `core_chunk` then runs as one opaque custom operator pair
(`falcon_lab::chunk_torch_fwd` / `_bwd`, like the Triton cores): the forward runs this same code without
autograd, the backward recomputes it with autograd (the recomputation Falcon-2/2A already do in eager).
Eager calls run the code directly, as before.
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint


PER_COLUMN_TILE = 8  # ours: the time tile of Falcon-2/2A (exact for any value; measured fastest on CPU)


def _masked_exp(diff: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return diff.masked_fill(~mask, float("-inf")).exp()


def _chunks(t: torch.Tensor):
    """Per-chunk views [B, H, ...] for the state pass, made once with unbind (indexing inside the loop
    would make autograd build a full-size zero gradient per chunk: a quadratic backward). Slices of a
    contiguous [B, H, N, ...] tensor keep (B, H) collapsible, so batched matmuls do not copy them."""
    return t.unbind(2)


def _rep(t: torch.Tensor, W: int, dim: int) -> torch.Tensor:
    return t if W == 1 else t.repeat_interleave(W, dim=dim)


def core_chunk(
    q: torch.Tensor,
    xw: torch.Tensor,
    vw: torch.Tensor,
    eta: torch.Tensor,
    g: torch.Tensor,
    S0: Optional[torch.Tensor],
    *,
    delta: bool,
    window: int,
    read_after: bool,
    chunk_size: int = 64,
):
    """The chunked PyTorch core (kernel-contract.md): (o [B, T, H, V] in q's dtype, S_T). Under
    torch.compile, one opaque custom operator (module docstring); in eager, `_core_chunk` itself."""
    if torch.compiler.is_compiling():
        o, S = chunk_torch_fwd(q, xw, vw, eta, g, S0, bool(delta), int(window), bool(read_after), int(chunk_size))
        return o, S
    return _core_chunk(q, xw, vw, eta, g, S0, delta=delta, window=window, read_after=read_after,
                       chunk_size=chunk_size)


def _core_chunk(q, xw, vw, eta, g, S0, *, delta, window, read_after, chunk_size=64, recompute_percol=True):
    cd = eta.dtype
    Bsz, T, H, K = q.shape
    V = vw.shape[-1]
    W = window
    per_col = eta.dim() == 4
    if per_col and W != 1:
        raise NotImplementedError("per-column gates with a window > 1 are not a Falcon variant")
    if per_col:  # per-column decay masks cost C*V per token: tile time by at most 8 steps
        C = min(chunk_size, PER_COLUMN_TILE)
    elif delta and W > 1:  # keep the (C/W)*W pseudo-token system chunk_size wide
        C = max(1, chunk_size // W)
    else:
        C = chunk_size
    N = math.ceil(T / C)
    pad = N * C - T

    # [B, H, T, *] layout in the compute dtype, time padded to N*C (padded steps: η = 0, log γ = 0).
    qh = F.pad(q.to(cd).transpose(1, 2), (0, 0, 0, pad))
    xh = F.pad(xw.to(cd).transpose(1, 2), (0, 0, 0, pad))
    vh = F.pad(vw.to(cd).transpose(1, 2), (0, 0, 0, pad))
    if per_col:
        eh = F.pad(eta.transpose(1, 2), (0, 0, 0, pad))
        gh = F.pad(g.transpose(1, 2), (0, 0, 0, pad))
    else:
        eh = F.pad(eta.transpose(1, 2), (0, pad))
        gh = F.pad(g.transpose(1, 2), (0, pad))
    S = S0.to(cd) if S0 is not None else q.new_zeros(Bsz, H, K, V, dtype=cd)

    P = C + W - 1  # pairs touched by one chunk of steps
    qc = qh.reshape(Bsz, H, N, C, K)
    if W == 1:
        xs, vs = xh.reshape(Bsz, H, N, C, K), vh.reshape(Bsz, H, N, C, V)
    else:
        xs = xh.unfold(2, P, C).transpose(-1, -2)  # [B, H, N, P, K]
        vs = vh.unfold(2, P, C).transpose(-1, -2)
    ec = eh.reshape(Bsz, H, N, C, *eh.shape[3:])
    gc = gh.reshape(Bsz, H, N, C, *gh.shape[3:])

    if per_col:
        if recompute_percol:
            o, S = _per_column_recomputed(qc, xs, vs, ec, gc, S, delta=delta, read_after=read_after)
        else:  # the custom operator's backward: already a recomputation
            o, S = _per_column(qc, xs, vs, ec, gc, S, delta=delta, read_after=read_after)
    else:
        u, u_prev, u_read, m_read, m_strict = _prefixes(gc, read_after)
        # decay-and-step matrix of the read-out: Dr[i, s] = [s ≤ i] e^{u^r_i - u_s} η_s
        Dr = _masked_exp(u_read[..., :, None] - u[..., None, :], m_read) * ec[..., None, :]
        u_last = u[..., -1]  # [B, H, N]
        dec_last = u_last.exp()[..., None, None]  # decay of S across a whole chunk
        w_end = (u_last[..., None] - u).exp() * ec  # weight of step s in S_out
        decay_q = u_read.exp()[..., None] * qc
        outs = []
        if not delta:
            if W == 1:
                M, m_end = Dr, w_end
            else:
                s_idx = torch.arange(C, device=q.device)[:, None]
                j_idx = torch.arange(P, device=q.device)[None, :]
                band = ((j_idx >= s_idx) & (j_idx <= s_idx + W - 1)).to(cd)  # [C, P]: pairs of step s
                M, m_end = Dr @ band, w_end @ band
            o_intra = ((qc @ xs.transpose(-1, -2)) * M) @ vs
            kv = xs.transpose(-1, -2) @ (m_end[..., None] * vs)  # [B, H, N, K, V]
            for o_n, dq_n, dl_n, kv_n in zip(_chunks(o_intra), _chunks(decay_q), _chunks(dec_last), _chunks(kv)):
                outs.append(o_n + dq_n @ S)
                S = dl_n * S + kv_n
        else:
            if W == 1:
                Xp, Vp = xs, vs
            else:  # pseudo-tokens (i, m) -> pair i + m, row-major: blocks of W rows per step
                Xp = xs.unfold(3, W, 1).permute(0, 1, 2, 3, 5, 4).reshape(Bsz, H, N, C * W, K)
                Vp = vs.unfold(3, W, 1).permute(0, 1, 2, 3, 5, 4).reshape(Bsz, H, N, C * W, V)
            Ds = _masked_exp(u_prev[..., :, None] - u[..., None, :], m_strict) * ec[..., None, :]
            L = (Xp @ Xp.transpose(-1, -2)) * _rep(_rep(Ds, W, -1), W, -2)
            rhs = torch.cat([Vp, _rep(u_prev.exp(), W, -1)[..., None] * Xp], dim=-1)
            sol = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
            Um, Wm = sol[..., :V], sol[..., V:]
            Pm = (qc @ Xp.transpose(-1, -2)) * _rep(Dr, W, -1)  # [B, H, N, C, CW]
            Xw_end = Xp * _rep(w_end, W, -1)[..., None]
            XwT = Xw_end.transpose(-1, -2)
            for U_n, W_n, dq_n, P_n, dl_n, X_n in zip(_chunks(Um), _chunks(Wm), _chunks(decay_q),
                                                      _chunks(Pm), _chunks(dec_last), _chunks(XwT)):
                R = U_n - W_n @ S
                outs.append(dq_n @ S + P_n @ R)
                S = dl_n * S + X_n @ R
        o = torch.stack(outs, dim=2)  # [B, H, N, C, V]
    o = o.reshape(Bsz, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(q.dtype), S


def _prefixes(gc: torch.Tensor, read_after: bool):
    """Per-chunk log-decay prefixes of gc [B, H, N, C, ...]: inclusive u, exclusive u⁻, the read prefix,
    and the [C, C] masks of the read-out (s <= i after, s < i before) and of the solve (s < i)."""
    u = gc.cumsum(3)
    u_prev = torch.cat([torch.zeros_like(u[:, :, :, :1]), u[:, :, :, :-1]], dim=3)
    u_read = u if read_after else u_prev
    idx = torch.arange(gc.shape[3], device=gc.device)
    m_read = idx[:, None] >= idx[None, :] if read_after else idx[:, None] > idx[None, :]
    m_strict = idx[:, None] > idx[None, :]
    return u, u_prev, u_read, m_read, m_strict


def _per_column_recomputed(qc, xs, vs, ec, gc, S, *, delta: bool, read_after: bool):
    """Falcon-2 / 2A under activation recomputation when autograd needs it (ours). Their per-column
    decay masks make autograd keep about a dozen [.., V, C, C] tensors, ~450 KB per token per layer
    at H = 6, K = V = 128 (measured with saved-tensor hooks): 175 GB for the small model's 32768-token
    step, which ran out of memory on the H200. Recomputing the op in backward keeps only its inputs
    (one extra forward of the op; the [.., V, C, C] tensors of one layer exist only transiently)."""
    fn = functools.partial(_per_column, delta=delta, read_after=read_after)
    args = (qc, xs, vs, ec, gc, S)
    if torch.is_grad_enabled() and any(t.requires_grad for t in args):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _per_column(qc, xs, vs, ec, gc, S, *, delta: bool, read_after: bool):
    """Falcon-2 / 2A on tiles of C steps (the caller keeps C small: the per-column decay tensors are
    [C, C, V]; the C x C systems cannot share an inverse across columns, falcon-math.md §6.5).

    Everything that does not depend on the carried state is precomputed for all tiles at once, in the
    [.., C(i), C(s), V] layout (columns last: per-column products are broadcasts, never copies), and
    (ours) the state pass does only what the recurrence needs per tile:
    - one decay tensor E[i, s, c] = e^{u⁻_i - u_s} η_s (s < i) serves the read-out and the solve (the
      clamp only touches s >= i, which the strictly lower [C, C] factors A = QXᵀ and G = XXᵀ zero);
    - Falcon-2: the per-column inverses (I + L_c)^{-1}, L_c = G ⊙ E[.., c], by row-wise forward
      substitution vectorised over tiles and columns, so that the loop is R = (I + L)^{-1} (v - e^{u⁻} ⊙
      X S_in) and the state update, with no triangular solve; Falcon-2A: one fused multiply-add;
    - the read-outs e^{u⁻} Q S_in and the intra-tile terms for all tiles after the loop, read before
      the update; read-after is then o_i = γ_i o⁻_i + (q_i·x_i) η_i r_i (§4).
    Measured alternatives (2 cores, T = 4096): a value-major layout with one batched
    solve_triangular was slower forward+backward; tiles of 4 or 16 were slower than 8."""
    u, u_prev, _, _, m_strict = _prefixes(gc, read_after)
    C = qc.shape[3]
    E = (u_prev[..., :, None, :] - u[..., None, :, :]).clamp_max(0.0).exp() * ec[..., None, :, :]
    A = (qc @ xs.transpose(-1, -2)).masked_fill(~m_strict, 0.0)  # [B,H,N,C,C], strictly lower
    decay_last = u[..., -1, :].exp()[..., None, :]  # [B,H,N,1,V]
    w_end = (u[..., -1:, :] - u).exp() * ec  # [B,H,N,C,V]
    S_ins = []
    if not delta:
        R = vs
        kv = xs.transpose(-1, -2) @ (w_end * vs)  # [B,H,N,K,V]
        for dl_n, kv_n in zip(_chunks(decay_last), _chunks(kv)):
            S_ins.append(S)
            S = torch.addcmul(kv_n, dl_n, S)
    else:
        G = (xs @ xs.transpose(-1, -2)).masked_fill(~m_strict, 0.0)
        Lc = E * G[..., None]
        eye = torch.eye(C, dtype=Lc.dtype, device=Lc.device)[..., None]  # [C, C, 1]
        rows = [eye[0].expand(*Lc.shape[:3], C, Lc.shape[-1])]
        for i in range(1, C):
            prev = torch.stack(rows, dim=3)  # [B,H,N,i,C,V]
            rows.append(eye[i] - (Lc[..., i, :i, None, :] * prev).sum(3))
        Ainv = torch.stack(rows, dim=3)  # [B,H,N,C(i),C(j),V]
        U = (Ainv * vs[..., None, :, :]).sum(4)  # (I + L)^{-1} v: [B,H,N,C,V]
        Wd = Ainv * u_prev.exp()[..., None, :, :]  # (I + L)^{-1} diag(e^{u⁻})
        xT = xs.transpose(-1, -2)
        Rs = []
        for x_n, xT_n, U_n, W_n, dl_n, we_n in zip(_chunks(xs), _chunks(xT), _chunks(U), _chunks(Wd),
                                                    _chunks(decay_last), _chunks(w_end)):
            S_ins.append(S)
            R_n = U_n - (W_n * (x_n @ S)[..., None, :, :]).sum(-2)
            Rs.append(R_n)
            S = dl_n * S + xT_n @ (we_n * R_n)
        R = torch.stack(Rs, dim=2)
    S_in = torch.stack(S_ins, dim=2)  # [B,H,N,K,V]
    o = u_prev.exp() * (qc @ S_in) + ((E * R[..., None, :, :]) * A[..., None]).sum(4)
    if read_after:
        qx = (qc * xs).sum(-1, keepdim=True)  # [B,H,N,C,1]
        o = gc.exp() * o + qx * ec * R
    return o, S


# ---- the opaque form for torch.compile (ours) ---------------------------------------------------------
def _autograd_on():
    """A custom operator's implementation runs below autograd (its dispatch keys are excluded); the
    backward's recomputation needs them back. Keeps the other thread-local dispatch keys as they are."""
    DK = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(DK.AutogradFunctionality).remove(DK.ADInplaceOrView)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@torch.library.custom_op("falcon_lab::chunk_torch_fwd", mutates_args=())
def chunk_torch_fwd(q: torch.Tensor, xw: torch.Tensor, vw: torch.Tensor, eta: torch.Tensor, g: torch.Tensor,
                    S0: Optional[torch.Tensor], delta: bool, window: int, read_after: bool,
                    chunk_size: int) -> List[torch.Tensor]:
    with torch.no_grad():
        o, S = _core_chunk(q, xw, vw, eta, g, S0, delta=delta, window=window, read_after=read_after,
                           chunk_size=chunk_size)
    return [o.contiguous(), S.contiguous()]


@chunk_torch_fwd.register_fake
def _(q, xw, vw, eta, g, S0, delta, window, read_after, chunk_size):
    B, T, H, K = q.shape
    V = vw.shape[-1]
    return [q.new_empty((B, T, H, V)), q.new_empty((B, H, K, V), dtype=eta.dtype)]


@torch.library.custom_op("falcon_lab::chunk_torch_bwd", mutates_args=())
def chunk_torch_bwd(q: torch.Tensor, xw: torch.Tensor, vw: torch.Tensor, eta: torch.Tensor, g: torch.Tensor,
                    S0: Optional[torch.Tensor], dO: torch.Tensor, dS: Optional[torch.Tensor], delta: bool,
                    window: int, read_after: bool, chunk_size: int) -> List[torch.Tensor]:
    ins = [t.detach().requires_grad_() for t in (q, xw, vw, eta, g, *([S0] if S0 is not None else []))]
    with _autograd_on(), torch.enable_grad():
        o, S = _core_chunk(*ins[:5], ins[5] if S0 is not None else None, delta=delta, window=window,
                           read_after=read_after, chunk_size=chunk_size, recompute_percol=False)
        outs, douts = ([o, S], [dO, dS]) if dS is not None else ([o], [dO])
        grads = torch.autograd.grad(outs, ins, douts, allow_unused=True)
    # contiguous, as the fake outputs below (compiled code may view them by those strides)
    grads = [gr.contiguous() if gr is not None else t.new_zeros(t.shape) for gr, t in zip(grads, ins)]
    if S0 is None:
        grads.append(q.new_empty(0, dtype=eta.dtype))
    return grads


@chunk_torch_bwd.register_fake
def _(q, xw, vw, eta, g, S0, dO, dS, delta, window, read_after, chunk_size):
    return [t.new_empty(t.shape) for t in (q, xw, vw, eta, g)] + [
        S0.new_empty(S0.shape) if S0 is not None else q.new_empty(0, dtype=eta.dtype)]


def _torch_setup_context(ctx, inputs, output):
    q, xw, vw, eta, g, S0, delta, window, read_after, chunk_size = inputs
    ctx.save_for_backward(q, xw, vw, eta, g, S0)
    ctx.cfg = (delta, window, read_after, chunk_size)
    ctx.has_s0 = S0 is not None


def _torch_backward(ctx, grads):
    q, xw, vw, eta, g, S0 = ctx.saved_tensors
    dO, dS = grads[0], grads[1]
    if dO is None:
        dO = torch.zeros(q.shape[:3] + (vw.shape[-1],), dtype=q.dtype, device=q.device)
    out = chunk_torch_bwd(q, xw, vw, eta, g, S0 if ctx.has_s0 else None, dO, dS, *ctx.cfg)
    return (*out[:5], out[5] if ctx.has_s0 else None, None, None, None, None)


chunk_torch_fwd.register_autograd(_torch_backward, setup_context=_torch_setup_context)
