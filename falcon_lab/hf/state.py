"""Batch operations on the mixers' decoding states, whatever their structure.

A mixer's state is a tree of dicts / lists / tuples / dataclasses (FalconState) whose tensor leaves
are batch-first (FalconState.S [N, H, K, V], .seen [N]; the short-conv cache [N, K-1, C]; attention's
K/V [N, H, T, d]) and whose other leaves (variant names, attention's position counter) are shared
by the whole batch. These helpers select, repeat and concatenate rows of such trees, so the cache and
the fla-style layer need to know nothing about any particular mixer. Torch only (no transformers).
"""
from __future__ import annotations

import dataclasses

import torch


class Unmergeable(ValueError):
    """Row states that cannot be stacked into one batch (e.g. KV caches of different lengths)."""


def map_tensors(state, fn):
    """The same tree with `fn` applied to every batch-first tensor leaf (0-dim tensors are kept)."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return fn(state) if state.dim() > 0 else state
    if isinstance(state, dict):
        return {k: map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(map_tensors(v, fn) for v in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return dataclasses.replace(state, **{f.name: map_tensors(getattr(state, f.name), fn)
                                             for f in dataclasses.fields(state) if f.init})
    return state


def select_rows(state, idx: torch.Tensor):
    """Rows `idx` of every tensor leaf (beam reordering, dropping finished rows, one row of a batch)."""
    return map_tensors(state, lambda t: t.index_select(0, idx.to(t.device)))


def repeat_rows(state, n: int):
    """Each row repeated `n` times in place (row0, row0, row1, row1, ...), as generate expands a batch."""
    return map_tensors(state, lambda t: t.repeat_interleave(n, dim=0))


def cat_rows(states: list):
    """Stack row states (each with batch size >= 1) into one batch. Raises Unmergeable where they differ
    in anything but the batch dimension."""
    first = states[0]
    if first is None:
        if any(s is not None for s in states):
            raise Unmergeable("some rows have a state and some none")
        return None
    if isinstance(first, torch.Tensor):
        if not all(isinstance(s, torch.Tensor) for s in states):
            raise Unmergeable("a tensor leaf is missing in some rows")
        if first.dim() == 0:
            if not all(bool(torch.equal(s, first)) for s in states):
                raise Unmergeable("rows differ in a scalar tensor leaf")
            return first
        if any(s.shape[1:] != first.shape[1:] or s.dtype != first.dtype for s in states):
            raise Unmergeable(f"rows differ in shape beyond the batch dimension: {[tuple(s.shape) for s in states]}")
        return torch.cat(states, dim=0)
    if isinstance(first, dict):
        if any(not isinstance(s, dict) or s.keys() != first.keys() for s in states):
            raise Unmergeable("rows have different state keys")
        return {k: cat_rows([s[k] for s in states]) for k in first}
    if isinstance(first, (list, tuple)):
        if any(type(s) is not type(first) or len(s) != len(first) for s in states):
            raise Unmergeable("rows have different state lengths")
        return type(first)(cat_rows(list(vals)) for vals in zip(*states))
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        if any(type(s) is not type(first) for s in states):
            raise Unmergeable("rows have different state types")
        return dataclasses.replace(first, **{f.name: cat_rows([getattr(s, f.name) for s in states])
                                             for f in dataclasses.fields(first) if f.init})
    if any(s != first for s in states):
        raise Unmergeable(f"rows differ in a non-tensor leaf ({first!r} vs others)")
    return first


def contiguous_span(mask_row: torch.Tensor) -> tuple[int, int]:
    """(start, end) of the ones of a 0/1 row that must be one contiguous block (left or right padding)."""
    nz = torch.nonzero(mask_row, as_tuple=False).flatten()
    if nz.numel() == 0:
        return 0, 0
    s, e = int(nz[0]), int(nz[-1]) + 1
    if e - s != nz.numel():
        raise ValueError("attention_mask: the tokens of a row must be contiguous (left or right padding only)")
    return s, e
