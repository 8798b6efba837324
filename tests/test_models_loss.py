"""The LM loss (falcon_lab/models/loss.py): the chunked form equals the materialized one in value and
gradients (float64), ignores -100 labels, respects the logit scale, and is what the decoder's
forward(labels=) returns; model.compile / model.loss_impl are validated at start-up."""
import pytest
import torch
import torch.nn.functional as F

from falcon_lab.models import build_model
from falcon_lab.models.loss import lm_nll


def _inputs(N=300, D=24, V=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, dtype=torch.float64, generator=g).requires_grad_(True)
    w = torch.randn(V, D, dtype=torch.float64, generator=g).requires_grad_(True)
    y = torch.randint(0, V, (N,), generator=g)
    y[::7] = -100
    return h, w, y


@pytest.mark.parametrize("chunk", [1, 64, 299, 300, 1000])
def test_chunked_equals_materialized_value_and_gradients(chunk):
    h, w, y = _inputs()
    ref = F.cross_entropy((h @ w.t() * 0.5), y, ignore_index=-100, reduction="sum")
    gref = torch.autograd.grad(ref * 1.7, (h, w))
    for impl in ("materialized", "chunked"):
        nll, n = lm_nll(h, w, y, impl=impl, scale=0.5, chunk_tokens=chunk)
        assert int(n) == int((y != -100).sum())
        torch.testing.assert_close(nll.double(), ref, rtol=1e-6, atol=1e-6)
        g = torch.autograd.grad(nll * 1.7, (h, w))
        for a, b in zip(g, gref):  # fp32 softmax inside (as in training), so ~1e-7 relative
            assert float((a - b).norm() / b.norm()) <= 1e-6


def test_chunked_without_weight_grad_and_under_no_grad():
    h, w, y = _inputs()
    w = w.detach()
    nll, _ = lm_nll(h, w, y, impl="chunked", chunk_tokens=50)
    (dh,) = torch.autograd.grad(nll, (h,))
    ref = torch.autograd.grad(F.cross_entropy(h @ w.t(), y, ignore_index=-100, reduction="sum"), (h,))[0]
    assert float((dh - ref).norm() / ref.norm()) <= 1e-6
    with torch.no_grad():
        a, _ = lm_nll(h, w, y, impl="chunked", chunk_tokens=50)
        b, _ = lm_nll(h, w, y, impl="materialized")
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_unknown_impl_is_refused():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="model.loss_impl"):
        lm_nll(h, w, y, impl="fused")


@pytest.mark.parametrize("impl", ["chunked", "materialized"])
def test_decoder_forward_with_labels_is_the_logits_loss(impl):
    torch.manual_seed(0)
    m = build_model(dict(d_model=32, n_layers=1, n_heads=2, head_dim=16, loss_impl=impl),
                    dict(name="falcon", variant="1A"), vocab_size=50).double()
    x = torch.randint(0, 50, (2, 17))
    y = x.roll(-1, 1)
    y[:, -1] = -100
    nll, n = m(x, labels=y)
    ref = F.cross_entropy(m(x).reshape(-1, 50), y.reshape(-1), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(nll.double(), ref, rtol=1e-6, atol=1e-6)
    assert int(n) == 2 * 16


def test_compile_and_loss_knobs_validated_at_start():
    from falcon_lab.training.api import resolve_compile
    from falcon_lab.training.config import compose
    from falcon_lab.training.validate import ConfigError, validate_config

    for bad, key in (("model.compile=maybe", "model.compile"), ("model.loss_impl=fused", "model.loss_impl")):
        with pytest.raises(ConfigError, match=key):
            validate_config(compose(["model=tiny", bad]))
    assert resolve_compile("auto", "cpu") is False and resolve_compile("auto", "gpu") is True
    assert resolve_compile(True, "cpu") is True and resolve_compile(False, "gpu") is False


# ---- the Triton chunk body (falcon_lab/modules/xent.py) under the interpreter, against float64 ----
XENT_CASES = [
    dict(id="f32_multi_block", dtype="float32", C=7, V=1000, scale=0.5, grad=True, seed=0, edge=True),
    dict(id="bf16_multi_block", dtype="bfloat16", C=6, V=700, scale=1.0, grad=True, seed=1, edge=True),
    dict(id="f32_one_block_nograd", dtype="float32", C=5, V=97, scale=1.3, grad=False, seed=2),
    dict(id="f32_large_logits", dtype="float32", C=4, V=300, scale=1.0, grad=True, seed=3, spread=60.0),
]


@pytest.fixture(scope="module")
def xent_results():
    import os

    from tests.interp_helpers import run_interp_cases

    # BLOCK is min(8192, next power of two of V): force several blocks per row at these small V
    return run_interp_cases("xent_interp_cases.py", XENT_CASES, timeout=600,
                            FALCON_XENT_BLOCK=os.environ.get("FALCON_XENT_BLOCK", "256"))


@pytest.mark.parametrize("case", XENT_CASES, ids=[c["id"] for c in XENT_CASES])
def test_triton_chunk_body_matches_float64(xent_results, case):
    r = xent_results[case["id"]]
    assert "error" not in r, r.get("error")
    r = r["res"]
    tol = 1e-2 if case["dtype"] == "bfloat16" else 1e-5
    assert r["nll"] <= tol and r["ignored_zero"]
    if case["grad"]:
        assert r["grad"] <= tol and r["ignored_grad_zero"]
    else:
        assert r["untouched"]


def test_chunked_torch_impl_equals_chunked():
    h, w, y = _inputs()
    a, _ = lm_nll(h, w, y, impl="chunked", chunk_tokens=64)
    b, _ = lm_nll(h, w, y, impl="chunked_torch", chunk_tokens=64)
    torch.testing.assert_close(a, b)
