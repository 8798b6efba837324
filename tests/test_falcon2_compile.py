"""torch.compile keeps the PyTorch chunk core opaque (falcon_lab/kernels/chunk_torch.py, ours).

Falcon-2 runs the PyTorch chunk form on CUDA (its Triton kernel is unproven); traced by Dynamo, its loops
over tiles unrolled into a graph Inductor did not finish compiling in 7.5 minutes on the H200. Under
compile the core is one custom operator pair; these checks fail if it is traced again."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from falcon_lab.layers.falcon import FalconMixer

B, T, D, H, HD = 2, 40, 32, 2, 16  # T = 40: five Falcon-2 tiles of 8, one Falcon-1A chunk of 16 + rest


def _counting_backend(stats):
    def fw(gm, _):
        stats["fw"] = stats.get("fw", 0) + len(gm.graph.nodes)
        stats["fw_targets"] = stats.get("fw_targets", []) + [str(n.target) for n in gm.graph.nodes]
        return make_boxed_func(gm)

    def bw(gm, _):
        stats["bw"] = stats.get("bw", 0) + len(gm.graph.nodes)
        stats["bw_targets"] = stats.get("bw_targets", []) + [str(n.target) for n in gm.graph.nodes]
        return make_boxed_func(gm)

    def backend(gm, ex):
        stats["graphs"] = stats.get("graphs", 0) + 1
        return aot_autograd(fw_compiler=fw, bw_compiler=bw)(gm, ex)

    return backend


def _run(mod, x):
    x = x.clone().requires_grad_()
    y, _ = mod(x)
    y.square().mean().backward()
    return y.detach(), x.grad


# recompute=True: the CUDA default (selective checkpointing around glue + op, its context_fn)
@pytest.mark.parametrize("variant,chunk_size,recompute", [("2", 64, False), ("2", 64, True)])
def test_compiled_mixer_matches_eager_and_core_is_opaque(variant, chunk_size, recompute):
    torch.manual_seed(0)
    m = FalconMixer(D, H, HD, variant=variant, chunk_size=chunk_size, recompute=recompute).train()
    x = torch.randn(B, T, D)
    y0, gx0 = _run(m, x)
    g0 = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    stats = {}
    cm = torch.compile(m, backend=_counting_backend(stats), fullgraph=True)
    y1, gx1 = _run(cm, x)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, g0[n], rtol=1e-5, atol=1e-6, msg=n)

    assert stats["graphs"] == 1  # fullgraph: no graph break either
    assert any("chunk_torch_fwd" in t for t in stats["fw_targets"])
    assert any("chunk_torch_bwd" in t for t in stats["bw_targets"])
    # the tile loop is not in the graph: nothing like the traced form's hundreds of nodes
    assert stats["fw"] < 200 and stats["bw"] < 300, (stats["fw"], stats["bw"])


def test_eager_core_does_not_use_the_operator(monkeypatch):
    """Eager calls run the PyTorch code directly (same autograd graph as before the operator)."""
    from falcon_lab.kernels import chunk_torch

    def boom(*a, **k):
        raise AssertionError("custom operator used in eager")

    monkeypatch.setattr(chunk_torch, "chunk_torch_fwd", boom)
    m = FalconMixer(D, H, HD, variant="2").train()
    _run(m, torch.randn(B, T, D))


def test_operator_with_initial_state_and_final_state_grads():
    """The operator's backward: gradients of o and S_T w.r.t. every input, S0 included, as autograd."""
    from falcon_lab.kernels.chunk_torch import _core_chunk, chunk_torch_fwd

    torch.manual_seed(1)
    Bs, Ts, Hs, K, V = 1, 19, 2, 4, 5
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, xw, vw = mk(Bs, Ts, Hs, K), mk(Bs, Ts, Hs, K), mk(Bs, Ts, Hs, V)
    eta = (torch.rand(Bs, Ts, Hs, V, dtype=torch.float64) * 0.3).requires_grad_()
    g = (-torch.rand(Bs, Ts, Hs, V, dtype=torch.float64) * 0.2).requires_grad_()
    S0 = mk(Bs, Hs, K, V)
    ins = (q, xw, vw, eta, g, S0)
    wo, ws = torch.randn(Bs, Ts, Hs, V, dtype=torch.float64), torch.randn(Bs, Hs, K, V, dtype=torch.float64)
    o, S = _core_chunk(*ins, delta=True, window=1, read_after=True, chunk_size=64)
    ref = torch.autograd.grad((o * wo).sum() + (S * ws).sum(), ins)
    o2, S2 = chunk_torch_fwd(*ins, True, 1, True, 64)
    got = torch.autograd.grad((o2 * wo).sum() + (S2 * ws).sum(), ins)
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(S2, S)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
