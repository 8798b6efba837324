"""Optimiser groups (width-muP), schedule, and the throughput/MFU metrics."""
import math

import pytest

from falcon_lab.training import run
from falcon_lab.training.config import compose
from falcon_lab.training.module import LitLM, lr_lambda


def test_warmup_then_cosine_to_min_ratio():
    f = lr_lambda(warmup=10, max_steps=110, min_ratio=0.05)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.05 + 0.95 * 0.5)
    assert f(110) == pytest.approx(0.05) and f(500) == pytest.approx(0.05)


def test_mup_scales_hidden_lr_and_logits():
    cfg = compose(["optim=paper"])  # muP base rates at width 1024; the tiny model has width 64
    from omegaconf import OmegaConf

    m = LitLM(OmegaConf.to_container(cfg, resolve=True), vocab_size=320)

    class _T:
        max_steps = 100

    m.trainer = None
    m._trainer = _T()
    groups = {g["name"]: g for g in m.configure_optimizers()["optimizer"].param_groups}
    assert groups["hidden"]["initial_lr"] == pytest.approx(1e-3 * 1024 / 64)
    assert groups["embed"]["initial_lr"] == pytest.approx(1e-3) and groups["vectors"]["weight_decay"] == 0.0
    assert m.model.logit_scale == pytest.approx(1024 / 64)  # MuReadout: logits / width_mult
    plain = LitLM(OmegaConf.to_container(compose([]), resolve=True), vocab_size=320)
    assert plain.width_mult == 1.0 and plain.model.logit_scale == 1.0


def test_tokens_per_s_and_mfu_are_logged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose(["debug=smoke", "logger=none", "checks.shuffle=false", "data.seq_len=32",
                   "metrics.peak_flops=1e12", "trainer.max_steps=3"])
    res = run(cfg)
    tps = res["history"]["train/tokens_per_s"][-1][1]
    mfu = res["history"]["train/mfu"][-1][1]
    from falcon_lab.models import build_model

    model = build_model(cfg.model, cfg.mixer, 320)
    assert tps > 0 and math.isclose(mfu, tps * 3 * model.flops_per_token(32) / 1e12, rel_tol=1e-4)


def test_fused_adamw_with_bf16_mixed_and_clipping_trains(tmp_path):
    """Lightning refuses gradient clipping with fused AdamW under bf16-mixed; the module clips itself
    (this failed on the H200 with optim=paper). Run on CPU with the fused CPU AdamW."""
    from falcon_lab.training import run
    from falcon_lab.training.config import compose

    cfg = compose(["model=tiny", "data=kjv", "trainer=cpu", "logger=none", "trainer.max_steps=3",
                   "data.seq_len=32", "data.batch_size=2", "trainer.precision=bf16-mixed",
                   "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "checks.shuffle=false",
                   "optim.fused=true", "+optim.fused_on_cpu=true", "optim.grad_clip=0.01",
                   f"run_dir={tmp_path}"])
    res = run(cfg)
    assert res["steps"] == 3
