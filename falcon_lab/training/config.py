"""Compose the packaged Hydra config from Python (for the sweep and evaluation drivers)."""
from __future__ import annotations

from hydra import compose as _compose
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from falcon_lab.training.arms import register_resolvers as register_arm_resolvers
from falcon_lab.training.validate import register_resolvers

register_resolvers()  # ${falcon_dirname:...} in train.yaml's hydra run/sweep dirs
register_arm_resolvers()  # ${falcon_arm:} in train.yaml's hydra sweep subdir

CONFIG_MODULE = "falcon_lab.configs"
CONFIG_NAME = "train"


def compose(overrides: list[str] | None = None, return_hydra_config: bool = False) -> DictConfig:
    """The `python -m falcon_lab.fit` config with `overrides`, without running Hydra's app.

    Uses the Compose API (initialize_config_module); ${hydra:...} interpolations are not used in
    the packaged configs, so the result resolves outside a Hydra run."""
    gh = GlobalHydra.instance()
    if gh.is_initialized():
        gh.clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return _compose(config_name=CONFIG_NAME, overrides=list(overrides or []),
                        return_hydra_config=return_hydra_config)
