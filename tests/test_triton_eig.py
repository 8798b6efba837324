"""Falcon-3's μ_t squarings in one Triton kernel (falcon_lab/kernels/triton/eig.py) under the Triton interpreter
(tests/triton_eig_cases.py), against the PyTorch squarings and float64 eigvalsh, and where the Triton backend uses it
(falcon_lab.kernels.triton.eig_check)."""
import pytest
import torch

from interp_helpers import case_result, run_interp_cases

CASES = [dict(id=f"W{W}-K{K}{'-' + kind if kind else ''}", W=W, K=K, N=N, seed=i, **({kind: True} if kind else {}))
         for i, (W, K, N, kind) in enumerate([
             (2, 8, 37, None), (4, 16, 301, None), (8, 16, 50, None), (16, 32, 20, None),
             (4, 16, 64, "rank1"), (4, 16, 64, "zeros"), (8, 4, 40, "rank1"), (4, 16, 30, "close"),
             (4, 16, 40, "compiled")])]


@pytest.fixture(scope="module")
def results():
    return run_interp_cases("triton_eig_cases.py", CASES, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_one_kernel_squarings_match_the_pytorch_ones(results, case):
    """μ_t from the kernel's eigenvector is as close to float64 eigvalsh as the PyTorch squarings' (fp32 rounding),
    the eigenvectors agree in direction, zero Grams give a zero vector, and Falcon-3's prep (μ_t, η, dk) through it
    is as close to the float64 prep as the PyTorch prep in fp32 is."""
    r = case_result(results, case["id"])
    assert r["shape"][-2:] == [case["W"], 1] and r["v_finite"]
    assert r["mu_triton"] <= 2 * r["mu_torch"] + 2e-6, r
    if "min_cos" in r:
        assert r["min_cos"] >= 1 - 1e-4 and r["zero_where_torch_zero"], r
    for name in ("stat", "eta", "dk"):
        assert r[f"prep_{name}"] <= 4 * r[f"prep_{name}_torch"] + 5e-6, (name, r)
    if case.get("compiled"):  # falcon_lab::top_eigvec (torch.compile's path): the eager kernel's result, opcheck
        assert r["compiled_differs"] == 0.0 and r["opcheck_failed"] == 0, r


def test_triton_backend_uses_it_for_falcon_3_only_where_it_applies(monkeypatch):
    import falcon_lab.kernels.triton as kt
    from falcon_lab.kernels.spec import FalconSpec

    s3 = FalconSpec.from_variant("3")
    assert kt.eig_check(s3, window=4, device_type="cpu")[0]
    for variant, W in (("1", 1), ("3A", 4), ("2", 1)):
        ok, why = kt.eig_check(FalconSpec.from_variant(variant), window=W, device_type="cpu")
        assert not ok and "only Falcon-3" in why
    ok, why = kt.eig_check(s3, window=3, device_type="cpu")
    assert not ok and "windows 2, 4, 8, 16" in why
    monkeypatch.setattr(kt, "_UNPROVEN", False)
    assert kt.PROVEN_EIG and kt.eig_check(s3, window=4, device_type="cuda")[0]  # proven on the H200 (2026-12-03)
    monkeypatch.setattr(kt, "PROVEN_EIG", False)
    ok, why = kt.eig_check(s3, window=4, device_type="cuda")
    assert not ok and "not proven" in why
    monkeypatch.setattr(kt, "PROVEN_EIG", True)
    # traced (a packed Falcon-3 call under torch.compile): the kernel as the custom operator falcon_lab::top_eigvec,
    # unless FALCON_TRITON_PREP_COMPILED=traced
    assert torch.compile(lambda: kt.eig_check(s3, window=4, device_type="cuda")[0], backend="eager",
                         fullgraph=True)()
    monkeypatch.setattr(kt, "_PREP_COMPILED", "traced")
    assert not torch.compile(lambda: kt.eig_check(s3, window=4, device_type="cuda")[0], backend="eager",
                             fullgraph=True)()
    monkeypatch.setattr(kt, "_PREP_COMPILED", "auto")
    monkeypatch.setattr(kt, "_PREP", "torch")
    ok, why = kt.eig_check(s3, window=4, device_type="cuda")
    assert not ok and "FALCON_TRITON_PREP=torch" in why


def test_top_eigvec_refuses_what_it_cannot_take():
    from falcon_lab.kernels.triton.eig import top_eigvec

    for bad in (torch.zeros(3, 3, 3), torch.zeros(2, 4, 4, dtype=torch.float64), torch.zeros(2, 32, 32),
                torch.zeros(2, 4, 2)):
        with pytest.raises(ValueError, match="power of two"):
            top_eigvec(bad)
