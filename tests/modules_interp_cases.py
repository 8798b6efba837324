"""Cases for tests/test_modules_conv.py, run in ONE subprocess with TRITON_INTERPRET=1 (set before
triton is imported) and FALCON_TRITON_POISON=1 (NaN-filled outputs). Each conv case runs
short_conv(backend="triton") forward and backward and reports relative errors against the torch path
computed in float64 on the same (rounded) inputs. Prints one JSON line per case."""

from interp_case_helpers import rel, run_cases  # first: checks TRITON_INTERPRET=1, one torch thread

import torch

from falcon_lab.modules import conv
from falcon_lab.modules.conv import short_conv, short_conv_torch


def pos_from_cu(cu):
    return torch.cat([torch.arange(cu[i + 1] - cu[i]) for i in range(len(cu) - 1)])


def make(c):
    gen = torch.Generator().manual_seed(c["seed"])
    dtype = getattr(torch, c["dtype"])
    B, T, D, K = c["B"], c["T"], c["D"], c["K"]
    x = torch.randn(B, T, D, generator=gen).to(dtype)
    w = (torch.rand(D, K, generator=gen) * 2 - 1).float() / K ** 0.5
    cache = torch.randn(B, K - 1, D, generator=gen).to(dtype) if c.get("cache") else None
    pos = pos_from_cu(c["cu"]) if c.get("cu") else None
    dy = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    return x, w, cache, pos, dy


def conv_case(c):
    conv.BLOCK_T, conv.BLOCK_D = c.get("BT", 64), c.get("BD", 64)
    x, w, cache, pos, dy = make(c)
    act = c["act"]
    split = c.get("split", 1)
    if split > 1:  # y (and its gradient) in the layout [split, B, T, D/split]
        B, T, D = dy.shape
        dy = dy.view(B, T, split, D // split).permute(2, 0, 1, 3).contiguous()
    # reference: torch path in float64 on the rounded inputs
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y_ref, nc_ref = short_conv_torch(xr, wr, cache.double() if cache is not None else None, pos, act, split)
    dx_ref, dw_ref = torch.autograd.grad((y_ref * dy).sum(), (xr, wr))
    xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y, nc = short_conv(xi, wi, cache, pos, act, backend="triton", split=split)
    dx, dw = torch.autograd.grad((y.double() * dy).sum(), (xi, wi))
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype and nc.dtype == x.dtype
    res = {"y": rel(y, y_ref), "dx": rel(dx, dx_ref), "dw": rel(dw, dw_ref)}
    if c["K"] > 1:
        res["new_cache"] = rel(nc, nc_ref)
    if split > 1:  # the same numbers as the plain layout, moved
        with torch.no_grad():
            y1, _ = short_conv(x, w, cache, pos, act, backend="triton")
        B, T, D = x.shape
        res["split_layout_exact"] = bool(torch.equal(y1.view(B, T, split, D // split).permute(2, 0, 1, 3), y))
    if pos is not None and split == 1:  # perturb the first sequence: nothing else may change (exactly)
        x2 = x.clone()
        x2[:, : c["cu"][1]] += 1.0
        with torch.no_grad():
            y2, _ = short_conv(x2, w, cache, pos, act, backend="triton")
        res["leak"] = float((y2[:, c["cu"][1]:] - y[:, c["cu"][1]:]).abs().max())
    return res


def compile_case(c):
    """torch.compile(fullgraph=True, aot_eager) around short_conv(backend="triton") + backward vs eager."""
    conv.BLOCK_T, conv.BLOCK_D = 64, 64
    x, w, cache, pos, dy = make(c)

    def fn(x, w, cache, pos):
        y, nc = short_conv(x, w, cache, pos, True, backend="triton")
        return (y.double() * dy).sum() + nc.double().sum()

    out = {}
    for name, f in (("eager", fn), ("compiled", torch.compile(fn, backend="aot_eager", fullgraph=True))):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = f(xi, wi, cache, pos)
        out[name] = (loss.detach(), *torch.autograd.grad(loss, (xi, wi)))
    return {k: rel(a, b) for k, a, b in zip(("loss", "dx", "dw"), out["compiled"], out["eager"])}


def opcheck_case(c):
    """torch.library.opcheck on both custom ops (schema, fake tensor, autograd registration, aot)."""
    conv.BLOCK_T, conv.BLOCK_D = 64, 64
    x, w, cache, pos, dy = make(c)
    x.requires_grad_(True)
    w.requires_grad_(True)
    fwd = torch.library.opcheck(torch.ops.falcon_lab.short_conv_fwd.default, (x, w, cache, pos, True))
    bwd = torch.library.opcheck(torch.ops.falcon_lab.short_conv_bwd.default,
                                (dy.to(x.dtype), x.detach(), w.detach(), cache, pos, True))
    return {"fwd": fwd, "bwd": bwd}


if __name__ == "__main__":
    run_cases(lambda c: {"conv": conv_case, "compile": compile_case, "opcheck": opcheck_case}[c.get("kind", "conv")](c))
