"""Cases for tests/test_modules_norm.py, run in a subprocess with TRITON_INTERPRET=1 (set before triton
is imported). Each case runs a falcon_lab.modules.norm function with backend="triton" and compares it,
forward and backward, with the torch path computed in float64 on the same (rounded) inputs. A last case
runs both Triton ops under torch.compile(backend="aot_eager", fullgraph=True), forward and backward,
against eager. Prints one JSON line per case."""

from interp_case_helpers import rel, run_cases  # first: checks TRITON_INTERPRET=1, one torch thread

import torch

from falcon_lab.modules.norm import qk_norm, qk_norm_torch, rms_norm_gated, rms_norm_gated_torch


def inputs(c):
    """x (rows of different scales), gate, weight/gain (fp32, as parameters are), upstream gradient."""
    gen = torch.Generator().manual_seed(c["seed"])
    B, T, H, D = c["B"], c["T"], c["H"], c["D"]
    dtype = getattr(torch, c["dtype"])
    x = torch.randn(B, T, H, D, generator=gen) * torch.exp(torch.randn(B, T, H, 1, generator=gen))
    if c.get("noncontig"):  # a [B, H, T, D] tensor seen as [B, T, H, D]
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    gate = 2 * torch.randn(B, T, H, D, generator=gen)
    wshape = {"none": None, "D": (D,), "HD": (H, D)}[c.get("w", "D")]
    w = 1 + 0.3 * torch.randn(wshape, generator=gen) if wshape else None
    dy = torch.randn(B, T, H, D, generator=gen)
    x, gate, dy = x.to(dtype), gate.to(dtype), dy.to(dtype)
    return x, (gate if c.get("gate") else None), w, dy


def run_case(c):
    x, gate, w, dy = inputs(c)
    leaves = {"x": x, "weight": w, "gate": gate}
    tri = {k: v.clone().requires_grad_(True) for k, v in leaves.items() if v is not None}
    ref = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items() if v is not None}
    if c["fn"] == "rms_norm_gated":
        y = rms_norm_gated(tri["x"], tri.get("weight"), tri.get("gate"), eps=1e-6, backend="triton")
        y_ref = rms_norm_gated_torch(ref["x"], ref.get("weight"), ref.get("gate"), eps=1e-6)
    else:
        y = qk_norm(tri["x"], c["kind"], 1e-6, tri.get("weight"), backend="triton")
        y_ref = qk_norm_torch(ref["x"], c["kind"], 1e-6, ref.get("weight"))
    assert y.dtype == x.dtype, (y.dtype, x.dtype)
    names = list(tri)
    grads = torch.autograd.grad(y, [tri[k] for k in names], dy)
    grads_ref = torch.autograd.grad(y_ref, [ref[k] for k in names], dy.double())
    res = {"y": rel(y, y_ref)}
    for k, a, b in zip(names, grads, grads_ref):
        assert a.dtype == tri[k].dtype and a.shape == tri[k].shape, (k, a.dtype, a.shape)
        res["d" + k] = rel(a, b)
    return res


def compile_case(c):
    """Both Triton ops inside one compiled function, forward and backward; fullgraph=True raises on a
    graph break. Returns the largest |compiled - eager| over outputs and gradients."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(c["seed"])
    B, T, H, D = 2, 9, 3, 32
    x0, g0, u0 = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    w0, gain0 = 1 + 0.1 * torch.randn(D, generator=gen), 1 + 0.1 * torch.randn(H, D, generator=gen)

    def fn(x, g, w, u, gain):
        o = rms_norm_gated(x, w, g, 1e-6, backend="triton")
        q = qk_norm(u, "rmsnorm", 1e-6, gain, backend="triton")
        k = qk_norm(u * 2, "l2", 1e-6, None, backend="triton")
        return o, q, k

    def run(f):
        leaves = [t.clone().requires_grad_(True) for t in (x0, g0, w0, u0, gain0)]
        outs = f(*leaves)
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
        loss.backward()
        return [o.detach() for o in outs] + [t.grad for t in leaves]

    eager = run(fn)
    compiled = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
    explain = torch._dynamo.explain(fn)(x0, g0, w0, u0, gain0)
    return {"max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(compiled, eager)),
            "graph_count": explain.graph_count, "graph_break_count": explain.graph_break_count,
            "ops_in_graph": sum(str(gm.code).count("torch.ops.falcon_lab.") for gm in explain.graphs)}


if __name__ == "__main__":
    run_cases(lambda c: compile_case(c) if c.get("compile") else run_case(c))
