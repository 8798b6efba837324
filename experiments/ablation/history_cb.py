"""A config-named training callback for the ablation blocks (``+callbacks.history=experiments.ablation.history_cb:make``):
after every validation it appends one JSON line to ``<run_dir>/metrics.jsonl`` (step, wall time, every val/* metric and
the last train/* and throughput metrics). Appending keeps it resume-safe, and it does not depend on MLflow, so the block's
small results survive even where MLflow is not importable (logger=none). Ours; no tested code depends on it."""
from __future__ import annotations

import json
import os
import time

import lightning as L


class MetricsJsonl(L.Callback):
    def __init__(self, path: str):
        self.path = path
        self.t0 = time.time()

    def _write(self, trainer, final: bool = False):
        if trainer.global_rank != 0 or getattr(trainer, "sanity_checking", False):
            return
        row = {"step": int(trainer.global_step), "time": time.time(), "since_start_s": round(time.time() - self.t0, 1)}
        for k, v in trainer.callback_metrics.items():
            try:
                row[k] = float(v)
            except (TypeError, ValueError):
                pass
        if final:
            row["final"] = True
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_validation_end(self, trainer, pl_module):
        self._write(trainer)

    def on_train_end(self, trainer, pl_module):
        self._write(trainer, final=True)


def make(cfg, tokenizer, dirpath):
    return MetricsJsonl(os.path.join(str(dirpath), "metrics.jsonl"))
