"""What every Triton kernel family here shares (in the spirit of fla's `ops/common/`, ours): the launch helper on the
host and the pieces of the chunk kernels on the device.

Host:   `launch(q, v, C, allow_tf32)` -> `Launch` (shapes, chunk count, tile sizes, dot precision, pipeline stages,
        device) for one call of a family's forward or backward; `_empty` (NaN-poisoned under FALCON_TRITON_POISON=1
        for the GPU checks); the tile and precision rules `_cfg`, `_prec`, `_stages`.
Varlen: `varlen(cu_seqlens, T, C)` -> `Varlen` (per-chunk program -> (sequence, chunk), each sequence's first chunk
        slot) on the host; `_varlen_chunk`, `_varlen_seq` on the device, after which a kernel moves its token pointers
        to the sequence's first token and runs as for one sequence of its length.
Device: the token offsets of a chunk's rows (`_chunk_rows`), the [BK, BV] tile of a (b, h) state (`_state_tile`),
        a state read at the start of a sequential pass (`_state_init`: S0 or dS_T or zeros) and the per-chunk states
        it writes (`_state_put`: HS forward, DHS backward). Triton inlines them, so a kernel composed of them compiles
        to the same code as the same lines written out (experiments/h200/ptx_fingerprint.py checks this).

Layouts (docs/kernel-contract.md): token rows (b*T + t)*H + h times K or V; states (b*H + h)*K*V; per-chunk states
((b*H + h)*NT + n)*K*V. A pair stream longer than T (window composition) is read at rows b*XT + XOFF + t.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .host import cdiv, env_choice, env_value, next_pow2  # noqa: F401  (cdiv, next_pow2 re-exported)

# Debug aid for the GPU checks: allocate outputs filled with NaN so unwritten elements show.
POISON = env_choice("FALCON_TRITON_POISON", "0", ("0", "1"),
                    "1: outputs allocated NaN-filled (GPU checks: unwritten elements show)") == "1"
FP32_DOT = env_choice("FALCON_TRITON_FP32_DOT", "tf32x3", ("tf32x3", "ieee", "tf32"),
                      "fp32 inputs' dot precision (see _prec; K or V <= 16 and the interpreter use 'ieee')")


def _empty(shape, dtype, device):
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _np2(n: int) -> int:
    return max(16, next_pow2(int(n)))


def _cfg(K: int, V: int):
    """Tile sizes (ours): the whole key dimension in one tile, value blocks of BV columns."""
    BK = _np2(K)
    BV_state = 64 if BK <= 64 else 32
    BV_out = min(64, _np2(V))
    BV_main = 64 if BK <= 64 else 32
    warps_main = 8  # five [C, BK]/[C, C] fp32 accumulators live in the value loop
    return BK, min(BV_state, _np2(V)), BV_out, min(BV_main, _np2(V)), warps_main


# The state passes' value tile (ours): "auto" (the default) halves _cfg's while the pass would have fewer than
# STATE_PROGRAMS programs (one per value tile and (sequence, head), each sequential over its chunks), down to 16 (32
# for fp32); "off" keeps _cfg's; a power of two (16 ... 128) sets it. Why: on the H200 Falcon-1 matched fla at B = 16
# and was 1.32x / 1.42x at (4, 8192, 12, 64) / (1, 32768, 6, 128), where its state passes ran 48 / 24 programs on
# 132 SMs (benchmarks/results/h200_logs/kernels_2026-12-02f/). Measured there on 2026-12-03 (5bb2636, same process
# order, bf16 fwd+bwd): Falcon-1 3.65 -> 3.12 ms at (1, 32768, 6, 128), 2.23 -> 2.13 ms at (4, 8192, 12, 64), the
# B = 16 shapes unchanged; Falcon-1A 2.75 -> 2.39 ms and Falcon-3A 13.7 -> 12.4 ms at T = 32768; all 34 rows of
# `bench check --quick --variants 1,1A,3A,3` passed with it (benchmarks/results/h200_logs/kernels_2026-12-03/).
STATE_BV = env_value("FALCON_TRITON_STATE_BV", "auto",
                     "the state passes' value tile: auto, off or 16-128 (auto proven)")
STATE_PROGRAMS = 264


def state_bv(bv: int, V: int, n_seq_heads: int, dtype: torch.dtype) -> int:
    """The state passes' value tile for a call (see STATE_BV): bv from _cfg, n_seq_heads = sequences x heads."""
    if STATE_BV == "off":
        return bv
    if STATE_BV != "auto":
        want = int(STATE_BV)
        if want not in (16, 32, 64, 128):
            raise ValueError(f"FALCON_TRITON_STATE_BV must be 16, 32, 64, 128, auto or off, got {STATE_BV!r}")
        return min(want, _np2(V))
    floor = 32 if dtype == torch.float32 else 16
    while bv > floor and cdiv(V, bv) * n_seq_heads < STATE_PROGRAMS:
        bv //= 2
    return bv


# The linear (no delta) state passes over key tiles too (ours, written 2026-12-04, twenty-first session): "scalar" (the
# default since that session) splits chunk.py's _fwd_state / _bwd_state for Falcon-1A (and the Falcon-1A scans of
# Falcon-3A's delayed form and of its W scans) into NKB key tiles of BK >= KSPLIT_MIN_BK columns while a pass would
# have fewer than STATE_PROGRAMS programs, then halves the value tile as "auto" does (with NKB x the programs); "on"
# does the same for Falcon-2A's per-column passes (percol.py); "off" keeps the whole key width in one tile (the proven
# form before). The linear update S = γ S + xᵀ (η v) (and its adjoint dH = γ dH + qᵀ (dO e^u)) never mixes key rows,
# so a key tile is a sequential pass of its own. Its one cross-row term, the state part of DU (x · dH, a sum over all
# keys), moves out of the sequential loop: into _bwd_dul_state (chunk.py), a per-chunk kernel that reads DHS after the
# pass, and into percol's _pc_bwd_main, which forms x · dH anyway. Falcon-1's delta rule needs all keys per step.
# Why: at (1, 32768, 6, 128) Falcon-1A's two state passes were 1.66 of its 2.4 ms on the H200 (80e1747 profile; 24-48
# programs on 132 SMs, each 512 chunks long). On the H200 (torch 2.11, Triton 3.6, 93a6914; benchmarks/results/
# h200_logs/kernels_2026-12-04e/call2/) with "on": all 29 rows of `bench check` for each of 1A, 3A and 2A pass
# (NaN-poisoned, bf16 + fp32, K = 16/64/128, every chunk size, the public op with ragged cu_seqlens, the varlen-native
# rows, CUDA-graph decode); in one process (switch_ab.py, 2 rounds, GPU time, against "off") Falcon-1A 0.969 / 0.874 /
# 0.971 / 0.999x and Falcon-3A 0.978 / 0.896 / 0.983 / 1.001x at 16x2048x12x64, 1x32768x6x128, 4x8192x12x64,
# 16x2048x6x128, but Falcon-2A 1.029 / 0.996 / 0.968 / 1.001x: hence "scalar".
LINEAR_KSPLIT = env_choice("FALCON_TRITON_LINEAR_KSPLIT", "scalar", ("off", "scalar", "on"),
                           "the linear state passes also split over key tiles: Falcon-1A / 3A (scalar), and 2A (on); "
                           "all proven")
KSPLIT_MIN_BK = 32  # the smallest key tile "on" makes (tests lower it to 16 to split K = 32)


def linear_state_tiles(bk: int, bv: int, K: int, V: int, n_seq_heads: int, dtype: torch.dtype) -> tuple:
    """(BK, BV, NKB) of a linear (no delta) state pass: bk, bv from _cfg; NKB key tiles (LINEAR_KSPLIT), then the
    value tile of state_bv with NKB x the programs. NKB = 1 is the whole key width (the kernels' proven form)."""
    if LINEAR_KSPLIT in ("scalar", "on"):
        while bk // 2 >= KSPLIT_MIN_BK and cdiv(V, bv) * cdiv(K, bk) * n_seq_heads < STATE_PROGRAMS:
            bk //= 2
    nkb = cdiv(K, bk)
    return bk, state_bv(bv, V, n_seq_heads * nkb, dtype), nkb


# The sequential state passes' launch (ours, opt-in, for measurement; chunk.py's _fwd_state and _bwd_state):
# FALCON_TRITON_STATE_STAGES, the software-pipeline depth: "" (the default) leaves Triton's (3 stages for 16-bit
# inputs; fp32 keeps 1, _stages), 1-4 sets num_stages for 16-bit inputs; FALCON_TRITON_STATE_WARPS: "" (the default,
# Triton's 4) or 1, 2, 4, 8 warps. Why: on the H200 Falcon-1's state passes took 0.74 / 0.89 ms against 0.52 / 0.67
# for fla's fwd_h / dhu at (1, 32768, 6, 128) (2026-12-03), and fla autotunes its fwd_h over 2 and 4 warps and 2-4
# stages (its table for that shape in .tcache: 0.58 ms with 3 stages, 0.515 with 4; dhu 0.96 with 2, 0.67 with 3).
# Measured on 2026-12-03 (c84b0ad): 4 stages out of shared memory at K = 128, no faster elsewhere; warps not yet.
STATE_STAGES = env_value("FALCON_TRITON_STATE_STAGES", "",
                         "the state passes' pipeline stages, 16-bit inputs: '' (Triton's) or 1-4",
                         ("", "1", "2", "3", "4"))
if STATE_STAGES not in ("", "1", "2", "3", "4"):
    raise ValueError(f"FALCON_TRITON_STATE_STAGES must be empty or 1-4, got {STATE_STAGES!r}")
STATE_WARPS = env_value("FALCON_TRITON_STATE_WARPS", "", "the state passes' warps: '' (Triton's 4) or 1, 2, 4, 8",
                        ("", "1", "2", "4", "8"))
if STATE_WARPS not in ("", "1", "2", "4", "8"):
    raise ValueError(f"FALCON_TRITON_STATE_WARPS must be empty, 1, 2, 4 or 8, got {STATE_WARPS!r}")


def state_opts(st: dict) -> dict:
    """The compile options of a sequential state pass: the call's (`Launch.st`), with num_stages from STATE_STAGES for
    a 16-bit call (fp32 keeps its 1 stage: 3 overflowed shared memory at K = 128) and num_warps from STATE_WARPS."""
    if STATE_STAGES and "num_stages" not in st:
        st = {**st, "num_stages": int(STATE_STAGES)}
    if STATE_WARPS:
        st = {**st, "num_warps": int(STATE_WARPS)}
    return st


def _prec(dtype: torch.dtype, allow_tf32: bool, device: torch.device, K: int = 0, V: int = 0) -> str:
    """Dot precision for fp32 operands (16-bit operands ignore it). Default (ours): "tf32x3", the
    three-pass split-TF32 product on tensor cores, which keeps fp32-level accuracy; plain "ieee" FMA
    dots are available (FALCON_TRITON_FP32_DOT=ieee) but took minutes of ptxas time per kernel set on
    the H200 (Triton 3.6). "tf32" only when asked (allow_tf32). The interpreter always uses "ieee".
    Where K or V is <= 16 (ours): "ieee" instead of "tf32x3". On the H200 (Triton 3.6, 2026-12-02) the tf32x3
    builds of that size went wrong where nothing else did: compute-sanitizer found a 256-byte shared-memory read
    out of bounds in chunk.py's _bwd_main (the x·dH dot, fp32, K = V = 16, C = 64, Falcon-3 with its pseudo-tokens
    read in place: an illegal memory access), the banded Falcon-3A's gradients at the same shape were 9 % off,
    and both passed with "ieee" (benchmarks/results/h200_logs/kernels_2026-12-02f/). Small tiles compile fast."""
    if dtype != torch.float32:
        return "tf32"
    if allow_tf32:
        return "tf32"
    if device.type == "cpu":
        return "ieee"
    sizes = [d for d in (K, V) if d]
    if FP32_DOT == "tf32x3" and sizes and min(sizes) <= 16:
        return "ieee"
    return FP32_DOT


def _stages(dtype: torch.dtype) -> dict:
    # fp32 tiles of K=128 overflowed the 227 KB of shared memory with 3 pipeline stages (measured)
    return {"num_stages": 1} if dtype == torch.float32 else {}


class Launch(NamedTuple):
    """One family call's geometry and compile options (ours): q [B, T, H, K], values [.., V], chunk C."""
    B: int
    T: int
    H: int
    K: int
    V: int
    NT: int        # chunks
    BK: int        # the key tile (all of K)
    BVs: int       # value tile of the sequential state passes
    BVo: int       # value tile of the per-chunk read-out kernels
    BVm: int       # value tile of the per-chunk backward kernels
    warps: int     # warps of the per-chunk backward kernels
    prec: str      # dot precision for fp32 operands
    st: dict       # num_stages, where the dtype needs it
    dev: torch.device


class Varlen(NamedTuple):
    """Packed sequences (B = 1, tokens of sequence s at cu[s] .. cu[s+1]-1) as the kernels read them (fla's
    `prepare_chunk_indices` in spirit; the layout is ours): every tensor here is made on q's device from cu_seqlens
    with shapes known from T, N and C alone, so nothing waits for the GPU and torch.compile sees static shapes."""
    cu: torch.Tensor    # [N+1] int32 token offsets
    cidx: torch.Tensor  # [NT, 2] int32 (sequence, chunk in it) of each per-chunk program; (-1, 0) past the last
    coff: torch.Tensor  # [N+1] int32 index of each sequence's first chunk among the NT slots
    N: int
    NT: int             # chunk slots: an upper bound of Σ ceil(len_s / C)


def varlen_chunks(T: int, N: int, C: int) -> int:
    """Chunk slots for N packed sequences of T tokens in all: Σ ceil(l/C) <= (T + N(C-1)) / C, and <= T."""
    return max(1, min(T, (T + N * (C - 1)) // C))


def varlen(cu_seqlens: torch.Tensor, T: int, C: int) -> Varlen:
    cu = cu_seqlens.to(torch.int32).contiguous()
    N = cu.numel() - 1
    NT = varlen_chunks(T, N, C)
    lens = cu[1:] - cu[:-1]
    coff = torch.cat([cu.new_zeros(1), torch.cumsum((lens + C - 1) // C, 0, dtype=torch.int32)])
    j = torch.arange(NT, device=cu.device, dtype=torch.int32)
    seq = torch.searchsorted(coff[1:], j, right=True).to(torch.int32)  # the sequence whose chunks hold slot j
    ok = seq < N
    n = j - coff[seq.clamp(max=N - 1)]
    cidx = torch.stack([torch.where(ok, seq, -1), torch.where(ok, n, 0)], 1).to(torch.int32).contiguous()
    return Varlen(cu, cidx, coff, N, NT)


def varlen_args(cu_seqlens, q, T: int, C: int, NT: int, B: int, group: int = 1, xoff: int = 0):
    """(the kernels' packed-sequence arguments CU, CIDX, COFF, VARLEN; chunk slots; state rows) for one family call:
    with cu_seqlens the packed plan (`varlen`), the slots of its chunks and one state per sequence; without, dummy
    pointers (q, never read), NT and B unchanged."""
    if cu_seqlens is None:
        return (q, q, q, False), NT, B
    if group != 1 or B != 1:
        raise ValueError("packed sequences (cu_seqlens) run on a batch of 1 (B = 1), without Falcon-3's pseudo-tokens "
                         "read in place (its host expansion packs them)")
    vl = varlen(cu_seqlens, T, C)
    return (vl.cu, vl.cidx, vl.coff, True), vl.NT, vl.N


def launch(q: torch.Tensor, V: int, C: int, allow_tf32: bool, T: int = 0) -> Launch:
    """T: the rows the kernels run over, if not q's (Falcon-3's pseudo-tokens gathered in the kernels)."""
    B, Tq, H, K = q.shape
    T = T or Tq
    prec = _prec(q.dtype, allow_tf32, q.device, K, V)
    return Launch(B, T, H, K, V, cdiv(T, C), *_cfg(K, V), prec, _stages(q.dtype), q.device)


# ------------------------------------------------------------------------------------------------
# device pieces
# ------------------------------------------------------------------------------------------------
@triton.jit
def _chunk_rows(b, h, n, i, T, XT, XOFF, H: tl.constexpr, C: tl.constexpr):
    """Chunk n of sequence b, head h, with i = tl.arange(0, C) (made by the kernel, once): (rows, row mask, token
    offsets of the step stream, token offsets of the pair stream read at XOFF in sequences of XT rows; unused
    results cost nothing, Triton drops them)."""
    rows = n * C + i
    rmask = rows < T
    tok = (b * T + rows).to(tl.int64) * H + h
    xtok = (b * XT + XOFF + rows).to(tl.int64) * H + h
    return rows, rmask, tok, xtok


@triton.jit
def _varlen_chunk(CU, CIDX, COFF, j):
    """Per-chunk program j over packed sequences (see `varlen`): (sequence, chunk n in it, its first token (int64),
    its length, its first chunk's slot (int64)). A slot past the last chunk reads as an empty chunk of sequence 0:
    every row masked, its state slot 0 (a real one) read and nothing written."""
    s = tl.load(CIDX + 2 * j)
    n = tl.load(CIDX + 2 * j + 1)
    ok = s >= 0
    s = tl.where(ok, s, 0)
    bos = tl.load(CU + s)
    Tn = tl.where(ok, tl.load(CU + s + 1) - bos, 0)
    return s, n, bos.to(tl.int64), Tn, tl.load(COFF + s).to(tl.int64)


@triton.jit
def _varlen_seq(CU, COFF, s, C: tl.constexpr):
    """Sequence s of a packed batch for a sequential pass: (first token (int64), length, chunks, first chunk's slot
    (int64))."""
    bos = tl.load(CU + s)
    Tn = tl.load(CU + s + 1) - bos
    return bos.to(tl.int64), Tn, tl.cdiv(Tn, C), tl.load(COFF + s).to(tl.int64)


@triton.jit
def _state_tile(vb, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Value block vb of a [K, V] state as a [BK, BV] tile: (key indices, key mask, value indices, value mask,
    tile mask, offsets inside one state)."""
    ck = tl.arange(0, BK)
    kmask = ck < K
    cv = vb * BV + tl.arange(0, BV)
    vmask = cv < V
    smask = kmask[:, None] & vmask[None, :]
    soff = ck[:, None] * V + cv[None, :]
    return ck, kmask, cv, vmask, smask, soff


@triton.jit
def _state_tile_k(p, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NKB: tl.constexpr):
    """_state_tile for a pass split over NKB key tiles (linear_state_tiles): program p is key tile p % NKB of value
    block p // NKB."""
    ck = (p % NKB) * BK + tl.arange(0, BK)
    kmask = ck < K
    cv = (p // NKB) * BV + tl.arange(0, BV)
    vmask = cv < V
    smask = kmask[:, None] & vmask[None, :]
    soff = ck[:, None] * V + cv[None, :]
    return ck, kmask, cv, vmask, smask, soff


@triton.jit
def _state_init(P, bh64, soff, smask, HAS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    """The fp32 tile a sequential pass starts from: P's (b, h) state if HAS (S0 forward, dS_T backward), else 0."""
    if HAS:
        S = tl.load(P + bh64 * K * V + soff, mask=smask, other=0.).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    return S


@triton.jit
def _state_put(P, S, bh64, n, NT, soff, smask, K: tl.constexpr, V: tl.constexpr):
    """Store the tile as chunk n's state (HS: the state at the chunk's start; DHS: the gradient at its end)."""
    tl.store(P + (bh64 * NT + n) * K * V + soff, S, mask=smask)


@triton.jit
def _state_get(P, bh, n, NT, soff, smask, K: tl.constexpr, V: tl.constexpr):
    """Chunk n's stored state tile (what _state_put wrote)."""
    return tl.load(P + (bh.to(tl.int64) * NT + n) * K * V + soff, mask=smask, other=0.)
