"""The fused preps (falcon_lab/kernels/triton/prep.py, prep_window.py) under the Triton interpreter, against the
PyTorch prep in float64 (tests/triton_prep_cases.py), and where the Triton backend uses them
(falcon_lab.kernels.triton.prep_check)."""
import itertools

import pytest
import torch

from interp_helpers import case_result, run_interp_cases


def _case(i, per_col, shift, step, lam_mode, last_k, seen, valid):
    return dict(id=f"{'F2' if per_col else 'F1'}-{'shift' if shift else 'noshift'}-{step}-{lam_mode}"
                   f"{'-lastk' if last_k else ''}{f'-seen{seen}' if seen else ''}{'-valid' if valid else ''}",
                B=2, T=9, H=3, K=5 + 11 * (i % 2), V=6, per_col=per_col, shift=shift, step=step, lam_mode=lam_mode,
                last_k=last_k, seen=seen, valid=valid, lam_max=3.0 if lam_mode == "scaled" else 0.9, seed=i)


# every knob value at least twice, every pair of (per_col, shift, step, lam_mode) once; the carried key, a
# continued row (seen > 0) and right padding (varlen) spread over them
CASES = [_case(i, pc, sh, st, lm, i % 3 == 0, 3 * (i % 2), i % 4 == 1)
         for i, (pc, sh, st, lm) in enumerate(itertools.product((False, True), (True, False), ("nlms", "direct"),
                                                               ("scaled", "absolute")))]


def _window_cases(prefix, first, rows, **extra):
    """Windowed cases (prep_window.py): one per (W, shift, step, lam_mode, last_k, seen, valid, tail) row."""
    return [dict(_case(first + i, False, sh, st, lm, lk, seen, val), window=W, tail=tail, **extra,
                 id=f"{prefix}-W{W}-{'shift' if sh else 'noshift'}-{st}-{lm}{'-tail' if tail else ''}"
                    f"{'-lastk' if lk else ''}{f'-seen{seen}' if seen else ''}{'-valid' if val else ''}")
            for i, (W, sh, st, lm, lk, seen, val, tail) in enumerate(rows)]


# Falcon-3A's windowed prep (prep_window.py): windows 2, 3, 4 and 8 (longer than the 3-step continuation below, so
# the carried tail and the first windows overlap), with and without a carried tail, shift or not, padding
CASES += _window_cases("F3A", 20, [(4, True, "nlms", "scaled", True, 3, False, True),
                                   (4, True, "nlms", "absolute", False, 0, True, False),
                                   (2, False, "nlms", "scaled", False, 3, False, True),
                                   (3, True, "direct", "scaled", True, 0, True, True),
                                   (8, True, "nlms", "scaled", False, 3, True, True),
                                   (4, False, "direct", "absolute", True, 3, False, False)])
# Falcon-3's fused prep (prep_window.py with eig: μ_t, the window Gram's top eigenvalue, squarings in the kernel):
# windows 2, 4 and 8 (4 with a carried tail), shift or not, padding
CASES += _window_cases("F3", 40, [(4, True, "nlms", "scaled", True, 3, False, True),
                                  (2, False, "nlms", "absolute", False, 0, True, False),
                                  (8, True, "direct", "scaled", False, 3, True, True),
                                  (4, False, "nlms", "scaled", True, 0, False, False)], delta=True)


# ... and its gate backward from the statistic the forward stored (FALCON_TRITON_3_PREP_GATES=stat, ours, the default
# since 2026-12-05) against the recomputed μ_t's (=recompute): the same outputs and gradients to the bit
# (`gates_forms_differ`), shift or not, padding, a carried tail
CASES += _window_cases("F3-gstat", 50, [(4, True, "nlms", "scaled", True, 3, False, True),
                                        (8, False, "direct", "absolute", False, 0, True, False)], delta=True,
                       gates="stat")


# ... and through the custom operators falcon_lab::prep_fwd / prep_bwd (prep_ops.py: what a torch.compile'd call runs
# with FALCON_TRITON_PREP_COMPILED=op): the eager results to the bit, and torch.library.opcheck
CASES += [dict(c, id=c["id"] + "-compiled", compiled=True) for c in CASES if c["id"] in (
    "F2-shift-nlms-absolute-lastk-seen3-valid", "F1-noshift-direct-scaled-lastk")]
CASES += _window_cases("F3A-compiled", 60, [(4, True, "nlms", "scaled", True, 3, True, True)], compiled=True)
CASES += _window_cases("F3-compiled", 70, [(4, True, "direct", "scaled", True, 3, True, True),
                                           (2, False, "nlms", "absolute", False, 0, False, False)], delta=True,
                       compiled=True)


@pytest.fixture(scope="module")
def results():
    return run_interp_cases("triton_prep_cases.py", CASES, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fused_prep_matches_float64_as_well_as_the_torch_prep(results, case):
    """Each output and gradient of the fused prep in fp32 is as close to the float64 prep as the PyTorch prep in fp32
    is (within 4x, plus 5e-6: the two sum ||x||² in different orders)."""
    res = case_result(results, case["id"])
    if case.get("gates"):
        assert res.pop("gates_forms_differ") == 0.0, "the statistic-based gate backward differs from the recomputed one"
    if case.get("compiled"):
        assert res.pop("opcheck_failed") == 0, "torch.library.opcheck failed on falcon_lab::prep_fwd"
        assert res.pop("compiled_differs") == 0.0, "the custom operators' results differ from the eager Function's"
    assert set(res) >= {"x", "v", "eta", "g", "stat", "dk", "dbeta", "dlam"}
    assert ("dlast_k" in res) == case["last_k"] and ("dtail_x" in res) == bool(case.get("tail"))
    for name, e in res.items():
        assert e["fused"] <= 4 * e["torch"] + 5e-6, f"{name}: fused {e['fused']:.2e} vs torch {e['torch']:.2e}"
        assert e["fused"] <= 2e-5, f"{name}: {e['fused']:.2e}"


def test_the_triton_backend_uses_the_fused_prep_where_it_applies(monkeypatch):
    import falcon_lab.kernels.triton as kt
    from falcon_lab.kernels.spec import FalconSpec

    s1, s3a = FalconSpec.from_variant("1"), FalconSpec.from_variant("3A")
    assert kt.prep_check(s1, window=4, dtype=torch.bfloat16, device_type="cpu")[0]
    assert kt.prep_check(FalconSpec.from_variant("2A"), window=4, dtype=torch.float32, device_type="cpu")[0]
    assert kt.prep_check(s3a, window=4, dtype=torch.bfloat16, device_type="cpu")[0]
    s3 = FalconSpec.from_variant("3")
    assert kt.prep_check(s3, window=4, dtype=torch.bfloat16, device_type="cpu")[0]  # Falcon-3's, interpreter-tested
    ok, why = kt.prep_check(s3, window=3, dtype=torch.bfloat16, device_type="cpu")
    assert not ok and "windows 2, 4, 8, 16" in why
    monkeypatch.setattr(kt, "_UNPROVEN", False)
    assert kt.prep_check(s3, window=4, dtype=torch.bfloat16, device_type="cuda")[0]  # proven on the H200 (2026-12-03)
    monkeypatch.setattr(kt, "PROVEN_PREP", kt.PROVEN_PREP - {"3"})
    ok, why = kt.prep_check(s3, window=4, dtype=torch.bfloat16, device_type="cuda")
    assert not ok and "not proven" in why
    assert kt.prep_check(s3a, window=4, dtype=torch.bfloat16, device_type="cuda")[0]  # proven on the H200
    monkeypatch.setattr(kt, "PROVEN_PREP", kt.PROVEN_PREP - {"3A"})
    ok, why = kt.prep_check(s3a, window=4, dtype=torch.bfloat16, device_type="cuda")
    assert not ok and "not proven" in why
    ok, why = kt.prep_check(s1, window=1, dtype=torch.float64, device_type="cpu")
    assert not ok and "fp32" in why
    monkeypatch.setattr(kt, "PROVEN_PREP", set())
    assert not kt.prep_check(s1, window=1, dtype=torch.bfloat16, device_type="cuda")[0]
    monkeypatch.setattr(kt, "PROVEN_PREP", {"1"})
    assert kt.prep_check(s1, window=1, dtype=torch.bfloat16, device_type="cuda")[0]
    assert not torch.compile(lambda: kt.prep_check(s1, window=1, dtype=torch.bfloat16, device_type="cuda")[0],
                             backend="eager", fullgraph=True)()  # traced: the PyTorch prep, fused by Inductor
    # by default (FALCON_TRITON_PREP_COMPILED=auto) Falcon-3's prep runs as the custom operators (prep_ops.py) there
    monkeypatch.setattr(kt, "PROVEN_PREP", {"1", "3"})
    ok, why = torch.compile(lambda: kt.prep_check(s3, window=4, dtype=torch.bfloat16, device_type="cuda"),
                            backend="eager", fullgraph=True)()
    assert ok and "custom operators" in why
    monkeypatch.setattr(kt, "_PREP_COMPILED", "op")  # every variant's
    ok, why = torch.compile(lambda: kt.prep_check(s1, window=1, dtype=torch.bfloat16, device_type="cuda"),
                            backend="eager", fullgraph=True)()
    assert ok and "custom operators" in why
    monkeypatch.setattr(kt, "_PREP_COMPILED", "traced")  # none
    assert not torch.compile(lambda: kt.prep_check(s3, window=4, dtype=torch.bfloat16, device_type="cuda")[0],
                             backend="eager", fullgraph=True)()
    monkeypatch.setattr(kt, "_PREP", "torch")
    ok, why = kt.prep_check(s1, window=1, dtype=torch.bfloat16, device_type="cuda")
    assert not ok and "FALCON_TRITON_PREP=torch" in why
