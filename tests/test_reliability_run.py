"""Issue 16 (second part): a locked MLflow store does not end a run; a failed resume leaves the finished run it came
from untouched; runs cannot write outside their folders; bad generate/evaluate values are refused up front;
Ctrl-C saves last.ckpt and marks the run KILLED."""
import sqlite3
import subprocess
import sys
from pathlib import Path

import lightning as L
import mlflow
import pytest
import torch

from falcon_lab.training import run
from falcon_lab.training.config import compose
from falcon_lab.training.validate import ConfigError

SMALL = ["debug=smoke", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
         "data.seq_len=16", "data.batch_size=2", "checks.shuffle=false"]




@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A checkpoint of a 2-step run without MLflow."""
    d = tmp_path_factory.mktemp("tiny")
    res = run(compose(SMALL + ["logger=none", f"run_dir={d / 'run'}"]))
    return Path(res["last_ckpt_path"])


# ---------------------------------------------------------------------------------------------------------------
# 1. a transient lock of the SQLite store
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def short_busy_timeout():
    """MLflow makes every SQLite session wait up to 20 s on a lock (PRAGMA busy_timeout = 20000): shortened to
    0.2 s here so that a lock of a few seconds is enough to make a store call fail."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def shorten(conn, cursor, statement, parameters, context, executemany):
        if statement.strip().lower().startswith("pragma busy_timeout"):
            statement = "PRAGMA busy_timeout = 200;"
        return statement, parameters

    event.listen(Engine, "before_cursor_execute", shorten, retval=True)
    yield
    event.remove(Engine, "before_cursor_execute", shorten)


class _LockStore(L.Callback):
    """Holds an exclusive lock on the SQLite file from another connection from step `start` to step `stop`."""

    def __init__(self, db, start, stop):
        self.db, self.start, self.stop, self.con, self.held = str(db), start, stop, None, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.start and self.con is None:
            self.con = sqlite3.connect(self.db, isolation_level=None, timeout=30)
            self.con.execute("BEGIN EXCLUSIVE")
        self.held.append((trainer.global_step, self.con is not None))
        if trainer.global_step == self.stop and self.con is not None:
            self.con.execute("ROLLBACK")
            self.con.close()
            self.con = None

    def on_exception(self, trainer, pl_module, exception):
        if self.con is not None:
            self.con.execute("ROLLBACK")
            self.con.close()
            self.con = None


def test_a_locked_store_does_not_end_the_run_and_no_metric_is_lost(store, tmp_path, short_busy_timeout):
    db = Path(store[len("sqlite:///"):])
    lock = _LockStore(db, start=2, stop=5)
    with pytest.warns(UserWarning, match=r"MLflow store unavailable"):
        res = run(compose(SMALL + ["trainer.max_steps=8", "trainer.val_check_interval=4", "logger.retry_s=1",
                                   f"run_dir={tmp_path / 'run'}"]), callbacks=[lock])
    assert res["steps"] == 8
    assert any(held for _, held in lock.held)  # the store really was locked for some steps
    client = mlflow.MlflowClient(store)
    r = client.get_run(res["run_id"])
    assert r.info.status == "FINISHED"
    want = sorted(s for s, _ in res["history"]["train/loss"])
    assert len(want) == 8
    got = sorted(m.step for m in client.get_metric_history(res["run_id"], "train/loss"))
    assert got == want
    vals = {m.step: m.value for m in client.get_metric_history(res["run_id"], "train/loss")}
    assert all(vals[s] == pytest.approx(v, rel=1e-5) for s, v in res["history"]["train/loss"])


def test_metric_logging_retries_then_buffers(store, tmp_path, short_busy_timeout, recwarn):
    """Unit level: a locked store makes log_metrics buffer after its retry budget, warn once, and flush later."""
    from falcon_lab.training.mlflow import build_logger

    cfg = compose(SMALL + ["logger.retry_s=0.5", f"run_dir={tmp_path / 'run'}"])
    logger = build_logger(cfg)
    rid = logger.run_id
    con = sqlite3.connect(store[len("sqlite:///"):], isolation_level=None, timeout=30)
    con.execute("BEGIN EXCLUSIVE")
    try:
        logger.log_metrics({"a": 1.0}, step=0)
        logger.log_metrics({"a": 2.0}, step=1)
    finally:
        con.execute("ROLLBACK")
        con.close()
    assert len([w for w in recwarn.list if "MLflow store unavailable" in str(w.message)]) == 1
    logger.log_metrics({"a": 3.0}, step=2)
    logger.finalize("success")
    client = mlflow.MlflowClient(store)
    assert sorted((m.step, m.value) for m in client.get_metric_history(rid, "a")) == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert client.get_run(rid).info.status == "FINISHED"


# ---------------------------------------------------------------------------------------------------------------
# 2. a failed resume
# ---------------------------------------------------------------------------------------------------------------
def test_a_failed_resume_leaves_the_finished_run_untouched(store, tmp_path):
    a = run(compose(SMALL + [f"run_dir={tmp_path / 'a'}"]))
    client = mlflow.MlflowClient(store)
    before = client.get_run(a["run_id"])
    assert before.info.status == "FINISHED"
    with pytest.raises(ConfigError, match=r"^ckpt_path: .*d_model|^ckpt_path: .*shape"):
        run(compose(SMALL + ["model.d_model=96", "trainer.max_steps=4", f"ckpt_path={a['last_ckpt_path']}",
                             f"run_dir={tmp_path / 'b'}"]))
    after = client.get_run(a["run_id"])
    assert after.info.status == before.info.status == "FINISHED"
    assert after.info.end_time == before.info.end_time
    assert after.data.tags == before.data.tags
    assert after.data.params == before.data.params
    assert len(client.search_runs([before.info.experiment_id])) == 1  # and no stray new run


# ---------------------------------------------------------------------------------------------------------------
# 3. writes outside the run folder
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../../elsewhere/x", "..", "a/b", "a\\b"])
def test_experiment_name_with_a_path_is_refused(name, store, tmp_path):
    with pytest.raises(ConfigError, match=r"^logger\.experiment_name"):
        run(compose(SMALL + [f"logger.experiment_name={name}"]))
    assert not (tmp_path.parent / "elsewhere").exists() and not any(tmp_path.glob("outputs/*"))


def test_fit_cli_refuses_an_experiment_name_with_a_path(tmp_path):
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    p = subprocess.run([sys.executable, "-m", "falcon_lab.fit", "logger.experiment_name=../../../elsewhere/x",
                        "debug=smoke", "trainer.max_steps=1"], cwd=work, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "logger.experiment_name" in p.stderr + p.stdout
    assert not (work / "elsewhere").exists() and not (tmp_path / "a" / "elsewhere").exists()
    assert not any(tmp_path.rglob("elsewhere"))


def test_evaluate_never_creates_a_store_named_by_the_checkpoint(tiny_ckpt, tmp_path, monkeypatch):
    from falcon_lab.evaluation.runner import compose_eval, evaluate

    evil_db = tmp_path / "elsewhere" / "deep" / "evil.db"
    ck = torch.load(tiny_ckpt, map_location="cpu", weights_only=True)
    ck["falcon_lab"] = {"mlflow_run_id": "0" * 32, "tracking_uri": f"sqlite:///{evil_db}"}
    ck["hyper_parameters"]["cfg"]["logger"]["tracking_uri"] = f"sqlite:///{evil_db}"
    planted = tmp_path / "run" / "checkpoints" / "planted.ckpt"
    planted.parent.mkdir(parents=True)
    torch.save(ck, planted)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    res = evaluate(compose_eval([f"ckpt={planted}", "suites=[ppl]", "device=cpu", f"out_dir={tmp_path / 'ev'}",
                                 "ppl.max_docs=2", "ppl.max_chars=2000", "ppl.extrapolation.enabled=false"]))
    assert not evil_db.exists() and not (tmp_path / "elsewhere").exists()
    assert res["tracking_uri"] == f"sqlite:///{(work / 'mlruns' / 'mlflow.db').resolve()}"
    assert mlflow.MlflowClient(res["tracking_uri"]).get_run(res["run_id"]).info.status == "FINISHED"


def test_evaluate_uses_the_checkpoints_store_when_it_exists(store, tmp_path, monkeypatch):
    """The checkpoint's own store is still followed when it already exists (its training run gets the metrics)."""
    from falcon_lab.evaluation.runner import compose_eval, evaluate

    a = run(compose(SMALL + [f"run_dir={tmp_path / 'a'}"]))
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    res = evaluate(compose_eval([f"ckpt={a['last_ckpt_path']}", "suites=[ppl]", "device=cpu",
                                 f"out_dir={tmp_path / 'ev'}", "ppl.max_docs=2", "ppl.max_chars=2000",
                                 "ppl.extrapolation.enabled=false"]))
    assert res["tracking_uri"] == store and res["run_id"] == a["run_id"]


# ---------------------------------------------------------------------------------------------------------------
# 4. CLI values refused at start
# ---------------------------------------------------------------------------------------------------------------
GEN_BAD = [("max_new_tokens=-5", "max_new_tokens"), ("temperature=-1", "temperature"), ("top_k=-3", "top_k"),
           ("temperature=nan", "temperature"), ("max_new_tokens=abc", "max_new_tokens")]
if not torch.cuda.is_available():
    GEN_BAD.append(("device=cuda", "device"))


@pytest.mark.parametrize("arg,key", GEN_BAD)
def test_generate_refuses_bad_values_at_start(arg, key, tiny_ckpt, tmp_path):
    p = subprocess.run([sys.executable, "-m", "falcon_lab.generate", f"ckpt={tiny_ckpt}", "prompt=x", arg],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"{key}:" in p.stderr or f"{key}=" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("arg", ["top_k=0", "top_k=null", "temperature=0"])
def test_generate_accepts_edge_values(arg, tiny_ckpt, tmp_path):
    p = subprocess.run([sys.executable, "-m", "falcon_lab.generate", f"ckpt={tiny_ckpt}", "prompt=x", arg,
                        "max_new_tokens=3", "device=cpu"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


def test_evaluate_refuses_a_dtype_that_is_not_one(tiny_ckpt, tmp_path):
    from falcon_lab.evaluation.runner import EvalConfigError, check_config, compose_eval

    with pytest.raises(EvalConfigError, match=r"^dtype"):
        check_config(compose_eval([f"ckpt={tiny_ckpt}", "dtype=save"]))
    check_config(compose_eval([f"ckpt={tiny_ckpt}", "dtype=bfloat16"]))  # a real one passes
    p = subprocess.run([sys.executable, "-m", "falcon_lab.evaluate", f"ckpt={tiny_ckpt}", "dtype=save",
                        "device=cpu", f"out_dir={tmp_path / 'ev'}", "mlflow.enabled=false"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "dtype" in p.stderr, p.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# 5. Ctrl-C
# ---------------------------------------------------------------------------------------------------------------
class _CtrlC(L.Callback):
    def __init__(self, at):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            raise KeyboardInterrupt


def test_ctrl_c_saves_last_ckpt_and_marks_the_run_killed(store, tmp_path):
    k = 3
    with pytest.raises(KeyboardInterrupt):
        run(compose(SMALL + ["trainer.max_steps=6", "trainer.val_check_interval=10", f"run_dir={tmp_path / 'r'}"]),
            callbacks=[_CtrlC(k)])
    last = tmp_path / "r" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    ck = torch.load(last, map_location="cpu", weights_only=True)
    assert ck["global_step"] == k
    client = mlflow.MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("falcon_lab").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "KILLED"
    rid = runs[0].info.run_id
    res = run(compose(SMALL + ["trainer.max_steps=6", "trainer.val_check_interval=10", f"ckpt_path={last}",
                               f"run_dir={tmp_path / 'r'}"]))
    assert res["steps"] == 6 and res["run_id"] == rid
    assert client.get_run(rid).info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(rid, "train/loss"))[-1] == 5


class _FailOnRestore(L.Callback):
    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        raise RuntimeError("cannot restore this")


def test_a_resume_failing_during_restore_leaves_the_run_as_it_was(store, tmp_path):
    """The fallback behind the up-front check: a resume that fails while Lightning restores the checkpoint
    (before a single new step) puts the source run's status, end time and tags back."""
    a = run(compose(SMALL + [f"run_dir={tmp_path / 'a'}"]))
    client = mlflow.MlflowClient(store)
    before = client.get_run(a["run_id"])
    with pytest.raises(RuntimeError, match="cannot restore this"):
        run(compose(SMALL + ["trainer.max_steps=4", "optim.lr=0.01", f"ckpt_path={a['last_ckpt_path']}",
                             f"run_dir={tmp_path / 'a'}"]), callbacks=[_FailOnRestore()])
    after = client.get_run(a["run_id"])
    assert (after.info.status, after.info.end_time) == (before.info.status, before.info.end_time)
    assert after.data.tags == before.data.tags
