"""A toy objective for the sweep-driver tests that need no language model.

``toy_runner`` has the runner signature of :mod:`falcon_lab.sweeps.runner`: it reads
``toy.lr`` / ``toy.steps`` / ``toy.fail`` / ``toy.sleep`` from its overrides, fits a 1-parameter
quadratic with a real Lightning Trainer (validation every step, so the pruning callback sees every
step) and logs to a real MLflow store as a child run of the sweep's parent run.
"""
from __future__ import annotations

import time

import lightning.pytorch as pl
import torch


class _Quadratic(pl.LightningModule):
    def __init__(self, lr: float, sleep: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([3.0]))
        self.lr = lr
        self.sleep = sleep

    def training_step(self, batch, _):
        if self.sleep:
            time.sleep(self.sleep)
        loss = ((self.w - 1.0) ** 2).sum() + 0 * batch.sum()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, _):
        self.log("val/loss", ((self.w - 1.0) ** 2).sum() + 0 * batch.sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _parse(overrides: list[str]) -> dict:
    out = {"toy.lr": 0.1, "toy.steps": 4, "toy.fail": False, "toy.sleep": 0.0}
    for o in overrides:
        k, v = o.split("=", 1)
        k = k.lstrip("+")
        if k in out:
            out[k] = v.lower() == "true" if k == "toy.fail" else type(out[k])(float(v))
    return out


def toy_runner(overrides: list[str], callbacks: list, tracking: dict) -> dict:
    from lightning.pytorch.loggers import MLFlowLogger

    a = _parse(overrides)
    if a["toy.fail"]:
        raise RuntimeError("toy.fail=true: this trial fails on purpose")
    tags = dict(tracking.get("tags") or {})
    if tracking.get("parent_run_id"):
        tags["mlflow.parentRunId"] = tracking["parent_run_id"]
    logger = None
    if tracking.get("tracking_uri"):  # None: the sweep runs without MLflow
        logger = MLFlowLogger(experiment_name=tracking["experiment_name"],
                              run_name=tracking.get("run_name"),
                              tracking_uri=tracking["tracking_uri"], tags=tags)
    data = torch.utils.data.DataLoader(torch.zeros(1, 1), batch_size=1)
    trainer = pl.Trainer(max_steps=int(a["toy.steps"]), val_check_interval=1, max_epochs=-1,
                         limit_val_batches=1, logger=logger or False, callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         log_every_n_steps=1, accelerator="cpu", devices=1)
    model = _Quadratic(a["toy.lr"], a["toy.sleep"])
    trainer.fit(model, data, data)
    return {"val_loss": float(trainer.callback_metrics["val/loss"]),
            "run_id": logger.run_id if logger else None,
            "ckpt_path": None, "run_dir": None}
