"""The Falcon mixer: all six state-update rules on `falcon_lab.kernels.chunk_falcon`.

Everything the paper leaves open is ours (falcon-math.md §3, docs/training.md "Knobs"):
- short causal depthwise conv (kernel 4) + SiLU on the q/k/v projections;
- QK normalisation per head: `rmsnorm` (u/sqrt(mean u² + eps_rms), ||x||² ≈ d_k) or `l2`
  (u/sqrt(||u||² + eps_rms)), optional learnable gain (`qk_norm_gain`);
- gate heads from the current token's hidden state, Linear(d_model -> H) with bias
  (-> H·d_v for variants 2/2A):
    ctx_beta: β = beta_max·σ(z), step "nlms" (η = β / (E + λ + ε) inside the operator);
    ctx_eta:  η = (eta_max / E_nom)·σ(z), step "direct", E_nom = d_k for rmsnorm keys, 1 for l2;
- λ: ctx (scaled: λ̄ = lam_scale·σ(z), λ = λ̄·E in the operator; absolute: λ = softplus(z)),
  const (lam_value, scaled or absolute), off (λ = 0);
- per-head output RMSNorm (learnable gain) and an output gate SiLU(W_g h) (the paper's 130M vs 124M
  parameter gap suggests one extra d×d matrix per layer).

Memory (ours, `recompute`): in training, the glue between the projections and the op's Triton core
(short conv + SiLU, QK norm, gate nonlinearities, the op's prep) runs under selective activation
checkpointing: autograd keeps the projections' outputs and the core's outputs (o, chunk states), and
the glue is recomputed in backward to feed the core's backward (torch.utils.checkpoint with a policy
that saves the core `falcon_lab::chunk_core_fwd` and recomputes the rest). Same values and gradients;
`auto` turns it on for CUDA inputs of the variants without a window (off on CPU, where the op's PyTorch
form would be recomputed too, and for 3 / 3A, whose window-expanded prep is costly to redo: on the H200
at 2048 x 16 it cost Falcon-3 39 % and Falcon-3A 7 % of their speed, for -8.8 GiB and +0.5 GiB; it costs
Falcon-1A about nothing and saves 2.9 GiB, Falcon-2A 2 % for 5.1 GiB).

Gate ranges (ours) keep the decay clamp inactive in the presets: without a learnable QK gain,
||x||² ≤ d_k (rmsnorm) or ≤ 1 (l2), so with scaled λ, lam_scale ≤ 1 and eta_max ≤ 1,
α = ηλ ≤ σ_η·λ̄ < 1 for ctx_eta; for ctx_beta, α = β λ̄/(1+λ̄) < 1 when beta_max ≤ 2 (§3.4).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from falcon_lab.kernels import FalconSpec, chunk_falcon, fused_recurrent_falcon
from falcon_lab.layers.base import (
    Mixer,
    _gate_dtype,
    check_module_backend,
    flatten_for_varlen,
    operator_backend_label,
    positions_in_sequence,
)
from falcon_lab.modules import FusedRMSNormGated, RMSNorm, ShortConvolution, qk_norm
from falcon_lab.layers.registry import register_mixer

from falcon_lab.layers.falcon_config import (  # noqa: F401  (re-exported: the knobs' one home)
    DEFAULT_WINDOW,
    GATES,
    LAM_MODES,
    LAMS,
    PRESETS,
    QK_NORMS,
    READS,
    RECOMPUTE,
    VARIANTS,
    FalconConfig,
    check_recompute,
    normalize_preset,
)

__all__ = ["FalconMixer", "FalconConfig", "VARIANTS", "PRESETS", "QK_NORMS", "GATES", "LAMS", "LAM_MODES", "READS",
           "RECOMPUTE", "DEFAULT_WINDOW", "check_recompute", "normalize_preset", "operator_flops_per_token_head"]


def operator_flops_per_token_head(variant: str, dk: int, dv: int, chunk: int, window: int) -> float:
    """Forward FLOPs per token per head of the chunked operator (falcon-math.md §7)."""
    C, d, e, B = chunk, dk, dv, window
    if variant == "1A":
        return 2 * C * (d + e) + 4 * d * e
    if variant == "2A":
        return 2 * C * (d + e) + 4 * d * e + C * e
    if variant == "3A":
        return 2 * (C + B) * (d + e) + 4 * d * e * (1 + B / (2 * C)) + C * B
    if variant == "1":
        return 4 * C * d + 3 * C * e + 6 * d * e
    if variant == "2":
        return 4 * C * d + 3.5 * C * e + 6 * d * e
    if variant == "3":
        return 4 * (C + B) * d + (B * B * C + 2 * B * C) * e + 6 * d * e
    raise ValueError(variant)


# the cores' forward operators: kernels/triton/ops.py (registered only where triton imports) and, under
# torch.compile, the PyTorch chunk form (kernels/chunk_torch.py), whose backward recomputes it anyway
_CORE_OPS = ("falcon_lab::chunk_core_fwd", "falcon_lab::chunk_torch_fwd")


def _keep_core(ctx, op, *args, **kwargs):
    """Selective checkpointing policy: keep what the op's core computed, recompute the glue."""
    if getattr(op, "name", None) is not None and op.name() in _CORE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_KEEP_CORE = functools.partial(create_selective_checkpoint_contexts, _keep_core)


@register_mixer("falcon")
class FalconMixer(Mixer):
    Config = FalconConfig  # the knobs (falcon_config.py): the registry reads them from here

    def __init__(self, d_model: int, n_heads: int, head_dim: int, **knobs):
        """knobs: the fields of FalconConfig (configs/mixer/falcon.yaml); checked and resolved there."""
        super().__init__()
        c = FalconConfig.from_knobs(knobs).resolved()
        self.config = c
        self.qk_norm, self.gate, self.lam, self.window = c.qk_norm, c.gate, c.lam, c.window
        self.recompute = c.recompute
        self.variant, self.preset = c.variant, c.preset
        self.H, self.dk, self.dv = n_heads, head_dim, head_dim
        self.lam_mode = c.lam_mode if self.lam != "off" else "absolute"
        self.lam_scale, self.lam_value = float(c.lam_scale), float(c.lam_value)
        self.shift, self.read = bool(c.shift), c.read
        self.eps, self.eps_gamma, self.eps_rms = float(c.eps), float(c.eps_gamma), float(c.eps_rms)
        self.beta_max, self.eta_max = float(c.beta_max), float(c.eta_max)
        self.backend, self.chunk_size = c.backend, int(c.chunk_size)
        conv_size, output_norm, output_gate = c.conv_size, c.output_norm, c.output_gate
        qk_norm_gain, lam_init_bias, module_backend = c.qk_norm_gain, c.lam_init_bias, c.module_backend
        mb = check_module_backend(module_backend)
        self.spec = FalconSpec.from_variant(self.variant)
        self.per_column = self.spec.per_column
        H, dk, dv = n_heads, head_dim, head_dim
        self.q_proj = nn.Linear(d_model, H * dk, bias=False)
        self.k_proj = nn.Linear(d_model, H * dk, bias=False)
        self.v_proj = nn.Linear(d_model, H * dv, bias=False)
        # q, k, v convolved in one kernel that writes them as three contiguous tensors (split=3; dk == dv)
        self.conv = ShortConvolution(2 * H * dk + H * dv, conv_size, backend=mb, split=3) if conv_size > 1 else None
        self.qk_gain = nn.Parameter(torch.ones(2, H, dk)) if qk_norm_gain else None
        self.gate_proj = nn.Linear(d_model, H * dv if self.per_column else H, bias=True)
        nn.init.zeros_(self.gate_proj.bias)  # ours: σ(0) = 1/2 -> β = 1 (ctx_beta), η = eta_max/2/E_nom
        self.lam_proj = None
        if self.lam == "ctx":
            self.lam_proj = nn.Linear(d_model, H, bias=True)
            nn.init.constant_(self.lam_proj.bias, lam_init_bias)  # ours: weak initial forgetting
        self.module_backend = mb
        # the output norm and the SiLU gate in one module (one kernel on CUDA) when both are on
        self.o_norm = None
        if output_norm:
            self.o_norm = (FusedRMSNormGated(dv, eps=1e-6, backend=mb) if output_gate
                           else RMSNorm(dv, eps=1e-6, backend=mb))
        self.g_proj = nn.Linear(d_model, H * dv, bias=False) if output_gate else None
        self.o_proj = nn.Linear(H * dv, d_model, bias=False)
        self.e_nom = float(dk) if self.qk_norm == "rmsnorm" else 1.0
        self.backend_used = "unset"

    # -- gates ---------------------------------------------------------------------------------
    def _gate_logits(self, h):
        """The gate heads' linear parts (kept outside the recomputed glue): the step and λ heads in one
        matrix product (their weights stacked; same parameters and values as two Linear calls)."""
        if self.lam_proj is None:
            return self.gate_proj(h), None
        z = F.linear(h, torch.cat([self.gate_proj.weight, self.lam_proj.weight]),
                     torch.cat([self.gate_proj.bias, self.lam_proj.bias]))
        return z.split([self.gate_proj.out_features, self.lam_proj.out_features], dim=-1)

    def _gates(self, zg, zl):
        B, T = zg.shape[:2]
        z = zg.float()
        z = z.view(B, T, self.H, self.dv) if self.per_column else z.view(B, T, self.H)
        if self.gate == "ctx_beta":
            beta, step = self.beta_max * torch.sigmoid(z), "nlms"
        else:
            beta, step = (self.eta_max / self.e_nom) * torch.sigmoid(z), "direct"
        if self.lam == "ctx":
            zl = zl.float()
            lam = self.lam_scale * torch.sigmoid(zl) if self.lam_mode == "scaled" else F.softplus(zl)
        elif self.lam == "const":
            lam = torch.full((B, T, self.H), self.lam_value, device=zg.device, dtype=torch.float32)
        else:
            lam = torch.zeros(B, T, self.H, device=zg.device, dtype=torch.float32)
        return beta, lam, step

    def _norm(self, u, which):
        gain = self.qk_gain[which] if self.qk_gain is not None else None
        return qk_norm(u, self.qk_norm, self.eps_rms, gain=gain, backend=self.module_backend)

    def init_state(self, batch_size, device=None, max_len=None):
        return {"conv": None, "op": None}

    def _recomputes(self, x, state, return_state, decode) -> bool:
        if not (self.training and torch.is_grad_enabled()) or state is not None or return_state or decode:
            return False
        if self.recompute == "auto":  # measured on the H200 (benchmarks/results/model_h200.md, +norecompute rows)
            return x.is_cuda and not self.spec.windowed
        return bool(self.recompute)

    def forward(self, x, cu_seqlens=None, state=None, return_state=False, decode=False):
        B0, T0, D = x.shape
        if cu_seqlens is not None and (state is not None or return_state):
            raise ValueError("cu_seqlens and decoding state cannot be combined")
        h = flatten_for_varlen(x, cu_seqlens)
        B, T, _ = h.shape
        H, dv = self.H, self.dv
        # q, k, v in one matrix product (weights stacked: no [B, T, 3D] copy of the outputs; same parameters)
        qkv = F.linear(h, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
        zg, zl = self._gate_logits(h)
        pos = positions_in_sequence(cu_seqlens, T, h.device) if cu_seqlens is not None else None
        # which core the op runs (its own dispatch, asked with q's batch, length, device and dtype), set out
        # here: the recomputed region below may not change module attributes under torch.compile
        self.backend_used = ("recurrent-" if decode else "") + operator_backend_label(
            self.backend, qkv, self.variant, self.window, step=decode)
        if self._recomputes(x, state, return_state, decode):
            o = checkpoint(self._glue_and_op, qkv, zg, zl, pos, cu_seqlens, use_reentrant=False,
                           context_fn=_KEEP_CORE)
            new_state = None
        else:
            o, conv_cache, op_state = self._glue_and_op(qkv, zg, zl, pos, cu_seqlens, state, return_state,
                                                        decode, full=True)
            new_state = {"conv": conv_cache, "op": op_state} if return_state else None
        gate = self.g_proj(h).view(B, T, H, dv) if self.g_proj is not None else None
        if isinstance(self.o_norm, FusedRMSNormGated):
            o = self.o_norm(o, gate.to(o.dtype))
        else:
            o = self.o_norm(o) if self.o_norm is not None else o
            o = o * F.silu(gate) if gate is not None else o
        y = self.o_proj(o.reshape(B, T, H * dv)).view(B0, T0, D)
        return y, new_state

    def _glue_and_op(self, qkv, zg, zl, pos, cu_seqlens, state=None, return_state=False, decode=False,
                     full=False):
        """Projections' outputs -> the op's output o [B, T, H, dv]: short conv + SiLU, QK norm, gates,
        the op (prep and core). full: also return (conv cache, op state) for decoding."""
        B, T, _ = qkv.shape
        H, dk, dv = self.H, self.dk, self.dv
        conv_cache = state["conv"] if state is not None else None
        if self.conv is not None:
            y, conv_cache = self.conv(qkv, conv_cache, pos)
            q, k, v = y.unbind(0)
        else:
            q, k, v = F.silu(qkv).split([H * dk, H * dk, H * dv], dim=-1)
        q = self._norm(q.view(B, T, H, dk), 0)
        k = self._norm(k.view(B, T, H, dk), 1)
        v = v.view(B, T, H, dv)
        beta, lam, step = self._gates(zg, zl)
        kw = dict(variant=self.variant, step=step, lam_mode=self.lam_mode, shift=self.shift, read=self.read,
                  eps=self.eps, eps_gamma=self.eps_gamma, initial_state=state["op"] if state else None,
                  output_final_state=return_state)
        if self.window is not None:
            kw["window"] = self.window
        if decode:
            o, op_state = fused_recurrent_falcon(q, k, v, beta.to(_gate_dtype(q)), lam.to(_gate_dtype(q)),
                                                 backend=self.backend, **kw)
        else:
            o, op_state = chunk_falcon(q, k, v, beta.to(_gate_dtype(q)), lam.to(_gate_dtype(q)), cu_seqlens=cu_seqlens,
                                       chunk_size=self.chunk_size, backend=self.backend, **kw)
        return (o, conv_cache, op_state) if full else o

    def state_numel(self, batch_size, seq_len):
        H, dk, dv = self.H, self.dk, self.dv
        W = self.window or 1
        per = H * dk * dv + H * dk + (W - 1) * H * (dk + dv)
        conv = (self.conv.size - 1) * (2 * H * dk + H * dv) if self.conv is not None else 0
        return batch_size * (per + conv)

    def flops_per_token(self, seq_len):
        D = self.q_proj.in_features
        H, dk, dv = self.H, self.dk, self.dv
        mm = 2 * D * (2 * H * dk + H * dv) + 2 * H * dv * D
        mm += 2 * D * self.gate_proj.out_features + (2 * D * H if self.lam_proj is not None else 0)
        mm += 2 * D * H * dv if self.g_proj is not None else 0
        conv = 2 * (self.conv.size if self.conv else 0) * (2 * H * dk + H * dv)
        C = max(1, min(self.chunk_size, seq_len))
        op = H * operator_flops_per_token_head(self.variant, dk, dv, C, self.window or 1)
        return float(mm + conv + op)
