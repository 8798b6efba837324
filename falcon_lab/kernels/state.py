"""FalconState: everything exact continuation of a Falcon scan needs.

The matrix state S alone is not enough (falcon-math.md §4.2):
- every shifted variant writes the pair (φ(k_{t-1}), v_t), so the next segment's first write needs
  the last normalised key φ(k_T) of this one (the paper's algorithms drop it: that loses one pair and,
  since η = 0 there, one step of decay);
- the window variants 3 and 3A also need the last B-1 causal pairs (the "tail");
- whether the next position is a sequence start (x = 0, η = 0) depends on how many tokens were seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class FalconState:
    S: torch.Tensor  # [N, H, K, V], fp32 (fp64 for float64 inputs)
    last_k: torch.Tensor  # [N, H, K]: φ(k) of the last token seen (zeros when none)
    seen: torch.Tensor  # [N] int64: tokens consumed so far
    tail_x: Optional[torch.Tensor]  # [N, W-1, H, K] last W-1 write keys (oldest first); None if W == 1
    tail_v: Optional[torch.Tensor]  # [N, W-1, H, V] their values
    variant: str
    window: int
    shift: bool
    read: str

    @property
    def batch_size(self) -> int:
        return self.S.shape[0]

    def detach(self) -> "FalconState":
        """A copy cut from the autograd graph (truncated BPTT across segments)."""
        d = lambda t: None if t is None else t.detach()  # noqa: E731
        return FalconState(d(self.S), d(self.last_k), self.seen, d(self.tail_x), d(self.tail_v),
                           self.variant, self.window, self.shift, self.read)

    def to(self, device=None, dtype=None) -> "FalconState":
        """Move to a device and/or cast the float tensors (seen stays int64)."""
        m = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
        return FalconState(m(self.S), m(self.last_k), self.seen.to(device=device), m(self.tail_x),
                           m(self.tail_v), self.variant, self.window, self.shift, self.read)

    def index_select(self, idx: torch.Tensor) -> "FalconState":
        """Keep the sequences idx (beam search, dropping finished sequences)."""
        s = lambda t: None if t is None else t.index_select(0, idx)  # noqa: E731
        return FalconState(s(self.S), s(self.last_k), self.seen.index_select(0, idx), s(self.tail_x),
                           s(self.tail_v), self.variant, self.window, self.shift, self.read)

    def numel(self) -> int:
        """Recurrent memory per batch in elements (S + last key + window tail)."""
        n = self.S[0].numel() + self.last_k[0].numel()
        if self.tail_x is not None:
            n += self.tail_x[0].numel() + self.tail_v[0].numel()
        return n
