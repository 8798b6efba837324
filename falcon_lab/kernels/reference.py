"""The step-by-step core: the float64 truth every other backend is tested against.

One loop over time, exactly the recurrence of kernel-contract.md (falcon-math.md §4): for each t the
right-hand side uses the pre-update state S_{t-1} for every residual in the window (Jacobi).
With T = 1 and a carried state it is also the decoding step.
"""

from __future__ import annotations

from typing import Optional

import torch


def core_recurrent(
    q: torch.Tensor,  # [B, T, H, K]
    xw: torch.Tensor,  # [B, T+W-1, H, K]
    vw: torch.Tensor,  # [B, T+W-1, H, V]
    eta: torch.Tensor,  # [B, T, H] or [B, T, H, V]
    g: torch.Tensor,  # like eta
    S0: Optional[torch.Tensor],  # [B, H, K, V]
    *,
    delta: bool,
    window: int,
    read_after: bool,
    chunk_size: Optional[int] = None,  # the core contract's argument; a token loop has no chunks
):
    cd = eta.dtype
    Bsz, T, H, K = q.shape
    V = vw.shape[-1]
    W = window
    per_col = eta.dim() == 4
    S = S0.to(cd) if S0 is not None else q.new_zeros(Bsz, H, K, V, dtype=cd)
    qc, xc, vc = q.to(cd), xw.to(cd), vw.to(cd)
    # Per-step views made once with unbind: slicing inside the loop would make autograd build a
    # full-size zero gradient per step (a quadratic backward).
    xs_t = xc.unfold(1, W, 1).permute(0, 1, 4, 2, 3).unbind(1)  # T x [B, W, H, K]: step t's pairs
    vs_t = vc.unfold(1, W, 1).permute(0, 1, 4, 2, 3).unbind(1)
    outs = []
    for q_t, xs, vs, e_t, g_t in zip(qc.unbind(1), xs_t, vs_t, eta.unbind(1), g.unbind(1)):
        if delta:
            r = vs - torch.einsum("bwhk,bhkv->bwhv", xs, S)  # residuals at S_{t-1}
        else:
            r = vs
        upd = torch.einsum("bwhk,bwhv->bhkv", xs, r)
        if per_col:
            S_new = S * g_t.exp()[:, :, None, :] + upd * e_t[:, :, None, :]
        else:
            S_new = S * g_t.exp()[..., None, None] + upd * e_t[..., None, None]
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S_new if read_after else S))
        S = S_new
    o = torch.stack(outs, dim=1) if outs else q.new_zeros(Bsz, 0, H, V, dtype=cd)
    return o.to(q.dtype), S
