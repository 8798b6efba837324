"""Issue 17, points 3, 4, 8, 9: effective knobs and labels, arms named by what differs, compare grouped by arm
(mean ± std over seeds, filters, paired difference), validation at the end of short runs, quiet output."""
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from omegaconf import OmegaConf

from falcon_lab.compare import compare
from falcon_lab.compare import main as compare_main
from falcon_lab.training import compose
from falcon_lab.training.arms import arm_of_job, effective_mixer, falcon_label
from falcon_lab.training.mlflow import run_tags

TINY = ["debug=smoke", "data.seq_len=32", "checks.shuffle=false", "model.n_layers=1"]


# ---- provenance ------------------------------------------------------------------------------------------
def test_effective_knobs_and_label_follow_the_preset():
    cfg = compose(["experiment=ablate_eta", "mixer.gate=ctx_eta"])
    t = run_tags(cfg)
    # the ctx_eta arm of a `.1` config is effectively `.2`; knobs are the ones the model uses, not None
    assert (t["knob.qk_norm"], t["knob.gate"], t["knob.lam"], t["knob.window"]) == ("l2", "ctx_eta", "ctx", "None")
    assert (t["preset"], t["preset.configured"], t["label"]) == (".2", ".1", "Falcon-1A.2")
    assert run_tags(compose(["experiment=ablate_eta", "mixer.gate=ctx_beta"]))["label"] == "Falcon-1A.1"
    assert run_tags(compose(["mixer.variant=3A"]))["knob.window"] == "4"
    off = {"name": "falcon", "variant": "1A", "preset": ".3", "gate": "ctx_beta"}
    assert falcon_label(off) == "Falcon-1A.3+gate=ctx_beta"
    assert effective_mixer({"name": "attention"}) == {"name": "attention"}
    from falcon_lab.training.api import _flat_params

    p = _flat_params(cfg)
    assert (p["mixer.qk_norm"], p["mixer.lam"], p["mixer.preset"]) == ("l2", "ctx", ".1")


def test_arm_names_are_what_differs_between_jobs():
    hc = OmegaConf.create({"sweeper": {"params": {"mixer.gate": "ctx_beta,ctx_eta"}},
                           "overrides": {"task": ["experiment=ablate_eta", "debug=smoke", "mixer.gate=ctx_eta",
                                                  "seed=2"]}})
    assert arm_of_job(hc, ["experiment=ablate_eta", "debug=smoke", "seed=1,2"]) == ("gate=ctx_eta",
                                                                                    "gate=ctx_eta,seed=2")
    assert arm_of_job(hc, ["experiment=ablate_eta", "seed=2"]) == ("gate=ctx_eta", "gate=ctx_eta")
    none = OmegaConf.create({"sweeper": {"params": None}, "overrides": {"task": ["seed=2"]}})
    assert arm_of_job(none, ["seed=2"]) == ("", "")


# ---- compare ---------------------------------------------------------------------------------------------
def _fake_run(client, exp_id, arm, seed, loss, steps=300, status="FINISHED", tags=None):
    r = client.create_run(exp_id, run_name=f"{arm},seed={seed}" if arm else None,
                          tags={"mixer": "falcon", "label": "Falcon-1A.2", "steps": str(steps),
                                **({"arm": arm} if arm else {}), **(tags or {})})
    rid = r.info.run_id
    client.log_param(rid, "seed", str(seed))
    for i, v in enumerate((loss + 1.0, loss)):
        client.log_metric(rid, "val/loss", v, step=i)
    client.set_terminated(rid, status)
    return rid


def test_compare_groups_arms_over_seeds_with_filters_and_paired_difference(store, tmp_path, capsys):
    client = mlflow.MlflowClient(store)
    exp = client.create_experiment("arms")
    for seed, (b, e) in enumerate([(3.0, 2.9), (3.2, 3.0), (3.1, 3.05)], start=1):
        _fake_run(client, exp, "gate=ctx_beta", seed, b)
        _fake_run(client, exp, "gate=ctx_eta", seed, e)
    _fake_run(client, exp, "gate=ctx_eta", 9, 9.0, steps=20)  # a stale smoke run
    _fake_run(client, exp, "gate=ctx_eta", 8, 1.0, status="FAILED")
    res = compare("arms", tracking_uri=store, out_dir=str(tmp_path / "c"), min_steps=100, status="FINISHED",
                  plots=False)
    assert len(res["rows"]) == 6 and res["filtered"] == 2 and res["ref"] == "gate=ctx_beta"
    by = {a["arm"]: a for a in res["arms"]}
    m, sd, n = by["gate=ctx_beta"]["stats"]["val loss (best)"]
    assert n == 3 and m == pytest.approx(3.1) and sd == pytest.approx(0.1)
    dm, dsd, dn = by["gate=ctx_eta"]["diff"]  # paired by seed: -0.1, -0.2, -0.05
    assert dn == 3 and dm == pytest.approx(-0.35 / 3) and dsd == pytest.approx(0.0763763, rel=1e-4)
    md = Path(res["markdown"]).read_text()
    assert "| gate=ctx_eta | Falcon-1A.2 | 3 | 1,2,3 | 2.9833 ± 0.0764" in md
    assert "-0.1167 ± 0.0764 (n=3)" in md and "2 of 8 runs left out by the filters" in md
    # tag filter and a chosen reference arm, through the command line
    capsys.readouterr()
    compare_main(["experiment=arms", f"tracking_uri={store}", f"out_dir={tmp_path / 'd'}", "ref=gate=ctx_eta",
                  "tag=arm=gate=ctx_eta", "min_steps=100"])
    out = capsys.readouterr().out
    assert "Δ val loss (best) vs gate=ctx_eta" in out and "(reference)" in out and "ctx_beta |" not in out
    with pytest.raises(ValueError, match="ref='nope': no such arm"):
        compare("arms", tracking_uri=store, out_dir=str(tmp_path / "e"), ref="nope", plots=False)
    with pytest.raises(SystemExit, match="tag=KEY=VALUE"):
        compare_main(["experiment=arms", "tag=novalue"])


def test_compare_untagged_runs_group_by_label_and_differing_settings(store, tmp_path):
    client = mlflow.MlflowClient(store)
    exp = client.create_experiment("loose")
    ids = []
    for seed, lr in ((1, "0.001"), (2, "0.001"), (1, "0.003")):
        rid = _fake_run(client, exp, None, seed, 3.0 + float(lr))
        client.log_param(rid, "optim.lr", lr)
        ids.append(rid)
    # a run logged before tags carried effective knobs: relabelled from its knob.* tags
    old = client.create_run(exp, tags={"mixer": "falcon", "variant": "Falcon-1A", "preset": ".1",
                                       "knob.gate": "ctx_eta", "knob.qk_norm": "None", "knob.lam": "None"})
    client.set_terminated(old.info.run_id)
    res = compare("loose", tracking_uri=store, out_dir=str(tmp_path / "c"), plots=False)
    arms = {a["arm"]: a["n"] for a in res["arms"]}
    assert arms["Falcon-1A.2 lr=0.001"] == 2 and arms["Falcon-1A.2 lr=0.003"] == 1
    assert next(r for r in res["rows"] if r["run_id"] == old.info.run_id)["mixer"] == "Falcon-1A.2"
    # group=false: the per-run table only (existing invocations keep their output)
    flat = compare("loose", tracking_uri=store, out_dir=str(tmp_path / "d"), group=False, plots=False)
    assert flat["arms"] == [] and "## Arms" not in Path(flat["markdown"]).read_text()


# ---- a multirun, end to end ------------------------------------------------------------------------------
def test_multirun_names_arms_validates_short_runs_prints_the_table_and_stays_quiet(store, tmp_path):
    """trainer.max_steps=2 with val_check_interval=100: each run still validates at its end (val/loss, a best
    checkpoint, the `best val/loss` line); arms named by what differs; the arms table at the end; no bar."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=store)
    p = subprocess.run([sys.executable, "-m", "falcon_lab.fit", "-m", *TINY, "trainer.max_steps=2",
                        "trainer.enable_progress_bar=true", "trainer.val_check_interval=100",
                        "logger.experiment_name=day", "mixer.gate=ctx_beta,ctx_eta", "mixer.preset=.1", "seed=1,2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    # folders and MLflow run names by arm
    sweep = next((tmp_path / "multirun" / "day").iterdir())
    assert {d.name for d in sweep.iterdir() if d.is_dir()} >= {"gate=ctx_beta,seed=1", "gate=ctx_eta,seed=2"}
    assert (sweep / "gate=ctx_eta,seed=1" / "checkpoints" / "best-step000002.ckpt").is_file()
    client = mlflow.MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("day").experiment_id])
    assert {r.info.run_name for r in runs} == {f"gate={g},seed={s}" for g in ("ctx_beta", "ctx_eta") for s in (1, 2)}
    assert {(r.data.tags["arm"], r.data.tags["label"]) for r in runs} == {("gate=ctx_beta", "Falcon-1A.1"),
                                                                          ("gate=ctx_eta", "Falcon-1A.2")}
    # every run validated at its (short) end; the multirun ends with the arms table
    assert all("val/loss" in r.data.metrics and r.data.tags["steps"] == "2" for r in runs)
    assert {r.data.params["mixer.qk_norm"] for r in runs} == {"l2"}  # effective params, not null
    assert out.count("best val/loss") == 4
    assert "runs in 2 arms" in out and "| gate=ctx_eta | Falcon-1A.2 | 2 | 1,2 |" in out
    assert "python -m falcon_lab.compare experiment=day" in out and "best val/loss" in out
    # off a terminal: no progress-bar redraws
    assert "\r" not in out and "it/s]" not in out and len(out) < 60_000


# ---- output hygiene --------------------------------------------------------------------------------------
@pytest.mark.parametrize("app", ["generate", "export"])
def test_generate_and_export_write_no_log_file_in_the_current_folder(app):
    from hydra import compose as hcompose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="falcon_lab.configs", version_base="1.3"):
        cfg = hcompose(config_name=app, overrides=["ckpt=x"] + (["out=y"] if app == "export" else []),
                       return_hydra_config=True)
    GlobalHydra.instance().clear()
    handlers = OmegaConf.to_container(cfg.hydra.job_logging, resolve=False).get("handlers", {})
    assert handlers and not any("FileHandler" in str(h.get("class")) for h in handlers.values())


def test_sweep_report_goes_beside_the_sweep_and_a_finished_rerun_says_so(tmp_path, monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    import optuna

    from falcon_lab.sweep import _say_if_finished
    from falcon_lab.sweep import main as sweep_main

    monkeypatch.chdir(tmp_path)
    db = f"sqlite:///{tmp_path / 'sweeps' / 'optuna.db'}"
    (tmp_path / "sweeps").mkdir()
    study = optuna.create_study(study_name="smoke", storage=db)
    for i in range(3):
        study.enqueue_trial({})
        study.tell(study.ask(), 1.0 + i)
    ctx = SimpleNamespace(study_name="smoke", storage=db, n_trials=4)
    with caplog.at_level(logging.INFO, logger="falcon_lab"):
        assert not _say_if_finished(ctx)  # budget not reached: it trains, silently
        ctx.n_trials = 3
        assert _say_if_finished(ctx)  # sweep.main calls it before its (empty) worker loop
    assert "nothing to train" in caplog.text and "study=smoke_2" in caplog.text
    assert sweep_main(["report=true", "study=smoke", f"storage={db}"]) == 0
    assert (tmp_path / "sweeps" / "smoke" / "report" / "README.md").is_file()
    assert not (tmp_path / "ablations").exists()
