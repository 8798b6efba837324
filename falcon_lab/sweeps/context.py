"""Preparing a sweep, once, in the main process: :func:`prepare` checks the search space against the
composed fit config, creates or loads the Optuna study (``load_if_exists``) and the MLflow parent run,
and returns the :class:`SweepContext` every worker runs from. Nothing here races: it happens before
any worker starts."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from . import storage as st
from .runner import DEFAULT_RUNNER, load_runner
from .space import SearchSpace, check_keys, load_space, trial_overrides


@dataclasses.dataclass
class SweepContext:
    """Everything a worker needs; written as JSON for worker processes."""

    space_path: str
    n_trials: int
    study_name: str
    storage: str
    fit_overrides: list[str]
    runner: str = DEFAULT_RUNNER
    launch: str = "inprocess"          # inprocess | subprocess (separate job per trial)
    tracking_uri: str | None = None
    experiment_name: str | None = None
    parent_run_id: str | None = None
    sweep_dir: str = "sweeps"
    heartbeat: float = 15.0
    grace: float = 90.0
    poll: float = 2.0
    max_retry: int = 2
    devices: int = 1                   # devices one trial uses (GPUs given to each worker)

    def space(self) -> SearchSpace:
        return load_space(self.space_path, n_trials=self.n_trials)

    def dump(self, path: Path) -> Path:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SweepContext":
        return cls(**json.loads(Path(path).read_text()))


class SweepMismatch(ValueError):
    pass


def _space_signature(space: SearchSpace, fit_overrides: list[str]) -> str:
    d = space.as_dict()
    for k in ("n_trials", "max_failed", "description"):
        d.pop(k, None)
    d["fit_overrides"] = list(fit_overrides)
    return json.dumps(d, sort_keys=True, default=str)


def prepare(space: SearchSpace, fit_overrides: list[str], *, study_name: str | None = None,
            storage: str | None = None, runner: str | None = None, launch: str = "auto",
            workdir: str | Path | None = None, tracking: bool = True, check: bool = True,
            command: str | None = None, **timing: Any) -> SweepContext:
    """Create (or load) the study and the MLflow parent run; validate the space against the config."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    workdir = Path(workdir or os.getcwd()).resolve()
    study_name = study_name or space.name
    for o in list(space.overrides) + list(fit_overrides):
        key = o.split("=", 1)[0].lstrip("+~")
        if key in ("run_dir", "ckpt_path", "logger.run_id", "logger.parent_run_id"):
            raise ValueError(
                f"{o}: a sweep sets {key} per trial (trial folders under sweeps/<study>/trials/, "
                f"retries resume from their checkpoints, child runs under the study's parent run); "
                f"remove this override")
    run_fn = load_runner(runner)
    composer = getattr(run_fn, "compose", None)
    cfg = None
    if composer is not None and check:
        try:
            cfg = composer(list(space.overrides) + list(fit_overrides))
        except Exception as e:  # Hydra's composition errors name the override
            if isinstance(e, ValueError):
                raise
            msg = str(e).strip().replace("\n", " ")
            raise ValueError(f"cannot compose the fit config with the space's overrides "
                             f"{list(space.overrides)} and {list(fit_overrides)}: {msg}") from e
        check_keys(space, cfg)
        validator = getattr(run_fn, "validate", None)
        if validator is not None:
            check_corners(space, list(space.overrides) + list(fit_overrides), composer, validator)
    # MLflow settings: the fit config's logger section wins, then MLFLOW_TRACKING_URI, then ./mlruns
    from .tracking import default_tracking_uri, open_parent

    lg = cfg.get("logger") if cfg is not None else None
    tracking_uri = (os.environ.get("MLFLOW_TRACKING_URI")
                    or (lg.get("tracking_uri") if lg is not None else None)
                    or default_tracking_uri(workdir))
    if lg is not None and lg.get("name", "mlflow") in (None, "none", False):
        tracking = False  # logger=none: the trials log nothing, so no parent run either
    experiment = (lg.get("experiment_name") if lg is not None else None) or "falcon_lab"
    if launch == "auto":
        launch = "subprocess" if devices_per_trial(cfg) > 1 else "inprocess"
    if launch not in ("inprocess", "subprocess"):
        raise ValueError(f"launch={launch}: one of auto, inprocess, subprocess")

    url = st.resolve_storage(storage, workdir)
    stor = st.open_storage(url)
    study = optuna.create_study(study_name=study_name, storage=stor, direction=space.direction,
                                load_if_exists=True)
    if study.direction.name.lower() != space.direction:
        raise SweepMismatch(
            f"study {study_name!r} in {st.describe(url)} was created to {study.direction.name.lower()}; "
            f"the space says {space.direction}. Use study=NEW_NAME.")
    sig = _space_signature(space, fit_overrides)
    old = study.user_attrs.get("falcon_lab:signature")
    if old is not None and old != sig:
        raise SweepMismatch(
            f"study {study_name!r} in {st.describe(url)} exists with a different search space or "
            f"fit overrides; resuming it would mix two experiments. Use study=NEW_NAME, or the "
            f"same space and overrides as before (stored: {old})")
    if old is None:
        study.set_user_attr("falcon_lab:signature", sig)
        study.set_user_attr("falcon_lab:space_path", space.path)
        study.set_user_attr("falcon_lab:metric", space.metric)
        study.set_user_attr("falcon_lab:description", space.description)
        study.set_user_attr("falcon_lab:fit_overrides", list(fit_overrides))
        if command:
            study.set_user_attr("falcon_lab:command", command)
    study.set_user_attr("falcon_lab:n_trials", space.n_trials)
    parent = None
    if tracking:
        parent = open_parent(tracking_uri, experiment, study_name,
                             study.user_attrs.get("falcon_lab:mlflow_parent_run_id"),
                             {"ablation": space.name, "metric": space.metric,
                              "direction": space.direction, "n_trials": space.n_trials,
                              "sampler": space.sampler, "pruner": space.pruner,
                              "storage": st.describe(url),
                              "overrides": list(space.overrides) + list(fit_overrides),
                              "parameters": {p.key: p.type for p in space.params}},
                             lock_path=workdir / "sweeps" / study_name / ".mlflow-parent.lock")
        study.set_user_attr("falcon_lab:mlflow_parent_run_id", parent)
        study.set_user_attr("falcon_lab:tracking_uri", tracking_uri)
    sweep_dir = workdir / "sweeps" / study_name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    ctx = SweepContext(space_path=space.path, n_trials=space.n_trials, study_name=study_name,
                       storage=url, fit_overrides=list(fit_overrides),
                       runner=runner or DEFAULT_RUNNER, launch=launch,
                       tracking_uri=tracking_uri if tracking else None,
                       experiment_name=experiment, parent_run_id=parent, sweep_dir=str(sweep_dir),
                       devices=devices_per_trial(cfg), **timing)
    return ctx


def check_corners(space: SearchSpace, base: list[str], composer, validator) -> None:
    """Fail before any training if a corner of the space gives an invalid fit config (e.g. a
    window for a variant without one): the message names the parameters and the bad key."""
    from .space import SearchSpaceError, corner_params

    for combo in corner_params(space):
        try:
            validator(composer(base + trial_overrides(combo)))
        except Exception as e:
            shown = " ".join(trial_overrides(combo))
            raise SearchSpaceError(
                f"{space.path}: the trial config with {shown} is invalid: {e}") from e


def devices_per_trial(cfg) -> int:
    if cfg is None:
        return 1
    tr = cfg.get("trainer") or {}
    dev, nodes = tr.get("devices", 1), tr.get("num_nodes", 1) or 1
    if isinstance(dev, int):
        n = dev
    elif isinstance(dev, (list, tuple)) or (hasattr(dev, "__len__") and not isinstance(dev, str)):
        n = len(dev)
    elif isinstance(dev, str) and dev.isdigit():
        n = int(dev)
    elif dev in ("auto", -1, "-1"):
        n = visible_gpus() or 1
    else:
        n = 1
    return max(1, n) * max(1, int(nodes))


def visible_gpus() -> int:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0
