"""Each baseline mixer on the Falcon operator equals the same layer computed by fla's naive reference."""
import pytest
import torch

pytest.importorskip("fla")  # dev dependency (fla-core); its naive.py references run on CPU

from falcon_lab.models.mixers import build_mixer  # noqa: E402


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "mamba2", "retnet"])
def test_baseline_matches_fla_naive(name):
    torch.manual_seed(0)
    m = build_mixer(dict(name=name), 32, 2, 16).double()
    x = torch.randn(2, 41, 32, dtype=torch.float64)
    if name == "gated_deltanet":  # exercise strong, varied decay (α well below 1)
        with torch.no_grad():
            m.A_log.fill_(1.5)
    ours, _ = m(x)
    assert m.backend_used.startswith("falcon")
    m.core = "fla_naive"
    ref, _ = m(x)
    assert m.backend_used == "fla-naive"
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err  # fla's references compute in float32


def test_gated_deltanet_decay_really_varies():
    torch.manual_seed(0)
    m = build_mixer(dict(name="gated_deltanet"), 32, 2, 16)
    with torch.no_grad():
        m.A_log.fill_(1.5)
    g, beta = m._gates(torch.randn(1, 30, 32))
    alpha = g.exp()
    assert alpha.min() < 0.9 and alpha.max() <= 1 and alpha.min() >= m.alpha_min


def test_fla_core_refuses_cpu():
    m = build_mixer(dict(name="deltanet", core="fla"), 32, 2, 16)
    with pytest.raises(RuntimeError, match="core=fla needs CUDA"):
        m(torch.randn(1, 4, 32))
