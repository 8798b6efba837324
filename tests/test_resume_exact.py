"""Issue 16 A: resuming from a checkpoint written at ANY step continues exactly as the uninterrupted run.

The training sampler once reported its length as `total - start`, while Lightning restores its in-epoch batch
counter to `start`: Lightning then ended the "epoch" too early (before the midpoint) or at once (past it) and
re-iterated the sampler from `start`, training batches twice. Checked here at early, middle and late steps,
from the per-step checkpoints (saved in on_train_batch_end) and from last.ckpt (saved after validation, what a
killed run resumes from), on batch hashes, final weights and the MLflow metric history."""
import hashlib
import shutil

import lightning as L
import mlflow
import pytest
import torch

from falcon_lab.training import run
from falcon_lab.training.config import compose

N = 10
BASE = ["debug=smoke", "logger=none", "checks.shuffle=false", f"trainer.max_steps={N}",
        "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "checkpoint.every_n_steps=1",
        "data.seq_len=16", "data.batch_size=2", "optim.warmup_steps=3"]


class Record(L.Callback):
    """(global_step, hash of the batch) for every training_step; the final weights. With `snap`, a copy of
    last.ckpt as it stands when each step starts (last.ckpt is rewritten after every validation)."""

    def __init__(self, snap=None):
        self.seen, self.weights, self.snap = [], None, snap

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        h = hashlib.sha1(batch["input_ids"].numpy().tobytes() + batch["labels"].numpy().tobytes()).hexdigest()
        self.seen.append((trainer.global_step, h))
        if self.snap is not None:
            last = self.snap["src"] / "last.ckpt"
            if last.exists():
                shutil.copy(last, self.snap["dst"] / f"last_at{trainer.global_step}.ckpt")

    def on_train_end(self, trainer, pl_module):
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    snaps = root / "snaps"
    snaps.mkdir()
    rec = Record({"src": root / "a" / "checkpoints", "dst": snaps})
    res = run(compose(BASE + [f"run_dir={root / 'a'}"]), callbacks=[rec])
    assert res["steps"] == N and [s for s, _ in rec.seen] == list(range(N))
    assert len({h for _, h in rec.seen}) == N  # distinct batches, so a repeat is visible
    return root, rec


# 20 %, 50 %, 80 % of the run from the per-step checkpoints; last.ckpt (written after validation) early,
# before, and past the midpoint
@pytest.mark.parametrize("kind,k", [("step", 2), ("step", 5), ("step", 8), ("last", 2), ("last", 4), ("last", 8)])
def test_resume_at_any_step_is_exact(kind, k, uninterrupted, tmp_path):
    root, full = uninterrupted
    ck = root / "a" / "checkpoints" / f"step{k:06d}.ckpt" if kind == "step" else root / "snaps" / f"last_at{k}.ckpt"
    assert ck.exists(), ck
    assert torch.load(ck, map_location="cpu", weights_only=False)["global_step"] == k
    rec = Record()
    res = run(compose(BASE + [f"run_dir={tmp_path / 'b'}", f"ckpt_path={ck}"]), callbacks=[rec])
    assert res["steps"] == N
    assert rec.seen == full.seen[k:], f"resumed at {k}: {[s for s, _ in rec.seen]}, batches repeated: " + str(
        [(s, full.seen.index(next(x for x in full.seen if x[1] == h))) for s, h in rec.seen])
    assert rec.weights.keys() == full.weights.keys()
    for name, w in full.weights.items():
        assert torch.equal(w, rec.weights[name]), (name, (w - rec.weights[name]).abs().max().item())



def test_stop_at_max_steps_then_continue_longer(uninterrupted, tmp_path):
    """A finished run (max_steps=4) continued with max_steps=10 from its last.ckpt trains batches 4..9 once each
    (the weights differ from the 10-step run: the learning-rate schedule depends on max_steps)."""
    _, full = uninterrupted
    short = BASE + [f"run_dir={tmp_path / 'a'}"]
    first = Record()
    run(compose(short + ["trainer.max_steps=4"]), callbacks=[first])
    assert first.seen == full.seen[:4]
    rec = Record()
    res = run(compose(short + [f"ckpt_path={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}"]), callbacks=[rec])
    assert res["steps"] == N and rec.seen == full.seen[4:]

class _Crash(L.Callback):
    """A run dying mid-way: after last.ckpt of step `after` was written and a few more steps were logged."""

    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            raise RuntimeError("killed")


@pytest.fixture
def store(tmp_path, monkeypatch):
    db = tmp_path / "mlruns" / "mlflow.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    mlflow.MlflowClient(uri).search_experiments()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    return uri


def test_killed_run_resumed_from_last_ckpt_relogs_the_same_values(store, tmp_path):
    """last.ckpt at step 6 of 10 (validation every 3), the run dies at step 8 (steps 6, 7 already in MLflow);
    resuming continues the same MLflow run and re-logs steps 6, 7 with the values they had."""
    base = ["debug=smoke", "checks.shuffle=false", f"trainer.max_steps={N}", "trainer.val_check_interval=3",
            "trainer.limit_val_batches=1", "data.seq_len=16", "data.batch_size=2", "logger.experiment_name=t_kill",
            f"run_dir={tmp_path / 'a'}"]
    with pytest.raises(RuntimeError, match="killed"):
        run(compose(base), callbacks=[_Crash(8)])
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 6
    res = run(compose(base + [f"ckpt_path={last}"]))
    client = mlflow.MlflowClient(store)
    hist = client.get_metric_history(res["run_id"], "train/loss")
    by_step = {}
    for m in hist:
        by_step.setdefault(m.step, []).append(m.value)
    assert sorted(by_step) == list(range(N))
    assert {s: len(v) for s, v in by_step.items() if len(v) > 1} == {6: 2, 7: 2}  # logged before the kill and again
    assert all(v[0] == v[1] for v in by_step.values() if len(v) > 1), by_step
    assert client.get_run(res["run_id"]).info.status == "FINISHED"


@pytest.mark.parametrize("k", [2])
def test_task_datamodule_resume_is_exact(k, tmp_path, monkeypatch):
    """The synthetic-task datamodules (data=addition, data=mqar) share the sampler design, and had the same bug."""
    monkeypatch.chdir(tmp_path)
    base = ["experiment=addition", "model=tiny", "debug=smoke", "logger=none", f"trainer.max_steps={N}",
            "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "checkpoint.every_n_steps=1",
            "data.batch_size=2", "addition_eval.n_examples=2", "addition_eval.ood=false",
            "addition_eval.every_n_steps=1000"]
    full = Record()
    run(compose(base + [f"run_dir={tmp_path / 'a'}"]), callbacks=[full])
    rec = Record()
    ck = tmp_path / "a" / "checkpoints" / f"step{k:06d}.ckpt"
    res = run(compose(base + [f"run_dir={tmp_path / 'b'}", f"ckpt_path={ck}"]), callbacks=[rec])
    assert res["steps"] == N
    assert rec.seen == full.seen[k:]
    for name, w in full.weights.items():
        assert torch.equal(w, rec.weights[name]), name
