"""Issue 16: a typo in a config group, or a bad value, fails at start-up naming the key."""
import os
import subprocess
import sys

import pytest
from hydra.errors import HydraException

from falcon_lab.training.config import compose
from falcon_lab.training.validate import ConfigError, validate_config


@pytest.mark.parametrize("override,group,available", [
    ("experiment=does_not_exist", "experiment", "ablate_window"),
    ("debug=smok", "debug", "smoke"),
])
def test_unknown_group_option_fails_naming_the_key_and_choices(override, group, available):
    with pytest.raises(HydraException) as e:
        compose([override])
    msg = str(e.value)
    assert f"{group}/{override.split('=')[1]}" in msg and f"Available options in '{group}'" in msg
    assert available in msg


def test_no_experiment_and_known_options_still_compose(tmp_path):
    cfg = compose([])
    validate_config(cfg)
    assert cfg.mixer.name == "falcon" and cfg.logger.experiment_name
    assert compose(["debug=smoke"]).trainer.max_steps == 4
    assert compose(["experiment=ablate_window"]).logger.experiment_name == "ablate_window"
    mine = tmp_path / "mine" / "experiment"
    mine.mkdir(parents=True)
    (mine / "my_exp.yaml").write_text("# @package _global_\nlogger:\n  experiment_name: my_exp\n")
    assert compose([f"hydra.searchpath=[file://{tmp_path / 'mine'}]", "experiment=my_exp"]) \
        .logger.experiment_name == "my_exp"


@pytest.mark.parametrize("override,group", [("experiment=does_not_exist", "experiment"), ("debug=smok", "debug")])
def test_fit_cli_with_a_typo_exits_nonzero_before_training(override, group, tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    p = subprocess.run([sys.executable, "-m", "falcon_lab.fit", override, "logger=none", "trainer.max_steps=1",
                        "trainer.val_check_interval=1", "trainer.limit_val_batches=1", "data.seq_len=16",
                        "data.batch_size=2", "checks.shuffle=false", f"run_dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0, p.stdout[-2000:]
    assert f"Available options in '{group}'" in p.stderr + p.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,key", [
    (["mixer.lam=const", "mixer.lam_value=-0.1"], "mixer.lam_value"),
    (["mixer.lam_value=-0.1"], "mixer.lam_value"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay"),
    (["optim.warmup_steps=-5"], "optim.warmup_steps"),
    (["optim.grad_clip=-1"], "optim.grad_clip"),
    (["optim.grad_clip=abc"], "optim.grad_clip"),
    (["optim.lr=nan"], "optim.lr"),
    (["optim.lr=inf"], "optim.lr"),
    (["mixer.eps_gamma=0"], "mixer.eps_gamma"),
    (["mixer.eps_gamma=1.5"], "mixer.eps_gamma"),
    (["checkpoint.save_top_k=abc"], "checkpoint.save_top_k"),
    (["checkpoint.save_top_k=1.5"], "checkpoint.save_top_k"),
    (["checkpoint.save_top_k=-2"], "checkpoint.save_top_k"),
])
def test_bad_values_are_refused_at_start_naming_the_key(overrides, key):
    cfg = compose(overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(cfg)


@pytest.mark.parametrize("overrides", [
    ["checkpoint.save_top_k=-1"], ["checkpoint.save_top_k=0"], ["optim.grad_clip=0"], ["optim.weight_decay=0"],
    ["optim.warmup_steps=0"], ["mixer.eps_gamma=1"], ["mixer.eps_gamma=1e-6"],
    ["mixer.lam=const", "mixer.lam_value=0"], ["optim=paper"],
])
def test_edge_values_that_are_valid_are_accepted(overrides):
    validate_config(compose(overrides))


def test_bad_value_refused_by_run_before_anything_is_built(tmp_path, monkeypatch):
    from falcon_lab.training import run

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"checkpoint\.save_top_k"):
        run(compose(["checkpoint.save_top_k=abc", "logger=none", f"run_dir={tmp_path / 'r'}"]))
    assert not (tmp_path / "r").exists()
