"""Step-based Optuna pruning for Lightning.

``optuna_integration.PyTorchLightningPruningCallback`` reports at ``current_epoch``; with
step-based validation (``val_check_interval``) every report after the first one is dropped. This
callback reports the monitored metric at ``trainer.global_step`` instead. Under DDP only rank 0
talks to the Optuna storage; its prune decision is broadcast so that every rank stops together.
"""
from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl


class StepPruningCallback(pl.Callback):
    """Report ``metric`` to an Optuna trial after every validation and stop a pruned run.

    Args:
        trial: an ``optuna.trial.Trial`` (rank 0), or ``None`` on ranks that do not report.
        metric: the name the LightningModule logs, e.g. ``"val/loss"``.
        direction: ``"minimize"`` or ``"maximize"`` (which value counts as the best one).

    After ``trainer.fit`` returns, ``pruned`` says whether the trial was stopped by the pruner,
    ``pruned_at_step`` at which global step, and ``history`` holds ``(step, value)`` pairs.
    The caller (the sweep driver) then tells Optuna the trial was PRUNED.
    """

    def __init__(self, trial: Any, metric: str = "val/loss", direction: str = "minimize") -> None:
        super().__init__()
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"direction must be minimize or maximize, got {direction!r}")
        self.trial = trial
        self.metric = metric
        self.direction = direction
        self.history: list[tuple[int, float]] = []
        self.pruned = False
        self.pruned_at_step: int | None = None
        self.available_metrics: list[str] = []

    # best value seen so far (None before the first validation)
    @property
    def best(self) -> float | None:
        vals = [v for _, v in self.history if not math.isnan(v)]
        if not vals:
            return None
        return min(vals) if self.direction == "minimize" else max(vals)

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.sanity_checking:
            return
        self.available_metrics = sorted(trainer.callback_metrics)
        value = trainer.callback_metrics.get(self.metric)
        step = int(trainer.global_step)
        decision = False
        if value is not None and trainer.is_global_zero:
            value = float(value)
            if not self.history or self.history[-1][0] != step:  # one report per step
                self.history.append((step, value))
                if self.trial is not None:
                    self.trial.report(value, step)
                    decision = bool(self.trial.should_prune())
        # every rank must take the same decision: rank 0's, broadcast
        decision = bool(trainer.strategy.broadcast(decision, src=0))
        if decision:
            self.pruned = True
            self.pruned_at_step = step
            trainer.should_stop = True
