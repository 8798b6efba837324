"""The shared pre-step of every backend: pairs, window statistic, NLMS step, decay (kernel-contract.md).

Plain differentiable PyTorch: the chain rules of the shift, the NLMS division, the clamp and the
window spectral norm μ_t (repeated squaring + Rayleigh quotient, `_largest_eig`) are autograd's.
Notation follows falcon-math.md §4:
position t (1-based) writes the pair (x_t, y_t) = (φ(k_{t-1}), v_t) (shift) or (φ(k_t), v_t).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .spec import SPECS, FalconSpec

# variant name -> FalconSpec (delta, per_column, windowed): the one encoding of a variant (spec.py)
VARIANTS = SPECS


@dataclass
class CoreInputs:
    xw: torch.Tensor  # [B, T+W-1, H, K] pair keys (first W-1 rows: carried tail)
    vw: torch.Tensor  # [B, T+W-1, H, V] pair values
    eta: torch.Tensor  # [B, T, H] or [B, T, H, V]: step (already / B_t for windows), 0 where no pair
    g: torch.Tensor  # same shape: log γ_t <= 0
    stat: torch.Tensor  # [B, T, H]: E_t, μ_t or Ē_t (diagnostics)


def effective_window(variant: str, window: int) -> int:
    return FalconSpec.from_variant(variant).window(window)


def prepare(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    variant: str,
    window: int,
    step: str,
    lam_mode: str,
    shift: bool,
    eps: float,
    eps_gamma: float,
    seen: torch.Tensor,  # [B] int64 tokens already consumed by each row
    last_k: Optional[torch.Tensor] = None,  # [B, H, K]
    tail_x: Optional[torch.Tensor] = None,  # [B, W-1, H, K]
    tail_v: Optional[torch.Tensor] = None,  # [B, W-1, H, V]
    valid: Optional[torch.Tensor] = None,  # [B, T] bool: False on right padding (varlen)
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1]: B = 1 holds N packed sequences (seen, last_k, tails per
    # sequence); then xw / vw are the packed pair stream: each sequence's W-1 carried tail rows, then its pairs
    eigvec: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,  # Falcon-3: the squarings' top eigenvector
    # ([.., W, W] fp32 -> [.., W, 1], no gradient) from elsewhere, e.g. the Triton kernel (triton/eig.py)
) -> CoreInputs:
    spec = FalconSpec.from_variant(variant)
    per_column, windowed = spec.per_column, spec.windowed
    W = spec.window(window)
    Bsz, T, H, K = k.shape
    V = v.shape[-1]
    cd = torch.float64 if k.dtype == torch.float64 else torch.float32

    # ---- the pair stream ------------------------------------------------------------------
    if cu_seqlens is not None:  # packed sequences: positions and the shift restart at each sequence's first token
        if Bsz != 1:
            raise ValueError(f"cu_seqlens: the packed prep takes B = 1, got B = {Bsz}")
        cu = cu_seqlens.to(k.device)
        N = cu.numel() - 1
        seq = torch.repeat_interleave(torch.arange(N, device=k.device), cu[1:] - cu[:-1], output_size=T)
        first = cu[:-1]
        pos = (seen.to(k.device)[seq] + torch.arange(T, device=k.device) - first[seq] + 1)[None]
    else:
        pos = seen.to(k.device)[:, None] + torch.arange(1, T + 1, device=k.device)  # global 1-based
    if shift and cu_seqlens is not None:
        prev = last_k if last_k is not None else k.new_zeros(N, H, K)
        x = torch.cat([k.new_zeros(1, 1, H, K), k[:, :-1]], dim=1)
        x = x.index_put((torch.zeros_like(first), first), prev.to(k.dtype))  # each sequence's x_1: its last_k
        n_pairs = pos - 1
    elif shift:
        prev = last_k if last_k is not None else k.new_zeros(Bsz, H, K)
        x = torch.cat([prev[:, None].to(k.dtype), k[:, :-1]], dim=1)
        n_pairs = pos - 1  # pairs written up to and including t
    else:
        x = k
        n_pairs = pos
    has_pair = n_pairs > 0  # [B, T]
    x = x * has_pair[..., None, None].to(x.dtype)  # the x_1 = 0 sentinel, in feature space
    win_idx = None
    if W > 1 and cu_seqlens is not None:  # the packed pair stream: sequence s at rows cu[s] + s(W-1) ..
        E = W - 1
        tx = tail_x if tail_x is not None else k.new_zeros(N, E, H, K)
        tv = tail_v if tail_v is not None else v.new_zeros(N, E, H, V)
        dest = torch.arange(T, device=k.device) + (seq + 1) * E  # token t's pair row
        trows = (first + torch.arange(N, device=k.device) * E)[:, None] + torch.arange(E, device=k.device)
        zero = torch.zeros_like(dest)
        xw = x.new_zeros(1, T + N * E, H, K).index_put((zero, dest), x[0]).index_put(
            (zero[:N * E], trows.reshape(-1)), tx.to(k.dtype).reshape(N * E, H, K))
        vw = v.new_zeros(1, T + N * E, H, V).index_put((zero, dest), v[0]).index_put(
            (zero[:N * E], trows.reshape(-1)), tv.to(v.dtype).reshape(N * E, H, V))
        win_idx = dest[:, None] - E + torch.arange(W, device=k.device)  # [T, W]: the pair rows of t's window
    elif W > 1:
        tx = tail_x if tail_x is not None else k.new_zeros(Bsz, W - 1, H, K)
        tv = tail_v if tail_v is not None else v.new_zeros(Bsz, W - 1, H, V)
        xw = torch.cat([tx.to(k.dtype), x], dim=1)
        vw = torch.cat([tv.to(v.dtype), v], dim=1)
    else:
        xw, vw = x, v
    count = n_pairs.clamp(min=0, max=W).to(cd)  # B_t: pairs in the window at t

    # ---- the statistic E_t / μ_t / Ē_t ------------------------------------------------------
    xc = xw.to(cd)
    if not windowed:
        stat = (xc[:, W - 1:] ** 2).sum(-1)  # E_t = ||x_t||²   [B, T, H]
    else:
        if win_idx is not None:  # packed: [1, T, H, K, W] gathered per sequence
            win = xc[0, win_idx].permute(0, 2, 3, 1)[None]
        else:
            win = xc.unfold(1, W, 1)  # [B, T, H, K, W]: pairs t..t+W-1 of the extended stream
        if not spec.delta:  # 3A: mean window energy
            stat = (win ** 2).sum((-2, -1)) / count.clamp(min=1)[..., None]  # Ē_t
        else:  # "3": top eigenvalue of the W x W window Gram (zero rows add zero eigenvalues)
            with torch.autocast(xc.device.type, enabled=False):  # the Gram in cd, not autocast's bf16
                gram = win.transpose(-1, -2) @ win  # [B, T, H, W, W]
                stat = _largest_eig(gram, eigvec=eigvec) / count.clamp(min=1)[..., None]  # μ_t

    # ---- λ_t, η_t, γ_t ----------------------------------------------------------------------
    lam_c = lam.to(cd)
    if lam_mode == "scaled":
        lam_t = lam_c * (stat.detach() if windowed else stat)
    else:
        lam_t = lam_c
    beta_c = beta.to(cd)
    if step == "nlms":
        den = stat + lam_t + eps
        if per_column:
            den = den[..., None]
        ok = den > 0
        eta = torch.where(ok, beta_c / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(den))
    else:
        eta = beta_c
    keep = has_pair if valid is None else has_pair & valid
    keep = keep[..., None] if not per_column else keep[..., None, None]
    eta = torch.where(keep, eta, torch.zeros_like(eta))
    lam_b = lam_t[..., None] if per_column else lam_t
    alpha = torch.clamp(eta * lam_b, max=1.0 - eps_gamma)
    g = torch.log1p(-alpha)
    if windowed:
        eta = eta / count.clamp(min=1)[..., None]
    return CoreInputs(xw=xw, vw=vw, eta=eta, g=g, stat=stat)


def _largest_eig(gram: torch.Tensor, squarings: Optional[int] = None,
                 eigvec: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Largest eigenvalue of each symmetric positive semi-definite [.., n, n] matrix (the window Gram),
    without cuSOLVER (ours). Repeated squaring of the trace-normalised matrix, P <- (P / tr P)^2, turns it
    into its top eigenprojector (the other eigenvalues shrink as (λ_i/λ_1)^(2^j)); a column of P is then
    a top eigenvector v, and the value is its Rayleigh quotient vᵀGv / vᵀv against the original matrix.
    The quotient's error is second order in v's error: the worst case over λ_2/λ_1 after 20 squarings is
    ~(λ_1 - λ_2)(λ_2/λ_1)^(2^21) <= λ_1 / (2^21 e) ~ 2e-7 λ_1, i.e. fp32 rounding (40 squarings in fp64:
    <= 2e-13 λ_1). v is taken without gradient, so the gradient is v vᵀ / vᵀv, eigvalsh's for a simple top
    eigenvalue (at an eigenvector the quotient is stationary in v). No host synchronisation and no data-dependent
    control flow, so it compiles and should be CUDA-graph capturable (capture not yet tried on the GPU; it trained
    the Falcon-3 B = 8 MQAR runs of block 11 on the H200); zero matrices give 0. Computed in fp32 at least.
    Why not eigvalsh: cuSOLVER's batched syevj raised "failed to converge" on the H200 in every MQAR run of
    Falcon-3 at B = 8 (2026-12-02, block 9; their windows hold Grams of 8 identical keys, rank 1 with a
    7-fold zero eigenvalue: our reading, seen on CPU, not isolated on the GPU), returned
    CUSOLVER_STATUS_INTERNAL_ERROR once a call held ~1e5 matrices, and cannot run under graph capture."""
    g = gram if gram.dtype in (torch.float32, torch.float64) else gram.float()
    if g.shape[-1] == 1:
        return g[..., 0, 0].to(gram.dtype)
    if squarings is None:
        squarings = 40 if g.dtype == torch.float64 else 20
    with torch.autocast(g.device.type, enabled=False):  # every product in g's dtype
        if eigvec is not None and g.dtype == torch.float32 and squarings == 20:  # the same squarings, one kernel
            v = eigvec(g)
        else:
            v = _top_eigvec_torch(g, squarings)
        num = (v * (g @ v)).sum((-2, -1))
    den = (v * v).sum((-2, -1))
    ok = den > 0
    top = torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))
    return top.to(gram.dtype)


def _top_eigvec_torch(g: torch.Tensor, squarings: int) -> torch.Tensor:
    """_largest_eig's top eigenvector ([.., n, 1], no gradient) by `squarings` squarings of the trace-normalised g."""
    with torch.no_grad():
        p = g.detach()
        tiny = torch.finfo(p.dtype).tiny
        for _ in range(squarings):
            tr = p.diagonal(dim1=-2, dim2=-1).sum(-1).clamp(min=tiny)
            p = p / tr[..., None, None]
            p = p @ p
        col = p.diagonal(dim1=-2, dim2=-1).argmax(-1)  # the column with the largest top-eigenvector weight
        return torch.take_along_dim(p, col[..., None, None], dim=-1)  # [.., n, 1]
