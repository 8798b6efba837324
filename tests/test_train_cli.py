"""End to end through the command line: the default fit learns real structure, Hydra flags, multirun
ablations as separate MLflow runs, user experiment folders, generate, 2-process CPU DDP."""
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import mlflow
import pytest
import torch

from falcon_lab.data.corpus import load_kjv


def _fit(args, cwd, env_extra=None, timeout=420):
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", "falcon_lab.fit", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def _unigram_entropy_nats(texts):
    c = Counter()
    for t in texts:
        c.update(t.encode())
    n = sum(c.values())
    return -sum(v / n * math.log(v / n) for v in c.values())


@pytest.mark.slow
def test_default_fit_learns_real_structure(tmp_path):
    out = _fit([], tmp_path)
    db = tmp_path / "mlruns" / "mlflow.db"
    assert f"mlflow ui --backend-store-uri sqlite:///{db}" in out
    assert "checkpoint:" in out and list((tmp_path / "outputs").rglob("*.ckpt"))
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("falcon_lab").experiment_id])
    m = run.data.metrics
    assert run.info.status == "FINISHED"
    # better than the best context-free (unigram byte) model of the validation text, by a clear margin
    h1 = _unigram_entropy_nats(d["text"] for d in load_kjv("validation"))
    assert m["val/loss"] < h1 - 0.5, (m["val/loss"], h1)
    # a real verse is clearly preferred to the same words shuffled
    assert m["val/shuffle_win_rate"] >= 0.9 and m["val/shuffle_gap"] > 0.1, m
    # and the checkpoint generates
    ck = sorted((tmp_path / "outputs").rglob("last.ckpt"))[0]
    g = subprocess.run([sys.executable, "-m", "falcon_lab.generate", f"ckpt={ck}", "prompt=And God said",
                        "max_new_tokens=20", "temperature=0"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert g.returncode == 0 and g.stdout.startswith("And God said"), g.stderr[-2000:]
    # CUDA-graph decoding asked for on a CPU: refused at start-up, naming the key
    g = subprocess.run([sys.executable, "-m", "falcon_lab.generate", f"ckpt={ck}", "cuda_graph=true",
                        "max_new_tokens=2"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert g.returncode != 0 and "cuda_graph=true needs device=cuda" in g.stderr, g.stderr[-2000:]


def test_hydra_flags_and_user_experiment_folder(tmp_path):
    exp = tmp_path / "mine" / "experiment"
    exp.mkdir(parents=True)
    (exp / "my_exp.yaml").write_text("# @package _global_\ndefaults:\n  - override /mixer: retnet\n"
                                     "logger:\n  experiment_name: from_user_folder\n")
    out = _fit(["--cfg", "job", f"hydra.searchpath=[file://{tmp_path / 'mine'}]", "experiment=my_exp"], tmp_path)
    assert "name: retnet" in out and "experiment_name: from_user_folder" in out
    assert not (tmp_path / "mlruns").exists()  # --cfg computes nothing
    helptext = _fit(["--help"], tmp_path)
    assert "experiment=ablate_window" in helptext and "mixer: attention, deltanet, falcon" in helptext


@pytest.mark.slow
def test_ablation_multirun_gives_one_mlflow_run_per_arm(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    (tmp_path / "mlruns").mkdir()
    _fit(["experiment=ablate_alignment", "debug=smoke", "trainer.max_steps=2", "data.seq_len=32",
          "checks.shuffle=false"], tmp_path, {"MLFLOW_TRACKING_URI": uri})
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("ablate_alignment").experiment_id])
    assert len(runs) == 4 and all(r.info.status == "FINISHED" for r in runs)
    arms = {(r.data.tags["knob.shift"], r.data.tags["knob.read"]) for r in runs}
    assert arms == {(s, r) for s in ("True", "False") for r in ("after", "before")}
    assert len({r.info.run_name for r in runs}) == 4


def test_run_without_validation_says_so(tmp_path):
    """A run with validation switched off reports that no validation ran, not 'val/loss nan' (a run shorter than
    val_check_interval validates at its end: tests/test_researcher_day.py)."""
    out = _fit(["debug=smoke", "trainer.max_steps=2", "trainer.limit_val_batches=0", "data.seq_len=32",
                "checks.shuffle=false", "logger=none"], tmp_path)
    done = next(line for line in out.splitlines() if "[falcon_lab] done:" in line)
    assert "no validation ran (trainer.limit_val_batches=0" in done and "nan" not in done, done


@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path):
    out = _fit(["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
                "trainer.cpu_threads=1", "debug=smoke", "logger=none", "checks.shuffle=false",
                "data.seq_len=32", "data.global_batch_size=16", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert "Starting with 2 processes" in out or "world_size=2" in out.replace(" ", ""), out[-2000:]
    last = Path(tmp_path / "run" / "checkpoints") / "last.ckpt"
    assert last.exists()
    # global batch 16 = 4 per device x 2 processes x 2: each rank took 2 micro-batches per optimizer step
    ck = torch.load(last, map_location="cpu", weights_only=True)
    assert ck["global_step"] == 4
    assert ck["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 8
