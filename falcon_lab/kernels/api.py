"""Public API of the Falcon operators: argument checks, varlen packing, state, backend dispatch."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from .dispatch import BACKENDS, select
from .prep import effective_window, prepare
from .spec import SPECS, FalconSpec
from .state import FalconState

STEPS = ("nlms", "direct")
LAM_MODES = ("absolute", "scaled")
READS = ("after", "before")


def _err(arg: str, msg: str) -> ValueError:
    return ValueError(f"{arg}: {msg}")


# Packed calls' cu_seqlens, checked and on the inputs' device, once per distinct tensor (ours, after fla's
# `tensor_cache` for its chunk indices). Checking a CUDA cu_seqlens reads it on the host (`tolist`), and a CPU one's
# copy to the GPU waits for its stream: either is a sync that makes the host wait for every kernel queued before it,
# and a packed model calls the op once per layer (again under recompute) with the same tensor. On the H200
# (2026-12-04, twenty-first session, `experiments/h200/varlen_bench.py`, before this cache) a packed Falcon-1A
# fwd+bwd took 3.3-3.8 ms against 1.4-1.7 ms for the same tokens in dense rows, host-bound ops whose host and GPU
# time then add instead of overlapping (our reading; the cache's effect is not yet measured there). Each entry holds
# its tensor (so that its id is not reused while cached) and `_version` (an in-place change checks it again).
_CU_CACHE: list = []
_CU_CACHE_N = 8


def _checked_cu(cu_seqlens: torch.Tensor, T: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens validated against T (start 0, end T, strictly increasing) and on `device`: from _CU_CACHE when this
    tensor, unchanged, was checked for T and device before (no host sync); under torch.compile tracing, every call."""
    tracing = torch.compiler.is_compiling()
    if not tracing:
        for t, ver, tt, dev, out in _CU_CACHE:
            if t is cu_seqlens and ver == cu_seqlens._version and tt == T and dev == device:
                return out
    cs = cu_seqlens.tolist()
    if len(cs) < 2 or cs[0] != 0 or cs[-1] != T:
        raise _err("cu_seqlens", f"must start at 0 and end at T = {T}, got {cs[:3]}...{cs[-2:]}")
    if any(b <= a for a, b in zip(cs[:-1], cs[1:])):
        raise _err("cu_seqlens", "must be strictly increasing (every sequence has >= 1 token)")
    out = cu_seqlens.to(device)
    if not tracing:
        _CU_CACHE.insert(0, (cu_seqlens, cu_seqlens._version, T, device, out))
        del _CU_CACHE[_CU_CACHE_N:]
    return out


def _check(q, k, v, beta, lam, variant, window, step, lam_mode, shift, read, eps, eps_gamma,
           initial_state, cu_seqlens, chunk_size, backend):
    if variant not in SPECS:
        raise _err("variant", f"unknown variant {variant!r}; expected one of {sorted(SPECS)}")
    if step not in STEPS:
        raise _err("step", f"unknown step {step!r}; expected one of {STEPS}")
    if lam_mode not in LAM_MODES:
        raise _err("lam_mode", f"unknown lam_mode {lam_mode!r}; expected one of {LAM_MODES}")
    if read not in READS:
        raise _err("read", f"unknown read {read!r}; expected one of {READS}")
    if not isinstance(shift, bool):
        raise _err("shift", f"must be a bool, got {shift!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise _err("window", f"must be an int >= 1, got {window!r}")
    if not (eps >= 0):
        raise _err("eps", f"must be >= 0, got {eps!r}")
    if not (0 < eps_gamma <= 1):
        raise _err("eps_gamma", f"must be in (0, 1], got {eps_gamma!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise _err("chunk_size", f"must be a positive int, got {chunk_size!r}")
    if backend not in BACKENDS:
        raise _err("backend", f"unknown backend {backend!r}; expected one of {BACKENDS}")
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("lam", lam)):
        if not isinstance(t, torch.Tensor):
            raise _err(name, f"must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise _err(name, f"must be a floating-point tensor, got {t.dtype}")
    if q.dim() != 4:
        raise _err("q", f"must be [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise _err("k", f"must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise _err("v", f"must be [B, T, H, V] with B, T, H = {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise _err("k/v", f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    Bsz, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0:
        raise _err("q", "sequence length T must be >= 1")
    per_column = SPECS[variant].per_column
    want = (Bsz, T, H, V) if per_column else (Bsz, T, H)
    if tuple(beta.shape) != want:
        kind = "[B, T, H, V] (one gain per value channel)" if per_column else "[B, T, H]"
        raise _err("beta", f"variant {variant} takes beta of shape {kind} = {want}, got {tuple(beta.shape)}")
    if tuple(lam.shape) != (Bsz, T, H):
        raise _err("lam", f"must be [B, T, H] = {(Bsz, T, H)}, got {tuple(lam.shape)}")
    n_seq = Bsz
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise _err("cu_seqlens", "must be a 1-D integer (Long) tensor [N+1]")
        if Bsz != 1:
            raise _err("cu_seqlens", f"requires the packed batch B == 1, got B = {Bsz}")
        _checked_cu(cu_seqlens, T, q.device)
        n_seq = cu_seqlens.numel() - 1
    if initial_state is not None:
        st = initial_state
        if not isinstance(st, FalconState):
            raise _err("initial_state", f"must be a FalconState, got {type(st).__name__}")
        W = effective_window(variant, window)
        mism = []
        if st.variant != variant:
            mism.append(f"variant {st.variant!r} != {variant!r}")
        if effective_window(st.variant, st.window) != W and st.variant == variant:
            mism.append(f"window {st.window} != {window}")
        if st.shift != shift:
            mism.append(f"shift {st.shift} != {shift}")
        if st.read != read:
            mism.append(f"read {st.read!r} != {read!r}")
        if tuple(st.S.shape) != (n_seq, H, K, V):
            mism.append(f"S shape {tuple(st.S.shape)} != {(n_seq, H, K, V)}")
        mism += _state_structure(st, n_seq, H, K, V, W, q)
        if mism:
            raise _err("initial_state", "incompatible with this call: " + "; ".join(mism))


def _state_structure(st, N, H, K, V, W, q) -> list:
    """What a FalconState must hold to continue this call exactly (shapes, dtypes, device)."""
    out = []
    for name, t, shape in (("last_k", st.last_k, (N, H, K)), ("seen", st.seen, (N,))):
        if not isinstance(t, torch.Tensor):
            out.append(f"{name} must be a tensor, got {type(t).__name__}")
        elif tuple(t.shape) != shape:
            out.append(f"{name} shape {tuple(t.shape)} != {shape}")
    if isinstance(st.seen, torch.Tensor) and (st.seen.is_floating_point() or st.seen.dtype == torch.bool):
        out.append(f"seen must be an integer tensor (tokens consumed), got {st.seen.dtype}")
    if W > 1:
        for name, t, d in (("tail_x", st.tail_x, K), ("tail_v", st.tail_v, V)):
            if t is None:  # allowed for a fresh start (no pairs yet: the tail is zeros); one host sync here
                if isinstance(st.seen, torch.Tensor) and bool((st.seen > 0).any()):
                    out.append(f"{name} is missing, but tokens were seen (window {W} needs the last {W - 1} pairs)")
            elif tuple(t.shape) != (N, W - 1, H, d):
                out.append(f"{name} shape {tuple(t.shape)} != {(N, W - 1, H, d)}")
    for name, t in (("S", st.S), ("last_k", st.last_k), ("seen", st.seen), ("tail_x", st.tail_x),
                    ("tail_v", st.tail_v)):
        if isinstance(t, torch.Tensor) and t.device != q.device:
            out.append(f"{name} is on {t.device}, the inputs on {q.device}")
    if isinstance(st.S, torch.Tensor) and not st.S.is_floating_point():
        out.append(f"S must be floating point, got {st.S.dtype}")
    return out


def _triton_prep(spec, W, q, *, packed: bool = False):
    """The prep of a Triton-backend call (same arguments, same CoreInputs as prep.prepare): the fused prep kernels
    (triton.prep_check; a packed call only at window 1), Falcon-3's PyTorch prep with its μ_t squarings in one
    kernel (triton.eig_check), or the PyTorch prep."""
    from .triton import eig_check, prep_check

    if prep_check(spec, window=W, dtype=q.dtype, device_type=q.device.type)[0] and (W == 1 or not packed):
        from .triton import fused_prepare

        return fused_prepare
    if eig_check(spec, window=W, device_type=q.device.type)[0]:
        from .triton.eig import top_eigvec

        return functools.partial(prepare, eigvec=top_eigvec)
    return prepare


def _packed_natively(spec, W, q, k, v, beta, lam, S0, backend, mode):
    """The Triton core for a packed batch without padding it (triton.varlen_check), or None (then it is padded)."""
    if mode == "step":
        return None
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, beta, lam, *([S0] if S0 is not None else [])))
    choice = select(spec, q, window=W, grad=grad, backend=backend)
    if choice.label != "triton":
        return None
    from .triton import varlen_check

    return choice.core if varlen_check(spec, window=W, device_type=q.device.type)[0] else None


def _falcon(q, k, v, beta, lam, *, variant, window, step, lam_mode, shift, read, eps, eps_gamma,
            initial_state, output_final_state, cu_seqlens, chunk_size, backend, mode):
    _check(q, k, v, beta, lam, variant, window, step, lam_mode, shift, read, eps, eps_gamma,
           initial_state, cu_seqlens, chunk_size, backend)
    spec = FalconSpec.from_variant(variant)
    delta, W = spec.delta, spec.window(window)
    if cu_seqlens is not None:
        st = initial_state
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        S0 = st.S.to(cd) if st is not None else None
        core = _packed_natively(spec, W, q, k, v, beta, lam, S0, backend, mode)
        if core is not None:
            cs = _checked_cu(cu_seqlens, q.shape[1], q.device)  # checked by _check: from the cache
            lengths = cs[1:] - cs[:-1]
            seen = st.seen.to(q.device) if st is not None else torch.zeros_like(lengths)
            prep = _triton_prep(spec, W, q, packed=True)  # the windowed fused prep has no packed form
            inp = prep(k, v, beta, lam, variant=variant, window=window, step=step, lam_mode=lam_mode,
                       shift=shift, eps=eps, eps_gamma=eps_gamma, seen=seen,
                       last_k=st.last_k if st is not None else None,
                       tail_x=st.tail_x if st is not None else None,
                       tail_v=st.tail_v if st is not None else None, cu_seqlens=cs)
            o, S = core(q, inp.xw, inp.vw, inp.eta, inp.g, S0, delta=delta, window=W, read_after=(read == "after"),
                        chunk_size=chunk_size, cu_seqlens=cs)
            final = None
            if output_final_state:
                tail_x = tail_v = None
                if W > 1:  # each sequence's last W-1 pair rows: its stream ends at cu[s+1] + (s+1)(W-1)
                    ends = cs[1:] + torch.arange(1, lengths.numel() + 1, device=q.device) * (W - 1)
                    tidx = ends[:, None] - (W - 1) + torch.arange(W - 1, device=q.device)
                    tail_x, tail_v = inp.xw[0, tidx], inp.vw[0, tidx]
                final = FalconState(S=S, last_k=k[0, cs[1:] - 1], seen=seen + lengths, tail_x=tail_x, tail_v=tail_v,
                                    variant=variant, window=window, shift=shift, read=read)
            return o, final
    valid = None
    lengths = None
    if cu_seqlens is not None:  # gather the packed batch into right-padded rows
        cs = cu_seqlens.to(q.device)
        lengths = cs[1:] - cs[:-1]
        n_seq, Tmax = lengths.numel(), int(lengths.max())
        ar = torch.arange(Tmax, device=q.device)
        valid = ar[None, :] < lengths[:, None]  # [N, Tmax]
        gidx = (cs[:-1, None] + ar[None, :]).clamp(max=q.shape[1] - 1)  # [N, Tmax]
        unpack = lambda t: t[0][gidx] * valid.view(*valid.shape, *([1] * (t.dim() - 2))).to(t.dtype)  # noqa: E731
        q, k, v, beta, lam = (unpack(t) for t in (q, k, v, beta, lam))
    Bsz = q.shape[0]
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    st = initial_state
    seen = st.seen.to(q.device) if st is not None else torch.zeros(Bsz, dtype=torch.long, device=q.device)
    S0 = st.S.to(cd) if st is not None else None
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, beta, lam, *([S0] if S0 is not None else [])))
    choice = select(spec, q, window=W, grad=grad, backend=backend, step=(mode == "step"))
    prep = _triton_prep(spec, W, q) if choice.label == "triton" else prepare
    inp = prep(k, v, beta, lam, variant=variant, window=window, step=step, lam_mode=lam_mode,
               shift=shift, eps=eps, eps_gamma=eps_gamma, seen=seen,
               last_k=st.last_k if st is not None else None,
               tail_x=st.tail_x if st is not None else None,
               tail_v=st.tail_v if st is not None else None, valid=valid)
    o, S = choice.core(q, inp.xw, inp.vw, inp.eta, inp.g, S0, delta=delta, window=W, read_after=(read == "after"),
                chunk_size=chunk_size)
    final = None
    if output_final_state:
        if lengths is None:
            T = q.shape[1]
            last_k = k[:, -1]
            tail_x = inp.xw[:, T:T + W - 1] if W > 1 else None
            tail_v = inp.vw[:, T:T + W - 1] if W > 1 else None
            seen_out = seen + T
        else:
            rows = torch.arange(lengths.numel(), device=q.device)
            last_k = k[rows, lengths - 1]
            if W > 1:
                tidx = lengths[:, None] + torch.arange(W - 1, device=q.device)[None, :]
                tail_x, tail_v = inp.xw[rows[:, None], tidx], inp.vw[rows[:, None], tidx]
            else:
                tail_x = tail_v = None
            seen_out = seen + lengths
        final = FalconState(S=S, last_k=last_k, seen=seen_out, tail_x=tail_x, tail_v=tail_v,
                            variant=variant, window=window, shift=shift, read=read)
    if lengths is not None:  # pack back to [1, total, H, V]
        o = o[valid][None]
    return o, final


def chunk_falcon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    variant: str,
    window: int = 4,
    step: str = "nlms",
    lam_mode: str = "absolute",
    shift: bool = True,
    read: str = "after",
    eps: float = 1e-6,
    eps_gamma: float = 1e-4,
    initial_state: Optional[FalconState] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    backend: Optional[str] = None,
    check_finite: bool = False,
) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """Chunk-parallel Falcon scan. Shapes follow fla: q, k [B, T, H, K] (normalised features
    φ(q), φ(k); k is *not* pre-shifted), v [B, T, H, V], beta [B, T, H] ([B, T, H, V] for variants
    2 and 2A), lam [B, T, H]. Returns o [B, T, H, V] in the input dtype and, when asked, the
    FalconState that continues the scan exactly. See README "Operators" for every knob.

    check_finite: refuse non-finite inputs, negative beta / lam / seen and an NLMS gain beta >= 2 (outside
    its stable range) with an error naming the argument (and the first position of a non-finite value).
    The chunked form multiplies masked (future) terms by zero inside a chunk, so a NaN/Inf at position t
    also reaches the outputs of earlier positions of its chunk (the recurrent forms stay causal); this
    mode keeps such values out instead (ours; one host sync per input, so off by default)."""
    if check_finite:
        _check_finite(q=q, k=k, v=v, beta=beta, lam=lam,
                      initial_state=initial_state.S if initial_state is not None else None)
        for name, t in (("beta", beta), ("lam", lam)):
            if bool((t < 0).any()):
                raise _err(name, f"must be >= 0 (min {float(t.min()):.3g}); a negative step or forgetting rate "
                                 "makes the state grow without bound (check_finite=True refuses it)")
        if step == "nlms" and bool((beta >= 2).any()):
            raise _err("beta", f"must be < 2 with step='nlms' (max {float(beta.max()):.3g}): the NLMS gain is "
                               "stable for 0 <= beta < 2 only (check_finite=True refuses it)")
        if initial_state is not None and bool((initial_state.seen < 0).any()):
            raise _err("initial_state", "seen must be >= 0 (tokens consumed)")
    return _falcon(q, k, v, beta, lam, variant=variant, window=window, step=step, lam_mode=lam_mode,
                   shift=shift, read=read, eps=eps, eps_gamma=eps_gamma, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                   chunk_size=chunk_size, backend=backend, mode="chunk")


def _check_finite(**tensors) -> None:
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                first = [int(i) for i in bad.nonzero()[0]]
                raise _err(name, f"holds non-finite values (first at index {first}); the chunked form would "
                                 "spread them to earlier positions of the chunk (check_finite=True refuses them)")


def naive_recurrent_falcon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    variant: str,
    window: int = 4,
    step: str = "nlms",
    lam_mode: str = "absolute",
    shift: bool = True,
    read: str = "after",
    eps: float = 1e-6,
    eps_gamma: float = 1e-4,
    initial_state: Optional[FalconState] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """Token-by-token Falcon scan in PyTorch, on any device: the float64 reference (pass float64
    inputs). Same arguments and results as chunk_falcon (fla's `naive_*` naming)."""
    return _falcon(q, k, v, beta, lam, variant=variant, window=window, step=step, lam_mode=lam_mode,
                   shift=shift, read=read, eps=eps, eps_gamma=eps_gamma, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=1,
                   backend="torch", mode="step")


def fused_recurrent_falcon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    variant: str,
    window: int = 4,
    step: str = "nlms",
    lam_mode: str = "absolute",
    shift: bool = True,
    read: str = "after",
    eps: float = 1e-6,
    eps_gamma: float = 1e-4,
    initial_state: Optional[FalconState] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """The fast recurrent step (decoding; fla's `fused_recurrent_*` naming): on CUDA, T = 1 without
    gradients, the fused Triton decode kernel where it is proven on the H200 (falcon_lab/kernels/dispatch.py
    says which); otherwise the PyTorch token recurrence. Same arguments and results as chunk_falcon."""
    return _falcon(q, k, v, beta, lam, variant=variant, window=window, step=step, lam_mode=lam_mode,
                   shift=shift, read=read, eps=eps, eps_gamma=eps_gamma, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=16,
                   backend=backend, mode="step")


# The name used before fla's naming was adopted; the float64 reference loop (kept: tests and users call it).
recurrent_falcon = naive_recurrent_falcon
