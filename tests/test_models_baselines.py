"""Each baseline mixer on the Falcon operator equals the same layer computed by fla's naive reference."""
import pytest
import torch

pytest.importorskip("fla")  # dev dependency (fla-core); its naive.py references run on CPU

from falcon_lab.layers import build_mixer  # noqa: E402


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


def test_attention_rope_table_equals_computed_rope():
    """The precomputed RoPE table gives the same outputs as computing cos/sin in the step: plain,
    continued from a state (offset positions) and packed varlen rows; it is not saved in checkpoints."""
    from falcon_lab.models import build_model

    torch.manual_seed(0)
    m = build_model(dict(d_model=32, n_layers=1, n_heads=2, head_dim=16), dict(name="attention"), vocab_size=50)
    mix = m.blocks[0].mixer
    assert not [k for k in m.state_dict() if "rope" in k]
    x = torch.randn(2, 12, 32)
    cu = torch.tensor([0, 5, 12, 20, 24])
    with torch.no_grad():
        plain, st = mix(x[:, :7], return_state=True)
        cont, _ = mix(x[:, 7:], state=st)
        packed, _ = mix(x, cu_seqlens=cu)
        full = mix(x)[0]
        mix.rope_cos, mix.rope_sin = mix.rope_cos[:0], mix.rope_sin[:0]  # forces the computed path
        plain2, st2 = mix(x[:, :7], return_state=True)
        cont2, _ = mix(x[:, 7:], state=st2)
        packed2, _ = mix(x, cu_seqlens=cu)
        full2 = mix(x)[0]
    for a, b in ((plain, plain2), (cont, cont2), (packed, packed2), (full, full2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
