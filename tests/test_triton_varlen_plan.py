"""The host side of native packed sequences (falcon_lab/kernels/triton/common.py `varlen`, `varlen_check`): which
chunk each per-chunk program runs, each sequence's first chunk slot, and when a call is run natively or padded.
The kernels themselves are checked against float64 under the interpreter (test_triton_interp.py, varlen-native-*)."""
import pytest
import torch

from falcon_lab.kernels.spec import FalconSpec
from falcon_lab.kernels.triton import PROVEN_VARLEN, varlen_check
from falcon_lab.kernels.triton.common import varlen, varlen_chunks


@pytest.mark.parametrize("lens,C", [([1, 15, 16, 17, 53], 16), ([64], 64), ([1] * 9, 32), ([100, 1, 28], 16),
                                    ([2048, 517, 1], 64)])
def test_chunk_plan_covers_every_chunk_once(lens, C):
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    T = int(cu[-1])
    p = varlen(cu, T, C)
    want = [(s, n) for s, n_tok in enumerate(lens) for n in range(-(-n_tok // C))]
    got = [tuple(r) for r in p.cidx.tolist()]
    assert got[:len(want)] == want  # slot j runs chunk j of the packed batch, in order
    assert all(r == (-1, 0) for r in got[len(want):])  # the rest: empty programs
    assert p.NT == varlen_chunks(T, len(lens), C) >= len(want) and p.NT <= T
    assert p.coff.tolist() == [sum(-(-m // C) for m in lens[:s]) for s in range(len(lens) + 1)]
    assert p.cu.dtype == p.cidx.dtype == p.coff.dtype == torch.int32


def test_the_chunk_bound_is_tight_for_worst_case_lengths():
    """Σ ceil(l/C) reaches the bound when every sequence is one token past a chunk boundary."""
    C, lens = 16, [17] * 7
    T = sum(lens)
    assert varlen_chunks(T, len(lens), C) == sum(-(-m // C) for m in lens) == 14


def test_which_calls_run_natively():
    import falcon_lab.kernels.triton as kt

    one, two_a, three, three_a = (FalconSpec.from_variant(v) for v in ("1", "2A", "3", "3A"))
    assert varlen_check(one, window=1, device_type="cpu")[0] and varlen_check(two_a, window=1, device_type="cpu")[0]
    assert varlen_check(three, window=4, device_type="cpu")[0]  # its host expansion, packed
    # Falcon-3A: natively under either FALCON_TRITON_3A and FALCON_TRITON_3A_PACKED (core runs a packed call as its
    # banded scan, the packed default since 2026-12-04, or as the W scans); never padded for it
    prev, prev_packed = kt._FALCON_3A, kt._FALCON_3A_PACKED
    try:
        for mode, packed, how in (("banded", "banded", "banded scan"), ("banded", "scans", "W scans"),
                                  ("scans", "banded", "W scans"), ("scans", "scans", "W scans"),
                                  ("delayed", "banded", "banded scan"), ("delayed", "scans", "W scans"),
                                  ("delayed", "delayed", "delayed form"), ("banded", "delayed", "delayed form"),
                                  ("scans", "delayed", "W scans")):
            kt._FALCON_3A, kt._FALCON_3A_PACKED = mode, packed
            ok, why = varlen_check(three_a, window=4, device_type="cpu")
            assert ok and how in why, (mode, packed, why)
            assert varlen_check(three, window=4, device_type="cpu")[0]  # the 3A switch is not Falcon-3's
    finally:
        kt._FALCON_3A, kt._FALCON_3A_PACKED = prev, prev_packed
    # Falcon-3: natively on its expansion under either FALCON_TRITON_3, the in-place default included (core runs a
    # packed call on the expansion: the in-place pseudo-tokens have no packed form); never padded for it
    in_place = kt._FALCON_3
    try:
        for mode in ("gather", "expand"):
            kt._FALCON_3 = mode
            ok, why = varlen_check(three, window=4, device_type="cpu")
            assert ok and "expansion" in why, (mode, why)
    finally:
        kt._FALCON_3 = in_place
    ok, why = varlen_check(one, window=1, device_type="cuda")
    assert ok == ("1" in PROVEN_VARLEN), why  # on CUDA only once proven there (or FALCON_TRITON_UNPROVEN=1)
    if not ok:
        assert "not proven on the H200" in why and "FALCON_TRITON_UNPROVEN=1" in why
    assert varlen_check(three_a, window=4, device_type="cuda")[0] == ("3A" in PROVEN_VARLEN or kt._UNPROVEN)


def test_a_packed_falcon_3a_call_follows_the_packed_switch(monkeypatch):
    """With FALCON_TRITON_3A=banded (the default) `core` takes the banded kernel for an unpacked Falcon-3A call and, for
    a packed one (as the public op calls it when varlen_check says native), the banded kernel reading cu_seqlens under
    FALCON_TRITON_3A_PACKED=banded (the default 2026-12-04, nineteenth to twentieth session; the delayed form since) or
    the W scans reading them under =scans; the scans
    too for a window the banded kernel does not take (W > 16). The kernel families are stubbed: which family each call
    launched, with which cu_seqlens, no kernels."""
    import falcon_lab.kernels.triton as kt

    calls = []

    def fake_chunk_core(q, xw, vw, eta, g, S0, family, cfg, cu_seqlens=None):
        calls.append((family, cu_seqlens is not None))
        B, T, H, _ = q.shape
        return torch.zeros(B, T, H, vw.shape[-1]), torch.zeros(B if cu_seqlens is None else cu_seqlens.numel() - 1, H,
                                                                 q.shape[-1], vw.shape[-1])
    monkeypatch.setattr(kt, "chunk_core", fake_chunk_core)
    monkeypatch.setattr(kt, "_INTERPRET", True)  # CPU tensors: past core's interpreter check (nothing is launched)
    monkeypatch.setattr(kt, "_FALCON_3A", "banded")
    monkeypatch.setattr(kt, "_FALCON_3A_PACKED", "banded")

    def run(W, cu=None, **kw):
        calls.clear()
        T, H, K = 20, 2, 16
        n = 1 if cu is None else cu.numel() - 1
        q = torch.randn(1, T, H, K)
        xw, vw = torch.randn(1, T + n * (W - 1), H, K), torch.randn(1, T + n * (W - 1), H, K)
        eta, g = torch.rand(1, T, H), -torch.rand(1, T, H)
        kt.core(q, xw, vw, eta, g, None, delta=False, window=W, read_after=True, chunk_size=16, cu_seqlens=cu, **kw)
        return list(calls)

    cu = torch.tensor([0, 7, 20])
    assert run(4) == [("window_linear", False)]  # the banded default, unpacked
    assert run(4, cu) == [("window_linear", True)]  # packed: the banded scan, natively
    monkeypatch.setattr(kt, "_FALCON_3A_PACKED", "scans")
    assert run(4, cu) == [("scalar", True)] * 4  # packed under =scans: the W scans, natively
    monkeypatch.setattr(kt, "_FALCON_3A_PACKED", "banded")
    assert run(17) == [("scalar", False)] * 17  # beyond the banded kernel's window: the scans
    assert run(4, fused_window=False) == [("scalar", False)] * 4  # the per-call opt-out
    monkeypatch.setattr(kt, "_FALCON_3A", "scans")
    assert run(4) == [("scalar", False)] * 4  # FALCON_TRITON_3A=scans
    # FALCON_TRITON_3A=delayed (one Falcon-1A scan plus a band, window_delayed.py): unpacked calls up to W = 16, also
    # with fused_window=True; packed calls follow FALCON_TRITON_3A_PACKED (banded set above); W > 16 and
    # fused_window=False the scans
    monkeypatch.setattr(kt, "_FALCON_3A", "delayed")
    assert run(4) == [("window_delayed", False)] and run(16, fused_window=True) == [("window_delayed", False)]
    assert run(4, cu) == [("window_linear", True)]
    assert run(17) == [("scalar", False)] * 17 and run(4, fused_window=False) == [("scalar", False)] * 4
    monkeypatch.setattr(kt, "_FALCON_3A_PACKED", "scans")
    assert run(4, cu) == [("scalar", True)] * 4
    # FALCON_TRITON_3A_PACKED=delayed (the default since 2026-12-04, twenty-first session): packed calls on the delayed
    # form too, unless FALCON_TRITON_3A=scans
    monkeypatch.setattr(kt, "_FALCON_3A_PACKED", "delayed")
    assert run(4, cu) == [("window_delayed", True)] and run(4) == [("window_delayed", False)]
    monkeypatch.setattr(kt, "_FALCON_3A", "scans")
    assert run(4, cu) == [("scalar", True)] * 4


def test_the_gpu_varlen_benchmark_runs(tmp_path):
    """experiments/h200/varlen_bench.py (native vs padded vs dense rows, for the next H200 session) in its --smoke mode:
    CPU, interpreter, tiny sizes; the script runs end to end, the two paths agree and the JSON has every row."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(root / "experiments/h200/varlen_bench.py"), "--smoke", "--variants", "1",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "varlen_bench.json").read_text())
    assert [r["mode"] for r in res["rows"]] == ["native", "pad", "dense rows, no resets"]
    diff = res["rows"][0]["native_vs_pad_max_abs_diff"]
    assert diff["o"] <= 1e-5 and diff["dq"] <= 1e-5, diff
    assert res["meta"]["padding_factor"] > 1 and sum(res["meta"]["lengths"]) == res["meta"]["tokens"]
