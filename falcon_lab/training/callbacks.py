"""Callbacks: throughput + MFU at global_step, and an in-memory metric history (for plots and tests)."""
from __future__ import annotations

import time

import lightning as L
import torch

# dense bf16 tensor-core peaks (FLOP/s); Lightning's table does not match "NVIDIA H200"
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def device_peak_flops(override=None):
    if override:
        return float(override)
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, val in PEAK_FLOPS.items():
        if key in name:
            return val
    return None


class ThroughputMFU(L.Callback):
    """Logs train/tokens_per_s and (where the peak is known) train/mfu = 3·F_fwd·tokens/s / peak."""

    def __init__(self, tokens_per_step: int, flops_per_token_fwd: float, peak_flops=None, log_every: int = 1):
        self.tokens_per_step = tokens_per_step
        self.flops = 3.0 * flops_per_token_fwd  # forward + backward (2x)
        self.peak = peak_flops
        self.log_every = max(1, log_every)
        self._t = None
        self._step0 = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._t is None:
            self._t, self._step0 = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self._step0 or step % self.log_every:
            return
        now = time.perf_counter()
        dt = now - self._t
        steps = step - self._step0
        self._t, self._step0 = now, step
        if dt <= 0:
            return
        tps = self.tokens_per_step * steps / dt
        pl_module.log("train/tokens_per_s", tps, on_step=True, on_epoch=False, rank_zero_only=True)
        if self.peak:
            pl_module.log("train/mfu", tps * self.flops / (self.peak * trainer.world_size),
                          on_step=True, on_epoch=False, rank_zero_only=True)

    def on_validation_start(self, trainer, pl_module):
        self._val_t = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if self._t is not None:  # do not count validation time as training time
            self._t += time.perf_counter() - self._val_t


class MetricHistory(L.Callback):
    """Keeps every logged scalar per global_step: history[name] = [(step, value), ...]."""

    def __init__(self):
        self.history: dict[str, list[tuple[int, float]]] = {}

    def _grab(self, trainer, prefix, step):
        for k, v in trainer.callback_metrics.items():
            if k.startswith(prefix):
                lst = self.history.setdefault(k, [])
                if not lst or lst[-1][0] != step:
                    lst.append((step, float(v)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Lightning logs training_step values at the global_step of the batch (before its update)
        self._grab(trainer, "train/", trainer.global_step - 1)

    def on_validation_end(self, trainer, pl_module):
        self._grab(trainer, "val/", trainer.global_step)


def plot_curves(history: dict, path: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("train/loss", "val/loss") if history.get(k)]
    if not keys:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for k in keys:
        s, v = zip(*history[k])
        ax[0].plot(s, v, label=k, marker="o" if k.startswith("val") else None, ms=3)
    ax[0].set_xlabel("step"); ax[0].set_ylabel("loss (nats/token)"); ax[0].legend(); ax[0].grid(alpha=.3)
    for k in ("train/lr", "train/tokens_per_s"):
        if history.get(k):
            s, v = zip(*history[k])
            (ax[1] if k == "train/lr" else ax[1].twinx()).plot(s, v, label=k, color="C2" if k == "train/lr" else "C3")
    ax[1].set_xlabel("step"); ax[1].set_title("lr (green), tokens/s (red)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class ValidateAtEnd(L.Callback):
    """Validation always runs at the end of training: on the last step (max_steps) the trainer is asked to stop,
    which makes Lightning validate there (and ModelCheckpoint keep the best) even when max_steps is not a
    multiple of val_check_interval (`trainer.max_steps=20` alone would otherwise leave no val/loss)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.max_steps and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True


class TextProgress(L.Callback):
    """The progress bar's stand-in off a terminal (a log file, CI, `| tee`): one log line about every tenth of
    the run (`step 40/300 train/loss 2.41 4,100 tok/s`) and one per validation, instead of tens of kilobytes
    of bar redraws."""

    def __init__(self, every: int | None = None):
        self.every = every

    def _log(self, msg):
        import logging

        logging.getLogger("falcon_lab.training").info(msg)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank != 0:
            return
        step, total = trainer.global_step, trainer.max_steps
        every = self.every or max(1, (total if total and total > 0 else 1000) // 10)
        if step == 0 or step % every or getattr(self, "_last", None) == step:
            return
        self._last = step
        m = trainer.callback_metrics
        parts = [f"step {step}/{total}"]
        for k, fmt in (("train/loss", "{:.4f}"), ("train/tokens_per_s", "{:,.0f} tok/s")):
            if k in m:
                v = fmt.format(float(m[k]))
                parts.append(v if k.endswith("per_s") else f"{k} {v}")
        self._log(" ".join(parts))

    def on_validation_end(self, trainer, pl_module):
        if trainer.global_rank == 0 and not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self._log(f"step {trainer.global_step}: val/loss {float(trainer.callback_metrics['val/loss']):.4f}")


def progress_bar_wanted(enabled) -> bool:
    """trainer.enable_progress_bar=true shows the bar on a terminal only; off a terminal TextProgress logs
    instead (FALCON_PROGRESS_BAR=1 forces the bar, e.g. in a notebook)."""
    import os
    import sys

    if not enabled:
        return False
    if os.environ.get("FALCON_PROGRESS_BAR", "").strip().lower() in ("1", "true", "yes"):
        return True
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # closed or replaced stream
        return False


def load_callback_factory(target, key: str):
    """`callbacks.<key>: "module:function"` in a training config: the function (cfg, tokenizer, dirpath) ->
    a Lightning callback or None. The config names it, so training imports no tier above it (the addition
    accuracy callback lives in falcon_lab.evaluation). A target that does not load is a ConfigError naming
    the key."""
    from falcon_lab.training.validate import load_callable

    return load_callable(target, f"callbacks.{key}")
