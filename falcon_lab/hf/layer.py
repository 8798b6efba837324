"""`FalconAttention`: the platform's Falcon mixer with fla's layer signature, to drop into fla models.

    layer = FalconAttention(hidden_size=1024, num_heads=8, layer_idx=i, variant="1A", preset=".3")
    o, _, past_key_values = layer(hidden_states, attention_mask=None, past_key_values=None, use_cache=False)

One implementation: `self.mixer` is falcon_lab's `FalconMixer` (built through the mixer registry with the
given knobs: variant, preset, qk_norm, gate, lam, window, ...; docs/training.md lists them), so the layer runs
the same public op, `falcon_lab.kernels.chunk_falcon` (and `fused_recurrent_falcon` for one-token decoding
steps), with the same weights (`layer.mixer.load_state_dict(platform_mixer.state_dict())`).

fla's conventions, as its layers follow them:
- `hidden_states` [B, T, D]; `attention_mask` [B, T] 0/1 padding mask (0 = padding), the padded tokens are
  removed before the op and zeros put back after; `cu_seqlens` (kwarg) for an already packed batch
  [1, total, D] (every sequence starts fresh);
- `past_key_values`: fla's `Cache` (or falcon_lab's `FalconLabCache`, which offers the same layer
  interface): this layer's entry holds `recurrent_state` (a `FalconState`) and `conv_state` (the short-conv
  cache); `use_cache=True` writes them back with `offset` = the number of new tokens;
- returns `(o, None, past_key_values)` (no attention maps).
With a cache and padding or `cu_seqlens`, each sequence runs on its own tokens and the per-sequence states
are stacked into one batch (as fla's varlen kernels return one state per sequence).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from falcon_lab.hf.state import cat_rows, select_rows


class FalconAttention(nn.Module):
    def __init__(self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int | None = None,
                 layer_idx: int | None = None, **knobs):
        super().__init__()
        from falcon_lab.layers.registry import build_mixer

        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"FalconAttention: hidden_size {hidden_size} is not divisible by num_heads "
                                 f"{num_heads}; give head_dim")
            head_dim = hidden_size // num_heads
        self.hidden_size, self.num_heads, self.head_dim = int(hidden_size), int(num_heads), int(head_dim)
        self.layer_idx = layer_idx
        # unknown knobs fail here, naming the key (the registry's check)
        self.mixer = build_mixer({"name": "falcon", **knobs}, self.hidden_size, self.num_heads, self.head_dim,
                                 layer_idx or 0)

    def extra_repr(self) -> str:
        m = self.mixer
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"layer_idx={self.layer_idx}, variant={m.variant}, qk_norm={m.qk_norm}, gate={m.gate}, lam={m.lam}, "
                f"window={m.window}")

    # -- cache glue (fla's layer-cache interface) --------------------------------------------------
    def _last_state(self, past_key_values):
        if past_key_values is None:
            return None
        if self.layer_idx is None:
            raise ValueError("FalconAttention requires layer_idx when past_key_values is given")
        if len(past_key_values) <= self.layer_idx:
            return None
        entry = past_key_values[self.layer_idx]
        if not entry or entry.get("recurrent_state") is None:
            return None
        return {"conv": entry.get("conv_state"), "op": entry["recurrent_state"]}

    def _save_state(self, past_key_values, state, offset):
        if past_key_values is None or state is None:
            return
        past_key_values.update(recurrent_state=state["op"], conv_state=state["conv"], layer_idx=self.layer_idx,
                               offset=offset)

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool | None = False, output_attentions: bool | None = False,
                **kwargs):
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("FalconAttention: attention_mask must be a [batch, length] 0/1 padding mask "
                             "(0 = padding); arbitrary attention masks are not supported")
        B, T, D = hidden_states.shape
        last = self._last_state(past_key_values)
        want_state = bool(use_cache) and past_key_values is not None
        cu_seqlens = kwargs.get("cu_seqlens")
        mask = attention_mask[:, -T:].bool() if attention_mask is not None else None
        if mask is not None and bool(mask.all()):
            mask = None
        if cu_seqlens is not None and mask is not None:
            raise ValueError("FalconAttention: give either attention_mask (padding) or cu_seqlens (packed), not both")

        if mask is None and cu_seqlens is None:
            decode = T == 1 and last is not None  # a decoding step: the recurrent form (as Decoder.step)
            o, st = self.mixer(hidden_states, state=last, return_state=want_state, decode=decode)
            self._save_state(past_key_values, st if want_state else None, T)
            return o, None, past_key_values

        if cu_seqlens is not None:  # packed: [1, total, D], one sequence per segment
            if B != 1:
                raise ValueError(f"FalconAttention: cu_seqlens needs a packed batch of size 1, got {B}")
            segments = [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
        else:
            idx = torch.arange(T, device=hidden_states.device)
            segments = []
            for r in range(B):
                pos = idx[mask[r]]
                if pos.numel() and int(pos[-1] - pos[0]) + 1 != pos.numel():
                    raise ValueError("FalconAttention: the tokens of a row must be contiguous (left or right padding)")
                segments.append((r, int(pos[0]) if pos.numel() else 0, int(pos[-1]) + 1 if pos.numel() else 0))

        if last is None and not want_state:  # no cache: one varlen call over the real tokens (fla's unpadding)
            if cu_seqlens is not None:
                o, _ = self.mixer(hidden_states, cu_seqlens=cu_seqlens)
                return o, None, past_key_values
            keep = [(r, s, e) for r, s, e in segments if e > s]
            x = torch.cat([hidden_states[r, s:e] for r, s, e in keep], dim=0)[None]
            lens = torch.tensor([0] + [e - s for _, s, e in keep], device=x.device).cumsum(0)
            y, _ = self.mixer(x, cu_seqlens=lens)
            o = hidden_states.new_zeros(B, T, D)
            for (r, s, e), a, b in zip(keep, lens[:-1].tolist(), lens[1:].tolist()):
                o[r, s:e] = y[0, a:b]
            return o, None, past_key_values

        # with a cache: each sequence on its own tokens, from its own state; the states stacked
        o = hidden_states.new_zeros(B, T, D)
        states = []
        for n, (r, s, e) in enumerate(segments):
            if e == s:
                raise ValueError("FalconAttention: a sequence without tokens cannot be cached")
            row_state = select_rows(last, torch.tensor([n])) if last is not None else None
            decode = e - s == 1 and row_state is not None
            y, st = self.mixer(hidden_states[r:r + 1, s:e], state=row_state, return_state=True, decode=decode)
            o[r, s:e] = y[0]
            states.append(st)
        if want_state:
            self._save_state(past_key_values, cat_rows(states), T)
        return o, None, past_key_values
