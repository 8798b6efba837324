"""Dtype discipline (the fast-layers issue): under bf16 autocast the activations reach the token-mixing
op in bf16 for every mixer (q, k, v of the Falcon operator; q, k, v of SDPA), while the gates and λ
stay fp32 (the operator's contract takes them so), and the mixer hands bf16 to its output projection.
On the GPU an fp32 q/k/v sends the Triton kernels down their fp32 path (10x slower measured on the
H200: ../shared h200-measurements §4)."""
import pytest
import torch
import torch.nn.functional as F

import falcon_lab.layers.baselines as baselines
import falcon_lab.layers.falcon as falcon
from falcon_lab.models import build_model

TINY = dict(d_model=32, n_layers=1, n_heads=2, head_dim=16)
MIXERS = [dict(name="falcon", variant=v) for v in ("1", "2", "3", "1A", "2A", "3A")] + [
    dict(name="falcon", variant="1A", preset=".1"),
    dict(name="falcon", variant="3A", window=2, qk_norm_gain=True),
    dict(name="deltanet"), dict(name="gated_deltanet"), dict(name="mamba2"), dict(name="retnet"),
]
IDS = [" ".join(f"{k}={v}" for k, v in m.items()) for m in MIXERS]


def _recording(fn, seen):
    def wrapped(q, k, v, beta, lam, **kw):
        seen.append({"q": q.dtype, "k": k.dtype, "v": v.dtype, "beta": beta.dtype, "lam": lam.dtype})
        return fn(q, k, v, beta, lam, **kw)
    return wrapped


@pytest.mark.parametrize("mix", MIXERS, ids=IDS)
def test_operator_inputs_stay_in_autocast_dtype(mix, monkeypatch):
    seen = []
    monkeypatch.setattr(falcon, "chunk_falcon", _recording(falcon.chunk_falcon, seen))
    monkeypatch.setattr(baselines, "chunk_falcon", _recording(baselines.chunk_falcon, seen))
    model = build_model(TINY, mix, vocab_size=64)
    outs = []
    hook = model.blocks[0].mixer.o_proj.register_forward_hook(lambda m, i, o: outs.append(i[0].dtype))
    x = torch.randint(0, 64, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nll, _ = model(x[:, :-1], labels=x[:, 1:])
    nll.backward()
    hook.remove()
    assert seen, "the mixer did not call the Falcon operator"
    for s in seen:
        assert (s["q"], s["k"], s["v"]) == (torch.bfloat16,) * 3, s
        assert (s["beta"], s["lam"]) == (torch.float32,) * 2, s
    assert outs == [torch.bfloat16], outs


def test_attention_inputs_stay_in_autocast_dtype(monkeypatch):
    seen = []
    sdpa = F.scaled_dot_product_attention

    def rec(q, k, v, *a, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", rec)
    model = build_model(TINY, dict(name="attention"), vocab_size=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (2, 16)))
    assert seen == [(torch.bfloat16,) * 3]
