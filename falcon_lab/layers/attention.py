"""Softmax attention (the Transformer baseline): RoPE + SDPA (causal; flash on GPU), KV cache decoding."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from falcon_lab.layers.base import Mixer, positions_in_sequence
from falcon_lab.layers.registry import register_mixer


ROPE_TABLE = 32768  # positions whose cos/sin each attention layer keeps precomputed (ours)


def rope_cos_sin(pos: torch.Tensor, dim: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim))
    ang = pos.float()[..., None] * inv  # [T, dim/2] or [B, T, dim/2]
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x [B, T, H, D] (rotate-half convention), cos/sin [T, D/2] or per row [B, T, D/2]."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None], sin[:, :, None])
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)


@register_mixer("attention")
class Attention(Mixer):
    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, rope_theta: float = 10000.0,
                 qk_norm: bool = False):
        super().__init__()
        self.H, self.dh, self.theta = n_heads, head_dim, float(rope_theta)
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.qk_norm = qk_norm
        self.backend_used = "sdpa"
        # RoPE's cos/sin for positions < ROPE_TABLE, computed once (non-persistent: not in checkpoints).
        # Computed inside the step instead, torch.compile fuses pow/cos/sin into the rotation itself and
        # evaluates them per element of q and k: 17 ms of a 78 ms training step on the H200 (2048 x 16).
        cos, sin = rope_cos_sin(torch.arange(ROPE_TABLE), head_dim, self.theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope(self, pos, start, T):
        """cos/sin at `pos` (start + arange(T), or per-row positions): from the table where it reaches."""
        table = self.rope_cos.dtype in (torch.float32, torch.float64)  # not after a cast to bf16/fp16
        if table and isinstance(start, int) and start + T <= self.rope_cos.shape[0]:
            if pos.dim() == 1:
                return self.rope_cos[start:start + T].float(), self.rope_sin[start:start + T].float()
            return self.rope_cos[pos].float(), self.rope_sin[pos].float()  # per-row positions < T
        return rope_cos_sin(pos, self.dh, self.theta)

    def init_state(self, batch_size, device=None, max_len=None):
        if max_len is None:  # growing cache (torch.cat per step)
            return {"k": None, "v": None, "pos": 0}
        # static cache (ours): buffers of max_len positions allocated at the first call, written in place;
        # the position is a tensor, so every leaf keeps its shape and a step can be graph-captured
        return {"k": None, "v": None, "pos": torch.zeros((), dtype=torch.long, device=device),
                "max_len": int(max_len)}

    def forward(self, x, cu_seqlens=None, state=None, return_state=False, decode=False):
        B0, T0, D = x.shape
        h = x  # varlen: rows stay [B, T]; cu_seqlens (over B*T, row starts included) gives a per-row block mask
        B, T, _ = h.shape
        q = self.q_proj(h).view(B, T, self.H, self.dh)
        k = self.k_proj(h).view(B, T, self.H, self.dh)
        v = self.v_proj(h).view(B, T, self.H, self.dh)
        if self.qk_norm:
            q, k = F.rms_norm(q, (self.dh,)), F.rms_norm(k, (self.dh,))
        if state is not None and "max_len" in state:
            return self._static_forward(q, k, v, state, return_state, B0, T0, D)
        start = state["pos"] if state is not None else 0
        if cu_seqlens is not None:
            pos = positions_in_sequence(cu_seqlens, B * T, h.device).view(B, T)
        else:
            pos = torch.arange(start, start + T, device=h.device)
        cos, sin = self._rope(pos, start, T)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, dh]
        new_state = None
        if state is not None and state["k"] is not None:
            k = torch.cat([state["k"], k], dim=2)
            v = torch.cat([state["v"], v], dim=2)
        if return_state:
            new_state = {"k": k, "v": v, "pos": start + T}
        if cu_seqlens is not None:
            seq = torch.searchsorted(cu_seqlens[:-1].to(h.device), torch.arange(B * T, device=h.device),
                                     right=True).view(B, T)
            mask = (seq[:, :, None] == seq[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, 1, T, T]
        elif k.shape[2] == T:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # decoding / continuation: queries are the last T of the keys
            S = k.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=h.device).tril(diagonal=S - T)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = o.transpose(1, 2).reshape(B, T, self.H * self.dh)
        return self.o_proj(o).view(B0, T0, D), new_state

    def _static_forward(self, q, k, v, state, return_state, B0, T0, D):
        """Continuation with a preallocated KV cache [B, H, max_len, dh]: the new keys/values are written
        at positions pos..pos+T-1 in place; queries see the cache up to their own position. The first call
        (empty cache) runs plain causal attention over its own keys, then fills the cache."""
        B, T = q.shape[0], q.shape[1]
        cap = state["max_len"]
        start = state["pos"]
        pos = start + torch.arange(T, device=q.device)
        cos, sin = rope_cos_sin(pos, self.dh, self.theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, dh]
        kbuf, vbuf = state["k"], state["v"]
        if kbuf is None:  # first call: nothing cached yet
            if T > cap:
                raise ValueError(f"attention: prompt of {T} positions exceeds the static KV cache (max_len={cap})")
            kbuf = k.new_zeros(B, self.H, cap, self.dh)
            vbuf = v.new_zeros(B, self.H, cap, self.dh)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = None
        kbuf.index_copy_(2, pos, k.to(kbuf.dtype))
        vbuf.index_copy_(2, pos, v.to(vbuf.dtype))
        if o is None:
            mask = torch.arange(cap, device=q.device)[None, :] <= pos[:, None]  # [T, max_len]
            o = F.scaled_dot_product_attention(q, kbuf.to(q.dtype), vbuf.to(q.dtype), attn_mask=mask)
        new_state = {"k": kbuf, "v": vbuf, "pos": start + T, "max_len": cap} if return_state else None
        o = o.transpose(1, 2).reshape(B, T, self.H * self.dh)
        return self.o_proj(o).view(B0, T0, D), new_state

    def state_numel(self, batch_size, seq_len):
        return 2 * batch_size * seq_len * self.H * self.dh

    def flops_per_token(self, seq_len):
        D = self.q_proj.in_features
        HD = self.H * self.dh
        # projections + QK^T and AV over on average seq_len/2 causal keys
        return float(2 * D * 3 * HD + 2 * HD * D + 2 * 2 * HD * seq_len / 2)
