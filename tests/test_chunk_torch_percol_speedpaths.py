"""Falcon-2/2A's torch chunk form (per-column tiles: precomputed per-column inverses, a loop that only
carries the state, read-after recovered from read-before) against the float64 recurrence, forward and
every gradient, for every tile size that the tiling can produce (the tile changes cost only)."""

import itertools

import pytest
import torch

from falcon_inputs import make_inputs, rel
from falcon_lab.kernels import FalconState, chunk_falcon, recurrent_falcon
import falcon_lab.kernels.chunk_torch as ct


@pytest.mark.parametrize("variant", ["2", "2A"])
@pytest.mark.parametrize("tile,read", list(itertools.product([1, 3, 8], ["after", "before"])))
def test_per_column_tiles_match_recurrence_forward_and_backward(variant, tile, read, monkeypatch):
    monkeypatch.setattr(ct, "PER_COLUMN_TILE", tile)
    # T = 19 is not a multiple of any tile > 1 (padded last tile); λ̄ = 8 scaled with β up to 1.99
    # makes the clamp fire, so the decays inside a tile span many orders of magnitude.
    q, k, v, beta, lam = make_inputs(variant, T=19, V=6, requires_grad=True, beta_range=(0.1, 1.99),
                                     lam_scale=8.0)
    S0 = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    kw = dict(variant=variant, read=read, lam_mode="scaled", eps_gamma=1e-2)
    outs, grads = [], []
    for fn in (recurrent_falcon, chunk_falcon):
        s0 = S0.clone().requires_grad_()
        extra = {} if fn is recurrent_falcon else {"chunk_size": 64, "backend": "torch"}
        init = FalconState(S=s0, last_k=torch.zeros(2, 2, 5, dtype=torch.float64),
                           seen=torch.zeros(2, dtype=torch.long), tail_x=None, tail_v=None,
                           variant=variant, window=1, shift=True, read=read)
        o, st = fn(q, k, v, beta, lam, initial_state=init, output_final_state=True, **kw, **extra)
        (o.square().sum() + st.S.sin().sum()).backward()
        outs.append((o.detach(), st.S.detach()))
        grads.append([t.grad.clone() for t in (q, k, v, beta, lam, s0)])
        for t in (q, k, v, beta, lam):
            t.grad = None
    assert rel(outs[1][0], outs[0][0]) < 1e-12 and rel(outs[1][1], outs[0][1]) < 1e-12
    for g_c, g_r in zip(grads[1], grads[0]):
        assert torch.isfinite(g_c).all() and rel(g_c, g_r) < 1e-10


@pytest.mark.parametrize("variant", ["2", "2A"])
@pytest.mark.parametrize("tile,read", [(1, "after"), (3, "before"), (8, "after")])
def test_unfactored_fallback_matches_recurrence(variant, tile, read, monkeypatch):
    """The factored form (e^{u⁻_i - u_s} = e^{u⁻_i} e^{-u_s}) gives way to the unfactored decay tensor
    where a tile decays by more than e^{-_FACTOR_EXP}; a bound of 0 forces that path everywhere (2A's long
    tiles are retried on short tiles first, then fall back too)."""
    monkeypatch.setattr(ct, "_FACTOR_EXP", {dt: 0.0 for dt in ct._FACTOR_EXP})
    test_per_column_tiles_match_recurrence_forward_and_backward(variant, tile, read, monkeypatch)
