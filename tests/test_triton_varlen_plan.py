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
    assert varlen_check(three_a, window=4, device_type="cpu")[0]  # the W scans
    assert varlen_check(three, window=4, device_type="cpu")[0]  # its host expansion, packed
    banded, kt._FALCON_3A = kt._FALCON_3A, "banded"
    try:
        ok, why = varlen_check(three_a, window=4, device_type="cpu")
        assert not ok and "banded" in why, why
        assert varlen_check(three, window=4, device_type="cpu")[0]  # the 3A switch is not Falcon-3's
    finally:
        kt._FALCON_3A = banded
    in_place, kt._FALCON_3 = kt._FALCON_3, "gather"
    try:
        ok, why = varlen_check(three, window=4, device_type="cpu")  # pseudo-tokens read in place: padded
        assert not ok and "in place" in why, why
    finally:
        kt._FALCON_3 = in_place
    ok, why = varlen_check(one, window=1, device_type="cuda")
    assert ok == ("1" in PROVEN_VARLEN), why  # on CUDA only once proven there (or FALCON_TRITON_UNPROVEN=1)
    if not ok:
        assert "not proven on the H200" in why and "FALCON_TRITON_UNPROVEN=1" in why


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
