"""The linear state passes of chunk.py split along the sequence (ours; FALCON_TRITON_LINEAR_SPLIT, proven, default).

Falcon-1A's inter-chunk recurrence (and that of the Falcon-1A scans of Falcon-3A) is linear with a scalar decay per
chunk: with u_C the chunk's log-decay and D_n = Xᵀ (e^{u_C - u} ⊙ η ⊙ V) its injection,

    S_{n+1} = e^{u_C,n} S_n + D_n ,        dH_{n-1} = e^{u_C,n} dH_n + Qᵀ (e^{ur} ⊙ dO)   (the reverse pass).

chunk.py runs it as one program per (sequence·head, state tile), sequentially over every chunk: at (1, 32768, 6, 128)
512 chunks a program, latency-bound per chunk (Falcon-1A's two passes and DU's kernel were 1.36 of its 1.88 ms on the
H200 even with the key split, kernels_2026-12-04e/call2). Here the chunks are cut into G pieces of L consecutive
chunks (fla's chunk_h_split does the same for long packed sequences), and the pass runs in three kernels:

    _fwd_state_split / _bwd_state_split   (tiles, sequences·heads, pieces): each piece from zero (the first piece
            from S0, the last backward piece from dS_T): the local states into HS / DHS, the local state at the
            piece's far end into SL, the log-decay from the piece's near end to each chunk into DC and over the
            whole piece into DL
    _split_carry  (tiles, sequences·heads): sequential over the G pieces, Z_p = e^{DL_q} Z_q + SL_q with q the
            piece before p (forward: p - 1, Z_0 = 0; reverse: p + 1, Z_{G-1} = 0), Z_p into CARRY; the last Z is
            S_T (forward) or dS_0 (reverse)
    _split_fixup  (tiles, chunks, sequences·heads): HS[n] += e^{DC[n]} CARRY[piece of n]

so the sequential chain is L + G steps instead of G·L. Every exponent is a sum of log-decays (<= 0). Falcon-2A's
passes (percol.py, PER_COL) are the same with a decay per value column: u_C, DC and DL are per column and the carry
scales the state's columns. Dense calls only (no cu_seqlens), window 1 (no Falcon-3 pseudo-tokens), the linear rule
only: Falcon-1's and -2's delta rules have a matrix transition per chunk, whose products would cost K x K per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import STATE_PROGRAMS, _state_tile_k, cdiv
from .host import env_choice

# "off" (the proven single pass, the default) or "on": split a linear pass into pieces of SPLIT_LEN chunks where it has
# at least two pieces and fewer than STATE_PROGRAMS programs (a starved GPU). Written 2026-12-04 (twenty-second
# session). On the H200 (2026-12-05, twenty-third session, 5852125, benchmarks/results/h200_logs/kernels_2026-12-05/):
# the whole sweeps of 1A, 3A and 2A pass with it (pieces of 4 chunks, 29/29 each), and in one process it is 0.949 /
# 0.957 / 0.745x (1A / 3A / 2A) the GPU time of the single pass at (1, 32768, 6, 128) and 0.999 / 1.000 / 0.918x at (4,
# 8192, 12, 64) (the B = 16 shapes never split): the default since then.
LINEAR_SPLIT = env_choice("FALCON_TRITON_LINEAR_SPLIT", "on", ("off", "on"),
                          "Falcon-1A, the 3A scans, Falcon-2A: the linear state passes split along the sequence "
                          "(both proven)")
# Chunks a piece: 32 unless FALCON_TRITON_LINEAR_SPLIT_LEN says otherwise (a check at real sizes sets a small one so
# that its rows split; the interpreter tests set this attribute to 1 or 2)
SPLIT_LEN = int(env_choice("FALCON_TRITON_LINEAR_SPLIT_LEN", "32", ("2", "4", "8", "16", "32", "64"),
                           "chunks a piece of a split linear state pass (FALCON_TRITON_LINEAR_SPLIT=on)"))


def split_pieces(NT: int, programs: int, linear: bool, dense: bool) -> int:
    """The pieces G of a state pass over NT chunks with `programs` programs (tiles x sequences·heads), or 0 for the
    single pass: LINEAR_SPLIT="on", a linear, dense, window-1 call, G >= 2 and the pass starved of programs."""
    if LINEAR_SPLIT != "on" or not (linear and dense):
        return 0
    G = cdiv(NT, SPLIT_LEN)
    return G if G >= 2 and programs < STATE_PROGRAMS else 0


@triton.jit
def _piece_start(P, HAS: tl.constexpr, AT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, NKB: tl.constexpr):
    """A piece program's ids and tile, and the state it starts from: P's (b, h) tile (S0, dS_T) if HAS and this is
    piece AT, else zero. The value block's first key tile writes its columns' decays (`first`, a [BV] mask: the
    interpreter takes no scalar in a block mask)."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    p = tl.program_id(2)
    ck, kmask, cv, vmask, smask, soff = _state_tile_k(t, K, V, BK, BV, NKB)
    bh64 = bh.to(tl.int64)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS:
        S = tl.where(p == AT, tl.load(P + bh64 * K * V + soff, mask=smask, other=0.).to(tl.float32), 0.)
    return p, bh // H, bh % H, bh64, ck, kmask, cv, vmask, smask, soff, S, (cv * 0 + t) % NKB == 0


@triton.jit
def _rows_or_cols(P, tok, rmask, vm, cv, C: tl.constexpr, BV: tl.constexpr, V: tl.constexpr, PER_COL: tl.constexpr):
    """A chunk's η or log γ as [C, BV] fp32: per value column (PER_COL, Falcon-2A) or per step, broadcast over the
    tile's columns (Falcon-1A)."""
    if PER_COL:
        out = tl.load(P + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
    else:
        out = tl.load(P + tok, mask=rmask, other=0.).to(tl.float32)[:, None] + tl.zeros([C, BV], dtype=tl.float32)
    return out


@triton.jit
def _fwd_state_split(X, VV, ETA, G, S0, HS, SL, DC, DL, T, XT, XOFF, NT, H: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NKB: tl.constexpr,
                     L: tl.constexpr, NP, HAS_S0: tl.constexpr, PREC: tl.constexpr, PER_COL: tl.constexpr):
    """Piece p (program axis 2) of the forward linear pass: chunks p·L .. p·L + L - 1 from zero (piece 0 from S0).
    PER_COL (Falcon-2A, percol.py): η and log γ per value column; else per step (chunk.py)."""
    p, b, h, bh64, ck, kmask, cv, vmask, smask, soff, S, first = _piece_start(S0, HAS_S0, 0, H, K, V, BK, BV, NKB)
    i = tl.arange(0, C)
    dsum = tl.zeros([BV], dtype=tl.float32)
    for r in range(0, L):
        n = p * L + r
        rows = n * C + i
        rmask = rows < T  # (only rows of live chunks: T <= NT·C)
        tok = (b * T + rows).to(tl.int64) * H + h
        xtok = (b * XT + XOFF + rows).to(tl.int64) * H + h
        tl.store(HS + (bh64 * NT + n) * K * V + soff, S, mask=smask & (ck * 0 + n < NT)[:, None])
        tl.store(DC + (bh64 * NT + n) * V + cv, dsum, mask=vmask & (cv * 0 + n < NT) & first)
        x = tl.load(X + xtok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
        vm = rmask[:, None] & vmask[None, :]
        v = tl.load(VV + xtok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        g = _rows_or_cols(G, tok, rmask, vm, cv, C, BV, V, PER_COL)
        u = tl.cumsum(g, 0)
        uC = tl.sum(g, 0)
        w = v * _rows_or_cols(ETA, tok, rmask, vm, cv, C, BV, V, PER_COL) * tl.exp(tl.minimum(uC[None, :] - u, 0.))
        S = S * tl.exp(uC)[None, :] + tl.dot(tl.trans(x), w.to(x.dtype), input_precision=PREC)
        dsum += uC
    tl.store(SL + (bh64 * NP + p) * K * V + soff, S, mask=smask)
    tl.store(DL + (bh64 * NP + p) * V + cv, dsum, mask=vmask & first)


@triton.jit
def _bwd_state_split(Q, G, DO, DST, DHS, SL, DC, DL, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NKB: tl.constexpr, L: tl.constexpr, NP,
                     READ_AFTER: tl.constexpr, HAS_DST: tl.constexpr, PREC: tl.constexpr, PER_COL: tl.constexpr):
    """Piece p of the reverse linear pass (chunk.py _bwd_state / percol.py _pc_bwd_state with NKB key tiles: DU is not
    touched): chunks from p·L + L - 1 down to p·L from zero (the last piece from dS_T); DHS[n] the local gradient at
    chunk n's end."""
    p, b, h, bh64, ck, kmask, cv, vmask, smask, soff, dH, first = _piece_start(DST, HAS_DST, NP - 1, H, K, V, BK, BV,
                                                                              NKB)
    i = tl.arange(0, C)
    dsum = tl.zeros([BV], dtype=tl.float32)
    for r in range(0, L):
        n = p * L + (L - 1 - r)
        rows = n * C + i
        rmask = rows < T  # (only rows of live chunks: T <= NT·C)
        tok = (b * T + rows).to(tl.int64) * H + h
        tl.store(DHS + (bh64 * NT + n) * K * V + soff, dH, mask=smask & (ck * 0 + n < NT)[:, None])
        tl.store(DC + (bh64 * NT + n) * V + cv, dsum, mask=vmask & (cv * 0 + n < NT) & first)
        q = tl.load(Q + tok[:, None] * K + ck[None, :], mask=rmask[:, None] & kmask[None, :], other=0.)
        vm = rmask[:, None] & vmask[None, :]
        do = tl.load(DO + tok[:, None] * V + cv[None, :], mask=vm, other=0.).to(tl.float32)
        g = _rows_or_cols(G, tok, rmask, vm, cv, C, BV, V, PER_COL)
        u = tl.cumsum(g, 0)
        uC = tl.sum(g, 0)
        if READ_AFTER:
            ur = u
        else:
            ur = u - g
        dH = dH * tl.exp(uC)[None, :] + tl.dot(tl.trans(q), (do * tl.exp(ur)).to(q.dtype), input_precision=PREC)
        dsum += uC
    tl.store(SL + (bh64 * NP + p) * K * V + soff, dH, mask=smask)
    tl.store(DL + (bh64 * NP + p) * V + cv, dsum, mask=vmask & first)


@triton.jit
def _split_carry(SL, DL, CARRY, OUT, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 NKB: tl.constexpr, NP, REVERSE: tl.constexpr, STORE_OUT: tl.constexpr):
    """Z over the pieces in order (REVERSE: last to first): CARRY[p] = Z before piece p, Z = Z e^{DL[p]} + SL[p] (the
    decay per value column); the final Z into OUT (S_T, or dS_0 in reverse)."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    ck, kmask, cv, vmask, smask, soff = _state_tile_k(t, K, V, BK, BV, NKB)
    bh64 = bh.to(tl.int64)
    Z = tl.zeros([BK, BV], dtype=tl.float32)
    for r in range(0, NP):
        if REVERSE:
            p = NP - 1 - r
        else:
            p = r
        tl.store(CARRY + (bh64 * NP + p) * K * V + soff, Z, mask=smask)
        dl = tl.load(DL + (bh64 * NP + p) * V + cv, mask=vmask, other=0.)
        Z = Z * tl.exp(dl)[None, :] + tl.load(SL + (bh64 * NP + p) * K * V + soff, mask=smask, other=0.)
    if STORE_OUT:
        tl.store(OUT + bh64 * K * V + soff, Z, mask=smask)


@triton.jit
def _split_fixup(HS, DC, CARRY, NT, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 NKB: tl.constexpr, L: tl.constexpr, NP, SKIP):
    """HS[n] += CARRY[n // L] e^{DC[n]} (per value column; the piece SKIP, whose carry is zero, untouched)."""
    t = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    p = n // L
    if p != SKIP:
        ck, kmask, cv, vmask, smask, soff = _state_tile_k(t, K, V, BK, BV, NKB)
        bh64 = bh.to(tl.int64)
        ptr = HS + (bh64 * NT + n) * K * V + soff
        z = tl.load(CARRY + (bh64 * NP + p) * K * V + soff, mask=smask, other=0.)
        dc = tl.load(DC + (bh64 * NT + n) * V + cv, mask=vmask, other=0.)
        tl.store(ptr, tl.load(ptr, mask=smask, other=0.).to(tl.float32) + z * tl.exp(dc)[None, :], mask=smask)


def _buffers(NSH: int, NP: int, NT: int, K: int, V: int, dev):
    """(SL, DC, DL, CARRY): the pieces' far-end states, the per-chunk and per-piece log-decays (per value column),
    the carried states."""
    f32 = torch.float32
    return (torch.empty(NSH, NP, K, V, dtype=f32, device=dev), torch.empty(NSH, NT, V, dtype=f32, device=dev),
            torch.empty(NSH, NP, V, dtype=f32, device=dev), torch.empty(NSH, NP, K, V, dtype=f32, device=dev))


def fwd_state_split(x, v, eta, g, S0, HS, ST, T, XT, xoff, NT, H, K, V, C, BK, BV, NKB, NP, prec, st,
                    per_col=False):
    """The forward linear pass in NP pieces: HS (the state at each chunk's start) and ST, as chunk.py's _fwd_state
    (per_col: percol.py's _pc_fwd_state)."""
    NSH = HS.shape[0] * H
    SL, DC, DL, CARRY = _buffers(NSH, NP, NT, K, V, x.device)
    tiles = cdiv(V, BV) * NKB
    _fwd_state_split[(tiles, NSH, NP)](x, v, eta, g, S0 if S0 is not None else eta, HS, SL, DC, DL, T, XT, xoff, NT,
                                      H, K, V, C, BK, BV, NKB, SPLIT_LEN, NP, S0 is not None, prec, per_col, **st)
    _split_carry[(tiles, NSH)](SL, DL, CARRY, ST, K, V, BK, BV, NKB, NP, False, True, **st)
    _split_fixup[(tiles, NT, NSH)](HS, DC, CARRY, NT, K, V, BK, BV, NKB, SPLIT_LEN, NP, 0, **st)


def bwd_state_split(q, g, dO, dST, DHS, DS0, T, NT, H, K, V, C, BK, BV, NKB, NP, read_after, prec, st,
                    per_col=False):
    """The reverse linear pass in NP pieces: DHS (the gradient at each chunk's end) and DS0 (if not None)."""
    NSH = DHS.shape[0] * H
    SL, DC, DL, CARRY = _buffers(NSH, NP, NT, K, V, q.device)
    tiles = cdiv(V, BV) * NKB
    _bwd_state_split[(tiles, NSH, NP)](q, g, dO, dST if dST is not None else g, DHS, SL, DC, DL, T, NT, H, K, V, C,
                                      BK, BV, NKB, SPLIT_LEN, NP, read_after, dST is not None, prec, per_col, **st)
    _split_carry[(tiles, NSH)](SL, DL, CARRY, DS0 if DS0 is not None else SL, K, V, BK, BV, NKB, NP, True,
                               DS0 is not None, **st)
    _split_fixup[(tiles, NT, NSH)](DHS, DC, CARRY, NT, K, V, BK, BV, NKB, SPLIT_LEN, NP, NP - 1, **st)
