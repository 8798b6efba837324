"""Mixer interface and shared pieces (varlen helpers; the layer modules are re-exported from falcon_lab.modules)."""
from __future__ import annotations

import torch
import torch.nn as nn

from falcon_lab.modules import RMSNorm, ShortConvolution, qk_norm  # noqa: F401  (re-exported)

MODULE_BACKENDS = (None, "torch", "triton")


def check_module_backend(value):
    """mixer.module_backend: which implementation of the layer modules (short conv, QK norm, output
    norm-gate) runs: null = Triton on CUDA, torch elsewhere; torch; triton."""
    if value not in MODULE_BACKENDS:
        raise ValueError(f"mixer.module_backend: {value!r} is not one of null, torch, triton")
    return value


class Mixer(nn.Module):
    """A token mixer: [B, T, D] -> [B, T, D].

    forward(x, cu_seqlens=None, state=None, return_state=False) -> (y, new_state | None)
      cu_seqlens (LongTensor [N+1] over the flattened B*T tokens) resets at sequence starts.
    init_state(batch_size, device) -> state for `step` (recurrent state, or an empty KV cache)
    step(x [B, D], state) -> (y [B, D], state)
    state_numel(batch_size, seq_len) -> elements of recurrent state / KV cache after seq_len tokens
    flops_per_token(seq_len) -> analytic forward FLOPs per token (2 per multiply-add)
    """

    backend_used: str = "torch"

    def init_state(self, batch_size: int, device=None, max_len: int | None = None):
        """max_len: the longest context the state will hold (only a KV cache uses it)."""
        return None

    def step(self, x: torch.Tensor, state):
        y, state = self.forward(x[:, None], state=state, return_state=True, decode=True)
        return y[:, 0], state

    def state_numel(self, batch_size: int, seq_len: int) -> int:
        raise NotImplementedError

    def flops_per_token(self, seq_len: int) -> float:
        raise NotImplementedError


def _gate_dtype(q: torch.Tensor) -> torch.dtype:
    """Gates (β/η, λ) stay fp32 under bf16/fp16 autocast (fp64 with fp64 inputs): the operator's
    preparation divides and clamps them in fp32 anyway, so rounding them to bf16 first only loses bits."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def operator_backend_label(backend, q: torch.Tensor, variant: str, window: int | None, step: bool = False) -> str:
    """Which core the Falcon op runs for this call ("triton" or "torch"): the op's own dispatch
    decision (falcon_lab.kernels.dispatch.select), asked with the same arguments."""
    from falcon_lab.kernels.dispatch import select
    from falcon_lab.kernels.spec import FalconSpec

    return select(FalconSpec.from_variant(variant), q, window=window or 1, grad=torch.is_grad_enabled(),
                  backend=backend, step=step).label


def positions_in_sequence(cu_seqlens: torch.Tensor, total: int, device) -> torch.Tensor:
    """[total] position of each flattened token inside its sequence (0 at each start)."""
    idx = torch.arange(total, device=device)
    starts = cu_seqlens[:-1].to(device)
    seq = torch.searchsorted(starts, idx, right=True) - 1
    return idx - starts[seq]


def flatten_for_varlen(x: torch.Tensor, cu_seqlens):
    """[B, T, ...] with cu_seqlens over B*T -> [1, B*T, ...] (no-op without cu_seqlens)."""
    if cu_seqlens is None:
        return x
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


# The layer building blocks live in falcon_lab.modules (torch and Triton implementations of one
# signature); these names stay importable from here.
ShortConv = ShortConvolution


def l2_normalize(u: torch.Tensor, eps: float) -> torch.Tensor:
    """u / sqrt(||u||² + eps) (ours: eps placement), in u's dtype."""
    return qk_norm(u, "l2", eps)


def rms_normalize(u: torch.Tensor, eps: float) -> torch.Tensor:
    """u / sqrt(||u||²/d + eps)  ->  ||u||² ≈ d, in u's dtype."""
    return qk_norm(u, "rmsnorm", eps)
