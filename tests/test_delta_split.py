"""The host side of the split delta-rule passes (falcon_lab/kernels/triton/delta_split.py): when a call splits, and
the piece view of its streams. The kernels themselves are checked against float64 in tests/test_triton_interp.py
(the dsplit-* cases)."""

import pytest
import torch

from falcon_lab.kernels.triton import delta_split as ds


@pytest.fixture
def split_on(monkeypatch):
    monkeypatch.setattr(ds, "DELTA_SPLIT", "on")
    monkeypatch.setattr(ds, "DELTA_SPLIT_LEN", 2)


def _call(B=1, Ts=64, H=2, K=16, V=16, W=1, extra=None):
    """q, x, v as chunk.py gets them: Falcon-1 (x, v with one row a step) or Falcon-3 in place (W - 1 more pairs)."""
    q = torch.zeros(B, Ts, H, K)
    rows = Ts + (W - 1 if extra is None else extra)
    return q, torch.zeros(B, rows, H, K), torch.zeros(B, rows, H, V)


def test_pieces_only_where_the_call_allows(split_on):
    q, x, v = _call()
    assert ds.dsplit_pieces(q, x, v, 16, True, 1, False, 0, None) == 2  # 4 chunks of 16, pieces of 2
    assert ds.dsplit_pieces(q, x, v, 16, False, 1, False, 0, None) == 0  # the linear rule: state_split.py's
    assert ds.dsplit_pieces(q, x, v, 16, True, 1, False, 3, None) == 0  # a pair offset
    assert ds.dsplit_pieces(q, x, v, 16, True, 1, False, 0, torch.tensor([0, 64])) == 0  # packed
    assert ds.dsplit_pieces(q, x, v, 32, True, 1, False, 0, None) == 0  # one piece only
    q, x, v = _call(Ts=70)
    assert ds.dsplit_pieces(q, x, v, 16, True, 1, False, 0, None) == 0  # T not a multiple of the chunk
    q, x, v = _call(Ts=48)
    assert ds.dsplit_pieces(q, x, v, 16, True, 1, False, 0, None) == 0  # 3 chunks: not a multiple of the piece
    q, x, v = _call(Ts=16, W=4)  # Falcon-3 in place: 64 pseudo-tokens, 4 chunks
    assert ds.dsplit_pieces(q, x, v, 16, True, 4, True, 0, None) == 2
    q, x, v = _call(Ts=16, W=4, extra=0)  # a pair stream without its carried pairs
    assert ds.dsplit_pieces(q, x, v, 16, True, 4, True, 0, None) == 0
    q, x, v = _call(B=64, H=8, K=64, V=64)  # 512 sequences·heads: the single pass has programs enough
    assert ds.dsplit_pieces(q, x, v, 16, True, 1, False, 0, None) == 0


def test_off_never_splits(monkeypatch):
    monkeypatch.setattr(ds, "DELTA_SPLIT", "off")
    monkeypatch.setattr(ds, "DELTA_SPLIT_LEN", 2)
    q, x, v = _call()
    assert ds.dsplit_pieces(q, x, v, 16, True, 1, False, 0, None) == 0


@pytest.mark.parametrize("B", [1, 3])
def test_piece_view_of_the_streams(B):
    G, Ts, W = 4, 20, 3
    q = torch.randn(B, Ts, 2, 5)
    x = torch.randn(B, Ts + W - 1, 2, 5)
    qp = ds.piece_view(G, q)
    assert qp.shape == (B * G, Ts // G, 2, 5) and qp.data_ptr() == q.data_ptr()
    for b in range(B):
        for p in range(G):
            assert torch.equal(qp[b * G + p], q[b, p * 5:(p + 1) * 5])
    xp = ds.pair_pieces(G, x, Ts)
    XT = ds.pair_rows(G, xp, Ts)
    if B == 1:  # read in place, a row stride of Ts / G pairs a piece
        assert xp.data_ptr() == x.data_ptr() and XT == Ts // G
        flat = xp.reshape(-1, 2, 5)
        for p in range(G):
            assert torch.equal(flat[p * XT:p * XT + Ts // G + W - 1], x[0, p * 5:p * 5 + 5 + W - 1])
    else:  # a contiguous copy, each piece with its W - 1 carried pairs
        assert xp.is_contiguous() and xp.shape == (B * G, Ts // G + W - 1, 2, 5) and XT == Ts // G + W - 1
        for b in range(B):
            for p in range(G):
                assert torch.equal(xp[b * G + p], x[b, p * 5:p * 5 + 5 + W - 1])
