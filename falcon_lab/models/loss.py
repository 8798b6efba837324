"""The language-model loss: final hidden states × tied embedding → summed next-token NLL.

One function, `lm_nll(h, weight, labels, impl=...)`, used by every model the platform trains or
benchmarks (fla's model too, through its backbone's hidden states), so that a speed comparison never
hinges on a different loss. Implementations (the choice is `model.loss_impl`):

- "materialized": logits = h Wᵀ for every token, then fp32 cross-entropy. The [N, vocab] logits and
  their fp32 copy are kept for backward: 32768 tokens × 50304 ≈ 13 GB in fp32 alone.
- "chunked" (ours; the idea of fused linear cross-entropy): tokens in chunks of `chunk_tokens`; each
  chunk's logits are formed, turned into its loss and, when a gradient is needed, at once into the
  gradients of h and W ((softmax − onehot) · scale), and dropped. Autograd keeps only dh [N, D] and
  dW [vocab, D]; the backward multiplies them by the incoming gradient. Same FLOPs as materialized
  (three matmuls per chunk), peak memory of one chunk's logits. The chunk body (logits -> NLL and
  their gradient, in place) is `falcon_lab.modules.xent.xent_rows_`: one Triton kernel on CUDA (two
  passes over each row in the logits' dtype), PyTorch's fp32 softmax elsewhere.
- "chunked_torch": the same with the PyTorch chunk body on every device (to measure the kernel against).

Numerics: matmuls in the autocast dtype (bf16 on the GPU), log-sum-exp and softmax in fp32 (in
registers for the Triton body). Labels equal to `ignore_index` contribute nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from falcon_lab.modules.xent import xent_rows_

LOSS_IMPLS = ("materialized", "chunked", "chunked_torch")
IGNORE = -100


def _mm_dtype(h: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return h.dtype


class _ChunkedNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, scale, chunk_tokens, ignore_index, dtype, backend):
        N = h.shape[0]
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w = weight.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[1] else None
        for s in range(0, N, chunk_tokens):
            hc = h[s:s + chunk_tokens].to(dtype)
            z = hc @ w.t()  # [C, vocab] in the matmul dtype; becomes its own gradient below
            total += xent_rows_(z, labels[s:s + chunk_tokens], scale, ignore_index, grad=need,
                                backend=backend).sum()
            if need:
                if dh is not None:
                    dh[s:s + chunk_tokens] = (z @ w).to(h.dtype)
                if dw is not None:
                    dw += (z.t() @ hc).float()
        ctx.save_for_backward(*(t for t in (dh, dw) if t is not None))
        ctx.has = (dh is not None, dw is not None)
        ctx.w_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, g):
        it = iter(ctx.saved_tensors)
        dh = next(it) if ctx.has[0] else None
        dw = next(it) if ctx.has[1] else None
        dh = dh * g.to(dh.dtype) if dh is not None else None
        dw = (dw * g).to(ctx.w_dtype) if dw is not None else None
        return dh, dw, None, None, None, None, None, None


def lm_nll(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, impl: str = "chunked",
           scale: float = 1.0, chunk_tokens: int = 8192, ignore_index: int = IGNORE):
    """(summed NLL in fp32, number of counted tokens) of next-token labels.

    h [..., D] final (normed) hidden states; weight [vocab, D] the output embedding; labels [...] int64;
    scale multiplies the logits (muP's output multiplier)."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"model.loss_impl: {impl!r} is not one of {LOSS_IMPLS}")
    h2 = h.reshape(-1, h.shape[-1])
    y = labels.reshape(-1)
    n = (y != ignore_index).sum()
    with torch.profiler.record_function("lm_loss"):  # the benchmark's profile attributes its GPU time
        if impl == "materialized":
            logits = F.linear(h2, weight) * scale
            return F.cross_entropy(logits.float(), y, ignore_index=ignore_index, reduction="sum"), n
        return _ChunkedNLL.apply(h2, weight, y, float(scale), int(chunk_tokens), int(ignore_index),
                                 _mm_dtype(h2), "torch" if impl == "chunked_torch" else None), n
