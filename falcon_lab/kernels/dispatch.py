"""Which core runs a Falcon call, and why: the one answer the op uses and the mixers report.

    select(spec, q, *, window, grad, backend=None, step=False) -> Choice(core, label, reason)

- backend "torch": the chunked PyTorch form (or, for `step`, the token recurrence);
- backend None: Triton on CUDA tensors where a kernel exists for the configuration and was proven
  on the H200 (falcon_lab/kernels/triton/__init__.py: PROVEN_CHUNK / PROVEN_DECODE), else PyTorch;
- backend "triton": Triton or an error saying why not (CPU tensors run it under the interpreter).
`step=True` is the fused recurrent step (`fused_recurrent_falcon`): the Triton decode kernel for
T = 1 without gradients where proven, else the PyTorch token recurrence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .spec import FalconSpec

BACKENDS = (None, "torch", "triton")


@dataclass(frozen=True)
class Choice:
    core: Callable
    label: str  # "triton" | "torch"
    reason: str


def _torch_core(step: bool):
    if step:
        from .reference import core_recurrent

        return core_recurrent
    from .chunk_torch import core_chunk

    return core_chunk


def select(spec: FalconSpec, q, *, window: int, grad: bool, backend=None, step: bool = False) -> Choice:
    W = spec.window(window)
    T = q.shape[1]
    if backend == "torch":
        return Choice(_torch_core(step), "torch", "backend='torch'")
    if not (q.is_cuda or backend == "triton"):
        return Choice(_torch_core(step), "torch", f"{q.device.type} tensors")
    if step and (T != 1 or grad):
        if backend == "triton":
            raise NotImplementedError("backend='triton': the fused recurrent step takes T = 1 without gradients; "
                                      "use chunk_falcon for longer or differentiable calls")
        return Choice(_torch_core(True), "torch", "the Triton step kernel takes T = 1 without gradients")
    try:
        from . import triton as tk
    except ImportError as e:  # pragma: no cover - depends on the Triton install
        if backend == "triton":
            raise NotImplementedError(f"backend='triton' is not available: {e}") from e
        return Choice(_torch_core(step), "torch", f"Triton is not importable: {e}")
    ok, why = tk.check(spec, window=W, T=T, grad=grad, device_type=q.device.type)
    if ok:
        return Choice(tk.core, "triton", why)
    if backend == "triton":
        raise NotImplementedError(f"backend='triton' has no kernel for {spec.label} (window={W}): {why}; "
                                  "use backend='torch' or backend=None (falls back to torch)")
    return Choice(_torch_core(step), "torch", why)
