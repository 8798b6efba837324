"""Layer building blocks (fla's `modules` tier): the short causal convolution, the norms and the
output norm-gate. Each has a PyTorch implementation (CPU, and what torch.compile fuses) and a Triton
kernel (CUDA; under TRITON_INTERPRET=1 on CPU for the parity tests) with the same signature."""

from falcon_lab.modules.conv import ShortConvolution, short_conv  # noqa: E402,F401
from falcon_lab.modules.norm import FusedRMSNormGated, RMSNorm, qk_norm, rms_norm_gated  # noqa: E402,F401

__all__ = ["ShortConvolution", "short_conv", "RMSNorm", "FusedRMSNormGated", "qk_norm", "rms_norm_gated"]
