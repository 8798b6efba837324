"""In-process training: every experiment runs a few steps; exact resume; MLflow records; checkpoints load."""

import lightning as L
import mlflow
import pytest
import torch

from falcon_lab.training import load_checkpoint, run
from falcon_lab.training.config import compose
from train_helpers import arms, experiments, small_overrides


@pytest.mark.parametrize("exp", experiments())
def test_every_experiment_runs_a_few_steps(exp, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose(small_overrides(exp) + arms(exp)[0] + ["logger=none", "checks.shuffle=false"])
    res = run(cfg)
    assert res["steps"] == 2
    hist = res["history"]["train/loss"]
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(v)) for _, v in hist)
    assert res["ckpt_path"] and res["ckpt_path"].endswith(".ckpt")


class _Boom(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            raise RuntimeError("boom")


def test_mlflow_run_contents_and_failed_status(store, tmp_path):
    cfg = compose(["debug=smoke", "mixer.variant=3A", "logger.experiment_name=t_mlflow",
                   "logger.tags={team: falcon}", "logger.parent_run_id=abc123"])
    res = run(cfg)
    client = mlflow.MlflowClient(store)
    r = client.get_run(res["run_id"])
    assert r.info.status == "FINISHED"
    assert r.data.params["mixer.variant"] == "3A" and r.data.params["model.d_model"] == "64"
    assert not [k for k in r.data.params if k.startswith("cfg/") or k in ("ckpt_path", "run_dir")]
    t = r.data.tags
    assert t["mixer"] == "falcon" and t["variant"] == "Falcon-3A" and t["knob.window"] == "4"  # the effective window (DEFAULT_WINDOW), not None
    assert t["team"] == "falcon" and t["mlflow.parentRunId"] == "abc123" and len(t["git_commit"]) in (40, 7)
    assert t["git_dirty"] in ("true", "false")
    steps = [m.step for m in client.get_metric_history(res["run_id"], "train/loss")]
    assert steps == [0, 1, 2, 3]  # logged at global_step (the step whose update the batch makes)
    for key in ("val/loss", "val/ppl", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/shuffle_gap"):
        assert client.get_metric_history(res["run_id"], key), key
    v = client.get_metric_history(res["run_id"], "val/loss")[-1].value
    p = client.get_metric_history(res["run_id"], "val/ppl")[-1].value
    assert abs(p - torch.tensor(v).exp().item()) < 1e-3 * p
    arts = {a.path for a in client.list_artifacts(res["run_id"])}
    assert {"config.yaml", "loss_curve.png"} <= arts
    # a crash ends the run FAILED, not RUNNING
    with pytest.raises(RuntimeError, match="boom"):
        run(compose(["debug=smoke", "logger.experiment_name=t_mlflow"]), callbacks=[_Boom()])
    runs = client.search_runs([r.info.experiment_id], order_by=["attributes.start_time DESC"])
    assert runs[0].info.status == "FAILED"


def test_resume_reproduces_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["debug=smoke", "logger=none", "checks.shuffle=false", "trainer.max_steps=8",
            "trainer.val_check_interval=4", "checkpoint.every_n_steps=4", "optim.warmup_steps=3"]
    full = run(compose(base + [f"run_dir={tmp_path / 'a'}"]))
    ck = tmp_path / "a" / "checkpoints" / "step000004.ckpt"
    assert ck.exists()
    resumed = run(compose(base + [f"run_dir={tmp_path / 'b'}", f"ckpt_path={ck}"]))
    a = dict(full["history"]["train/loss"])
    b = dict(resumed["history"]["train/loss"])
    assert sorted(b) == [4, 5, 6, 7]
    for s in b:
        assert abs(a[s] - b[s]) <= 1e-6 * abs(a[s]), (s, a[s], b[s])
    assert abs(full["final_val_loss"] - resumed["final_val_loss"]) < 1e-6


def test_load_checkpoint_and_generate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run(compose(["debug=smoke", "logger=none", "mixer=attention", "checks.shuffle=false"]))
    model, tok, cfg = load_checkpoint(res["ckpt_path"])
    assert cfg.mixer.name == "attention" and not model.training
    ids = torch.tensor([tok.encode("And God said", add_bos=True)])
    out = model.generate(ids, 5)
    assert out.shape == (1, ids.shape[1] + 5)
    with pytest.raises(FileNotFoundError, match="ckpt"):
        load_checkpoint(str(tmp_path / "none.ckpt"))


@pytest.mark.parametrize("extra", [["data.tokenizer=bpe", "data.bpe_vocab_size=512"],
                                   ["data.cu_seqlens=true"], ["data.cu_seqlens=true", "mixer=attention"]])
def test_bpe_and_document_resets_train_and_reload(extra, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run(compose(["debug=smoke", "logger=none", "data.seq_len=32", "trainer.max_steps=2"] + extra))
    assert torch.isfinite(torch.tensor(res["final_val_loss"]))
    model, tok, cfg = load_checkpoint(res["ckpt_path"])
    assert tok.decode(tok.encode("In the beginning")) == "In the beginning"
    assert model.vocab_size == tok.vocab_size


def test_resume_continues_the_same_mlflow_run(store, tmp_path):
    base = ["debug=smoke", "checks.shuffle=false", "trainer.max_steps=4", "checkpoint.every_n_steps=2",
            "data.seq_len=32", "logger.experiment_name=t_resume"]
    first = run(compose(base + [f"run_dir={tmp_path / 'a'}", "trainer.max_steps=2"]))
    again = run(compose(base + [f"run_dir={tmp_path / 'a'}", f"ckpt_path={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}"]))
    assert again["run_id"] == first["run_id"]
    client = mlflow.MlflowClient(store)
    assert [m.step for m in client.get_metric_history(first["run_id"], "train/loss")] == [0, 1, 2, 3]
    assert client.get_run(first["run_id"]).info.status == "FINISHED"
