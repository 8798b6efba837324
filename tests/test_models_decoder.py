"""Decoder + mixers: shapes, decoding == full forward, generate == greedy, varlen resets, knob errors."""
import pytest
import torch

from falcon_lab.models import build_model
from falcon_lab.models.parallelize import parallelize
from falcon_lab.layers import build_mixer

TINY = dict(d_model=32, n_layers=2, n_heads=2, head_dim=16)
MIXERS = [dict(name="falcon", variant=v) for v in ("1", "2", "3", "1A", "2A", "3A")] + [
    dict(name="falcon", variant="1A", preset=".1"),
    dict(name="falcon", variant="1", preset=".2", shift=False, read="before"),
    dict(name="falcon", variant="3A", window=2, lam="const", lam_mode="absolute", qk_norm_gain=True),
    dict(name="attention"), dict(name="deltanet"), dict(name="gated_deltanet"), dict(name="mamba2"),
    dict(name="retnet"),
]
IDS = [" ".join(f"{k}={v}" for k, v in m.items()) for m in MIXERS]


def _model(mix):
    torch.manual_seed(0)
    return build_model(TINY, mix, vocab_size=320).double().eval()


@pytest.mark.parametrize("mix", MIXERS, ids=IDS)
def test_step_decoding_matches_full_forward(mix):
    m = _model(mix)
    x = torch.randint(0, 256, (2, 13))
    with torch.no_grad():
        full = m(x)
        # prefill the first 5 tokens with the parallel form, then one step per token
        logits, state = m.prefill(x[:, :5])
        torch.testing.assert_close(logits, full[:, :5], rtol=1e-6, atol=1e-7)
        for t in range(5, 13):
            lg, state = m.step(x[:, t], state)
            torch.testing.assert_close(lg, full[:, t], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mix", MIXERS[:6] + MIXERS[9:], ids=IDS[:6] + IDS[9:])
def test_generate_equals_greedy_continuation(mix):
    m = _model(mix)
    prompt = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        seq = prompt
        for _ in range(5):
            seq = torch.cat([seq, m(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(m.generate(prompt, 5), seq)
        assert torch.equal(m.generate(prompt, 5, prefill=False), seq)


@pytest.mark.parametrize("mix", [MIXERS[3], MIXERS[5], MIXERS[9], MIXERS[11], MIXERS[12]],
                         ids=[IDS[3], IDS[5], IDS[9], IDS[11], IDS[12]])
def test_cu_seqlens_resets_match_separate_sequences(mix):
    m = _model(mix)
    a, b = torch.randint(0, 256, (1, 7)), torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        packed = m(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 7, 16]))
        torch.testing.assert_close(packed[:, :7], m(a), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(packed[:, 7:], m(b), rtol=1e-6, atol=1e-7)


def test_gradients_reach_every_parameter():
    m = build_model(TINY, dict(name="falcon", variant="2"), vocab_size=320)
    m(torch.randint(0, 256, (2, 10))).logsumexp(-1).sum().backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing


def test_state_size_is_constant_for_recurrent_mixers_and_grows_for_attention():
    rec = build_model(TINY, dict(name="falcon", variant="3A"), 320)
    att = build_model(TINY, dict(name="attention"), 320)
    assert rec.state_numel(1, 100) == rec.state_numel(1, 10_000) > 0
    assert att.state_numel(1, 200) == 2 * att.state_numel(1, 100)
    # analytic FLOPs: attention grows with context, the recurrent form does not (past the chunk size)
    assert att.flops_per_token(4096) > att.flops_per_token(1024)
    assert rec.flops_per_token(4096) == rec.flops_per_token(1024)


def test_presets_and_tied_embeddings():
    m = build_model(TINY, dict(name="falcon", variant="1A", preset=".2"), 320)
    mix = m.blocks[0].mixer
    assert (mix.qk_norm, mix.gate, mix.lam) == ("l2", "ctx_eta", "ctx")
    assert build_mixer(dict(name="falcon", preset=".3"), 32, 2, 16).qk_norm == "rmsnorm"
    for spelled in (0.1, ".1", "1", 1):  # `mixer.preset=.1` reaches us as the float 0.1 from Hydra
        assert build_mixer(dict(name="falcon", preset=spelled), 32, 2, 16).gate == "ctx_beta"
    assert all(not (hasattr(mod, "bias") and mod.bias is not None)
               for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and "proj" in n
               and not n.endswith(("gate_proj", "lam_proj")))
    assert m.num_params() - m.num_params(non_embedding=True) == 320 * 32  # one shared embedding matrix


@pytest.mark.parametrize("cfg,key", [
    (dict(name="falcon", variant="1", window=4), "mixer.window"),
    (dict(name="falcon", variant="3", window=0), "mixer.window"),
    (dict(name="falcon", variant="5"), "mixer.variant"),
    (dict(name="falcon", gate="ctx_gamma"), "mixer.gate"),
    (dict(name="falcon", windw=4), "mixer.windw"),
    (dict(name="attention", variant="1"), "mixer.variant"),
    (dict(name="nope"), "mixer.name"),
])
def test_bad_mixer_knobs_name_the_key(cfg, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_mixer(cfg, 32, 2, 16)


@pytest.mark.parametrize("variant", ["1", "2A", "3", "3A"])
@pytest.mark.parametrize("gate", ["ctx_eta", "ctx_beta"])
def test_preset_gate_ranges_bound_the_decay(variant, gate):
    """docs/training.md: with RMS keys (no gain), scaled λ, lam_scale <= 1, eta_max <= 1, beta_max <= 2,
    α = ηλ <= σ_η·λ̄ (ctx_eta) or βλ̄/(1+λ̄) (ctx_beta), so α < 1 and the clamp only fires at saturation."""
    from falcon_lab.kernels.prep import prepare
    from falcon_lab.layers.base import rms_normalize

    torch.manual_seed(0)
    mix = build_mixer(dict(name="falcon", variant=variant, preset=".3", gate=gate, window=4 if "3" in variant else None),
                      32, 2, 16).double()
    h = 3 * torch.randn(2, 40, 32, dtype=torch.float64)
    with torch.no_grad():
        mix.gate_proj.weight.normal_(0, 0.1)
        mix.lam_proj.weight.normal_(0, 0.1)
        beta, lam, step = mix._gates(*mix._gate_logits(h))
    k = rms_normalize(torch.randn(2, 40, 2, 16, dtype=torch.float64), 1e-6)
    v = torch.randn(2, 40, 2, 16, dtype=torch.float64)
    inp = prepare(k, v, beta.double(), lam.double(), variant=variant, window=mix.window or 1, step=step,
                  lam_mode="scaled", shift=True, eps=1e-6, eps_gamma=1e-4, seen=torch.zeros(2, dtype=torch.long))
    alpha = -torch.expm1(inp.g)
    lam_b = lam.double()[..., None] if beta.dim() == 4 else lam.double()
    if gate == "ctx_eta":
        bound = beta.double() * 16 * lam_b  # σ_η·λ̄  (η = σ_η / d_k)
    else:
        bound = beta.double() * lam_b / (1 + lam_b)
    assert (alpha <= bound + 1e-9).all()
    assert alpha.max() < 1 - 1e-4  # these gates are far from saturation: the clamp is inactive


@pytest.mark.parametrize("mix", [MIXERS[3], MIXERS[9]], ids=[IDS[3], IDS[9]])
def test_cu_seqlens_over_several_rows(mix):
    m = _model(mix)
    docs = [torch.randint(0, 256, (1, n)) for n in (5, 3, 4, 2, 6)]  # rows of 8: [5|3] [4|2|2'] [4'']...
    x = torch.cat(docs, 1)[:, :16].view(2, 8)
    cu = torch.tensor([0, 5, 8, 12, 14, 16])
    with torch.no_grad():
        out = m(x, cu_seqlens=cu).reshape(1, 16, -1)
        flat = x.reshape(1, 16)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            torch.testing.assert_close(out[:, a:b], m(flat[:, a:b]), rtol=1e-6, atol=1e-7)


def test_preset_given_as_float_on_the_command_line_is_understood():
    # `python -m falcon_lab.fit mixer.preset=.3`: Hydra parses .3 as the float 0.3, which the typed schema's
    # str field keeps as "0.3"
    from falcon_lab.training.config import compose
    from falcon_lab.training.validate import validate_config

    cfg = compose(["mixer=falcon", "mixer.variant=1", "mixer.preset=.3"])
    assert cfg.mixer.preset == "0.3"
    validate_config(cfg)
    from falcon_lab.layers.falcon import FalconMixer
    m = FalconMixer(32, 2, 16, variant="1", preset=0.3)
    assert m.preset == ".3" and m.qk_norm == "rmsnorm" and m.gate == "ctx_eta"


@pytest.mark.parametrize("mix", [dict(name="falcon", variant="3", window=4), dict(name="falcon", variant="1A"),
                                 dict(name="attention"), dict(name="mamba2")])
def test_chunked_prefill_equals_whole_prefill(mix):
    """Decoder.prefill(chunk_tokens=c) carries the state between segments: same logits and the same
    state as one whole-prompt prefill; last_only returns the last position's logits."""
    torch.manual_seed(0)
    model = build_model(TINY, mix, vocab_size=320).double().eval()
    ids = torch.randint(0, 320, (2, 37))
    with torch.no_grad():
        full, s_full = model.prefill(ids)
        part, s_part = model.prefill(ids, chunk_tokens=10)
        last, _ = model.prefill(ids, chunk_tokens=16, last_only=True)
        nxt = torch.tensor([3, 5])
        a, _ = model.step(nxt, s_full)
        b, _ = model.step(nxt, s_part)
    # the Falcon state S is kept in fp32 (ours, as the decode path), so a carried state agrees to
    # fp32 precision, not float64's
    tol = dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(part, full, **tol)
    torch.testing.assert_close(last[:, 0], full[:, -1], **tol)
    torch.testing.assert_close(b, a, **tol)
    with pytest.raises(ValueError, match="chunk_tokens"):
        model.prefill(ids, chunk_tokens=0)


def test_generate_cuda_graph_needs_cuda():
    model = _model(dict(name="falcon", variant="1A"))
    with pytest.raises(ValueError, match="cuda_graph=True needs CUDA"):
        model.generate(torch.tensor([[1, 2, 3]]), 2, cuda_graph=True)


def _losses_after_backward(*models):
    """Next-token loss of each model on the same random batch, after its backward (grads filled)."""
    ids = torch.randint(0, 320, (2, 24))
    losses = []
    for m in models:
        loss = torch.nn.functional.cross_entropy(m(ids[:, :-1]).reshape(-1, 320), ids[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mix", [dict(name="falcon", variant="2"), dict(name="attention")])
def test_activation_checkpointing_same_loss_and_grads(mix):
    """model.activation_checkpointing recomputes blocks in backward: same loss and gradients; eval and
    no-grad forwards are untouched."""
    torch.manual_seed(0)
    a = build_model(TINY, mix, vocab_size=320).double().train()
    b = parallelize(build_model(TINY, mix, vocab_size=320), activation_checkpointing=True).double().train()
    b.load_state_dict(a.state_dict())
    losses = _losses_after_backward(a, b)
    assert b.activation_checkpointing and not a.activation_checkpointing
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_activation_checkpointing_from_config():
    """build_model gives the plain model; the trainer's configure_model applies model.compile and
    model.activation_checkpointing in one parallelize step (once, however often Lightning calls it)."""
    from omegaconf import OmegaConf

    from falcon_lab.training.config import compose
    from falcon_lab.training.module import LitLM
    cfg = compose(["model=tiny", "model.activation_checkpointing=true", "model.compile=true"])
    assert cfg.model.activation_checkpointing is True
    lit = LitLM(OmegaConf.to_container(cfg, resolve=True), vocab_size=320)
    assert not lit.model.activation_checkpointing
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in lit.model.blocks)
    lit.configure_model()
    lit.configure_model()
    assert lit.model.activation_checkpointing
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in lit.model.blocks)


def test_model_compile_same_loss_and_grads():
    """model.compile=true torch.compiles each block in place (parameter names unchanged): same loss and
    gradients as eager, through the Falcon operator's custom autograd function (a graph break)."""
    torch.manual_seed(0)
    mix = dict(name="falcon", variant="1A")
    a = build_model(TINY, mix, vocab_size=320)
    b = parallelize(build_model(TINY, mix, vocab_size=320), compile=True)
    assert all(getattr(blk, "_compiled_call_impl", None) is not None for blk in b.blocks)
    assert list(b.state_dict()) == list(a.state_dict())
    b.load_state_dict(a.state_dict())
    losses = _losses_after_backward(a, b)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("chunk", [None, 7])
def test_static_kv_cache_decodes_like_the_growing_one(chunk):
    """init_state(max_len=N) preallocates attention's KV cache and writes it in place: the same logits as
    the growing cache, for prefill (whole or chunked) and decode steps; every state leaf keeps its shape
    and Python values from step to step (the condition for CUDA-graph capture), which the growing
    cache does not."""
    from falcon_lab.models.graph_step import check_static_step, state_leaves
    model = _model(dict(name="attention"))
    ids = torch.randint(0, 320, (2, 19))
    with torch.no_grad():
        ref, s_ref = model.prefill(ids)
        out, s_st = model.prefill(ids, state=model.init_state(2, max_len=19 + 4), chunk_tokens=chunk)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        tok = ref[:, -1].argmax(-1)
        for _ in range(4):
            a, s_ref2 = model.step(tok, s_ref)
            b, s_st2 = model.step(tok, s_st)
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
            check_static_step(state_leaves(s_st, []), state_leaves(s_st2, []))
            with pytest.raises(RuntimeError, match="KV cache"):
                check_static_step(state_leaves(s_ref, []), state_leaves(s_ref2, []))
            s_ref, s_st, tok = s_ref2, s_st2, a.argmax(-1)
    with pytest.raises(ValueError, match="max_len=5"):
        model.prefill(ids, state=model.init_state(2, max_len=5))
