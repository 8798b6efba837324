"""One decode step of a model captured in a CUDA graph, for fast token-by-token generation.

A recurrent model's decode state keeps its shapes from step to step, so one `model.step` can be
captured once and replayed per token: eager decoding of the small model costs ~20 ms per token on an
H200 (Python and kernel launches), a replay ~3 ms (benchmarks/results/archive/model_h200_2026-11.md). A growing KV cache
(attention) changes shape every step and cannot be captured: `check_static_step` says so.
"""
from __future__ import annotations

import dataclasses

import torch


def state_leaves(obj, out):
    """Flatten a decode state (dicts, lists, tuples, dataclasses such as FalconState) into leaves."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            state_leaves(obj[k], out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            state_leaves(v, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            state_leaves(getattr(obj, f.name), out)
    else:
        out.append(obj)
    return out


def clone_state(obj):
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: clone_state(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                           if f.init})
    return obj



class GraphStep:
    """One decode step captured in a CUDA graph; the state tensors are updated in place (the step's
    new state is copied into static buffers inside the graph). Raises RuntimeError(reason) if the
    state changes shape or holds Python values that change per step (then the graph would be wrong).

    Construction consumes `tok` once (a validated replay: the replayed logits must match an eager step
    from the same state), leaving its logits in `.logits` and the state advanced in place; then
    `feed(tokens)` consumes one token per row per replay. Proven on the H200 through the whole-model
    benchmark for Falcon-1, -1A and -2A (benchmarks/results/archive/model_h200_2026-11.md, `+graph` rows)."""

    def __init__(self, model, tok, state):
        self.model = model
        self.tok = tok.clone()
        self.state = state
        self.static = state_leaves(state, [])
        # dry run: the step must keep every tensor's shape/dtype and every non-tensor leaf
        _, new = model.step(self.tok, state)
        self._check(state_leaves(new, []))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                _, new = model.step(self.tok, state)
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            logits, new = model.step(self.tok, state)
            nl = state_leaves(new, [])
            for a, b in zip(self.static, nl):
                if torch.is_tensor(a) and a is not b:
                    a.copy_(b)
            self.logits = logits
            self.next_tok = logits.argmax(-1)
        # the replay must reproduce an eager step from the same state (else: eager, with the reason)
        ref_logits, _ = model.step(self.tok, clone_state(state))
        self.graph.replay()
        torch.cuda.synchronize()
        err = (self.logits.float() - ref_logits.float()).abs().max().item()
        scale = ref_logits.float().abs().max().item() + 1e-6
        if not err <= 2e-2 * scale:
            raise RuntimeError(f"CUDA-graph replay differs from the eager step (max abs diff {err:.3g}, "
                               f"logit scale {scale:.3g})")
        self.tok.copy_(self.next_tok)

    def _check(self, nl):
        check_static_step(self.static, nl)

    def __call__(self):
        """Greedy: replay one step and feed its argmax back (the benchmark's loop)."""
        self.graph.replay()
        self.tok.copy_(self.next_tok)

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Consume `tokens` [B] (state updated in place); returns the static logits buffer [B, V]
        (overwritten by the next replay: use or copy it before feeding again)."""
        self.tok.copy_(tokens)
        self.graph.replay()
        return self.logits


def check_static_step(old, new):
    """Raise RuntimeError(reason) unless a decode step keeps the state's structure, every tensor's
    shape/dtype and every non-tensor value (the conditions for replaying one captured step)."""
    if len(new) != len(old):
        raise RuntimeError("decode state changes structure per step")
    for a, b in zip(old, new):
        if torch.is_tensor(a) != torch.is_tensor(b):
            raise RuntimeError("decode state changes structure per step")
        if torch.is_tensor(a):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise RuntimeError(f"decode state tensor changes shape per step ({tuple(a.shape)} -> "
                                   f"{tuple(b.shape)}: a growing KV cache cannot be graph-captured)")
        elif a != b:
            raise RuntimeError(f"decode state holds a Python value that changes per step ({a!r} -> {b!r})")
