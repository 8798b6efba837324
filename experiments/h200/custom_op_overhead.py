"""CPU dispatch cost of a torch.library custom operator with register_autograd against the same trivial body as an
autograd.Function (a hypothesis for the Falcon-1A core slowdown since 0d99b9a, experiments/h200/NEXT.md). Run:

    .venv/bin/python experiments/h200/custom_op_overhead.py
"""
import time
from typing import List, Optional

import torch

CFG = [1, 1, 64, 0, 0, 0, 1, 0]  # the scalar family's cfg layout (ops.py); unused by the trivial body


def body(q, x, v, eta, g):
    return [torch.empty_like(q), q.new_empty(2), q.new_empty(3), q.new_empty(0), q.new_empty(0), q.new_empty(0)]


@torch.library.custom_op("overhead_probe::fwd", mutates_args=())
def fwd(q: torch.Tensor, x: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, g: torch.Tensor,
        S0: Optional[torch.Tensor], family: str, cfg: List[int]) -> List[torch.Tensor]:
    return body(q, x, v, eta, g)


@torch.library.custom_op("overhead_probe::bwd", mutates_args=())
def bwd(q: torch.Tensor, saved: List[torch.Tensor], dO: torch.Tensor) -> List[torch.Tensor]:
    return [torch.empty_like(q) for _ in range(5)]


def setup(ctx, inputs, output):
    q, x, v, eta, g, S0, family, cfg = inputs
    ctx.save_for_backward(q, x, v, eta, g, *output[2:])


def backward(ctx, grads):
    q, *rest = ctx.saved_tensors
    return (*bwd(q, list(rest[4:]), grads[0]), None, None, None)


fwd.register_autograd(backward, setup_context=setup)


class Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, v, eta, g):
        out = body(q, x, v, eta, g)
        ctx.save_for_backward(q, *out[2:])
        return out[0], out[1]

    @staticmethod
    def backward(ctx, dO, dS):
        q, *_ = ctx.saved_tensors
        return tuple(torch.empty_like(q) for _ in range(5))


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    ins = [torch.randn(2, 4, 2, 8, requires_grad=True) for _ in range(5)]

    def custom(grad):
        with torch.set_grad_enabled(grad):
            o = fwd(*ins, None, "scalar", CFG)
            if grad:
                o[0].sum().backward()

    def plain(grad):
        with torch.set_grad_enabled(grad):
            o = Plain.apply(*ins)
            if grad:
                o[0].sum().backward()

    c, p = per_call_us(lambda: custom(True)), per_call_us(lambda: plain(True))
    cf, pf = per_call_us(lambda: custom(False)), per_call_us(lambda: plain(False))
    print(f"custom_op fwd+bwd {c:.1f} us, autograd.Function {p:.1f} us; fwd only {cf:.1f} vs {pf:.1f} us")


if __name__ == "__main__":
    main()
