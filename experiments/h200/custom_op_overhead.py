"""CPU dispatch cost of a torch.library custom operator with register_autograd against the same trivial body as an
autograd.Function (a hypothesis for the Falcon-1A core slowdown since 0d99b9a, experiments/h200/NEXT.md). Run:
    .venv/bin/python experiments/h200/custom_op_overhead.py
"""
import time, torch
from typing import List, Optional

def body(q, x, v, eta, g):
    return [torch.empty_like(q), q.new_empty(2), q.new_empty(3), q.new_empty(0), q.new_empty(0), q.new_empty(0)]

@torch.library.custom_op("tst::fwd", mutates_args=())
def fwd(q: torch.Tensor, x: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, g: torch.Tensor, S0: Optional[torch.Tensor], family: str, cfg: List[int]) -> List[torch.Tensor]:
    return body(q, x, v, eta, g)

@torch.library.custom_op("tst::bwd", mutates_args=())
def bwd(q: torch.Tensor, saved: List[torch.Tensor], dO: torch.Tensor) -> List[torch.Tensor]:
    return [torch.empty_like(q) for _ in range(5)]

def setup(ctx, inputs, output):
    q, x, v, eta, g, S0, family, cfg = inputs
    ctx.save_for_backward(q, x, v, eta, g, *output[2:])
def backward(ctx, grads):
    q, *rest = ctx.saved_tensors
    r = bwd(q, list(rest[4:]), grads[0])
    return (*r, None, None, None)
fwd.register_autograd(backward, setup_context=setup)

class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, v, eta, g):
        out = body(q, x, v, eta, g)
        ctx.save_for_backward(q, *out[2:])
        return out[0], out[1]
    @staticmethod
    def backward(ctx, dO, dS):
        q, *rest = ctx.saved_tensors
        return tuple(torch.empty_like(q) for _ in range(5))

ins = [torch.randn(2, 4, 2, 8, requires_grad=True) for _ in range(5)]
def t(fn, n=2000):
    for _ in range(50): fn()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t0) / n * 1e6
def co():
    o = fwd(*ins, None, "scalar", [1, 1, 64, 0, 0, 0, 1]); o[0].sum().backward()
def af():
    o = F.apply(*ins); o[0].sum().backward()
def co_f():
    with torch.no_grad(): fwd(*ins, None, "scalar", [1, 1, 64, 0, 0, 0, 1])
def af_f():
    with torch.no_grad(): F.apply(*ins)
print(f"custom_op fwd+bwd {t(co):.1f} us, autograd.Function {t(af):.1f} us; fwd only {t(co_f):.1f} vs {t(af_f):.1f} us")
