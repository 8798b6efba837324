"""`FalconLabCache`: a transformers `Cache` carrying each decoder layer's mixer state.

One `FalconLabCacheLayer` per decoder layer holds whatever that layer's mixer returned as its state:
for Falcon and the Falcon-expressed baselines `{"conv": short-conv cache, "op": FalconState}` (O(1) in
the sequence length), for attention `{"k", "v", "pos"}` (a growing KV cache). The cache never looks
inside a state beyond the batch operations of falcon_lab/hf/state.py (generate's beam reordering,
`num_return_sequences` expansion, dropping rows).

Left-padded batches: each row's prompt is run alone and the row states are stacked into one batch when
they can be (recurrent states always can); when they cannot (KV caches of different lengths) the layer
keeps a list of per-row states (`RowStates`) and each later step runs row by row.

The same object also offers fla's layer-cache interface (`cache[layer_idx]` -> dict, `cache.update(
recurrent_state=..., conv_state=..., layer_idx=..., offset=...)`), which `FalconAttention`
(falcon_lab/hf/layer.py) uses, as it uses fla's own `Cache` inside fla models.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from falcon_lab.hf.state import cat_rows, map_tensors, repeat_rows, select_rows


class RowStates(list):
    """Per-row states of one layer (a batch whose rows could not be stacked)."""


class FalconLabCacheLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = False  # a recurrent state cannot be rolled back (assisted decoding is refused)
    supports_early_init = False

    def __init__(self):
        super().__init__()
        self.state: Any = None

    def lazy_initialization(self, *args, **kwargs) -> None:
        pass

    def update(self, *args, **kwargs):
        raise NotImplementedError("FalconLabCache layers hold mixer states, not attention keys/values; "
                                  "falcon_lab's mixers update them themselves")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None

    def offload(self):
        pass

    def prefetch(self):
        pass

    def _apply(self, fn_batched, fn_rows):
        if self.state is None:
            return
        self.state = RowStates(fn_rows(list(self.state))) if isinstance(self.state, RowStates) else fn_batched(self.state)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        idx = [int(i) for i in indices.tolist()]
        self._apply(lambda s: select_rows(s, indices), lambda rows: [map_tensors(rows[i], torch.clone) for i in idx])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda s: repeat_rows(s, repeats),
                    lambda rows: [map_tensors(r, torch.clone) for r in rows for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("FalconLabCache cannot be cropped: a recurrent state cannot forget tokens")


class FalconLabCache(Cache):
    """Per-layer mixer states for `FalconLabForCausalLM.generate` (and fla-style layers)."""

    def __init__(self, num_layers: int = 0):
        super().__init__(layers=[FalconLabCacheLayer() for _ in range(int(num_layers))])
        self.seen_tokens = 0  # input positions consumed so far (padding included), what generate calls the cache length

    # -- the decoder's view ----------------------------------------------------------------------
    @property
    def is_empty(self) -> bool:
        return all(layer.state is None for layer in self.layers)

    @property
    def per_row(self) -> bool:
        return any(isinstance(layer.state, RowStates) for layer in self.layers)

    def states(self) -> list:
        """The batched per-layer states (a list, one entry per layer)."""
        return [layer.state for layer in self.layers]

    def row_states(self, row: int) -> list:
        """Row `row`'s per-layer states."""
        out = []
        for layer in self.layers:
            s = layer.state
            out.append(s[row] if isinstance(s, RowStates) else select_rows(s, torch.tensor([row])))
        return out

    def set_states(self, states: list) -> None:
        self._grow(len(states))
        for layer, s in zip(self.layers, states):
            layer.state = s

    def set_row_states(self, rows: list[list]) -> None:
        """Per-row per-layer states: stacked per layer where possible, else kept as RowStates."""
        n_layers = len(rows[0])
        self._grow(n_layers)
        for i in range(n_layers):
            per_row = [r[i] for r in rows]
            try:
                self.layers[i].state = cat_rows(per_row)
            except ValueError:  # Unmergeable (or a state structure torch.cat refuses)
                self.layers[i].state = RowStates(per_row)
        if self.per_row:  # one layer could not be stacked: keep every layer per row, so rows stay aligned
            for i in range(n_layers):
                self.layers[i].state = RowStates([r[i] for r in rows])

    def _grow(self, n: int) -> None:
        while len(self.layers) < n:
            self.layers.append(FalconLabCacheLayer())

    # -- transformers' Cache interface ----------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.seen_tokens)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return int(self.seen_tokens) + int(query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self):
        super().reset()
        self.seen_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)

    @property
    def batch_size(self) -> int:
        for layer in self.layers:
            s = layer.state
            if isinstance(s, RowStates):
                return len(s)
            for leaf in _tensor_leaves(s):
                return int(leaf.shape[0])
        return -1

    # -- fla's layer-cache interface (FalconAttention, and fla layers generally) ------------------
    def __getitem__(self, layer_idx: int):
        if layer_idx >= len(self.layers):
            raise KeyError(f"FalconLabCache has {len(self.layers)} layers, asked for layer {layer_idx}")
        return self.layers[layer_idx].state

    def __iter__(self):
        for layer in self.layers:
            yield layer.state

    def update(self, recurrent_state=None, attn_state=None, conv_state=None, ffn_state=None, layer_idx: int = 0,
               offset: int | None = 1, cache_kwargs: dict | None = None, **_):
        """fla's `Cache.update`: store this layer's states (a dict like fla's) and count `offset` new tokens
        once per step (at layer 0)."""
        if attn_state is not None:
            raise NotImplementedError("FalconLabCache.update: attn_state (a KV cache for fla attention layers) is "
                                      "not supported; use fla's Cache for fla models")
        self._grow(layer_idx + 1)
        layer = self.layers[layer_idx]
        if layer.state is None:
            layer.state = {"recurrent_state": None, "attn_state": None, "conv_state": None, "ffn_state": None}
        for key, val in (("recurrent_state", recurrent_state), ("conv_state", conv_state), ("ffn_state", ffn_state)):
            if val is not None:
                layer.state[key] = val
        if layer_idx == 0:
            self.seen_tokens += int(offset if offset is not None else 1)
        return layer.state


def _tensor_leaves(state):
    out = []
    map_tensors(state, lambda t: out.append(t) or t)
    return out
