"""How one trial trains: a *runner* is ``runner(overrides, callbacks, tracking) -> dict``.

- ``overrides``: the fit overrides of the trial (the space's fixed ones, the command line's, then
  the sampled parameters), composed by the training config's Compose API;
- ``callbacks``: Lightning callbacks to add (the step-based pruning callback);
- ``tracking``: MLflow settings of the child run (``experiment_name``, ``run_name``, ``tags``,
  ``parent_run_id``, ``tracking_uri``), written into the ``logger.*`` keys of the fit config,
  plus ``trial_dir`` (the trial's run folder) and, for a retry of a killed trial whose last
  checkpoint exists, ``resume_ckpt``.

It returns ``falcon_lab.training.run``'s dict (``val_loss``, ``run_id``, ``ckpt_path``,
``run_dir``). The default runner is :func:`training_runner`; ``runner=module:function`` on the
sweep command line plugs in another one (it must be importable in worker processes).
"""
from __future__ import annotations

from typing import Any, Callable

Runner = Callable[[list, list, dict], dict]
DEFAULT_RUNNER = "falcon_lab.sweeps.runner:training_runner"


def compose_fit(overrides: list[str]):
    """The fit config with these overrides (Hydra Compose API, owned by falcon_lab.training)."""
    from falcon_lab.training.config import compose

    return compose(list(overrides))


LOGGER_KEYS = ("experiment_name", "run_name", "tags", "parent_run_id", "tracking_uri")


def apply_tracking(cfg, tracking: dict[str, Any]):
    """Write the child-run settings into ``logger.*``; ``trial_dir`` becomes ``run_dir`` and
    ``resume_ckpt`` becomes ``ckpt_path`` unless the user set those explicitly."""
    from omegaconf import open_dict

    with open_dict(cfg):
        if tracking.get("trial_dir") and not cfg.get("run_dir"):
            cfg.run_dir = tracking["trial_dir"]
        if tracking.get("resume_ckpt") and not cfg.get("ckpt_path"):
            cfg.ckpt_path = tracking["resume_ckpt"]
        for k, v in tracking.items():
            if v is None or k not in LOGGER_KEYS:
                continue
            if k == "tags":
                old = cfg.logger.get("tags") or {}
                cfg.logger.tags = {**dict(old), **{str(a): str(b) for a, b in v.items()}}
            else:
                cfg.logger[k] = v
    return cfg


def _training_run():
    import inspect

    import falcon_lab.training as training

    fn = training.run
    if inspect.ismodule(fn):  # a submodule named `run` can shadow the package's run() function
        fn = fn.run
    return fn


def training_runner(overrides: list[str], callbacks: list, tracking: dict[str, Any]) -> dict:
    """Compose the fit config with the trial's overrides, point its logger at the child run, train."""
    cfg = apply_tracking(compose_fit(overrides), tracking)
    return _training_run()(cfg, callbacks=callbacks)


def validate_fit(cfg) -> None:
    """The training's start-up validation (one clear error naming the key), without training."""
    from falcon_lab.training.validate import validate_config

    validate_config(cfg)


training_runner.compose = compose_fit    # the driver checks searched keys against this config
training_runner.validate = validate_fit  # ... and the corner configs of the space with this


def load_runner(spec: str | None) -> Runner:
    """`runner=module:function` (default DEFAULT_RUNNER) -> the function; a ConfigError (a ValueError) naming
    `runner` when it does not load."""
    from falcon_lab.training.validate import load_callable

    return load_callable(spec or DEFAULT_RUNNER, "runner")
