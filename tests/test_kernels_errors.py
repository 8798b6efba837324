"""Bad input gets a clear error naming the argument."""

import pytest
import torch

from falcon_inputs import make_inputs
from falcon_lab.kernels import chunk_falcon, recurrent_falcon


@pytest.fixture
def x():
    return make_inputs("1", T=8)


@pytest.mark.parametrize("fn", [chunk_falcon, recurrent_falcon])
@pytest.mark.parametrize("kwargs,match", [
    (dict(variant="4"), "variant: unknown variant '4'"),
    (dict(variant="1", step="sgd"), "step: unknown step"),
    (dict(variant="1", lam_mode="relative"), "lam_mode: unknown"),
    (dict(variant="1", read="during"), "read: unknown"),
    (dict(variant="1", window=0), "window: must be an int >= 1"),
    (dict(variant="3", window=1.5), "window: must be an int"),
    (dict(variant="1", eps=-1e-3), "eps: must be >= 0"),
    (dict(variant="1", eps_gamma=0.0), "eps_gamma"),
    (dict(variant="1", shift="yes"), "shift: must be a bool"),
])
def test_bad_knobs(fn, x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*x, **kwargs)


def test_bad_shapes(x):
    q, k, v, beta, lam = x
    with pytest.raises(ValueError, match=r"q: must be \[B, T, H, K\]"):
        chunk_falcon(q[0], k, v, beta, lam, variant="1")
    with pytest.raises(ValueError, match="k: must have q's shape"):
        chunk_falcon(q, k[..., :3], v, beta, lam, variant="1")
    with pytest.raises(ValueError, match="v: must be"):
        chunk_falcon(q, k, v[:, :4], beta, lam, variant="1")
    with pytest.raises(ValueError, match=r"beta: variant 2 takes beta of shape \[B, T, H, V\]"):
        chunk_falcon(q, k, v, beta, lam, variant="2")
    with pytest.raises(ValueError, match=r"beta: variant 1 takes beta of shape \[B, T, H\]"):
        chunk_falcon(q, k, v, beta[..., None].expand(2, 8, 2, 4), lam, variant="1")
    with pytest.raises(ValueError, match="lam: must be"):
        chunk_falcon(q, k, v, beta, lam[..., None], variant="1")
    with pytest.raises(ValueError, match="k/v: q, k and v must share a dtype"):
        chunk_falcon(q, k.float(), v, beta, lam, variant="1")
    with pytest.raises(ValueError, match="beta: must be a floating-point"):
        chunk_falcon(q, k, v, beta.long(), lam, variant="1")
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_falcon(q, k, v, beta, lam, variant="1", chunk_size=0)
    with pytest.raises(ValueError, match="backend: unknown backend"):
        chunk_falcon(q, k, v, beta, lam, variant="1", backend="cuda")


def test_bad_cu_seqlens(x):
    q, k, v, beta, lam = x
    with pytest.raises(ValueError, match="cu_seqlens: requires the packed batch B == 1"):
        chunk_falcon(q, k, v, beta, lam, variant="1", cu_seqlens=torch.tensor([0, 8]))
    q1, k1, v1, b1, l1 = (t[:1] for t in x)
    with pytest.raises(ValueError, match="cu_seqlens: must be strictly increasing"):
        chunk_falcon(q1, k1, v1, b1, l1, variant="1", cu_seqlens=torch.tensor([0, 5, 5, 8]))
    with pytest.raises(ValueError, match="cu_seqlens: must start at 0 and end at T"):
        chunk_falcon(q1, k1, v1, b1, l1, variant="1", cu_seqlens=torch.tensor([0, 5, 7]))
    with pytest.raises(ValueError, match="cu_seqlens: must be a 1-D integer"):
        chunk_falcon(q1, k1, v1, b1, l1, variant="1", cu_seqlens=torch.tensor([0.0, 8.0]))


def test_cu_seqlens_checked_once_per_tensor(x, monkeypatch):
    """A packed call's cu_seqlens is read on the host (a device sync on CUDA) once per distinct, unchanged tensor: later
    calls with it (the model's other layers, recompute) take the checked device copy from api._CU_CACHE; a new tensor
    or an in-place change is checked again, so a bad change still fails naming the argument."""
    from falcon_lab.kernels import api

    monkeypatch.setattr(api, "_CU_CACHE", [])
    reads = []

    class Cu(torch.Tensor):  # a tensor whose host reads are counted
        def tolist(self):
            reads.append(self.numel())
            return torch.Tensor.tolist(self)

    q1, k1, v1, b1, l1 = (t[:1] for t in x)
    cu = torch.tensor([0, 3, 8]).as_subclass(Cu)
    o1, _ = chunk_falcon(q1, k1, v1, b1, l1, variant="1", cu_seqlens=cu)
    o2, _ = chunk_falcon(q1, k1, v1, b1, l1, variant="1", cu_seqlens=cu)
    assert len(reads) == 1 and torch.equal(o1, o2)  # checked once, the same result
    assert api._checked_cu(cu, 8, q1.device) is api._checked_cu(cu, 8, q1.device)
    cu2 = torch.tensor([0, 3, 8]).as_subclass(Cu)  # equal values, another tensor: checked again
    chunk_falcon(q1, k1, v1, b1, l1, variant="1", cu_seqlens=cu2)
    assert len(reads) == 2
    cu[1] = 0  # in place: `_version` moves on, so it is checked again and refused
    with pytest.raises(ValueError, match="cu_seqlens: must be strictly increasing"):
        chunk_falcon(q1, k1, v1, b1, l1, variant="1", cu_seqlens=cu)
    assert len(reads) == 3
    monkeypatch.setattr(api, "_CU_CACHE_N", 2)
    for _ in range(3):  # the cache keeps its newest _CU_CACHE_N entries
        api._checked_cu(torch.tensor([0, 8]), 8, q1.device)
    assert len(api._CU_CACHE) == 2


def test_check_finite_refuses_non_finite_inputs_naming_them():
    """The chunked form is not causal under NaN/Inf (masked future terms are multiplied by zero): the
    checked mode refuses them, naming the argument and the first position; without it, the NaN reaches
    an earlier output of its chunk, which is the documented behaviour the mode exists for."""
    import torch.nn.functional as F

    from falcon_lab.kernels import chunk_falcon

    torch.manual_seed(0)
    q = F.normalize(torch.randn(1, 16, 1, 8), dim=-1)
    k = F.normalize(torch.randn(1, 16, 1, 8), dim=-1)
    v, beta, lam = torch.randn(1, 16, 1, 8), torch.rand(1, 16, 1), 0.1 * torch.rand(1, 16, 1)
    k[0, 10, 0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^k: holds non-finite values \(first at index \[0, 10, 0, 3\]\)"):
        chunk_falcon(q, k, v, beta, lam, variant="1A", chunk_size=16, check_finite=True)
    o, _ = chunk_falcon(q, k, v, beta, lam, variant="1A", chunk_size=16)
    assert not torch.isfinite(o[0, :10]).all()  # what check_finite guards against
    ok = k.clone()
    ok[0, 10, 0, 3] = 0.0
    chunk_falcon(q, ok, v, beta, lam, variant="1A", chunk_size=16, check_finite=True)  # finite: accepted


def test_malformed_states_are_refused_naming_what_is_wrong():
    """A FalconState that cannot continue the call exactly is refused up front (it used to be accepted
    and give wrong results or raw torch errors): a window tail missing after tokens were seen (a fresh
    state, seen = 0, may leave it out: it is zeros) or mis-shaped, float `seen`, wrong shapes."""
    import dataclasses

    import torch.nn.functional as F

    from falcon_lab.kernels import chunk_falcon

    torch.manual_seed(0)
    q = F.normalize(torch.randn(2, 12, 2, 8), dim=-1)
    k = F.normalize(torch.randn(2, 12, 2, 8), dim=-1)
    v, beta, lam = torch.randn(2, 12, 2, 8), torch.rand(2, 12, 2), 0.1 * torch.rand(2, 12, 2)
    _, st = chunk_falcon(q, k, v, beta, lam, variant="3A", window=4, output_final_state=True)
    chunk_falcon(q, k, v, beta, lam, variant="3A", window=4, initial_state=st)  # the real one continues
    bad = {
        "tail_x is missing, but tokens were seen": dataclasses.replace(st, tail_x=None),
        "tail_v shape": dataclasses.replace(st, tail_v=st.tail_v[:, :2]),
        "seen must be an integer tensor": dataclasses.replace(st, seen=st.seen.float()),
        "last_k shape": dataclasses.replace(st, last_k=st.last_k[:, :1]),
    }
    for msg, s in bad.items():
        with pytest.raises(ValueError, match=rf"^initial_state: incompatible with this call: .*{msg}"):
            chunk_falcon(q, k, v, beta, lam, variant="3A", window=4, initial_state=s)
    with pytest.raises(ValueError, match=r"^initial_state: seen must be >= 0"):
        chunk_falcon(q, k, v, beta, lam, variant="3A", window=4, check_finite=True,
                     initial_state=dataclasses.replace(st, seen=st.seen - 100))
    for name, t in (("beta", -beta), ("lam", -lam)):
        args = dict(beta=beta, lam=lam)
        args[name] = t
        with pytest.raises(ValueError, match=rf"^{name}: must be >= 0"):
            chunk_falcon(q, k, v, args["beta"], args["lam"], variant="1A", check_finite=True)
    with pytest.raises(ValueError, match=r"^beta: must be < 2 with step='nlms'"):
        chunk_falcon(q, k, v, beta + 2, lam, variant="1A", step="nlms", check_finite=True)
    chunk_falcon(q, k, v, beta + 2, lam, variant="1A", step="direct", check_finite=True)  # a direct step: no such bound
