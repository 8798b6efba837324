"""Issue 17, points 5 and 7: the MLflow experiment opens on the runs table with a shared default view and few,
relevant params (the full config as the `config.yaml` artifact); the global batch is a config value and the
gradient accumulation is derived from it and the world size (or the run refuses with the arithmetic)."""
import json
import re
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from falcon_lab.training import run
from falcon_lab.training.config import compose
from falcon_lab.training.mlflow import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    SHARED_VIEW_PREFIX,
    VIEW_KEY,
    VIEW_METRICS,
    VIEW_PARAMS,
    prepare_experiment,
    view_url,
)
from falcon_lab.training.validate import ConfigError, derive_accumulation

ROOT = Path(__file__).resolve().parents[1]
TINY = ["debug=smoke", "data.seq_len=16", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
        "checks.shuffle=false"]


def test_a_run_opens_on_the_runs_table_with_relevant_params_and_derived_accumulation(store, tmp_path):
    # 2 per device x 1 rank: a global batch of 4 makes 2 micro-batches per optimizer step
    res = run(compose(TINY + ["trainer.max_steps=2", "data.batch_size=2", "data.global_batch_size=4",
                              "logger.experiment_name=kjv_view", f"run_dir={tmp_path / 'r'}"]))
    client = mlflow.MlflowClient(store)
    exp = client.get_experiment(res["experiment_id"])
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    view = json.loads(exp.tags[SHARED_VIEW_PREFIX + VIEW_KEY])
    r = client.get_run(res["run_id"])
    p = r.data.params
    # every column of the shared view names something the run has, in the UI's column-id form
    for col in view["selectedColumns"]:
        kind, key = re.fullmatch(r"(params|metrics|tags)\.`(.+)`", col).groups()
        have = {"params": p, "metrics": r.data.metrics, "tags": r.data.tags}[kind]
        assert key in have or (kind, key) == ("tags", "arm"), col  # `arm`: multirun jobs only
    assert view["orderByKey"] == "metrics.`val/loss_best`" and view["orderByAsc"] is True
    # the sort key is the running minimum of val/loss, one value per validation (the last val/loss need not be best)
    vals = [m.value for m in sorted(client.get_metric_history(res["run_id"], "val/loss"), key=lambda m: m.timestamp)]
    best = [m.value for m in sorted(client.get_metric_history(res["run_id"], "val/loss_best"), key=lambda m: m.timestamp)]
    assert len(vals) >= 1 and best == [min(vals[:i + 1]) for i in range(len(vals))]
    assert set(VIEW_METRICS) >= {"val/loss", "train/loss"} and "seed" in VIEW_PARAMS
    # relevant params only: none of another source's keys, loader plumbing or kernel switches
    assert 25 < len(p) < 60, sorted(p)
    assert not [k for k in p if k.startswith(("data.hf_", "data.path", "hydra", "logger.", "checks.", "metrics.",
                                              "checkpoint.", "run_dir", "ckpt_path"))], sorted(p)
    assert not {"data.num_workers", "data.cache_dir", "model.compile", "model.activation_checkpointing",
                "mixer.backend", "optim.fused", "trainer.log_every_n_steps"} & set(p)
    assert "mixer.beta_max" not in p and p["mixer.eta_max"] == "1.0"  # gate=ctx_eta (preset .3): beta_max unused
    assert (p["seed"], p["model.d_model"], p["mixer.qk_norm"], p["optim.lr"]) == ("1234", "64", "rmsnorm", "0.003")
    assert (p["data.source"], p["data.seq_len"], p["data.batch_size"]) == ("kjv", "16", "2")
    assert (p["trainer.max_steps"], p["trainer.precision"]) == ("2", "32-true")
    # the global batch, and the accumulation derived from it, as the run used them
    assert (p["data.global_batch_size"], p["trainer.accumulate_grad_batches"], p["trainer.world_size"]) == \
        ("4", "2", "1")
    ck = torch.load(res["last_ckpt_path"], map_location="cpu", weights_only=True)
    assert ck["global_step"] == 2
    assert ck["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 4  # 2 steps x 2
    # the full resolved config is the run's config.yaml artifact (with what the params leave out)
    art = Path(mlflow.artifacts.download_artifacts(run_id=res["run_id"], artifact_path="config.yaml",
                                                   tracking_uri=store, dst_path=str(tmp_path / "dl")))
    full = yaml.safe_load(art.read_text())
    assert full["data"]["hf_name"] == "HuggingFaceFW/fineweb-edu" and full["data"]["global_batch_size"] == 4
    assert "compile" in full["model"] and "num_workers" in full["data"]


def test_a_kind_or_view_chosen_in_the_ui_is_kept(store):
    client = mlflow.MlflowClient(store)
    eid = client.create_experiment("chosen")
    client.set_experiment_tag(eid, EXPERIMENT_KIND_TAG, "genai_development")
    client.set_experiment_tag(eid, SHARED_VIEW_PREFIX + VIEW_KEY, '{"selectedColumns": []}')
    prepare_experiment(client, eid)
    tags = client.get_experiment(eid).tags
    assert tags[EXPERIMENT_KIND_TAG] == "genai_development"
    assert tags[SHARED_VIEW_PREFIX + VIEW_KEY] == '{"selectedColumns": []}'
    # MLflow >= 3.17 opens on the GenAI workflow unless the address asks for "Model training"
    assert view_url(store, eid).endswith(
        f"/#/experiments/{eid}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}")
    assert view_url(store, eid, workflow=None).endswith(f"/#/experiments/{eid}/runs?viewStateShareKey={VIEW_KEY}")
    assert view_url("http://host:5001/", eid).startswith("http://host:5001/#/experiments/")
    from falcon_lab.sweeps.tracking import ensure_experiment  # a sweep's experiment: the same kind

    sid = ensure_experiment(store, "a_sweep")
    assert client.get_experiment(sid).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def test_the_installed_mlflow_ui_reads_these_tags():
    """The tag names are the UI's, not MLflow's Python API: read them from the installed UI bundle, so that an
    MLflow upgrade that renames them fails here rather than silently opening the GenAI overview again."""
    js = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    text = "\n".join(f.read_text(errors="ignore") for f in js.glob("main.*.js"))
    assert f'"{EXPERIMENT_KIND_TAG}"' in text
    assert f'CUSTOM_MODEL_DEVELOPMENT="{EXPERIMENT_KIND}"' in text
    assert f'"{SHARED_VIEW_PREFIX}"' in text and '"viewStateShareKey"' in text
    assert '"selectedColumns","columnOrder"' in text  # the view state's keys
    assert 'ATTRIBUTES:"attributes",PARAMS:"params",METRICS:"metrics",TAGS:"tags"' in text
    assert 'e+".`"+t+"`"' in text  # column ids: <kind>.`<key>`


def test_accumulation_is_derived_from_the_global_batch_and_world_size():
    assert derive_accumulation(480, 24, 4) == 5  # paper_small_*: one 4-GPU node
    assert derive_accumulation(480, 12, 8, num_nodes=2) == 5  # 2 nodes x 4 GPUs, half the rows per device
    assert derive_accumulation(480, 24, 4, configured=5) == 5
    assert derive_accumulation(None, 24, 4, configured=None) == 1  # no global batch: as configured
    assert derive_accumulation(None, 24, 4, configured=3) == 3
    with pytest.raises(ConfigError) as e:  # 2 nodes x 4 GPUs at 24 per device: 480 / 192 = 2.5
        derive_accumulation(480, 24, 8, num_nodes=2)
    msg = str(e.value)
    assert msg.startswith("data.global_batch_size=480: not a multiple of")
    assert "24 x 8 (4 devices x 2 nodes) = 192" in msg and "480 / 192 = 2.5" in msg and "384 or 576" in msg
    with pytest.raises(ConfigError, match=r"trainer.accumulate_grad_batches=3 contradicts .*= 24 per device x 4 "
                                          r"\(4 devices\) x 5 accumulation"):
        derive_accumulation(480, 24, 4, configured=3)
    c = compose(["experiment=paper_small_falcon_1a_3"])
    assert (c.data.global_batch_size, c.data.batch_size, c.trainer.devices) == (480, 24, 4)


def test_a_global_batch_that_does_not_divide_refuses_before_any_mlflow_run(store, tmp_path):
    with pytest.raises(ConfigError, match=r"data.global_batch_size=6: .* 4 x 1 \(1 devices\) = 4 .*6 / 4 = 1.5"):
        run(compose(TINY + ["data.batch_size=4", "data.global_batch_size=6", "logger.experiment_name=refused",
                            f"run_dir={tmp_path / 'r'}"]))
    client = mlflow.MlflowClient(store)
    exp = client.get_experiment_by_name("refused")
    assert exp is None or not client.search_runs([exp.experiment_id])
    with pytest.raises(ConfigError, match="data.global_batch_size: must be a positive integer"):
        run(compose(TINY + ["data.global_batch_size=0", f"run_dir={tmp_path / 's'}"]))


def test_launch_scripts_share_one_run_dir_requeue_and_use_the_project_environment(tmp_path):
    import subprocess

    sb = (ROOT / "experiments/launch/slurm.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=USR1@\d+$", sb, re.M) and "#SBATCH --requeue" in sb
    assert "hpc_ckpt_" in sb and ".venv/bin/python" in sb
    assert not re.search(r"srun python\b", sb) and 'srun "$PY" -m falcon_lab.fit' in sb
    tr = (ROOT / "experiments/launch/torchrun.sh").read_text()
    assert ".venv/bin/python" in tr and not re.search(r"^exec torchrun", tr, re.M)
    # two nodes without a shared run id are refused (each would stamp its own clock)
    fake = tmp_path / "py"
    fake.write_text("#!/bin/sh\necho \"$@\"\n")
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "FALCON_PYTHON": str(fake), "GPUS_PER_NODE": "4"}
    p = subprocess.run(["bash", str(ROOT / "experiments/launch/torchrun.sh"), "x=1"], env={**env, "NNODES": "2"},
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "set RUN_ID" in p.stderr, p.stderr
    p = subprocess.run(["bash", str(ROOT / "experiments/launch/torchrun.sh"), "x=1"],
                       env={**env, "NNODES": "2", "NODE_RANK": "1", "RUN_ID": "job42"},
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "--nnodes 2 --node_rank 1 --nproc_per_node 4" in p.stdout
    assert "trainer.num_nodes=2 hydra.run.dir=outputs/torchrun/job42 x=1" in p.stdout


def test_running_best_ignores_nan_and_keeps_the_minimum():
    from falcon_lab.training.module import running_best

    best, seen = None, []
    for v in (float("nan"), 3.0, 2.5, 2.7, float("nan"), 2.4, 9.0):
        best = running_best(best, v)
        seen.append(best)
    assert seen == [None, 3.0, 2.5, 2.5, 2.5, 2.4, 2.4]
