"""The delta rule's state passes split along the sequence (ours; FALCON_TRITON_DELTA_SPLIT, proven, the default).

chunk.py's delta-rule passes (Falcon-1 and Falcon-3's in-place pseudo-tokens) are affine in the state with a matrix
per chunk: with Wt, Vt from _fwd_prep and c = e^{u_C - u} ⊙ η,

    S_{n+1} = M_n S_n + Xᵀ diag(c) Vt ,     M_n = e^{u_C} I - Xᵀ diag(c) Wt          (forward)
    dH_{n-1} = M_nᵀ dH_n + Qᵀ (e^{ur} ⊙ dO) - Wtᵀ (η ⊙ dU_intra)                       (reverse)

and run as one program per (sequence·head, value tile), sequentially over every chunk. Where that starves the GPU
(Falcon-3 at (1, 32768, 6, 128): 2048 chunks of 16 steps, 24 programs on 132 SMs; `_bwd_state` 3.70 and `_fwd_state`
2.83 of its 11.1 ms on the H200, kernels_2026-12-03h/call9) the chunks are cut into G pieces of L and the sequences
are run as B·G "sequences" of L chunks each (the piece view: a reshape of every per-step and per-pseudo-token tensor;
Falcon-3's pair stream is copied with its W - 1 rows of overlap). Three steps a pass:

    _dsplit_fwd / _dsplit_bwd  (column tiles, pieces·heads): each piece from zero (the first forward piece from S0,
            the last reverse piece from dS_T), the state columns and, as K more columns started from the identity
            with no injection, the piece's transition P_p = M_last ⋯ M_first (reverse: P_pᵀ, the same loop on the
            identity: Σ M_nᵀ applied last to first) into OUT [pieces·heads, K, V + K] (fp32). Nothing else is written.
    _dsplit_carry  (value tiles, sequences·heads): sequential over the G pieces, Z <- P_p Z + L_p: the state at each
            piece's start (reverse: the gradient at each piece's end) into CARRY, S_T (dS_0) at the end
    chunk.py's own `_fwd_state` / `_bwd_state` on the piece view, from CARRY (S0 = CARRY, dS_T = CARRY): the proven
            kernels, unchanged, write HS, R (DHS, DU) as they do for any batch

so the sequential chain is L + G + L chunks instead of G·L, for about 2x the passes' work plus K x K products per
piece. Every later kernel (read-out, backward per chunk) runs on the piece view too: HS and DHS hold the pieces'
chunks, piece-major, inside the usual [B, H, NT, K, V] buffer. Dense calls only (no cu_seqlens, no pair offset), T a
multiple of the chunk and the chunks a multiple of L; Falcon-3 needs C a multiple of W. The linear passes (Falcon-1A,
-2A, the 3A scans) have their own split (state_split.py, a scalar decay per chunk instead of M_n).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk import _gfirst, _rows_w  # chunk.py imports this module at its end, after these
from .common import _cfg, _empty, _state_tile, cdiv, state_bv
from .host import env_choice

# "off" (the single pass) or "on": split the delta rule's passes into pieces of DELTA_SPLIT_LEN chunks where the single
# pass has fewer than DSPLIT_PROGRAMS programs and the call allows it (dsplit_pieces). Written 2026-12-05 (twenty-third
# session). On the H200 the same day (benchmarks/results/h200_logs/kernels_2026-12-05/): the whole sweeps of Falcon-1
# and -3 pass with it (pieces of 2 chunks, 29/29 each; rows 1, 11, 22 of Falcon-1's and 1, 2, 5, 8, 11, 12, 15, 18, 22
# of Falcon-3's split); in one process it took Falcon-1 / -3 to 0.762 / 0.775x the GPU time of the single pass at (1,
# 32768, 6, 128) (48 programs) but to 1.076 / 1.036x at (4, 8192, 12, 64) (192 programs; then STATE_PROGRAMS = 264 was
# the bound): the default since then, bounded by one program per SM.
DELTA_SPLIT = env_choice("FALCON_TRITON_DELTA_SPLIT", "on", ("off", "on"),
                         "Falcon-1, Falcon-3 in place: the delta rule's state passes split along the sequence (both "
                         "proven)")
# Split only below this many programs of the single pass (the H200's 132 SMs; measured above)
DSPLIT_PROGRAMS = 132
# Chunks a piece (a check at real sizes sets a small one so that its rows split; the interpreter tests set 1 or 2)
DELTA_SPLIT_LEN = int(env_choice("FALCON_TRITON_DELTA_SPLIT_LEN", "32", ("1", "2", "4", "8", "16", "32", "64"),
                                 "chunks a piece of a split delta-rule state pass (FALCON_TRITON_DELTA_SPLIT=on)"))


def dsplit_pieces(q, x, v, C: int, delta: bool, group: int, gather: bool, xoff: int, cu_seqlens) -> int:
    """The pieces G of chunk.py's delta-rule passes for this call, or 0 for the single pass: DELTA_SPLIT="on", a dense
    call (no cu_seqlens, xoff 0, x and v with one row per kernel row, or Falcon-3's pair stream with C a multiple of
    W), T a multiple of C, the chunks a multiple of DELTA_SPLIT_LEN, G >= 2, and the single pass starved of programs
    (its value tiles x sequences·heads below DSPLIT_PROGRAMS, as state_bv counts them)."""
    if DELTA_SPLIT != "on" or not delta or cu_seqlens is not None or xoff:
        return 0
    B, Ts, H, K = q.shape
    V = v.shape[-1]
    if gather:
        T = Ts * group
        if C % group or x.shape[1] != Ts + group - 1 or v.shape[1] != x.shape[1]:
            return 0
    else:
        T = Ts
        if group != 1 or x.shape[1] != T or v.shape[1] != T:
            return 0
    L = DELTA_SPLIT_LEN
    if T % C or (T // C) % L or T // C // L < 2:
        return 0
    if cdiv(V, state_bv(_cfg(K, V)[1], V, B * H, q.dtype)) * B * H >= DSPLIT_PROGRAMS:
        return 0
    return T // C // L


def piece_view(G: int, t: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [B·G, T / G, ...]: piece p of sequence b is row b·G + p (a view when t is contiguous)."""
    return t.reshape(t.shape[0] * G, t.shape[1] // G, *t.shape[2:])


def pair_pieces(G: int, t: torch.Tensor, Ts: int) -> torch.Tensor:
    """Falcon-3's pair stream [B, Ts + W - 1, ...] -> [B·G, Ts / G + W - 1, ...] (a copy): piece p reads pairs
    p·Ts/G .. (p + 1)·Ts/G + W - 2, its W - 1 carried pairs and its own. With B = 1 the stream itself (contiguous),
    read with a row stride of Ts / G pairs a piece (pair_rows): the pieces' windows overlap in place, no copy."""
    t = t.contiguous()
    if t.shape[0] == 1:
        return t
    Ls, extra = Ts // G, t.shape[1] - Ts
    win = t.as_strided((t.shape[0], G, Ls + extra, *t.shape[2:]),
                       (t.stride(0), Ls * t.stride(1), t.stride(1), *t.stride()[2:]))
    # a copy (reshape alone may return the overlapping view itself where B = 1)
    return win.reshape(t.shape[0] * G, Ls + extra, *t.shape[2:]).contiguous()


def piece_streams(G: int, Ts: int, gather: bool, x, v, *steps):
    """A call's streams on the piece view: (x, v, *steps), the pair streams by pair_pieces (Falcon-3 in place) or
    piece_view (one row a step), the per-step tensors (q, η, log γ, dO) by piece_view."""
    pairs = (pair_pieces(G, t, Ts) for t in (x, v)) if gather else (piece_view(G, t) for t in (x, v))
    return (*pairs, *(piece_view(G, t) for t in steps))


def pair_rows(G: int, x: torch.Tensor, Ts: int) -> int:
    """The kernels' pair rows a piece (XT) for pair_pieces' result x: Ts / G where x is the B = 1 stream itself (one
    row; a copy has B·G >= 2), else x's rows."""
    return Ts // G if x.shape[0] == 1 else x.shape[1]


@triton.jit
def _dsplit_start(P, HAS: tl.constexpr, AT, NVT, GP, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr):
    """A piece program's ids and tile: (sequence·piece b, head h, key indices, key mask, column indices, column mask,
    the value-tile flag as a [BV] vector (the interpreter takes no scalar in a block mask), the tile it starts from,
    the columns' offsets in OUT's rows of V + K). Column tile t = program_id(0) is value columns (t < NVT) or the
    transition's K identity columns, which start at 1 on their diagonal; a value tile starts from P's state (S0, dS_T)
    of its sequence if HAS and this is piece AT, else from 0."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    ck = tl.arange(0, BK)
    kmask = ck < K
    j = tl.arange(0, BV)
    isv = (j * 0 + t) < NVT
    cc = tl.where(isv, t * BV + j, (t - NVT) * BV + j)
    cmask = tl.where(isv, cc < V, cc < K)
    S = tl.where((ck[:, None] == cc[None, :]) & (~isv)[None, :] & kmask[:, None] & cmask[None, :], 1., 0.)
    if HAS:
        m = kmask[:, None] & (cmask & isv & (j * 0 + b % GP == AT))[None, :]
        S += tl.load(P + ((b // GP) * H + h).to(tl.int64) * K * V + ck[:, None] * V + cc[None, :], mask=m,
                     other=0.).to(tl.float32)
    return b, h, ck, kmask, cc, cmask, isv, S, tl.where(isv, cc, V + cc)


@triton.jit
def _dsplit_put(OUT, S, ck, kmask, co, cmask, K: tl.constexpr, V: tl.constexpr):
    """The piece's tile into its OUT row [K, V + K] (program_id(1): piece·head)."""
    tl.store(OUT + tl.program_id(1).to(tl.int64) * K * (V + K) + ck[:, None] * (V + K) + co[None, :], S,
             mask=kmask[:, None] & cmask[None, :])


@triton.jit
def _dsplit_fwd(X, ETA, G, WT, VT, S0, OUT, T, XT, NL, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NVT, GP, HAS_S0: tl.constexpr,
                PREC: tl.constexpr, GROUP: tl.constexpr, GATHER: tl.constexpr):
    """Program (column tile, piece·head) of the piece view: the piece's NL chunks from zero (piece 0 from S0), its
    local end state and transition into OUT (as chunk.py's _fwd_state steps, with Vt's columns zero for the
    transition's)."""
    b, h, ck, kmask, cc, cmask, isv, S, co = _dsplit_start(S0, HAS_S0, 0, NVT, GP, H, K, V, BK, BV)
    i = tl.arange(0, C)
    for n in range(0, NL):
        rows, rmask, tok, xtok, stok, gmask = _rows_w(b, h, n, i, T, XT, 0, H, C, GROUP, GATHER)
        km = rmask[:, None] & kmask[None, :]
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
        dt = x.dtype
        eta = tl.load(ETA + stok, mask=rmask, other=0.).to(tl.float32)
        g = tl.load(G + stok, mask=gmask, other=0.).to(tl.float32)
        u = tl.cumsum(g, 0)
        uC = tl.sum(g, 0)
        wt = tl.load(WT + tok[:, None] * K + ck[None, :], mask=km, other=0.)
        vt = tl.load(VT + tok[:, None] * V + cc[None, :], mask=rmask[:, None] & (cmask & isv)[None, :], other=0.)
        r = vt.to(tl.float32) - tl.dot(wt, S.to(dt), input_precision=PREC)
        w = r * (eta * tl.exp(tl.minimum(uC - u, 0.)))[:, None]
        S = S * tl.exp(uC) + tl.dot(tl.trans(x), w.to(dt), input_precision=PREC)
    _dsplit_put(OUT, S, ck, kmask, co, cmask, K, V)


@triton.jit
def _dsplit_bwd(Q, X, ETA, G, WT, DO, DU, DST, OUT, T, XT, NL, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NVT, GP, HAS_DST: tl.constexpr,
                READ_AFTER: tl.constexpr, PREC: tl.constexpr, GROUP: tl.constexpr, GATHER: tl.constexpr):
    """Program (column tile, piece·head) of the piece view: the piece's NL chunks last to first from zero (the last
    piece from dS_T), as chunk.py's _bwd_state steps (DU's intra part read, nothing written), dO and DU zero for the
    identity columns: the local gradient at the piece's start and P_pᵀ into OUT."""
    b, h, ck, kmask, cc, cmask, isv, dH, co = _dsplit_start(DST, HAS_DST, GP - 1, NVT, GP, H, K, V, BK, BV)
    i = tl.arange(0, C)
    vcol = cmask & isv
    for nn in range(0, NL):
        n = NL - 1 - nn
        rows, rmask, tok, xtok, stok, gmask = _rows_w(b, h, n, i, T, XT, 0, H, C, GROUP, GATHER)
        km = rmask[:, None] & kmask[None, :]
        vm = rmask[:, None] & vcol[None, :]
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=km, other=0.)
        q = tl.load(Q + stok[:, None] * K + ck[None, :], mask=km, other=0.)
        dt = x.dtype
        eta = tl.load(ETA + stok, mask=rmask, other=0.).to(tl.float32)
        g = tl.load(G + stok, mask=gmask, other=0.).to(tl.float32)
        u = tl.cumsum(g, 0)
        uC = tl.sum(g, 0)
        if READ_AFTER:
            ur = u
        else:
            ur = u - _gfirst(g, i, GROUP)
        if GATHER:
            do = tl.load(DO + stok[:, None] * V + cc[None, :], mask=gmask[:, None] & vcol[None, :],
                         other=0.).to(tl.float32)
        else:
            do = tl.load(DO + tok[:, None] * V + cc[None, :], mask=vm, other=0.).to(tl.float32)
        du = tl.load(DU + tok[:, None] * V + cc[None, :], mask=vm, other=0.).to(tl.float32)
        du += tl.dot(x, dH.to(dt), input_precision=PREC) * tl.exp(tl.minimum(uC - u, 0.))[:, None]
        dHn = dH * tl.exp(uC) + tl.dot(tl.trans(q), (do * tl.exp(ur)[:, None]).to(dt), input_precision=PREC)
        wt = tl.load(WT + tok[:, None] * K + ck[None, :], mask=km, other=0.)
        dH = dHn - tl.dot(tl.trans(wt), (du * eta[:, None]).to(dt), input_precision=PREC)
    _dsplit_put(OUT, dH, ck, kmask, co, cmask, K, V)


@triton.jit
def _dsplit_carry(OUT, INIT, CARRY, FIN, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, GP, HAS_INIT: tl.constexpr, HAS_FIN: tl.constexpr, REVERSE: tl.constexpr,
                  PREC: tl.constexpr):
    """Program (value tile, sequence·head): over its G pieces in order (REVERSE: last to first), CARRY's piece rows
    [B·G, H, K, V] get the state at each piece's start (the gradient at each piece's end): INIT's (S0, dS_T; else 0)
    for the first piece, then Z_next = P Z + L with (L, P) the piece's OUT columns; the last Z into FIN (S_T, dS_0)."""
    t = tl.program_id(0)
    bs = tl.program_id(1)
    s = bs // H
    h = bs % H
    ck, kmask, cv, vmask, smask, soff = _state_tile(t, K, V, BK, BV)
    if HAS_INIT:
        z0 = tl.load(INIT + bs.to(tl.int64) * K * V + soff, mask=smask, other=0.).to(tl.float32)
    else:
        z0 = tl.zeros([BK, BV], dtype=tl.float32)
    first = GP - 1 if REVERSE else 0
    row = ((s * GP + first) * H + h).to(tl.int64)
    tl.store(CARRY + row * K * V + soff, z0, mask=smask)
    lo = ck[:, None] * (V + K) + cv[None, :]
    po = ck[:, None] * (V + K) + V + ck[None, :]
    pm = kmask[:, None] & kmask[None, :]
    Z = tl.load(OUT + row * K * (V + K) + lo, mask=smask, other=0.)
    for j in range(1, GP):
        if REVERSE:
            p = GP - 1 - j
        else:
            p = j
        row = ((s * GP + p) * H + h).to(tl.int64)
        tl.store(CARRY + row * K * V + soff, Z, mask=smask)
        P = tl.load(OUT + row * K * (V + K) + po, mask=pm, other=0.)
        Z = tl.dot(P, Z, input_precision=PREC) + tl.load(OUT + row * K * (V + K) + lo, mask=smask, other=0.)
    if HAS_FIN:
        tl.store(FIN + bs.to(tl.int64) * K * V + soff, Z, mask=smask)


def _carry_prec(dtype: torch.dtype) -> str:
    """The carry's fp32 products: full precision for fp32 inputs, tf32 (tensor cores) for 16-bit inputs, whose own
    passes round the state to the inputs' dtype before every product (the interpreter computes both in fp32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dsplit_forward(x, eta, g, WT, VT, S0, G: int, T: int, XT: int, NL: int, H: int, K: int, V: int, C: int, BK: int,
                   BV: int, prec: str, group: int, gather: bool, st: dict):
    """On the piece view (B·G sequences of NL chunks): the start state of every piece (CARRY [B·G, H, K, V], fp32)
    and S_T [B, H, K, V] (fp32)."""
    Bp = eta.shape[0]  # B·G (x may be the B = 1 pair stream itself)
    BGH = Bp * H
    NVT, NIT = cdiv(V, BV), cdiv(K, BV)
    dev = x.device
    OUT = _empty((BGH, K, V + K), torch.float32, dev)
    _dsplit_fwd[(NVT + NIT, BGH)](x, eta, g, WT, VT, S0 if S0 is not None else eta, OUT, T, XT, NL, H, K, V, C, BK,
                                  BV, NVT, G, S0 is not None, prec, group, gather, **st)
    CARRY = _empty((Bp, H, K, V), torch.float32, dev)
    ST = _empty((Bp // G, H, K, V), torch.float32, dev)
    _dsplit_carry[(NVT, BGH // G)](OUT, S0 if S0 is not None else eta, CARRY, ST, H, K, V, BK, BV, G, S0 is not None,
                                   True, False, _carry_prec(x.dtype), num_warps=8, num_stages=1)
    return CARRY, ST


def dsplit_backward(q, x, eta, g, WT, dO, DU, dST, need_ds0: bool, G: int, T: int, XT: int, NL: int, H: int, K: int,
                    V: int, C: int, BK: int, BV: int, read_after: bool, prec: str, group: int, gather: bool,
                    st: dict):
    """On the piece view, after DU's intra part: the gradient at every piece's end (DCARRY [B·G, H, K, V], fp32, the
    last piece's dS_T or 0) and dS_0 [B, H, K, V] (fp32; None unless need_ds0)."""
    Bp = eta.shape[0]  # B·G (x may be the B = 1 pair stream itself)
    BGH = Bp * H
    NVT, NIT = cdiv(V, BV), cdiv(K, BV)
    dev = x.device
    OUT = _empty((BGH, K, V + K), torch.float32, dev)
    _dsplit_bwd[(NVT + NIT, BGH)](q, x, eta, g, WT, dO, DU, dST if dST is not None else eta, OUT, T, XT, NL, H, K,
                                  V, C, BK, BV, NVT, G, dST is not None, read_after, prec, group, gather, **st)
    DCARRY = _empty((Bp, H, K, V), torch.float32, dev)
    DS0 = _empty((Bp // G, H, K, V), torch.float32, dev) if need_ds0 else None
    _dsplit_carry[(NVT, BGH // G)](OUT, dST if dST is not None else eta, DCARRY, DS0 if DS0 is not None else eta, H,
                                   K, V, BK, BV, G, dST is not None, need_ds0, True, _carry_prec(x.dtype),
                                   num_warps=8, num_stages=1)
    return DCARRY, DS0
