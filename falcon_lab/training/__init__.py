"""Training: LightningModule, callbacks, MLflow wiring, `run(cfg)` and `load_checkpoint(path)`."""


def run(cfg, callbacks=None):
    from falcon_lab.training.api import run as _run

    return _run(cfg, callbacks=callbacks)


def load_checkpoint(path, map_location="cpu"):
    from falcon_lab.training.api import load_checkpoint as _load

    return _load(path, map_location=map_location)


def compose(overrides=None, return_hydra_config=False):
    from falcon_lab.training.config import compose as _compose

    return _compose(overrides, return_hydra_config=return_hydra_config)
