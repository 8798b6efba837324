"""Search-space files: every shipped space loads; every kind of mistake names the bad key."""
from __future__ import annotations

import pytest
import yaml

from falcon_lab.sweep import UsageError, parse_args
from falcon_lab.sweeps.space import (SearchSpaceError, available, format_value, load_space,
                                     trial_overrides)

GOOD = {
    "metric": "val/loss",
    "direction": "minimize",
    "n_trials": 4,
    "sampler": {"name": "tpe", "seed": 0},
    "pruner": {"name": "median", "n_warmup_steps": 1},
    "parameters": {
        "optim.lr": {"type": "log", "low": 1e-4, "high": 1e-2},
        "model.mixer.window": {"type": "categorical", "choices": [1, 2, 4]},
        "data.batch_size": {"type": "int", "low": 2, "high": 8, "step": 2},
        "model.mixer.lam_scale": {"type": "float", "low": 0.1, "high": 2.0},
    },
}


def _write(tmp_path, d, name="space.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(p)


def _bad(tmp_path, mutate):
    import copy

    d = copy.deepcopy(GOOD)
    mutate(d)
    with pytest.raises(SearchSpaceError) as ei:
        load_space(_write(tmp_path, d))
    return str(ei.value)


def test_shipped_spaces_load():
    names = available()
    assert {"smoke", "window_lambda", "eta_vs_beta", "alignment"} <= set(names)
    for n in names:
        s = load_space(n)
        assert s.n_trials >= 1 and s.params
        s.make_sampler(), s.make_pruner()


def test_good_space_and_samplers(tmp_path):
    import optuna

    s = load_space(_write(tmp_path, GOOD))
    assert [p.key for p in s.params] == list(GOOD["parameters"])
    study = optuna.create_study(sampler=s.make_sampler(), pruner=s.make_pruner())
    t = study.ask()
    params = s.suggest(t)
    assert 1e-4 <= params["optim.lr"] <= 1e-2 and params["model.mixer.window"] in (1, 2, 4)
    assert params["data.batch_size"] in (2, 4, 6, 8)
    ov = trial_overrides(params)
    assert ov[1] == f"model.mixer.window={params['model.mixer.window']}"


def test_grid_space_defaults_budget_to_grid_size(tmp_path):
    d = {"metric": "val/loss", "direction": "minimize", "sampler": {"name": "grid"},
         "parameters": {"a": {"type": "categorical", "choices": [True, False]},
                        "b": {"type": "categorical", "choices": ["after", "before"]}}}
    s = load_space(_write(tmp_path, d))
    assert s.n_trials == 4 and s.grid_size() == 4


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(metrics="x"), "metrics: unknown key (did you mean 'metric'?)"),
    (lambda d: d.pop("metric"), "metric: missing"),
    (lambda d: d.update(direction="down"), "direction: must be minimize or maximize"),
    (lambda d: d.update(n_trials=0), "n_trials: must be >= 1"),
    (lambda d: d.update(n_trials="many"), "n_trials: must be an integer"),
    (lambda d: d["sampler"].update(name="tpee"), "sampler.name: unknown sampler 'tpee' (did you mean 'tpe'?)"),
    (lambda d: d["sampler"].update(sed=1), "sampler.sed: unknown key (did you mean 'seed'?)"),
    (lambda d: d["pruner"].update(name="medain"), "pruner.name: unknown pruner 'medain'"),
    (lambda d: d["pruner"].update(n_warmup=1), "pruner.n_warmup: unknown key"),
    (lambda d: d["parameters"]["optim.lr"].update(type="loguniform"), "parameters.optim.lr.type: unknown type 'loguniform'"),
    (lambda d: d["parameters"]["optim.lr"].pop("type"), "parameters.optim.lr.type: missing"),
    (lambda d: d["parameters"]["optim.lr"].update(low=0.0), "parameters.optim.lr.low: a log-scaled range needs low > 0"),
    (lambda d: d["parameters"]["optim.lr"].update(high=1e-5), "parameters.optim.lr.high: must be greater than low"),
    (lambda d: d["parameters"]["optim.lr"].update(hi=1), "parameters.optim.lr.hi: unknown key (did you mean 'high'?)"),
    (lambda d: d["parameters"]["model.mixer.window"].update(choices=[]), "parameters.model.mixer.window.choices: must be a non-empty list"),
    (lambda d: d["parameters"]["model.mixer.window"].update(choices=[1, 1]), "parameters.model.mixer.window.choices: duplicate"),
    (lambda d: d["parameters"]["model.mixer.window"].update(choices=[[1, 2]]), "parameters.model.mixer.window.choices[0]: choices must be scalars"),
    (lambda d: d["parameters"]["data.batch_size"].update(low=2.5), "parameters.data.batch_size.low: must be an integer"),
    (lambda d: d["parameters"]["data.batch_size"].update(step=0), "parameters.data.batch_size.step: must be > 0"),
    (lambda d: d["parameters"]["model.mixer.lam_scale"].update(low="a"), "parameters.model.mixer.lam_scale.low: must be a number"),
    (lambda d: d["parameters"].update({"x": 3}), "parameters.x: must be a mapping"),
    (lambda d: d.update(parameters={}), "parameters: must be a non-empty mapping"),
    (lambda d: d.update(overrides="trainer.max_steps=3"), "overrides: must be a list"),
    (lambda d: d.update(overrides=["optim.lr=0.1"]), "overrides[0]: 'optim.lr' is also a searched parameter"),
    (lambda d: d.update(overrides=["trainer"]), "overrides[0]: must be a 'key=value' string"),
])
def test_bad_space_names_the_key(tmp_path, mutate, needle):
    msg = _bad(tmp_path, mutate)
    assert needle in msg, msg
    assert "space.yaml" in msg  # and the file


def test_grid_needs_finite_params(tmp_path):
    d = dict(GOOD, sampler={"name": "grid"})
    with pytest.raises(SearchSpaceError, match=r"parameters\.optim\.lr: a grid sampler needs"):
        load_space(_write(tmp_path, d))


def test_unknown_ablation_name_lists_available():
    with pytest.raises(SearchSpaceError, match=r"ablation=smok: no search space.*did you mean smoke"):
        load_space("smok")


def test_yaml_syntax_error(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("metric: [val/loss\n")
    with pytest.raises(SearchSpaceError, match="cannot parse YAML"):
        load_space(str(p))


def test_format_value_round_trips_through_hydra():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for v in [1, 0.001, 1e-05, True, False, None, "3A", "after", "a b", "1.5", "true", "x=y"]:
        o = parser.parse_override(f"k={format_value(v)}")
        assert o.value() == v, (v, format_value(v), o.value())


def test_cli_argument_errors():
    opts, fit = parse_args(["ablation=smoke", "workers=2", "trainer.max_steps=3"])
    assert opts["workers"] == 2 and fit == ["trainer.max_steps=3"]
    with pytest.raises(UsageError, match="workers=0: must be >= 1"):
        parse_args(["ablation=smoke", "workers=0"])
    with pytest.raises(UsageError, match="report=maybe: expected true or false"):
        parse_args(["ablation=smoke", "report=maybe"])
    with pytest.raises(UsageError, match="launch=gpu"):
        parse_args(["ablation=smoke", "launch=gpu"])
    with pytest.raises(UsageError, match="expected key=value"):
        parse_args(["ablation=smoke", "oops"])
    with pytest.raises(UsageError, match="grace= must be longer than heartbeat="):
        parse_args(["ablation=smoke", "heartbeat=10", "grace=5"])


def test_cli_takes_hydra_overrides():
    """Every argument is a Hydra override: typed options, quoting, +/~ fit overrides passed through."""
    opts, fit = parse_args(["ablation=smoke", "n_trials=4", "report=yes", "study='my study'",
                            "heartbeat=2", "+trainer.cpu_threads=1", "~debug", "optim.lr=1e-3",
                            "storage=postgresql://u:p@db:5432/optuna?sslmode=require"])
    assert opts["n_trials"] == 4 and opts["report"] is True and opts["study"] == "my study"
    assert opts["timing"] == {"heartbeat": 2.0, "grace": 90.0} and opts["workers"] == 1
    assert opts["storage"] == "postgresql://u:p@db:5432/optuna?sslmode=require"  # '=' in a value
    assert fit == ["+trainer.cpu_threads=1", "~debug", "optim.lr=1e-3"]
    for name in ("007", "1e3", "true"):  # names are the text as written, not Hydra-typed values
        assert parse_args(["ablation=smoke", f"study={name}"])[0]["study"] == name
    for arg, needle in [("workers=two", "workers=two: expected an integer"),
                        ("n_trials=1.5", "n_trials=1.5: expected an integer"),
                        ("grace=soon", "grace=soon: expected a number of seconds"),
                        ("workers=null", "workers=null: expected an integer"),
                        ("optim.lr=a=b", "optim.lr=a=b: not a Hydra override")]:
        with pytest.raises(UsageError, match=needle):
            parse_args(["ablation=smoke", arg])
    with pytest.raises(UsageError, match="workers= given twice"):
        parse_args(["ablation=smoke", "workers=2", "workers=3"])


def test_cli_bad_keys_fail_at_start_naming_the_key(tmp_path, monkeypatch, capsys):
    from falcon_lab.sweep import main

    monkeypatch.chdir(tmp_path)
    assert main(["ablation=smoke", "worker=2"]) == 2
    err = capsys.readouterr().err
    assert "'worker'" in err and "did you mean the sweep option workers=" in err
    assert main(["ablation=smoke", "trainer.max_stepz=3"]) == 2
    assert "trainer.max_stepz" in capsys.readouterr().err
    assert main(["ablation=smoke", "report=maybe"]) == 2
    assert "report=maybe: expected true or false" in capsys.readouterr().err
    assert not (tmp_path / "sweeps").exists() and not (tmp_path / "mlruns").exists()


def test_study_rejects_a_changed_space(tmp_path):
    from falcon_lab.sweeps.driver import SweepMismatch, prepare

    s = load_space(_write(tmp_path, GOOD))
    kw = dict(storage=f"sqlite:///{tmp_path}/o.db", runner="sweep_helpers:toy_runner",
              workdir=tmp_path, tracking=False)
    prepare(s, [], **kw)
    prepare(s, [], **kw)  # same space: resumes
    with pytest.raises(SweepMismatch, match="different search space or fit overrides"):
        prepare(s, ["trainer.max_steps=9"], **kw)


def test_report_arms_table_averages_over_seeds(tmp_path):
    import optuna
    from optuna.distributions import CategoricalDistribution

    from falcon_lab.sweeps.report import arms_table, format_table, write_report

    study = optuna.create_study(direction="minimize")
    dist = {"mixer.shift": CategoricalDistribution([True, False]), "seed": CategoricalDistribution([0, 1])}
    for shift, seed, v in [(True, 0, 1.0), (True, 1, 3.0), (False, 0, 0.5), (False, 1, 1.0)]:
        study.add_trial(optuna.trial.create_trial(params={"mixer.shift": shift, "seed": seed},
                                                  distributions=dist, value=v))
    table = arms_table(study).splitlines()
    assert table[0] == "| mixer.shift | n | mean | min | max |"
    assert table[2] == "| False | 2 | 0.75 | 0.5 | 1 |" and table[3] == "| True | 2 | 2 | 1 | 3 |"
    assert "COMPLETE" in format_table(study)
    md = write_report(study, tmp_path / "r").read_text()
    assert "## Arms (over seeds)" in md and (tmp_path / "r" / "param_importances.png").exists()


@pytest.mark.parametrize("override", ["run_dir=/tmp/x", "ckpt_path=a.ckpt", "logger.run_id=abc"])
def test_per_trial_keys_cannot_be_fixed(tmp_path, override):
    from falcon_lab.sweeps.driver import prepare

    s = load_space(_write(tmp_path, GOOD))
    with pytest.raises(ValueError, match=f"{override}: a sweep sets"):
        prepare(s, [override], storage=f"sqlite:///{tmp_path}/o.db",
                runner="sweep_helpers:toy_runner", workdir=tmp_path, tracking=False)
