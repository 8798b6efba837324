"""The reductions of falcon-math.md §4.1, fla's references under the exact mappings, NLMS descent."""

import pytest
import torch

from falcon_inputs import make_inputs, rel
from falcon_lab.kernels import FalconState, chunk_falcon, recurrent_falcon
from falcon_lab.kernels.chunk_torch import core_chunk
from falcon_lab.kernels.prep import prepare


@pytest.mark.parametrize("pair", [("3", "1"), ("3A", "1A")])
@pytest.mark.parametrize("lam_mode", ["absolute", "scaled"])
def test_window_one_reduces_to_scalar(pair, lam_mode):
    w_var, s_var = pair
    q, k, v, beta, lam = make_inputs(w_var, T=30)
    o3, s3 = chunk_falcon(q, k, v, beta, lam, variant=w_var, window=1, lam_mode=lam_mode,
                          output_final_state=True, chunk_size=8)
    o1, s1 = chunk_falcon(q, k, v, beta, lam, variant=s_var, lam_mode=lam_mode,
                          output_final_state=True, chunk_size=8)
    assert rel(o3, o1) < 1e-12 and rel(s3.S, s1.S) < 1e-12


@pytest.mark.parametrize("pair", [("2", "1"), ("2A", "1A")])
def test_per_column_with_tied_gains_equals_scalar(pair):
    c_var, s_var = pair
    q, k, v, beta, lam = make_inputs(s_var, T=30)
    tied = beta[..., None].expand(*beta.shape, v.shape[-1]).contiguous()
    o2, _ = chunk_falcon(q, k, v, tied, lam, variant=c_var, lam_mode="scaled", chunk_size=8)
    o1, _ = chunk_falcon(q, k, v, beta, lam, variant=s_var, lam_mode="scaled", chunk_size=8)
    assert rel(o2, o1) < 1e-12


@pytest.mark.parametrize("W", [2, 4])
def test_3A_is_a_sum_of_W_shifted_1A_scans(W):
    q, k, v, beta, lam = make_inputs("3A", T=33)
    kw = dict(variant="3A", window=W, step="nlms", lam_mode="scaled", shift=True, eps=1e-6,
              eps_gamma=1e-4)
    inp = prepare(k, v, beta, lam, seen=torch.zeros(2, dtype=torch.long), **kw)
    o_full, _ = chunk_falcon(q, k, v, beta, lam, chunk_size=8, **{a: b for a, b in kw.items()
                                                                  if a not in ("variant", "window")},
                             variant="3A", window=W)
    total = 0
    T = q.shape[1]
    for m in range(W):  # scan m writes the pair m steps back: x_{t-m} v_{t-m}, same η_t/B_t and γ_t
        xm = inp.xw[:, W - 1 - m:W - 1 - m + T]
        vm = inp.vw[:, W - 1 - m:W - 1 - m + T]
        o_m, _ = core_chunk(q, xm, vm, inp.eta, inp.g, None, delta=False, window=1, read_after=True,
                            chunk_size=8)
        total = total + o_m
    assert rel(total, o_full) < 1e-12


def test_falcon1_equals_fla_gated_delta_rule_under_the_exact_mapping():
    import fla.ops.gated_delta_rule.naive as naive  # fla-core is a dev dependency: fail, never skip
    q, k, v, beta, lam = make_inputs("1", T=40, K=8, V=8, lam_scale=0.5)
    o, st = chunk_falcon(q, k, v, beta, lam, variant="1", lam_mode="scaled", output_final_state=True)
    inp = prepare(k, v, beta, lam, variant="1", window=1, step="nlms", lam_mode="scaled", shift=True,
                  eps=1e-6, eps_gamma=1e-4, seen=torch.zeros(2, dtype=torch.long))
    gamma = inp.g.exp()
    # falcon-math.md §5: k = x, v' = γ v, g = log γ, β' = η / γ, scale 1
    o_fla, S_fla = naive.naive_recurrent_gated_delta_rule(
        q.float(), inp.xw.float(), (gamma[..., None] * v).float(), (inp.eta / gamma).float(),
        inp.g.float(), scale=1.0, output_final_state=True)
    assert rel(o_fla, o) < 1e-5 and rel(S_fla, st.S) < 1e-5


def test_falcon1A_equals_fla_simple_gla_under_the_exact_mapping():
    import fla.ops.simple_gla.naive as naive
    q, k, v, beta, lam = make_inputs("1A", T=40, K=8, V=8, lam_scale=0.5)
    o, _ = chunk_falcon(q, k, v, beta, lam, variant="1A", lam_mode="scaled")
    inp = prepare(k, v, beta, lam, variant="1A", window=1, step="nlms", lam_mode="scaled", shift=True,
                  eps=1e-6, eps_gamma=1e-4, seen=torch.zeros(2, dtype=torch.long))
    # k = η ⊙ x, g = log γ, scale 1
    o_fla, _ = naive.naive_recurrent_simple_gla(q.float(), (inp.eta[..., None] * inp.xw).float(),
                                                v.float(), inp.g.float(), scale=1.0)
    assert rel(o_fla, o) < 1e-5


def _ridge_loss(S, X, Y, lam):
    """Instantaneous (window-mean) ridge loss ½ mean_j ||y_j - Sᵀx_j||² + ½ λ ||S||², per column."""
    R = Y - X @ S
    return 0.5 * (R ** 2).mean(0) + 0.5 * lam * (S ** 2).sum(0)


@pytest.mark.parametrize("variant", ["1", "2", "3"])
def test_nlms_step_never_increases_the_instantaneous_loss(variant):
    # β in (0, 2), absolute λ small enough that ηλ < 1 - ε_γ: each step is gradient descent with a
    # step below 2 / L on the instantaneous ridge loss, so that loss must not increase.
    W = 3
    q, k, v, beta, lam = make_inputs(variant, B=1, T=40, H=1, K=4, V=3, beta_range=(0.05, 1.95),
                                     lam_scale=0.3)
    st, checked = None, 0
    for t in range(40):
        sl = [x[:, t:t + 1] for x in (q, k, v, beta, lam)]
        S_prev = st.S[0, 0] if st is not None else torch.zeros(4, 3, dtype=torch.float64)
        pairs_x = st.tail_x[0, :, 0] if (st is not None and st.tail_x is not None) else None
        pairs_v = st.tail_v[0, :, 0] if (st is not None and st.tail_v is not None) else None
        last = st.last_k[0, 0] if st is not None else None
        _, st = recurrent_falcon(*sl, variant=variant, window=W, initial_state=st, output_final_state=True)
        if last is None:
            continue  # t = 1: no pair is written (η_1 = 0)
        X, Y = last[None], v[0, t:t + 1, 0]
        if variant == "3":
            X = torch.cat([pairs_x, X])
            Y = torch.cat([pairs_v, Y])
            keep = X.abs().sum(-1) > 0
            X, Y = X[keep], Y[keep]
        lam_t = lam[0, t, 0]
        before = _ridge_loss(S_prev, X, Y, lam_t)
        after = _ridge_loss(st.S[0, 0], X, Y, lam_t)
        assert (after <= before + 1e-12).all(), (t, before, after)
        checked += 1
    assert checked == 39


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_top_eigenvalue_matches_eigvalsh(n):
    """Falcon-3's μ_t without cuSOLVER (repeated squaring + Rayleigh quotient) equals float64 eigvalsh to
    rounding, also for rank-deficient, all-zero, rank-1 windows of identical keys (the MQAR windows on which
    cuSOLVER failed to converge) and a nearly degenerate top pair; its gradient is eigvalsh's."""
    from falcon_lab.kernels.prep import _largest_eig
    g = torch.Generator().manual_seed(n)
    K = max(9, n + 1)  # key dimension: the window Gram is the n x n matrix of n keys
    x = torch.randn(300, K, n, dtype=torch.float64, generator=g)
    x[:40, :, -1] = 0  # rank-deficient
    x[40:50] = 0  # all-zero windows
    x[50:60] = x[50:60, :, :1]  # n identical keys: rank 1, an (n-1)-fold zero eigenvalue
    if n >= 2:  # top pair 1e-6 apart: orthogonal columns of norms 1 and 1 - 5e-7
        q = torch.linalg.qr(torch.randn(10, K, n, dtype=torch.float64, generator=g))[0]
        r = torch.linalg.qr(torch.randn(10, n, n, dtype=torch.float64, generator=g))[0]  # not diagonal
        x[60:70] = q * torch.tensor([1.0, 1 - 5e-7] + [0.3] * (n - 2), dtype=torch.float64) @ r
    gram = (x.transpose(-1, -2) @ x).requires_grad_(True)
    ref = torch.linalg.eigvalsh(gram)[..., -1]
    got = _largest_eig(gram)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12), (got - ref).abs().max()
    got32 = _largest_eig(gram.detach().float()).double()
    assert torch.allclose(got32, ref.detach(), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got32).all()
    # gradient: a weighted sum over the matrices with a simple top eigenvalue (eigvalsh's is defined there)
    ev = torch.linalg.eigvalsh(gram.detach())
    simple = (ev[..., -1] - ev[..., -2] > 1e-3 * ev[..., -1]) if n > 1 else torch.ones(300, dtype=torch.bool)
    w = torch.randn(300, dtype=torch.float64, generator=g) * simple
    (gr,) = torch.autograd.grad((got * w).sum(), gram)
    (gr_ref,) = torch.autograd.grad((ref * w).sum(), gram)
    assert simple.sum() > 200
    assert torch.allclose(gr, gr_ref, rtol=1e-9, atol=1e-9), (gr - gr_ref).abs().max()
