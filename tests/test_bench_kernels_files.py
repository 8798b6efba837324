"""`python -m falcon_lab.bench kernels`: only a full default run (every op, every shape) writes
kernels_h200.{json,md,png}; a partial run (--ops, --quick) writes kernels_h200_partial.* instead."""
from falcon_lab.benchmarking.kernels import OPS, SHAPES, result_stem


def test_only_a_full_run_owns_the_result_file():
    assert result_stem(OPS, SHAPES) == "kernels_h200"
    assert result_stem(list(reversed(OPS)), SHAPES) == "kernels_h200"  # order of --ops does not matter
    assert result_stem(["falcon-1", "falcon-2"], SHAPES) == "kernels_h200_partial"
    assert result_stem(OPS, SHAPES[:1]) == "kernels_h200_partial"  # --quick


def test_flop_model_is_falcon_math_section_7_and_bound_is_the_larger_floor():
    """Per token and head at d = e = 128, C = 64, B = 4, falcon-math.md §7's table: F1A 98k, F2A 107k, F3A 103k,
    F1 156k, F2 160k (nominal), F3 ≈ 158k (C_3 = 16), FLA's F1 ≈ 190k."""
    import pytest

    from falcon_lab.benchmarking.kernels import BF16_PEAK, HBM_BPS, bytes_floor, flops_model, limit_fractions, summary

    table = {"falcon-1A": 98, "falcon-2A": 107, "falcon-3A": 103, "falcon-1": 156, "falcon-2": 160, "falcon-3": 158,
             "fla_chunk_delta_rule": 190, "torch_chunk_falcon-1": 156}
    for op, k in table.items():
        assert flops_model(op, 1, 1, 1, 128, 128) / 1e3 == pytest.approx(k, abs=1.0), op
    assert flops_model("falcon-1", 16, 2048, 12, 64, 64) == 16 * 2048 * 12 * flops_model("falcon-1", 1, 1, 1, 64, 64)
    # fwd+bwd at 2.82 ms (Falcon-1's op time of 2026-12-01): both floors as fractions of that time
    f = limit_fractions("falcon-1", 16, 2048, 12, 64, 64, 2.82, fwd=False)
    assert f["bw"] == pytest.approx(bytes_floor("falcon-1", 16, 2048, 12, 64, 64, False) / HBM_BPS / 2.82e-3, abs=1e-4)
    assert f["tc"] == pytest.approx(3 * flops_model("falcon-1", 16, 2048, 12, 64, 64) / BF16_PEAK / 2.82e-3, abs=1e-4)
    assert f["bound"] == ("memory" if f["bw"] >= f["tc"] else "compute") == "memory"
    assert limit_fractions("sdpa_flash", 1, 32768, 6, 128, 128, 10.0, fwd=False)["bound"] == "compute"
    row = dict(op="falcon-1", B=16, T=2048, H=12, K=64, fwd_ms=1.0, fwdbwd_ms=2.82, peak_mem_mb=1.0,
               bw_floor_frac_fwdbwd=f["bw"], tc_peak_frac_fwdbwd=f["tc"], bound_fwdbwd=f["bound"], host_ms_fwdbwd=3.03,
               gpu_ms_fwdbwd=1.71)
    table = summary([row, dict(row, decode_step_eager_ms=0.1, decode_step_graph_ms=0.02),
                     dict(row, gpu_ms_fwdbwd=None)]).splitlines()
    line = table[2]
    # the host time and the kernels' GPU time beside the measured one; an unmeasured GPU time leaves its cell empty
    assert f"| {f['tc']} | memory |" in line and "| 2.82 | 3.03 | 1.71 |" in line
    assert "| 2.82 | 3.03 |  |" in table[-1]
    assert len({t.count("|") for t in table}) == 1, table  # every row, the decode row included, has every column


def test_op_labels_name_their_variant():
    from falcon_lab.benchmarking.kernels import OPS, flops_model, op_variant

    assert [op_variant(o) for o in ("falcon-1", "falcon-3A", "falcon-3A-scans", "torch_chunk_falcon-1")] == \
        ["1", "3A", "3A", "1"]
    # the baselines have none (a bench run with sdpa_flash died on the H200 on 2026-12-02 at 273f685 here)
    assert op_variant("sdpa_flash") is None and op_variant("fla_chunk_delta_rule") is None
    # falcon-3A is the default (the delayed form since 2026-12-04), the W scans timed beside it in the same run
    assert "falcon-3A" in OPS and "falcon-3A-scans" in OPS and "falcon-3A-banded" not in OPS
    assert flops_model("falcon-3A-scans", 2, 64, 3, 64, 64) == flops_model("falcon-3A", 2, 64, 3, 64, 64)


def test_falcon_3a_ops_run_the_default_and_the_forced_scans(monkeypatch):
    """falcon-3A runs whatever FALCON_TRITON_3A chooses (the delayed form by default); falcon-3A-scans pins the W scans
    for its call and restores the setting after it. The core is stubbed: which path each op asked for, no kernels."""
    import os

    import torch

    import falcon_lab.kernels.triton as kt
    from falcon_lab.benchmarking import kernels as bk

    if "FALCON_TRITON_3A" not in os.environ:
        assert kt._FALCON_3A == "delayed"
    seen = []

    def fake_chunk_falcon(q, *a, **kw):
        seen.append(kt._FALCON_3A)
        return q, None
    monkeypatch.setattr("falcon_lab.kernels.chunk_falcon", fake_chunk_falcon)
    monkeypatch.setattr(kt, "_FALCON_3A", "banded")
    ins = bk.make_inputs("falcon-3A", 1, 8, 1, 16, 16, dtype=torch.float32, dev="cpu")
    bk.make_fn("falcon-3A")(*ins)
    bk.make_fn("falcon-3A-scans")(*ins)
    assert seen == ["banded", "scans"] and kt._FALCON_3A == "banded"


def test_results_record_the_kernel_path_switches(monkeypatch):
    """A timing file says which paths it timed: FALCON_TRITON_* (e.g. UNPROVEN=1, 2A=blocked) in every row and
    above the Markdown table; other variables stay out."""
    from falcon_lab.benchmarking.kernels import run_flags, summary

    monkeypatch.setenv("FALCON_TRITON_UNPROVEN", "1")
    monkeypatch.setenv("FALCON_TRITON_2A", "blocked")
    monkeypatch.setenv("HOME_OF_SOMETHING_ELSE", "x")
    flags = run_flags()
    assert {"FALCON_TRITON_2A": "blocked", "FALCON_TRITON_UNPROVEN": "1"}.items() <= flags.items()
    assert all(k.startswith("FALCON_TRITON") for k in flags)
    row = dict(op="falcon-1", B=1, T=1, H=1, K=1, fwd_ms=1.0, fwdbwd_ms=2.0, peak_mem_mb=1.0, flags=flags)
    text = summary([row])
    assert text.splitlines()[0].startswith("Environment switches: ") and "FALCON_TRITON_2A=blocked" in text
    assert "HOME_OF_SOMETHING_ELSE" not in text
    assert summary([dict(row, flags={})]).splitlines()[0] == "Environment switches: none"
    assert summary([{k: v for k, v in row.items() if k != "flags"}]).startswith("| op |")  # older files: no line


def test_extra_ops_run_only_when_named():
    """torch_chunk_falcon-2 / -2A (the PyTorch chunk forms the Triton kernels replaced on CUDA) are timed only when
    --ops names them; a run with them is partial, and they compute what the recurrence does (CPU, float64)."""
    import torch

    from falcon_lab.benchmarking.kernels import EXTRA_OPS, OPS, SHAPES, make_fn, make_inputs, reference, result_stem

    assert not set(EXTRA_OPS) & set(OPS)
    assert result_stem(OPS + EXTRA_OPS, SHAPES) == "kernels_h200_partial"
    for op in EXTRA_OPS:
        ins = [t.double() for t in make_inputs(op, 1, 40, 2, 16, 16, dtype=torch.float64, dev="cpu")]
        out = make_fn(op)(*ins)
        assert torch.allclose(out, reference(op, ins), atol=1e-9), op


def test_the_ops_own_peak_leaves_out_what_was_allocated_before():
    """peak_mem_op_mb: the peak less what earlier work left allocated (not the call's inputs and dO), shown beside
    peak_mem_mb in the table when a row has it."""
    import torch

    from falcon_lab.benchmarking.kernels import own_peak_mb, summary

    ins = [torch.empty(2 ** 18, dtype=torch.float32), torch.empty(2 ** 19, dtype=torch.bfloat16)]  # 1 MB + 1 MB
    mb = 2 ** 20
    # 64 MB left by earlier work, 2 MB of inputs, the op's peak 10 MB above them
    assert own_peak_mb(peak=76 * mb, before=66 * mb, tensors=ins) == 12.0
    row = dict(op="falcon-3", B=16, T=2048, H=12, K=64, fwd_ms=1.0, fwdbwd_ms=2.0, peak_mem_mb=3481.0)
    assert "| 3481.0 |" in summary([row])
    assert "| 3481.0 (3416.1) |" in summary([dict(row, peak_mem_op_mb=3416.1)])
