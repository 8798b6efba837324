"""Linear-recurrent baselines expressed exactly through the Falcon operator (same-step pairs,
`shift=False`, direct step `step="direct"`, absolute λ), with fla's pure-PyTorch references as a
second path (`core="fla_naive"`, CPU, for tests) and fla's chunk kernels where they run
(`core="fla"`, CUDA only). `backend_used` records which path ran.

Exact maps (all [D], checked against fla's naive references in tests/test_models_baselines.py):
- DeltaNet:       S = S + β k (v − Sᵀk)ᵀ             = Falcon-1, η = β, λ = 0.
- Gated DeltaNet: S = αS + β k (v − αSᵀk)ᵀ           = Falcon-1 with η = αβ, y = v/α, λ = (1−α)/η
                  (then γ = 1 − ηλ = α). Ours: α ≥ alpha_min (1e-3) and β ≥ 1e-6 so v/α and λ stay finite.
- Mamba-2 (SSD):  S = a S + dt · B xᵀ, y = Cᵀ S + D x = Falcon-1A, η = dt, λ = (1−a)/dt, q = C, k = B;
                  exact while a ≥ eps_gamma (1e-6), i.e. dt·|A| ≤ 13.8.
- RetNet:         S = γ_h S + k vᵀ (fixed per-head γ_h = 1 − 2^(−5−h)) = Falcon-1A, η = 1, λ = 1 − γ_h.
                  Ours: no xPos rotation.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from falcon_lab.kernels import chunk_falcon, fused_recurrent_falcon
from falcon_lab.layers.base import (
    Mixer,
    _gate_dtype,
    flatten_for_varlen,
    l2_normalize,
    operator_backend_label,
    positions_in_sequence,
)
from falcon_lab.modules import FusedRMSNormGated, RMSNorm, ShortConvolution
from falcon_lab.layers.falcon import operator_flops_per_token_head
from falcon_lab.layers.registry import register_mixer

CORES = ("falcon", "fla_naive", "fla")


class _OperatorMixer(Mixer):
    """Shared shell: projections -> short conv -> (q, k, v, β, λ) -> Falcon operator -> norm/gate -> out."""

    variant = "1"
    delta = True

    def _shell(self, d_model, n_heads, head_dim, conv_size, core, use_gate, chunk_size, backend):
        if core not in CORES:
            raise ValueError(f"mixer.core: {core!r} is not one of {CORES}")
        self.H, self.dk, self.dv = n_heads, head_dim, head_dim
        self.core, self.chunk_size, self.backend = core, int(chunk_size), backend
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.conv = ShortConvolution(3 * n_heads * head_dim, conv_size) if conv_size > 1 else None
        # output norm and SiLU gate in one module (one kernel on CUDA) when gated
        self.o_norm = FusedRMSNormGated(head_dim) if use_gate else RMSNorm(head_dim)
        self.g_proj = nn.Linear(d_model, n_heads * head_dim, bias=False) if use_gate else None
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.backend_used = "unset"

    def init_state(self, batch_size, device=None, max_len=None):
        return {"conv": None, "op": None}

    def _qkv(self, h, cu_seqlens, conv_cache):
        B, T, _ = h.shape
        qkv = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        pos = positions_in_sequence(cu_seqlens, T, h.device) if cu_seqlens is not None else None
        if self.conv is not None:
            qkv, conv_cache = self.conv(qkv, conv_cache, pos)
        else:
            qkv = F.silu(qkv)
        q, k, v = (t.reshape(B, T, self.H, -1) for t in qkv.chunk(3, dim=-1))
        return q, k, v, conv_cache

    def operator_inputs(self, h, q, k, v):
        """-> q', k', v', β(=η), λ, eps_gamma for the Falcon operator (subclasses)."""
        raise NotImplementedError

    def reference(self, h, q, k, v):
        """fla's naive recurrence of the same layer (CPU, float32)."""
        raise NotImplementedError

    def _fla_kernel(self, h, q, k, v):
        raise NotImplementedError(f"core='fla' is not wired for {self.mixer_name}")

    def forward(self, x, cu_seqlens=None, state=None, return_state=False, decode=False):
        B0, T0, D = x.shape
        h = flatten_for_varlen(x, cu_seqlens)
        B, T, _ = h.shape
        q, k, v, conv_cache = self._qkv(h, cu_seqlens, state["conv"] if state else None)
        op_state = None
        if self.core == "falcon" or decode or return_state:
            q2, k2, v2, eta, lam, eps_g = self.operator_inputs(h, q, k, v)
            kw = dict(variant=self.variant, step="direct", lam_mode="absolute", shift=False, read="after",
                      eps_gamma=eps_g, initial_state=state["op"] if state else None,
                      output_final_state=return_state)
            if decode:
                o, op_state = fused_recurrent_falcon(q2, k2, v2, eta.to(_gate_dtype(q2)), lam.to(_gate_dtype(q2)),
                                                     backend=self.backend, **kw)
                self.backend_used = "falcon-recurrent-" + operator_backend_label(self.backend, q2, self.variant, None,
                                                                                step=True)
            else:
                o, op_state = chunk_falcon(q2, k2, v2, eta.to(_gate_dtype(q2)), lam.to(_gate_dtype(q2)), cu_seqlens=cu_seqlens,
                                           chunk_size=self.chunk_size, backend=self.backend, **kw)
                self.backend_used = "falcon-" + operator_backend_label(self.backend, q2, self.variant, None)
        elif self.core == "fla_naive":
            if cu_seqlens is not None:
                raise ValueError("mixer.core=fla_naive does not support cu_seqlens")
            o = self.reference(h, q, k, v).to(q.dtype)
            self.backend_used = "fla-naive"
        else:
            if not q.is_cuda:
                raise RuntimeError("mixer.core=fla needs CUDA tensors (fla's Triton kernels); use core=falcon on CPU")
            o = self._fla_kernel(h, q, k, v)
            self.backend_used = "fla"
        o = self._post(h, o, v)
        new_state = {"conv": conv_cache, "op": op_state} if return_state else None
        return self.o_proj(o).view(B0, T0, D), new_state

    def _post(self, h, o, v):
        B, T = h.shape[:2]
        if self.g_proj is not None:
            return self.o_norm(o, self.g_proj(h).view(o.shape).to(o.dtype)).reshape(B, T, -1)
        return self.o_norm(o).reshape(B, T, -1)

    def state_numel(self, batch_size, seq_len):
        conv = (self.conv.size - 1) * self.conv.weight.shape[0] if self.conv is not None else 0
        return batch_size * (self.H * self.dk * self.dv + conv)

    def flops_per_token(self, seq_len):
        D = self.q_proj.in_features
        HD = self.H * self.dk
        mm = 2 * D * 3 * HD + 2 * HD * D + (2 * D * HD if self.g_proj is not None else 0) + self._extra_flops(D)
        C = max(1, min(self.chunk_size, seq_len))
        op = self.H * operator_flops_per_token_head(self.variant, self.dk, self.dv, C, 1)
        conv = 2 * (self.conv.size * self.conv.weight.shape[0] if self.conv is not None else 0)
        return float(mm + op + conv)

    def _extra_flops(self, D):
        return 0


@register_mixer("deltanet")
class DeltaNet(_OperatorMixer):
    variant = "1"

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, conv_size: int = 4, use_gate: bool = False,
                 core: str = "falcon", chunk_size: int = 64, backend: str | None = None):
        super().__init__()
        self._shell(d_model, n_heads, head_dim, conv_size, core, use_gate, chunk_size, backend)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)

    def _features(self, h, q, k):
        q, k = l2_normalize(q, 1e-6), l2_normalize(k, 1e-6)
        return q * self.dk ** -0.5, k  # fla's default read scale 1/sqrt(d_k)

    def operator_inputs(self, h, q, k, v):
        q, k = self._features(h, q, k)
        beta = torch.sigmoid(self.b_proj(h).float())
        return q, k, v, beta, torch.zeros_like(beta), 1e-4

    def reference(self, h, q, k, v):
        from fla.ops.delta_rule.naive import delta_rule_recurrence

        q, k = l2_normalize(q, 1e-6), l2_normalize(k, 1e-6)
        beta = torch.sigmoid(self.b_proj(h).float())
        t = lambda z: z.transpose(1, 2).float()  # noqa: E731  [B, H, T, D]
        o, _ = delta_rule_recurrence(t(q), t(k), t(v), beta.transpose(1, 2))  # scales q by d_k^-1/2
        return o.transpose(1, 2)

    def _fla_kernel(self, h, q, k, v):
        from fla.ops.delta_rule import chunk_delta_rule

        q, k = l2_normalize(q, 1e-6), l2_normalize(k, 1e-6)
        beta = torch.sigmoid(self.b_proj(h).float()).to(q.dtype)
        o, _ = chunk_delta_rule(q, k, v, beta, scale=self.dk ** -0.5)
        return o

    def _extra_flops(self, D):
        return 2 * D * self.H


@register_mixer("gated_deltanet")
class GatedDeltaNet(_OperatorMixer):
    variant = "1"

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, conv_size: int = 4, use_gate: bool = True,
                 alpha_min: float = 1e-3, core: str = "falcon", chunk_size: int = 64, backend: str | None = None):
        super().__init__()
        self._shell(d_model, n_heads, head_dim, conv_size, core, use_gate, chunk_size, backend)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        self.a_proj = nn.Linear(d_model, n_heads, bias=False)
        self.alpha_min = float(alpha_min)
        # ours (Mamba-2 style init): A ~ U[1, 16], dt ~ logU[1e-3, 1e-1]
        self.A_log = nn.Parameter(torch.log(torch.empty(n_heads).uniform_(1, 16)))
        dt = torch.exp(torch.empty(n_heads).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def _gates(self, h):
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(h).float() + self.dt_bias)
        g = g.clamp(min=math.log(self.alpha_min))
        beta = torch.sigmoid(self.b_proj(h).float()).clamp(min=1e-6)
        return g, beta

    def operator_inputs(self, h, q, k, v):
        q, k = l2_normalize(q, 1e-6), l2_normalize(k, 1e-6)
        g, beta = self._gates(h)
        alpha = g.exp()
        eta = alpha * beta
        lam = -torch.expm1(g) / eta  # (1 - α)/η  ->  γ = 1 - ηλ = α
        return q * self.dk ** -0.5, k, v / alpha[..., None].to(v.dtype), eta, lam, 1e-6

    def reference(self, h, q, k, v):
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        q, k = l2_normalize(q, 1e-6), l2_normalize(k, 1e-6)
        g, beta = self._gates(h)
        o, _ = naive_recurrent_gated_delta_rule(q.float(), k.float(), v.float(), beta, g, scale=self.dk ** -0.5)
        return o

    def _fla_kernel(self, h, q, k, v):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k = l2_normalize(q, 1e-6), l2_normalize(k, 1e-6)
        g, beta = self._gates(h)
        o, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta.to(q.dtype), scale=self.dk ** -0.5)
        return o

    def _extra_flops(self, D):
        return 4 * D * self.H


@register_mixer("mamba2")
class Mamba2(_OperatorMixer):
    """Mamba-2 (SSD, one B/C group) on Falcon-1A: q = C, k = B, v = x, η = dt, λ = (1 − a)/dt."""

    variant = "1A"

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, conv_size: int = 4,
                 core: str = "falcon", chunk_size: int = 64, backend: str | None = None):
        super().__init__()
        self._shell(d_model, n_heads, head_dim, conv_size, core, True, chunk_size, backend)
        # q_proj -> C, k_proj -> B (shared across heads: one group), v_proj -> x, g_proj -> z
        self.q_proj = nn.Linear(d_model, head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, head_dim, bias=False)
        self.conv = ShortConvolution(2 * head_dim + n_heads * head_dim, conv_size) if conv_size > 1 else None
        self.dt_proj = nn.Linear(d_model, n_heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(n_heads).uniform_(1, 16)))
        dt = torch.exp(torch.empty(n_heads).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.o_norm = RMSNorm(n_heads * head_dim)

    def _qkv(self, h, cu_seqlens, conv_cache):
        B, T, _ = h.shape
        N, H, P = self.dk, self.H, self.dv
        cbx = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        pos = positions_in_sequence(cu_seqlens, T, h.device) if cu_seqlens is not None else None
        if self.conv is not None:
            cbx, conv_cache = self.conv(cbx, conv_cache, pos)
        else:
            cbx = F.silu(cbx)
        C, Bm, x = cbx.split([N, N, H * P], dim=-1)
        C = C[:, :, None].expand(B, T, H, N)
        Bm = Bm[:, :, None].expand(B, T, H, N)
        return C, Bm, x.reshape(B, T, H, P), conv_cache

    def _dt(self, h):
        dt = F.softplus(self.dt_proj(h).float() + self.dt_bias)
        return dt, -self.A_log.float().exp()

    def operator_inputs(self, h, q, k, v):
        dt, A = self._dt(h)
        lam = -torch.expm1(dt * A) / dt  # (1 - a)/dt  ->  γ = 1 - ηλ = a = exp(dt A)
        return q, k, v, dt, lam, 1e-6

    def reference(self, h, q, k, v):
        from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

        dt, A = self._dt(h)
        o, _ = naive_recurrent_simple_gla(q.float(), (k * dt[..., None]).float(), v.float(), dt * A, scale=1.0)
        return o

    def _fla_kernel(self, h, q, k, v):
        from fla.ops.simple_gla import chunk_simple_gla

        dt, A = self._dt(h)
        o, _ = chunk_simple_gla(q, (k * dt[..., None]).to(q.dtype), v, g=dt * A, scale=1.0)
        return o

    def _post(self, h, o, v):
        B, T = h.shape[:2]
        o = o + self.D.to(o.dtype)[:, None] * v
        o = o.reshape(B, T, -1) * F.silu(self.g_proj(h))
        return self.o_norm(o)

    def state_numel(self, batch_size, seq_len):
        conv = (self.conv.size - 1) * self.conv.weight.shape[0] if self.conv is not None else 0
        return batch_size * (self.H * self.dk * self.dv + conv)

    def flops_per_token(self, seq_len):
        D, H, N, P = self.v_proj.in_features, self.H, self.dk, self.dv
        mm = 2 * D * (2 * N + 2 * H * P + H) + 2 * H * P * D
        C = max(1, min(self.chunk_size, seq_len))
        return float(mm + H * operator_flops_per_token_head("1A", N, P, C, 1))


@register_mixer("retnet")
class RetNet(_OperatorMixer):
    """Retention (RetNet / Lightning-attention style fixed decay) on Falcon-1A: η = 1, λ = 1 − γ_h."""

    variant = "1A"

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, conv_size: int = 1, use_gate: bool = True,
                 core: str = "falcon", chunk_size: int = 64, backend: str | None = None):
        super().__init__()
        self._shell(d_model, n_heads, head_dim, conv_size, core, use_gate, chunk_size, backend)
        self.register_buffer("decay", 1 - 2.0 ** (-5.0 - torch.arange(n_heads, dtype=torch.float32)),
                             persistent=False)

    def _qkv(self, h, cu_seqlens, conv_cache):
        B, T, _ = h.shape
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        if self.conv is not None:
            pos = positions_in_sequence(cu_seqlens, T, h.device) if cu_seqlens is not None else None
            qkv, conv_cache = self.conv(torch.cat([q, k, v], -1), conv_cache, pos)
            q, k, v = qkv.chunk(3, dim=-1)
        return (q.reshape(B, T, self.H, -1), k.reshape(B, T, self.H, -1), v.reshape(B, T, self.H, -1), conv_cache)

    def operator_inputs(self, h, q, k, v):
        B, T = h.shape[:2]
        eta = torch.ones(B, T, self.H, device=h.device)
        lam = (1 - self.decay).expand(B, T, self.H).contiguous()
        return q, k * self.dk ** -0.5, v, eta, lam, 1e-4

    def reference(self, h, q, k, v):
        from fla.ops.retention.naive import naive_retention

        t = lambda z: z.transpose(1, 2).float()  # noqa: E731
        return naive_retention(t(q), t(k), t(v)).transpose(1, 2)

    def _fla_kernel(self, h, q, k, v):
        from fla.ops.simple_gla import chunk_simple_gla

        B, T = h.shape[:2]
        g = torch.log(self.decay).expand(B, T, self.H).contiguous()
        o, _ = chunk_simple_gla(q, k * self.dk ** -0.5, v, g=g, scale=1.0)
        return o
