"""Falcon-3 in place in time segments, recomputed in the backward (ours; FALCON_TRITON_3_LEAN, opt-in, proven).

Falcon-3's chunk form (chunk.py, `gather=True`) runs Falcon-1's kernels over T·W pseudo-tokens: what its forward saves
for the backward (A, Wt, R per pseudo-token, the states of chunks of C / W steps) and the backward's scratch (dU, dHS,
the per-pseudo-token dv, dx, the [C, C] scratch) are W-fold, and at (16, 2048, 12, 64) its own peak is 2.92x
Falcon-1's (op_memory.py, 2290.6 against 784.5 MB; issue 15 asks for at most 2x). Here the call runs as S segments of
whole chunks along time, each through the unchanged chunk_forward / chunk_backward:

    forward:   for k = 0 .. S-1:  O_k, S_{k+1}, _ = chunk_forward(segment k, S0 = S_k)   (keeps only S_k, fp32)
    backward:  for k = S-1 .. 0:  saved_k = chunk_forward(segment k, S0 = S_k)          (the forward recomputed)
                                  grads_k, dS_k = chunk_backward(segment k, saved_k, dO_k, dS_T = dS_{k+1})

so only one segment's W-fold buffers exist at a time: gradient checkpointing at the segment boundaries, the boundary
states (S x [B, H, K, V] fp32) being the only thing saved besides the inputs. A segment reads its pair rows
t0 .. t1 + W - 2 (its W - 1 carried pairs are the previous segment's last), so the pair gradients of consecutive
segments overlap by W - 1 rows: they are summed in fp32 and rounded once. The price is the forward run twice (about
1.4x Falcon-3's fwd+bwd time at the benchmark's shapes, from the H200's fwd / fwd+bwd split) and S times the
launches. Segments: FALCON_TRITON_3_LEAN_SEGMENTS (4) of equal whole chunks (the last may be shorter); dense calls
(no cu_seqlens: Falcon-3's packed form is the host expansion) with C a multiple of W. The proven kernels run
unchanged (each segment is an ordinary call with an initial state and, but for the last, a final-state gradient).
"""

from __future__ import annotations

import torch

from .host import cdiv, env_choice

# "off" (one call over the whole sequence, the default) or "on" (Falcon-3 in place in segments, recomputed).
# Written 2026-12-05 (twenty-third session). On the H200 the same day
# (benchmarks/results/h200_logs/kernels_2026-12-05/): Falcon-3's whole check sweep passes with "on" (29/29), and in one
# process beside Falcon-1 its peak is 1207.4 / 1152.8 / 1190.5 / 1241.5 MB (op_memory.py predicted 1206.8 / 1152.8 /
# 1190.5 / 1241.3), 1.54 / 1.44 / 1.52 / 1.55x Falcon-1's 784.5 / 803.3 / 784.5 / 803.3 (2.92-2.95x with "off"), at
# 1.458 / 1.438 / 1.442 / 1.492x the GPU time of "off", at (16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64),
# (16, 2048, 6, 128). Proven; a memory mode, so "off" stays the default.
LEAN = env_choice("FALCON_TRITON_3_LEAN", "off", ("off", "on"),
                  "Falcon-3 in place: in time segments with the forward recomputed in the backward (both proven)")
LEAN_SEGMENTS = int(env_choice("FALCON_TRITON_3_LEAN_SEGMENTS", "4", ("2", "4", "8", "16"),
                               "segments of Falcon-3's memory-lean form (FALCON_TRITON_3_LEAN=on)"))


def lean_bounds(q, x, C: int, delta: bool, group: int, gather: bool, xoff: int, cu_seqlens) -> list:
    """The segments [(t0, t1), ...] (steps) of a Falcon-3 in-place call under LEAN="on", or [] for one call: the
    delta rule read in place (gather), dense, C a multiple of W, at least two segments of whole chunks."""
    if LEAN != "on" or not (delta and gather) or cu_seqlens is not None or xoff or C % group:
        return []
    Ts = q.shape[1]
    if x.shape[1] != Ts + group - 1:
        return []
    steps = C // group  # steps a chunk
    seg = cdiv(cdiv(Ts, LEAN_SEGMENTS), steps) * steps
    out = [(t0, min(t0 + seg, Ts)) for t0 in range(0, Ts, seg)]
    return out if len(out) >= 2 else []


def saved_shape(q, v, n_seg: int) -> tuple:
    """The boundary states a lean forward saves (in the slot of the per-chunk states): [S, B, H, K, V] fp32."""
    B, _, H, K = q.shape
    return (n_seg, B, H, K, v.shape[-1])


def _segment(t0: int, t1: int, W: int, q, x, v, eta, g):
    """Segment [t0, t1) as a call of its own: its steps and its pairs t0 .. t1 + W - 2 (contiguous copies; views where
    B = 1)."""
    return (q[:, t0:t1].contiguous(), x[:, t0:t1 + W - 1].contiguous(), v[:, t0:t1 + W - 1].contiguous(),
            eta[:, t0:t1].contiguous(), g[:, t0:t1].contiguous())


def lean_forward(bounds, q, x, v, eta, g, S0, *, chunk_forward, group, out_dtype=None, **kw):
    """(O, S_T, (boundary states, three empty slots)) of a Falcon-3 in-place call in segments."""
    B, Ts, H, K = q.shape
    V = v.shape[-1]
    O = torch.empty(B, Ts, H, V, dtype=out_dtype or q.dtype, device=q.device)
    starts = torch.zeros(saved_shape(q, v, len(bounds)), dtype=torch.float32, device=q.device)
    S = S0
    for k, (t0, t1) in enumerate(bounds):
        if S is not None:
            starts[k].copy_(S)
        Ok, S, _ = chunk_forward(*_segment(t0, t1, group, q, x, v, eta, g), S, group=group, out_dtype=out_dtype,
                                 lean=False, **kw)
        O[:, t0:t1] = Ok
    empty = q.new_empty(0)
    return O, S, (starts, empty, empty.clone(), empty.clone())


def lean_backward(bounds, q, x, v, eta, g, starts, dO, dST, *, chunk_forward, chunk_backward, group, need_ds0,
                  **kw):
    """(dq, dx, dv, deta, dg, dS0) of a Falcon-3 in-place call in segments, last to first, each segment's forward
    recomputed from its saved start state."""
    W = group
    dq = torch.empty_like(q)
    deta = torch.empty_like(eta)
    dg = torch.empty_like(g)
    f32 = torch.float32
    dx = torch.zeros(x.shape, dtype=f32, device=x.device)  # the pair gradients, summed over the segments in fp32
    dv = torch.zeros(v.shape, dtype=f32, device=v.device)
    dS = dST
    for k in reversed(range(len(bounds))):
        t0, t1 = bounds[k]
        seg = _segment(t0, t1, W, q, x, v, eta, g)
        _, _, saved = chunk_forward(*seg, starts[k], group=W, need_out=False, lean=False, **kw)
        gq, gx, gv, ge, gg, dS = chunk_backward(*seg, saved, dO[:, t0:t1].contiguous(), dS, group=W,
                                                need_ds0=need_ds0 or k > 0, pair_dtype=f32, lean=False, **kw)
        saved = None
        dq[:, t0:t1] = gq
        deta[:, t0:t1] = ge
        dg[:, t0:t1] = gg
        dx[:, t0:t1 + W - 1] += gx
        dv[:, t0:t1 + W - 1] += gv
    return dq, dx.to(x.dtype), dv.to(v.dtype), deta, dg, dS if need_ds0 else None
