"""Shared helpers for the training tests: experiment discovery, arm expansion, small-run overrides."""
from __future__ import annotations

from importlib import resources

from hydra.core.override_parser.overrides_parser import OverridesParser

from falcon_lab.training.config import compose

# what makes any experiment a few-second CPU run
SMALL = ["model=tiny", "data=kjv", "trainer=cpu", "optim=adamw", "debug=smoke", "trainer.devices=1",
         "trainer.accumulate_grad_batches=1", "data.global_batch_size=null", "trainer.max_steps=2", "data.seq_len=32",
         "data.batch_size=4"]


def experiments() -> list[str]:
    root = resources.files("falcon_lab.configs").joinpath("experiment")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def arms(experiment: str) -> list[list[str]]:
    """The multirun arms of an experiment as override lists ([[]] for single-run experiments)."""
    cfg = compose([f"experiment={experiment}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.get("params") or {}
    if not params:
        return [[]]
    parser = OverridesParser.create()
    out = [[]]
    for ov in parser.parse_overrides([f"{k}={v}" for k, v in params.items()]):
        vals = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
        out = [prev + [f"{ov.key_or_group}={v}"] for prev in out for v in vals]
    return out


def small_overrides(experiment: str) -> list[str]:
    ov = [f"experiment={experiment}"] + SMALL
    cfg = compose([f"experiment={experiment}"])
    if cfg.data.name != "lm":  # task experiments keep their own data module, just smaller
        ov = [o for o in ov if not o.startswith(("data=", "data.seq_len"))]
    if cfg.get("addition_eval"):
        ov += ["addition_eval.n_examples=2", "addition_eval.ood=false", "addition_eval.every_n_steps=1000"]
    return ov
