"""Exact continuation, decoding steps and varlen resets."""

import pytest
import torch

from falcon_inputs import VARIANTS, make_inputs, rel
from falcon_lab.kernels import FalconState, chunk_falcon, recurrent_falcon


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_split_anywhere_equals_one_call(variant, shift, fn):
    q, k, v, beta, lam = make_inputs(variant, T=41)
    call = chunk_falcon if fn == "chunk" else recurrent_falcon
    extra = {"chunk_size": 16} if fn == "chunk" else {}
    kw = dict(variant=variant, window=4, shift=shift, lam_mode="scaled", **extra)
    o_full, st_full = call(q, k, v, beta, lam, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(hash((variant, shift, fn)) % 1000)
    for cut in sorted(set([1, 2, 3, 40] + torch.randint(1, 41, (3,), generator=gen).tolist())):
        sl = lambda t, a, b: t[:, a:b]  # noqa: E731
        o1, st = call(*(sl(t, 0, cut) for t in (q, k, v, beta, lam)), output_final_state=True, **kw)
        o2, st2 = call(*(sl(t, cut, 41) for t in (q, k, v, beta, lam)), initial_state=st,
                       output_final_state=True, **kw)
        assert rel(torch.cat([o1, o2], 1), o_full) < 1e-12, cut
        assert rel(st2.S, st_full.S) < 1e-12
        assert torch.equal(st2.seen, st_full.seen)


@pytest.mark.parametrize("variant", VARIANTS)
def test_token_by_token_decoding_equals_full_scan(variant):
    q, k, v, beta, lam = make_inputs(variant, T=12)
    kw = dict(variant=variant, window=3, read="after")
    o_full, _ = chunk_falcon(q, k, v, beta, lam, **kw)
    st, outs = None, []
    for t in range(12):
        o, st = recurrent_falcon(*(x[:, t:t + 1] for x in (q, k, v, beta, lam)), initial_state=st,
                                 output_final_state=True, **kw)
        outs.append(o)
    assert rel(torch.cat(outs, 1), o_full) < 1e-12
    assert st.numel() > 0


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_varlen_equals_separate_sequences(variant, fn):
    lens = [5, 17, 1, 9, 2]
    T = sum(lens)
    q, k, v, beta, lam = make_inputs(variant, B=1, T=T)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    call = chunk_falcon if fn == "chunk" else recurrent_falcon
    extra = {"chunk_size": 4} if fn == "chunk" else {}
    kw = dict(variant=variant, window=3, lam_mode="scaled", **extra)
    # a carried state per sequence, from a previous segment of each
    pre = make_inputs(variant, B=len(lens), T=4, seed=7)
    _, st0 = call(*pre, output_final_state=True, **kw)
    o, st = call(q, k, v, beta, lam, cu_seqlens=cu, initial_state=st0, output_final_state=True, **kw)
    assert o.shape == (1, T, 2, 4)
    for i in range(len(lens)):
        a, b = cu[i].item(), cu[i + 1].item()
        st_i = st0.index_select(torch.tensor([i]))
        o_i, s_i = call(*(t[:, a:b] for t in (q, k, v, beta, lam)), initial_state=st_i,
                        output_final_state=True, **kw)
        assert rel(o[:, a:b], o_i) < 1e-12
        assert rel(st.S[i:i + 1], s_i.S) < 1e-12
        assert rel(st.last_k[i:i + 1], s_i.last_k) < 1e-15
        if s_i.tail_x is not None:
            assert torch.allclose(st.tail_x[i:i + 1], s_i.tail_x) and torch.allclose(st.tail_v[i:i + 1], s_i.tail_v)


@pytest.mark.parametrize("variant", ["1", "3A"])
def test_varlen_resets_at_document_starts(variant):
    # the second document's output must not depend on the first document at all
    q, k, v, beta, lam = make_inputs(variant, B=1, T=20)
    cu = torch.tensor([0, 8, 20])
    o, _ = chunk_falcon(q, k, v, beta, lam, variant=variant, cu_seqlens=cu, chunk_size=4)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    k2[:, :8] = torch.randn_like(k2[:, :8])
    v2[:, :8] = torch.randn_like(v2[:, :8])
    o2, _ = chunk_falcon(q2, k2, v2, beta, lam, variant=variant, cu_seqlens=cu, chunk_size=4)
    assert torch.allclose(o[:, 8:], o2[:, 8:], atol=1e-14)
    assert not torch.allclose(o[:, :8], o2[:, :8])


def test_state_gradient_flows_across_segments():
    q, k, v, beta, lam = make_inputs("3", T=16, requires_grad=True)
    kw = dict(variant="3", window=4, output_final_state=True, chunk_size=4)
    _, st = chunk_falcon(*(t[:, :9] for t in (q, k, v, beta, lam)), **kw)
    o2, _ = chunk_falcon(*(t[:, 9:] for t in (q, k, v, beta, lam)), initial_state=st, **kw)
    o2.sum().backward()
    # the first segment's keys reach the second through S, the last key and the window tail
    assert k.grad[:, :9].abs().sum() > 0 and v.grad[:, 6:9].abs().sum() > 0


def test_state_compatibility_is_checked():
    q, k, v, beta, lam = make_inputs("3", T=6)
    _, st = chunk_falcon(q, k, v, beta, lam, variant="3", window=4, output_final_state=True)
    with pytest.raises(ValueError, match="initial_state.*variant"):
        chunk_falcon(q, k, v, beta, lam, variant="3A", initial_state=st)
    with pytest.raises(ValueError, match="initial_state.*window"):
        chunk_falcon(q, k, v, beta, lam, variant="3", window=2, initial_state=st)
    with pytest.raises(ValueError, match="initial_state.*shift"):
        chunk_falcon(q, k, v, beta, lam, variant="3", window=4, shift=False, initial_state=st)
    with pytest.raises(ValueError, match="initial_state.*read"):
        chunk_falcon(q, k, v, beta, lam, variant="3", window=4, read="before", initial_state=st)
    q2, k2, v2, b2, l2 = make_inputs("3", T=6, H=3)
    with pytest.raises(ValueError, match="initial_state.*S shape"):
        chunk_falcon(q2, k2, v2, b2, l2, variant="3", window=4, initial_state=st)
    with pytest.raises(ValueError, match="initial_state.*FalconState"):
        chunk_falcon(q, k, v, beta, lam, variant="3", initial_state=st.S)
