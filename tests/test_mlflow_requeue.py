"""Issue 17, point 7 (the rest): a SLURM requeue does not leave the MLflow run FAILED.

SLURM (`#SBATCH --signal=USR1@300 --requeue`, experiments/launch/slurm.sbatch) sends SIGUSR1 before the time limit;
Lightning's SLURM auto-requeue handler saves <run_dir>/hpc_ckpt_<n>.ckpt and runs `scontrol requeue`; SLURM then
sends SIGTERM and starts the job again, which resumes from the checkpoint. Simulated on CPU with the real Lightning
path: the SLURM environment variables make Lightning pick its SLURMEnvironment (auto-requeue on), a fake `scontrol`
on PATH records the requeue, and the run sends itself SIGUSR1, then SIGTERM, as SLURM would. The run stays open
(RUNNING) after the requeue signal, ends KILLED (not FAILED) at the SIGTERM, and the requeued job continues the same
MLflow run (RUNNING again, FINISHED at the end, its metrics continuing the steps). SQLite store in tmp_path."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import mlflow
import pytest

from falcon_lab.training import run
from falcon_lab.training.config import compose

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["debug=smoke", "trainer.val_check_interval=1000", "trainer.limit_val_batches=1", "data.seq_len=16",
         "data.batch_size=2", "checks.shuffle=false", "data.cache_dir=null"]


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """The environment srun gives one task of a one-node job, and a `scontrol` that records what it is asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for k, v in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242",
                 "SLURM_JOB_NAME": "falcon_lab", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                 "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return calls


class SlurmSignals(L.Callback):
    """Sends this process SIGUSR1 after step `usr1_at` and SIGTERM after step `term_at` (as SLURM would), and records
    the MLflow run's status in between."""

    def __init__(self, usr1_at, term_at, uri):
        self.usr1_at, self.term_at, self.uri = usr1_at, term_at, uri
        self.seen: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self.usr1_at and "usr1" not in self.seen:
            # a default action would end the test process: the Lightning SLURM handler must be installed
            assert signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN, None)
            self.seen["usr1"] = step
            os.kill(os.getpid(), signal.SIGUSR1)
        elif step == self.usr1_at + 1 and "after_usr1" not in self.seen:
            r = mlflow.MlflowClient(self.uri).get_run(trainer.logger.run_id)
            self.seen["after_usr1"] = (r.info.status, dict(r.data.tags))
        elif step == self.term_at and "term" not in self.seen:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
            self.seen["term"] = step
            os.kill(os.getpid(), signal.SIGTERM)


def _steps(client, rid, key="train/loss"):
    return sorted(m.step for m in client.get_metric_history(rid, key))


def test_slurm_requeue_keeps_the_run_and_the_requeued_job_continues_it(store, slurm, tmp_path):
    run_dir = tmp_path / "outputs" / "slurm" / "4242"  # what slurm.sbatch pins
    cb = SlurmSignals(usr1_at=3, term_at=5, uri=store)
    with pytest.raises(SystemExit) as e:
        run(compose(SMALL + ["trainer.max_steps=10", f"run_dir={run_dir}"]), callbacks=[cb])
    assert e.value.code == 143  # killed by SIGTERM, not a clean exit 0
    client = mlflow.MlflowClient(store)
    (r,) = client.search_runs([client.get_experiment_by_name("falcon_lab").experiment_id])
    rid = r.info.run_id
    # the requeue signal: Lightning's handler saved its checkpoint and asked SLURM to requeue the job ...
    assert slurm.read_text().split() == ["requeue", "4242"]
    assert [p.name for p in run_dir.glob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_1.ckpt"]
    # ... and the run stayed open, marked as requeued
    status, tags = cb.seen["after_usr1"]
    assert status == "RUNNING", status
    assert tags["slurm.requeues"] == "1" and tags["slurm.requeue_step"] == "3"
    # the SIGTERM that follows: KILLED, not FAILED; a single process also saves last.ckpt at that step
    assert r.info.status == "KILLED"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_file()
    assert _steps(client, rid) == list(range(5))

    # the requeued job: the same command and run dir, no ckpt_path (Lightning would pick the hpc checkpoint itself);
    # it resumes from the newest checkpoint (last.ckpt, step 5) and continues the same MLflow run
    seen = {}

    class Status(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.setdefault("status", client.get_run(rid).info.status)

    res = run(compose(SMALL + ["trainer.max_steps=10", f"run_dir={run_dir}"]), callbacks=[Status()])
    assert res["run_id"] == rid and res["steps"] == 10
    assert seen["status"] == "RUNNING"  # continued: RUNNING again while it trains
    r = client.get_run(rid)
    assert r.info.status == "FINISHED"
    assert _steps(client, rid) == list(range(10))  # steps 0..9 once each: the metrics continue in the same run
    assert "val/loss" in r.data.metrics
    assert len(client.search_runs([r.info.experiment_id])) == 1


def test_a_requeue_resumed_from_the_hpc_checkpoint_continues_the_run(store, slurm, tmp_path):
    """As slurm.sbatch does it, with an explicit ckpt_path: the requeue checkpoint carries the MLflow run id."""
    run_dir = tmp_path / "r"
    cb = SlurmSignals(usr1_at=2, term_at=4, uri=store)
    with pytest.raises(SystemExit):
        run(compose(SMALL + ["trainer.max_steps=6", f"run_dir={run_dir}"]), callbacks=[cb])
    hpc = run_dir / "hpc_ckpt_1.ckpt"
    client = mlflow.MlflowClient(store)
    (r,) = client.search_runs([client.get_experiment_by_name("falcon_lab").experiment_id])
    assert r.info.status == "KILLED"
    res = run(compose(SMALL + ["trainer.max_steps=6", f"run_dir={run_dir}", f"ckpt_path={hpc}"]))
    assert res["run_id"] == r.info.run_id and res["steps"] == 6
    assert client.get_run(r.info.run_id).info.status == "FINISHED"
    assert set(_steps(client, r.info.run_id)) == set(range(6))  # steps 2-3 are trained (and logged) in both jobs


@pytest.mark.slow  # one CLI subprocess (imports torch, Lightning, MLflow): ~15 s idle
def test_a_plain_sigterm_ends_the_cli_run_killed_not_failed(store, tmp_path):
    """scancel / preemption without a requeue signal, through the real CLI in a subprocess: exit status 143, the run
    KILLED, last.ckpt saved at the step it stopped, and a resume from it continues the same run."""
    (tmp_path / "sigterm_at.py").write_text(textwrap.dedent("""
        import os, signal
        import lightning as L

        class TermAt(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)

        def factory(cfg, tokenizer, dirpath):
            return TermAt()
    """))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    args = [sys.executable, "-m", "falcon_lab.fit", *SMALL, "trainer.max_steps=4", f"run_dir={tmp_path / 'r'}"]
    p = subprocess.run(args + ["+callbacks.term=sigterm_at:factory"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 143, p.stderr[-3000:]
    client = mlflow.MlflowClient(store)
    (r,) = client.search_runs([client.get_experiment_by_name("falcon_lab").experiment_id])
    assert r.info.status == "KILLED"
    last = tmp_path / "r" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    res = run(compose(SMALL + ["trainer.max_steps=4", f"run_dir={tmp_path / 'r'}", f"ckpt_path={last}"]))
    assert res["run_id"] == r.info.run_id
    r = client.get_run(r.info.run_id)
    assert r.info.status == "FINISHED" and _steps(client, r.info.run_id) == [0, 1, 2, 3]
